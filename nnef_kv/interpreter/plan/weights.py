"""Weights pass: ``linear(x, W)`` and ``matmul(x, W, transposeB = true)`` with a constant ``W`` run as
``x @ Wt`` where ``Wt`` is the transposed view of a C-contiguous ``[out, in]`` array, the layout torch and
tract store a ``Linear`` weight in: a few-row product (a decode step) runs on the numba kernel reading
rows of ``W`` (:mod:`nnef_kv.kernels.gemv`), a prefill on BLAS told the transposition (no copy). Products
of one input by several constant weights (q/k/v, gate/up) become one product by the weights stacked
(one new ``[sum of outs, in]`` array).

The products' weights are held in huge pages (:mod:`nnef_kv.tensors.hugepages`) where that costs no second
copy: stacked weights are made there; a weight of :data:`MIN_HUGE_BYTES` to :data:`MAX_HUGE_BYTES`
memory-mapped from a model file is copied there by :func:`place_weights` and its file pages are given
back (:func:`nnef_kv.tensors.pages.release_pages`), so the plan still holds one copy and loading reads no
tensor byte (planning does); a ``.tgz`` member is inflated into huge pages already; a model the process
built itself keeps its arrays. A decode step streams every weight once: in huge pages it does so without
the page-table walks of 4 KiB pages (docs/benchmarks.md, "At real size"). ``NNEF_KV_HUGE_PAGES=0`` keeps
the archive's own mapped arrays (nothing read at planning). The copies are shared by the plans of the
same loaded arrays (a converted archive's session and its reference's in ``validate``, see
:func:`_stacked`). A tied embedding stays one array in the archive; when its LM head is copied, the copy
is what is held, the gather reading a few rows of the mapping a step.

Measured (``python benchmarks/scale.py --rows products``, one thread, GB/s of weight read): BLAS on the
transposed view 13.5-17.3 at one row, 5.3-5.6 at 2-4 rows; the numba kernel 20.8-30.8 and 16.2-21.7; at
64 and 512 rows BLAS on the view and on a contiguous ``[in, out]`` copy are within 15%."""
from __future__ import annotations

import weakref
from typing import Any, Callable

import numpy as np

from ...tensors import hugepages
from ...tensors.pages import _mapping_of, release_pages
from ..graph import Node
from .parallel import few_rows, split_matmul
from .steps import Step, has_lazy as _has_lazy, replace_steps

__all__ = ["rewrite_weights", "fuse_projections", "place_weights", "MIN_HUGE_BYTES",
           "MAX_HUGE_BYTES"]


def _matmul_pretransposed(a: np.ndarray, bt: np.ndarray) -> np.ndarray:
    """``a @ bt`` with the leading axes of ``a`` folded into rows: one 2-D BLAS call (split in two column
    halves across two threads when the session runs with ``threads = 2``, see :mod:`.parallel`)."""
    got = few_rows(a, bt)  # a decode step's product
    if got is not None:
        return got
    if a.ndim > 2 and bt.ndim == 2 and a.flags.c_contiguous and a.dtype == bt.dtype:
        return split_matmul(a.reshape(-1, a.shape[-1]), bt).reshape(a.shape[:-1] + (bt.shape[1],))
    if a.ndim == 2 and bt.ndim == 2:
        return split_matmul(a, bt)
    return np.matmul(a, bt)


def add_bias(y: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """``y + bias`` as ``linear`` adds it (in y's dtype; a single zero bias adds nothing)."""
    if bias is not None:
        if bias.ndim == 0 or bias.size == 1:
            if bias.reshape(()).item() != 0:
                y = y + bias.reshape(()).astype(y.dtype)
        else:
            y = y + bias.astype(y.dtype, copy=False)
    return y


def _linear_pretransposed(x: np.ndarray, wt: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    return add_bias(_matmul_pretransposed(x, wt), bias)


def _prepare_weight(w: np.ndarray) -> np.ndarray:
    """``W [.., out, in]`` -> ``[in, out]`` (leading unit axes dropped): the transposed view of a contiguous
    ``W`` (no copy: BLAS reads it transposed), a contiguous copy of any other layout."""
    while w.ndim > 2 and w.shape[0] == 1:
        w = w[0]
    wt = np.swapaxes(w, -1, -2)
    if wt.ndim == 2:  # the view of a C-contiguous [out, in]: what the few-row kernel reads (see .parallel)
        return wt if wt.flags.f_contiguous else np.ascontiguousarray(w).T
    return np.ascontiguousarray(wt)


def rewrite_weights(node: Node, base: list[Any], consts: set[int]) -> tuple[Callable, list[Any], dict] | None:
    """linear / matmul(transposeB) with a constant weight -> a kernel on a pre-transposed weight."""
    if node.op == "linear" and isinstance(node.inputs[1], int) and node.inputs[1] in consts and not node.attrs:
        w = base[node.inputs[1]]
        x_rank_ok = w.ndim >= 2 and all(d == 1 for d in w.shape[:-2])
        if not x_rank_ok or w.dtype.kind != "f":
            return None
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        b = base[bias] if isinstance(bias, int) and bias in consts else None
        if isinstance(b, np.ndarray) and b.size == 1 and b.reshape(()).item() == 0:
            bias = None  # linear(x, W, 0.0): what the kernels skip anyway; the product can join a projection
        wt = _prepare_weight(w)
        return _linear_pretransposed, [node.inputs[0], ("const", wt), bias], {}
    if node.op == "matmul" and isinstance(node.inputs[1], int) and node.inputs[1] in consts:
        attrs = node.attrs
        if _has_lazy(attrs) or attrs.get("transposeA", False) or not attrs.get("transposeB", False):
            return None
        w = base[node.inputs[1]]
        if w.ndim < 2 or w.dtype.kind != "f" or any(d != 1 for d in w.shape[:-2]):
            return None
        return _matmul_pretransposed, [node.inputs[0], ("const", _prepare_weight(w))], {}
    return None


def _root(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


#: weights copied for the plans (stacked or alone) by what they were made of: (id of each part's root array,
#: where in it, shape, strides, dtype) -> (weak references to those roots, a weak reference to the copy)
_COPIES: dict[tuple, tuple[tuple[weakref.ref, ...], weakref.ref]] = {}
#: a weight smaller than this stays where it is (the archive's mapping, or its own array): the copy would cost
#: more than its share of a step
MIN_HUGE_BYTES = 256 * 1024
#: nor is a weight larger than this copied alone (the LM head of a large vocabulary): one long stream gains
#: little from huge pages (``python benchmarks/scale.py --rows products``: 1 x 576 x 49152 at 29.2 GB/s from a
#: NumPy array, 28.2 from huge pages; a SmolLM2-135M-shaped f32 decode step, its 113 MB head copied or
#: not, interleaved in one process: 25.5-29.7 vs 26.2-30.2 ms, 2-3%), and copying costs load time (1.8 s
#: for Llama-3.2-1B's tied 1 GB embedding) and, while it is copied, the weight's size twice
MAX_HUGE_BYTES = 256 << 20


def _stacked(parts: list[np.ndarray]) -> np.ndarray:
    """The weights ``parts`` (each ``[in, out_i]``, the transposed view of an ``[out_i, in]`` array) side by
    side: ``[in, sum of outs]``, the transposed view of one C-contiguous ``[sum of outs, in]`` array, in
    huge pages (:mod:`nnef_kv.tensors.hugepages`, unless turned off). Parts that are views of read-only
    arrays (a loaded archive's) give the array made for the same parts by another plan while that one is
    alive: the sessions of an archive and of its reference hold one copy, not one each (``validate`` gives
    both the same arrays), and so do compare's worker processes, forked from the process that planned the
    reference (:mod:`nnef_kv.validate.jobs`). The pages of memory-mapped parts are given back: read again
    from the file if anything else uses them (a tied embedding's gather reads a few rows a step)."""
    roots = [_root(p) for p in parts]
    key = None
    if all(not r.flags.writeable for r in roots):
        key = tuple((id(r), p.__array_interface__["data"][0] - r.__array_interface__["data"][0], p.shape,
                     p.strides, p.dtype.str) for p, r in zip(parts, roots))
        got = _COPIES.get(key)
        if got is not None and all(ref() is r for ref, r in zip(got[0], roots)):
            wt = got[1]()
            if wt is not None:
                return wt
    rows = sum(p.shape[1] for p in parts)
    dtype = np.result_type(*parts)
    w = hugepages.empty((rows, parts[0].shape[0]), dtype) if hugepages.enabled() else \
        np.empty((rows, parts[0].shape[0]), dtype)
    np.concatenate([p.T for p in parts], axis=0, out=w)
    wt = w.T
    for p in parts:
        release_pages(p)
    if key is not None:
        for k in [k for k, (refs, x) in _COPIES.items() if x() is None or any(r() is None for r in refs)]:
            del _COPIES[k]
        wt.flags.writeable = False
        _COPIES[key] = (tuple(weakref.ref(r) for r in roots), weakref.ref(wt))
    return wt


def place_weights(base: list[Any], slots: list[int]) -> None:
    """The prepared weights at ``base[slot]`` (``[in, out]`` views, see :func:`rewrite_weights`) of
    :data:`MIN_HUGE_BYTES` to :data:`MAX_HUGE_BYTES`, in huge pages (:mod:`nnef_kv.tensors.hugepages`): a decode
    step streams them at a higher rate there. A weight memory-mapped read-only from a model file is copied
    (shared with other plans of the same arrays, see :func:`_stacked`) and its file pages are given back; one
    already in huge pages (a ``.tgz`` member is inflated into them) stays; one in the process's own memory (a
    model built or imported in Python) stays too: a copy would hold it twice. Nothing when
    ``NNEF_KV_HUGE_PAGES=0``."""
    if not hugepages.enabled():
        return
    for s in slots:
        wt = base[s]
        if not (isinstance(wt, np.ndarray) and wt.ndim == 2 and MIN_HUGE_BYTES <= wt.nbytes <= MAX_HUGE_BYTES
                and wt.dtype.kind == "f"):
            continue
        root = _root(wt)
        if root.flags.writeable or hugepages.holds(root) or _mapping_of(root.base) is None:
            continue
        base[s] = _stacked([wt])


def fuse_projections(steps: list[Step], step_nodes: list[Node],
                      projections: list[tuple[int, int, np.ndarray, int, int]], base: list[Any]
                      ) -> tuple[list[Step], list[Node], int]:
    """Products of one input by several constant weights (q/k/v, gate/up) -> one product by the weights
    side by side, run where the first of them was; each output is a column slice of the result. The
    others' inputs are that same input and constants, so running them earlier changes nothing."""
    groups: dict[int, list[tuple[int, int, np.ndarray, int, int]]] = {}
    for p in projections:
        groups.setdefault(p[1], []).append(p)
    replace: dict[int, tuple[Step, Node]] = {}
    drop: set[int] = set()
    for x, members in groups.items():
        if len(members) < 2:
            continue
        w0 = members[0][2]
        members = [m for m in members if m[2].shape[0] == w0.shape[0] and m[2].dtype == w0.dtype]
        if len(members) < 2:
            continue
        wt = _stacked([m[2] for m in members])
        parts: list[tuple[int, int, int]] = []
        at = 0
        for m in members:
            parts.append((m[3], at, at + m[2].shape[1]))
            at += m[2].shape[1]
        first = step_nodes[members[0][0]]
        node = Node(first.name, first.op, first.prim, [x] + [n for m in members for n in step_nodes[m[0]].inputs[1:]],
                    {}, [m[3] for m in members], first.location)

        def step(v: list, st: list, x: int = x, wt: np.ndarray = wt, parts: tuple = tuple(parts)) -> None:
            y = _matmul_pretransposed(v[x], wt)
            for o, a, b in parts:
                v[o] = y[..., a:b]

        step.product = (x, wt, tuple(parts))  # type: ignore[attr-defined]  # read by the dense pass (the array: the
        # step reads this one, in huge pages or not)
        replace[members[0][0]] = (step, node)
        drop.update(m[0] for m in members[1:])
        for m in members:  # the separate transposed weights are not used any more
            base[m[4]] = None
    if not replace:
        return steps, step_nodes, 0
    return replace_steps(steps, step_nodes, replace, drop)
