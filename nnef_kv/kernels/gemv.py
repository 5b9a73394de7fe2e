"""Products of a few rows by a constant float weight kept as ``W [N, K]`` (numba), beside a NumPy reference.

A decode step multiplies one row by every weight of the model, so it streams the weights once a token and
nothing else: a step runs at the memory bandwidth one core reaches on a dot product. OpenBLAS's gemv for
``x @ W.T`` (the layout torch and tract store a ``Linear`` weight in, read by BLAS as a transposed view)
reaches about half of it here: ``python benchmarks/scale.py --rows products`` on this 2-core VM (AMD EPYC, one
thread, weights cycled through 600 MB so every call reads memory; 2026-12-06 18:08 UTC, load average 0.9):
1 x 576 x 1536 12.4 GB/s with BLAS, 21.5 with :func:`rows_by_t`; 1 x 576 x 49152 (an LM head) 13.1 and
29.2; at 2 rows BLAS drops to 5.5 GB/s and this kernel keeps 20.7; at 8 rows (BLAS 4.7) they meet: the
kernel's one dot product an output and row is compute-bound there (docs/benchmarks.md, "Where the code's
thresholds come from"). Above :data:`MAX_ROWS` rows (a prefill) BLAS's blocked product is the faster one.

``rows_by_t(a, w, out, lo, hi)`` writes ``out[:, lo:hi] = a @ w[lo:hi].T``: one dot product an output,
``sum_i w[o, i] * a[r, i]`` along a contiguous row of ``w``, in lanes (``reassoc``: the sum is vectorised,
no FMA contraction, NaN and Inf kept). **Each output is computed the same way whatever ``lo``, ``hi`` and
the number of rows**, so a product split across threads at any row of ``w`` gives the same bits as
unsplit, and a projection fused with others (``w`` stacked with more rows) the same bits as alone.
The NumPy reference is ``np.matmul(a, w[lo:hi].T)`` (the same sums, in BLAS's order).
"""
from __future__ import annotations

import numpy as np

from . import kernel

__all__ = ["rows_by_t", "MAX_ROWS", "DTYPES", "usable"]

#: products of more rows than this run on BLAS (measured crossover, see the module docstring)
MAX_ROWS = 4
#: the weight dtypes the kernel takes (numba has no float16 arithmetic)
DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def usable(a: np.ndarray, wt: np.ndarray) -> bool:
    """``a [m, K] @ wt [K, N]`` runs on :func:`rows_by_t`: few rows, ``wt`` the transposed view of a
    C-contiguous ``[N, K]`` weight, ``a`` C-contiguous, one dtype the kernel takes."""
    return (a.ndim == 2 and wt.ndim == 2 and 0 < a.shape[0] <= MAX_ROWS and a.dtype == wt.dtype
            and a.dtype in DTYPES and wt.flags.f_contiguous and a.flags.c_contiguous
            and a.shape[1] == wt.shape[0])


@kernel("nnef_kv.kernels._gemv_jit:rows_by_t", core="_rows_by_t")
def rows_by_t(a: np.ndarray, w: np.ndarray, out: np.ndarray, lo: int, hi: int) -> None:
    """``out[:, lo:hi] = a @ w[lo:hi].T`` for ``a [m, K]``, ``w [N, K]``, ``out [m, N]`` (all C-contiguous,
    one float dtype). ``rows_by_t.hot()`` hands a caller that checked the shapes with :func:`usable` and its
    row range itself the compiled core, the same arguments without the wrapper's checks (a decode step calls
    it about 120 times)."""
    np.matmul(a, w[lo:hi].T, out=out[:, lo:hi])

