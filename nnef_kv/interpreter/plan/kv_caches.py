"""The KV caches an attention reads, found on the built graph (for :mod:`.recognize`, the one attention
recognizer): ``K`` / ``V`` followed back through casts and the grouped-query repeat (``unsqueeze(axes = [2]) ->
tile/broadcast -> reshape``: kv head ``h`` serves query heads ``h*G .. h*G+G-1``, the mapping the fused ops use) to

* ``explicit``: ``concat([past, new], axis = 2)`` where ``past`` is a graph input (``in_cache_*``,
  ``past_key_values.*``); the concatenation is usually also a graph output (``out_cache_*``, ``present.*``);
* ``dyn``: ``tract_transformers_dyn_kv_cache(new, ...)`` (tract holds the cache in its state);

and every cache of a graph whatever reads it (:func:`find_caches`), with its role by use."""
from __future__ import annotations

from dataclasses import dataclass, field

from ...errors import ConversionError
from ..catalog import ops_having
from ..graph import Node
from .view import PASSTHROUGH, View, product

__all__ = ["Cache", "cache_at", "cache_source", "repeat_chain", "repeat_nodes", "find_caches", "DYN_CACHE_OP",
           "REPEAT_OPS"]

#: the steps of a K/V head expansion (repeat_kv)
REPEAT_OPS = ops_having("kv_expand")
DYN_CACHE_OP = "tract_transformers_dyn_kv_cache"
SDPA_OP = "tract_transformers_sdpa"


@dataclass
class Cache:
    """Where the full K (or V) of an attention comes from (slots of the built graph)."""

    kind: str  # "explicit" or "dyn"
    full: int  # the slot holding past + new (concat output / dyn cache output)
    new: int  # this call's new tokens
    node: Node  # the concat / dyn cache node
    past: int | None = None  # explicit: the graph input holding the past
    repeat: list[int] = field(default_factory=list)  # the slots of the GQA repeat chain (full -> attention)
    role: str = ""  # "key" or "value" when known


def repeat_nodes(w: View, slot: int) -> list[Node]:
    """The nodes K (or V) goes back through to its source: casts and the steps of a head expansion (nearest
    first); unchecked (:func:`repeat_chain` checks it is the grouped-query repeat)."""
    out: list[Node] = []
    n = w.node(slot)
    while n is not None and n.op in REPEAT_OPS | PASSTHROUGH and w.first(n) is not None and len(out) < 64:
        out.append(n)
        n = w.node(w.first(n))
    return out


def repeat_chain(w: View, slot: int) -> tuple[int, list[int]]:
    """Follow K/V back through casts and the GQA repeat; returns (source slot, chain slots)."""
    nodes = repeat_nodes(w, slot)
    chain = [w.out(n) for n in nodes]
    cur = w.first(nodes[-1]) if nodes else slot
    structural = [c for c in chain if w.node(c).op in REPEAT_OPS]  # type: ignore[union-attr]
    if structural:  # source side first: must start with unsqueeze(axes = [2]) (repeat_interleave of heads)
        fn = w.node(structural[-1])
        if fn is None or fn.op != "unsqueeze" or w.attr(fn, "axes") != [2]:
            ops = [w.node(c).op for c in chain]  # type: ignore[union-attr]
            raise ConversionError(
                f"{w.where}: '{w.name(slot)}' reaches the attention through {' -> '.join(reversed(ops))}; only the "
                "grouped-query repeat unsqueeze(axes = [2]) -> tile/broadcast -> reshape is understood")
    return cur, chain


def cache_at(w: View, src: int, what: str, chain: list[int] | None = None) -> Cache | None:
    n = w.node(src)
    if n is None:
        return None
    if n.op == "concat":
        values = w.arg(n, "values")
        if not isinstance(values, list) or len(values) != 2 or values[0] not in w.inputs:
            return None
        axis = w.axis(n, "axis")
        if axis not in (2, -2):
            raise ConversionError(f"{w.where}: {what} cache '{w.name(src)}' concatenates on axis {axis}; only the "
                                  "[B, H, T, D] layout (sequence axis 2) is supported")
        return Cache("explicit", src, values[1], n, past=values[0], repeat=list(chain or []), role=what)
    if n.op == DYN_CACHE_OP:
        new = w.first(n)
        if new is None:
            return None
        axis = w.axis(n, "axis")
        if axis not in (2, -2):
            raise ConversionError(f"{w.where}: dyn kv cache '{w.name(src)}' is on axis {axis}; only axis 2 is "
                                  "supported")
        return Cache("dyn", src, new, n, repeat=list(chain or []), role=what)
    return None


def cache_source(w: View, slot: int, what: str) -> Cache | None:
    """The cache a K (``what = "key"``) or V reaches through casts and the GQA repeat, else None."""
    src, chain = repeat_chain(w, slot)
    return cache_at(w, src, what, chain)


def _role_by_use(w: View, slot: int) -> str:
    """``key`` when the cache reaches the second operand of a scores-like product (transposed), ``value`` when
    it reaches the second operand of p . V, through the GQA repeat and casts; else ''."""
    frontier, seen = [slot], set()
    while frontier:
        cur = frontier.pop()
        if cur in seen:
            continue
        seen.add(cur)
        for u in w.users(cur):
            if u.op in REPEAT_OPS | PASSTHROUGH:
                frontier.append(w.out(u))
            elif u.op == "transpose" and w.attr(u, "axes") == [0, 1, 3, 2]:
                return "key"
            elif u.op == SDPA_OP:
                return "key" if w.arg(u, "k") == cur else "value" if w.arg(u, "v") == cur else ""
            else:
                prod = product(w, u)
                if prod is not None and prod[1] == cur:
                    return "key" if prod[2] else "value"
    return ""


def find_caches(w: View) -> list[tuple[Cache, str]]:
    """Every KV cache of the graph whatever the attention around it (``concat([graph input, new], axis = 2)``,
    ``tract_transformers_dyn_kv_cache``), each with its role by use ('' when its use does not tell)."""
    out, where = [], w.where
    try:
        for n in w.graph.nodes:
            if n.op == "concat" or n.op == DYN_CACHE_OP:
                w.where = f"{where}: cache '{n.name}'"
                src = cache_at(w, w.out(n), "")
                if src is not None:
                    out.append((src, _role_by_use(w, src.full)))
    finally:
        w.where = where
    return out
