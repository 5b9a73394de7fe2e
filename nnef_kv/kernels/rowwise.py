"""Two decoder-block chains in one call each, numba, bit for bit what their NumPy references compute.

A decode step of a torch-to-nnef export runs, per layer, two RMS norms and two rotate-half RoPEs as chains of
NumPy calls on one token's vectors (the plan's fused forms, :mod:`nnef_kv.interpreter.plan.patterns`): 8-15 us
each, about 1.8 ms of a 27 ms SmolLM2-135M token, nearly all of it call overhead. These kernels do the same
float32 operations in the same order, so their results are the NumPy calls' bits (tests/properties/
test_kernels.py compares them with ``assert_array_equal``; tests/unit/test_patterns.py compares whole fused and
unfused decodes):

* :func:`rms_rows` ``(x, eps, weight, out)``: per row of ``x [R, N]``, ``ss = sum(x * x)`` summed as NumPy's
  ``add.reduce`` sums a contiguous float32 row (its pairwise scheme: blocks of at most 128 summed with eight
  interleaved accumulators, longer rows split in halves rounded down to a multiple of 8, plus the reduction's
  initial 0), ``mean = float32(float64(ss) / N)`` (``np.mean``'s true_divide by an integer), ``r = mean +
  eps``, ``y = x * (1 / sqrt(r))`` and ``y * weight`` when a weight is given (``[N]``), each rounded to f32.
  NaN, Inf and ``r <= 0`` give what NumPy gives (IEEE operations, no fast-math).
* :func:`rope_half` ``(x, cos, sin, out)``: ``x * cos + rotate_half(x) * sin`` on ``x [B, H, S, D]`` with
  ``rotate_half(x) = concat(-x[..., D/2:], x[..., :D/2])``, ``cos``/``sin`` of rank 4 broadcasting to ``x``
  (each product and the sum rounded to f32: LLVM contracts nothing into FMAs without fast-math flags).

Operand order does not matter for the bits (IEEE addition and multiplication are commutative), so one kernel
serves every operand order the patterns match.
"""
from __future__ import annotations

import numpy as np

from . import kernel

__all__ = ["rms_rows", "rope_half", "NO_WEIGHT"]

#: the weight argument of the compiled core of :func:`rms_rows` (:meth:`.Kernel.hot`) when there is none:
#: ``rms_core(x, eps, weight or NO_WEIGHT, out)``; ``rope_core(x, cos, sin, out)`` takes the kernel's own
NO_WEIGHT = np.zeros(0, np.float32)

_F32 = np.dtype(np.float32)


def _check_rows(x: np.ndarray, eps: np.float32, weight: np.ndarray | None, out: np.ndarray) -> None:
    if not (isinstance(x, np.ndarray) and x.dtype == _F32 and x.ndim == 2):
        raise ValueError("rms_rows: x must be a 2-D float32 array")
    if not isinstance(eps, np.float32):
        raise ValueError("rms_rows: eps must be a numpy float32")
    if weight is not None and not (isinstance(weight, np.ndarray) and weight.dtype == _F32
                                   and weight.shape == (x.shape[1],)):
        raise ValueError(f"rms_rows: weight must be a float32 array of shape ({x.shape[1]},)")
    if not (isinstance(out, np.ndarray) and out.dtype == _F32 and out.shape == x.shape):
        raise ValueError(f"rms_rows: out must be a float32 array of shape {x.shape}")


@kernel("nnef_kv.kernels._rowwise_jit:rms_rows", core="rms_core")
def rms_rows(x: np.ndarray, eps: np.float32, weight: np.ndarray | None, out: np.ndarray) -> None:
    """``out = x / sqrt(mean(x * x, last axis) + eps) * weight`` on ``x [R, N]`` (see the module docstring)."""
    _check_rows(x, eps, weight, out)
    m = np.add.reduce(np.multiply(x, x), axis=-1, keepdims=True)
    np.true_divide(m, np.intp(x.shape[1]), out=m, casting="unsafe")
    np.add(m, eps, out=m)
    with np.errstate(divide="ignore", invalid="ignore"):
        np.sqrt(m, out=m)
        np.divide(np.float32(1), m, out=m)
    np.multiply(x, m, out=out)
    if weight is not None:
        np.multiply(out, weight, out=out)


def _check_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, out: np.ndarray) -> None:
    if not all(isinstance(a, np.ndarray) and a.dtype == _F32 and a.ndim == 4 for a in (x, cos, sin, out)):
        raise ValueError("rope_half: x, cos, sin, out must be 4-D float32 arrays")
    if x.shape[3] % 2 or out.shape != x.shape:
        raise ValueError(f"rope_half: x {x.shape} needs an even last axis and out of the same shape")
    for name, a in (("cos", cos), ("sin", sin)):
        if any(n not in (1, m) for n, m in zip(a.shape, x.shape)):
            raise ValueError(f"rope_half: {name} {a.shape} does not broadcast to {x.shape}")


@kernel("nnef_kv.kernels._rowwise_jit:rope_half", core="rope_core")
def rope_half(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, out: np.ndarray) -> None:
    """``out = x * cos + rotate_half(x) * sin`` (see the module docstring)."""
    _check_rope(x, cos, sin, out)
    h = x.shape[3] // 2
    r = np.empty_like(x)
    np.negative(x[..., h:], out=r[..., :h])
    r[..., h:] = x[..., :h]
    np.multiply(r, sin, out=r)
    np.multiply(x, cos, out=out)
    np.add(out, r, out=out)
