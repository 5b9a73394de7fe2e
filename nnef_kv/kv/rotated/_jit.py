"""numba side of :mod:`nnef_kv.kv.rotated.kernels` (imported on first use; see that module)."""
from __future__ import annotations

import numpy as np
from numba import njit

from ...kernels._numba_common import JIT

__all__ = ["code_scores", "code_values"]


@njit(**JIT)
def _byte_tables(qrow, cb, bits, d, m, tab):  # tab [m, 256]: what byte value b at byte j adds to the score
    per = 8 // bits
    mask = (1 << bits) - 1
    for j in range(m):
        for b in range(256):
            acc = np.float32(0.0)
            for k in range(per):
                c = j + k * m
                if c < d:
                    acc += qrow[c] * cb[(b >> (k * bits)) & mask]
            tab[j, b] = acc


@njit(**JIT)
def _scores_planar(qr, codes, norms, cb, bits, d, out):
    n, mrows, _ = qr.shape
    t_len, m = codes.shape[1], codes.shape[2]
    tr = np.empty((m, 256), np.float32)  # one row's table at a time: it stays in L1 (m * 1 KiB)
    for h in range(n):
        ch = codes[h]
        for r in range(mrows):
            _byte_tables(qr[h, r], cb, bits, d, m, tr)
            o = out[h, r]
            m4 = m - m % 4
            for t in range(t_len):
                row = ch[t]
                a0 = a1 = a2 = a3 = np.float32(0.0)  # four chains of additions, not one
                for j in range(0, m4, 4):
                    a0 += tr[j, row[j]]
                    a1 += tr[j + 1, row[j + 1]]
                    a2 += tr[j + 2, row[j + 2]]
                    a3 += tr[j + 3, row[j + 3]]
                for j in range(m4, m):
                    a0 += tr[j, row[j]]
                o[t] = ((a0 + a1) + (a2 + a3)) * norms[h, t]


@njit(**JIT)
def _decode_stream(row, cb, bits, d, dec):  # a bitstream row -> cb[code] of its d coordinates
    mask = (1 << bits) - 1
    full = d // 8  # 8 codes fill exactly `bits` bytes: one word of 8 * bits bits
    for g in range(full):
        w = np.int64(0)
        for i in range(bits):
            w |= np.int64(row[g * bits + i]) << (8 * i)
        for i in range(8):
            dec[8 * g + i] = cb[(w >> (bits * i)) & mask]
    for c in range(8 * full, d):
        bit = c * bits
        byte = bit >> 3
        sh = bit & 7
        v = np.int64(row[byte]) >> sh
        if sh + bits > 8:
            v |= np.int64(row[byte + 1]) << (8 - sh)
        dec[c] = cb[v & mask]


@njit(**JIT)
def _scores_stream(qr, codes, norms, cb, bits, d, out):
    n, mrows, _ = qr.shape
    t_len = codes.shape[1]
    dec = np.empty(d, np.float32)
    for h in range(n):
        for t in range(t_len):
            _decode_stream(codes[h, t], cb, bits, d, dec)
            nt = norms[h, t]
            d4 = d - d % 4
            for r in range(mrows):
                q = qr[h, r]
                a0 = a1 = a2 = a3 = np.float32(0.0)  # four chains of additions, not one
                for c in range(0, d4, 4):
                    a0 += q[c] * dec[c]
                    a1 += q[c + 1] * dec[c + 1]
                    a2 += q[c + 2] * dec[c + 2]
                    a3 += q[c + 3] * dec[c + 3]
                for c in range(d4, d):
                    a0 += q[c] * dec[c]
                out[h, r, t] = ((a0 + a1) + (a2 + a3)) * nt


@njit(**JIT)
def _values_planar(w, codes, cb, bits, d, out):
    n, mrows, t_len = w.shape
    m = codes.shape[2]
    per = 8 // bits
    mask = (1 << bits) - 1
    hr = np.empty((m, 256), np.float32)  # one row's histogram at a time: it stays in L1
    for h in range(n):
        ch = codes[h]
        for r in range(mrows):
            hr[:] = 0
            wr = w[h, r]
            for t in range(t_len):
                row = ch[t]
                wt = wr[t]
                for j in range(m):
                    hr[j, row[j]] += wt
            o = out[h, r]
            o[:] = 0
            for j in range(m):
                for b in range(256):
                    x = hr[j, b]
                    if x == 0:  # byte value never seen with a weight (0 * cb adds 0: skipping it is exact)
                        continue
                    for k in range(per):
                        c = j + k * m
                        if c < d:
                            o[c] += x * cb[(b >> (k * bits)) & mask]


@njit(**JIT)
def _values_stream(w, codes, cb, bits, d, out):
    n, mrows, t_len = w.shape
    dec = np.empty(d, np.float32)
    for h in range(n):
        for r in range(mrows):
            out[h, r, :] = 0
        for t in range(t_len):
            _decode_stream(codes[h, t], cb, bits, d, dec)
            for r in range(mrows):
                wt = w[h, r, t]
                o = out[h, r]
                for c in range(d):
                    o[c] += wt * dec[c]


def _args(codes, cb, bits, d):
    codes = np.asarray(codes, np.uint8)  # a view of the cache's buffer (rows strided by its capacity): not copied
    return codes, np.ascontiguousarray(cb, np.float32), int(bits), int(d)


def code_scores(qr, codes, norms, cb, bits, d):
    codes, cb, bits, d = _args(codes, cb, bits, d)
    qr = np.ascontiguousarray(qr, np.float32)
    norms = np.ascontiguousarray(norms, np.float32)
    out = np.empty((qr.shape[0], qr.shape[1], codes.shape[1]), np.float32)
    if bits in (1, 2, 4):
        _scores_planar(qr, codes, norms, cb, bits, d, out)
    else:
        _scores_stream(qr, codes, norms, cb, bits, d, out)
    return out


def code_values(w, codes, cb, bits, d):
    codes, cb, bits, d = _args(codes, cb, bits, d)
    w = np.ascontiguousarray(w, np.float32)
    out = np.empty((w.shape[0], w.shape[1], d), np.float32)
    if bits in (1, 2, 4):
        _values_planar(w, codes, cb, bits, d, out)
    else:
        _values_stream(w, codes, cb, bits, d, out)
    return out
