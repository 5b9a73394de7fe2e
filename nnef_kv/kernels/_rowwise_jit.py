"""numba side of :mod:`nnef_kv.kernels.rowwise` (imported on first use; see that module)."""
from __future__ import annotations

import numpy as np
from numba import njit

from ._numba_common import JIT

__all__ = ["rms_rows", "rope_half", "rms_core", "rope_core"]

_BLOCK = 128  # the block NumPy's pairwise sum adds with eight accumulators


@njit(**JIT)
def _block(a, lo, n):
    """``a[lo:lo + n]``, ``n <= 128``, summed as NumPy sums a block: fewer than 8 in order from 0, else eight
    interleaved accumulators, added as ``((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))``, then the rest."""
    if n < 8:
        res = np.float32(0)
        for i in range(lo, lo + n):
            res += a[i]
        return res
    r0, r1, r2, r3 = a[lo], a[lo + 1], a[lo + 2], a[lo + 3]
    r4, r5, r6, r7 = a[lo + 4], a[lo + 5], a[lo + 6], a[lo + 7]
    end8 = lo + n - n % 8
    i = lo + 8
    while i < end8:
        r0 += a[i]
        r1 += a[i + 1]
        r2 += a[i + 2]
        r3 += a[i + 3]
        r4 += a[i + 4]
        r5 += a[i + 5]
        r6 += a[i + 6]
        r7 += a[i + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < lo + n:
        res += a[i]
        i += 1
    return res


@njit(**JIT)
def _pairwise(a, n):
    """``a[:n]`` summed in NumPy's pairwise order: a block of at most 128 as :func:`_block`, a longer run as
    its first half (``n // 2`` rounded down to a multiple of 8) plus the rest, each summed the same way. The
    tree is walked with an explicit stack (numba's on-disk cache does not keep recursive functions safely)."""
    if n <= _BLOCK:
        return _block(a, 0, n)
    los = np.empty(64, np.int64)
    ns = np.empty(64, np.int64)
    state = np.empty(64, np.int8)
    vals = np.empty(64, np.float32)
    top, nv = 0, 0
    los[0], ns[0], state[0] = 0, n, 0
    while top >= 0:
        lo, m = los[top], ns[top]
        if m <= _BLOCK:
            vals[nv] = _block(a, lo, m)
            nv += 1
            top -= 1
            continue
        half = m // 2
        half -= half % 8
        if state[top] == 0:  # the first half next
            state[top] = 1
            top += 1
            los[top], ns[top], state[top] = lo, half, 0
        elif state[top] == 1:  # then the rest
            state[top] = 2
            top += 1
            los[top], ns[top], state[top] = lo + half, m - half, 0
        else:  # both summed: their sum is this run's
            nv -= 1
            vals[nv - 1] = vals[nv - 1] + vals[nv]
            top -= 1
    return vals[0]


@njit(**JIT)
def rms_core(x, eps, weight, out):
    rows, n = x.shape
    sq = np.empty(n, np.float32)
    weighted = weight.size > 0
    for r in range(rows):
        xr = x[r]
        for i in range(n):
            sq[i] = xr[i] * xr[i]
        ss = np.float32(0) + _pairwise(sq, n)
        mean = np.float32(np.float64(ss) / np.float64(n))
        inv = np.float32(1) / np.sqrt(mean + eps)
        orow = out[r]
        for i in range(n):
            y = xr[i] * inv
            orow[i] = y * weight[i] if weighted else y


@njit(**JIT)
def rope_core(x, cos, sin, out):
    b_n, h_n, s_n, d = x.shape
    half = d // 2
    cb, ch, cs, cd = cos.shape
    sb, sh, ss, sd = sin.shape
    for b in range(b_n):
        for h in range(h_n):
            for s in range(s_n):
                xr = x[b, h, s]
                cr = cos[b if cb > 1 else 0, h if ch > 1 else 0, s if cs > 1 else 0]
                sr = sin[b if sb > 1 else 0, h if sh > 1 else 0, s if ss > 1 else 0]
                orow = out[b, h, s]
                for j in range(d):
                    c = xr[j] * cr[j if cd > 1 else 0]
                    rot = -xr[j + half] if j < half else xr[j - half]
                    orow[j] = c + rot * sr[j if sd > 1 else 0]


def rms_rows(x, eps, weight, out):
    """See :func:`nnef_kv.kernels.rowwise.rms_rows`."""
    from .rowwise import NO_WEIGHT, _check_rows

    _check_rows(x, eps, weight, out)
    rms_core(x, eps, NO_WEIGHT if weight is None else weight, out)


def rope_half(x, cos, sin, out):
    """See :func:`nnef_kv.kernels.rowwise.rope_half`."""
    from .rowwise import _check_rope

    _check_rope(x, cos, sin, out)
    rope_core(x, cos, sin, out)
