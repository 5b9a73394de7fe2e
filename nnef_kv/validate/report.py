"""Writing a validation report: ``report.json``, ``report.md`` and ``report.png`` (matplotlib, Agg),
each written atomically."""
from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

from ..atomic import atomic_write
from .runner import ValidationReport

__all__ = ["write_report", "render_markdown", "render_plot", "REPORT_FILES"]

REPORT_FILES = ("report.json", "report.md", "report.png")


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


def _f(x: Any, spec: str = ".4g") -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return format(x, spec)
    return str(x)


def render_markdown(rep: ValidationReport) -> str:
    d = rep.to_dict()
    lines = [f"# nnef-kv validation: `{rep.archive}`", ""]
    if rep.reference:
        lines.append(f"Reference (f32): `{rep.reference}`")
        lines.append("")
    lines.append(f"**Result: {'PASS' if rep.ok else 'FAIL'}**")
    lines += [f"\n> {n}" for n in rep.notes]
    lines += ["", "| check | result | detail |", "|---|---|---|"]
    for c in rep.checks:
        lines.append(f"| {c.name} | {'ok' if c.ok else 'FAILED'} | {c.detail} |")
    p = rep.parity
    lines += ["", "## tract parity", ""]
    if p is None:
        lines.append("not run")
    elif p.status in ("skipped", "error"):
        lines.append(f"{p.status}: {p.reason}")
    else:
        lines.append(f"{p.status}: max |logits - tract| = {p.max_abs:.3g} ({p.max_rel:.3g} of the largest logit) over "
                     f"{p.calls} calls; argmax agreement {p.argmax_agreement:.3f}")
    if rep.round_trip is not None:
        rt = rep.round_trip
        lines += ["", "## archive round trip", "",
                  f"{'ok' if rt.ok else 'FAILED'}: {rt.tensors} tensors, {rt.members} members, {rt.written_bytes:,} "
                  f"bytes written (sha256 `{rt.sha256[:16]}...`)"]
        lines += [f"- {pr}" for pr in rt.problems]
    c = d["numeric_cost"]
    if c is not None:
        kl = c["kl"]
        att = c["attention_deviation"]
        lines += ["", "## numeric cost vs the f32 reference", "",
                  f"Decode: prompt of {c['n_prompt']} tokens then {c['calls'] - 1} one-token calls "
                  "(teacher forced on the reference's greedy tokens).", "",
                  "| measure | value |", "|---|---|",
                  f"| attention deviation, worst (rel. L2) | {_f(att['max'])} |",
                  f"| attention deviation, mean | {_f(att['mean'])} |",
                  f"| logits rel. L2, mean / max | {_f(c['logits_rel_l2'].get('mean'))} / {_f(c['logits_rel_l2'].get('max'))} |",
                  f"| greedy-token agreement | {c['token_agreement']:.4f} |",
                  f"| KL(p_ref ‖ p) mean (nats) | {_f(kl.get('mean'))} |",
                  f"| KL median / p90 / p99 / max | {_f(kl.get('p50'))} / {_f(kl.get('p90'))} / {_f(kl.get('p99'))} / "
                  f"{_f(kl.get('max'))} |",
                  f"| KV bytes (this archive) | {c['kv_bytes'].get('total', 0):,} |",
                  f"| KV bytes (f32 reference) | {c['reference_kv_bytes'].get('total', 0):,} |",
                  f"| KV ratio vs f32 | {_f(c['kv_ratio'], '.3f')} |"]
        lines += ["", f"Attention deviation: {att['what']}."]
        if att["per_layer_mean"]:
            lines += ["", "| layer | mean deviation | worst deviation |", "|---|---|---|"]
            for i, (m, w) in enumerate(zip(att["per_layer_mean"], att["per_layer_max"])):
                lines.append(f"| {i} | {m:.4g} | {w:.4g} |")
    elif rep.trace_kv_bytes:
        lines += ["", f"KV bytes at the end of the decode: {rep.trace_kv_bytes.get('total', 0):,} "
                      "(no reference given: no numeric cost)"]
    lines += ["", "![per-step deviation](report.png)", ""]
    return "\n".join(lines)


def render_plot(rep: ValidationReport) -> bytes:
    """A PNG: attention deviation per layer, logits deviation and KL per decode call."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    c = rep.cost
    if c is None:
        for ax in axes:
            ax.axis("off")
        axes[1].text(0.5, 0.5, "no reference: no numeric cost", ha="center", va="center")
    else:
        calls = list(range(c.calls))
        ax = axes[0]
        if c.attention:
            for layer in range(len(c.attention[0])):
                ax.plot(calls, [row[layer] for row in c.attention], label=f"layer {layer}", lw=1)
            if len(c.attention[0]) <= 8:
                ax.legend(fontsize=7)
        ax.set_title("attention deviation (rel. L2)")
        ax.set_xlabel("decode call")
        axes[1].plot(calls, c.logits_rel_l2, color="tab:orange", lw=1)
        axes[1].set_title("logits deviation (rel. L2)")
        axes[1].set_xlabel("decode call")
        kl = [max(k, 1e-12) for k in c.kl]
        axes[2].semilogy(calls, kl, color="tab:green", lw=1)
        axes[2].set_title("KL(p_ref || p), nats")
        axes[2].set_xlabel("decode call")
    fig.suptitle(Path(rep.archive).name, fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return buf.getvalue()


def write_report(rep: ValidationReport, out_dir: str | Path) -> list[Path]:
    """Write the three report files into ``out_dir`` (created if needed); returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    payloads = {
        "report.json": json.dumps(_json_safe(rep.to_dict()), indent=1).encode(),
        "report.md": render_markdown(rep).encode(),
        "report.png": render_plot(rep),
    }
    paths = []
    for name, data in payloads.items():
        with atomic_write(out / name) as f:
            f.write(data)
        paths.append(out / name)
    return paths
