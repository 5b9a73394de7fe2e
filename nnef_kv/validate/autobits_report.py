"""The report of ``convert --auto-bits``: the budget and target, every uniform setting measured, the
sensitivity of each layer's keys and values, the candidates verified, and the choice against the best
uniform setting (text for the terminal, report.md, report.json)."""
from __future__ import annotations

import json
from typing import Any

from .autobits import AutoBitsResult, Candidate
from .autobits_units import span
from .compare import finite
from .report import _json_safe

__all__ = ["render_text", "render_markdown", "render_json"]


def _kl(c: Candidate) -> str:
    lo, hi = c.kl_ci
    return f"{c.kl:.4g} [{lo:.4g}, {hi:.4g}]" if finite(lo) and finite(hi) and (lo, hi) != (c.kl, c.kl) \
        else f"{c.kl:.4g}"


def _row(c: Candidate, target: float) -> list[str]:
    f = c.figures()
    kl = c.kl
    return [c.label, f"{int(c.kv_bytes):,}" if finite(c.kv_bytes) else "-",
            f"{f['bits_per_value']:.2f}" if finite(f.get("bits_per_value")) else "-",
            _kl(c) if finite(kl) else ("failed: " + (c.row.reason if c.row else "?"))[:90],
            f"{f['kl_p99']:.4g}" if finite(f.get("kl_p99")) else "-",
            f"{100 * f['top1_agreement']:.1f}" if finite(f.get("top1_agreement")) else "-",
            "yes" if finite(kl) and c.within(target) else ("undecided" if finite(kl) and c.undecided(target)
                                                         else "no")]


HEAD = ["setting", "KV bytes", "bits/value", "KL mean [95%]", "KL p99", "same top %", "within target (upper bound)"]


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(x) for x in col) for col in zip(HEAD, *rows)]
    lines = ["  ".join(x.ljust(w) for x, w in zip(HEAD, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(x.ljust(w) for x, w in zip(r, widths)) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def _summary(res: AutoBitsResult) -> list[str]:
    st = res.starts
    gs = res.unit_groups
    grouped = "" if len(gs) == res.layers else (f" in {len(gs)} groups of consecutive layers sharing a setting "
                                                f"({', '.join(span(r) for r in gs)}; --layer-groups)")
    out = [f"scheme {res.scheme}, {res.layers} layers{grouped}, ladder {', '.join(map(str, res.ladder))}"
           f"{' (keys and values apart)' if res.split else ''}; context {res.context}, {res.eval_tokens} predictions "
           f"a window: the search on {len(st.get('search', []))} window, more tokens on "
           f"{len(st.get('decide', []))}, held out {len(st.get('held-out', []))} (first predicted tokens: search "
           f"{st.get('search')}, chosen on {st.get('decide')}, held out {st.get('held-out')})",
           "within a target = the 95% interval's upper bound is (block bootstrap, nnef_kv/validate/statistics.py)",
           f"budget --max-kl {res.budget:g}; target {res.target:.4g}"
           + (" (the best uniform setting's KL: --match-uniform-kl)" if res.target < res.budget else " (the budget)")]
    bu, ch = res.best_uniform, res.chosen
    out.append(f"best uniform setting within the budget: {bu.label}, {int(bu.kv_bytes):,} bytes, KL {_kl(bu)}"
               if bu is not None else "no uniform setting is within the budget")
    bp = res.best_pair
    if bp is not None:
        out.append(f"best uniform KEY/VALUE pair within the budget: {bp.label}, {int(bp.kv_bytes):,} bytes, "
                   f"KL {bp.kl:.4g}")
    if ch is not None:
        out.append(f"chosen: --layer-bits {res.layer_bits}: {int(ch.kv_bytes):,} bytes, KL {_kl(ch)}"
                   + (f" ({100 * res.saving():.1f}% fewer KV bytes than the best uniform setting" if res.saving()
                      is not None else "")
                   + (f", {100 * res.saving(bp):.1f}% than the best uniform pair)" if bp is not None and
                      res.saving() is not None else (")" if res.saving() is not None else "")))
    for what, c in (("the choice", ch or res.rejected), ("the best uniform setting", bu)):
        h = res.held(c)
        if h is not None:
            out.append(f"held-out text, {what} ({c.label.replace(' (more tokens)', '')}): {int(h.kv_bytes):,} bytes, "
                       f"KL {_kl(h)}: {'within' if h.within(res.target) else 'NOT within'} the target {res.target:.4g}")
    if res.rejected is not None:
        out.append(f"REJECTED: --layer-bits {_bits(res.rejected)} met the target on the text chosen on but not on the "
                   f"held-out text: not returned")
    out += [f"note: {n}" for n in res.notes]
    return out


def _bits(c: Candidate) -> str:
    from ..converters.layer_bits import format_spec

    return format_spec(c.setting)


def render_text(res: AutoBitsResult) -> str:
    rows = [_row(c, res.target) for c in res.uniform]
    lines = ["auto-bits: " + _summary(res)[0]] + ["  " + s for s in _summary(res)[1:]]
    lines += ["uniform settings:", _table(rows), "candidates verified:",
              _table([_row(c, res.target) for c in res.rounds])]
    if res.decided:
        lines += ["measured again on more tokens:", _table([_row(c, res.target) for c in res.decided])]
    if res.held_out:
        lines += ["held-out text:", _table([_row(c, res.target) for c in res.held_out])]
    return "\n".join(lines)


def _md_table(rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)] + ["| " + " | ".join(r) + " |" for r in rows]


def render_markdown(res: AutoBitsResult) -> str:
    lines = ["# nnef-kv convert --auto-bits", ""] + [f"- {s}" for s in _summary(res)]
    lines += [f"- ran on: {res.runner}", "- method: nnef_kv/validate/autobits.py (uniform baselines, per-unit "
              "sensitivity from the most precise setting, exact multiple-choice knapsack on the predicted KL, "
              "candidates verified by measuring)", "", "## Uniform settings", ""]
    lines += _md_table([_row(c, res.target) for c in res.uniform])
    lines += ["", "## Sensitivity: dKL when one unit alone is lowered from the most precise setting", ""]
    levels = res.ladder[:-1]
    lines += ["| layers | " + " | ".join(f"{lv}" for lv in levels) + " |", "|---|" + "---|" * len(levels)]
    for g, rng in enumerate(res.unit_groups):
        for side in ((0, 1) if res.split else (0,)):
            what = ("keys" if side == 0 else "values") if res.split else "keys+values"
            vals = [res.sensitivity.get((g, side, lv)) for lv in levels]
            lines.append(f"| {span(rng)} {what} | " + " | ".join(f"{v:.3g}" if finite(v) else "-" for v in vals)
                         + " |")
    lines += ["", "## Candidates verified", ""] + _md_table([_row(c, res.target) for c in res.rounds])
    if res.decided:
        lines += ["", "## Measured again on more tokens", ""] + _md_table([_row(c, res.target) for c in res.decided])
    if res.held_out:
        lines += ["", "## Held-out text", ""] + _md_table([_row(c, res.target) for c in res.held_out])
    if res.chosen is not None:
        lines += ["", f"Chosen: `--layer-bits {res.layer_bits}`", ""]
    return "\n".join(lines) + "\n"


def _cand(c: Candidate | None) -> Any:
    if c is None:
        return None
    f = c.figures()
    return {"label": c.label, "layer_bits": [list(x) for x in c.setting], "status": c.row.status if c.row else None,
            "reason": c.row.reason if c.row else "", "kv_bytes": f.get("kv_bytes"), "kl_mean": f.get("kl_mean"),
            "kl_mean_ci95": f.get("kl_mean_ci95"), "predictions": f.get("predictions"),
            "ppl_ratio_ci95": f.get("ppl_ratio_ci95"), "top1_agreement_ci95": f.get("top1_agreement_ci95"),
            "kl_p99": f.get("kl_p99"), "ppl_ratio": f.get("ppl_ratio"), "top1_agreement": f.get("top1_agreement"),
            "bits_per_value": f.get("bits_per_value")}


def render_json(res: AutoBitsResult) -> str:
    d = {"format": "nnef-kv-auto-bits", "version": 2, "scheme": res.scheme, "options": res.options,
         "budget": res.budget, "target": res.target, "context": res.context, "eval_tokens": res.eval_tokens,
         "layers": res.layers, "split": res.split, "ladder": list(res.ladder), "layer_bits": res.layer_bits,
         "saving_vs_best_uniform": res.saving(), "best_uniform": _cand(res.best_uniform), "chosen": _cand(res.chosen),
         "best_uniform_pair": _cand(res.best_pair), "saving_vs_best_uniform_pair": res.saving(res.best_pair),
         "uniform": [_cand(c) for c in res.uniform], "candidates": [_cand(c) for c in res.rounds],
         "groups": [[r.start, r.stop - 1] for r in res.unit_groups],
         "sensitivity": [{"layer": res.unit_groups[k[0]].start, "layers": [res.unit_groups[k[0]].start,
                                                                           res.unit_groups[k[0]].stop - 1],
                          "side": ("keys", "values")[k[1]] if res.split else "keys+values",
                          "level": k[2], "dkl": v} for k, v in res.sensitivity.items()],
         "decided": [_cand(c) for c in res.decided], "held_out": [_cand(c) for c in res.held_out],
         "held_out_chosen": _cand(res.held(res.chosen or res.rejected)),
         "held_out_best_uniform": _cand(res.held(res.best_uniform)), "rejected": _cand(res.rejected),
         "window_starts": res.starts, "notes": res.notes, "runner": res.runner}
    return json.dumps(_json_safe(d), indent=1)
