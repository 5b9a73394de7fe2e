"""numba side of :mod:`nnef_kv.kernels.dense` (imported on first use; see that module)."""
from __future__ import annotations

import warnings

import numpy as np
from numba import njit, types
from numba.core.errors import NumbaTypeSafetyWarning
from numba.typed import List

from ._gate_jit import silu_core
from ._gemv_jit import _rows_by_t
from ._numba_common import JIT
from ._rowwise_jit import rms_core

__all__ = ["run_ops", "run_core", "weight_list"]

_ROW2 = types.float32[:, ::1]


@njit(**JIT)
def run_core(code, eps, weights, ins, outs):
    vals = List.empty_list(_ROW2)
    for x in ins:
        vals.append(x)
    none = np.zeros((1, 0), np.float32)
    for i in range(code.shape[0]):
        op, a, b, c, e = code[i, 0], code[i, 1], code[i, 2], code[i, 3], code[i, 4]
        if op == 1:  # SLICE: one row, so its columns are contiguous
            vals.append(vals[a][0, b:c].reshape((1, c - b)))
            continue
        if op == 0:
            n = weights[b].shape[0]
        else:
            n = vals[a].shape[1]
        y = outs[e] if e >= 0 else np.empty((1, n), np.float32)
        if op == 0:  # PRODUCT
            _rows_by_t(vals[a], weights[b], y, 0, n)
        elif op == 2:  # ADD
            x0, x1 = vals[a], vals[b]
            for j in range(n):
                y[0, j] = x0[0, j] + x1[0, j]
        elif op == 3:  # RMS
            w = weights[b][0] if b >= 0 else none[0]
            rms_core(vals[a], eps[i], w, y)
        else:  # GATE
            silu_core(vals[a], vals[b], y)
        vals.append(y)


def weight_list(weights):
    """The weights as the typed list the core takes (built once per run of a plan). Read-only weights go in
    as the list's (writable) array type: the core never writes them (numba's type-safety warning silenced)."""
    out = List.empty_list(_ROW2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NumbaTypeSafetyWarning)
        for w in weights:
            out.append(w)
    return out


def run_ops(code, eps, weights, ins, outs):
    """See :func:`nnef_kv.kernels.dense.run_ops`."""
    from .dense import check_program

    check_program(code, eps, weights, ins, outs)
    run_core(code, eps, weights if isinstance(weights, List) else weight_list(weights), tuple(ins), tuple(outs))
