"""``nnef-kv validate``: round trip, tract parity and numeric cost against an f32 reference.

What is measured (numeric cost, over one decode run: a prompt call then ``steps`` one-token calls):

* the **reference** (f32 archive) decodes greedily; the archive under test is fed the *same* tokens
  (teacher forcing), so step ``i`` of both sees the same text;
* **attention deviation**: for each call and each layer, the relative L2 distance
  ``||a - a_ref|| / ||a_ref||`` between the output of the layer's attention op (fused op or
  ``softmax(.) @ V``, shape ``[B, Hq, Sq, D]``) in the archive and in the reference. Each model runs on
  its own hidden states, so deviation accumulates through layers and steps, as in real use;
* **logits deviation**: relative L2 and max |diff| of the last-position logits of each call;
* **greedy-token agreement**: fraction of calls whose argmax equals the reference's argmax;
* **KL divergence** ``KL(p_ref || p)`` of the next-token distributions (softmax of the logits, nats),
  per call, summarised as mean, median, p90/p95/p99/p99.9 and max (llama.cpp ``perplexity
  --kl-divergence`` style);
* **KV bytes** held at the end of the run (codes + params + full-precision parts), and the f32
  reference's KV bytes at the same length.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import InputError, NnefKvError
from .decode import DecodeTrace, InterpreterDecoder, TractDecoder, run_decode, tract_available
from .metrics import kl_divergence, rel_l2, summary_stats
from .roundtrip import RoundTripResult, check_round_trip

__all__ = ["ValidateOptions", "NumericCost", "ParityResult", "Check", "ValidationReport", "validate_model",
           "numeric_cost", "tract_parity", "default_prompt", "reference_trace"]


@dataclass
class ValidateOptions:
    steps: int = 32
    prompt_ids: list[int] | None = None
    prompt_len: int = 16
    seed: int = 0
    max_attention_deviation: float | None = None  # worst (max over calls and layers)
    min_token_agreement: float | None = None
    max_kl: float | None = None  # mean KL over calls
    parity: bool = True
    round_trip: bool = True
    parity_atol: float = 1e-4
    parity_rtol: float = 1e-3  # of the largest |logit| tract returned


@dataclass
class Check:
    name: str
    ok: bool
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "detail": self.detail}


@dataclass
class ParityResult:
    """Our interpreter vs tract on the same decode.

    ``status``: ``ok``; ``mismatch`` (logits differ beyond tolerance); ``error`` (tract refused or failed to
    run an archive made of ops it should know: a failed check); ``skipped`` (tract not installed, or the
    archive uses nnef-kv's own ops, which tract does not implement).
    """

    status: str
    reason: str = ""
    calls: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0
    argmax_agreement: float = 0.0
    per_call_max_abs: list[float] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "reason": self.reason, "calls": self.calls, "seconds": self.seconds,
                "max_abs": self.max_abs,
                "max_rel": self.max_rel, "argmax_agreement": self.argmax_agreement,
                "per_call_max_abs": self.per_call_max_abs}


@dataclass
class NumericCost:
    calls: int
    tokens: list[int]
    n_prompt: int
    layers: int
    attention: list[list[float]] | None  # [call][layer]
    attention_note: str
    logits_rel_l2: list[float]
    logits_max_abs: list[float]
    kl: list[float]
    ref_tokens: list[int]
    tokens_pred: list[int]
    kv_bytes: dict[str, int]
    ref_kv_bytes: dict[str, int]

    @property
    def token_agreement(self) -> float:
        return float(np.mean([a == b for a, b in zip(self.ref_tokens, self.tokens_pred)])) if self.ref_tokens else 0.0

    @property
    def attention_max(self) -> float | None:
        return None if not self.attention else float(np.max(self.attention))

    @property
    def attention_mean(self) -> float | None:
        return None if not self.attention else float(np.mean(self.attention))

    @property
    def kv_ratio(self) -> float | None:
        ref = self.ref_kv_bytes.get("total", 0)
        return None if not ref else self.kv_bytes.get("total", 0) / ref

    def kl_stats(self) -> dict[str, float]:
        return summary_stats(self.kl)

    def to_dict(self) -> dict[str, Any]:
        att = self.attention
        per_layer = None if not att else [float(x) for x in np.mean(np.asarray(att), axis=0)]
        per_layer_max = None if not att else [float(x) for x in np.max(np.asarray(att), axis=0)]
        steps = []
        for i in range(self.calls):
            steps.append({
                "call": i,
                "positions": self.n_prompt + i,  # tokens in the cache after this call
                "attention_deviation": None if not att else att[i],
                "logits_rel_l2": self.logits_rel_l2[i],
                "logits_max_abs": self.logits_max_abs[i],
                "kl": self.kl[i],
                "reference_token": self.ref_tokens[i],
                "token": self.tokens_pred[i],
            })
        return {
            "calls": self.calls, "n_prompt": self.n_prompt, "tokens": self.tokens, "layers": self.layers,
            "attention_deviation": {"max": self.attention_max, "mean": self.attention_mean,
                                    "per_layer_mean": per_layer, "per_layer_max": per_layer_max,
                                    "what": self.attention_note},
            "logits_rel_l2": summary_stats(self.logits_rel_l2, ()),
            "logits_max_abs": float(max(self.logits_max_abs)) if self.logits_max_abs else 0.0,
            "token_agreement": self.token_agreement,
            "kl": self.kl_stats(),
            "kv_bytes": self.kv_bytes, "reference_kv_bytes": self.ref_kv_bytes, "kv_ratio": self.kv_ratio,
            "steps": steps,
        }


@dataclass
class ValidationReport:
    archive: str
    reference: str | None
    options: ValidateOptions
    round_trip: RoundTripResult | None = None
    parity: ParityResult | None = None
    cost: NumericCost | None = None
    checks: list[Check] = field(default_factory=list)
    trace_kv_bytes: dict[str, int] = field(default_factory=dict)
    prompt: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # decode wall time per run (nnef-kv interpreter)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        o = self.options
        return {
            "format": "nnef-kv-validation", "version": 1,
            "archive": self.archive, "reference": self.reference, "ok": self.ok, "prompt": self.prompt,
            "notes": list(self.notes), "decode_seconds": dict(self.seconds),
            "options": {"steps": o.steps, "prompt_ids": o.prompt_ids, "max_attention_deviation": o.max_attention_deviation,
                        "min_token_agreement": o.min_token_agreement, "max_kl": o.max_kl,
                        "parity_atol": o.parity_atol, "parity_rtol": o.parity_rtol},
            "checks": [c.to_dict() for c in self.checks],
            "round_trip": None if self.round_trip is None else self.round_trip.to_dict(),
            "tract_parity": None if self.parity is None else self.parity.to_dict(),
            "numeric_cost": None if self.cost is None else self.cost.to_dict(),
            "kv_bytes": self.trace_kv_bytes,
        }


# ----------------------------------------------------------------------------------------------
def default_prompt(vocab: int, length: int, seed: int = 0) -> list[int]:
    """A deterministic prompt of ``length`` ids drawn in ``[0, vocab)``."""
    return [int(i) for i in np.random.default_rng(seed).integers(0, max(1, vocab), length)]


def _vocab_of(model: Any) -> int:
    dec = InterpreterDecoder(model)
    return int(dec(np.asarray([0], np.int64)).shape[-1])


def _nnef_kv_only_ops(model: Any) -> list[str]:
    from ..interpreter.session import get_plan

    return sorted({n.op for n in get_plan(model).step_nodes if n.op.startswith("nnef_kv_")})


def _with_path(model: Any, fn: Callable[[str], Any], path: str | None = None) -> Any:
    """``fn(path)`` when the caller vouches that ``path`` holds ``model`` unchanged, else ``fn`` on a temporary
    copy written from ``model`` (a converted model keeps its source's path: never trust ``model.source``)."""
    if path and os.path.exists(path):
        return fn(str(path))
    from ..io.archive import save

    with tempfile.TemporaryDirectory(prefix="nnef_kv_tract_") as tmp:
        path = Path(tmp) / "model.nnef.tar"
        save(model, path)
        return fn(str(path))


def tract_parity(model: Any, tokens: Sequence[int], n_prompt: int, ours: DecodeTrace, atol: float = 1e-4,
                 rtol: float = 1e-3, on_call: Callable[[], None] | None = None, path: str | None = None
                 ) -> ParityResult:
    """Decode ``tokens`` (teacher forced) with tract and compare the logits with ``ours``."""
    if not tract_available():
        return ParityResult("skipped", "the tract Python package is not installed")
    own = _nnef_kv_only_ops(model)
    if own:
        return ParityResult("skipped", f"tract cannot load this archive: it uses nnef-kv's own op(s) "
                                       f"{', '.join(own)} (extension nnef_kv), which tract does not implement")
    sig = InterpreterDecoder(model).sig
    steps = ours.calls - 1

    def run(path: str) -> DecodeTrace:
        return run_decode(TractDecoder(path, sig), tokens[:n_prompt], steps, tokens=tokens, on_call=on_call)

    try:
        theirs = _with_path(model, run, path)
    except NnefKvError:
        raise
    except BaseException as exc:  # tract raises its own errors (and pyo3 panics are BaseException)
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        text = str(exc).split("Stack backtrace", 1)[0]
        msg = " / ".join(ln.strip() for ln in text.splitlines() if ln.strip() and ln.strip() != "Caused by:")
        msg = msg or type(exc).__name__
        return ParityResult("error", f"tract failed to load or run this archive: {msg}")
    diff = np.abs(ours.logits.astype(np.float64) - theirs.logits.astype(np.float64))
    per_call = [float(x) for x in diff.max(axis=1)]
    scale = float(np.max(np.abs(theirs.logits))) or 1.0
    max_abs = float(diff.max())
    agree = float(np.mean(np.argmax(ours.logits, -1) == np.argmax(theirs.logits, -1)))
    ok = bool(np.isfinite(max_abs)) and max_abs <= atol + rtol * scale
    return ParityResult("ok" if ok else "mismatch", "" if ok else
                        f"max |logits - tract| = {max_abs:.3g} > {atol:g} + {rtol:g} * {scale:.3g}",
                        calls=ours.calls, max_abs=max_abs, max_rel=max_abs / scale, argmax_agreement=agree,
                        per_call_max_abs=per_call, seconds=theirs.seconds)


def reference_trace(reference: Any, prompt: Sequence[int], steps: int,
                    on_call: Callable[[], None] | None = None) -> DecodeTrace:
    """Greedy decode of the f32 reference, capturing attention outputs."""
    return run_decode(InterpreterDecoder(reference, capture_attention=True), prompt, steps, on_call=on_call)


def numeric_cost(model: Any, ref: DecodeTrace, on_call: Callable[[], None] | None = None
                 ) -> tuple[NumericCost, DecodeTrace]:
    """Decode ``model`` on the reference's tokens and measure how far it lands from the reference."""
    steps = ref.calls - 1
    trace = run_decode(InterpreterDecoder(model, capture_attention=True), ref.tokens[:ref.n_prompt], steps,
                       tokens=ref.tokens, on_call=on_call)
    if trace.logits.shape != ref.logits.shape:
        raise InputError(f"the archive's logits {trace.logits.shape[1:]} and the reference's "
                         f"{ref.logits.shape[1:]} differ: not the same model")
    layers = len(ref.attention[0]) if ref.attention else 0
    note = ("relative L2 of each attention op's output [B, Hq, Sq, D] vs the reference's, per call and layer "
            "(k-th attention op in graph order = layer k)")
    attention: list[list[float]] | None = []
    if not layers or any(len(a) != layers for a in trace.attention + ref.attention):
        attention = None
        note = (f"not comparable: the reference has {layers} attention ops per call, the archive "
                f"{len(trace.attention[0]) if trace.attention else 0}")
    else:
        for got, want in zip(trace.attention, ref.attention):
            row = []
            for a, b in zip(got, want):
                if a.size != b.size:
                    attention, note = None, (f"not comparable: attention outputs of {a.shape} vs the "
                                             f"reference's {b.shape}")
                    break
                row.append(rel_l2(a, b))
            if attention is None:
                break
            attention.append(row)
    kl = kl_divergence(ref.logits, trace.logits)
    cost = NumericCost(
        calls=trace.calls, tokens=list(ref.tokens), n_prompt=ref.n_prompt, layers=layers, attention=attention,
        attention_note=note,
        logits_rel_l2=[rel_l2(a, b) for a, b in zip(trace.logits, ref.logits)],
        logits_max_abs=[float(np.max(np.abs(a.astype(np.float64) - b))) for a, b in zip(trace.logits, ref.logits)],
        kl=[float(x) for x in kl], ref_tokens=ref.predictions, tokens_pred=trace.predictions,
        kv_bytes=dict(trace.kv_bytes), ref_kv_bytes=dict(ref.kv_bytes))
    return cost, trace


def validate_model(model: Any, reference: Any | None = None, options: ValidateOptions | None = None,
                   ref_trace: DecodeTrace | None = None, progress: Callable[[], None] | None = None,
                   path: str | None = None) -> ValidationReport:
    """Run every check on ``model`` (an :class:`nnef_kv.Model`); ``reference`` (f32 model) enables the cost.

    ``ref_trace`` reuses a reference decode (several archives against one reference, as ``demo`` does).
    ``path``: an archive file holding ``model`` unchanged, for tract (else a temporary copy is written).
    """
    o = options or ValidateOptions()
    if o.steps < 0:
        raise InputError(f"steps must be >= 0, got {o.steps}")
    rep = ValidationReport(archive=str(path or getattr(model, "source", None) or "<in memory>"),
                           reference=None if reference is None else str(getattr(reference, "source", None) or "<in memory>"),
                           options=o)
    if o.round_trip:
        rep.round_trip = check_round_trip(model)
        rep.checks.append(Check("round trip", rep.round_trip.ok,
                                "read, write, read: identical graph and tensors; identical bytes on a second write"
                                if rep.round_trip.ok else "; ".join(rep.round_trip.problems)))
    if reference is None and ref_trace is None:
        try:
            InterpreterDecoder(model)
        except InputError as exc:  # not a decoder: the round trip is all there is to check
            rep.notes.append(f"decode, tract parity and numeric cost skipped: {exc}")
            _threshold_checks(rep, o)
            return rep
    if ref_trace is None:
        src = reference if reference is not None else model
        prompt = list(o.prompt_ids) if o.prompt_ids else default_prompt(_vocab_of(src), o.prompt_len, o.seed)
        if reference is not None:
            ref_trace = reference_trace(reference, prompt, o.steps, on_call=progress)
    else:
        prompt = ref_trace.tokens[:ref_trace.n_prompt]
    rep.prompt = [int(t) for t in prompt]
    trace: DecodeTrace | None = None
    if ref_trace is not None:
        rep.cost, trace = numeric_cost(model, ref_trace, on_call=progress)
    else:
        trace = run_decode(InterpreterDecoder(model), prompt, o.steps, on_call=progress)
    rep.trace_kv_bytes = dict(trace.kv_bytes)
    rep.seconds["archive"] = trace.seconds
    if ref_trace is not None:
        rep.seconds["reference"] = ref_trace.seconds
    if o.parity:
        rep.parity = tract_parity(model, trace.tokens, trace.n_prompt, trace, o.parity_atol, o.parity_rtol,
                                  on_call=progress, path=path)
        if rep.parity.status != "skipped":
            if rep.parity.status == "error":
                rep.checks.append(Check("tract parity", False, rep.parity.reason))
            else:
                rep.checks.append(Check("tract parity", rep.parity.status == "ok",
                                        f"max |logits - tract| {rep.parity.max_abs:.3g} over {rep.parity.calls} "
                                        f"calls, argmax agreement {rep.parity.argmax_agreement:.3f}"
                                        + (f" ({rep.parity.reason})" if rep.parity.reason else "")))
    _threshold_checks(rep, o)
    return rep


def _threshold_checks(rep: ValidationReport, o: ValidateOptions) -> None:
    c = rep.cost
    if o.max_attention_deviation is not None:
        if c is None or c.attention_max is None:
            rep.checks.append(Check("max attention deviation", False,
                                    "no attention deviation measured (needs --reference and comparable attention ops)"))
        else:
            rep.checks.append(Check("max attention deviation", c.attention_max <= o.max_attention_deviation,
                                    f"worst {c.attention_max:.4g} (limit {o.max_attention_deviation:g})"))
    if o.min_token_agreement is not None:
        if c is None:
            rep.checks.append(Check("min token agreement", False, "needs --reference"))
        else:
            rep.checks.append(Check("min token agreement", c.token_agreement >= o.min_token_agreement,
                                    f"{c.token_agreement:.4f} (limit {o.min_token_agreement:g})"))
    if o.max_kl is not None:
        if c is None:
            rep.checks.append(Check("max KL", False, "needs --reference"))
        else:
            mean_kl = c.kl_stats().get("mean", float("nan"))
            rep.checks.append(Check("max KL", bool(mean_kl <= o.max_kl), f"mean KL {mean_kl:.4g} nats (limit {o.max_kl:g})"))
