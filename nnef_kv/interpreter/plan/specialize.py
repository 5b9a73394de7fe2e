"""Plan-time specialisation of kernels whose attributes are all known when the plan is built.

A generic kernel re-reads its attributes on every call (flattens a shape, normalises axes, parses a
datum type...). For the ops a decoder runs dozens of times per token, :func:`specialize` returns a closure
with that work done once, computing exactly what the generic kernel computes (same NumPy calls in the same
order, same roundings) on the inputs it handles, and calling the generic kernel itself for any other input
(another dtype, a rank it was not prepared for, an error to report). ``tests/test_specialize.py`` checks
each one against its generic kernel.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..ops import nnef_std as S
from ..ops import tract_core as C
from ..ops import tract_transformers as T


Kernel = Callable[..., Any]


def _reshape(attrs: dict[str, Any]) -> Kernel | None:
    shape = S._flatten(attrs.get("shape", ()))
    start, count = attrs.get("axis_start", 0), attrs.get("axis_count", -1)
    if not all(type(d) is int and d > 0 for d in shape) or type(start) is not int or type(count) is not int:
        return None  # 0 (copy a dim) and -1 (infer) depend on the input: the generic kernel
    if start < 0 or count < 0:
        return None
    new, end, generic = tuple(shape), start + count, S.reshape

    def reshape(input: np.ndarray) -> np.ndarray:  # noqa: A002 - NNEF parameter name
        s = input.shape
        if len(s) < end:
            return generic(input, shape=list(new), axis_start=start, axis_count=count)
        try:
            return input.reshape(s[:start] + new + s[end:])
        except (ValueError, AttributeError):
            return generic(input, shape=list(new), axis_start=start, axis_count=count)
    return reshape


def _transpose(attrs: dict[str, Any]) -> Kernel | None:
    axes = attrs.get("axes", ())
    if not all(type(a) is int for a in axes):
        return None
    perm, n, generic = tuple(axes), len(axes), S.transpose

    def transpose(input: np.ndarray) -> np.ndarray:  # noqa: A002
        if type(input) is np.ndarray and input.ndim == n:
            return input.transpose(perm)
        return generic(input, axes=list(perm))
    return transpose


def _unsqueeze(attrs: dict[str, Any]) -> Kernel | None:
    axes = attrs.get("axes", ())
    if not axes or not all(type(a) is int and a >= 0 for a in axes) or len(set(axes)) != len(axes):
        return None
    ax, generic = tuple(sorted(axes)), S.unsqueeze

    def unsqueeze(input: np.ndarray) -> np.ndarray:  # noqa: A002
        if type(input) is not np.ndarray or ax[-1] >= input.ndim + len(ax):
            return generic(input, axes=list(axes))
        shape = list(input.shape)
        for a in ax:
            shape.insert(a, 1)
        return input.reshape(shape)
    return unsqueeze


def _rms_norm(attrs: dict[str, Any]) -> Kernel | None:
    axis, eps = attrs.get("axis"), attrs.get("eps", 1e-6)
    if type(axis) is not int or not isinstance(eps, (int, float)):
        return None
    generic, array, e = C.tract_core_rms_norm, C.rms_norm_array, float(eps)

    def rms_norm(input: np.ndarray) -> np.ndarray:  # noqa: A002
        """:func:`tract_core_rms_norm` with its axis and eps read once."""
        x = input
        if type(x) is not np.ndarray or not -x.ndim <= axis < x.ndim:
            return generic(input, axis=axis, eps=eps)
        return array(x, axis + x.ndim if axis < 0 else axis, e)
    return rms_norm


def _sdpa(attrs: dict[str, Any]) -> Kernel | None:
    """``tract_transformers_sdpa`` with its datum types and scale parsed once (mask handled as the
    generic kernel does: the declared default ``false`` means none)."""
    try:
        acc = C.parse_datum_type(attrs.get("acc_datum_type", "f32"), where="tract_transformers_sdpa acc_datum_type")
        C.parse_datum_type(attrs.get("datum_type", "f32"), where="tract_transformers_sdpa datum_type")
        scale = attrs.get("scale")
        sc = None if scale is None or C.as_float(scale) == 0.0 else C.as_float(scale)
    except Exception:  # noqa: BLE001 - the generic kernel reports it, at run time, with the node
        return None
    causal, sdpa_array = bool(attrs.get("is_causal", False)), T.sdpa_array

    def sdpa(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: Any = None) -> np.ndarray:
        if mask is not None and np.ndim(mask) == 0 and np.asarray(mask).dtype == np.bool_ and not bool(mask):
            mask = None
        return sdpa_array(q, k, v, mask, scale=sc, is_causal=causal, acc_dtype=acc)
    return sdpa


#: generic kernel -> ``factory(static attributes) -> specialised kernel taking the inputs only, or None``
SPECIALIZERS: dict[Kernel, Callable[[dict[str, Any]], Kernel | None]] = {
    S.reshape: _reshape,
    S.transpose: _transpose,
    S.unsqueeze: _unsqueeze,
    C.tract_core_rms_norm: _rms_norm,
    T.tract_transformers_sdpa: _sdpa,
}


def specialize(prim: Any, attrs: dict[str, Any]) -> Kernel | None:
    """A kernel equivalent to ``prim.kernel(*inputs, **attrs)`` taking the inputs only, or None."""
    factory = SPECIALIZERS.get(getattr(prim, "kernel", prim))
    return None if factory is None else factory(attrs)


__all__ = ["SPECIALIZERS", "specialize"]
