"""The one attention recognizer: attentions, their KV caches and their score transforms, found on the
interpreter's built graph (:class:`~nnef_kv.interpreter.graph.Graph`, every fragment expanded, every operand
a slot); constants are what the op kernels compute from the graph's constants (:meth:`View.const`), never
a second folder.

An attention is recognised as

* **decomposed**: ``scores = q . K^T`` (a ``matmul``, ``transposeB`` or of ``transpose(K, [0, 1, 3, 2])``, or a
  ``tract_core_einsum`` ``bcij,bcjk->bcik`` of ``K^T`` / ``bcij,bckj->bcik`` of ``K``, through casts), then any
  chain of **score transforms** - casts, constant scales (``mul`` / ``div`` by a scalar constant), tanh
  softcapping (``div(c) -> tanh -> mul(c)``, Gemma 2), an additive mask (``add`` of a non-constant tensor),
  ``x - max(x)``, GPT-OSS's sink column (``concat([scores, sinks], axis = 3)``, dropped after the softmax) -
  then ``softmax`` over the last axis, then ``p . V`` (``matmul`` or ``einsum bcij,bcjk->bcik``, through casts);
* **fused**: ``tract_transformers_sdpa(q, K, V, mask?, scale?, is_causal?)``;
* **folded**: a softmax the walk above misses, followed through layout ops (the form tract's declutter
  writes): a candidate the converter proves by one run (``converters/folded.py``).

``K`` / ``V`` are followed back to their cache (:mod:`.kv_caches`); the graph is read through a
:class:`.view.View` (operands by parameter name, constants computed by the op kernels). Where recognition
stops, a :class:`Miss` names the node and what was expected there. :func:`recognize` is what the converter
reads (``converters/attention.py`` maps it back to the document's names); :func:`attention_outputs` what
validation captures, by the same rules (a fused attention op, or ``p . V`` reading a softmax).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...errors import ConversionError, NnefKvError
from ..catalog import ops_having, ops_with
from ..graph import Graph, Node
from ..values import Lazy
from .kv_caches import DYN_CACHE_OP, SDPA_OP, Cache, cache_at, cache_source, find_caches, repeat_chain
from .view import PASSTHROUGH, NotConstant, View, product, through_casts

__all__ = ["View", "Cache", "Found", "Miss", "Core", "recognize", "attention_core", "softmax_of", "find_caches",
           "attention_outputs", "fused_attention_ops", "interpret", "DYN_CACHE_OP"]

#: what the recognizer walks through, from the registry's facts (casts and copies: :data:`.view.PASSTHROUGH`)
SOFTMAX_OPS = ops_having("softmax")
#: the ops a folded attention's layout goes through: views, transposes, casts and copies; after the softmax,
#: slices too (tract keeps only the last query of the last layer)
LAYOUT_OPS = ops_having("view") | ops_having("numpy_view") | ops_having("passthrough")
FORWARD_OPS = LAYOUT_OPS | {"slice"}
#: what a score transform may be, for messages
SCORE_TRANSFORMS = "a cast, a constant scale (mul/div by a scalar), tanh softcapping or an additive mask"
CACHE_EXPECTED = ("a KV cache: concat([cache input, new], axis = 2) with the cache a graph input, or "
                  "tract_transformers_dyn_kv_cache")


# ---------------------------------------------------------------------------------------------- records
@dataclass
class Found:
    """One attention of the graph."""

    kind: str  # "plain" (matmul scores), "einsum", "sdpa" or "folded" (a candidate, proved by the converter)
    q: int
    key: Cache
    value: Cache
    output: Node  # the node computing the attention result (p . V, the sdpa)
    scale: float | None  # None: absent (the op's default 1/sqrt(D))
    mask: int | None  # the additive mask (or sdpa's mask input)
    is_causal: bool = False
    nodes: list[Node] = field(default_factory=list)  # the attention's own nodes (q . k to output)
    softcap: float | None = None
    unsupported: list[str] = field(default_factory=list)  # score transforms no fused op expresses
    sinks: int | None = None  # GPT-OSS: the column concatenated to the scores before the softmax
    softmax: Node | None = None
    product: Node | None = None  # kind "folded": q . K^T (its first operand the query in a folded layout)
    query_side: list[int] = field(default_factory=list)  # kind "folded": the query and its layout ancestors
    after: list[int] = field(default_factory=list)  # kind "folded": the result's layout descendants
    miss: Miss | None = None  # kind "folded": where the standard walk stopped (None: a softmax over another axis)


@dataclass
class Miss:
    """An attention the recognizer could not follow: where it stopped and what it expected there."""

    node: str
    op: str | None
    expected: str
    around: str  # the attention being followed (its softmax or sdpa node)

    def message(self) -> str:
        return (f"recognition of the attention around '{self.around}' stopped at node '{self.node}'"
                f"{f' ({self.op})' if self.op else ''}: expected {self.expected}")


class _Stop(Exception):
    def __init__(self, node: str, op: str | None, expected: str) -> None:
        super().__init__(node)
        self.node, self.op, self.expected = node, op, expected


# ---------------------------------------------------------------------------------------------- the scores
def _key_of_scores(w: View, n: Node) -> tuple[int, int, float, list[Node]] | None:
    """For a scores product ``q . K^T``: ``(q, K, constant factor on K^T, the nodes from the product's second
    operand back to K)``, else None."""
    prod = product(w, n)
    if prod is None:
        return None
    a, b, transposed = prod
    factor, cur, path = 1.0, b, []
    for _ in range(16):
        m = w.node(cur)
        if m is None:
            break
        if m.op in PASSTHROUGH:
            cur = w.first(m)
            path.append(m)
            continue
        c = w.scalar(w.arg(m, "y")) if m.op in ("mul", "div") else None  # op pattern
        if c is not None and w.const(w.arg(m, "x")) is None:
            factor = factor * c if m.op == "mul" else factor / c
            cur = w.arg(m, "x")
            path.append(m)
            continue
        break
    q = through_casts(w, a)
    if q is None:
        return None
    if transposed:
        return q, cur, factor, path
    m = w.node(cur)
    if m is not None and m.op == "transpose" and w.attr(m, "axes") == [0, 1, 3, 2] and w.first(m) is not None:
        return q, w.first(m), factor, path + [m]  # type: ignore[return-value]
    return None


def _const_operand(w: View, n: Node) -> tuple[float, int] | None:
    """``(constant, other operand)`` of a binary node with one scalar-constant operand."""
    x, y = w.arg(n, "x"), w.arg(n, "y")
    cy = w.scalar(y)
    if cy is not None and isinstance(x, int) and w.const(x) is None:
        return cy, x
    cx = w.scalar(x)
    if cx is not None and isinstance(y, int) and w.const(y) is None and n.op in ("mul", "add"):  # op pattern
        return cx, y
    return None


# ---------------------------------------------------------------------------------------------- the scores
def _stabilized(w: View, n: Node) -> tuple[tuple, int] | None:
    """``sub(x, max_reduce(x, axes = [last]))`` right before the softmax: ``(("stabilize", ...), x)``."""
    if n.op != "sub":
        return None
    x, m = w.arg(n, "x"), w.node(w.arg(n, "y"))
    if not isinstance(x, int) or m is None or m.op != "max_reduce" or w.first(m) != x:
        return None
    return (("stabilize", None, n.name), x) if w.axis(m, "axes") in (3, -1) else None


def _sink_concat(w: View, n: Node) -> tuple[tuple, int] | None:
    """``concat([scores, column], axis = last)`` before the softmax (GPT-OSS's sinks)."""
    if n.op != "concat" or w.axis(n, "axis") not in (3, -1):
        return None
    values = w.arg(n, "values")
    if not isinstance(values, list) or len(values) != 2:
        return None
    return ("sinks", values[1], n.name), values[0]


def drops_last_column(w: View, n: Node | None) -> bool:
    """A slice of the last axis keeping ``[0, -1)`` (its bounds computed on a probe when the graph computes
    them: torch-to-nnef's ``dyn_slice``): the sink column dropped after the softmax."""
    if n is None or n.op != "slice" or w.axis(n, "axes") not in (3, -1) or w.first(n) is None:
        return False
    width = 7
    try:
        reads = [s for k in ("begin", "end", "stride") if isinstance(n.attrs.get(k), Lazy)
                 for s in (n.attrs[k].reads or ())]
        v: list[Any] = [None] * w.graph.nslots
        got = w.evaluate(reads, {w.first(n): np.zeros((1, 1, 1, width), np.float32)}) if reads else {}
        for s, val in got.items():
            v[s] = val
        bounds = [n.attrs.get(k) for k in ("begin", "end", "stride")]
        begin, end, stride = [b.fn(v) if isinstance(b, Lazy) else b for b in bounds]
    except (NotConstant, NnefKvError, ArithmeticError, ValueError, TypeError, IndexError, AttributeError):
        return False
    one = [begin, end, stride if stride is not None else [1]]
    if any(not isinstance(b, (list, tuple)) or len(b) != 1 for b in one):
        return False
    b, e, s = (int(x[0]) for x in one)
    return b == 0 and e in (-1, width - 1) and s == 1


def _to_scores(w: View, start: int, depth: int = 0, layouts: bool = False) -> tuple[Node, list[tuple]]:
    """From a softmax input back to the scores product: the product node and the transforms met on the way,
    in the order they are applied (product first). Raises :class:`_Stop` where it cannot go on. ``layouts``:
    walk through layout ops too, and take any product (its K layout is proved by a run)."""
    through = LAYOUT_OPS if layouts else PASSTHROUGH
    ops: list[tuple] = []
    cur = start
    for _ in range(64):
        n = w.node(cur)
        if n is None and cur in w.input_ops:
            raise _Stop(w.name(cur), w.op(cur), SCORE_TRANSFORMS)
        if n is None:
            raise _Stop(w.name(cur), None, f"a computed scores tensor (q . K^T and then {SCORE_TRANSFORMS})")
        if product(w, n) is not None:
            if not layouts and _key_of_scores(w, n) is None:
                raise _Stop(n.name, n.op, "q . K^T with K^T a transpose(K, [0, 1, 3, 2]), transposeB = true, or an "
                                          "einsum bcij,bcjk->bcik / bcij,bckj->bcik")
            return n, list(reversed(ops))
        op = n.op
        if op in through:
            cur = w.first(n)
            continue
        if depth == 0 and all(o[0] == "stabilize" for o in ops):
            got = _stabilized(w, n) or _sink_concat(w, n)
            if got is not None:  # x - max(x) (softmax is invariant to it); the sink column (GPT-OSS)
                ops.append(got[0])
                cur = got[1]
                continue
        if op in ("mul", "div"):  # op pattern
            got = _const_operand(w, n)
            if got is None:
                raise _Stop(n.name, op, f"{SCORE_TRANSFORMS} (a {op} by a tensor that is not a scalar constant)")
            ops.append((op, got[0], n.name))
            cur = got[1]
            continue
        if op == "tanh":
            ops.append(("tanh", None, n.name))
            cur = w.first(n)
            continue
        if op in ("add", "sub"):  # op pattern
            got = _const_operand(w, n)
            if got is not None:
                ops.append(("bias", got[0] if op == "add" else -got[0], n.name))
                cur = got[1]
                continue
            if op == "add" and depth < 2:
                x, y = w.arg(n, "x"), w.arg(n, "y")
                for s, m in ((x, y), (y, x)):
                    if not isinstance(s, int) or not isinstance(m, int):
                        continue
                    try:
                        _to_scores(w, s, depth + 1, layouts)
                    except _Stop:
                        continue
                    ops.append(("mask", m, n.name))
                    cur = s
                    break
                else:
                    raise _Stop(n.name, op, f"{SCORE_TRANSFORMS}: neither operand of the add leads to q . K^T")
                continue
        raise _Stop(n.name, op, SCORE_TRANSFORMS)
    raise _Stop(w.name(cur), None, "the scores within 64 transforms")


def interpret(ops: list[tuple]) -> tuple[float, float | None, Any, list[str]]:
    """Score transforms -> ``(scale, softcap, mask, unsupported)``. Recognised: constant scales first, then at
    most one ``div(c)/mul(1/c) -> tanh -> mul(c)`` softcap, then at most one additive mask (casts anywhere);
    anything else is listed as unsupported (only the attention-free scheme converts it)."""
    scale, softcap, mask = 1.0, None, None
    bad: list[str] = []
    tanh_at = [i for i, o in enumerate(ops) if o[0] == "tanh"]
    end_scale = tanh_at[0] - 1 if tanh_at else len(ops)
    i = 0
    while i < len(ops):
        kind, val, node = ops[i]
        if kind in ("stabilize", "sinks"):  # read by recognize
            i += 1
            continue
        if kind in ("mul", "div") and i < end_scale and mask is None and softcap is None:  # op pattern
            scale = scale * val if kind == "mul" else scale / val
        elif kind == "tanh" and softcap is None and mask is None and i >= 1 and i + 1 < len(ops) \
                and ops[i - 1][0] in ("div", "mul") and ops[i + 1][0] == "mul":  # op pattern
            pre = ops[i - 1][1] if ops[i - 1][0] == "div" else (1.0 / ops[i - 1][1] if ops[i - 1][1] else 0.0)
            post = ops[i + 1][1]
            if pre and abs(pre - post) <= 1e-6 * abs(post):
                softcap = float(post)
                i += 2
                continue
            bad.append(f"'{node}' (tanh between {ops[i - 1][0]} {ops[i - 1][1]:g} and mul {post:g}: not a softcap)")
        elif kind == "mask" and mask is None:
            mask = val
        elif kind == "bias" and val == 0:
            pass  # x + 0
        elif kind in ("div", "mul") and i == end_scale and tanh_at:  # op pattern
            pass  # the softcap's divisor: read with the tanh
        else:
            what = {"bias": f"adds the constant {val:g}", "mask": "adds a second mask", "tanh": "a tanh",  # op pattern
                    "mul": f"multiplies by {val:g} after the mask or the softcap",
                    "div": f"divides by {val:g} after the mask or the softcap"}.get(kind, kind)
            bad.append(f"'{node}' ({what})")
        i += 1
    return scale, softcap, mask, bad


def _cache_miss(w: View, slot: int, around: str) -> Miss:
    src, _ = repeat_chain(w, slot)
    return Miss(w.name(src), w.op(src), CACHE_EXPECTED, around)


# ---------------------------------------------------------------------------------------------- attentions
def _forward_to_pv(w: View, sm: Node, through: Any = PASSTHROUGH, steps: int = 8, sinks: bool = False
                   ) -> tuple[Node | None, list[Node]]:
    """From a softmax forward through casts (``through``) to ``p . V`` (p the first operand); ``sinks``: through
    the slice that drops the sink column, once."""
    cur, fwd = w.out(sm), [sm]
    for _ in range(steps):
        users = w.users(cur)
        if len(users) != 1:
            return None, fwd
        u = users[0]
        if sinks and drops_last_column(w, u):
            sinks = False
            cur = w.out(u)
            fwd.append(u)
            continue
        if u.op in through:
            cur = w.out(u)
            fwd.append(u)
            continue
        prod = product(w, u)
        if prod is not None and prod[0] == cur and not prod[2]:
            return u, fwd
        return None, fwd
    return None, fwd


def recognize(w: View) -> tuple[list[Found], list[Miss]]:
    """Every attention of ``w``'s graph with its caches, and a :class:`Miss` for each softmax or sdpa that looks
    like an attention but could not be followed (or has no KV cache). Folded candidates (kind ``folded``, last)
    are to be proved by a run (``miss``: what to report if they are not); a softmax over another axis that is no
    folded candidate is no attention."""
    graph, where = w.graph, w.where
    found: list[Found] = []
    folded: list[Found] = []
    misses: list[Miss] = []
    for sm in [n for n in graph.nodes if n.op in SOFTMAX_OPS]:
        x, axis = w.first(sm), w.axis(sm, "axes")
        if x is None or axis is None:
            continue
        miss = None
        try:
            if axis in (3, -1):  # else not the standard layout: an attention only if folded (else not one)
                mm1, ops = _to_scores(w, x)
        except _Stop as stop:
            miss = Miss(stop.node, stop.op, stop.expected, sm.name)
        if axis not in (3, -1) or miss is not None:
            got = _follow_folded(w, sm)
            if got is not None:
                got.miss = miss
                folded.append(got)
            elif miss is not None:
                misses.append(miss)
            continue
        q, kfull, kfactor, _ = _key_of_scores(w, mm1)  # type: ignore[misc]
        sinks = next((o[1] for o in ops if o[0] == "sinks"), None)
        mm2, fwd = _forward_to_pv(w, sm, sinks=sinks is not None)
        if mm2 is None or (sinks is not None and not any(drops_last_column(w, f) for f in fwd[1:])):
            if mm2 is not None:  # a column joined the scores and was never dropped: not GPT-OSS's sinks
                misses.append(Miss(mm2.name, mm2.op, f"the slice dropping the column '{w.name(sinks)}' concatenated "
                                   f"to the scores before the softmax", sm.name))
                continue
            users = w.users(w.out(fwd[-1]))
            misses.append(Miss(users[0].name if len(users) == 1 else fwd[-1].name,
                               users[0].op if len(users) == 1 else fwd[-1].op,
                               "p . V: a matmul or einsum bcij,bcjk->bcik reading the softmax (through casts) as "
                               "its first operand", sm.name))
            continue
        prod2 = product(w, mm2)
        assert prod2 is not None
        w.where = f"{where}: attention at '{mm2.name}'"
        key, value = cache_source(w, kfull, "key"), cache_source(w, prod2[1], "value")
        if key is None or value is None:
            misses.append(_cache_miss(w, kfull if key is None else prod2[1], sm.name))
            continue
        if key.kind != value.kind:
            raise ConversionError(f"{w.where}: K comes from a {key.kind} cache but V from a {value.kind} one")
        scale, softcap, mask, bad = interpret(ops)
        inner = [graph.nodes[w.index[o[2]]] for o in ops]
        kind = "einsum" if "tract_core_einsum" in (mm1.op, mm2.op) else "plain"
        found.append(Found(kind, q, key, value, mm2, scale * kfactor, mask, nodes=[mm1, *inner, *fwd, mm2],
                           softcap=softcap, unsupported=bad, sinks=sinks, softmax=sm))
    for n in [n for n in graph.nodes if n.op == SDPA_OP]:
        w.where = f"{where}: tract_transformers_sdpa '{n.name}'"
        q, k, v = w.arg(n, "q"), w.arg(n, "k"), w.arg(n, "v")
        if not all(isinstance(s, int) for s in (q, k, v)):
            misses.append(Miss(n.name, n.op, "identifiers for q, k and v", n.name))
            continue
        key, value = cache_source(w, k, "key"), cache_source(w, v, "value")
        if key is None or value is None or key.kind != value.kind:
            misses.append(_cache_miss(w, k if key is None else v, n.name))
            continue
        mask = w.arg(n, "mask")
        if isinstance(mask, int) and (c := w.const(mask)) is not None and c.dtype == np.bool_ and c.size == 1 \
                and not c.ravel()[0]:
            mask = None  # ``mask = false`` written out: none
        scale = n.attrs.get("scale")
        scale = float(scale) if isinstance(scale, (int, float, np.number)) and not isinstance(scale, bool) else None
        found.append(Found("sdpa", q, key, value, n, scale or None, mask if isinstance(mask, int) else None,
                           is_causal=bool(w.attr(n, "is_causal")), nodes=[n]))
    w.where = where
    return found + folded, misses


# ---------------------------------------------------------------------------------------------- folded
def _layout_back(w: View, slot: int | None) -> list[int]:
    """``slot`` and its ancestors through layout ops (nearest first)."""
    out: list[int] = []
    cur = slot
    while cur is not None and len(out) < 32:
        out.append(cur)
        n = w.node(cur)
        if n is None or n.op not in LAYOUT_OPS:
            break
        cur = w.first(n)
    return out


def _layout_forward(w: View, slot: int) -> list[int]:
    """``slot``'s descendants through layout ops read by nothing else (nearest first, ``slot`` excluded)."""
    out: list[int] = []
    cur = slot
    while len(out) < 32:
        users = w.users(cur)
        if len(users) != 1 or users[0].op not in FORWARD_OPS or len(users[0].outputs) != 1:
            break
        cur = w.out(users[0])
        out.append(cur)
    return out


def _follow_folded(w: View, sm: Node) -> Found | None:
    """The folded attention around softmax ``sm`` (a candidate: its layouts are proved by a run), else None."""
    x = w.first(sm)
    if x is None:
        return None
    try:
        mm1, ops = _to_scores(w, x, layouts=True)
    except _Stop:
        return None
    prod = product(w, mm1)
    mm2, fwd = _forward_to_pv(w, sm, FORWARD_OPS, 16)
    if prod is None or mm2 is None:
        return None
    where = w.where
    w.where = f"{where}: attention at '{mm2.name}'"
    try:
        key = cache_at(w, _layout_back(w, prod[1])[-1], "key")
        value = cache_at(w, _layout_back(w, product(w, mm2)[1])[-1], "value")  # type: ignore[index]
    finally:
        w.where = where
    if key is None or value is None or key.kind != value.kind:
        return None
    scale, softcap, mask, bad = interpret(ops)
    inner = [w.graph.nodes[w.index[o[2]]] for o in ops]
    return Found("folded", prod[0], key, value, mm2, scale, mask, nodes=[mm1, *inner, *fwd, mm2], softcap=softcap,
                 unsupported=bad, softmax=sm, product=mm1, query_side=_layout_back(w, prod[0]),
                 after=_layout_forward(w, w.out(mm2)))


# ---------------------------------------------------------------------------------------------- capture
def softmax_of(w: View, pv: Node) -> tuple[Node, list[Node]] | None:
    """``(the softmax, the casts after it)`` when ``pv`` is a ``p . V`` product reading a softmax's probabilities
    (through casts) as its first operand, else None."""
    prod = product(w, pv)
    if prod is None or prod[2]:
        return None
    casts: list[Node] = []
    cur = prod[0]
    for _ in range(16):
        n = w.node(cur)
        if n is None or (n.op not in SOFTMAX_OPS and n.op not in PASSTHROUGH):
            return None
        if n.op in SOFTMAX_OPS:
            return n, casts[::-1]
        casts.append(n)
        cur = w.first(n)
    return None


@dataclass
class Core:
    """A decomposed attention seen from its ``p . V`` product, its caches not asked for (what the planner fuses)."""

    softmax: Node
    forward: list[Node]  # the casts from the softmax to p . V
    product: Node  # q . K^T
    ops: list[tuple]  # the score transforms, product first: (kind, value, node name)
    key_path: list[Node]  # the nodes from the scores product's second operand back to K (transpose, casts, scales)


def attention_core(w: View, pv: Node) -> Core | None:
    """The decomposed attention whose ``p . V`` product is ``pv`` (the walk of :func:`recognize` from its
    softmax back to ``q . K^T``), else None."""
    got = softmax_of(w, pv)
    if got is None or w.first(got[0]) is None or w.axis(got[0], "axes") is None:
        return None
    try:
        mm1, ops = _to_scores(w, w.first(got[0]))  # type: ignore[arg-type]
    except _Stop:
        return None
    key = _key_of_scores(w, mm1)
    return None if key is None else Core(got[0], got[1], mm1, ops, key[3])


def attention_outputs(graph: Graph) -> list[Node]:
    """The nodes whose first output is an attention's result, in graph order: every fused attention op
    (registered with role ``attention`` or ``attention+kv``), and every ``p . V`` product whose first operand a
    softmax makes (through casts): what validation captures, layer by layer."""
    w = View(graph)
    fused = fused_attention_ops()
    return [n for n in graph.nodes if n.op in fused or softmax_of(w, n) is not None]


def fused_attention_ops() -> frozenset[str]:
    """The ops registered as an attention (role ``attention`` or ``attention+kv``)."""
    return ops_with(role="attention") | ops_with(role="attention+kv")
