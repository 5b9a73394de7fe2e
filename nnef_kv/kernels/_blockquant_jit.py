"""numba side of :mod:`nnef_kv.kernels.blockquant` (imported on first use; see that module)."""
from __future__ import annotations

import numpy as np
from numba import njit

from ._numba_common import JIT, h2f, wide_vectors
from . import blockquant as _bq
from .blockquant import PackedWeights, _check_x
from .blockquant import matmul as _matmul_kernel

__all__ = ["matmul", "matvec"]

_F8 = np.float32(8.0)


@njit(**JIT)
def _tile(n: int, m: int) -> int:
    """Output tile: ``acc`` and ``tmp`` (``2 * m * tile`` floats, 16 KiB each at most; measured: 2048
    outputs for one row is ~20% faster than 512)."""
    t = max(64, min(2048, 8192 // max(1, m))) // 16 * 16
    return min(t, n)


@njit(**JIT)
def _q4_rows(codes, sbits, x, y):
    """y[m, :] = x[m, :] @ W.T for Q4_0 codes [K/2, N] (uint8), f16 scale bits [K/32, N] (uint16)."""
    wide_vectors()
    k2, n = codes.shape
    m_rows = x.shape[0]
    nb = k2 // 16
    tw = _tile(n, m_rows)
    acc = np.empty((m_rows, tw), np.float32)
    tmp = np.empty((m_rows, tw), np.float32)
    sc = np.empty(tw, np.float32)
    lo = np.empty(tw, np.float32)
    hi = np.empty(tw, np.float32)
    for n0 in range(0, n, tw):
        n1 = min(n, n0 + tw)
        w = n1 - n0
        acc[:, :w] = 0.0
        for b in range(nb):
            tmp[:, :w] = 0.0
            if m_rows == 1:  # four byte rows (eight inputs) a pass
                t0 = tmp[0]
                for r in range(b * 16, b * 16 + 16, 4):
                    s0 = codes[r, n0:n1]
                    s1 = codes[r + 1, n0:n1]
                    s2 = codes[r + 2, n0:n1]
                    s3 = codes[r + 3, n0:n1]
                    xa = x[0, 2 * r]
                    xb = x[0, 2 * r + 1]
                    xc = x[0, 2 * r + 2]
                    xd = x[0, 2 * r + 3]
                    xe = x[0, 2 * r + 4]
                    xf = x[0, 2 * r + 5]
                    xg = x[0, 2 * r + 6]
                    xh = x[0, 2 * r + 7]
                    for j in range(w):
                        c = np.uint32(s0[j])
                        e = np.uint32(s1[j])
                        f = np.uint32(s2[j])
                        g = np.uint32(s3[j])
                        t0[j] += (((xa * (np.float32(np.int32(c & np.uint32(15))) - _F8)
                                    + xb * (np.float32(np.int32(c >> np.uint32(4))) - _F8))
                                   + (xc * (np.float32(np.int32(e & np.uint32(15))) - _F8)
                                      + xd * (np.float32(np.int32(e >> np.uint32(4))) - _F8)))
                                  + ((xe * (np.float32(np.int32(f & np.uint32(15))) - _F8)
                                      + xf * (np.float32(np.int32(f >> np.uint32(4))) - _F8))
                                     + (xg * (np.float32(np.int32(g & np.uint32(15))) - _F8)
                                        + xh * (np.float32(np.int32(g >> np.uint32(4))) - _F8))))
            else:
                for r in range(b * 16, b * 16 + 16):
                    s0 = codes[r, n0:n1]
                    for j in range(w):  # decode once, use for every row
                        c = np.uint32(s0[j])
                        lo[j] = np.float32(np.int32(c & np.uint32(15))) - _F8
                        hi[j] = np.float32(np.int32(c >> np.uint32(4))) - _F8
                    for m in range(m_rows):
                        xa = x[m, 2 * r]
                        xb = x[m, 2 * r + 1]
                        tm = tmp[m]
                        for j in range(w):
                            tm[j] += xa * lo[j] + xb * hi[j]
            s = sbits[b, n0:n1]
            for j in range(w):
                sc[j] = h2f(s[j])
            for m in range(m_rows):
                am = acc[m]
                tm = tmp[m]
                for j in range(w):
                    am[j] += sc[j] * tm[j]
        y[:, n0:n1] = acc[:, :w]


@njit(**JIT)
def _q8_rows(codes, sbits, x, y):
    """y[m, :] = x[m, :] @ W.T for Q8_1 codes [K, N] (int8), f16 scale bits [K/32, N] (uint16)."""
    wide_vectors()
    k, n = codes.shape
    m_rows = x.shape[0]
    nb = k // 32
    tw = _tile(n, m_rows)
    acc = np.empty((m_rows, tw), np.float32)
    tmp = np.empty((m_rows, tw), np.float32)
    sc = np.empty(tw, np.float32)
    cf = np.empty(tw, np.float32)
    for n0 in range(0, n, tw):
        n1 = min(n, n0 + tw)
        w = n1 - n0
        acc[:, :w] = 0.0
        for b in range(nb):
            tmp[:, :w] = 0.0
            if m_rows == 1:  # four rows (inputs) a pass
                t0 = tmp[0]
                for r in range(b * 32, b * 32 + 32, 4):
                    s0 = codes[r, n0:n1]
                    s1 = codes[r + 1, n0:n1]
                    s2 = codes[r + 2, n0:n1]
                    s3 = codes[r + 3, n0:n1]
                    xa = x[0, r]
                    xb = x[0, r + 1]
                    xc = x[0, r + 2]
                    xd = x[0, r + 3]
                    for j in range(w):
                        t0[j] += ((xa * np.float32(np.int32(s0[j])) + xb * np.float32(np.int32(s1[j])))
                                  + (xc * np.float32(np.int32(s2[j])) + xd * np.float32(np.int32(s3[j]))))
            else:
                for r in range(b * 32, b * 32 + 32):
                    s0 = codes[r, n0:n1]
                    for j in range(w):
                        cf[j] = np.float32(np.int32(s0[j]))
                    for m in range(m_rows):
                        xa = x[m, r]
                        tm = tmp[m]
                        for j in range(w):
                            tm[j] += xa * cf[j]
            s = sbits[b, n0:n1]
            for j in range(w):
                sc[j] = h2f(s[j])
            for m in range(m_rows):
                am = acc[m]
                tm = tmp[m]
                for j in range(w):
                    am[j] += sc[j] * tm[j]
        y[:, n0:n1] = acc[:, :w]


@njit(**JIT)
def _q4_dequant_block(codes, sbits, k0, k1, n0, n1, out):
    """out[k - k0, j] = W[n0 + j, k] as f32 for k in [k0, k1) (multiples of 32), Q4_0."""
    wide_vectors()
    w = n1 - n0
    sc = np.empty(w, np.float32)
    for b in range(k0 // 32, k1 // 32):
        s = sbits[b, n0:n1]
        for j in range(w):
            sc[j] = h2f(s[j])
        for r in range(b * 16, b * 16 + 16):
            src = codes[r, n0:n1]
            o0 = out[2 * r - k0]
            o1 = out[2 * r + 1 - k0]
            for j in range(w):
                c = np.uint32(src[j])
                o0[j] = (np.float32(np.int32(c & np.uint32(15))) - _F8) * sc[j]
                o1[j] = (np.float32(np.int32(c >> np.uint32(4))) - _F8) * sc[j]


@njit(**JIT)
def _q8_dequant_block(codes, sbits, k0, k1, n0, n1, out):
    """out[k - k0, j] = W[n0 + j, k] as f32 for k in [k0, k1) (multiples of 32), Q8_1."""
    wide_vectors()
    w = n1 - n0
    sc = np.empty(w, np.float32)
    for b in range(k0 // 32, k1 // 32):
        s = sbits[b, n0:n1]
        for j in range(w):
            sc[j] = h2f(s[j])
        for r in range(b * 32, b * 32 + 32):
            src = codes[r, n0:n1]
            o = out[r - k0]
            for j in range(w):
                o[j] = np.float32(np.int32(src[j])) * sc[j]


#: blocks of W.T dequantized for BLAS: TILE_K inputs x TILE_N outputs (512 KiB of f32, in L2)
TILE_K, TILE_N = 256, 512


def _blas_tiles(p: PackedWeights, x: np.ndarray, y: np.ndarray) -> None:
    """Many rows: dequantize [TILE_K, TILE_N] blocks of W.T (numba) and multiply each with BLAS,
    summing the K blocks of an output tile (the dequantized values are exactly the reference's)."""
    k, n = p.k, p.n
    deq = _q4_dequant_block if p.format == "Q4_0" else _q8_dequant_block
    sbits = p.scales.view(np.uint16)
    m = x.shape[0]
    for n0 in range(0, n, TILE_N):
        n1 = min(n, n0 + TILE_N)
        w = n1 - n0
        buf = np.empty((TILE_K, w), np.float32)
        part = np.empty((m, w), np.float32)
        acc = None
        for k0 in range(0, k, TILE_K):
            k1 = min(k, k0 + TILE_K)
            blk = buf if k1 - k0 == TILE_K else np.empty((k1 - k0, w), np.float32)
            deq(p.codes, sbits, k0, k1, n0, n1, blk)
            if acc is None:
                acc = np.matmul(x[:, k0:k1], blk)
            else:
                np.matmul(x[:, k0:k1], blk, out=part)
                acc += part
        y[:, n0:n1] = acc


def matmul(p: PackedWeights, x: np.ndarray) -> np.ndarray:
    """numba side of :func:`nnef_kv.kernels.blockquant.matmul` (same signature and results up to f32
    summation order)."""
    x = _check_x(p, x)
    if not p.finite_scales:
        return _matmul_kernel.reference(p, x)
    lead = x.shape[:-1]
    x2 = np.ascontiguousarray(x.reshape(-1, p.k))
    m = x2.shape[0]
    y = np.empty((m, p.n), np.float32)
    if m == 0:
        return y.reshape(lead + (p.n,))
    if m > _bq.BLAS_ROWS[p.format]:
        _blas_tiles(p, x2, y)
    elif p.format == "Q4_0":
        _q4_rows(p.codes, p.scales.view(np.uint16), x2, y)
    else:
        _q8_rows(p.codes, p.scales.view(np.uint16), x2, y)
    return y.reshape(lead + (p.n,))


def matvec(p: PackedWeights, x: np.ndarray) -> np.ndarray:
    """numba side of :func:`nnef_kv.kernels.blockquant.matvec`."""
    x = _check_x(p, x)
    if x.ndim != 1:
        raise ValueError(f"matvec needs a vector, got shape {x.shape}")
    return matmul(p, x)
