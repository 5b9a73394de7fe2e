"""NNEF 1.0.5 standard operations (spec chapter 4) as NumPy kernels, with tract's semantics where they differ.

tract behaviours followed here (checked with tract 0.23.9):
* binary ops align ranks by appending trailing unit axes to the lower-rank operand (NNEF style:
  ``add(x[N,C,H,W], b[1,C])`` works), then broadcast numpy-style;
* a 0-d literal operand takes the dtype of the other operand (``add(x_f16, 1.0)``);
* integer ``div`` truncates toward zero (tract's TDim/i64 division);
* ``min``/``max`` (so ``relu``, ``clamp``) and ``min_reduce``/``max_reduce`` ignore a NaN operand (Rust
  ``f32::min``); every other op propagates NaN (tract's sigmoid approximation maps NaN to ~4e-7; here NaN);
* ``round`` rounds half away from zero; ``slice`` reads ``end = 0`` as "to the end", negative bounds
  from the end, and clamps out-of-range bounds;
* ``elu`` has ``alpha`` (Khronos; tract's stdlib lacks it, defaults agree);
* ``zero_point_linear_quantize`` takes ``zero_point: integer, scale: scalar`` as tract does.
f16 tensors compute in f16 except where noted (conv/deconv/matmul accumulate in f32, then cast back).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ...errors import GraphError
from ...core.registry import Kernel, declare, primitive, source

T1 = "(x: tensor<scalar>) -> (y: tensor<scalar>)"
T2 = "(x: tensor<scalar>, y: tensor<scalar>) -> (z: tensor<scalar>)"


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
def _align(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rank alignment by trailing unit axes, and literal dtype adoption."""
    if x.dtype != y.dtype:
        if y.ndim == 0 or (y.size == 1 and x.size != 1):
            y = y.astype(x.dtype) if not (x.dtype == np.bool_) else y
        elif x.ndim == 0 or x.size == 1:
            x = x.astype(y.dtype) if not (y.dtype == np.bool_) else x
    if x.ndim != y.ndim and x.ndim > 0 and y.ndim > 0:
        if x.ndim < y.ndim:
            x = x.reshape(x.shape + (1,) * (y.ndim - x.ndim))
        else:
            y = y.reshape(y.shape + (1,) * (x.ndim - y.ndim))
    return x, y


def _axes(axes: Sequence[int], rank: int) -> tuple[int, ...]:
    return tuple(sorted(a + rank if a < 0 else a for a in axes))


def _flatten(items: Any) -> list[Any]:
    if not isinstance(items, (list, tuple)):
        return [items]
    out: list[Any] = []
    for i in items:
        out += _flatten(i) if isinstance(i, (list, tuple)) else [i]
    return out


def _f(x: np.ndarray) -> np.ndarray:
    """Float view of an input for float-only math (ints/bools go to f32)."""
    return x if x.dtype.kind == "f" else x.astype(np.float32)


# ------------------------------------------------------------------------------------------------
# element-wise unary
# ------------------------------------------------------------------------------------------------
def _unary(name: str, fn: Any, *aliases: str, positional: bool = False) -> None:
    """``positional``: tract registers the op as a unit element-wise op (operand bound by position)."""
    primitive(f"fragment {name}{T1};", "nnef", *aliases, positional=positional)(fn)


def _round(x: np.ndarray) -> np.ndarray:
    if x.dtype.kind != "f":
        return x
    # half away from zero, keeping the sign of -0.0 (and of values rounding to zero), as IEEE and tract
    return np.copysign(np.floor(np.abs(x) + x.dtype.type(0.5)), x).astype(x.dtype, copy=False)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    x = _f(x)
    with np.errstate(over="ignore"):
        return (1 / (1 + np.exp(-x))).astype(x.dtype, copy=False)


def _rcp(x: np.ndarray) -> np.ndarray:
    x = _f(x)
    with np.errstate(divide="ignore"):
        return (x.dtype.type(1) / x).astype(x.dtype, copy=False)


def _rsqrt(x: np.ndarray) -> np.ndarray:
    x = _f(x)
    with np.errstate(divide="ignore", invalid="ignore"):
        return (x.dtype.type(1) / np.sqrt(x)).astype(x.dtype, copy=False)


def _rsqr(x: np.ndarray) -> np.ndarray:
    x = _f(x)
    with np.errstate(divide="ignore"):
        return (x.dtype.type(1) / (x * x)).astype(x.dtype, copy=False)


def _float_fn(fn: Any) -> Any:
    def k(x: np.ndarray) -> np.ndarray:
        x = _f(x)
        with np.errstate(all="ignore"):
            return fn(x).astype(x.dtype, copy=False)
    k.__name__ = getattr(fn, "__name__", "float_fn")
    return k


def _copy(x: np.ndarray) -> np.ndarray:
    return np.array(x, copy=True)


primitive("fragment copy<?>(x: tensor<?>) -> (y: tensor<?>);")(_copy)
# positional=True: the ops tract registers as unit element-wise (nnef/src/ops/nnef/mod.rs)
_unary("neg", lambda x: np.negative(x), positional=True)
_unary("rcp", _rcp)
_unary("recip", _rcp, positional=True)
for _n, _fn in [("exp", np.exp), ("log", np.log), ("sin", np.sin), ("cos", np.cos), ("tan", np.tan),
                ("sinh", np.sinh), ("cosh", np.cosh), ("tanh", np.tanh), ("asin", np.arcsin), ("acos", np.arccos),
                ("atan", np.arctan), ("asinh", np.arcsinh), ("acosh", np.arccosh), ("atanh", np.arctanh),
                ("sqrt", np.sqrt)]:
    _unary(_n, _float_fn(_fn), positional=True)
_unary("log2", _float_fn(np.log2))
_unary("abs", lambda x: np.abs(x), positional=True)
_unary("sign", lambda x: np.sign(x), positional=True)
primitive("fragment not(x: tensor<logical>) -> (y: tensor<logical>);", positional=True)(lambda x: np.logical_not(x))
_unary("floor", lambda x: np.floor(x) if x.dtype.kind == "f" else x, positional=True)
_unary("ceil", lambda x: np.ceil(x) if x.dtype.kind == "f" else x, positional=True)
_unary("round", _round, positional=True)
_unary("sqr", lambda x: x * x)
_unary("square", lambda x: x * x, positional=True)  # tract registers "square"
_unary("rsqr", _rsqr)
_unary("rsqrt", _rsqrt, positional=True)
_unary("sigmoid", _sigmoid, positional=True)
_unary("relu", lambda x: np.fmax(x, x.dtype.type(0)))  # tract: relu = max(x, 0.0), and max ignores NaN
_unary("softplus", _float_fn(lambda x: np.logaddexp(x, 0)))
_unary("silu", lambda x: x * _sigmoid(x))


@primitive("fragment gelu(x: tensor<scalar>) -> (y: tensor<scalar>);")
def gelu(x: np.ndarray) -> np.ndarray:
    """Khronos defines gelu as ``x * sigmoid(1.702 * x)`` (tract has no ``gelu``; its exports use fragments)."""
    x = _f(x)
    return x * _sigmoid(x * x.dtype.type(1.702))


@primitive("fragment elu(x: tensor<scalar>, alpha: scalar = 1.0) -> (y: tensor<scalar>);")
def elu(x: np.ndarray, alpha: float = 1.0) -> np.ndarray:
    x = _f(x)
    with np.errstate(over="ignore"):
        return np.where(x < 0, x.dtype.type(alpha) * (np.exp(x) - 1), x).astype(x.dtype, copy=False)


@primitive("fragment selu(x: tensor<scalar>, alpha: scalar = 1.67326319, lambda: scalar = 1.05070102) -> (y: tensor<scalar>);")
def selu(x: np.ndarray, alpha: float = 1.67326319, **kw: float) -> np.ndarray:
    lam = kw.get("lambda", 1.05070102)
    return (x.dtype.type(lam) * elu(x, alpha)).astype(x.dtype, copy=False)


@primitive("fragment leaky_relu(x: tensor<scalar>, alpha: scalar) -> (y: tensor<scalar>);")
def leaky_relu(x: np.ndarray, alpha: float = 0.01) -> np.ndarray:
    return np.where(x < 0, x * x.dtype.type(alpha), x)


@primitive("fragment prelu(x: tensor<scalar>, alpha: tensor<scalar>) -> (y: tensor<scalar>);")
def prelu(x: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    x2, a = _align(x, alpha)
    return np.where(x2 < 0, a * x2, x2).astype(x.dtype, copy=False)


@primitive("fragment softabs(x: tensor<scalar>, epsilon: scalar) -> (y: tensor<scalar>);")
def softabs(x: np.ndarray, epsilon: float = 0.0) -> np.ndarray:
    return np.sqrt(x * x + x.dtype.type(epsilon))


# ------------------------------------------------------------------------------------------------
# element-wise binary, comparisons, logic, select
# ------------------------------------------------------------------------------------------------
def _div(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    x, y = _align(x, y)
    if x.dtype.kind in "iu" and y.dtype.kind in "iu":
        q = np.abs(x) // np.abs(y)
        return np.where((x < 0) != (y < 0), -q, q).astype(np.result_type(x, y))
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.divide(x, y)


def _pow(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    x, y = _align(x, y)
    with np.errstate(all="ignore"):
        if x.dtype.kind in "iu" and y.dtype.kind in "iu":
            return np.power(x, np.maximum(y, 0))
        return np.power(x, y)


def _binary(name: str, fn: Any, sig: str = T2) -> None:
    def k(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        x, y = _align(x, y)
        return fn(x, y)
    k.__name__ = name
    primitive(f"fragment {name}{sig};", positional=True)(k)  # tract registers it as binary: by position


_binary("add", np.add)
_binary("sub", np.subtract)
_binary("mul", np.multiply)
primitive(f"fragment div{T2};", positional=True)(_div)
primitive(f"fragment pow{T2};", positional=True)(_pow)
_binary("min", np.fmin)
_binary("max", np.fmax)
_CMP = "(x: tensor<scalar>, y: tensor<scalar>) -> (z: tensor<logical>)"
for _n, _fn in [("lt", np.less), ("gt", np.greater), ("le", np.less_equal), ("ge", np.greater_equal),
                ("eq", np.equal), ("ne", np.not_equal)]:
    _binary(_n, _fn, _CMP)
_LOG = "(x: tensor<logical>, y: tensor<logical>) -> (z: tensor<logical>)"
_binary("and", np.logical_and, _LOG)
_binary("or", np.logical_or, _LOG)


@primitive("fragment select<?>(condition: tensor<logical>, true_value: tensor<?>, false_value: tensor<?>) -> (output: tensor<?>);")
def select(condition: np.ndarray, true_value: np.ndarray, false_value: np.ndarray) -> np.ndarray:
    t, f = _align(true_value, false_value)
    rank = max(condition.ndim, t.ndim, f.ndim)

    def pad(a: np.ndarray) -> np.ndarray:
        return a if a.ndim in (0, rank) else a.reshape(a.shape + (1,) * (rank - a.ndim))
    return np.where(pad(condition.astype(bool, copy=False)), pad(t), pad(f))


@primitive("fragment clamp(x: tensor<scalar>, a: tensor<scalar>, b: tensor<scalar>) -> (y: tensor<scalar>);")
def clamp(x: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    # NNEF: clamp = max(min(x, b), a); tract's min/max ignore NaN (clamp(NaN, 0, 1) = 1, clamp(x, 1, 0) = 1)
    x1, b = _align(x, b)
    y = np.fmin(x1, b)
    y, a = _align(y, a)
    return np.fmax(y, a).astype(x.dtype, copy=False)


@primitive("fragment add_n(x: tensor<scalar>[]) -> (y: tensor<scalar>);")
def add_n(x: list[np.ndarray]) -> np.ndarray:
    out = x[0]
    for t in x[1:]:
        a, b = _align(out, t)
        out = a + b
    return out


# ------------------------------------------------------------------------------------------------
# reductions
# ------------------------------------------------------------------------------------------------
def _reducer(name: str, fn: Any, sig_in: str = "tensor<scalar>", sig_out: str = "tensor<scalar>") -> None:
    def k(input: np.ndarray, axes: Sequence[int] = ()) -> np.ndarray:
        ax = _axes(axes, input.ndim)
        if not ax:
            return input
        return fn(input, axis=ax, keepdims=True)
    k.__name__ = name
    primitive(f"fragment {name}(input: {sig_in}, axes: integer[]) -> (output: {sig_out});")(k)


@primitive("fragment sum_reduce(input: tensor<scalar>, axes: integer[], normalize: logical = false) -> (output: tensor<scalar>);")
def sum_reduce(input: np.ndarray, axes: Sequence[int] = (), normalize: bool = False) -> np.ndarray:
    ax = _axes(axes, input.ndim)
    if not ax:
        return input
    if normalize:
        return np.mean(input, axis=ax, keepdims=True, dtype=input.dtype if input.dtype.kind == "f" else None)
    return np.sum(input, axis=ax, keepdims=True, dtype=input.dtype if input.dtype.kind != "b" else np.int64)


def _mean(x: np.ndarray, axis: tuple[int, ...], keepdims: bool) -> np.ndarray:
    return np.mean(x, axis=axis, keepdims=keepdims).astype(x.dtype if x.dtype.kind == "f" else np.float32)


_reducer("mean_reduce", _mean)
_reducer("max_reduce", np.fmax.reduce)  # NaN ignored, as tract
_reducer("min_reduce", np.fmin.reduce)
_reducer("any_reduce", np.any, "tensor<logical>", "tensor<logical>")
_reducer("all_reduce", np.all, "tensor<logical>", "tensor<logical>")


def _arg(fn: Any) -> Any:
    def k(input: np.ndarray, axes: Sequence[int] = ()) -> np.ndarray:
        ax = _axes(axes, input.ndim)
        if not ax:
            return np.zeros(input.shape, np.int64)
        rest = [a for a in range(input.ndim) if a not in ax]
        moved = np.transpose(input, rest + list(ax))
        flat = moved.reshape(moved.shape[: len(rest)] + (-1,))
        idx = fn(flat, axis=-1).astype(np.int64)
        out_shape = [1 if a in ax else input.shape[a] for a in range(input.ndim)]
        return idx.reshape(out_shape)
    return k


def _nan_ignoring_arg(extreme: Any) -> Any:
    """tract's argmax/argmin: NaN ignored, the first index on ties, 0 for an all-NaN slice (checked against
    tract 0.23.9: argmax [NaN, inf, 1] = 1, [1, NaN, 2] = 2, [NaN, NaN] = 0; argmin [NaN, inf, 1] = 2)."""

    def fn(flat: np.ndarray, axis: int) -> np.ndarray:
        if flat.dtype.kind != "f":
            return (np.argmax if extreme is np.fmax else np.argmin)(flat, axis=axis)
        if flat.shape[axis] == 0:
            return np.argmax(flat, axis=axis)  # numpy's error for an empty slice
        m = extreme.reduce(flat, axis=axis, keepdims=True)  # NaN only when the whole slice is NaN
        return np.argmax(flat == m, axis=axis)

    return fn


primitive("fragment argmax_reduce(input: tensor<scalar>, axes: integer[]) -> (output: tensor<integer>);")(
    _arg(_nan_ignoring_arg(np.fmax)))
primitive("fragment argmin_reduce(input: tensor<scalar>, axes: integer[]) -> (output: tensor<integer>);")(
    _arg(_nan_ignoring_arg(np.fmin)))


@primitive("fragment moments(input: tensor<scalar>, axes: integer[]) -> (mean: tensor<scalar>, variance: tensor<scalar>);")
def moments(input: np.ndarray, axes: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
    ax = _axes(axes, input.ndim)
    m = np.mean(input, axis=ax, keepdims=True).astype(input.dtype)
    v = np.mean((input - m) ** 2, axis=ax, keepdims=True).astype(input.dtype)
    return m, v


@primitive("fragment softmax(x: tensor<scalar>, axes: integer[] = [1]) -> (y: tensor<scalar>);")
def softmax(x: np.ndarray, axes: Sequence[int] = (1,)) -> np.ndarray:
    ax = _axes(axes, x.ndim)
    m = np.max(x, axis=ax, keepdims=True)
    e = np.exp(x - m)
    return e / np.sum(e, axis=ax, keepdims=True)


# ------------------------------------------------------------------------------------------------
# shape and layout
# ------------------------------------------------------------------------------------------------
def _reshape_static(attrs: dict[str, Any]) -> Kernel | None:
    shape = _flatten(attrs.get("shape", ()))
    start, count = attrs.get("axis_start", 0), attrs.get("axis_count", -1)
    if not all(type(d) is int and d > 0 for d in shape) or type(start) is not int or type(count) is not int:
        return None  # 0 (copy a dim) and -1 (infer) depend on the input: the generic kernel
    if start < 0 or count < 0:
        return None
    new, end, generic = tuple(shape), start + count, reshape

    def reshape_static(input: np.ndarray) -> np.ndarray:  # noqa: A002 - NNEF parameter name
        s = input.shape
        if len(s) < end:
            return generic(input, shape=list(new), axis_start=start, axis_count=count)
        try:
            return input.reshape(s[:start] + new + s[end:])
        except (ValueError, AttributeError):
            return generic(input, shape=list(new), axis_start=start, axis_count=count)
    return reshape_static


@primitive("fragment reshape<?>(input: tensor<?>, shape: integer[], axis_start: integer = 0, axis_count: integer = -1) -> (output: tensor<?>);",
           specialize=_reshape_static)
def reshape(input: np.ndarray, shape: Sequence[int] = (), axis_start: int = 0, axis_count: int = -1) -> np.ndarray:
    shape = _flatten(shape)  # tract splices nested arrays: shape = [1, foo, 3] with foo = [1, 2]
    dims = list(input.shape)
    start = axis_start + len(dims) if axis_start < 0 else axis_start
    count = len(dims) - start if axis_count < 0 else axis_count
    new = [dims[start + i] if int(s) == 0 else int(s) for i, s in enumerate(shape)]
    full = dims[:start] + new + dims[start + count:]
    if full.count(-1) == 1:
        known = int(np.prod([d for d in full if d != -1]))
        total = input.size
        i = full.index(-1)
        full[i] = total // known if known else 0
    try:
        return input.reshape(full)
    except ValueError as exc:
        raise GraphError(f"reshape {list(input.shape)} -> {list(shape)}: {exc}") from None


@primitive("fragment squeeze<?>(input: tensor<?>, axes: integer[]) -> (output: tensor<?>);")
def squeeze(input: np.ndarray, axes: Sequence[int] = ()) -> np.ndarray:
    return np.squeeze(input, axis=_axes(axes, input.ndim)) if len(axes) else input


def _unsqueeze_static(attrs: dict[str, Any]) -> Kernel | None:
    axes = attrs.get("axes", ())
    if not axes or not all(type(a) is int and a >= 0 for a in axes) or len(set(axes)) != len(axes):
        return None
    ax, generic = tuple(sorted(axes)), unsqueeze

    def unsqueeze_static(input: np.ndarray) -> np.ndarray:  # noqa: A002
        if type(input) is not np.ndarray or ax[-1] >= input.ndim + len(ax):
            return generic(input, axes=list(axes))
        shape = list(input.shape)
        for a in ax:
            shape.insert(a, 1)
        return input.reshape(shape)
    return unsqueeze_static


@primitive("fragment unsqueeze<?>(input: tensor<?>, axes: integer[]) -> (output: tensor<?>);",
           specialize=_unsqueeze_static)
def unsqueeze(input: np.ndarray, axes: Sequence[int] = ()) -> np.ndarray:
    if not len(axes):
        return input
    rank = input.ndim + len(axes)
    ax = _axes(axes, rank)
    if len(set(ax)) != len(ax) or ax[0] < 0 or ax[-1] >= rank:
        return np.expand_dims(input, ax)  # its error message
    shape = list(input.shape)
    for a in ax:
        shape.insert(a, 1)
    return input.reshape(shape)


def _transpose_static(attrs: dict[str, Any]) -> Kernel | None:
    axes = attrs.get("axes", ())
    if not all(type(a) is int for a in axes):
        return None
    perm, n, generic = tuple(axes), len(axes), transpose

    def transpose_static(input: np.ndarray) -> np.ndarray:  # noqa: A002
        if type(input) is np.ndarray and input.ndim == n:
            return input.transpose(perm)
        return generic(input, axes=list(perm))
    return transpose_static


@primitive("fragment transpose<?>(input: tensor<?>, axes: integer[]) -> (output: tensor<?>);",
           specialize=_transpose_static)
def transpose(input: np.ndarray, axes: Sequence[int] = ()) -> np.ndarray:
    perm = list(axes) + list(range(len(axes), input.ndim))
    return input.transpose(perm)


@primitive("fragment concat<?>(values: tensor<?>[], axis: integer) -> (value: tensor<?>);")
def concat(values: list[np.ndarray], axis: int = 0) -> np.ndarray:
    if len(values) == 1:
        return values[0]
    dt = np.result_type(*values)
    return np.concatenate([v.astype(dt, copy=False) for v in values], axis=axis)


@primitive("fragment stack<?>(values: tensor<?>[], axis: integer) -> (value: tensor<?>);")
def stack(values: list[np.ndarray], axis: int = 0) -> np.ndarray:
    return np.stack(values, axis=axis)


@primitive("fragment unstack<?>(value: tensor<?>, axis: integer) -> (values: tensor<?>[]);")
def unstack(value: np.ndarray, axis: int = 0) -> list[np.ndarray]:
    return [np.take(value, i, axis=axis) for i in range(value.shape[axis])]


@primitive("fragment split<?>(value: tensor<?>, axis: integer, ratios: integer[]) -> (values: tensor<?>[]);")
def split(value: np.ndarray, axis: int = 0, ratios: Sequence[int] = ()) -> list[np.ndarray]:
    total = sum(ratios)
    dim = value.shape[axis]
    if total == 0 or dim % total:
        raise GraphError(f"split: axis size {dim} is not divisible by the ratio sum {total}")
    unit = dim // total
    bounds = np.cumsum([r * unit for r in ratios])[:-1]
    return np.split(value, bounds, axis=axis)


def _slice_bounds(b: int, e: int, s: int, d: int) -> tuple[int, int]:
    if s > 0:
        if b < 0:
            b += d
        if e <= 0 and not (e == 0 and b == 0 and False):
            e = d if e == 0 else e + d
        return max(0, min(b, d)), max(0, min(e, d))
    # negative stride: python semantics with clamping
    if b < 0:
        b += d
    if e < -d:
        e = -1 - d  # until the start
    elif e < 0:
        e += d
    return max(-1, min(b, d - 1)), e


@primitive("fragment slice<?>(input: tensor<?>, axes: integer[], begin: integer[], end: integer[], stride: integer[] = []) -> (output: tensor<?>);")
def slice_(input: np.ndarray, axes: Sequence[int] = (), begin: Sequence[int] = (), end: Sequence[int] = (),
           stride: Sequence[int] = ()) -> np.ndarray:
    idx: list[Any] = [slice(None)] * input.ndim
    for i, a in enumerate(axes):
        a = a + input.ndim if a < 0 else a
        s = int(stride[i]) if i < len(stride) else 1
        d = input.shape[a]
        b, e = _slice_bounds(int(begin[i]), int(end[i]), s, d)
        if s < 0 and e < 0:
            idx[a] = slice(b, None, s)
        else:
            idx[a] = slice(b, e, s)
    return input[tuple(idx)]


_PAD_MODES = {"reflect": "reflect", "replicate": "edge", "reflect-even": "symmetric", "edge": "edge"}


def _pad(x: np.ndarray, pads: Sequence[tuple[int, int]], border: str, value: Any = 0) -> np.ndarray:
    pads = [(int(a), int(b)) for a, b in pads]
    if not any(a or b for a, b in pads):
        return x
    if border in ("constant", "ignore"):
        return np.pad(x, pads, mode="constant", constant_values=value)
    mode = _PAD_MODES.get(border)
    if mode is None:
        raise GraphError(f"unknown border mode {border!r}")
    return np.pad(x, pads, mode=mode)


@primitive("fragment pad(input: tensor<scalar>, padding: (integer, integer)[], border: string = 'constant', value: scalar = 0.0) -> (output: tensor<scalar>);")
def pad(input: np.ndarray, padding: Sequence[Sequence[int]] = (), border: str = "constant", value: float = 0.0) -> np.ndarray:
    pads = [tuple(p) for p in padding] + [(0, 0)] * (input.ndim - len(padding))
    return _pad(input, pads, border, input.dtype.type(value) if input.dtype.kind != "b" else bool(value))


@primitive("fragment tile<?>(input: tensor<?>, repeats: integer[]) -> (output: tensor<?>);")
def tile(input: np.ndarray, repeats: Sequence[int] = ()) -> np.ndarray:
    return np.tile(input, [int(r) for r in repeats])


@primitive("fragment gather<?>(input: tensor<?>, indices: tensor<integer>, axis: integer = 0) -> (output: tensor<?>);")
def gather(input: np.ndarray, indices: np.ndarray, axis: int = 0) -> np.ndarray:
    return np.take(input, indices.astype(np.int64, copy=False), axis=axis)


# ------------------------------------------------------------------------------------------------
# linear algebra
# ------------------------------------------------------------------------------------------------
def _acc(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32) if x.dtype == np.float16 else x


@primitive("fragment matmul(A: tensor<scalar>, B: tensor<scalar>, transposeA: logical = false, transposeB: logical = false) -> (C: tensor<scalar>);")
def matmul(A: np.ndarray, B: np.ndarray, transposeA: bool = False, transposeB: bool = False) -> np.ndarray:
    a = np.swapaxes(A, -1, -2) if transposeA else A
    b = np.swapaxes(B, -1, -2) if transposeB else B
    if A.dtype == np.float16:
        return np.matmul(_acc(a), _acc(b)).astype(np.float16)
    return np.matmul(a, b)


@primitive("fragment linear(input: tensor<scalar>, filter: tensor<scalar>, bias: tensor<scalar> = 0.0) -> (output: tensor<scalar>);")
def linear(input: np.ndarray, filter: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    y = matmul(input, filter, False, True)
    if bias is not None and not (bias.size == 1 and bias.reshape(()).item() == 0):
        a, b = _align(y, bias)
        y = a + b
    return y


# ------------------------------------------------------------------------------------------------
# convolution and windows
# ------------------------------------------------------------------------------------------------
def _auto_pads(sizes: Sequence[int], ks: Sequence[int], stride: Sequence[int], dilation: Sequence[int],
               padding: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    if len(padding):
        return [(int(p[0]), int(p[1])) for p in padding]
    out = []
    for i, k, s, d in zip(sizes, ks, stride, dilation):
        o = -(-i // s)
        total = max(0, (o - 1) * s + (k - 1) * d + 1 - i)
        out.append((total // 2, total - total // 2))
    return out


def _windows(x: np.ndarray, ks: Sequence[int], stride: Sequence[int], dilation: Sequence[int],
             axes: Sequence[int]) -> np.ndarray:
    """View of shape ``x.shape`` (windowed axes -> output sizes) + ``ks``."""
    dk = [(k - 1) * d + 1 for k, d in zip(ks, dilation)]
    win = sliding_window_view(x, dk, axis=tuple(axes))
    sl: list[Any] = [slice(None)] * x.ndim
    for a, s in zip(axes, stride):
        sl[a] = slice(None, None, s)
    sl += [slice(None, None, d) for d in dilation]
    return win[tuple(sl)]


_LETTERS = "pqrstuvw"
_KLETTERS = "ijklmxyz"


def _bias_add(y: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    if bias is None or (bias.size == 1 and bias.reshape(()).item() == 0):
        return y
    b = bias.reshape(-1) if bias.ndim >= 1 else bias
    if b.ndim == 1 and b.size > 1:
        b = b.reshape((1, -1) + (1,) * (y.ndim - 2))
    return y + b.astype(y.dtype)


@primitive("fragment conv(input: tensor<scalar>, filter: tensor<scalar>, bias: tensor<scalar> = 0.0, border: string = 'constant', padding: (integer,integer)[] = [], stride: integer[] = [], dilation: integer[] = [], groups: integer = 1) -> (output: tensor<scalar>);")
def conv(input: np.ndarray, filter: np.ndarray, bias: np.ndarray | None = None, border: str = "constant",
         padding: Sequence[Sequence[int]] = (), stride: Sequence[int] = (), dilation: Sequence[int] = (),
         groups: int = 1) -> np.ndarray:
    dt = input.dtype
    x, w = _acc(input), _acc(filter).astype(_acc(input).dtype, copy=False)
    n, c = x.shape[:2]
    sp = x.ndim - 2
    stride = list(stride) or [1] * sp
    dilation = list(dilation) or [1] * sp
    ks = w.shape[2:]
    pads = _auto_pads(x.shape[2:], ks, stride, dilation, padding)
    xp = _pad(x, [(0, 0), (0, 0)] + pads, "constant" if border == "ignore" else border)
    win = _windows(xp, ks, stride, dilation, range(2, 2 + sp))  # [n, c, *O, *k]
    g = groups or c
    cg, og = c // g, w.shape[0] // g
    win = win.reshape((n, g, cg) + win.shape[2:])
    wg = w.reshape((g, og, cg) + tuple(ks))
    O, K = _LETTERS[:sp], _KLETTERS[:sp]
    y = np.einsum(f"Ngc{O}{K},goc{K}->Ngo{O}", win, wg, optimize=True)
    y = y.reshape((n, g * og) + y.shape[3:])
    return _bias_add(y, bias).astype(dt, copy=False)


def _transposed(x: np.ndarray, w: np.ndarray, stride: Sequence[int], dilation: Sequence[int], groups: int) -> np.ndarray:
    """Full (uncropped) transposed convolution. ``w`` is ``[C_out, C_in/groups, *k]``: tract reads deconv
    filters with the input channels on the second axis, like conv filters (checked with tract 0.23.9)."""
    n, c = x.shape[:2]
    sp = x.ndim - 2
    ks = w.shape[2:]
    g = groups or c
    cg = c // g
    og = w.shape[0] // g
    full = [(i - 1) * s + (k - 1) * d + 1 for i, k, s, d in zip(x.shape[2:], ks, stride, dilation)]
    out = np.zeros((n, g, og, *full), dtype=x.dtype)
    xg = x.reshape((n, g, cg) + x.shape[2:])
    wg = w.reshape((g, og, cg) + tuple(ks))
    O = _LETTERS[:sp]
    for kpos in np.ndindex(*ks):
        contrib = np.einsum(f"Ngc{O},goc->Ngo{O}", xg, wg[(slice(None), slice(None), slice(None)) + kpos])
        sl = tuple(slice(kp * d, kp * d + (i - 1) * s + 1, s)
                   for kp, d, i, s in zip(kpos, dilation, x.shape[2:], stride))
        out[(slice(None), slice(None), slice(None)) + sl] += contrib
    return out.reshape((n, g * og, *full))


def _crop(y: np.ndarray, first: int, pads: list[tuple[int, int]], out_sizes: list[int] | None) -> np.ndarray:
    sl: list[Any] = [slice(None)] * first
    for a, (p0, p1) in enumerate(pads):
        full = y.shape[first + a]
        size = out_sizes[a] if out_sizes else full - p0 - p1
        sl.append(slice(p0, p0 + size))
    z = y[tuple(sl)]
    if out_sizes and list(z.shape[first:]) != list(out_sizes):
        extra = [(0, 0)] * first + [(0, o - s) for o, s in zip(out_sizes, z.shape[first:])]
        z = np.pad(z, extra)
    return z


def _deconv_pads(in_sizes: Sequence[int], ks: Sequence[int], stride: Sequence[int], dilation: Sequence[int],
                 padding: Sequence[Sequence[int]], out_sizes: list[int] | None) -> list[tuple[int, int]]:
    if len(padding):
        return [(int(p[0]), int(p[1])) for p in padding]
    pads = []
    for a, (i, k, s, d) in enumerate(zip(in_sizes, ks, stride, dilation)):
        full = (i - 1) * s + (k - 1) * d + 1
        o = out_sizes[a] if out_sizes else i * s
        total = max(0, full - o)
        pads.append((total // 2, total - total // 2))
    return pads


@primitive("fragment deconv(input: tensor<scalar>, filter: tensor<scalar>, bias: tensor<scalar> = 0.0, border: string = 'constant', padding: (integer,integer)[] = [], stride: integer[] = [], dilation: integer[] = [], output_shape: integer[] = [], groups: integer = 1) -> (output: tensor<scalar>);")
def deconv(input: np.ndarray, filter: np.ndarray, bias: np.ndarray | None = None, border: str = "constant",
           padding: Sequence[Sequence[int]] = (), stride: Sequence[int] = (), dilation: Sequence[int] = (),
           output_shape: Sequence[int] = (), groups: int = 1) -> np.ndarray:
    dt = input.dtype
    x, w = _acc(input), _acc(filter)
    sp = x.ndim - 2
    stride = list(stride) or [1] * sp
    dilation = list(dilation) or [1] * sp
    out_sizes = [int(o) for o in output_shape[2:]] if len(output_shape) else None
    y = _transposed(x, w.astype(x.dtype, copy=False), stride, dilation, groups)
    pads = _deconv_pads(x.shape[2:], w.shape[2:], stride, dilation, padding, out_sizes)
    y = _crop(y, 2, pads, out_sizes)
    return _bias_add(y, bias).astype(dt, copy=False)


def _pool(x: np.ndarray, size: Sequence[int], border: str, padding: Sequence[Sequence[int]], stride: Sequence[int],
          dilation: Sequence[int], pad_value: Any) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Windows over every axis. Like tract, the window, stride, dilation and padding of the first two
    axes (batch, channel) are ignored: tract pools over the spatial axes only (checked with 0.23.9:
    ``box(x, size = [1, 3, 1, 1])`` returns ``x``)."""
    r = x.ndim
    size = [1, 1][: min(2, r)] + [int(s) for s in size][2:]
    stride = ([1, 1][: min(2, r)] + list(stride)[2:]) if len(stride) else [1] * r
    dilation = ([1, 1][: min(2, r)] + list(dilation)[2:]) if len(dilation) else [1] * r
    if len(padding):
        padding = [(0, 0)] * min(2, r) + [tuple(p) for p in padding][2:]
    pads = _auto_pads(x.shape, size, stride, dilation, padding)
    if border in ("constant", "ignore"):
        xp = np.pad(x, pads, mode="constant", constant_values=pad_value) if any(a or b for a, b in pads) else x
    else:
        xp = _pad(x, pads, border)
    return _windows(xp, size, stride, dilation, range(r)), pads


def _counts(x: np.ndarray, size: Sequence[int], padding: Any, stride: Sequence[int], dilation: Sequence[int]) -> np.ndarray:
    ones = np.ones(x.shape, np.float32)
    win, _ = _pool(ones, size, "constant", padding, stride, dilation, 0)
    return win.sum(axis=tuple(range(x.ndim, 2 * x.ndim)))


def _window_size(size: Sequence[int]) -> float:
    return float(np.prod([int(s) for s in size][2:])) if len(size) > 2 else 1.0


@primitive("fragment box(input: tensor<scalar>, size: integer[], border: string = 'constant', padding: (integer,integer)[] = [], stride: integer[] = [], dilation: integer[] = [], normalize: logical = false) -> (output: tensor<scalar>);")
def box(input: np.ndarray, size: Sequence[int] = (), border: str = "constant", padding: Any = (),
        stride: Sequence[int] = (), dilation: Sequence[int] = (), normalize: bool = False) -> np.ndarray:
    win, _ = _pool(input, size, border, padding, stride, dilation, 0)
    r = input.ndim
    y = win.sum(axis=tuple(range(r, 2 * r)), dtype=_acc(input).dtype)
    if normalize:
        if border == "ignore":
            y = y / _counts(input, size, padding, stride, dilation)
        else:
            y = y / _window_size(size)
    return y.astype(input.dtype, copy=False)


@primitive("fragment debox(input: tensor<scalar>, size: integer[], border: string = 'constant', padding: (integer,integer)[] = [], stride: integer[] = [], dilation: integer[] = [], output_shape: integer[] = [], normalize: logical = false) -> (output: tensor<scalar>);")
def debox(input: np.ndarray, size: Sequence[int] = (), border: str = "constant", padding: Any = (),
          stride: Sequence[int] = (), dilation: Sequence[int] = (), output_shape: Sequence[int] = (),
          normalize: bool = False) -> np.ndarray:
    r = input.ndim
    size = [int(s) for s in size]
    stride = list(stride) or [1] * r
    dilation = list(dilation) or [1] * r
    x = _acc(input)
    full = [(i - 1) * s + (k - 1) * d + 1 for i, k, s, d in zip(x.shape, size, stride, dilation)]
    out = np.zeros(full, dtype=x.dtype)
    for kpos in np.ndindex(*size):
        sl = tuple(slice(kp * d, kp * d + (i - 1) * s + 1, s) for kp, d, i, s in zip(kpos, dilation, x.shape, stride))
        out[sl] += x
    if normalize:
        out = out / float(np.prod(size))
    out_sizes = [int(o) for o in output_shape] if len(output_shape) else None
    pads = _deconv_pads(x.shape, size, stride, dilation, padding, out_sizes)
    return _crop(out, 0, pads, out_sizes).astype(input.dtype, copy=False)


_POOL_SIG = "(input: tensor<scalar>, size: integer[], border: string = 'constant', padding: (integer,integer)[] = [], stride: integer[] = [], dilation: integer[] = [])"


@primitive(f"fragment max_pool{_POOL_SIG} -> (output: tensor<scalar>);")
def max_pool(input: np.ndarray, size: Sequence[int] = (), border: str = "constant", padding: Any = (),
             stride: Sequence[int] = (), dilation: Sequence[int] = ()) -> np.ndarray:
    # tract never lets padding win a max, whatever the border: pad with the lowest value
    fill = -np.inf if input.dtype.kind == "f" else np.iinfo(input.dtype).min if input.dtype.kind in "iu" else 0
    win, _ = _pool(input, size, "constant" if border == "ignore" else border, padding, stride, dilation, fill)
    r = input.ndim
    return win.max(axis=tuple(range(r, 2 * r)))


@primitive(f"fragment argmax_pool{_POOL_SIG} -> (index: tensor<integer>);")
def argmax_pool(input: np.ndarray, size: Sequence[int] = (), border: str = "constant", padding: Any = (),
                stride: Sequence[int] = (), dilation: Sequence[int] = ()) -> np.ndarray:
    """Index of the maximum within each window, flattened over the window (row-major)."""
    fill = -np.inf if border == "ignore" and input.dtype.kind == "f" else 0
    win, _ = _pool(input, size, border, padding, stride, dilation, fill)
    r = input.ndim
    flat = win.reshape(win.shape[:r] + (-1,))
    return np.argmax(flat, axis=-1).astype(np.int64)


@primitive(f"fragment max_pool_with_index{_POOL_SIG} -> (output: tensor<scalar>, index: tensor<integer>);")
def max_pool_with_index(input: np.ndarray, **kw: Any) -> tuple[np.ndarray, np.ndarray]:
    return max_pool(input, **kw), argmax_pool(input, **kw)


@primitive(f"fragment avg_pool{_POOL_SIG} -> (output: tensor<scalar>);")
def avg_pool(input: np.ndarray, size: Sequence[int] = (), border: str = "constant", padding: Any = (),
             stride: Sequence[int] = (), dilation: Sequence[int] = ()) -> np.ndarray:
    return box(input, size, border, padding, stride, dilation, True)


@primitive(f"fragment rms_pool{_POOL_SIG} -> (output: tensor<scalar>);")
def rms_pool(input: np.ndarray, size: Sequence[int] = (), border: str = "constant", padding: Any = (),
             stride: Sequence[int] = (), dilation: Sequence[int] = ()) -> np.ndarray:
    return np.sqrt(box(input * input, size, border, padding, stride, dilation, True))


@primitive("fragment separable_conv(input: tensor<scalar>, plane_filter: tensor<scalar>, point_filter: tensor<scalar>, bias: tensor<scalar> = 0.0, border: string = 'constant', padding: (integer,integer)[] = [], stride: integer[] = [], dilation: integer[] = [], groups: integer = 1) -> (output: tensor<scalar>);")
def separable_conv(input: np.ndarray, plane_filter: np.ndarray, point_filter: np.ndarray, bias: np.ndarray | None = None,
                   border: str = "constant", padding: Any = (), stride: Sequence[int] = (),
                   dilation: Sequence[int] = (), groups: int = 1) -> np.ndarray:
    filtered = conv(input, plane_filter, None, border, padding, stride, dilation, 0)
    return conv(filtered, point_filter, bias, groups=groups)


@primitive("fragment separable_deconv(input: tensor<scalar>, plane_filter: tensor<scalar>, point_filter: tensor<scalar>, bias: tensor<scalar> = 0.0, border: string = 'constant', padding: (integer,integer)[] = [], stride: integer[] = [], dilation: integer[] = [], output_shape: integer[] = [], groups: integer = 1) -> (output: tensor<scalar>);")
def separable_deconv(input: np.ndarray, plane_filter: np.ndarray, point_filter: np.ndarray,
                     bias: np.ndarray | None = None, border: str = "constant", padding: Any = (),
                     stride: Sequence[int] = (), dilation: Sequence[int] = (), output_shape: Sequence[int] = (),
                     groups: int = 1) -> np.ndarray:
    filtered = deconv(input, point_filter, None, groups=groups)
    return deconv(filtered, plane_filter, bias, border, padding, stride, dilation, output_shape, 0)


# ------------------------------------------------------------------------------------------------
# normalization
# ------------------------------------------------------------------------------------------------
@primitive("fragment local_response_normalization(input: tensor<scalar>, size: integer[], alpha: scalar = 1.0, beta: scalar = 0.5, bias: scalar = 1.0) -> (output: tensor<scalar>);")
def local_response_normalization(input: np.ndarray, size: Sequence[int] = (), alpha: float = 1.0, beta: float = 0.5,
                                 bias: float = 1.0) -> np.ndarray:
    t = input.dtype.type
    sigma = t(bias) + t(alpha) * box(input * input, size, normalize=True)
    return (input / sigma ** t(beta)).astype(input.dtype, copy=False)


@primitive("fragment local_mean_normalization(input: tensor<scalar>, size: integer[]) -> (output: tensor<scalar>);")
def local_mean_normalization(input: np.ndarray, size: Sequence[int] = ()) -> np.ndarray:
    return input - box(input, size, normalize=True)


@primitive("fragment local_variance_normalization(input: tensor<scalar>, size: integer[], bias: scalar = 0.0, epsilon: scalar = 0.0) -> (output: tensor<scalar>);")
def local_variance_normalization(input: np.ndarray, size: Sequence[int] = (), bias: float = 0.0,
                                 epsilon: float = 0.0) -> np.ndarray:
    t = input.dtype.type
    sigma = np.sqrt(box(input * input, size, normalize=True))
    return input / np.fmax(sigma + t(bias), t(epsilon))


@primitive("fragment local_contrast_normalization(input: tensor<scalar>, size: integer[], bias: scalar = 0.0, epsilon: scalar = 0.0) -> (output: tensor<scalar>);")
def local_contrast_normalization(input: np.ndarray, size: Sequence[int] = (), bias: float = 0.0,
                                 epsilon: float = 0.0) -> np.ndarray:
    return local_variance_normalization(local_mean_normalization(input, size), size, bias, epsilon)


@primitive("fragment l1_normalization(input: tensor<scalar>, axes: integer[], bias: scalar = 0.0, epsilon: scalar = 0.0) -> (output: tensor<scalar>);")
def l1_normalization(input: np.ndarray, axes: Sequence[int] = (), bias: float = 0.0, epsilon: float = 0.0) -> np.ndarray:
    t = input.dtype.type
    sigma = np.sum(np.abs(input), axis=_axes(axes, input.ndim), keepdims=True)
    return input / np.fmax(sigma + t(bias), t(epsilon))


@primitive("fragment l2_normalization(input: tensor<scalar>, axes: integer[], bias: scalar = 0.0, epsilon: scalar = 0.0) -> (output: tensor<scalar>);")
def l2_normalization(input: np.ndarray, axes: Sequence[int] = (), bias: float = 0.0, epsilon: float = 0.0) -> np.ndarray:
    t = input.dtype.type
    sigma = np.sqrt(np.sum(input * input, axis=_axes(axes, input.ndim), keepdims=True))
    return input / np.fmax(sigma + t(bias), t(epsilon))


@primitive("fragment batch_normalization(input: tensor<scalar>, mean: tensor<scalar>, variance: tensor<scalar>, offset: tensor<scalar>, scale: tensor<scalar>, epsilon: scalar) -> (output: tensor<scalar>);")
def batch_normalization(input: np.ndarray, mean: np.ndarray, variance: np.ndarray, offset: np.ndarray,
                        scale: np.ndarray, epsilon: float = 0.0) -> np.ndarray:
    t = input.dtype.type
    x, m = _align(input, mean)
    _, v = _align(input, variance)
    _, o = _align(input, offset)
    _, s = _align(input, scale)
    return (o + s * (x - m) / np.sqrt(v + t(epsilon))).astype(input.dtype, copy=False)


# ------------------------------------------------------------------------------------------------
# resize
# ------------------------------------------------------------------------------------------------
@primitive("fragment nearest_downsample(input: tensor<scalar>, factor: integer[]) -> (output: tensor<scalar>);")
def nearest_downsample(input: np.ndarray, factor: Sequence[int] = ()) -> np.ndarray:
    sl = (slice(None), slice(None)) + tuple(slice(None, None, int(f)) for f in factor)
    return input[sl]


@primitive("fragment area_downsample(input: tensor<scalar>, factor: integer[]) -> (output: tensor<scalar>);")
def area_downsample(input: np.ndarray, factor: Sequence[int] = ()) -> np.ndarray:
    f = [int(x) for x in factor]
    dims = 2 + len(f)
    return box(input, [1, 1] + f, "constant", [(0, 0)] * dims, [1, 1] + f, (), True)


@primitive("fragment nearest_upsample(input: tensor<scalar>, factor: integer[]) -> (output: tensor<scalar>);")
def nearest_upsample(input: np.ndarray, factor: Sequence[int] = ()) -> np.ndarray:
    y = input
    for a, f in enumerate(factor):
        y = np.repeat(y, int(f), axis=2 + a)
    return y


def _linear_weights(f: int, method: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per output phase ``p`` in [0, f): source offsets (i0, i1 relative to the input index) and weight of i1."""
    p = np.arange(f)
    if method == "aligned":
        raise GraphError("multilinear_upsample: method 'aligned' is handled separately")
    if method == "asymmetric":
        src = p / f
    else:  # symmetric
        src = (p + 0.5) / f - 0.5
    i0 = np.floor(src).astype(np.int64)
    w1 = (src - i0).astype(np.float64)
    return i0, i0 + 1, w1


@primitive("fragment multilinear_upsample(input: tensor<scalar>, factor: integer[], method: string = 'symmetric', border: string = 'replicate') -> (output: tensor<scalar>);")
def multilinear_upsample(input: np.ndarray, factor: Sequence[int] = (), method: str = "symmetric",
                         border: str = "replicate") -> np.ndarray:
    y = input.astype(np.float64)
    for a, f in enumerate(int(x) for x in factor):
        axis = 2 + a
        n = y.shape[axis]
        out_n = n * f
        o = np.arange(out_n)
        if method == "aligned":
            src = o * (n - 1) / (out_n - 1) if out_n > 1 else np.zeros(out_n)
        elif method == "asymmetric":
            src = o / f
        else:
            src = (o + 0.5) / f - 0.5
        i0 = np.floor(src).astype(np.int64)
        w1 = src - i0
        i1 = i0 + 1

        def fetch(idx: np.ndarray) -> np.ndarray:
            inside = (idx >= 0) & (idx < n)
            vals = np.take(y, np.clip(idx, 0, n - 1), axis=axis)
            if border == "constant":
                shape = [1] * y.ndim
                shape[axis] = out_n
                vals = vals * inside.reshape(shape)
            return vals
        shape = [1] * y.ndim
        shape[axis] = out_n
        w = w1.reshape(shape)
        y = fetch(i0) * (1 - w) + fetch(i1) * w
    return y.astype(input.dtype)


# ------------------------------------------------------------------------------------------------
# quantization
# ------------------------------------------------------------------------------------------------
@primitive("fragment linear_quantize(x: tensor<scalar>, min: tensor<scalar>, max: tensor<scalar>, bits: integer) -> (y: tensor<scalar>);")
def linear_quantize(x: np.ndarray, min: np.ndarray, max: np.ndarray, bits: int = 8) -> np.ndarray:
    t = x.dtype.type
    z = np.fmin(np.fmax(x, min.astype(x.dtype)), max.astype(x.dtype))
    r = t(2 ** bits - 1)
    lo, hi = min.astype(x.dtype), max.astype(x.dtype)
    q = _round((z - lo) / (hi - lo) * r)
    return (q / r * (hi - lo) + lo).astype(x.dtype)


@primitive("fragment logarithmic_quantize(x: tensor<scalar>, max: tensor<scalar>, bits: integer) -> (y: tensor<scalar>);")
def logarithmic_quantize(x: np.ndarray, max: np.ndarray, bits: int = 8) -> np.ndarray:
    m = np.ceil(np.log2(max.astype(np.float64)))
    with np.errstate(divide="ignore"):
        lg = np.log2(np.abs(x.astype(np.float64)))
    q = _round(np.clip(lg, m - 2 ** bits + 1, m))
    return np.where(x == 0, 0, np.sign(x) * 2.0 ** q).astype(x.dtype)


@primitive("fragment min_max_linear_quantize(x: tensor<scalar>, min: tensor<scalar>, max: tensor<scalar>, bits: integer, signed: logical, symmetric: logical) -> (y: tensor<scalar>);")
def min_max_linear_quantize(x: np.ndarray, min: np.ndarray, max: np.ndarray, bits: int = 8, signed: bool = True,
                            symmetric: bool = False) -> np.ndarray:
    xx = x.astype(np.float64)
    lo, hi = min.astype(np.float64), max.astype(np.float64)
    r = float(2 ** bits - 1 - int(signed and symmetric))
    z = np.fmin(np.fmax(xx, lo), hi)
    p = float(2 ** (bits - 1) - int(symmetric)) if signed else 0.0
    q = _round((z - lo) / (hi - lo) * r) - p
    return ((q + p) / r * (hi - lo) + lo).astype(x.dtype)


@primitive("fragment zero_point_linear_quantize(x: tensor<scalar>, zero_point: integer, scale: scalar, bits: integer, signed: logical, symmetric: logical) -> (y: tensor<scalar>);")
def zero_point_linear_quantize(x: np.ndarray, zero_point: int = 0, scale: float = 1.0, bits: int = 8,
                               signed: bool = True, symmetric: bool = False) -> np.ndarray:
    zp = float(np.asarray(zero_point).reshape(-1)[0]) if np.ndim(zero_point) else float(zero_point)
    sc = float(np.asarray(scale).reshape(-1)[0]) if np.ndim(scale) else float(scale)
    z = zp
    if signed:
        lo, hi = -(2 ** (bits - 1)) + int(symmetric), 2 ** (bits - 1) - 1
    else:
        lo, hi = 0, 2 ** bits - 1 - int(symmetric)
    q = np.clip(_round(x.astype(np.float64) / sc + z), lo, hi)
    return ((q - z) * sc).astype(x.dtype)


# ------------------------------------------------------------------------------------------------
# sources (handled by the graph builder; registered for their signatures)
# ------------------------------------------------------------------------------------------------
source("fragment external<? = scalar>(shape: integer[]) -> (output: tensor<?>);",
       describe="a graph input")
source("fragment variable<? = scalar>(shape: integer[], label: string) -> (output: tensor<?>);",
       describe="a stored tensor (a .dat file)")
source("fragment constant<? = scalar>(shape: integer[], value: ?[]) -> (output: tensor<?>);",
       describe="a literal tensor")



# ------------------------------------------------------------------------------------------------
# facts (registry.FACTS): what tools ask of these ops, declared here rather than listed where used
# ------------------------------------------------------------------------------------------------
def _quotient(a: float, b: float) -> float | None:
    return a / b if b != 0 else None


def _scalar_sqrt(v: float) -> float | None:
    return math.sqrt(v) if v >= 0 else None


def _scalar_rsqrt(v: float) -> float | None:
    return 1.0 / math.sqrt(v) if v > 0 else None


def _scalar_rcp(v: float) -> float | None:
    return 1.0 / v if v != 0 else None


declare("external", "input")
for _op in ("reshape", "squeeze", "unsqueeze"):
    declare(_op, "view")
for _op in ("reshape", "transpose"):
    declare(_op, "numpy_view")
declare("copy", "passthrough")
for _op in ("unsqueeze", "tile", "reshape"):
    declare(_op, "kv_expand")
declare("softmax", "softmax")
declare("gather", "gather", "fresh")
for _op in ("cos", "sin", "exp"):
    declare(_op, "fresh")
for _op, _fn in (("add", lambda a, b: a + b), ("sub", lambda a, b: a - b), ("mul", lambda a, b: a * b),
                 ("div", _quotient)):
    declare(_op, "fresh", scalar=_fn)
for _op, _fn in (("sqrt", _scalar_sqrt), ("rsqrt", _scalar_rsqrt), ("neg", lambda v: -v), ("rcp", _scalar_rcp),
                 ("recip", _scalar_rcp)):
    declare(_op, scalar=_fn)
for _op in ("slice", "squeeze", "unsqueeze", "reshape", "add", "sub", "mul", "div", "min", "max", "select", "lt",
            "gt", "le", "ge", "eq", "ne", "and", "or", "not", "neg", "abs", "sign", "floor", "ceil", "round", "tile",
            "concat", "stack", "transpose"):
    declare(_op, "memo")
for _op in ("conv", "deconv", "linear"):
    declare(_op, "quantized_bias")
