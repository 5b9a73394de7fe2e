"""Find attention blocks and the KV caches feeding them.

Two shapes of attention are recognised:

* **plain**: ``matmul(q, K^T) -> [mul|div by a constant] -> [add mask] -> softmax(last axis) ->
  [cast] -> matmul(., V)``, with ``K^T`` a ``transpose(K, [0, 1, 3, 2])`` (or ``transposeB = true``),
  as torch-to-nnef's eager export and nnef-tools' ONNX conversion write it;
* **fused**: ``tract_transformers_sdpa(q, K, V, mask?, scale?, ...)``.

``K``/``V`` are then followed back through the grouped-query repeat that exports add
(``unsqueeze(axes = [2]) -> tile/broadcast -> reshape``: kv head ``h`` serves query heads
``h*G .. h*G+G-1``, the mapping the fused ops use) to their cache:

* ``explicit``: ``concat([past, new], axis = 2)`` where ``past`` is a graph input (``in_cache_*``,
  ``past_key_values.*``); the concatenation is usually also a graph output (``out_cache_*``,
  ``present.*``);
* ``dyn``: ``tract_transformers_dyn_kv_cache(new, ...)`` (tract holds the cache in its state).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ConversionError
from ..grammar import ast as A
from .graph_edit import GraphEdit, Node, int_list, static_value

PASSTHROUGH = ("tract_core_cast", "copy")
REPEAT_OPS = ("unsqueeze", "tile", "tract_core_broadcast", "reshape")


@dataclass
class CacheSource:
    """Where the full K (or V) of an attention comes from."""

    kind: str  # "explicit" or "dyn"
    full: str  # the name holding past + new (concat output / dyn cache output)
    new: str  # this call's new tokens
    past: str | None = None  # explicit: the graph input holding the past
    node: Node | None = None  # the concat / dyn cache node
    repeat: list[str] = field(default_factory=list)  # names of the GQA repeat chain (full -> attention)


@dataclass
class AttentionBlock:
    """One attention found in the graph."""

    kind: str  # "plain" or "sdpa"
    q: str
    key: CacheSource
    value: CacheSource
    output: str  # the name holding the attention result [B, Hq, S, D]
    scale: float | None  # None: absent (the op's default 1/sqrt(D))
    mask: str | None  # the additive mask or sdpa mask input dropped by the conversion
    is_causal: bool = False  # sdpa's own is_causal flag
    nodes: list[str] = field(default_factory=list)  # the attention's own nodes (q.k to output)

    def describe(self) -> str:
        return (f"{self.kind} attention -> '{self.output}' (q '{self.q}', K {self.key.kind} '{self.key.full}', "
                f"V {self.value.kind} '{self.value.full}', scale {self.scale}, mask {self.mask!r})")


# ----------------------------------------------------------------------------------------------
def _single_axis(n: Node, param: str) -> int | None:
    v = n.arg(param)
    axes = int_list(v) if v is not None else None
    if axes is None:
        return None
    return axes[0] if len(axes) == 1 else None


def _scores_chain(g: GraphEdit, name: str) -> tuple[Node, float, str | None, list[str]] | None:
    """From a softmax input back to the q.k matmul: (matmul node, scale factor, mask, chain names)."""
    scale = 1.0
    mask: str | None = None
    chain: list[str] = []
    cur = name
    for _ in range(16):
        n = g.node(cur)
        if n is None or n.inv is None:
            return None
        chain.append(cur)
        op = n.op
        if op == "matmul":
            return n, scale, mask, chain
        if op in PASSTHROUGH:
            cur = n.arg_name("input") or n.arg_name("x") or ""
            continue
        if op in ("mul", "div"):
            x, y = n.arg("x"), n.arg("y")
            cy, cx = g.scalar_const(y), g.scalar_const(x) if op == "mul" else None
            if cy is not None and isinstance(x, A.Identifier):
                scale = scale * cy if op == "mul" else (scale / cy if cy else scale)
                cur = x.name
                continue
            if cx is not None and isinstance(y, A.Identifier):
                scale *= cx
                cur = y.name
                continue
            return None
        if op == "add" and mask is None:
            x, y = n.arg_name("x"), n.arg_name("y")
            for s, m in ((x, y), (y, x)):
                if s is not None and m is not None and _reaches_matmul(g, s):
                    mask, cur = m, s
                    break
            else:
                return None
            continue
        return None
    return None


def _reaches_matmul(g: GraphEdit, name: str) -> bool:
    cur = name
    for _ in range(8):
        n = g.node(cur)
        if n is None:
            return False
        if n.op == "matmul":
            return True
        if n.op in PASSTHROUGH + ("mul", "div"):
            nxt = n.arg_name("input") or n.arg_name("x")
            if nxt is None:
                return False
            cur = nxt
            continue
        return False
    return False


def _key_operand(g: GraphEdit, mm: Node) -> tuple[str, float] | None:
    """The K (layout [B, H, T, D]) a q.k matmul reads, and any constant factor applied to K^T."""
    b = mm.arg("B")
    tb = static_value(mm.arg("transposeB")) if mm.arg("transposeB") is not None else False
    if not isinstance(b, A.Identifier):
        return None
    factor = 1.0
    cur = b.name
    for _ in range(8):
        n = g.node(cur)
        if n is None:
            return None
        if n.op in ("mul", "div") and g.scalar_const(n.arg("y")) is not None and n.arg_name("x"):
            c = g.scalar_const(n.arg("y"))
            factor = factor * c if n.op == "mul" else factor / c
            cur = n.arg_name("x") or ""
            continue
        break
    if tb:
        return cur, factor
    n = g.node(cur)
    if n is not None and n.op == "transpose" and int_list(n.arg("axes")) == [0, 1, 3, 2] and n.arg_name("input"):
        return n.arg_name("input") or "", factor
    return None


def _repeat_chain(g: GraphEdit, name: str, where: str) -> tuple[str, list[str]]:
    """Follow K/V back through the GQA repeat; returns (source name, chain names)."""
    chain: list[str] = []
    cur = name
    while True:
        n = g.node(cur)
        if n is None or n.op not in REPEAT_OPS + PASSTHROUGH:
            break
        nxt = n.arg_name("input") or n.arg_name("x")
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


def _cache_source(g: GraphEdit, name: str, where: str, what: str) -> CacheSource | None:
    src, chain = _repeat_chain(g, name, where)
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
        return CacheSource("explicit", src, new.name, past=past.name, node=n, repeat=chain)
    if n.op == "tract_transformers_dyn_kv_cache":
        new = n.arg_name("input")
        axis = static_value(n.arg("axis")) if n.arg("axis") is not None else None
        if new is None:
            return None
        if axis not in (2, -2):
            raise ConversionError(f"{where}: dyn kv cache '{src}' is on axis {axis}; only axis 2 is supported")
        return CacheSource("dyn", src, new, node=n, repeat=chain)
    return None


# ----------------------------------------------------------------------------------------------
def find_plain_attention(g: GraphEdit) -> tuple[list[AttentionBlock], list[str]]:
    """Every plain attention; returns (blocks with a cache, descriptions of attentions without one)."""
    blocks: list[AttentionBlock] = []
    uncached: list[str] = []
    for sm in [n for n in g.nodes if n.op == "softmax"]:
        x = sm.arg_name("x")
        axis = _single_axis(sm, "axes")
        if x is None or axis not in (3, -1):
            continue
        found = _scores_chain(g, x)
        if found is None:
            continue
        mm1, scale, mask, chain = found
        q = mm1.arg_name("A")
        if q is None or static_value(mm1.arg("transposeA") or A.LogicalLiteral(False)):
            continue
        ko = _key_operand(g, mm1)
        if ko is None:
            continue
        kfull, kfactor = ko
        # forward: softmax -> [cast] -> matmul(p, V)
        cur, fwd = sm.name, [sm.name]
        mm2 = None
        for _ in range(4):
            users = g.users(cur)
            if len(users) != 1:
                break
            u = users[0]
            if u.op in PASSTHROUGH:
                cur = u.name
                fwd.append(cur)
                continue
            if u.op == "matmul" and u.arg_name("A") == cur and not static_value(
                    u.arg("transposeA") or A.LogicalLiteral(False)) and not static_value(
                    u.arg("transposeB") or A.LogicalLiteral(False)):
                mm2 = u
            break
        if mm2 is None or mm2.arg_name("B") is None:
            continue
        where = f"{g.where}: attention at '{mm2.name}'"
        key = _cache_source(g, kfull, where, "key")
        value = _cache_source(g, mm2.arg_name("B") or "", where, "value")
        desc = f"'{mm1.name}' -> softmax '{sm.name}' -> '{mm2.name}'"
        if key is None or value is None:
            uncached.append(desc)
            continue
        if key.kind != value.kind:
            raise ConversionError(f"{where}: K comes from a {key.kind} cache but V from a {value.kind} one")
        nodes = [mm1.name, *reversed(chain), *fwd, mm2.name]
        blocks.append(AttentionBlock("plain", q, key, value, mm2.name, scale * kfactor, mask, nodes=nodes))
    return blocks, uncached


def find_sdpa_attention(g: GraphEdit) -> tuple[list[AttentionBlock], list[str]]:
    """Every ``tract_transformers_sdpa`` fed by ``tract_transformers_dyn_kv_cache`` (K and V)."""
    blocks: list[AttentionBlock] = []
    uncached: list[str] = []
    for n in [n for n in g.nodes if n.op == "tract_transformers_sdpa"]:
        where = f"{g.where}: tract_transformers_sdpa '{n.name}'"
        q, k, v = n.arg_name("q"), n.arg_name("k"), n.arg_name("v")
        if q is None or k is None or v is None:
            uncached.append(f"sdpa '{n.name}' (non-identifier q/k/v)")
            continue
        key = _cache_source(g, k, where, "key")
        value = _cache_source(g, v, where, "value")
        if key is None or value is None or key.kind != "dyn" or value.kind != "dyn":
            uncached.append(f"sdpa '{n.name}'")
            continue
        scale_e = n.arg("scale")
        scale = g.scalar_const(scale_e) if scale_e is not None else None
        causal = n.arg("is_causal")
        blocks.append(AttentionBlock("sdpa", q, key, value, n.name, scale, n.arg_name("mask"),
                                     is_causal=bool(static_value(causal)) if causal is not None else False,
                                     nodes=[n.name]))
    return blocks, uncached
