"""numba side of :mod:`nnef_kv.kernels.gemv` (imported on first use; see that module)."""
from __future__ import annotations

from numba import njit

from ._numba_common import JIT_REASSOC, wide_vectors

__all__ = ["rows_by_t"]


@njit(**JIT_REASSOC)
def _rows_by_t(a, w, out, lo, hi):
    wide_vectors()
    m, k = a.shape
    zero = out.dtype.type(0)
    for o in range(lo, hi):
        for r in range(m):
            acc = zero
            for i in range(k):
                acc += w[o, i] * a[r, i]
            out[r, o] = acc


def rows_by_t(a, w, out, lo, hi):
    """``out[:, lo:hi] = a @ w[lo:hi].T`` (see :func:`nnef_kv.kernels.gemv.rows_by_t`)."""
    if not (0 <= lo <= hi <= w.shape[0]):
        raise ValueError(f"rows_by_t: rows {lo}:{hi} outside the weight's {w.shape[0]}")
    if a.shape[1] != w.shape[1] or out.shape != (a.shape[0], w.shape[0]):
        raise ValueError(f"rows_by_t: shapes {a.shape} x {w.shape}.T -> {out.shape}")
    _rows_by_t(a, w, out, lo, hi)
