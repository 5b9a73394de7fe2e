"""``nnef-kv demo``: the whole job on a built-in decoder and a real text.

Builds the small LLaMA-style decoder of :mod:`nnef_kv.models` (f32, explicit cache, deterministic
weights, 256 ids read by a byte-level tokenizer), converts it with each scheme whose ``demo`` is
``"bits"`` (``kivi``) at each requested bit width and with each whose ``demo`` is ``"tract"``
(``tract``: tract's fused u8 op, at its fixed bits; left out by ``--no-tract``), and validates every
conversion against the f32 model on the text shipped with the package (the Declaration of
Independence): at each context, the prompt is prefilled and the next ``eval_tokens`` tokens of the
text are teacher-forced (see :mod:`.runner`). The contexts are past the full-precision window, so the quantized cache
is what is
measured. One row per model and context.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..kv.schemes import SCHEMES
from ..models import DecoderConfig, build_decoder
from .runner import Measurement, ValidateOptions, ValidationReport, validate_model

__all__ = ["DemoOptions", "DemoRow", "run_demo", "format_table", "TABLE_COLUMNS", "bits_problem", "variants"]

TABLE_COLUMNS = ("model", "bits", "context", "quantized / fp tokens", "KV bytes", "ratio vs f32", "attn dev (worst)",
                 "attn dev (mean)", "same top", "KL mean", "KL p99", "ppl ratio", "round trip", "tract parity")


@dataclass
class DemoOptions:
    config: DecoderConfig = field(default_factory=lambda: DecoderConfig(vocab=256))
    bits: tuple[int, ...] = (8, 4, 2)
    tract: bool = True
    contexts: tuple[int, ...] = (256, 1024)
    eval_tokens: int = 64
    key_group: int = 32
    value_group: int = 32
    residual: int = 32
    report_dir: str | None = None
    save_dir: str | None = None


@dataclass
class DemoRow:
    label: str
    bits: str
    context: int
    quantized: int
    full_precision: int
    kv_bytes: int
    ratio: float | None
    attention_max: float | None
    attention_mean: float | None
    top1: float | None
    kl_mean: float | None
    kl_p99: float | None
    ppl_ratio: float | None
    round_trip: str
    parity: str
    report: ValidationReport | None = None

    def cells(self) -> list[str]:
        def f(x: float | None, spec: str = ".4f") -> str:
            return "-" if x is None else format(x, spec)

        return [self.label, self.bits, str(self.context), f"{self.quantized} / {self.full_precision}",
                f"{self.kv_bytes:,}",
                f(self.ratio, ".3f"), f(self.attention_max), f(self.attention_mean),
                "-" if self.top1 is None else f"{100 * self.top1:.1f} %", f(self.kl_mean, ".3g"), f(self.kl_p99, ".3g"),
                f(self.ppl_ratio, ".4f"), self.round_trip, self.parity]


def _parity_cell(rep: ValidationReport) -> str:
    p = rep.parity
    if p is None:
        return "-"
    if p.status == "error":
        return "tract error"
    if p.status == "skipped":
        return "n/a (nnef-kv op)" if "nnef-kv's own op" in p.reason else "skipped"
    return f"{p.status} {p.max_abs:.1e}"


def demo_tokens(vocab: int) -> Any:
    """The sample text through the byte-level tokenizer (ids < 256; the decoder must have >= 256 ids)."""
    from ..errors import InputError
    from ..text import byte_level_tokenizer, sample_text, token_source

    if vocab < 256:
        raise InputError(f"--vocab {vocab}: the demo reads a byte-level text, it needs a vocabulary of at least 256")
    src = token_source(prompt=sample_text(), tokenizer=byte_level_tokenizer(), names={"prompt": "the sample text"})
    src.description = (f"{len(src.ids)} tokens of the sample text (the Declaration of Independence, byte-level "
                       f"tokenizer)")
    return src


def bits_problem(bits: int) -> str | None:
    """Why a ``--bits`` width is refused by a scheme the demo sweeps (None: every one takes it)."""
    for s in SCHEMES.values():
        bad = s.check({"bits": bits}) if s.demo == "bits" else None
        if bad is not None:
            return bad.reason
    return None


def variants(opts: DemoOptions) -> list[tuple[str, str, dict[str, Any] | None]]:
    """(label, bits, convert keywords or None for the f32 reference) of every model the demo measures."""
    out: list[tuple[str, str, dict[str, Any] | None]] = [("f32 (reference)", "32", None)]
    for s in SCHEMES.values():
        if s.demo == "bits":
            out += [(s.name, str(b), {"scheme": s.name, "bits": b}) for b in opts.bits]
        elif s.demo == "tract" and opts.tract and s.fixed_bits is not None:
            out.append((s.name, str(s.fixed_bits), {"scheme": s.name, "bits": s.fixed_bits}))
    return out


def run_demo(opts: DemoOptions, progress: Any = None) -> list[DemoRow]:
    from ..converters import convert
    from ..io.archive import load, save
    from .report import write_report

    cfg = opts.config
    source = demo_tokens(cfg.vocab)
    vopts = ValidateOptions(contexts=list(opts.contexts), eval_tokens=opts.eval_tokens, parity=opts.tract)
    with tempfile.TemporaryDirectory(prefix="nnef_kv_demo_") as tmp:
        base = Path(opts.save_dir) if opts.save_dir else Path(tmp)
        base.mkdir(parents=True, exist_ok=True)
        ref_path = base / "f32.nnef.tar"
        save(build_decoder(cfg), ref_path)
        ref = load(ref_path)
        runs: dict[int, Measurement] = {}
        rows: list[DemoRow] = []
        f32_bytes: dict[int, int] = {}
        for label, bits, kw in variants(opts):
            if kw is None:
                model, path = ref, ref_path
            else:
                kivi = {"key_group": opts.key_group, "value_group": opts.value_group, "residual": opts.residual}
                taken = SCHEMES[kw["scheme"]].option_names  # a scheme is given only the options it takes
                model, _ = convert(ref, **{k: v for k, v in kivi.items() if k in taken}, **kw)
                path = base / f"{kw['scheme']}{bits}.nnef.tar"
                save(model, path)
                model = load(path)
            rep = validate_model(model, ref, source, vopts, progress=progress, path=str(path), reference_runs=runs)
            for res in rep.contexts:
                s = res.summary()
                if kw is None:
                    f32_bytes[res.context] = s["kv_bytes"]
                att = s.get("attention_deviation") or {}
                ref_bytes = f32_bytes.get(res.context)
                rows.append(DemoRow(
                    label=label, bits=bits, context=res.context, quantized=s["quantized_tokens"],
                    full_precision=s["full_precision_tokens"], kv_bytes=s["kv_bytes"],
                    ratio=(s["kv_bytes"] / ref_bytes) if ref_bytes else None,
                    attention_max=att.get("max"), attention_mean=att.get("mean"), top1=s.get("top1_agreement"),
                    kl_mean=s.get("kl_mean"), kl_p99=s.get("kl_p99"), ppl_ratio=s.get("ppl_ratio"),
                    round_trip="ok" if rep.round_trip is not None and rep.round_trip.ok else "FAILED",
                    parity=_parity_cell(rep), report=rep))
            if opts.report_dir:
                write_report(rep, Path(opts.report_dir) / (label.split()[0] + (bits if kw else "")))
    return rows


def format_table(rows: list[DemoRow], opts: DemoOptions | None = None) -> str:
    """A plain-text table, one row per model and context (stable column order :data:`TABLE_COLUMNS`)."""
    cells = [list(TABLE_COLUMNS)] + [r.cells() for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(TABLE_COLUMNS))]
    lines = []
    if opts is not None:
        c = opts.config
        n_text = rows[0].report.n_tokens if rows and rows[0].report is not None else 0
        lines.append(f"built-in decoder: {c.layers} layers, hidden {c.hidden}, {c.heads} heads / {c.kv_heads} KV heads "
                     f"x {c.head_dim}, vocab {c.vocab}, cache {c.cache}; text: the Declaration of Independence "
                     f"({n_text} byte-level tokens); contexts {', '.join(map(str, opts.contexts))}, then "
                     f"{opts.eval_tokens} teacher-forced predictions each; kivi groups {opts.key_group}/"
                     f"{opts.value_group}, residual {opts.residual}")
    for i, row in enumerate(cells):
        lines.append("  ".join(cell.rjust(w) if j else cell.ljust(w) for j, (cell, w) in enumerate(zip(row, widths))))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
