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

import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import InputError, NnefKvError
from .decode import InterpreterDecoder, TractDecoder, tract_available
from .results import (DEFAULT_CONTEXT_FLOOR, DEFAULT_EVAL_TOKENS, DEFAULT_WINDOWS, MIN_EVAL_TOKENS, THRESHOLDS, Check,
                      ContextResult, Measurement, ParityResult, ValidateOptions, ValidationReport)
from .roundtrip import check_round_trip
from .weights import check_same_model, share_weights
from ..converters.caches import refuse_exporter_problems as _exporter_bugs

__all__ = ["ValidateOptions", "Check", "ParityResult", "ContextResult", "Measurement", "ValidationReport",
           "validate_model", "resolve_contexts", "resolve_plan", "Plan", "window_starts", "max_positions",
           "vocab_size", "check_same_model", "DEFAULT_CONTEXT_FLOOR", "DEFAULT_EVAL_TOKENS", "DEFAULT_WINDOWS",
           "MIN_EVAL_TOKENS", "THRESHOLDS"]

def vocab_size(session: Any, sig: Any) -> int | None:
    """The number of token ids the model embeds: the size of the constant table a gather of the ids
    input reads (through casts), else None."""
    plan = session.plan
    ids_slot = next(s.slot for s in plan.inputs if s.name == sig.ids_input)
    fed = {ids_slot}
    from ..interpreter.catalog import ops_having

    passthrough, gathers = ops_having("passthrough"), ops_having("gather")
    for node in plan.graph.nodes:  # the graph as built: the planner may fuse the gather into a step (torch-to-nnef)
        ins = [x for x in node.inputs if isinstance(x, int)]
        if node.op in passthrough and ins and ins[0] in fed:
            fed.update(o for o in node.outputs if isinstance(o, int))
            continue
        if node.op in gathers and len(ins) >= 2 and ins[1] in fed:
            table = plan.base[ins[0]]
            if isinstance(getattr(table, "shape", None), tuple):  # an array, or block-quantized weights
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


# ---------------------------------------------------------------------------------------------- contexts
@dataclass
class Plan:
    """What is measured: the contexts, the predictions per window, and each window's first predicted token
    (its index in the text: the same tokens are predicted at every context and by every scheme; a window's
    prefill is the ``context`` tokens before it)."""

    contexts: list[int]
    eval_tokens: int
    starts: list[int]
    notes: list[str] = field(default_factory=list)

    @property
    def predictions(self) -> int:
        return self.eval_tokens * len(self.starts)


def window_starts(count: int, context: int, n: int, n_text: int, seed: int = 0) -> list[int]:
    """``count`` disjoint windows of ``context + n`` tokens in ``n_text``; each window's first predicted token.
    ``seed`` 0: spread evenly (the first at the text's start); another seed: the spare text divided at random."""
    span = context + n
    slack = n_text - count * span
    if slack < 0:
        raise ValueError("the windows do not fit in the text")
    if seed == 0:
        gaps = [0] + [slack // max(count - 1, 1)] * (count - 1) if count > 1 else [0]
    else:
        rng = np.random.default_rng(seed)
        gaps = list(rng.multinomial(slack, [1.0 / (count + 1)] * (count + 1))[:count])
    out, at = [], 0
    for g in gaps:
        at += int(g)
        out.append(at + context)
        at += span
    return out


def resolve_plan(options: ValidateOptions, n_text: int, maxpos: tuple[int | None, str], windows: list[int],
                 names: dict[str, str] | None = None) -> Plan:
    """The one rule for what ``validate``, ``compare`` and auto-bits measure, from the options, the KV ops'
    full-precision windows (``windows``), the model's bound (``maxpos``) and the text's length:

    * contexts: as given, else ``max(8 x window, DEFAULT_CONTEXT_FLOOR)`` capped so that the model holds
      the context and ``MIN_EVAL_TOKENS`` predictions (or ``--eval-tokens``) and the text feeds them;
    * predictions per window: as given, else ``DEFAULT_EVAL_TOKENS`` capped by the model and the text;
    * windows: as given, else as many as the text holds up to ``DEFAULT_WINDOWS`` (at least one).

    A given value the model or the text cannot satisfy -> InputError naming the option and both numbers."""
    nm = {"contexts": "--context", "eval_tokens": "--eval-tokens", "windows": "--windows", **(names or {})}
    top, bound = maxpos
    given_n = options.eval_tokens
    notes: list[str] = []
    if options.contexts:
        contexts = sorted(set(int(c) for c in options.contexts))
        floor_n = given_n or 1
        with_n = f"with {nm['eval_tokens']} {floor_n}" if given_n else "with one prediction"
        for c in contexts:
            if top is not None and c + floor_n - 1 > top:
                raise InputError(f"{nm['contexts']} {c}: {with_n} the model must hold {c + floor_n - 1} positions, it "
                                 f"holds at most {top} ({bound})")
            if c + floor_n > n_text:
                raise InputError(f"{nm['contexts']} {c}: {with_n} it needs {c + floor_n} tokens of text, the text has "
                                 f"{n_text}")
    else:
        w = max(windows, default=0)
        want = max(8 * w, DEFAULT_CONTEXT_FLOOR)
        need = given_n or MIN_EVAL_TOKENS
        caps = [(want, f"8 x the full-precision window {w}" if 8 * w >= DEFAULT_CONTEXT_FLOOR
                 else f"at least {DEFAULT_CONTEXT_FLOOR}")]
        if top is not None:
            caps.append((top - need + 1, f"the model's {top} positions ({bound}) less {need - 1} predictions"))
        caps.append((n_text - need, f"the text's {n_text} tokens less {need} predictions"))
        c, why = min(caps, key=lambda t: t[0])
        if c < 1:
            raise InputError(f"{nm['eval_tokens']} {need}: the text has {n_text} tokens, at least {need + 1} are "
                             f"needed" if c == n_text - need else
                             f"{nm['eval_tokens']} {need}: the model holds at most {top} positions ({bound})")
        contexts = [c]
        notes.append(f"context {c} (default: {why})")
    cmax = max(contexts)
    if given_n is None:
        caps = [(DEFAULT_EVAL_TOKENS, "the default")]
        if top is not None:
            caps.append((top - cmax + 1, f"the model's {top} positions less the context {cmax}, plus one"))
        caps.append((n_text - cmax, f"the text's {n_text} tokens less the context {cmax}"))
        n, why = min(caps, key=lambda t: t[0])
        if n < DEFAULT_EVAL_TOKENS:
            notes.append(f"{n} predictions per window (default {DEFAULT_EVAL_TOKENS}, capped by {why})")
    else:
        n = int(given_n)
    span = cmax + n
    if options.starts:  # given (a part of another plan): each must fit in the text
        for st in options.starts:
            if st < cmax or st + n > n_text:
                raise InputError(f"window at text token {st}: needs tokens {st - cmax}..{st + n - 1}, the text has "
                                 f"{n_text}")
        return Plan(contexts, n, [int(x) for x in options.starts], notes)
    if options.windows is None:
        k = max(1, min(DEFAULT_WINDOWS, n_text // span))
        if k < DEFAULT_WINDOWS:
            notes.append(f"{k} window(s) of the text (default {DEFAULT_WINDOWS}: the text's {n_text} tokens hold "
                         f"{n_text // span} of {cmax} + {n} tokens)")
    else:
        k = int(options.windows)
        if k * span > n_text:
            raise InputError(f"{nm['windows']} {k}: {k} disjoint windows of {cmax} + {n} tokens need {k * span} tokens "
                             f"of text, the text has {n_text} (at most {n_text // span} such windows)")
    starts = window_starts(k, cmax, n, n_text, options.windows_seed)
    return Plan(contexts, n, starts, notes)


def resolve_contexts(options: ValidateOptions, n_text: int, maxpos: tuple[int | None, str],
                     windows: list[int], names: dict[str, str] | None = None) -> tuple[list[int], list[str]]:
    """The contexts of :func:`resolve_plan` and its notes."""
    p = resolve_plan(options, n_text, maxpos, windows, names)
    return p.contexts, p.notes


# ---------------------------------------------------------------------------------------------- running
def _measure_one(dec: Any, ids: Sequence[int], ctx: int, start: int, n: int, chunk: int | None,
                 on_call: Callable[[], None] | None) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
    """One window: prefill ``ids[start - ctx:start]``, teacher-force ``ids[start:start + n - 1]``."""
    dec.reset()
    size = ctx if not chunk else int(chunk)
    base = start - ctx
    parts = [list(ids[base + i:base + min(i + size, ctx)]) for i in range(0, ctx, size)]
    for part in parts[:-1]:
        dec.prefill(part)
        if on_call:
            on_call()
    read0 = dec.reads_quantized(len(parts[-1]), stepwise=False)[-1:]
    lg0, att0 = dec.prefill(parts[-1])
    if on_call:
        on_call()
    rest = list(ids[start:start + n - 1])
    reads = np.concatenate([read0, dec.reads_quantized(len(rest), stepwise=True)])
    lg, att = dec.teacher(rest) if rest else (np.zeros((0, lg0.shape[-1]), np.float32), [a[:, :, :0] for a in att0])
    if on_call:
        on_call()
    logits = np.concatenate([lg0[None], lg]) if len(rest) else lg0[None]
    attention = [np.concatenate([a0, a], axis=2) for a0, a in zip(att0, att)] if att0 else []
    return logits, attention, reads


def _measure(dec: Any, ids: Sequence[int], ctx: int, n: int, chunk: int | None,
             on_call: Callable[[], None] | None, starts: Sequence[int] | None = None) -> Measurement:
    """Every window of ``starts`` (default: one, predicting from token ``ctx``), concatenated."""
    starts = list(starts) if starts else [ctx]
    t0 = time.perf_counter()
    got = [_measure_one(dec, ids, ctx, s, n, chunk, on_call) for s in starts]
    seconds = time.perf_counter() - t0
    attention = [np.concatenate([g[1][i] for g in got], axis=2) for i in range(len(got[0][1]))]
    census = dec.census()
    return Measurement(
        logits=np.concatenate([g[0] for g in got]),
        attention=attention,
        reads=np.concatenate([g[2] for g in got]).astype(np.int64),
        census=census,
        kv_bytes=int(sum(c["bytes"] for c in census)),
        kv_bytes_f32=int(sum(c["bytes_f32"] for c in census)),
        kv_bytes_used=int(sum(c["bytes_used"] for c in census)),
        seconds=seconds,
        logits_dtype=str(getattr(dec, "logits_dtype", "float32")),
        starts=starts,
    )


def targets_of(ids: Sequence[int], starts: Sequence[int], n: int) -> list[int]:
    return [int(t) for s in starts for t in ids[s:s + n]]


def _kv_op_settings(dec: InterpreterDecoder) -> list[dict[str, Any]]:
    from ..converters.schemes import report_settings

    out = []
    for node, st in dec.quantized_ops():
        settings = report_settings(node.op, node.attrs)  # what the schemes writing the op show (fixed bits too)
        out.append({"node": node.name, "op": node.op, "settings": settings, "fp_window": int(st.fp_window),
                    "window": getattr(st, "window_text", "")})
    return out


def _parity_tolerance(options: ValidateOptions, dtype: str,
                      probe: tuple[Any, Sequence[int], ContextResult] | None = None,
                      n: int | None = None) -> tuple[float, float, str]:
    """``(atol, rtol, note)``: the f32 tolerance (or the user's), plus, given ``probe = (model, ids, res)``
    of an archive holding tract's quantized KV ops, the logit movement of every code that the measured
    K/V noise against tract could flip at a rounding boundary (:mod:`nnef_kv.validate.parity`)."""
    f16 = dtype == "float16"
    atol = options.parity_atol if options.parity_atol is not None else (1e-3 if f16 else 1e-4)
    rtol = options.parity_rtol if options.parity_rtol is not None else (2e-2 if f16 else 1e-3)
    if probe is None or options.parity_atol is not None or options.parity_rtol is not None:
        return atol, rtol, ""
    from .parity import flip_bound, kv_inputs

    model, ids, res = probe
    if not kv_inputs(model.document):
        return atol, rtol, ""
    flip_dec = InterpreterDecoder(model)
    window = res.starts[:1]
    n = res.eval_tokens if n is None else n  # the predictions compared with tract
    got = flip_bound(model, flip_dec, ids, res.context, n, res.chunk, window[0],
                     lambda d: _measure(d, ids, res.context, n, res.chunk, None, window).logits,
                     res.archive.logits)
    return atol + got.logits, rtol, got.text()


def tract_parity(model: Any, dec: InterpreterDecoder, ids: Sequence[int], res: ContextResult,
                 options: ValidateOptions, path: str | None = None,
                 on_call: Callable[[], None] | None = None) -> ParityResult:
    """tract on the same teacher-forced tokens as ``res`` (prefill, then one-token calls), logits compared."""
    atol, rtol, _ = _parity_tolerance(options, res.archive.logits_dtype)
    n = min(res.eval_tokens, options.parity_tokens or res.eval_tokens)
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
        m = _measure(t, ids, res.context, n, res.chunk, on_call, res.starts[:1])  # the first window
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
    atol, rtol, note = _parity_tolerance(options, res.archive.logits_dtype, (model, ids, res), n)
    ours = res.archive.logits[:len(theirs)]
    diff = np.abs(ours.astype(np.float64) - theirs.astype(np.float64))
    scale = float(np.max(np.abs(theirs))) or 1.0
    max_abs = float(diff.max())
    agree = float(np.mean(np.argmax(ours, -1) == np.argmax(theirs, -1)))
    ok = bool(np.isfinite(max_abs)) and max_abs <= atol + rtol * scale
    why = "" if ok else f"max |logits - tract| = {max_abs:.3g} > {atol:g} + {rtol:g} * {scale:.3g}"
    return ParityResult("ok" if ok else "mismatch", "; ".join(x for x in (why, note) if x),
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
                   names: dict[str, str] | None = None, label: str | None = None) -> ValidationReport:
    """Validate ``model`` (an :class:`nnef_kv.Model`) on the tokens of ``source`` (a
    :class:`~nnef_kv.text.TokenSource`) against ``reference`` (the f32 model it was converted from).

    ``path``: an archive file holding ``model`` unchanged (for tract; else a temporary copy is written).
    ``reference_runs``: context -> reference :class:`Measurement`, reused and filled (several archives
    against one reference, as ``demo`` does). ``names``: option names for error messages (the CLI's).
    ``label``: what the report calls the model (default: ``path``, else the model's source)."""
    o = (options or ValidateOptions()).check(names)
    if source is None:
        raise InputError("validate: no tokens given (text, prompt or ids)")
    label = label or str(path or getattr(model, "source", None) or "<in memory>")
    rep = ValidationReport(
        archive=label,
        options=o,
        tokens=source.description,
        n_tokens=len(source.ids),
        reference=None if reference is None else str(getattr(reference, "source", None) or "<in memory>"),
    )
    rep.notes += list(source.notes)
    _exporter_bugs(model, label)  # a known exporter bug is explained, as inspect does (issue 23.8)
    different: InputError | None = None
    if reference is not None and not o.allow_different_weights:
        try:  # before any session is built: the archive plans on the reference's arrays (one copy, issue 26)
            share_weights(model, reference, (names or {}).get("reference", "reference") + f" {rep.reference}")
        except InputError as exc:  # refused where it always was: after the checks of the decoders
            different = exc
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
        if different is not None:
            raise different
        if o.allow_different_weights:
            rep.notes.append("weights not compared (allow_different_weights)")
    source.check_vocabulary(vocab_size(dec.session, dec.sig))
    rep.kv_ops = _kv_op_settings(dec)
    maxpos = max_positions(dec.session)
    plan = resolve_plan(o, len(source.ids), maxpos, [k["fp_window"] for k in rep.kv_ops], names)
    rep.notes += plan.notes
    rep.plan = plan
    rep.model_positions = maxpos[0]
    set_total = getattr(progress, "set_total", None)
    done = [0]
    if set_total is not None:  # the bar's total: the calls of every window (prefill parts + the stepwise run)
        def calls(c: int) -> int:
            return (-(-c // o.chunk) if o.chunk else 1) + 1

        set_total(sum(calls(c) * len(plan.starts) for c in plan.contexts) * (2 if ref_dec is not None else 1)
                  + (calls(plan.contexts[0]) if o.parity else 0))
        outer = progress

        def progress() -> None:
            done[0] += 1
            outer()
    if o.round_trip:
        rep.round_trip = check_round_trip(model)
        rep.checks.append(Check("round trip", rep.round_trip.ok,
                                "read, write, read: identical graph and tensors; identical bytes on a second write"
                                if rep.round_trip.ok else "; ".join(rep.round_trip.problems)))
    ids = source.ids
    n = plan.eval_tokens
    targets = targets_of(ids, plan.starts, n)
    for ctx in plan.contexts:
        ref_m = None
        if ref_dec is not None:
            ref_m = reference_runs.get(ctx) if reference_runs is not None else None
            if ref_m is None or ref_m.starts != plan.starts or len(ref_m.logits) != len(targets):
                ref_m = _measure(ref_dec, ids, ctx, n, o.chunk, progress, plan.starts)
                if reference_runs is not None:
                    reference_runs[ctx] = ref_m
        m = _measure(dec, ids, ctx, n, o.chunk, progress, plan.starts)
        res = ContextResult(ctx, n, o.chunk, targets, m, ref_m, starts=list(plan.starts))
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
                                    f"+ {p.rtol:g} x max |logit|), argmax agreement {p.argmax_agreement:.3f}"
                                    + (f"; {p.reason}" if p.reason else "")))
    if set_total is not None:
        set_total(done[0])  # what was run (a skipped parity run, reference runs reused)
    _finite_checks(rep)
    _quantized_checks(rep, names)
    _threshold_checks(rep, o)
    return rep


def _finite_checks(rep: ValidationReport) -> None:
    """NaN or Inf logits on either side: counted, never compared as tokens; a failed check when present."""
    for res in rep.contexts:
        s = res.summary()
        if s["nonfinite_predictions"]:
            ref = s["nonfinite_reference"]
            rep.checks.append(Check(f"finite logits @ {res.context}", False,
                                    f"{s['nonfinite_predictions']} of {res.n_predictions} predictions have NaN or Inf "
                                    f"logits (archive {s['nonfinite_archive']}"
                                    + ("" if ref is None else f", reference {ref}")
                                    + f"): left out of every figure, which rest on the {s['predictions']} others"))


def _quantized_checks(rep: ValidationReport, names: dict[str, str] | None) -> None:
    flag = (names or {}).get("contexts", "--context")
    for res in rep.contexts:
        if res.reads_quantized:
            rep.checks.append(Check(f"quantized entries read @ {res.context}", True,
                                    f"{res.reads_quantized} of {res.n_predictions} evaluated tokens read quantized "
                                    f"entries; each KV op holds {res.quantized_tokens} tokens quantized, "
                                    f"{res.full_precision_tokens} in full precision"))
            continue
        if not rep.kv_ops:
            detail = "nothing was quantized: the archive holds no quantized KV cache (nnef-kv convert makes one)"
        else:
            w = max(k["fp_window"] for k in rep.kv_ops)
            window = next(k["window"] for k in rep.kv_ops if k["fp_window"] == w)
            detail = (f"nothing was quantized: context {res.context} fits in the full-precision window ({window}); "
                      + _context_hint(flag, w, res.eval_tokens, rep.model_positions, rep.n_tokens))
        rep.checks.append(Check(f"quantized entries read @ {res.context}", False, detail))


def _context_hint(flag: str, w: int, n: int, top: int | None, n_text: int) -> str:
    """What to do when a context reads nothing quantized: a longer context only when the model and the text
    can hold one (never a hint the model cannot satisfy)."""
    want, least = max(8 * w, w + 1), w + 1
    room = min(x for x in (top - n + 1 if top is not None else None, n_text - n) if x is not None)
    if room >= want:
        return f"use {flag} >= {want}"
    if room >= least:
        return f"use {flag} {room} (the longest the model and the text allow; > {w} reads quantized entries)"
    bound = f"the model holds {top} positions" if top is not None and top - n + 1 <= n_text - n else \
        f"the text has {n_text} tokens"
    return (f"no context can read a quantized entry here ({bound}, fewer than the window {w} + {n} predictions): "
            f"convert with a smaller full-precision window (e.g. --residual)")


#: thresholds judged on the interval's bound (the others on the value itself)
BOUNDED = {"max_kl": ("kl_mean_ci95", 1), "min_token_agreement": ("top1_agreement_ci95", 0),
           "max_ppl_ratio": ("ppl_ratio_ci95", 1)}


def _threshold_checks(rep: ValidationReport, o: ValidateOptions) -> None:
    """A threshold on a mean holds when its 95% interval's bound does (the upper bound for a maximum, the
    lower for a minimum): a pass that more text would not overturn, at 95% confidence. The worst attention
    deviation is a maximum over tokens, judged as measured."""
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
            if opt in BOUNDED:
                ci_key, side = BOUNDED[opt]
                ci = s.get(ci_key) or [math.nan, math.nan]
                bound = float(ci[side])
                ok = bool(bound <= limit) if kind == "max" else bool(bound >= limit)
                which = "upper" if kind == "max" else "lower"
                rel = ("<=" if ok else ">") if kind == "max" else (">=" if ok else "<")
                rep.checks.append(Check(name, ok, f"{what} {val:.4g}, 95% interval [{ci[0]:.4g}, {ci[1]:.4g}] over "
                                                  f"{s['predictions']} predictions: {which} bound {bound:.4g} {rel} "
                                                  f"limit {limit:g} (judged on the interval's {which} bound)"))
                continue
            ok = bool(val <= limit) if kind == "max" else bool(val >= limit)
            rep.checks.append(Check(name, ok, f"{what} {val:.4g} (limit {limit:g}; a maximum over tokens, "
                                              f"no interval)"))
