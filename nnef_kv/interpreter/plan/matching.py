"""What the chain matchers of :mod:`.patterns` and :mod:`.attention` share: the match record, the walk
back from a root through steps read only inside the chain, and the run-time guards of the fast forms."""
from __future__ import annotations

import math
import operator

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..graph import Node
from ..ops.nnef_std import _flatten
from ..values import Lazy
from .chains import Flow

__all__ = ["Match", "Walk", "attr_fn", "pair", "is_f32", "same_rank_broadcast", "scalarish", "lazy_reads",
           "reshaped"]

_F32 = np.dtype(np.float32)


@dataclass
class Match:
    op: str
    members: list[int]  # step indices, the root last
    inputs: list[int]  # external input slots
    fast: Callable[[list], Any]
    out: int
    #: what a later pass reads of the chain (:mod:`.dense`): its slots and its guard
    parts: dict[str, Any] | None = None


def attr_fn(node: Node, name: str, default: Any = None) -> Callable[[list], Any]:
    """``v -> value`` of an attribute of a member (a run-time attribute evaluated on the run's values)."""
    a = node.attrs.get(name, default)
    if isinstance(a, Lazy):
        return a.fn
    return lambda v, a=a: a


class Walk:
    """Walks back from a root through steps read only inside the chain being matched."""

    def __init__(self, flow: Flow, taken: set[int]) -> None:
        self.flow, self.taken = flow, taken
        self.members: set[int] = set()

    def inner(self, slot: Any, reader: int, *ops: str) -> tuple[int, Node] | None:
        """The step producing ``slot`` if it is one of ``ops``, stateless, not in another chain, has one
        int output, and is read by ``reader`` alone."""
        got = self.flow.node_of(slot)
        if got is None:
            return None
        k, node = got
        if (node.op not in ops or k in self.taken or k in self.members or node.prim.stateful
                or len(node.outputs) != 1 or not isinstance(node.outputs[0], int)
                or not self.flow.only_reader(slot, reader)):
            return None
        self.members.add(k)
        return k, node

    def castis_f32(self, slot: Any, reader: int) -> tuple[Any, int | None]:
        """Through an optional ``tract_core_cast(to = 'f32')`` read only by ``reader``: (the cast's input or
        ``slot``, the cast's step or None)."""
        got = self.flow.node_of(slot)
        if got is not None and got[1].op == "tract_core_cast" and got[1].attrs.get("to") == "f32":
            c = self.inner(slot, reader, "tract_core_cast")
            if c is not None:
                return c[1].inputs[0], c[0]
        return slot, None


def pair(node: Node) -> tuple[Any, Any] | None:
    if len(node.inputs) != 2 or not all(isinstance(i, int) for i in node.inputs):
        return None
    return node.inputs[0], node.inputs[1]


def is_f32(x: Any) -> bool:
    return type(x) is np.ndarray and x.dtype == _F32


def same_rank_broadcast(x: np.ndarray, w: Any) -> bool:
    """``w`` (f32, same rank) broadcasts into ``x``'s shape: NNEF's mul is then NumPy's on them."""
    if not is_f32(w) or w.ndim != x.ndim:
        return False
    ws, xs = w.shape, x.shape
    if ws == xs:
        return True
    for a, b in zip(ws, xs):
        if a != b and a != 1:
            return False
    return True


def scalarish(c: Any, rank: int) -> bool:
    """An f32 constant of one value that NNEF's binary ops add or multiply as NumPy does for ``rank``."""
    return is_f32(c) and c.size == 1 and c.ndim in (0, rank)


def same_objects(a: tuple, b: tuple) -> bool:
    """The two tuples hold the same objects (``is``), in order: what the plan's memos of run-time attributes
    compare (a shape memo hands out the same objects while shapes do not change)."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


def frozen(x: Any) -> bool:
    """``x`` cannot change while it lives, so what was computed from it may be remembered by its identity: an
    int, float, str, bool or None, a NumPy scalar, or an array that is read-only, as is every array it views (a
    shape memo's values are made read-only; a read-only view of a writeable array is not frozen)."""
    if x is None or type(x) in (int, float, str, bool) or isinstance(x, np.generic):
        return True
    while isinstance(x, np.ndarray):
        if x.flags.writeable:
            return False
        x = x.base
        if x is None:
            return True
    return False


def lazy_reads(node: Node) -> tuple[int, ...]:
    return tuple(s for a in node.attrs.values() if isinstance(a, Lazy) for s in (a.reads or ()))


def reshaped(dims: list[int], node: Node, v: list) -> list[int] | None:
    """The shape the reshape kernel gives an input of shape ``dims`` (None if it would not run)."""
    try:
        shape = _flatten(attr_fn(node, "shape", ())(v))
        start, count = int(attr_fn(node, "axis_start", 0)(v)), int(attr_fn(node, "axis_count", -1)(v))
        start = start + len(dims) if start < 0 else start
        count = len(dims) - start if count < 0 else count
        new = [dims[start + i] if int(s) == 0 else int(s) for i, s in enumerate(shape)]
        full = dims[:start] + new + dims[start + count:]
        if full.count(-1) == 1:
            known = math.prod(d for d in full if d != -1)
            i = full.index(-1)
            full[i] = math.prod(dims) // known if known else 0
    except (TypeError, ValueError, IndexError):
        return None
    return full if all(d >= 0 for d in full) and math.prod(full) == math.prod(dims) else None
