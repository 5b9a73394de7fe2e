"""SwiGLU's gate ``g * sigmoid(g) * u`` in one pass, numba, beside a NumPy reference.

A torch-to-nnef export spells SwiGLU as ``mul(mul(g, sigmoid(g)), u)``; the plan's fused form of that chain
(``silu_gate`` in :mod:`nnef_kv.interpreter.plan.patterns`) makes six NumPy passes over ``tokens x ffn``
values: 10 us a layer on a decode step, 2.5 ms on a 512-token prefill of SmolLM2-135M (5% of it, the
largest step after the products and the attention). :func:`silu_gate` reads ``g`` and ``u`` once and
writes the result once.

``silu_gate(g, u, out)``: ``g``, ``u`` float32 ``[R, N]`` (rows of any stride, each row contiguous: the two
halves of a stacked gate/up product are such views), ``out`` float32 ``[R, N]`` C-contiguous.
The reference makes the unfused chain's calls: ``t = exp(-g)``, ``1 / (1 + t)``, ``* g``, ``* u``. The numba
side computes the sigmoid as ``1 / (1 + e)`` for ``g >= 0`` and ``e / (1 + e)`` below, with ``e =
exp(-|g|)`` from :func:`~nnef_kv.kernels._numba_common.exp_nonpositive` (within 1 ulp; 0 below -87): not the
reference's bits, within :func:`error_bound` of the exact value as the reference is
(tests/properties/test_decode_kernels.py). NaN gives NaN, ``g = +Inf`` gives ``Inf * u``, ``g = -Inf`` NaN,
as NumPy's calls do.
"""
from __future__ import annotations

import numpy as np

from . import kernel

__all__ = ["silu_gate", "readable", "exact", "error_bound"]

_F32 = np.dtype(np.float32)


def readable(x: np.ndarray) -> bool:
    """The compiled core reads ``x`` (2-D float32) in place: each row contiguous, rows a whole number of
    elements apart."""
    st = x.strides
    return x.ndim == 2 and st[1] == 4 and st[0] >= 0 and st[0] % 4 == 0


def _check(g: np.ndarray, u: np.ndarray, out: np.ndarray) -> None:
    if not all(isinstance(a, np.ndarray) and a.dtype == _F32 and a.ndim == 2 for a in (g, u, out)):
        raise ValueError("silu_gate: g, u, out must be 2-D float32 arrays")
    if not (g.shape == u.shape == out.shape and out.flags.c_contiguous):
        raise ValueError(f"silu_gate: g {g.shape}, u {u.shape} and a C-contiguous out {out.shape} of one shape")


@kernel("nnef_kv.kernels._gate_jit:silu_gate", core="silu_core")
def silu_gate(g: np.ndarray, u: np.ndarray, out: np.ndarray) -> None:
    """``out = g * sigmoid(g) * u`` (see the module docstring)."""
    _check(g, u, out)
    np.negative(g, out=out)
    with np.errstate(over="ignore"):
        np.exp(out, out=out)
    np.add(1, out, out=out)
    np.divide(1, out, out=out)
    np.multiply(g, out, out=out)
    np.multiply(out, u, out=out)


def exact(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """:func:`silu_gate` of the same inputs in float64."""
    g64 = g.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        return g64 / (1.0 + np.exp(-g64)) * u.astype(np.float64)


def error_bound(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """A bound on ``|out - exact(g, u)|`` for either side where the exact value is a finite float32: 12 ulp of the
    result (the exp's, the sum's, the division's, two products' roundings, with room: NumPy's exp is within
    a few ulp) plus ``|g u| 2**-125`` (a sigmoid below 2**-126, which either side may give as 0: the numba
    exp is 0 below -87, NumPy's ``1 / (1 + exp(-g))`` 0 once ``exp(-g)`` overflows) and the smallest
    subnormal times ``|u|`` (a product rounded in the subnormal range)."""
    g64, u64 = g.astype(np.float64), u.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        ex = np.abs(exact(g, u))
        return 12 * 2.0 ** -24 * ex + np.abs(g64 * u64) * 2.0 ** -125 + (np.abs(u64) + 1) * 2.0 ** -149
