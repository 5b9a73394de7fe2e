"""``nnef-kv demo``: the whole job on a built-in decoder.

Builds the small LLaMA-style decoder of :mod:`nnef_kv.models` (f32, explicit cache, deterministic
weights), decodes it greedily as the reference (prompt + steps), converts it with scheme ``kivi`` at each
requested bit width and with scheme ``tract`` (tract's fused u8 op), validates every conversion against
the reference on the same tokens, and returns one row per model.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..models import DecoderConfig, build_decoder
from .runner import ValidateOptions, ValidationReport, default_prompt, reference_trace, validate_model

__all__ = ["DemoOptions", "DemoRow", "run_demo", "format_table", "TABLE_COLUMNS"]

TABLE_COLUMNS = ("model", "bits", "KV bytes", "ratio vs f32", "attn dev (worst)", "attn dev (mean)",
                 "token agreement", "KL mean", "KL p99", "round trip", "tract parity")


@dataclass
class DemoOptions:
    config: DecoderConfig = field(default_factory=DecoderConfig)
    bits: tuple[int, ...] = (8, 4, 2)
    tract: bool = True
    prompt_len: int = 64
    steps: int = 192
    key_group: int = 32
    value_group: int = 32
    residual: int = 32
    report_dir: str | None = None
    save_dir: str | None = None


@dataclass
class DemoRow:
    label: str
    bits: str
    kv_bytes: int
    ratio: float
    attention_max: float | None
    attention_mean: float | None
    token_agreement: float
    kl_mean: float
    kl_p99: float
    round_trip: str
    parity: str
    report: ValidationReport | None = None

    def cells(self) -> list[str]:
        def f(x: float | None, spec: str = ".4f") -> str:
            return "-" if x is None else format(x, spec)

        return [self.label, self.bits, f"{self.kv_bytes:,}", f(self.ratio, ".3f"), f(self.attention_max),
                f(self.attention_mean), f(self.token_agreement, ".3f"), f(self.kl_mean, ".3g"), f(self.kl_p99, ".3g"),
                self.round_trip, self.parity]


def _parity_cell(rep: ValidationReport) -> str:
    p = rep.parity
    if p is None:
        return "-"
    if p.status == "error":
        return "tract error"
    if p.status == "skipped":
        return "n/a (nnef-kv op)" if "nnef-kv's own op" in p.reason else "skipped"
    return f"{p.status} {p.max_abs:.1e}"


def run_demo(opts: DemoOptions, progress: Any = None) -> list[DemoRow]:
    from ..converters import convert
    from ..io.archive import save
    from .report import write_report

    cfg = opts.config
    ref = build_decoder(cfg)
    vopts = ValidateOptions(steps=opts.steps, prompt_len=opts.prompt_len, parity=opts.tract)
    prompt = default_prompt(cfg.vocab, opts.prompt_len, cfg.seed)
    vopts.prompt_ids = prompt
    with tempfile.TemporaryDirectory(prefix="nnef_kv_demo_") as tmp:
        base = Path(opts.save_dir) if opts.save_dir else Path(tmp)
        ref_path = base / "f32.nnef.tar"
        save(ref, ref_path)
        from ..io.archive import load

        ref = load(ref_path)
        rtrace = reference_trace(ref, prompt, opts.steps, on_call=progress)
        ref_bytes = int(rtrace.kv_bytes.get("total", 0))
        rows: list[DemoRow] = []
        ref_rep = validate_model(ref, ref, vopts, ref_trace=rtrace, progress=progress, path=str(ref_path))
        variants: list[tuple[str, str, dict[str, Any]]] = [("kivi", str(b), {"scheme": "kivi", "bits": b}) for b in opts.bits]
        if opts.tract:
            variants.append(("tract", "8", {"scheme": "tract", "bits": 8}))
        reports: list[tuple[str, ValidationReport]] = [("f32", ref_rep)]
        labels = ["f32 (reference)"]
        bits_col = ["32"]
        for label, bits, kw in variants:
            model, _ = convert(ref, key_group=opts.key_group, value_group=opts.value_group, residual=opts.residual, **kw)
            path = base / f"{label}{bits}.nnef.tar"
            save(model, path)
            model = load(path)
            rep = validate_model(model, ref, vopts, ref_trace=rtrace, progress=progress, path=str(path))
            reports.append((f"{label}{bits}", rep))
            labels.append(label)
            bits_col.append(bits)
        for (name, rep), label, bits in zip(reports, labels, bits_col):
            c = rep.cost
            assert c is not None
            kl = c.kl_stats()
            rows.append(DemoRow(
                label=label, bits=bits, kv_bytes=int(c.kv_bytes.get("total", 0)),
                ratio=(c.kv_bytes.get("total", 0) / ref_bytes) if ref_bytes else float("nan"),
                attention_max=c.attention_max, attention_mean=c.attention_mean, token_agreement=c.token_agreement,
                kl_mean=kl.get("mean", float("nan")), kl_p99=kl.get("p99", float("nan")),
                round_trip="ok" if rep.round_trip is not None and rep.round_trip.ok else "FAILED",
                parity=_parity_cell(rep), report=rep))
            if opts.report_dir:
                write_report(rep, Path(opts.report_dir) / name)
    return rows


def format_table(rows: list[DemoRow], opts: DemoOptions | None = None) -> str:
    """A plain-text table, one row per model (stable column order :data:`TABLE_COLUMNS`)."""
    cells = [list(TABLE_COLUMNS)] + [r.cells() for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(TABLE_COLUMNS))]
    lines = []
    if opts is not None:
        c = opts.config
        lines.append(f"built-in decoder: {c.layers} layers, hidden {c.hidden}, {c.heads} heads / {c.kv_heads} KV heads "
                     f"x {c.head_dim}, vocab {c.vocab}, cache {c.cache}; prompt {opts.prompt_len} + {opts.steps} "
                     f"decode steps ({opts.prompt_len + opts.steps} positions); kivi groups {opts.key_group}/"
                     f"{opts.value_group}, residual {opts.residual}")
        if opts.prompt_len + opts.steps < opts.residual + opts.key_group:
            lines.append(f"note: {opts.prompt_len + opts.steps} positions < residual + key_group "
                         f"({opts.residual + opts.key_group}): KIVI keeps every token in full precision here")
    for i, row in enumerate(cells):
        lines.append("  ".join(cell.rjust(w) if j else cell.ljust(w) for j, (cell, w) in enumerate(zip(row, widths))))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
