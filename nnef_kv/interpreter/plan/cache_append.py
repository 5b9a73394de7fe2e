"""Explicit caches without the copy: ``out_cache = concat([in_cache, new], axis)`` grown in place.

torch-to-nnef exports take each layer's K and V cache as a graph input and return the cache with the new
tokens as a graph output; the caller feeds that output back as the next call's input. ``concat`` copies
the whole cache every call (O(T) a token, per layer, twice). Here such a concat (a graph input first, a
graph output as its result) writes into a growing buffer instead: its result is a view of the buffer's
first ``T + S`` positions. When the next call's input *is* that view (the same buffer, from position 0, as
long as everything written to it, same strides), the new tokens are written after it and a longer view
is returned: O(S). "That view" means the very array object returned last for that buffer: any other
input (a fresh array, a copy, an older or shorter view, another view of the same memory, another dtype)
goes into a new buffer, as a concat would copy it.

The values are exactly ``concat``'s, in ``concat``'s axis order (:func:`concat_order`); what differs is
that the view is not contiguous (the buffer has spare capacity along ``axis``): the strides of the axes
outside ``axis`` in that order are the capacity's. Nothing is ever written inside a view already handed out (only past
its end), so a caller holding an older output still sees what it saw; two calls given the same view (two
threads, or a retried step) cannot both grow it: the first claims the spare room (under a lock), the
second copies.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np

from ..graph import Graph, Node, slots_of
from ..values import Lazy
from .steps import Step

__all__ = ["grow_concat", "concat_order", "rewrite_cache_concats", "GROWTH", "MIN_SPARE"]

#: spare capacity a new buffer gets: a quarter of its length, at least MIN_SPARE positions
GROWTH = 0.25
MIN_SPARE = 64

_lock = threading.Lock()
#: id(owner) -> [weakref to the owner, positions written, weakref to the last view handed out, the buffer
#: (the owner seen in the graph's axis order), the buffer's axis order]
_fill: dict[int, list[Any]] = {}
_perms: dict[tuple, tuple[int, ...]] = {}


def _forget(key: int, lock: Any = _lock, fill: dict = _fill) -> None:
    """Weakref callback: the buffer is gone (bound defaults: module globals may be cleared at exit)."""
    with lock:
        fill.pop(key, None)


def concat_order(arrays: list[np.ndarray]) -> tuple[int, ...]:
    """The axis order (outermost first) of the array ``np.concatenate(arrays)`` returns: NumPy keeps its
    inputs' layout (``PyArray_CreateMultiSortedStridePerm``: a stable insertion sort of the axes by their
    strides in every input where both axes are longer than 1, C order winning conflicts; re-implemented
    here, checked against NumPy in the tests). The buffer is laid out the same way, so every product
    reading the cache sees the strides it would see on ``concat``'s result (BLAS's summation can depend
    on them)."""
    ndim = arrays[0].ndim
    perm = list(range(ndim))
    for i0 in range(1, ndim):
        ipos, j0 = i0, perm[i0]
        for i1 in range(i0 - 1, -1, -1):
            ambiguous, swap = True, False
            j1 = perm[i1]
            for a in arrays:
                if a.shape[j0] != 1 and a.shape[j1] != 1:
                    if abs(a.strides[j0]) <= abs(a.strides[j1]):
                        swap = False
                    elif ambiguous:
                        swap = True
                    ambiguous = False
            if not ambiguous:
                if swap:
                    ipos = i1
                else:
                    break
        if ipos != i0:
            perm[ipos + 1:i0 + 1] = perm[ipos:i0]
            perm[ipos] = j0
    return tuple(perm)


def _order(x: np.ndarray, new: np.ndarray) -> tuple[int, ...]:
    key = (x.shape, x.strides, new.shape, new.strides)
    got = _perms.get(key)
    if got is None:
        got = concat_order([x, new])
        if len(_perms) > 4096:
            _perms.clear()
        _perms[key] = got
    return got


def _new_buffer(shape: list[int], axis: int, dtype: np.dtype, perm: tuple[int, ...]) -> tuple[np.ndarray, list]:
    n = shape[axis]
    cap = list(shape)
    cap[axis] = n + max(MIN_SPARE, int(n * GROWTH))
    owner = np.empty([cap[p] for p in perm], dtype)
    buf = owner.transpose(np.argsort(perm))
    key = id(owner)
    meta = [weakref.ref(owner, lambda _r, key=key, forget=_forget: forget(key)), 0, None, buf, perm]
    with _lock:
        _fill[key] = meta
    return buf, meta


def _claim(x: np.ndarray, axis: int, extra: int, perm: tuple[int, ...]) -> tuple[np.ndarray, int, list[Any]] | None:
    """``(buffer, start, its record)`` when ``x`` is the last view handed out of one of our buffers (all
    that is written in it), laid out in ``perm``, with room for ``extra`` more positions along ``axis``;
    the buffer's fill then moves past them (claimed, under the lock). Else None."""
    owner = x.base
    if type(owner) is not np.ndarray:
        return None
    n = x.shape[axis]
    with _lock:
        meta = _fill.get(id(owner))
        if (meta is None or meta[0]() is not owner or meta[2] is None or meta[2]() is not x or meta[1] != n
                or meta[4] != perm or n + extra > meta[3].shape[axis]):
            return None
        meta[1] = n + extra
    return meta[3], n, meta


def grow_concat(values: list[np.ndarray], axis: int, c_order: bool = False) -> np.ndarray:
    """``concat(values, axis)`` for ``[cache, new]`` (see the module docstring); anything else: the concat
    kernel. ``c_order``: the buffer in C order whatever ``concat`` would choose (when no product reads the
    result's strides: the grouped-query repeat copies it first)."""
    if len(values) != 2:
        return _generic(values, axis)
    x, new = values
    if (type(x) is not np.ndarray or type(new) is not np.ndarray or x.dtype != new.dtype or x.ndim != new.ndim
            or not x.ndim):
        return _generic(values, axis)
    a = axis + x.ndim if axis < 0 else axis
    if not 0 <= a < x.ndim or x.shape[:a] != new.shape[:a] or x.shape[a + 1:] != new.shape[a + 1:]:
        return _generic(values, axis)
    s = new.shape[a]
    lead = (slice(None),) * a
    perm = tuple(range(x.ndim)) if c_order else _order(x, new)
    got = _claim(x, a, s, perm)
    if got is None:
        total = list(x.shape)
        total[a] += s
        buf, meta = _new_buffer(total, a, x.dtype, perm)
        start = x.shape[a]
        buf[lead + (slice(0, start),)] = x
        with _lock:
            meta[1] = start + s
    else:
        buf, start, meta = got
    buf[lead + (slice(start, start + s),)] = new
    out = buf[lead + (slice(0, start + s),)]
    meta[2] = weakref.ref(out)
    return out


def _generic(values: list[np.ndarray], axis: int) -> np.ndarray:
    from ..ops.nnef_std import concat

    return concat(values, axis=axis)


def _only_repeated(graph: Graph, slot: int) -> bool:
    """Nothing in the graph reads ``slot``'s strides: every reader takes its shape (``tract_core_shape_of``)
    or is the grouped-query repeat ``unsqueeze(x, [2])`` whose value only shape readers and ``tile`` (a
    C-ordered copy) read."""
    readers: dict[int, list[Node]] = {}
    for node in graph.nodes:
        for spec in node.inputs:
            for s in slots_of(spec):
                readers.setdefault(s, []).append(node)
        for a in node.attrs.values():
            if isinstance(a, Lazy) and (a.reads is None or slot in a.reads):
                return False
    shape_only = ("tract_core_shape_of", "shape_of")
    found = False
    for r in readers.get(slot, []):
        if r.op in shape_only:
            continue
        if r.op != "unsqueeze" or r.attrs.get("axes") != [2] or len(r.outputs) != 1 \
                or not isinstance(r.outputs[0], int) or r.outputs[0] in {s for _, s in graph.outputs}:
            return False
        for rr in readers.get(r.outputs[0], []):
            if rr.op not in shape_only and rr.op != "tile":
                return False
        found = True
    return found


def rewrite_cache_concats(graph: Graph, steps: list[Step], nodes: list[Node]) -> tuple[list[Step], int]:
    """The steps of ``concat([graph input, x], axis)`` producing a graph output, with a static axis, run
    :func:`grow_concat` (in C order when only the grouped-query repeat reads the cache, see
    :func:`_only_repeated`); returns the steps and how many were rewritten."""
    inputs = {i.slot for i in graph.inputs}
    outputs = {s for _, s in graph.outputs}
    out = list(steps)
    n = 0
    for k, node in enumerate(nodes):
        if node.op != "concat" or len(node.inputs) != 1 or not isinstance(node.inputs[0], list):
            continue
        vals = node.inputs[0]
        axis = node.attrs.get("axis")
        if (len(vals) != 2 or vals[0] not in inputs or type(axis) is not int or len(node.outputs) != 1
                or node.outputs[0] not in outputs):
            continue
        a, b = vals
        o = node.outputs[0]
        c_order = _only_repeated(graph, o)

        def step(v: list, st: list, a: int = a, b: int = b, o: int = o, axis: int = axis, c: bool = c_order) -> None:
            v[o] = grow_concat([v[a], v[b]], axis, c)
        step.grow = (a, b, o)  # type: ignore[attr-defined]  # read by the segments pass
        out[k] = step
        n += 1
    return out, n
