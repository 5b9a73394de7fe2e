"""Writing a validation report: ``report.json``, ``report.md`` and ``report.png`` (matplotlib, Agg),
each written atomically.

``report.json`` holds one object per measured context under ``contexts`` (keys listed in the README:
``context``, ``eval_tokens``, ``kl_mean``, ``kl_p99``, ``top1_agreement``, ``ppl_reference``, ``ppl``,
``quantized_tokens``, ``full_precision_tokens``, ``kv_bytes``, ``kv_bytes_f32`` ... and ``per_token``)
and a top-level ``verdict`` (``measured`` / ``pass`` / ``fail``)."""
from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import atomic_write
from .runner import ValidationReport

__all__ = ["write_report", "render_markdown", "render_plot", "render_json", "REPORT_FILES", "format_summary"]

REPORT_FILES = ("report.json", "report.md", "report.png")
KL_FLOOR = 1e-12  # KL values below this are drawn at it (log axis), with their own marker


def png_bytes(fig: Any, dpi: int) -> bytes:
    """A matplotlib figure laid out (``tight_layout``), encoded as PNG and closed."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    return buf.getvalue()


def write_files(out: Path, payloads: dict[str, bytes]) -> list[Path]:
    """Each payload written to ``out / name`` atomically (rendered before: nothing half-written); the paths."""
    paths = []
    for name, data in payloads.items():
        with atomic_write(out / name) as f:
            f.write(data)
        paths.append(out / name)
    return paths


def _json_safe(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else str(x)  # JSON has no NaN/inf: write them as strings
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if hasattr(x, "item") and callable(x.item):
        return _json_safe(x.item())
    return x


def render_json(rep: ValidationReport) -> str:
    return json.dumps(_json_safe(rep.to_dict()), indent=1)


def _g(x: Any, spec: str = ".4g") -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        return format(x, spec)
    return str(x)


def _pm(v: Any, e: Any, spec: str = ".4g", scale: float = 1.0, unit: str = "") -> str:
    if v is None:
        return "-"
    s = format(v * scale, spec) + unit
    if e is not None and isinstance(e, float) and math.isfinite(e):
        s += f" ± {format(e * scale, spec)}{unit}"
    return s


def _ci(v: Any, ci: Any, spec: str = ".4g", scale: float = 1.0, unit: str = "") -> str:
    """``value [low, high]`` (the 95% interval), llama.cpp's ``±`` style replaced by the interval itself."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    s = format(v * scale, spec) + unit
    if ci and all(isinstance(x, (int, float)) and math.isfinite(x) for x in ci):
        s += f"  [{format(ci[0] * scale, spec)}, {format(ci[1] * scale, spec)}]{unit}"
    return s


def _pct(x: Any, p: str) -> str:
    return _g(x) if x is not None else f"- (too few predictions for {p})"


def format_summary(s: dict[str, Any]) -> list[tuple[str, str]]:
    """A context's figures as (label, value) rows, llama.cpp ``perplexity --kl-divergence`` style, each mean
    with its 95% interval (block bootstrap over windows and blocks of tokens: :mod:`.statistics`)."""
    k, n = s.get("windows", 1), s["eval_tokens"]
    where = (f"tokens {s['context']}..{s['context'] + n - 1}" if k == 1 and s.get("window_starts") == [s["context"]]
             else f"text tokens from {', '.join(map(str, s.get('window_starts', [])))}")
    rows = [
        (
            "positions",
            f"{s['context']} prefilled"
            + (f" in chunks of {s['chunk']}" if s["chunk"] else " in one call")
            + f", then {n} predictions, in {k} window(s) ({where})",
        ),
        ("predictions behind the figures", f"{s['predictions']}"
         + (f" ({s['nonfinite_predictions']} left out: NaN or Inf logits)" if s.get("nonfinite_predictions") else "")
         + (f"; 95% intervals: block bootstrap over {s['bootstrap_blocks']} blocks" if s.get("bootstrap_blocks")
            else "")),
    ]
    if "kl_mean" in s:
        rows += [
            ("Mean PPL(Q)", _ci(s["ppl"], s.get("ppl_ci95"))),
            ("Mean PPL(base)", _ci(s["ppl_reference"], s.get("ppl_reference_ci95"))),
            ("Mean ln(PPL(Q)/PPL(base))", _ci(s["ln_ppl_ratio"], s.get("ln_ppl_ratio_ci95"))),
            ("Mean PPL(Q)/PPL(base)", _ci(s["ppl_ratio"], s.get("ppl_ratio_ci95"))),
            ("Mean KLD", _ci(s["kl_mean"], s.get("kl_mean_ci95"))),
            ("Maximum KLD", _g(s["kl_max"])),
            ("99.9% KLD", _pct(s["kl_p99_9"], "p99.9")),
            ("99.0% KLD", _pct(s["kl_p99"], "p99")),
            ("90.0% KLD", _pct(s["kl_p90"], "p90")),
            ("Median KLD", _pct(s["kl_median"], "the median")),
            ("Minimum KLD", _g(s["kl_min"])),
            ("RMS Δp", _g(s["rms_dp"] * 100, ".3f") + " %"),
            ("Same top p", _ci(s["top1_agreement"], s.get("top1_agreement_ci95"), ".3f", 100, " %")),
        ]
        att = s.get("attention_deviation")
        rows.append(("attention deviation (mean / worst)", "-" if not att else
                     f"{_ci(att['mean'], att.get('mean_ci95'))} / {att['max']:.4g}"))
    else:
        rows.append(("Mean PPL(Q)", _ci(s["ppl"], s.get("ppl_ci95")) + " (no reference: no KL)"))
    rows += [
        (
            "tokens held quantized / full precision (per KV op)",
            f"{s['quantized_tokens']} / {s['full_precision_tokens']}",
        ),
        (
            "evaluated tokens reading quantized entries",
            f"{s['tokens_reading_quantized']} of {s['predictions'] + s.get('nonfinite_predictions', 0)}"
            + (
                ""
                if s["first_quantized_read"] is None
                else f" (from position {s['context'] + s['first_quantized_read']})"
            ),
        ),
        (
            "KV bytes held / used / as f32",
            f"{s['kv_bytes']:,} / {s['kv_bytes_used']:,} / {s['kv_bytes_f32']:,}"
            + ("" if s["kv_ratio"] is None else f" (held / f32 {s['kv_ratio']:.3f})"),
        ),
    ]
    return rows


def render_markdown(rep: ValidationReport) -> str:
    lines = [f"# nnef-kv validation: `{rep.archive}`", "", f"**Verdict: {rep.verdict.upper()}**", ""]
    if rep.reference:
        lines.append(f"- reference (f32): `{rep.reference}`")
    lines.append(f"- tokens: {rep.tokens}")
    lines.append(f"- KV scheme: {rep.scheme}")
    lines += [f"- note: {n}" for n in rep.notes]
    lines += ["", "| check | result | detail |", "|---|---|---|"]
    for c in rep.checks:
        lines.append(f"| {c.name} | {'ok' if c.ok else 'FAILED'} | {c.detail} |")
    for res in rep.contexts:
        s = res.summary()
        lines += ["", f"## context {res.context}", "", "| measure | value |", "|---|---|"]
        lines += [f"| {a} | {b} |" for a, b in format_summary(s)]
        att = s.get("attention_deviation")
        if att:
            lines += [
                "",
                f"Attention deviation: {res.attention_note}.",
                "",
                "| layer | mean | worst |",
                "|---|---|---|",
            ]
            lines += [
                f"| {i} | {m:.4g} | {w:.4g} |"
                for i, (m, w) in enumerate(zip(att["per_layer_mean"], att["per_layer_max"]))
            ]
        lines += ["", "| KV op | node | tokens | quantized | full precision | bytes held | bytes used | as f32 |",
                  "|---|---|---|---|---|---|---|---|"]
        for c in res.archive.census:
            lines.append(
                f"| {c['op']} | `{c['node']}` | {c['tokens']} | {c['quantized_tokens']} | {c['full_precision_tokens']} "
                f"| {c['bytes']:,} | {c['bytes_used']:,} | {c['bytes_f32']:,} |"
            )
    p = rep.parity
    lines += ["", "## tract parity", ""]
    if p is None:
        lines.append("not run")
    elif p.status in ("skipped", "error"):
        lines.append(f"{p.status}: {p.reason}")
    else:
        lines.append(f"{p.status}: max |logits - tract| = {p.max_abs:.3g} ({p.max_rel:.3g} of the largest logit) over "
                     f"{p.calls} tokens (tolerance {p.atol:g} + {p.rtol:g} x max |logit|); argmax agreement "
                     f"{p.argmax_agreement:.3f}")
    if rep.round_trip is not None:
        rt = rep.round_trip
        lines += ["", "## archive round trip", "",
                  f"{'ok' if rt.ok else 'FAILED'}: {rt.tensors} tensors, {rt.members} members, {rt.written_bytes:,} "
                  f"bytes written (sha256 `{rt.sha256[:16]}...`)"]
        lines += [f"- {pr}" for pr in rt.problems]
    lines += ["", "![KL, top-1 and attention deviation per evaluated token](report.png)", ""]
    return "\n".join(lines)


def render_plot(rep: ValidationReport) -> bytes:
    """Per context: KL(p_ref || p) per evaluated token (log axis) with top-1 disagreements marked, and
    each layer's attention deviation; a line where quantized entries start to be read, threshold lines."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    rows = max(1, len(rep.contexts))
    fig, axes = plt.subplots(rows, 2, figsize=(13, 3.4 * rows + 0.6), squeeze=False)
    thr = rep.options.thresholds
    for r, res in enumerate(rep.contexts):
        ax_kl, ax_att = axes[r]
        pos = np.arange(res.n_predictions)  # prediction index: windows one after another
        first = res.first_quantized_read
        tm = res.token_measures()
        if tm is not None:
            kl = np.asarray(tm["kl"], np.float64)
            low = kl < KL_FLOOR
            ax_kl.semilogy(pos[~low], kl[~low], ".-", lw=0.8, ms=3, color="tab:green", label="KL(p_ref || p)")
            if low.any():
                ax_kl.semilogy(pos[low], np.full(int(low.sum()), KL_FLOOR), "v", ms=4, mfc="none", color="tab:green",
                               label=f"KL < {KL_FLOOR:g} (drawn at {KL_FLOOR:g})")
            miss = ~np.asarray(tm["top1"])
            if miss.any():
                ax_kl.semilogy(pos[miss], np.maximum(kl[miss], KL_FLOOR), "x", ms=6, color="tab:red",
                               label=f"top-1 differs ({int(miss.sum())} of {len(miss)})")
            if "max_kl" in thr:
                ax_kl.axhline(
                    max(thr["max_kl"], KL_FLOOR), color="k", ls=":", lw=1, label=f"--max-kl {thr['max_kl']:g}"
                )
            ax_kl.set_ylabel("KL (nats)")
        else:
            ax_kl.plot(pos, nll_rows(res), ".-", lw=0.8, ms=3, label="NLL of the true token")
            ax_kl.set_ylabel("NLL (nats)")
        ax_kl.set_xlabel(f"prediction ({res.windows} window(s) of {res.eval_tokens}, one after another)")
        sm = res.summary()
        ci = sm.get("kl_mean_ci95")
        ax_kl.set_title(f"context {res.context}: per-token divergence; mean KL "
                        + (f"{sm['kl_mean']:.4g} [{ci[0]:.4g}, {ci[1]:.4g}] (95%), " if ci else "")
                        + f"{sm['predictions']} predictions", fontsize=9)
        dev = res.attention_deviation()
        if dev is not None:
            for layer in range(dev.shape[1]):
                ax_att.plot(pos, dev[:, layer], lw=0.9, label=f"layer {layer}" if dev.shape[1] <= 12 else None)
            if "max_attention_deviation" in thr:
                ax_att.axhline(thr["max_attention_deviation"], color="k", ls=":", lw=1,
                               label=f"--max-attention-deviation {thr['max_attention_deviation']:g}")
        else:
            ax_att.text(0.5, 0.5, res.attention_note or "no reference: no attention deviation", ha="center",
                        va="center", transform=ax_att.transAxes, fontsize=8, wrap=True)
        ax_att.set_xlabel("prediction")
        ax_att.set_ylabel("attention deviation (rel. L2)")
        ax_att.set_title(f"context {res.context}: attention deviation per layer", fontsize=9)
        for ax in (ax_kl, ax_att):
            if first is not None:
                ax.axvline(first, color="tab:purple", ls="--", lw=1,
                           label="quantized entries read from here (first window)")
            for w in range(1, res.windows):
                ax.axvline(w * res.eval_tokens - 0.5, color="0.6", lw=0.6)
            else:
                ax.text(0.02, 0.95, "no token read a quantized entry", transform=ax.transAxes, fontsize=8,
                        va="top", color="tab:red")
            handles, labels = ax.get_legend_handles_labels()
            if handles:
                ax.legend(fontsize=7, loc="best")
    if not rep.contexts:
        for ax in axes[0]:
            ax.axis("off")
        axes[0][0].text(0.5, 0.5, "nothing measured", ha="center", va="center")
    fig.suptitle(f"{Path(rep.archive).name} - {rep.scheme} - verdict {rep.verdict.upper()}", fontsize=10)
    return png_bytes(fig, dpi=90)


def nll_rows(res: Any) -> np.ndarray:
    from .metrics import nll_of

    return nll_of(res.archive.logits, res.targets)


def write_report(rep: ValidationReport, out_dir: str | Path) -> list[Path]:
    """Write the three report files into ``out_dir`` (created if needed); returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    payloads = {
        "report.json": render_json(rep).encode(),
        "report.md": render_markdown(rep).encode(),
        "report.png": render_plot(rep),
    }
    return write_files(out, payloads)

