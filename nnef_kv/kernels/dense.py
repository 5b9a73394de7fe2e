"""A decode step's run of weight products, residual adds, RMS norms and SwiGLU gates in one call (numba),
beside a NumPy reference.

Between two attentions a LLaMA-style decoder runs, on the one row of a decode step: the output projection,
the residual add, the RMS norm, the gate|up product, the SwiGLU gate, the down product, the residual add,
the next layer's RMS norm and its q|k|v product. As plan steps that is nine Python calls, each checking its
operands; their products stream the weights at memory speed, and the ~40 us of Python between them costs
more than its own time because every product has just evicted the interpreter's data from the caches.
:func:`run_ops` runs such a run of operations, given as a small program, in one call.

A program is ``code`` (int64 ``[ops, 5]``, one row an operation) and ``eps`` (float32 ``[ops]``); ``values``
starts as the run's inputs (``ins``, 2-D float32 ``[1, n]`` C-contiguous arrays: one row) and each operation
appends its result; ``outs`` are C-contiguous ``[1, n]`` arrays the operations marked as exported write
into (``code[i, 4] = j >= 0``: into ``outs[j]``; -1: a new array). The operations (``code[i, 0]``):

* :data:`PRODUCT` ``(a, w)``: ``values[a] @ weights[w].T`` (``weights[w]`` float32 ``[N, K]`` C-contiguous):
  :func:`nnef_kv.kernels.gemv.rows_by_t`'s core, the same call as a plan's product step makes;
* :data:`SLICE` ``(a, lo, hi)``: columns ``lo:hi`` of ``values[a]`` (a view: one part of a stacked product);
* :data:`ADD` ``(a, b)``: ``values[a] + values[b]`` (float32, element by element: NumPy's ``add``);
* :data:`RMS` ``(a, w)``: :func:`nnef_kv.kernels.rowwise.rms_rows` of ``values[a]`` with ``eps[i]`` and the
  weight row ``weights[w][0]`` (``w = -1``: no weight);
* :data:`GATE` ``(a, b)``: :func:`nnef_kv.kernels.gate.silu_gate` of ``values[a]``, ``values[b]``.

The numba side calls the same compiled cores as the plan's steps, so its results are the steps' bits
(tests/unit/test_dense_runs.py compares whole decodes bit for bit). The reference makes the same operations
with NumPy (``np.matmul`` for the products: BLAS's sums, another order) and the kernels' references.
"""
from __future__ import annotations

import importlib
from typing import Any

import numpy as np

from . import kernel
from .gate import silu_gate
from .rowwise import rms_rows

__all__ = ["run_ops", "PRODUCT", "SLICE", "ADD", "RMS", "GATE", "check_program", "numba_side"]

PRODUCT, SLICE, ADD, RMS, GATE = 0, 1, 2, 3, 4
_F32 = np.dtype(np.float32)
_ROW = 5  # columns of a code row


def check_program(code: np.ndarray, eps: np.ndarray, weights: Any, ins: tuple, outs: tuple) -> None:
    """ValueError unless the program reads only values that exist, with the shapes its operations take."""
    if not (isinstance(code, np.ndarray) and code.dtype == np.int64 and code.ndim == 2 and code.shape[1] == _ROW):
        raise ValueError("run_ops: code must be an int64 array of shape [ops, 5]")
    if not (isinstance(eps, np.ndarray) and eps.dtype == _F32 and eps.shape == (code.shape[0],)):
        raise ValueError("run_ops: eps must be a float32 array of one value an operation")
    for x in list(ins) + list(outs) + list(weights):
        if not (isinstance(x, np.ndarray) and x.dtype == _F32 and x.ndim == 2 and x.flags.c_contiguous):
            raise ValueError("run_ops: inputs, outputs and weights must be C-contiguous 2-D float32 arrays")
    if any(x.shape[0] != 1 for x in list(ins) + list(outs)):
        raise ValueError("run_ops: inputs and outputs must have one row")
    widths = [x.shape[1] for x in ins]
    used: set[int] = set()
    for i, (op, a, b, c, e) in enumerate(code.tolist()):
        def width(j: int) -> int:
            if not 0 <= j < len(widths):
                raise ValueError(f"run_ops: operation {i} reads value {j}, which does not exist yet")
            return widths[j]
        if op == PRODUCT:
            if not 0 <= b < len(weights) or weights[b].shape[1] != width(a):
                raise ValueError(f"run_ops: operation {i}: product of width {width(a)} by weight {b}")
            n = weights[b].shape[0]
        elif op == SLICE:
            if not 0 <= b <= c <= width(a):
                raise ValueError(f"run_ops: operation {i}: columns {b}:{c} of a value of width {width(a)}")
            n = c - b
        elif op in (ADD, GATE):
            if width(a) != width(b):
                raise ValueError(f"run_ops: operation {i}: operands of widths {width(a)} and {width(b)}")
            n = width(a)
        elif op == RMS:
            n = width(a)
            if b != -1 and (not 0 <= b < len(weights) or weights[b].shape != (1, n)):
                raise ValueError(f"run_ops: operation {i}: RMS weight {b} is not a [1, {n}] row")
        else:
            raise ValueError(f"run_ops: operation {i}: unknown operation {op}")
        if e >= 0:
            if op == SLICE or e >= len(outs) or e in used or outs[e].shape[1] != n:
                raise ValueError(f"run_ops: operation {i}: output {e} cannot take its [1, {n}] result")
            used.add(e)
        widths.append(n)


@kernel("nnef_kv.kernels._dense_jit:run_ops", core="run_core")
def run_ops(code: np.ndarray, eps: np.ndarray, weights: Any, ins: tuple, outs: tuple) -> None:
    """Run the program (see the module docstring); the exported results are written into ``outs``."""
    check_program(code, eps, weights, ins, outs)
    values = list(ins)
    for i, (op, a, b, c, e) in enumerate(code.tolist()):
        if op == SLICE:
            values.append(values[a][:, b:c])
            continue
        if op == PRODUCT:
            y = np.matmul(values[a], weights[b].T)
        elif op == ADD:
            y = np.add(values[a], values[b])
        elif op == RMS:
            y = np.empty_like(values[a])
            rms_rows.reference(values[a], eps[i], None if b < 0 else weights[b][0], y)
        else:
            y = np.empty_like(values[a])
            silu_gate.reference(values[a], values[b], y)
        if e >= 0:
            outs[e][...] = y
            y = outs[e]
        values.append(y)


def numba_side() -> Any:
    """The numba module of :func:`run_ops` (imports numba, as the kernel's first call does): the cores it calls
    (``_rows_by_t``, ``rms_core``, ``silu_core``: the plan compares the members' kernels with them) and
    ``weight_list``."""
    return importlib.import_module(run_ops.jit_path.partition(":")[0])
