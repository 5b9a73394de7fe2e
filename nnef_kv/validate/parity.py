"""The tract-parity tolerance of an archive holding tract's quantized KV ops, derived from code flips.

nnef-kv stores tract's codes bit for bit *on the same K/V* (``tests/oracle/test_tract_parity.py``), but in a
whole decoder the K/V differ: the projections feeding them accumulate in another order in tract than in
NumPy's BLAS (the first difference of the trained decoder is layer 0's RMS norm ``mean_reduce``, 2e-9;
after the k/v ``linear`` it is 1e-6, after four layers 4e-6). That f32 noise carries the few codes that
lie at a rounding boundary to the other neighbour, which moves a stored value by a whole quantization
step: far more than an f32 tolerance allows, and tract disagrees with itself across chunkings the same way.

So the tolerance is derived, on the parity's own tokens, in two measured steps:

1. **the f32 noise**: tract and nnef-kv run the archive's *f32 twin* (each quantized cache made
   ``tract_transformers_dyn_kv_cache``; each fused op a ``dyn_kv_cache`` pair and a causal
   ``tract_transformers_sdpa``, which nnef-kv's stepwise teacher run answers as tract's one-token
   calls) with the K/V inputs of those ops as extra outputs; ``eps`` of an input is
   ``max |K/V of nnef-kv - K/V of tract|`` over the tokens. On the quantized archive itself the K/V
   of later layers differ by more where an earlier layer's flipped code moved its attention (1e-3 on
   the trained decoder at 512 tokens): that is the effect to bound, not the noise that causes it.
2. **the flips that noise can cause**: nnef-kv runs the quantized archive again with each quantized
   state's ``flip_margin = eps``: every code whose pre-rounding value lies within ``4 eps / step`` of a
   half-integer (the most ``eps`` on ``x``, ``lo`` and ``hi`` can move it,
   :func:`nnef_kv.kv.tract_dyn_cache.flip_at_boundary`) is stored as its other neighbour, one step
   away. ``flip = max |logits(flipped) - logits|``.

The tolerance is the f32 one plus ``flip``: every code that the f32 noise could flip, flipped at once
(tract flips a subset of them). Nothing is derived when there is no quantized op, when the user gave
``--parity-atol`` / ``--parity-rtol``, or when the probe cannot run (then the f32 tolerance stands and
the note says why).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ..grammar import ast

__all__ = ["QUANTIZED_TRACT_OPS", "FlipBound", "kv_inputs", "flip_bound"]

def _tract_quantized(role: str) -> str:
    from ..interpreter.catalog import ops_with

    (op,) = ops_with(registry="tract_transformers", role=role, quantized=True)
    return op


#: the tract ops whose stored codes depend on rounding boundaries: (its quantized dyn cache, its fused op)
QUANTIZED_TRACT_OPS = (_tract_quantized("kv-cache"), _tract_quantized("attention+kv"))


@dataclass
class FlipBound:
    """What :func:`flip_bound` measured: the logit movement of the flipped run and how it got there."""

    logits: float = 0.0  # max |logits(flipped) - logits(nnef-kv)|
    noise: dict[str, float] = dataclasses.field(default_factory=dict)  # K/V input -> eps
    flipped: int = 0  # codes stored at the other neighbour in the flipped run
    note: str = ""  # why nothing was derived, or the summary

    def text(self) -> str:
        if self.note:
            return self.note
        worst = max(self.noise.values()) if self.noise else 0.0
        return (f"quantized-cache term {self.logits:.3g}: K/V noise vs tract up to {worst:.3g}, "
                f"{self.flipped} boundary codes flipped")


def kv_inputs(document: ast.Document) -> list[tuple[str, str, list[str]]]:
    """``(result, op, [input identifiers])`` of every quantized tract op of the graph: the cache's ``input``,
    the fused op's ``k`` and ``v`` (inputs given by an expression, not a name, are left out)."""
    out = []
    for a in document.graph.body if document.graph else ():
        rhs = a.rhs
        if not isinstance(rhs, ast.Invocation) or rhs.name not in QUANTIZED_TRACT_OPS:
            continue
        pos = list(rhs.positional())
        named = rhs.named()
        if rhs.name == QUANTIZED_TRACT_OPS[0]:
            args = [pos[0] if pos else named.get("input")]
        else:
            args = [pos[i] if len(pos) > i else named.get(k) for i, k in ((1, "k"), (2, "v"))]
        lhs = a.lhs.name if isinstance(a.lhs, ast.Identifier) else ""
        out.append((lhs, rhs.name, [x.name if isinstance(x, ast.Identifier) else "" for x in args]))
    return out


def _schedule(ids: Sequence[int], ctx: int, n: int, chunk: int | None,
              start: int) -> list[tuple[list[int], bool]]:
    """The calls of validation's window at ``start``: the prefill of ``ids[start - ctx:start]`` in
    ``chunk``-token calls, then the teacher tokens (one stepwise run on nnef-kv's side, one-token calls
    on tract's)."""
    size = ctx if not chunk else int(chunk)
    base = start - ctx
    calls = [(list(ids[base + i:base + min(i + size, ctx)]), False) for i in range(0, ctx, size)]
    rest = list(ids[start:start + n - 1])
    return calls + ([(rest, True)] if rest else [])


def _with_outputs(model: Any, names: list[str]) -> Any:
    doc = model.document
    graph = dataclasses.replace(doc.graph, outputs=tuple(doc.graph.outputs) + tuple(names))
    return dataclasses.replace(model, document=dataclasses.replace(doc, graph=graph), text=None)


def _twin(model: Any, found: list, shapes: dict[str, tuple], token_symbol: str) -> Any:
    """The f32 twin of ``model``: tract's exact cache for each quantized one, a cache pair and a
    causal ``tract_transformers_sdpa`` for each fused op (``shapes``: K/V input -> [B, H, S, D])."""
    doc, past = model.document, "NNEF_KV_PROBE_PAST"
    fused = {lhs for lhs, op, _ in found if op == QUANTIZED_TRACT_OPS[1]}
    body: list[ast.Assignment] = []

    def dims(shape: tuple, sym: str) -> ast.ArrayExpr:
        return ast.ArrayExpr(tuple(ast.Identifier(sym) if i == 2 else ast.IntegerLiteral(int(d))
                                   for i, d in enumerate(shape)))

    for a in doc.graph.body:
        rhs = a.rhs
        if isinstance(rhs, ast.Invocation) and rhs.name == QUANTIZED_TRACT_OPS[0]:
            args = tuple(x for x in rhs.args if x.name not in ("bits", "per_channel"))
            body.append(dataclasses.replace(a, rhs=dataclasses.replace(rhs, name="tract_transformers_dyn_kv_cache",
                                                                       args=args)))
        elif isinstance(rhs, ast.Invocation) and isinstance(a.lhs, ast.Identifier) and a.lhs.name in fused:
            q, k, v = rhs.positional()[:3]
            cached = []
            for role, x in (("k", k), ("v", v)):
                name = f"{a.lhs.name}_probe_{role}"
                sh = shapes[x.name]
                body.append(ast.Assignment(ast.Identifier(name), ast.Invocation(
                    "tract_transformers_dyn_kv_cache", None, (
                        ast.Argument(None, x), ast.Argument("name", ast.StringLiteral(name)),
                        ast.Argument("axis", ast.IntegerLiteral(2)),
                        ast.Argument("datum_type", ast.StringLiteral("f32")),
                        ast.Argument("past_sequence_shape", dims(sh, past)),
                        ast.Argument("input_sequence_shape", dims(sh, token_symbol))))))
                cached.append(ast.Identifier(name))
            scale = [x for x in rhs.args if x.name == "scale"]
            body.append(dataclasses.replace(a, rhs=ast.Invocation("tract_transformers_sdpa", None, (
                ast.Argument(None, q), ast.Argument(None, cached[0]), ast.Argument(None, cached[1]), *scale,
                ast.Argument("datum_type", ast.StringLiteral("f32")),
                ast.Argument("acc_datum_type", ast.StringLiteral("f32")),
                ast.Argument("is_causal", ast.LogicalLiteral(True))))))
        else:
            body.append(a)
    exts = tuple(doc.extensions) + ((ast.Extension("tract_symbol", past),) if fused else ())
    return dataclasses.replace(model, document=dataclasses.replace(
        doc, extensions=exts, graph=dataclasses.replace(doc.graph, body=tuple(body))), text=None)


def _ours(model: Any, sig: Any, calls: list, names: list[str]) -> dict[str, np.ndarray]:
    """nnef-kv's K/V inputs over the calls, concatenated along the token axis (2)."""
    sess = model.session()
    cache = sig.empty_caches()
    got: dict[str, list[np.ndarray]] = {k: [] for k in names}
    for part, step in calls:
        feed = dict(cache)
        feed[sig.ids_input] = np.asarray(part, np.int64).reshape(1, -1)
        out, caps = sess.run(feed, capture=names, stepwise=step and len(part) > 1)
        for k in names:
            got[k].append(np.array(caps[k], np.float32))
        if sig.explicit:
            cache = {i: out[o] for i, o in sig.cache_outputs.items()}
    return {k: np.concatenate(v, axis=2) for k, v in got.items()}


def _theirs(model: Any, sig: Any, calls: list, names: list[str]) -> dict[str, np.ndarray]:
    """tract's K/V inputs over the same tokens (the teacher tokens one call each)."""
    from .. import tract_driver

    sig2 = dataclasses.replace(sig, output_names=list(sig.output_names) + names)
    drv = tract_driver.Decoder(_with_outputs(model, names), sig2)
    got: dict[str, list[np.ndarray]] = {k: [] for k in names}
    for part, step in calls:
        for piece in ([[t] for t in part] if step else [part]):
            out = drv(np.asarray(piece, np.int64))
            for k in names:
                got[k].append(np.asarray(out[k], np.float32))
    return {k: np.concatenate(v, axis=2) for k, v in got.items()}


def flip_bound(model: Any, dec: Any, ids: Sequence[int], ctx: int, n: int, chunk: int | None, start: int,
               measure: Callable[[Any], np.ndarray], logits: np.ndarray) -> FlipBound:
    """The quantized-cache term of the parity tolerance (module docstring). ``dec``: an
    :class:`~nnef_kv.validate.decode.InterpreterDecoder` of ``model`` (its quantized states get the margins
    for the flipped run, then 0 again); ``logits``: nnef-kv's logits of the window; ``measure(dec)``: the
    window's logits measured as validation measures them."""
    found = kv_inputs(model.document)
    if not found:
        return FlipBound(note="")
    names = list(dict.fromkeys(x for _, _, xs in found for x in xs if x))
    calls = _schedule(ids, ctx, n, chunk, start)
    try:
        first = _ours(model, dec.sig, calls[:1], names)  # the K/V shapes, for the fused ops' twin caches
        spec = next(x for x in dec.session.plan.inputs if x.name == dec.sig.ids_input)
        token_symbol = next(d for d in spec.shape if isinstance(d, str))
        twin = _twin(model, found, {k: v.shape for k, v in first.items()}, token_symbol)
        ours = _ours(twin, dec.sig, calls, names)
        theirs = _theirs(twin, dec.sig, calls, names)
    except BaseException as exc:  # tract's own errors (pyo3 panics are BaseException)
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        return FlipBound(note=f"no quantized-cache term (the K/V probe failed: {str(exc).splitlines()[0][:120]})")
    noise = {}
    for k in names:
        a, b = ours[k], theirs[k]
        noise[k] = float(np.max(np.abs(a - b))) if a.shape == b.shape else float("inf")
    if not all(np.isfinite(v) for v in noise.values()):
        bad = [k for k, v in noise.items() if not np.isfinite(v)]
        return FlipBound(noise=noise, note=f"no quantized-cache term ({bad[0]}: K/V shapes or values differ from "
                                            f"tract's)")
    by_result = {lhs: (op, xs) for lhs, op, xs in found}
    states = [(node, st) for node, st in dec.quantized_ops() if node.name in by_result]
    for node, st in states:
        op, xs = by_result[node.name]
        eps = [noise.get(x, 0.0) for x in xs]
        st.flip_margin = eps[0] if op == QUANTIZED_TRACT_OPS[0] else (eps[0], eps[1])
        st.flips = 0
    try:
        flipped_logits = measure(dec)
        flipped = int(sum(st.flips for _, st in states))
    finally:
        for _, st in states:
            st.flip_margin = 0.0 if isinstance(st.flip_margin, float) else (0.0, 0.0)
    ref = logits[:len(flipped_logits)].astype(np.float64)
    delta = float(np.max(np.abs(flipped_logits.astype(np.float64) - ref)))
    return FlipBound(logits=delta, noise=noise, flipped=flipped)

