"""Find attention blocks by what they compute, and the KV caches feeding them.

An attention is recognised as

* **decomposed**: ``scores = q . K^T`` (a ``matmul``, ``transposeB`` or of ``transpose(K, [0, 1, 3, 2])``, or a
  ``tract_core_einsum`` ``bcij,bcjk->bcik`` of ``K^T`` / ``bcij,bckj->bcik`` of ``K``, through casts), then any
  chain of **score transforms** - casts, constant scales (``mul`` / ``div`` by a scalar constant, a
  literal or a one-element variable), tanh softcapping (``div(c) -> tanh -> mul(c)``, Gemma 2), an
  additive mask (``add`` of a non-constant tensor: causal, padding or sliding-window masks as exported) -
  then ``softmax`` over the last axis, then ``p . V`` (``matmul`` or ``einsum bcij,bcjk->bcik``, through
  casts);
* **fused**: ``tract_transformers_sdpa(q, K, V, mask?, scale?, is_causal?)``.

``K`` / ``V`` are followed back through casts and the grouped-query repeat exporters add
(``unsqueeze(axes = [2]) -> tile/broadcast -> reshape``: kv head ``h`` serves query heads ``h*G .. h*G+G-1``,
the mapping the fused ops use) to their cache (:func:`cache_source`):

* ``explicit``: ``concat([past, new], axis = 2)`` where ``past`` is a graph input (``in_cache_*``,
  ``past_key_values.*``); the concatenation is usually also a graph output (``out_cache_*``, ``present.*``);
* ``dyn``: ``tract_transformers_dyn_kv_cache(new, ...)`` (tract holds the cache in its state).

Where recognition stops, :class:`Miss` records the node and what was expected there; the converter's
error quotes it. A softmax the walk above misses is followed once more through layout ops
(:func:`_follow_folded`: the form tract's declutter writes) and proved by one run (:mod:`.folded`); each mask
is read by evaluating it (:mod:`.masks`). The caches alone (scheme ``tract-cache``) and the exports that cannot
run are :mod:`.caches`'.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import ConversionError
from ..grammar import ast as A
from ..interpreter.catalog import ops_having
from . import folded
from .graph_edit import GraphEdit, Node, int_list, static_value
from .masks import read_block_masks
from .sinks import drops_last_column, read_sink_logits, sink_concat, stabilized

#: what the recognizer walks through, from the registry's facts: casts and copies; the steps of a K/V head
#: expansion (repeat_kv); the softmaxes (``softmax`` and ``tract_core_softmax``: tract reads them alike)
PASSTHROUGH = tuple(sorted(ops_having("passthrough")))
REPEAT_OPS = tuple(sorted(ops_having("kv_expand")))
SOFTMAX_OPS = tuple(sorted(ops_having("softmax")))
DYN_CACHE_OP = "tract_transformers_dyn_kv_cache"
#: what a score transform may be, for messages
SCORE_TRANSFORMS = "a cast, a constant scale (mul/div by a scalar), tanh softcapping or an additive mask"
#: what :func:`find_attention` looks for, in the "no attention found" message
LOOKED_FOR = (
    "attention: q . K^T (matmul or tract_core_einsum, through casts), then casts / constant scales / tanh "
    "softcapping / an additive mask, softmax, then p . V (matmul or einsum); or tract_transformers_sdpa; with K/V "
    "from concat([cache input, new], axis = 2) or tract_transformers_dyn_kv_cache"
)


@dataclass
class CacheSource:
    """Where the full K (or V) of an attention comes from."""

    kind: str  # "explicit" or "dyn"
    full: str  # the name holding past + new (concat output / dyn cache output)
    new: str  # this call's new tokens
    past: str | None = None  # explicit: the graph input holding the past
    node: Node | None = None  # the concat / dyn cache node
    repeat: list[str] = field(default_factory=list)  # names of the GQA repeat chain (full -> attention)
    role: str = ""  # "key" or "value" when known


@dataclass
class AttentionBlock:
    """One attention found in the graph."""

    kind: str  # "plain" (matmul scores), "einsum" or "sdpa"
    q: str
    key: CacheSource
    value: CacheSource
    output: str  # the name holding the attention result [B, Hq, S, D]
    scale: float | None  # None: absent (the op's default 1/sqrt(D))
    mask: str | None  # the additive mask or sdpa mask input dropped by the conversion
    is_causal: bool = False  # sdpa's own is_causal flag
    nodes: list[str] = field(default_factory=list)  # the attention's own nodes (q.k to output)
    softcap: float | None = None  # tanh softcapping of the scores (Gemma 2), None: none
    unsupported: list[str] = field(default_factory=list)  # score transforms no fused op expresses
    mask_reading: Any = None  # what the mask is (converters/masks.py MaskReading), once read
    layout: tuple = ()  # kind "folded": the layout ops from the fused op's [B, Hq, S, D] result to ``output``
    query_layout: tuple = ()  # kind "folded": the layout ops from ``q`` to the [B, Hq, S, D] query
    sinks: str | None = None  # GPT-OSS: the tensor concatenated to the scores as the softmax's last column
    sink_logits: tuple = ()  # its value, one logit per query head (read by evaluating it: .sinks)

    def describe(self) -> str:
        extra = f", softcap {self.softcap:g}" if self.softcap else ""
        return (f"{self.kind} attention -> '{self.output}' (q '{self.q}', K {self.key.kind} '{self.key.full}', "
                f"V {self.value.kind} '{self.value.full}', scale {self.scale}{extra}, mask {self.mask!r})")


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


# ----------------------------------------------------------------------------------------------
def _first_input(n: Node) -> str | None:
    return n.arg_name("input") or n.arg_name("x")


def _through_casts(g: GraphEdit, name: str | None) -> str | None:
    cur = name
    for _ in range(16):
        n = g.node(cur)
        if n is None or n.op not in PASSTHROUGH:
            return cur
        cur = _first_input(n)
    return cur


def _single_axis(n: Node, param: str) -> int | None:
    v = n.arg(param)
    if v is None:
        return None
    sv = static_value(v)
    if isinstance(sv, int) and not isinstance(sv, bool):
        return sv
    axes = int_list(v)
    return axes[0] if axes is not None and len(axes) == 1 else None


def _einsum_operands(n: Node) -> tuple[str, str, str] | None:
    """``(a, b, layout of b)`` of a two-operand einsum computing a batched ``[.., i, j] x [.., j, k]``
    product: layout ``"jk"`` (b is ``[.., j, k]``) or ``"kj"`` (b is ``[.., k, j]``)."""
    inputs = n.arg("inputs")
    expr = n.arg("expr")
    if not isinstance(inputs, A.ArrayExpr) or len(inputs.items) != 2 or not isinstance(expr, A.StringLiteral):
        return None
    a, b = inputs.items
    if not (isinstance(a, A.Identifier) and isinstance(b, A.Identifier)):
        return None
    text = expr.value.replace(" ", "")
    try:
        lhs, out = text.split("->")
        x, y = lhs.split(",")
    except ValueError:
        return None
    if len(x) != 4 or len(y) != 4 or len(out) != 4 or x[:2] != y[:2] or x[:2] != out[:2]:
        return None
    i, j = x[2], x[3]
    if out[2] != i:
        return None
    if y[2] == j and out[3] == y[3] != j:
        return a.name, b.name, "jk"
    if y[3] == j and out[3] == y[2] != j:
        return a.name, b.name, "kj"
    return None


def _product(n: Node) -> tuple[str, str, bool] | None:
    """``(A, B, B given transposed)`` of a batched matrix product node (matmul or einsum), else None."""
    if n.op == "matmul":
        a, b = n.arg_name("A"), n.arg_name("B")
        ta = n.arg("transposeA")
        if a is None or b is None or (ta is not None and static_value(ta)):
            return None
        tb = n.arg("transposeB")
        return a, b, bool(static_value(tb)) if tb is not None else False
    if n.op == "tract_core_einsum":
        got = _einsum_operands(n)
        if got is None:
            return None
        return got[0], got[1], got[2] == "kj"
    return None


def _key_of_scores(g: GraphEdit, n: Node) -> tuple[str, str, float] | None:
    """For a scores product ``q . K^T``: ``(q, K, constant factor on K^T)``, else None."""
    prod = _product(n)
    if prod is None:
        return None
    a, b, transposed = prod
    factor = 1.0
    cur = b
    for _ in range(16):
        m = g.node(cur)
        if m is None:
            return None
        if m.op in PASSTHROUGH:
            cur = _first_input(m) or ""
            continue
        if m.op in ("mul", "div") and g.scalar_const(m.arg("y")) is not None and m.arg_name("x"):  # op pattern
            c = g.scalar_const(m.arg("y"))
            factor = factor * c if m.op == "mul" else factor / c
            cur = m.arg_name("x") or ""
            continue
        break
    q = _through_casts(g, a)
    if transposed:
        return (q, cur, factor) if q else None
    m = g.node(cur)
    if m is not None and m.op == "transpose" and int_list(m.arg("axes")) == [0, 1, 3, 2] and m.arg_name("input"):
        return (q, m.arg_name("input") or "", factor) if q else None
    return None


def _const_operand(g: GraphEdit, n: Node) -> tuple[float, str] | None:
    """``(constant, other operand)`` of a binary node with one scalar-constant operand."""
    x, y = n.arg("x"), n.arg("y")
    cy = g.scalar_const(y)
    if cy is not None and isinstance(x, A.Identifier):
        return cy, x.name
    cx = g.scalar_const(x)
    if cx is not None and isinstance(y, A.Identifier) and n.op in ("mul", "add"):  # op pattern
        return cx, y.name
    return None


def _to_scores(g: GraphEdit, start: str, depth: int = 0, layouts: bool = False) -> tuple[Node, list[tuple]]:
    """From a softmax input back to the scores product: the product node and the transforms met on the
    way, in the order they are applied (product first). Raises :class:`_Stop` where it cannot go on.
    ``layouts``: walk through layout ops too, and take any product (its K layout is proved by :mod:`.folded`)."""
    through = LAYOUT_OPS if layouts else PASSTHROUGH
    ops: list[tuple] = []
    cur = start
    for _ in range(64):
        n = g.node(cur)
        if n is None or n.inv is None:
            raise _Stop(cur, None, f"a computed scores tensor (q . K^T and then {SCORE_TRANSFORMS})")
        if _product(n) is not None:
            if not layouts and _key_of_scores(g, n) is None:
                raise _Stop(n.name, n.op, "q . K^T with K^T a transpose(K, [0, 1, 3, 2]), transposeB = true, or an "
                                          "einsum bcij,bcjk->bcik / bcij,bckj->bcik")
            return n, list(reversed(ops))
        op = n.op
        if op in through:
            cur = _first_input(n) or ""
            continue
        if depth == 0 and all(o[0] == "stabilize" for o in ops):
            got = stabilized(g, n) or sink_concat(n)
            if got is not None:  # x - max(x) (softmax is invariant to it); the sink column (GPT-OSS)
                ops.append(got[0])
                cur = got[1]
                continue
        if op in ("mul", "div"):  # op pattern
            got = _const_operand(g, n)
            if got is None:
                raise _Stop(n.name, op, f"{SCORE_TRANSFORMS} (a {op} by a tensor that is not a scalar constant)")
            ops.append((op, got[0], n.name))
            cur = got[1]
            continue
        if op == "tanh":
            ops.append(("tanh", None, n.name))
            cur = n.arg_name("x") or ""
            continue
        if op in ("add", "sub"):  # op pattern
            got = _const_operand(g, n)
            if got is not None:
                ops.append(("bias", got[0] if op == "add" else -got[0], n.name))
                cur = got[1]
                continue
            if op == "add" and depth < 2:
                x, y = n.arg_name("x"), n.arg_name("y")
                for s, m in ((x, y), (y, x)):
                    if s is None or m is None:
                        continue
                    try:
                        _to_scores(g, s, depth + 1, layouts)
                    except _Stop:
                        continue
                    ops.append(("mask", m, n.name))
                    cur = s
                    break
                else:
                    raise _Stop(n.name, op, f"{SCORE_TRANSFORMS}: neither operand of the add leads to q . K^T")
                continue
        raise _Stop(n.name, op, SCORE_TRANSFORMS)
    raise _Stop(cur, None, "the scores within 64 transforms")


def _interpret(ops: list[tuple]) -> tuple[float, float | None, str | None, list[str]]:
    """Score transforms -> ``(scale, softcap, mask, unsupported)``. Recognised: constant scales first,
    then at most one ``div(c)/mul(1/c) -> tanh -> mul(c)`` softcap, then at most one additive mask (casts
    anywhere); anything else is listed as unsupported (only the attention-free scheme converts it)."""
    scale = 1.0
    softcap = None
    mask = None
    bad: list[str] = []
    tanh_at = [i for i, o in enumerate(ops) if o[0] == "tanh"]
    end_scale = tanh_at[0] - 1 if tanh_at else len(ops)
    i = 0
    while i < len(ops):
        kind, val, node = ops[i]
        if kind in ("stabilize", "sinks"):  # read by find_attention
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


def _repeat_chain(g: GraphEdit, name: str, where: str) -> tuple[str, list[str]]:
    """Follow K/V back through casts and the GQA repeat; returns (source name, chain names)."""
    chain: list[str] = []
    cur = name
    while True:
        n = g.node(cur)
        if n is None or n.op not in REPEAT_OPS + PASSTHROUGH:
            break
        nxt = _first_input(n)
        if nxt is None:
            break
        chain.append(cur)
        cur = nxt
    ops = [g.op_of(c) for c in chain]
    structural = [o for o in ops if o in REPEAT_OPS]
    if structural:
        # source side first: must start with unsqueeze(axes = [2]) (repeat_interleave of heads)
        first = next(c for c in reversed(chain) if g.op_of(c) in REPEAT_OPS)
        fn = g.node(first)
        if fn is None or fn.op != "unsqueeze" or int_list(fn.arg("axes")) != [2]:
            raise ConversionError(
                f"{where}: '{name}' reaches the attention through {' -> '.join(reversed(ops))}; only the "
                "grouped-query repeat unsqueeze(axes = [2]) -> tile/broadcast -> reshape is understood")
    return cur, chain


def _cache_at(g: GraphEdit, src: str, where: str, what: str, chain: list[str] | None = None) -> CacheSource | None:
    n = g.node(src)
    if n is None:
        return None
    if n.op == "concat":
        values = n.arg("values")
        axis = static_value(n.arg("axis")) if n.arg("axis") is not None else None
        if not isinstance(values, A.ArrayExpr) or len(values.items) != 2:
            return None
        past, new = values.items
        if not (isinstance(past, A.Identifier) and isinstance(new, A.Identifier)):
            return None
        if past.name not in g.inputs:
            return None
        if axis not in (2, -2):
            raise ConversionError(
                f"{where}: {what} cache '{src}' concatenates on axis {axis}; only the [B, H, T, D] layout "
                "(sequence axis 2) is supported")
        return CacheSource("explicit", src, new.name, past=past.name, node=n, repeat=list(chain or []), role=what)
    if n.op == DYN_CACHE_OP:
        new = n.arg_name("input")
        axis = static_value(n.arg("axis")) if n.arg("axis") is not None else None
        if new is None:
            return None
        if axis not in (2, -2):
            raise ConversionError(f"{where}: dyn kv cache '{src}' is on axis {axis}; only axis 2 is supported")
        return CacheSource("dyn", src, new, node=n, repeat=list(chain or []), role=what)
    return None


def cache_source(g: GraphEdit, name: str, where: str, what: str) -> CacheSource | None:
    """The cache a K (``what = "key"``) or V reaches through casts and the GQA repeat, else None."""
    src, chain = _repeat_chain(g, name, where)
    return _cache_at(g, src, where, what, chain)


# ----------------------------------------------------------------------------------------------
def _forward_to_pv(g: GraphEdit, sm: Node, through: Any = PASSTHROUGH, steps: int = 8, sinks: bool = False
                   ) -> tuple[Node | None, list[str]]:
    """From a softmax forward through casts (``through``) to ``p . V`` (p the first operand); ``sinks``:
    through the slice that drops the sink column, once."""
    cur, fwd = sm.name, [sm.name]
    for _ in range(steps):
        users = g.users(cur)
        if len(users) != 1:
            return None, fwd
        u = users[0]
        if sinks and drops_last_column(u):
            sinks = False
            cur = u.name
            fwd.append(cur)
            continue
        if u.op in through:
            cur = u.name
            fwd.append(cur)
            continue
        prod = _product(u)
        if prod is not None and prod[0] == cur and not prod[2]:
            return u, fwd
        return None, fwd
    return None, fwd


def find_attention(g: GraphEdit) -> tuple[list[AttentionBlock], list[Miss]]:
    """Every attention of the graph with its caches, and a :class:`Miss` for each softmax or sdpa that
    looks like an attention but could not be followed (or has no KV cache)."""
    blocks: list[AttentionBlock] = []
    misses: list[Miss] = []
    missed: list[tuple[Any, Miss | None]] = []  # for the walk through layout ops (_folded)
    for sm in [n for n in g.nodes if n.op in SOFTMAX_OPS]:
        x = sm.arg_name("x")
        axis = _single_axis(sm, "axes")
        if x is None or axis is None:
            continue
        try:
            if axis not in (3, -1):  # not the standard layout: an attention only if folded (else not one)
                missed.append((sm, None))
                continue
            mm1, ops = _to_scores(g, x)
        except _Stop as stop:
            missed.append((sm, Miss(stop.node, stop.op, stop.expected, sm.name)))
            continue
        q, kfull, kfactor = _key_of_scores(g, mm1)  # type: ignore[misc]
        sinks = next((o[1] for o in ops if o[0] == "sinks"), None)
        mm2, fwd = _forward_to_pv(g, sm, sinks=sinks is not None)
        if mm2 is None or (sinks is not None and not any(drops_last_column(g.node(f)) for f in fwd[1:])):
            if mm2 is not None:  # a column joined the scores and was never dropped: not GPT-OSS's sinks
                misses.append(Miss(mm2.name, mm2.op, f"the slice dropping the column '{sinks}' concatenated to the "
                                   f"scores before the softmax", sm.name))
                continue
            last = g.node(fwd[-1])
            users = g.users(fwd[-1])
            misses.append(Miss(users[0].name if len(users) == 1 else fwd[-1],
                               users[0].op if len(users) == 1 else (last.op if last else None),
                               "p . V: a matmul or einsum bcij,bcjk->bcik reading the softmax (through casts) as "
                               "its first operand", sm.name))
            continue
        prod2 = _product(mm2)
        assert prod2 is not None
        where = f"{g.where}: attention at '{mm2.name}'"
        key = cache_source(g, kfull, where, "key")
        value = cache_source(g, prod2[1], where, "value")
        if key is None or value is None:
            missing = kfull if key is None else prod2[1]
            src, _ = _repeat_chain(g, missing, where)
            n = g.node(src)
            misses.append(Miss(src, n.op if n else None,
                               "a KV cache: concat([cache input, new], axis = 2) with the cache a graph input, or "
                               "tract_transformers_dyn_kv_cache", sm.name))
            continue
        if key.kind != value.kind:
            raise ConversionError(f"{where}: K comes from a {key.kind} cache but V from a {value.kind} one")
        scale, softcap, mask, bad = _interpret(ops)
        chain_nodes = [o[2] for o in ops]
        kind = "einsum" if mm1.op == "tract_core_einsum" or mm2.op == "tract_core_einsum" else "plain"
        blocks.append(AttentionBlock(kind, q, key, value, mm2.name, scale * kfactor, mask,
                                     nodes=[mm1.name, *chain_nodes, *fwd, mm2.name], softcap=softcap, unsupported=bad,
                                     sinks=sinks))
    for n in [n for n in g.nodes if n.op == "tract_transformers_sdpa"]:
        where = f"{g.where}: tract_transformers_sdpa '{n.name}'"
        q, k, v = n.arg_name("q"), n.arg_name("k"), n.arg_name("v")
        if q is None or k is None or v is None:
            misses.append(Miss(n.name, n.op, "identifiers for q, k and v", n.name))
            continue
        key = cache_source(g, k, where, "key")
        value = cache_source(g, v, where, "value")
        if key is None or value is None or key.kind != value.kind:
            src, _ = _repeat_chain(g, k if key is None else v, where)
            m = g.node(src)
            misses.append(Miss(src, m.op if m else None,
                               "a KV cache: concat([cache input, new], axis = 2) with the cache a graph input, or "
                               "tract_transformers_dyn_kv_cache", n.name))
            continue
        scale_e = n.arg("scale")
        scale = g.scalar_const(scale_e) if scale_e is not None else None
        causal = n.arg("is_causal")
        blocks.append(AttentionBlock("sdpa", q, key, value, n.name, scale or None, n.arg_name("mask"),
                                     is_causal=bool(static_value(causal)) if causal is not None else False,
                                     nodes=[n.name]))
    found, left = _folded(g, missed)
    blocks += found
    misses += left
    read_sink_logits(g, blocks)
    return blocks, misses


def _folded(g: GraphEdit, missed: list[tuple[Node, Miss | None]]) -> tuple[list[AttentionBlock], list[Miss]]:
    """The softmaxes the standard walk missed, followed through layout ops and proved by one run
    (:mod:`.folded`); the others keep their miss (None: a softmax over another axis, not an attention)."""
    cands = [(sm, miss, _follow_folded(g, sm)) for sm, miss in missed]
    todo = [(c, miss) for _, miss, c in cands if c is not None]
    misses = [miss for _, miss, c in cands if c is None and miss is not None]
    if not todo:
        return [], misses
    blocks = []
    for c, _ in todo:
        scale, softcap, mask, bad = _interpret(c.ops)
        blocks.append(AttentionBlock("folded", c.query_side[0], c.key, c.value, c.pv, scale, mask,
                                     nodes=[c.product, *[o[2] for o in c.ops], *c.forward, c.pv], softcap=softcap,
                                     unsupported=bad))
    read_block_masks(g, blocks)
    proofs = folded.prove(g, [(c, b) for (c, _), b in zip(todo, blocks)])
    out = []
    for (c, miss), b in zip(todo, blocks):
        p = proofs[c.softmax]
        if isinstance(p, str):
            miss = miss or Miss(c.softmax, "softmax", "a softmax over the last axis of the scores", c.softmax)
            misses.append(Miss(miss.node, miss.op, f"{miss.expected} (followed through layout ops: {p})", miss.around))
            continue
        b.q, b.query_layout, b.output, b.layout = p.query, p.query_layout, p.output, p.layout
        out.append(b)
    return out, misses


# ----------------------------------------------------------------------------------------------
# attentions tract's declutter folded into layout ops (proved and rewritten by converters/folded.py)
#: the ops a folded attention's layout goes through: views, transposes, casts and copies
LAYOUT_OPS = ops_having("view") | ops_having("numpy_view") | ops_having("passthrough")
#: ... and after the softmax, slices too (tract keeps only the last query of the last layer)
FORWARD_OPS = LAYOUT_OPS | {"slice"}


@dataclass
class Folded:
    """A softmax whose attention was followed through layout ops, before the proof."""

    softmax: str
    product: str  # q . K^T (A operand: the query in its folded layout)
    query_side: list[str]  # A, then its layout ancestors (nearest first)
    ops: list[tuple]  # the score transforms (attention._interpret's input)
    pv: str  # P . V
    forward: list[str]  # the names from the softmax to P . V (softmax first)
    key: Any  # CacheSource
    value: Any  # CacheSource
    after: list[str] = field(default_factory=list)  # P . V's layout descendants (nearest first)


def _layout_back(g: GraphEdit, name: str | None) -> list[str]:
    """``name`` and its ancestors through layout ops (nearest first)."""
    out: list[str] = []
    cur = name
    while cur is not None and len(out) < 32:
        out.append(cur)
        n = g.node(cur)
        if n is None or n.op not in LAYOUT_OPS:
            break
        cur = _first_input(n)
    return out


def _layout_forward(g: GraphEdit, name: str) -> list[str]:
    """``name``'s descendants through layout ops read by nothing else (nearest first, ``name`` excluded)."""
    out: list[str] = []
    cur = name
    while len(out) < 32:
        users = g.users(cur)
        if len(users) != 1 or users[0].op not in FORWARD_OPS or len(users[0].names) != 1:
            break
        cur = users[0].name
        out.append(cur)
    return out


def _follow_folded(g: GraphEdit, sm: Node) -> Folded | None:
    """The folded attention around softmax ``sm`` (syntactically), else None."""
    x = sm.arg_name("x")
    if x is None:
        return None
    try:
        mm1, ops = _to_scores(g, x, layouts=True)
    except _Stop:
        return None
    prod = _product(mm1)
    if prod is None:
        return None
    a, b, _ = prod
    mm2, fwd = _forward_to_pv(g, sm, FORWARD_OPS, 16)
    if mm2 is None:
        return None
    where = f"{g.where}: attention at '{mm2.name}'"
    key = _cache_at(g, _layout_back(g, b)[-1], where, "key")
    value = _cache_at(g, _layout_back(g, _product(mm2)[1])[-1], where, "value")  # type: ignore[index]
    if key is None or value is None or key.kind != value.kind:
        return None
    return Folded(sm.name, mm1.name, _layout_back(g, a), ops, mm2.name, fwd, key, value, _layout_forward(g, mm2.name))
