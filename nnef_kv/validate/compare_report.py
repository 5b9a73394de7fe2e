"""The table and report files of ``nnef-kv compare``: the text table (stdout), ``report.md``,
``report.json`` (``rows``: one object per scheme, see :meth:`~.compare.SchemeRow.to_dict`) and
``report.png`` (KV bytes against mean KL, log-log, one panel per context, the Pareto front marked and
each point labelled), each file written atomically."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .compare import CompareReport, SchemeRow, finite, pareto_front
from .report import _json_safe, png_bytes, write_files

__all__ = ["render_table", "render_markdown", "render_json", "render_plot", "write_compare_report", "COMPARE_FILES"]

COMPARE_FILES = ("report.json", "report.md", "report.png")


def _f(x: Any, spec: str) -> str:
    return format(float(x), spec) if finite(x) else "-"


def _tract(r: SchemeRow) -> str:
    return {True: "yes", False: "no", None: "-"}[r.tract_runs]


def _columns(rep: CompareReport) -> tuple[list[str], list[list[str]]]:
    head = ["scheme", "bits/value"]
    for c in rep.contexts:
        at = f" @{c}" if len(rep.contexts) > 1 else ""
        head += [f"KV bytes{at}", f"x f32{at}", f"KL mean{at}", f"KL p99{at}", f"ppl ratio{at}", f"same top %{at}"]
    head += ["tract 0.23.9", "status"]
    body = []
    for r in rep.rows:
        last = r.per_context[-1] if r.per_context else {}
        cells = [r.scheme, _f(last.get("bits_per_value"), ".2f")]
        for c in rep.contexts:
            s = r.at(c)
            cells += [f"{s['kv_bytes']:,}" if finite(s.get("kv_bytes")) else "-", _f(s.get("kv_ratio"), ".3f"),
                      _f(s.get("kl_mean"), ".3g"), _f(s.get("kl_p99"), ".3g"), _f(s.get("ppl_ratio"), ".4f"),
                      _f(100 * s["top1_agreement"], ".1f") if finite(s.get("top1_agreement")) else "-"]
        status = r.status if r.status == "measured" else f"{r.status}: {r.reason}"
        cells += [_tract(r), status]
        body.append(cells)
    return head, body


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
    return "\n".join(line.rstrip() for line in lines)


def render_markdown(rep: CompareReport) -> str:
    head, body = _columns(rep)
    lines = [f"# nnef-kv compare: `{rep.archive}`", "",
             f"- tokens: {rep.tokens}",
             f"- contexts: {', '.join(map(str, rep.contexts))} (prefilled in one call), then {rep.eval_tokens} "
             f"teacher-forced predictions each, stepwise (as `nnef-kv validate`)",
             "- bits/value: KV bytes held (every array of the KV ops, allocated capacity included) x 8 / (2 x "
             "tokens x kv heads x head size x layers), at the largest context; x f32: held / the same tokens as f32",
             f"- ran on: {rep.runner}, {rep.seconds:.1f} s"]
    lines += [f"- note: {n}" for n in rep.notes]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in body]
    lines += ["", "| scheme | KV op settings | tract |", "|---|---|---|"]
    lines += [f"| {r.scheme} | {r.settings or '-'} | {r.tract_detail or '-'} |" for r in rep.rows]
    lines += ["", "![KV bytes against mean KL, Pareto front marked](report.png)", ""]
    return "\n".join(lines)


def render_json(rep: CompareReport) -> str:
    return json.dumps(_json_safe(rep.to_dict()), indent=1)


def render_plot(rep: CompareReport) -> bytes:
    """Per context: KV bytes held (x) against mean KL (y), log-log; the Pareto front (no scheme with fewer
    bytes and lower KL) joined and ringed; one label per point. Rows not measured are left out (listed)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    n = max(1, len(rep.contexts))
    fig, axes = plt.subplots(1, n, figsize=(7.5 * n, 5.6), squeeze=False)
    for ax, ctx in zip(axes[0], rep.contexts or [0]):
        pts, names = [], []
        for r in rep.rows:
            s = r.at(ctx)
            if r.status == "measured" and finite(s.get("kv_bytes")) and finite(s.get("kl_mean")):
                pts.append((float(s["kv_bytes"]), max(float(s["kl_mean"]), 1e-12)))
                names.append(r.scheme)
        front = pareto_front(pts)
        fams = sorted({nm.split(":")[0].split("+")[0] if not nm[0] == "q" else "ggml" for nm in names})
        colors = {f: plt.cm.tab10(i % 10) for i, f in enumerate(fams)}
        for (b, k), nm, on in zip(pts, names, front):
            fam = nm.split(":")[0].split("+")[0] if not nm[0] == "q" else "ggml"
            ax.scatter([b], [k], s=60 if on else 30, color=colors[fam], edgecolors="k" if on else "none", zorder=3,
                       label=fam if fam not in ax.get_legend_handles_labels()[1] else None)
        fr = sorted(p for p, on in zip(pts, front) if on)
        if fr:
            ax.plot([p[0] for p in fr], [p[1] for p in fr], "k--", lw=1, zorder=2, label="Pareto front")
        ax.set_xscale("log")
        ax.set_yscale("log")
        _label(fig, ax, pts, names, front)
        ax.set_xlabel(f"KV bytes held at context {ctx} (log)")
        ax.set_ylabel("mean KL(p_ref || p), nats (log)")
        left = [r.scheme for r in rep.rows if r.status != "measured"]
        title = f"context {ctx}, {rep.eval_tokens} predictions"
        if left:
            title += f"\nnot plotted: {', '.join(left)}"
        ax.set_title(title, fontsize=8)
        ax.grid(True, which="both", lw=0.3, alpha=0.5)
        if pts:
            ax.legend(fontsize=7, loc="best")
        else:
            ax.text(0.5, 0.5, "no scheme measured", ha="center", va="center", transform=ax.transAxes)
    fig.suptitle(f"nnef-kv compare: {Path(rep.archive).name}", fontsize=10)
    return png_bytes(fig, dpi=100)


def _label(fig: Any, ax: Any, pts: list[tuple[float, float]], names: list[str], front: list[bool]) -> None:
    """One label per point, each placed at the first of a few offsets where it overlaps no label or point
    placed before it (in screen space; widths estimated from the text length)."""
    if not pts:
        return
    ax.margins(0.12)
    ax.autoscale_view()
    xy = ax.transData.transform(pts)  # pixels
    px = fig.dpi / 72.0
    boxes = [(x - 4, y - 4, x + 4, y + 4) for x, y in xy]  # the points themselves
    order = sorted(range(len(pts)), key=lambda i: (not front[i], pts[i]))  # the front first
    for i in order:
        w, h = 7 * 0.62 * len(names[i]) * px, 9 * px
        x, y = xy[i]
        cands = [(6, 4), (6, -4 - h), (-6 - w, 4), (-6 - w, -4 - h), (6, 14), (6, -14 - h), (-6 - w, 14),
                 (-6 - w, -14 - h), (-w / 2, 10), (-w / 2, -10 - h), (6, 26), (6, -26 - h)]
        best = None
        for dx, dy in cands:
            b = (x + dx, y + dy, x + dx + w, y + dy + h)
            hits = sum(not (b[2] < o[0] or b[0] > o[2] or b[3] < o[1] or b[1] > o[3]) for o in boxes)
            if best is None or hits < best[0]:
                best = (hits, dx, dy, b)
            if hits == 0:
                break
        _, dx, dy, b = best
        boxes.append(b)
        ax.annotate(names[i], pts[i], textcoords="offset pixels", xytext=(dx, dy), fontsize=7,
                    fontweight="bold" if front[i] else "normal")


def write_compare_report(rep: CompareReport, out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    payloads = {"report.json": render_json(rep).encode(), "report.md": render_markdown(rep).encode(),
                "report.png": render_plot(rep)}  # everything rendered before anything is written
    return write_files(out, payloads)
