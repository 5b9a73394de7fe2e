"""Exact f32 attention of a few query rows over f32 keys and values (a decode step), numba, beside a NumPy
reference.

A decode step of an export with explicit caches (torch-to-nnef's form) runs its attention as a chain of
NumPy calls for one query row (the plan's fused form, :mod:`nnef_kv.interpreter.plan.attention`): about a
dozen calls a layer, 40-80 us, which on SmolLM2-135M is 2.4 ms of a 27 ms token, more than any other step
but the weight products. :func:`attend_rows` does the same arithmetic in one call.

``attend_rows(q, k, v, mask, g, scale, out)``: ``q [B, Hq, M, D]``, ``k [B, Hkv, T, D]``, ``v [B, Hkv, T, Dv]``
(query head ``h`` reads kv head ``h // g``, ``Hq = Hkv * g``), ``mask`` None or an f32 array broadcasting to
``[B, Hq, M, T]`` (added to the scores), ``scale`` None or an f32 scalar (multiplying the scores first),
the result written into ``out [B, Hq, M, Dv]`` (f32, C-contiguous).
Per query row: ``s = (q . k_t) * scale + mask_t``, ``p = exp(s - max s) / sum``, ``out = sum_t p_t v_t``,
all in f32, as the reference's NumPy calls do. The numba side sums the dot products and the softmax's
denominator in lanes (``reassoc``, no FMA, NaN and Inf kept) and uses
:func:`~nnef_kv.kernels._numba_common.exp_nonpositive` (within 1 ulp): the same results up to the
rounding of those sums, within :func:`error_bound` of the exact value as the reference is
(tests/properties/test_decode_kernels.py; every call of the plan's decodes of the fixtures' exports
checked in tests/unit/test_patterns.py). A row whose scores hold a NaN, or whose max is infinite, gives NaN
or what NumPy gives (the same ``s - max`` and ``exp``).

Only for a few rows (:data:`MAX_ROWS`): a prefill's rows are products BLAS blocks better. For a prefill's
blocks of query rows, :func:`softmax_rows` ``(s, mask, scale, out)`` turns the scores BLAS computed into
probabilities in place: ``s * scale + mask``, the row's max, ``exp(s - max)``, the division by the sum, in two
passes over a row instead of the seven NumPy calls (whose reductions and temporaries cost as much as the two
products on SmolLM2-135M's 512-token prefill). The scale's product, the mask's sum, the shift and the
division round as NumPy's do; the exp (1 ulp) and the sum (in lanes) do not: within :func:`softmax_bound` of
the float64 softmax of the same shifted scores (tests/properties/test_decode_kernels.py).
The compiled core without the wrapper's checks (:meth:`.Kernel.hot`, for the plan's decode step, which
checked the shapes itself): ``core(q, k, v, mask or NO_MASK, g, scale as f32, scaled, out)``, ``k`` and ``v``
:func:`readable` (the wrapper copies others).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from . import kernel

__all__ = ["attend_rows", "readable", "MAX_ROWS", "MAX_KEYS", "NO_MASK", "error_bound", "exact", "softmax_rows",
           "mask_readable", "softmax_bound"]

#: query rows a call takes at most (a decode step is one; a few for speculative or stepwise calls)
MAX_ROWS = 4
#: keys the plan's decode step gives the kernel at most: from about 2048 keys on, NumPy's calls (BLAS's
#: products) are as fast or faster (``python benchmarks/kernels.py --only decode``: 1.07x at 1024 keys, 0.96x
#: at 2048, 0.89x at 4096; docs/benchmarks.md)
MAX_KEYS = 1024

_F32 = np.dtype(np.float32)
#: the mask argument of the compiled core when there is none
NO_MASK = np.zeros((0, 0, 0, 0), np.float32)


def readable(x: np.ndarray) -> bool:
    """The compiled core reads ``x`` (a K or V cache) in place: its last axis of stride 1, no stride negative or
    other than a multiple of the item size (else the wrapper copies it)."""
    st, size = x.strides, x.itemsize
    return st[-1] == size and min(st) >= 0 and not any(s % size for s in st)


def _checked(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: Any, g: int, scale: Any,
             out: np.ndarray) -> np.ndarray | None:
    """``mask`` broadcast to ``[B, Hq, M, T]`` (None when absent); ValueError on shapes or dtypes the
    operation does not take."""
    if not all(isinstance(x, np.ndarray) and x.dtype == _F32 and x.ndim == 4 for x in (q, k, v)):
        raise ValueError("attend_rows: q, k, v must be 4-D float32 arrays")
    if not (isinstance(out, np.ndarray) and out.dtype == _F32 and out.flags.c_contiguous
            and out.shape == q.shape[:3] + v.shape[3:]):
        raise ValueError(f"attend_rows: out must be a C-contiguous float32 array of shape {q.shape[:3] + v.shape[3:]}")
    b, hq, m, d = q.shape
    b2, hkv, t, d2 = k.shape
    if g < 1 or hkv * g != hq or (b2, d2) != (b, d) or v.shape[:3] != (b, hkv, t) or t == 0:
        raise ValueError(f"attend_rows: shapes q {q.shape}, k {k.shape}, v {v.shape} with {g} query heads a kv head")
    if scale is not None and not (isinstance(scale, (np.ndarray, np.float32)) and np.asarray(scale).size == 1
                                  and np.asarray(scale).dtype == _F32):
        raise ValueError("attend_rows: scale must be one float32 value")
    if mask is None:
        return None
    if not (isinstance(mask, np.ndarray) and mask.dtype == _F32 and mask.ndim == 4):
        raise ValueError("attend_rows: mask must be a 4-D float32 array")
    if any(x not in (1, y) for x, y in zip(mask.shape, (b, hq, m, t))):
        raise ValueError(f"attend_rows: mask {mask.shape} does not broadcast to {(b, hq, m, t)}")
    return np.broadcast_to(mask, (b, hq, m, t))


@kernel("nnef_kv.kernels._attend_jit:attend_rows", core="core")
def attend_rows(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None, g: int,
                scale: Any, out: np.ndarray) -> None:
    """``out = softmax(q k^T * scale + mask) v`` per query row, kv head ``h // g`` for query head ``h`` (see
    the module docstring)."""
    mv = _checked(q, k, v, mask, g, scale, out)
    b, hq, m, d = q.shape
    hkv, t = k.shape[1], k.shape[2]
    s = np.matmul(q.reshape(b, hkv, g, m, d), np.swapaxes(k, -1, -2)[:, :, None]).reshape(b, hq, m, t)
    _numpy_softmax(s, mv, scale)
    out[...] = np.matmul(s.reshape(b, hkv, g, m, t), v[:, :, None]).reshape(out.shape)


def _numpy_softmax(s: np.ndarray, mask: np.ndarray | None, scale: Any) -> None:
    """``s`` (4-D float32) becomes ``softmax(s * scale + mask)`` over its last axis, in place, by NumPy's calls:
    the references of :func:`attend_rows` and :func:`softmax_rows`."""
    if scale is not None:
        np.multiply(s, np.float32(np.asarray(scale).reshape(())), out=s)
    if mask is not None:
        np.add(s, mask, out=s)
    with np.errstate(invalid="ignore", over="ignore"):
        np.subtract(s, np.max(s, axis=3, keepdims=True), out=s)
        np.exp(s, out=s)
        np.divide(s, np.sum(s, axis=3, keepdims=True), out=s)


def _exact(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None, g: int,
           scale: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """float64, of the same inputs: the output, the softmax, the scores, ``sum_i |q_i k_i|`` and ``sum_t p_t
    |v_t|``."""
    b, hq, m, _ = q.shape
    t = k.shape[2]
    q64 = q.astype(np.float64)
    kk = np.repeat(k.astype(np.float64), g, axis=1)
    vv = np.repeat(v.astype(np.float64), g, axis=1)
    absdots = np.matmul(np.abs(q64), np.swapaxes(np.abs(kk), -1, -2))
    s = np.matmul(q64, np.swapaxes(kk, -1, -2))
    with np.errstate(invalid="ignore", over="ignore"):
        if scale is not None:
            s = s * float(np.asarray(scale).reshape(()))
        if mask is not None:
            s = s + np.broadcast_to(mask, (b, hq, m, t)).astype(np.float64)
        p = np.exp(s - np.max(s, axis=3, keepdims=True))
        p = p / np.sum(p, axis=3, keepdims=True)
        return np.matmul(p, vv), p, s, absdots, np.matmul(p, np.abs(vv))


def exact(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None, g: int, scale: Any) -> np.ndarray:
    """:func:`attend_rows` of the same inputs computed in float64 (what :func:`error_bound` bounds the distance
    to)."""
    return _exact(q, k, v, mask, g, scale)[0]


def error_bound(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None, g: int,
                scale: Any) -> np.ndarray:
    """A bound on ``|out - exact(...)|`` for every output of :func:`attend_rows` (either side), where the exact
    value is finite. Each score is off by at most ``e_s = (D + 2) u sum_i |q_i k_i| |scale| + 2 u |s|`` (the
    dot product's ``gamma_D``, the scale's and the mask's roundings; ``u = 2**-24``), so each ``p_t`` by a
    relative ``2 max e_s + (T + 8) u`` (the shift, a 1-ulp exp, the sum's ``gamma_T``, the division), and the
    output by that times ``sum_t p_t |v_t|``, plus the weighted sum's own ``(T + 1) u sum_t p_t |v_t|``; 1%
    and the smallest normal f32 on top for the second-order terms."""
    u = 2.0 ** -24
    d, t = q.shape[3], k.shape[2]
    _, _, s, absdots, mag = _exact(q, k, v, mask, g, scale)
    sc = 1.0 if scale is None else abs(float(np.asarray(scale).reshape(())))
    with np.errstate(invalid="ignore", over="ignore"):
        e_s = np.where(np.isfinite(s), (d + 2) * u * absdots * sc + 2 * u * np.abs(s), 0.0)
    rel = 2 * np.max(e_s, axis=3, keepdims=True) + (t + 8) * u
    return (rel + (t + 1) * u) * mag * 1.01 + np.finfo(np.float32).tiny


def mask_readable(mask: np.ndarray) -> bool:
    """:func:`softmax_rows`'s compiled core reads ``mask`` (4-D float32) in place: no negative stride, every stride a
    whole number of elements, the last one element unless that axis has one entry."""
    st, size = mask.strides, mask.itemsize
    return mask.ndim == 4 and (st[3] == size or mask.shape[3] == 1) and min(st) >= 0 and not any(x % size for x in st)


@kernel("nnef_kv.kernels._attend_jit:softmax_rows", core="softmax_core")
def softmax_rows(s: np.ndarray, mask: np.ndarray | None, scale: Any, out: None = None) -> None:
    """``s [B, H, M, T]`` (float32, C-contiguous) becomes ``softmax(s * scale + mask)`` over its last axis, in
    place (``scale`` None or one float32, ``mask`` None or float32 broadcasting to ``s``); ``out`` is unused (the
    kernels' common signature). The compiled core: ``softmax_core(s, mask or NO_MASK, scale as f32, scaled)``,
    the mask :func:`mask_readable`."""
    _check_softmax(s, mask, scale)
    _numpy_softmax(s, mask, scale)


def _check_softmax(s: np.ndarray, mask: Any, scale: Any) -> None:
    if not (isinstance(s, np.ndarray) and s.dtype == _F32 and s.ndim == 4 and s.flags.c_contiguous and s.size):
        raise ValueError("softmax_rows: s must be a non-empty C-contiguous 4-D float32 array")
    if scale is not None and not (isinstance(scale, (np.ndarray, np.float32)) and np.asarray(scale).size == 1
                                  and np.asarray(scale).dtype == _F32):
        raise ValueError("softmax_rows: scale must be one float32 value")
    if mask is not None and not (isinstance(mask, np.ndarray) and mask.dtype == _F32 and mask.ndim == 4
                                 and all(x in (1, y) for x, y in zip(mask.shape, s.shape))):
        raise ValueError(f"softmax_rows: mask must be a 4-D float32 array broadcasting to {s.shape}")


def softmax_bound(shifted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The float64 softmax of float32 scores already shifted by their row max (what both sides of
    :func:`softmax_rows` exponentiate: the same f32 roundings up to there), and a bound on either side's
    distance to it where it is finite: ``(T + 4) u`` relative (a 1-ulp exp, the sum's ``gamma_T``, the
    division; ``u = 2**-24``) plus ``2**-125`` (the numba exp is 0 below -87, where the true value is under
    1.7e-38, and a probability in the subnormal range rounds coarsely)."""
    t = shifted.shape[-1]
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.exp(shifted.astype(np.float64))
        p = e / np.sum(e, axis=-1, keepdims=True)
    return p, (t + 4) * 2.0 ** -24 * np.abs(p) + 2.0 ** -125
