"""Weights pass: ``linear(x, W)`` and ``matmul(x, W, transposeB = true)`` with a constant ``W`` run as
``x @ Wt`` where ``Wt`` is the transposed *view* of the archive's own ``[out, in]`` array (BLAS is told
the transposition: no copy, so a memory-mapped weight stays one array, read from the file when first
used, and a tied embedding read by a gather and the LM head is one array); products of one input by
several constant weights (q/k/v, gate/up) become one product by the weights side by side (one new
``[in, out]`` array; the pages of memory-mapped originals are then released, see
:func:`nnef_kv.tensors.pages.release_pages`).

Measured (``python benchmarks/scale.py --rows products``, BLAS on one thread, best of N, 2-core VM at load
average ~11): view / copy 1.02 (1 x 576 x 1536), 1.01 (1 x 1536 x 576), 1.17 (1 x 576 x 49152; 0.84-0.90
in other runs), 1.42 (8 rows), 1.25 (64 rows), 1.00 and 1.01 (512 rows): a decode step has one row and a
prefill hundreds; a few-row product is the slower case."""
from __future__ import annotations

import weakref
from typing import Any, Callable

import numpy as np

from ...tensors.pages import release_pages
from ..graph import Node
from .parallel import split_matmul
from .steps import Step, has_lazy as _has_lazy, replace_steps

__all__ = ["rewrite_weights", "fuse_projections"]


def _matmul_pretransposed(a: np.ndarray, bt: np.ndarray) -> np.ndarray:
    """``a @ bt`` with the leading axes of ``a`` folded into rows: one 2-D BLAS call (split in two column
    halves across two threads when the session runs with ``threads = 2``, see :mod:`.parallel`)."""
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
    return wt if wt.ndim == 2 and wt.flags.f_contiguous else np.ascontiguousarray(wt)


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


#: fused weights by what they were made of: (id of each part's root array, where in it, shape, strides,
#: dtype) -> (weak references to those roots, a weak reference to the fused array)
_FUSED: dict[tuple, tuple[tuple[weakref.ref, ...], weakref.ref]] = {}


def _fused(members: list[tuple[int, int, np.ndarray, int, int]]) -> np.ndarray:
    """The weights of ``members`` side by side (``[in, sum of outs]``, contiguous). Parts that are views of
    read-only arrays (a loaded archive's) give the array made for the same parts by another plan while
    that one is alive: the sessions of an archive and of its reference hold one fused array, not one
    each (``validate`` gives both the same arrays), and so do compare's worker processes, forked from the
    process that planned the reference (:mod:`nnef_kv.validate.jobs`)."""
    parts = [m[2] for m in members]
    roots = [_root(p) for p in parts]
    key = None
    if all(not r.flags.writeable for r in roots):
        key = tuple((id(r), p.__array_interface__["data"][0] - r.__array_interface__["data"][0], p.shape,
                     p.strides, p.dtype.str) for p, r in zip(parts, roots))
        got = _FUSED.get(key)
        if got is not None and all(ref() is r for ref, r in zip(got[0], roots)):
            wt = got[1]()
            if wt is not None:
                return wt
    wt = np.ascontiguousarray(np.concatenate(parts, axis=1))
    for p in parts:  # a memory-mapped original is read again from its file if anything else uses it
        release_pages(p)
    if key is not None:
        for k in [k for k, (refs, w) in _FUSED.items() if w() is None or any(x() is None for x in refs)]:
            del _FUSED[k]
        wt.flags.writeable = False
        _FUSED[key] = (tuple(weakref.ref(r) for r in roots), weakref.ref(wt))
    return wt


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
        wt = _fused(members)
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

        replace[members[0][0]] = (step, node)
        drop.update(m[0] for m in members[1:])
        for m in members:  # the separate transposed weights are not used any more
            base[m[4]] = None
    if not replace:
        return steps, step_nodes, 0
    return replace_steps(steps, step_nodes, replace, drop)
