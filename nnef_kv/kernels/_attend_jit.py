"""numba side of :mod:`nnef_kv.kernels.attend` (imported on first use; see that module)."""
from __future__ import annotations

import numpy as np
from numba import carray, njit

from ._numba_common import JIT_REASSOC, exp_nonpositive, void_pointer, wide_vectors

__all__ = ["attend_rows", "core", "softmax_rows", "softmax_core"]


@njit(**JIT_REASSOC)
def _dot(a, b, n):
    acc = np.float32(0)
    for i in range(n):
        acc += a[i] * b[i]
    return acc


@njit(**JIT_REASSOC)
def _sum(a, n):
    acc = np.float32(0)
    for i in range(n):
        acc += a[i]
    return acc


@njit(**JIT_REASSOC)
def _span(a):
    """The elements a 4-D array spans, from its first, as one C-contiguous array, and its strides in elements
    (broadcast axes of one entry, non-negative strides of whole elements: :func:`~nnef_kv.kernels.attend.readable`
    for a cache, :func:`~nnef_kv.kernels.attend.mask_readable` for a mask): a cache's rows in a larger buffer
    indexed so that the loops over a row vectorise (numba does not vectorise a strided array's loops)."""
    size = a.itemsize
    st = (a.strides[0] // size, a.strides[1] // size, a.strides[2] // size, a.strides[3] // size)
    n = 1
    for i in range(4):
        n += (a.shape[i] - 1) * st[i]
    if a.size == 0:
        n = 0
    return carray(void_pointer(a.ctypes.data), (n,), np.float32), st


@njit(**JIT_REASSOC)
def core(q, k, v, mask, g, scale, scaled, out):
    """``out [B, Hq, M, Dv]`` for ``q [B, Hq, M, D]``, ``k [B, Hkv, T, D]``, ``v [B, Hkv, T, Dv]`` (``k`` and ``v``
    :func:`~nnef_kv.kernels.attend.readable`), ``mask`` of rank 4 broadcasting to ``[B, Hq, M, T]``
    (a size-0 array: none), ``scale`` applied when ``scaled``. The ``g * M`` query rows of a kv head are
    done together: each key and value row is read once for all of them."""
    wide_vectors()
    b_n, hq, m_n, d = q.shape
    t_n = k.shape[2]
    dv = v.shape[3]
    kf, ks = _span(k)
    vf, vs = _span(v)
    masked = mask.size > 0
    mb, mh, mm, mt = mask.shape
    rows = g * m_n
    s = np.empty((rows, t_n), np.float32)
    qr = np.empty((rows, d), np.float32)
    acc = np.empty((rows, dv), np.float32)
    for b in range(b_n):
        for kh in range(hq // g):
            ko = b * ks[0] + kh * ks[1]
            vo = b * vs[0] + kh * vs[1]
            for r in range(rows):
                qr[r] = q[b, kh * g + r // m_n, r % m_n]
            for t in range(t_n):
                kt = kf[ko + t * ks[2]:ko + t * ks[2] + d]
                for r in range(rows):
                    s[r, t] = _dot(qr[r], kt, d)
            for r in range(rows):
                h, m = kh * g + r // m_n, r % m_n
                sr = s[r]
                top = np.float32(-np.inf)
                nan = False
                for t in range(t_n):
                    x = sr[t]
                    if scaled:
                        x = x * scale
                    if masked:
                        x = x + mask[b if mb > 1 else 0, h if mh > 1 else 0, m if mm > 1 else 0, t if mt > 1 else 0]
                    sr[t] = x
                    nan |= x != x
                    top = x if x > top else top
                if nan:
                    top = np.float32(np.nan)
                for t in range(t_n):  # <= 0, or NaN (a NaN score, Inf - Inf): NaN as NumPy's exp gives
                    sr[t] = exp_nonpositive(sr[t] - top)
                den = _sum(sr, t_n)
                for t in range(t_n):
                    sr[t] = sr[t] / den
            acc[:] = 0
            for t in range(t_n):
                vt = vf[vo + t * vs[2]:vo + t * vs[2] + dv]
                for r in range(rows):
                    p = s[r, t]
                    ar = acc[r]
                    for j in range(dv):
                        ar[j] += p * vt[j]
            for r in range(rows):
                out[b, kh * g + r // m_n, r % m_n] = acc[r]


def attend_rows(q, k, v, mask, g, scale, out):
    """See :func:`nnef_kv.kernels.attend.attend_rows`."""
    from .attend import NO_MASK, _checked, readable

    _checked(q, k, v, mask, g, scale, out)
    k, v = (x if readable(x) else np.ascontiguousarray(x) for x in (k, v))
    sc = np.float32(1) if scale is None else np.float32(np.asarray(scale).reshape(()))
    core(q, k, v, NO_MASK if mask is None else mask, g, sc, scale is not None, out)


@njit(**JIT_REASSOC)
def softmax_core(s, mask, scale, scaled):
    """``s [B, H, M, T]`` C-contiguous -> ``softmax(s * scale + mask)`` in place, per row: the scale and the mask
    in the first pass with the row's max (sixteen running maxima, so that the loop vectorises; a NaN anywhere
    makes the whole row NaN through the sum, as NumPy's max would), then exp, sum and division."""
    wide_vectors()
    b_n, h_n, m_n, t_n = s.shape
    masked = mask.size > 0
    mf, ms = _span(mask)
    mb, mh, mm, mt = mask.shape
    part = np.empty(16, np.float32)
    t16 = t_n // 16 * 16
    for b in range(b_n):
        for h in range(h_n):
            for m in range(m_n):
                sr = s[b, h, m]
                if scaled:
                    for t in range(t_n):
                        sr[t] = sr[t] * scale
                if masked:
                    mo = (b if mb > 1 else 0) * ms[0] + (h if mh > 1 else 0) * ms[1] + (m if mm > 1 else 0) * ms[2]
                    if mt > 1:
                        mr = mf[mo:mo + t_n]
                        for t in range(t_n):
                            sr[t] = sr[t] + mr[t]
                    else:
                        x = mf[mo]
                        for t in range(t_n):
                            sr[t] = sr[t] + x
                part[:] = -np.inf
                for t0 in range(0, t16, 16):
                    for j in range(16):
                        x = sr[t0 + j]
                        part[j] = x if x > part[j] else part[j]
                top = np.float32(-np.inf)
                for j in range(16):
                    top = part[j] if part[j] > top else top
                for t in range(t16, t_n):
                    top = sr[t] if sr[t] > top else top
                den = np.float32(0)
                for t in range(t_n):  # <= 0, or NaN (a NaN score, Inf - Inf): NaN as NumPy's exp gives
                    e = exp_nonpositive(sr[t] - top)
                    sr[t] = e
                    den += e
                for t in range(t_n):
                    sr[t] = sr[t] / den


def softmax_rows(s, mask, scale, out=None):
    """See :func:`nnef_kv.kernels.attend.softmax_rows`."""
    from .attend import NO_MASK, _check_softmax, mask_readable

    _check_softmax(s, mask, scale)
    if mask is not None and not mask_readable(mask):
        mask = np.ascontiguousarray(mask)
    sc = np.float32(1) if scale is None else np.float32(np.asarray(scale).reshape(()))
    softmax_core(s, NO_MASK if mask is None else mask, sc, scale is not None)
