"""numba side of :mod:`nnef_kv.kernels.gate` (imported on first use; see that module)."""
from __future__ import annotations

import numpy as np
from numba import carray, njit

from ._numba_common import JIT, exp_nonpositive, void_pointer, wide_vectors

__all__ = ["silu_gate", "silu_core"]


@njit(**JIT)
def _row(a, r, n):
    """Row ``r`` of a 2-D float32 array whose rows are contiguous, as a C-contiguous array (numba does not
    vectorise loops over an array of unknown strides)."""
    return carray(void_pointer(a.ctypes.data + r * a.strides[0]), (n,), np.float32)


@njit(**JIT)
def silu_core(g, u, out):
    """``out = g * sigmoid(g) * u`` on ``[R, N]`` arrays (:func:`~nnef_kv.kernels.gate.readable`)."""
    wide_vectors()
    rows, n = g.shape
    one = np.float32(1)
    for r in range(rows):
        gr, ur, orow = _row(g, r, n), _row(u, r, n), _row(out, r, n)
        for i in range(n):
            x = gr[i]
            e = exp_nonpositive(-x if x >= 0 else x)  # exp(-|x|); NaN stays NaN
            s = (one if x >= 0 else e) / (one + e)
            orow[i] = x * s * ur[i]


def silu_gate(g, u, out):
    """See :func:`nnef_kv.kernels.gate.silu_gate`."""
    from .gate import _check, readable

    _check(g, u, out)
    g, u = (x if readable(x) else np.ascontiguousarray(x) for x in (g, u))
    silu_core(g, u, out)
