"""The two loops of the rotated-codebook attention (``nnef_kv_rotated_sdpa``) over packed codes: numba beside
a NumPy reference (the reference is the tests' oracle; ``NNEF_KV_NO_NUMBA=1`` runs it).

The codes are :class:`~nnef_kv.kv.packing.RowCodec` rows (``bits`` 1, 2, 4: planar, byte ``j`` of a row holds the
codes of coordinates ``j, j + m, j + 2m, ...`` in its bit fields, ``m`` = bytes a row; 3 bits: a bitstream),
``codes [n, T, m]`` uint8, one row per token and kv head; ``cb`` the codebook (``2**bits`` f32 points).

* :func:`code_scores` ``(qr [n, M, D], codes, norms [n, T], cb, bits, d) -> [n, M, T]``: ``norm_t * sum_j
  qr_j cb[code_tj]``, the raw score of every coded token for each (rotated) query row.
* :func:`code_values` ``(w [n, M, T], codes, cb, bits, d) -> [n, M, D]``: ``sum_t w_t cb[code_t]``, the
  coded values accumulated in the rotated basis (``w`` = softmax weight x norm).

numba (``_jit``; its docstring has the details): on hosts with AVX-512F the codebook sits in one register
and each token's codes are decoded 16 at a time by a lane permute, then dotted with the query rows (scores)
or added to the rows' accumulators (values), four query rows of a kv head per decode (GQA). Elsewhere a score
is a sum of table lookups, one table entry per code index (a nibble or byte of planar codes, a six-bit field
of two 3-bit codes), and the values use a weight histogram by index, turned into the ``D`` outputs at the
end; query rows sharing a kv head are served four at a time from 4-float entries. The sums are the
reference's up to the order of the f32 additions; NaN and Inf propagate as IEEE arithmetic does in any order
(no fastmath).
"""
from __future__ import annotations

import numpy as np

from ..packing import RowCodec
from ...kernels import kernel

__all__ = ["code_scores", "code_values", "decode"]


def decode(codes: np.ndarray, cb: np.ndarray, bits: int, d: int) -> np.ndarray:
    """``cb[code]`` of every coordinate, ``[n, T, D]`` f32."""
    return np.asarray(cb, np.float32)[RowCodec(bits, d).unpack(codes)]


@kernel("nnef_kv.kv.rotated._jit:code_scores")
def code_scores(qr: np.ndarray, codes: np.ndarray, norms: np.ndarray, cb: np.ndarray, bits: int, d: int,
                threads: int = 1) -> np.ndarray:
    """``[n, M, T]`` f32: ``norms[n, t] * sum_j qr[n, m, j] * cb[codes[n, t, j]]`` (reference: the codes
    decoded, a matmul; ``threads``: the numba side splits the tokens over that many threads)."""
    dec = decode(codes, cb, bits, d)
    s = np.matmul(np.asarray(qr, np.float32), dec.swapaxes(1, 2))
    with np.errstate(invalid="ignore", over="ignore"):
        s *= np.asarray(norms, np.float32)[:, None, :]
    return s


@kernel("nnef_kv.kv.rotated._jit:code_values")
def code_values(w: np.ndarray, codes: np.ndarray, cb: np.ndarray, bits: int, d: int, threads: int = 1
                ) -> np.ndarray:
    """``[n, M, D]`` f32: ``sum_t w[n, m, t] * cb[codes[n, t, :]]`` (reference: decoded, a matmul;
    ``threads``: the numba side splits the tokens over that many threads and adds their sums)."""
    dec = decode(codes, cb, bits, d)
    with np.errstate(invalid="ignore", over="ignore"):
        return np.matmul(np.asarray(w, np.float32), dec)
