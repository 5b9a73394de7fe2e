"""The table and report files of ``nnef-kv compare``: the text table (stdout), ``report.md``,
``report.json`` (``rows``: one object per scheme, see :meth:`~.compare.SchemeRow.to_dict`) and
``report.png`` (KV bytes against mean KL, log-log, one panel per context, the Pareto front marked and
each point labelled), each file written atomically."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .compare import CompareReport, SchemeRow, finite, short_reason
from .report import _json_safe, png_bytes, write_files

__all__ = ["render_table", "render_markdown", "render_json", "render_plot", "write_compare_report", "COMPARE_FILES"]

COMPARE_FILES = ("report.json", "report.md", "report.png")


def _f(x: Any, spec: str) -> str:
    return format(float(x), spec) if finite(x) else "-"


def _tract(r: SchemeRow) -> str:
    return {True: "yes", False: "no", None: "-"}[r.tract_runs]


def _ci(v: Any, ci: Any, spec: str, scale: float = 1.0) -> str:
    if not finite(v):
        return "-"
    s = format(float(v) * scale, spec)
    if ci and all(finite(x) for x in ci):
        s += f" [{format(ci[0] * scale, spec)}, {format(ci[1] * scale, spec)}]"
    return s


def _diff(s: dict[str, Any]) -> str:
    if not finite(s.get("kl_diff")):
        return "-"
    ci = s.get("kl_diff_ci95") or [None, None]
    if s["kl_diff"] == 0 and ci[0] == 0 and ci[1] == 0:
        return "baseline" if s.get("kl_diff_significant") is False else "0"
    return _ci(s["kl_diff"], ci, "+.2g") + (" *" if s.get("kl_diff_significant") else "")


def _columns(rep: CompareReport, full: bool = False) -> tuple[list[str], list[list[str]]]:
    head = ["scheme", "bits/value"]
    for c in rep.contexts:
        at = f" @{c}" if len(rep.contexts) > 1 else ""
        head += [f"KV bytes{at}", f"x f32{at}", f"KL mean [95%]{at}", f"KL - baseline [95%]{at}", f"front{at}",
                 f"KL p99{at}", f"ppl ratio [95%]{at}", f"same top % [95%]{at}"]
    head += ["tract 0.23.9", "status"]
    body = []
    for r in rep.rows:
        last = r.per_context[-1] if r.per_context else {}
        cells = [r.scheme, _f(last.get("bits_per_value"), ".2f")]
        for c in rep.contexts:
            s = r.at(c)
            cells += [f"{s['kv_bytes']:,}" if finite(s.get("kv_bytes")) else "-", _f(s.get("kv_ratio"), ".3f"),
                      _ci(s.get("kl_mean"), s.get("kl_mean_ci95"), ".3g"), _diff(s),
                      {True: "yes", False: "", None: "-"}[s.get("pareto")], _f(s.get("kl_p99"), ".3g"),
                      _ci(s.get("ppl_ratio"), s.get("ppl_ratio_ci95"), ".4f"),
                      _ci(s.get("top1_agreement"), s.get("top1_agreement_ci95"), ".1f", 100)]
        reason = r.reason if full else short_reason(r.reason)
        status = r.status if r.status == "measured" else f"{r.status}: {reason}"
        cells += [_tract(r), status]
        body.append(cells)
    return head, body


def legend_lines(rep: CompareReport) -> list[str]:
    """What the table's columns mean (printed under it, in report.md)."""
    base = ", ".join(f"{v} @{k}" if len(rep.baseline) > 1 else v for k, v in rep.baseline.items()) or "-"
    return [f"{rep.predictions} predictions per scheme and context ({len(rep.starts)} window(s) x {rep.eval_tokens}), "
            f"the same tokens for every scheme; [95%]: block-bootstrap interval (nnef_kv/validate/statistics.py)",
            f"KL - baseline: the paired difference to {base} on the same predictions (* : its interval excludes 0); "
            f"front: the significant Pareto front (no row with as few KV bytes has a KL lower beyond the noise)"]


def render_table(rep: CompareReport, width: int = 70) -> str:
    """The table as aligned text (a long reason cut to ``width`` characters; report.md has it whole)."""
    head, body = _columns(rep)
    body = [row[:-1] + [row[-1] if len(row[-1]) <= width else row[-1][:width - 3] + "..."] for row in body]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    num = [i for i in range(1, len(head) - 2)]
    lines = []
    for row in [head] + body:
        lines.append("  ".join(x.rjust(w) if i in num else x.ljust(w) for i, (x, w) in enumerate(zip(row, widths))))
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join([line.rstrip() for line in lines] + legend_lines(rep))


def render_markdown(rep: CompareReport) -> str:
    head, body = _columns(rep, full=True)
    lines = [f"# nnef-kv compare: `{rep.archive}`", "",
             f"- tokens: {rep.tokens}",
             f"- contexts: {', '.join(map(str, rep.contexts))} (prefilled in one call), then {rep.eval_tokens} "
             f"teacher-forced predictions, stepwise (as `nnef-kv validate`), in each of {len(rep.starts)} window(s) "
             f"of the text (first predicted tokens {', '.join(map(str, rep.starts))})",
             "- bits/value: KV bytes held (every array of the KV ops, allocated capacity included) x 8 / (2 x "
             "tokens x kv heads x head size x layers), at the largest context; x f32: held / the same tokens as f32",
             f"- ran on: {rep.runner}, {rep.seconds:.1f} s"]
    lines += [f"- note: {n}" for n in rep.notes]
    lines += [f"- {x}" for x in legend_lines(rep)]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in body]
    lines += ["", "| scheme | KV op settings | tract |", "|---|---|---|"]
    lines += [f"| {r.scheme} | {r.settings or '-'} | {r.tract_detail or '-'} |" for r in rep.rows]
    lines += ["", "![KV bytes against mean KL, Pareto front marked](report.png)", ""]
    return "\n".join(lines)


def render_json(rep: CompareReport) -> str:
    return json.dumps(_json_safe(rep.to_dict()), indent=1)


def render_plot(rep: CompareReport) -> bytes:
    """Per context: KV bytes held (x) against mean KL (y) with its 95% interval (error bars), log-log; the
    significant Pareto front joined and ringed. Each point carries a number joined to it by a leader line,
    and the legend beside the axes lists every number with its scheme: no label can be read as another
    point's. Rows not measured are left out (listed)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    n = max(1, len(rep.contexts))
    fig, axes = plt.subplots(1, n, figsize=(9.5 * n, 6.0), squeeze=False)
    for ax, ctx in zip(axes[0], rep.contexts or [0]):
        pts, names, front, errs, fam = [], [], [], [], []
        for r in rep.rows:
            s = r.at(ctx)
            if r.status == "measured" and finite(s.get("kv_bytes")) and finite(s.get("kl_mean")):
                k = max(float(s["kl_mean"]), 1e-12)
                ci = s.get("kl_mean_ci95") or [k, k]
                pts.append((float(s["kv_bytes"]), k))
                errs.append((k - max(float(ci[0]), 1e-12), max(float(ci[1]), k) - k))
                names.append(r.scheme)
                fam.append(r.family or r.scheme)
                front.append(bool(s.get("pareto")))
        colors = {f: plt.cm.tab10(i % 10) for i, f in enumerate(sorted(set(fam)))}
        for i, ((b, k), nm, on, e, f) in enumerate(zip(pts, names, front, errs, fam)):
            ax.errorbar([b], [k], yerr=[[min(e[0], k * 0.999)], [e[1]]], fmt="o", ms=8 if on else 5,
                        color=colors[f], mec="k" if on else colors[f], capsize=3, lw=1,
                        zorder=3, label=f"{i + 1}: {nm}" + (" (front)" if on else ""))
        fr = sorted(p for p, on in zip(pts, front) if on)
        if fr:
            ax.plot([p[0] for p in fr], [p[1] for p in fr], "k--", lw=1, zorder=2)
        ax.set_xscale("log")
        ax.set_yscale("log")
        _label(fig, ax, pts, [str(i + 1) for i in range(len(pts))], front)
        ax.set_xlabel(f"KV bytes held at context {ctx} (log)")
        ax.set_ylabel("mean KL(p_ref || p), nats (log), 95% interval")
        left = [r.scheme for r in rep.rows if r.status != "measured"]
        title = (f"context {ctx}, {rep.predictions} predictions ({len(rep.starts)} window(s)); "
                 f"dashed: significant Pareto front")
        if left:
            title += f"\nnot plotted: {', '.join(left)}"
        ax.set_title(title, fontsize=8)
        ax.grid(True, which="both", lw=0.3, alpha=0.5)
        if pts:
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0,
                      title="point: scheme", title_fontsize=7)
        else:
            ax.text(0.5, 0.5, "no scheme measured", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(f"nnef-kv compare: {Path(rep.archive).name}", fontsize=10)
    return png_bytes(fig, dpi=100)


def _label(fig: Any, ax: Any, pts: list[tuple[float, float]], names: list[str], front: list[bool]) -> None:
    """One label per point, each placed at the first of a few offsets where it overlaps no label or point
    placed before it (in screen space; widths estimated from the text length), joined to its point by a
    leader line."""
    if not pts:
        return
    ax.margins(0.15)
    ax.autoscale_view()
    xy = ax.transData.transform(pts)  # pixels
    px = fig.dpi / 72.0
    boxes = [(x - 5, y - 5, x + 5, y + 5) for x, y in xy]  # the points themselves
    order = sorted(range(len(pts)), key=lambda i: (not front[i], pts[i]))  # the front first
    for i in order:
        w, h = 7 * 0.62 * len(names[i]) * px + 4, 9 * px + 2
        x, y = xy[i]
        cands = [(d * dx, d * dy) for d in (14, 24, 36, 50) for dx, dy in
                 ((1, 1), (1, -1), (-1, 1), (-1, -1), (0, 1.2), (0, -1.2), (1.3, 0), (-1.3, 0))]
        best = None
        for dx, dy in cands:
            cx, cy = x + dx, y + dy
            b = (cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2)
            hits = sum(not (b[2] < o[0] or b[0] > o[2] or b[3] < o[1] or b[1] > o[3]) for o in boxes)
            if best is None or hits < best[0]:
                best = (hits, dx, dy, b)
            if hits == 0:
                break
        _, dx, dy, b = best
        boxes.append(b)
        ax.annotate(names[i], pts[i], textcoords="offset pixels", xytext=(dx, dy), fontsize=7, ha="center",
                    va="center", fontweight="bold" if front[i] else "normal",
                    arrowprops={"arrowstyle": "-", "lw": 0.6, "color": "0.35", "shrinkA": 1, "shrinkB": 3})


def write_compare_report(rep: CompareReport, out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    payloads = {"report.json": render_json(rep).encode(), "report.md": render_markdown(rep).encode(),
                "report.png": render_plot(rep)}  # everything rendered before anything is written
    return write_files(out, payloads)
