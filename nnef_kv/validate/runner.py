"""``nnef-kv validate``: what a quantized KV cache costs on the user's model and text, where it acts.

For each context length ``L`` (``contexts``, or a default long enough that most of the context is
quantized), in the archive and in the reference (the f32 archive it was converted from):

1. prefill the first ``L`` tokens of the text in one call (or calls of ``chunk`` tokens);
2. teacher-force the next ``eval_tokens - 1`` tokens of the text in one *stepwise* run
   (:meth:`Session.run` with ``stepwise=True``: each answered exactly as a one-token call would be,
   every weight product run once);
3. so ``eval_tokens`` predictions are measured: those of tokens ``L .. L+N-1`` (the prefill's last
   position predicts token ``L``).

At every evaluated token: ``KL(p_ref || p)``, whether the top-1 tokens agree, the NLL of the true next
token under both (perplexity of each and their ratio), the per-layer attention deviation (relative L2
of each attention op's output for that token against the reference's), and how many quantized
entries the token's attention read. Per context: the tokens each KV op holds quantized and in full
precision, and the KV bytes against an f32 cache of the same length. Reported as llama.cpp's
``llama-perplexity --kl-divergence`` does (mean KLD with its standard error, median, p90/p99/max,
"same top" %, ppl and ppl ratio).

No vacuous verdicts: a context whose evaluated tokens read no quantized entry fails the check
"quantized entries read" (``validate`` exits 1, saying which context and the window it fits in);
without thresholds the verdict is ``measured``, never ``pass``. The reference must be the same model:
refused when its weights differ from the archive's (``allow_different_weights`` to override) or when it
holds quantized KV ops itself. Every refusal happens before any decoding.
"""
from __future__ import annotations

import hashlib
import os
import time
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import InputError, NnefKvError
from .decode import InterpreterDecoder, TractDecoder, tract_available
from .results import (DEFAULT_CONTEXT_FLOOR, THRESHOLDS, Check, ContextResult, Measurement, ParityResult,
                      ValidateOptions, ValidationReport)
from .roundtrip import check_round_trip

__all__ = ["ValidateOptions", "Check", "ParityResult", "ContextResult", "Measurement", "ValidationReport",
           "validate_model", "resolve_contexts", "max_positions", "vocab_size", "check_same_model",
           "DEFAULT_CONTEXT_FLOOR", "THRESHOLDS"]

def vocab_size(session: Any, sig: Any) -> int | None:
    """The number of token ids the model embeds: the size of the constant table a gather of the ids
    input reads (through casts), else None."""
    plan = session.plan
    ids_slot = next(s.slot for s in plan.inputs if s.name == sig.ids_input)
    fed = {ids_slot}
    for node in plan.step_nodes:
        ins = [x for x in node.inputs if isinstance(x, int)]
        if node.op in ("tract_core_cast", "cast", "copy") and ins and ins[0] in fed:
            fed.update(o for o in node.outputs if isinstance(o, int))
            continue
        if node.op in ("gather", "tract_core_gather") and len(ins) >= 2 and ins[1] in fed:
            table = plan.base[ins[0]]
            if isinstance(table, np.ndarray):
                axis = int(node.attrs.get("axis", 0))
                return int(table.shape[axis])
    return None


def max_positions(session: Any) -> tuple[int | None, str]:
    """The most positions (tokens in the cache after a call) the graph's ``tract_assert`` lines allow,
    and the assertion that bounds it; ``(None, "")`` when nothing bounds it."""
    g = session.plan.graph
    if not g.assertions:
        return None, ""
    tok, _ = session.token_inputs()
    others = [s for s in g.symbols if s != tok]

    def failing(total: int) -> Any:
        for env in ({tok: 1, **{s: total - 1 for s in others}}, {tok: total, **{s: 0 for s in others}}):
            for a in g.assertions:
                if a.check(env) is False:
                    return a
        return None

    if failing(1) is not None:
        return None, ""
    top = 1 << 40
    if failing(top) is None:
        return None, ""
    lo, hi = 1, top  # failing(lo) is None, failing(hi) is not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if failing(mid) is None:
            lo = mid
        else:
            hi = mid
    return lo, f"tract_assert {failing(hi).text}"


def _tensor_digest(x: Any) -> tuple:
    if isinstance(x, np.ndarray):
        a = np.ascontiguousarray(x)
        return ("array", str(a.dtype), tuple(a.shape), hashlib.sha256(a.view(np.uint8).reshape(-1)).hexdigest())
    blocks = getattr(x, "blocks", None)
    if blocks is not None:  # block-quantized weights
        return (
            "blocks",
            tuple(getattr(x, "shape", ())),
            hashlib.sha256(np.ascontiguousarray(blocks).tobytes()).hexdigest(),
        )
    return ("other", repr(x)[:200])


def check_same_model(model: Any, reference: Any, where: str = "--reference") -> None:
    """InputError when the archive's weights are not all in the reference (the converter never changes
    a variable's tensor: a different tensor means a different model)."""
    mine = dict(getattr(model, "tensors", {}) or {})
    theirs = dict(getattr(reference, "tensors", {}) or {})
    ref_digests: dict[tuple, str] = {}
    for label, t in theirs.items():
        ref_digests.setdefault(_tensor_digest(t), label)
    for label, t in sorted(mine.items()):
        dg = _tensor_digest(t)
        if dg in ref_digests:
            continue
        if label in theirs:
            detail = f"its tensor '{label}' differs from the archive's"
        else:
            detail = f"it has no tensor equal to the archive's '{label}'"
        raise InputError(f"{where}: not the same model as the archive: {detail} (a converted archive keeps "
                         f"every weight of its source; --allow-different-weights compares anyway)")


# ---------------------------------------------------------------------------------------------- contexts
def resolve_contexts(options: ValidateOptions, n_text: int, maxpos: tuple[int | None, str],
                     windows: list[int], names: dict[str, str] | None = None) -> tuple[list[int], list[str]]:
    """The contexts to measure and notes on how defaults were chosen. A context the model cannot hold
    (``L + eval_tokens - 1`` positions) or the text cannot feed (``L + eval_tokens`` tokens) -> InputError
    naming both numbers."""
    nm = {"contexts": "--context", "eval_tokens": "--eval-tokens", **(names or {})}
    n = options.eval_tokens
    top, bound = maxpos
    notes: list[str] = []
    if options.contexts:
        for c in options.contexts:
            if top is not None and c + n - 1 > top:
                raise InputError(f"{nm['contexts']} {c}: with {nm['eval_tokens']} {n} the model must hold {c + n - 1} "
                                 f"positions, it holds at most {top} ({bound})")
            if c + n > n_text:
                raise InputError(f"{nm['contexts']} {c}: with {nm['eval_tokens']} {n} it needs {c + n} tokens of text, "
                                 f"the text has {n_text}")
        return sorted(set(int(c) for c in options.contexts)), notes
    w = max(windows, default=0)
    want = max(8 * w, DEFAULT_CONTEXT_FLOOR)
    caps = [(want, f"8 x the full-precision window {w}" if 8 * w >= DEFAULT_CONTEXT_FLOOR
             else f"at least {DEFAULT_CONTEXT_FLOOR}")]
    if top is not None:
        caps.append((top - n + 1, f"the model's {top} positions ({bound}) less {nm['eval_tokens']} {n} - 1"))
    caps.append((n_text - n, f"the text's {n_text} tokens less {nm['eval_tokens']} {n}"))
    c, why = min(caps, key=lambda t: t[0])
    if c < 1:
        raise InputError(f"{nm['eval_tokens']} {n}: the text has {n_text} tokens, at least {n + 1} are needed"
                         if c == n_text - n else
                         f"{nm['eval_tokens']} {n}: the model holds at most {top} positions ({bound})")
    notes.append(f"context {c} (default: {why})")
    return [c], notes


# ---------------------------------------------------------------------------------------------- running
def _measure(dec: Any, ids: Sequence[int], ctx: int, n: int, chunk: int | None,
             on_call: Callable[[], None] | None) -> Measurement:
    dec.reset()
    t0 = time.perf_counter()
    size = ctx if not chunk else int(chunk)
    parts = [list(ids[i:min(i + size, ctx)]) for i in range(0, ctx, size)]
    for part in parts[:-1]:
        dec.prefill(part)
        if on_call:
            on_call()
    read0 = dec.reads_quantized(len(parts[-1]), stepwise=False)[-1:]
    lg0, att0 = dec.prefill(parts[-1])
    if on_call:
        on_call()
    rest = list(ids[ctx:ctx + n - 1])
    reads = np.concatenate([read0, dec.reads_quantized(len(rest), stepwise=True)])
    lg, att = dec.teacher(rest) if rest else (np.zeros((0, lg0.shape[-1]), np.float32), [a[:, :, :0] for a in att0])
    if on_call:
        on_call()
    seconds = time.perf_counter() - t0
    logits = np.concatenate([lg0[None], lg]) if len(rest) else lg0[None]
    attention = [np.concatenate([a0, a], axis=2) for a0, a in zip(att0, att)] if att0 else []
    census = dec.census()
    return Measurement(
        logits=logits,
        attention=attention,
        reads=reads.astype(np.int64),
        census=census,
        kv_bytes=int(sum(c["bytes"] for c in census)),
        kv_bytes_f32=int(sum(c["bytes_f32"] for c in census)),
        kv_bytes_used=int(sum(c["bytes_used"] for c in census)),
        seconds=seconds,
        logits_dtype=str(getattr(dec, "logits_dtype", "float32")),
    )


def _kv_op_settings(dec: InterpreterDecoder) -> list[dict[str, Any]]:
    from ..kv.schemes import report_settings

    out = []
    for node, st in dec.quantized_ops():
        settings = report_settings(node.op, node.attrs)  # what the schemes writing the op show (fixed bits too)
        out.append({"node": node.name, "op": node.op, "settings": settings, "fp_window": int(st.fp_window),
                    "window": getattr(st, "window_text", "")})
    return out


def _parity_tolerance(options: ValidateOptions, dtype: str) -> tuple[float, float]:
    f16 = dtype == "float16"
    atol = options.parity_atol if options.parity_atol is not None else (1e-3 if f16 else 1e-4)
    rtol = options.parity_rtol if options.parity_rtol is not None else (2e-2 if f16 else 1e-3)
    return atol, rtol


def tract_parity(model: Any, dec: InterpreterDecoder, ids: Sequence[int], res: ContextResult,
                 options: ValidateOptions, path: str | None = None,
                 on_call: Callable[[], None] | None = None) -> ParityResult:
    """tract on the same teacher-forced tokens as ``res`` (prefill, then one-token calls), logits compared."""
    atol, rtol = _parity_tolerance(options, res.archive.logits_dtype)
    if not tract_available():
        return ParityResult("skipped", "the tract Python package is not installed", atol=atol, rtol=rtol)
    own = sorted({n.op for n in dec.session.plan.step_nodes if n.op.startswith("nnef_kv_")})
    if own:
        return ParityResult("skipped", f"tract cannot load this archive: it uses nnef-kv's own op(s) "
                                       f"{', '.join(own)} (extension nnef_kv), which tract does not implement",
                            atol=atol, rtol=rtol)

    def run() -> tuple[np.ndarray, float]:
        # the archive at ``path`` when the caller vouches it holds ``model`` unchanged, else the model itself
        # (a converted model keeps its source's path: never trust ``model.source``)
        t = TractDecoder(path if path and os.path.exists(path) else model, dec.sig)
        t0 = time.perf_counter()
        m = _measure(t, ids, res.context, res.eval_tokens, res.chunk, on_call)
        return m.logits, time.perf_counter() - t0

    try:
        theirs, seconds = run()
    except NnefKvError:
        raise
    except BaseException as exc:  # tract raises its own errors (and pyo3 panics are BaseException)
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        text = str(exc).split("Stack backtrace", 1)[0]
        msg = " / ".join(ln.strip() for ln in text.splitlines() if ln.strip() and ln.strip() != "Caused by:")
        return ParityResult("error", f"tract failed to load or run this archive: {msg or type(exc).__name__}",
                            atol=atol, rtol=rtol)
    ours = res.archive.logits
    diff = np.abs(ours.astype(np.float64) - theirs.astype(np.float64))
    scale = float(np.max(np.abs(theirs))) or 1.0
    max_abs = float(diff.max())
    agree = float(np.mean(np.argmax(ours, -1) == np.argmax(theirs, -1)))
    ok = bool(np.isfinite(max_abs)) and max_abs <= atol + rtol * scale
    return ParityResult("ok" if ok else "mismatch", "" if ok else
                        f"max |logits - tract| = {max_abs:.3g} > {atol:g} + {rtol:g} * {scale:.3g}",
                        calls=len(ours), max_abs=max_abs, max_rel=max_abs / scale, argmax_agreement=agree,
                        atol=atol, rtol=rtol, seconds=seconds)


def _decoder(model: Any, capture: bool, what: str) -> InterpreterDecoder:
    try:
        return InterpreterDecoder(model, capture_attention=capture)
    except InputError as exc:
        raise InputError(f"{what}: not a decoder nnef-kv can drive ({exc})") from None


def validate_model(model: Any, reference: Any | None = None, source: Any = None,
                   options: ValidateOptions | None = None, progress: Callable[[], None] | None = None,
                   path: str | None = None, reference_runs: dict[int, Measurement] | None = None,
                   names: dict[str, str] | None = None) -> ValidationReport:
    """Validate ``model`` (an :class:`nnef_kv.Model`) on the tokens of ``source`` (a
    :class:`~nnef_kv.text.TokenSource`) against ``reference`` (the f32 model it was converted from).

    ``path``: an archive file holding ``model`` unchanged (for tract; else a temporary copy is written).
    ``reference_runs``: context -> reference :class:`Measurement`, reused and filled (several archives
    against one reference, as ``demo`` does). ``names``: option names for error messages (the CLI's)."""
    o = (options or ValidateOptions()).check(names)
    if source is None:
        raise InputError("validate: no tokens given (text, prompt or ids)")
    label = str(path or getattr(model, "source", None) or "<in memory>")
    rep = ValidationReport(
        archive=label,
        options=o,
        tokens=source.description,
        n_tokens=len(source.ids),
        reference=None if reference is None else str(getattr(reference, "source", None) or "<in memory>"),
    )
    rep.notes += list(source.notes)
    dec = _decoder(model, capture=reference is not None, what=label)
    ref_dec = None
    if reference is not None:
        ref_dec = _decoder(
            reference, capture=True, what=f"{(names or {}).get('reference', 'reference')} {rep.reference}"
        )
        held = ref_dec.quantized_ops()
        if held:
            raise InputError(f"{(names or {}).get('reference', 'reference')} {rep.reference}: the reference holds a "
                             f"quantized KV cache itself ({held[0][0].op} '{held[0][0].name}'): compare against the "
                             f"f32 archive it was converted from")
        if not o.allow_different_weights:
            check_same_model(model, reference, (names or {}).get("reference", "reference") + f" {rep.reference}")
        elif reference is not None:
            rep.notes.append("weights not compared (allow_different_weights)")
    source.check_vocabulary(vocab_size(dec.session, dec.sig))
    rep.kv_ops = _kv_op_settings(dec)
    contexts, notes = resolve_contexts(o, len(source.ids), max_positions(dec.session),
                                       [k["fp_window"] for k in rep.kv_ops], names)
    rep.notes += notes
    if o.round_trip:
        rep.round_trip = check_round_trip(model)
        rep.checks.append(Check("round trip", rep.round_trip.ok,
                                "read, write, read: identical graph and tensors; identical bytes on a second write"
                                if rep.round_trip.ok else "; ".join(rep.round_trip.problems)))
    ids = source.ids
    for ctx in contexts:
        targets = list(ids[ctx:ctx + o.eval_tokens])
        ref_m = None
        if ref_dec is not None:
            ref_m = reference_runs.get(ctx) if reference_runs is not None else None
            if ref_m is None:
                ref_m = _measure(ref_dec, ids, ctx, o.eval_tokens, o.chunk, progress)
                if reference_runs is not None:
                    reference_runs[ctx] = ref_m
        m = _measure(dec, ids, ctx, o.eval_tokens, o.chunk, progress)
        res = ContextResult(ctx, o.eval_tokens, o.chunk, targets, m, ref_m)
        if ref_m is not None:
            if ref_m.logits.shape != m.logits.shape:
                raise InputError(f"{label}: logits of {m.logits.shape[1]} ids, the reference's of "
                                 f"{ref_m.logits.shape[1]}: not the same model")
            res.attention_note = ("relative L2 of each attention op's output [B, Hq, 1, D] for the token against "
                                  "the reference's (k-th attention op in graph order = layer k)")
            if res.attention_deviation() is None:
                res.attention_note = (f"not comparable: the archive has {len(m.attention)} attention ops, the "
                                      f"reference {len(ref_m.attention)} (or their outputs differ in shape)")
        rep.contexts.append(res)
    if o.parity and rep.contexts:
        rep.parity = tract_parity(model, dec, ids, rep.contexts[0], o, path=path, on_call=progress)
        p = rep.parity
        if p.status == "error":
            rep.checks.append(Check("tract parity", False, p.reason))
        elif p.status != "skipped":
            rep.checks.append(Check("tract parity", p.status == "ok",
                                    f"max |logits - tract| {p.max_abs:.3g} over {p.calls} tokens (tolerance {p.atol:g} "
                                    f"+ {p.rtol:g} x max |logit|), argmax agreement {p.argmax_agreement:.3f}"))
    _quantized_checks(rep, names)
    _threshold_checks(rep, o)
    return rep


def _quantized_checks(rep: ValidationReport, names: dict[str, str] | None) -> None:
    flag = (names or {}).get("contexts", "--context")
    for res in rep.contexts:
        if res.reads_quantized:
            rep.checks.append(Check(f"quantized entries read @ {res.context}", True,
                                    f"{res.reads_quantized} of {res.eval_tokens} evaluated tokens read quantized "
                                    f"entries; each KV op holds {res.quantized_tokens} tokens quantized, "
                                    f"{res.full_precision_tokens} in full precision"))
            continue
        if not rep.kv_ops:
            detail = "nothing was quantized: the archive holds no quantized KV cache (nnef-kv convert makes one)"
        else:
            w = max(k["fp_window"] for k in rep.kv_ops)
            window = next(k["window"] for k in rep.kv_ops if k["fp_window"] == w)
            detail = (f"nothing was quantized: context {res.context} fits in the full-precision window ({window}); "
                      f"use {flag} >= {max(8 * w, w + 1)}")
        rep.checks.append(Check(f"quantized entries read @ {res.context}", False, detail))


def _threshold_checks(rep: ValidationReport, o: ValidateOptions) -> None:
    for opt, limit in o.thresholds.items():
        key, kind, what = THRESHOLDS[opt]
        for res in rep.contexts:
            s = res.summary()
            val = s.get(key)
            name = f"{opt.replace('_', ' ')} @ {res.context}"
            if val is None:
                need = "a reference" if res.reference is None else "comparable attention ops"
                rep.checks.append(Check(name, False, f"{what}: not measured (needs {need})"))
                continue
            ok = bool(val <= limit) if kind == "max" else bool(val >= limit)
            rep.checks.append(Check(name, ok, f"{what} {val:.4g} (limit {limit:g})"))
