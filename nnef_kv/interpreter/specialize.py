"""Plan-time specialisation of kernels whose attributes are all known when the plan is built.

A generic kernel re-reads its attributes on every call (flattens a shape, normalises axes, parses a
datum type...). For the ops a decoder runs dozens of times per token, :func:`specialize` returns a closure
with that work done once, computing exactly what the generic kernel computes (same NumPy calls in the same
order, same roundings) on the inputs it handles, and calling the generic kernel itself for any other input
(another dtype, a rank it was not prepared for, an error to report). ``tests/test_specialize.py`` checks
each one against its generic kernel.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from .ops import nnef_std as S
from .ops import tract_core as C
from .ops import tract_transformers as T

_F32 = np.dtype(np.float32)

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
    e, generic = _F32.type(float(eps)), C.tract_core_rms_norm
    one = _F32.type(1.0)

    def rms_norm(input: np.ndarray) -> np.ndarray:  # noqa: A002
        """f32 input: :func:`tract_core_rms_norm`'s arithmetic, attributes read once."""
        x = input
        if type(x) is not np.ndarray or x.dtype != _F32 or not -x.ndim <= axis < x.ndim:
            return generic(input, axis=axis, eps=eps)
        ax = axis + x.ndim if axis < 0 else axis
        ms = np.add.reduce(np.square(x), axis=ax, keepdims=True, dtype=_F32)
        n = x.shape[ax]
        if ms.size == 1 and n:
            return x * (one / np.sqrt(_F32.type(float(ms.reshape(())) / n) + e))
        ms /= np.intp(n)
        ms += e
        np.sqrt(ms, out=ms)
        return np.multiply(x, np.divide(one, ms, out=ms))
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
    f32_acc = acc != np.float64

    def sdpa(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: Any = None) -> np.ndarray:
        if mask is not None and np.ndim(mask) == 0 and np.asarray(mask).dtype == np.bool_ and not bool(mask):
            mask = None
        if (mask is None and f32_acc and type(q) is np.ndarray and type(k) is np.ndarray and type(v) is np.ndarray
                and q.ndim == 4 and q.shape[2] == 1 and k.ndim == 4 and v.ndim == 4
                and q.dtype == _F32 and k.dtype == _F32 and v.dtype == _F32):
            # one query row (a decode step): it sees every key, causal or not; sdpa_array's arithmetic
            b, hq, _, d = q.shape
            bk, hkv, skv, dk = k.shape
            if (bk == b and dk == d and v.shape[0] == b and v.shape[1] == hkv and v.shape[2] == skv and hkv
                    and hq % hkv == 0 and skv):
                scores = np.matmul(q.reshape(b, hkv, hq // hkv, d), k.swapaxes(-1, -2))
                scores *= _F32.type(1.0 / math.sqrt(d) if sc is None else sc)
                scores -= np.maximum.reduce(scores, axis=-1, keepdims=True)
                np.exp(scores, out=scores)
                scores /= np.add.reduce(scores, axis=-1, keepdims=True)
                return np.matmul(scores, v).reshape(b, hq, 1, v.shape[-1])
        return sdpa_array(q, k, v, mask, scale=sc, is_causal=causal, acc_dtype=acc)
    return sdpa


def _silu(attrs: dict[str, Any]) -> Kernel | None:
    generic, body = C.tract_core_silu, C._silu

    def silu(x: np.ndarray) -> np.ndarray:
        """f32 input: :func:`tract_core_silu` without its dtype dispatch."""
        if type(x) is not np.ndarray or x.dtype != _F32:
            return generic(x)
        with np.errstate(over="ignore"):
            return body(x)
    return silu


def _apply_rope(attrs: dict[str, Any]) -> Kernel | None:
    generic = T.tract_transformers_apply_rope

    def apply_rope(input: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:  # noqa: A002
        """All f32: :func:`tract_transformers_apply_rope`'s products and sum, the second product made in
        place in the rotated copy (when ``sin`` broadcasts into it)."""
        x = input
        if not (type(x) is np.ndarray and type(cos) is np.ndarray and type(sin) is np.ndarray
                and x.dtype == _F32 and cos.dtype == _F32 and sin.dtype == _F32 and x.ndim
                and x.shape[-1] % 2 == 0 and sin.ndim <= x.ndim):
            return generic(input, cos, sin)
        half = x.shape[-1] // 2
        rot = np.empty_like(x)
        np.negative(x[..., half:], out=rot[..., :half])
        rot[..., half:] = x[..., :half]
        try:
            rot *= sin
        except ValueError:  # sin broadcasts to a larger shape than x
            return generic(input, cos, sin)
        out = x * cos
        out += rot
        return out
    return apply_rope


#: generic kernel -> ``factory(static attributes) -> specialised kernel taking the inputs only, or None``
SPECIALIZERS: dict[Kernel, Callable[[dict[str, Any]], Kernel | None]] = {
    S.reshape: _reshape,
    S.transpose: _transpose,
    S.unsqueeze: _unsqueeze,
    C.tract_core_rms_norm: _rms_norm,
    T.tract_transformers_sdpa: _sdpa,
    C.tract_core_silu: _silu,
    T.tract_transformers_apply_rope: _apply_rope,
}


def specialize(kernel: Kernel, attrs: dict[str, Any]) -> Kernel | None:
    """A kernel equivalent to ``kernel(*inputs, **attrs)`` taking the inputs only, or None."""
    factory = SPECIALIZERS.get(kernel)
    return None if factory is None else factory(attrs)


__all__ = ["SPECIALIZERS", "specialize"]
