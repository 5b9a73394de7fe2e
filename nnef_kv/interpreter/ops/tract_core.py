"""Kernels of tract's ``tract_core_*`` operations (registry ``tract_core``), plus ``tract_onnx_non_zero``.

Semantics follow tract (``sonos/tract`` ``nnef/src/ops/core/*.rs`` for the NNEF signatures, ``core/src/ops``
for the evaluation), checked against tract 0.23.9 in ``tests/oracle/test_tract_ops.py``. Signatures are NNEF
fragment declarations matching tract's ``register_primitive`` calls; where tract reads a parameter as
optional although its declaration has no default, the declaration below gives the neutral default
(documented on each op).

Float precision: f16 inputs are computed in f32 and rounded back to f16 where tract does so
(rms_norm, softmax, gelu_approx, silu, erf); f32 in f32.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from ...errors import GraphError, InputError
from ...core.registry import Kernel, declare, primitive, source
from ...core.coerce import as_float, as_int, as_int_list, float_compute_dtype, norm_axis, parse_datum_type

REG = "tract_core"

source("fragment tract_core_external<?>(datum_type: string, shape: integer[]) -> (output: tensor<?>);", REG,
       describe="a graph input of a tract datum type")
_F32 = np.dtype(np.float32)


# ----------------------------------------------------------------------------------------------
# Casts and plumbing
# ----------------------------------------------------------------------------------------------
def cast_array(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Cast as tract's ``Cast`` does: floats to ints truncate toward zero and saturate (Rust ``as``),
    NaN becomes 0; anything to bool is ``!= 0``; bool to numbers is 0/1."""
    x = np.asarray(x)
    dtype = np.dtype(dtype)
    if x.dtype == dtype:
        return x.copy()
    if dtype == np.bool_:
        return x != 0
    if x.dtype.kind == "f" and dtype.kind in "iu":
        info = np.iinfo(dtype)
        with np.errstate(invalid="ignore"):
            t = np.trunc(x.astype(np.float64))
            t = np.where(np.isnan(t), 0.0, t)
            t = np.clip(t, float(info.min), float(info.max))
        out = t.astype(dtype)
        # float64 cannot hold i64/u64 extremes exactly: saturate those by hand
        out = np.where(t >= float(info.max), info.max, out).astype(dtype)
        return out
    with np.errstate(over="ignore", invalid="ignore"):
        return x.astype(dtype)


@primitive(
    'fragment tract_core_cast(input: tensor<scalar>, to: string = "") -> (output: tensor<scalar>);',
    REG,
)
def tract_core_cast(input: np.ndarray, *, to: str = "") -> np.ndarray:
    """``to`` is a tract datum type name. tract also accepts no ``to`` when graph.quant gives the
    type; that case needs the graph builder to pass ``to`` (declared default "" = absent)."""
    if not to:
        raise GraphError("tract_core_cast without 'to' needs the target type from graph.quant")
    return cast_array(input, parse_datum_type(to, where="tract_core_cast"))


@primitive(
    "fragment tract_core_shape_of(input: tensor<scalar>) -> (output: tensor<integer>);",
    REG,
)
def tract_core_shape_of(input: np.ndarray) -> np.ndarray:
    return np.asarray(np.shape(input), dtype=np.int64)


@primitive(
    "fragment tract_core_range(start: integer, end: integer, step: integer) -> (output: tensor<scalar>);",
    REG,
)
def tract_core_range(*, start: Any, end: Any, step: Any) -> np.ndarray:
    """``start, start+step, ...`` below ``end``; length ``ceil((end-start)/step)``, values accumulated
    by repeated addition in the start's type (as tract does). Integer arguments give i64, decimal
    literals (Python floats) f32."""
    s = np.asarray(start)
    if s.dtype.kind in "iub" or isinstance(start, (int, np.integer)):
        a, b, c = as_int(start, what="range start"), as_int(end, what="range end"), as_int(step, what="range step")
        if c == 0:
            raise GraphError("tract_core_range: step is 0")
        n = -(-abs(b - a) // abs(c))  # tract: |end-start| divceil |step|
        dt = s.dtype if s.dtype.kind in "iu" else np.dtype(np.int64)
        return (a + c * np.arange(n, dtype=np.int64)).astype(dt)
    # a Python float is an NNEF decimal literal: f32, as tract reads it
    dt = np.dtype(np.float32) if isinstance(start, float) else s.dtype
    a, b, c = (np.asarray(v).astype(dt).reshape(()) for v in (start, end, step))
    n = int(math.ceil((float(b) - float(a)) / float(c)))
    n = max(n, 0)
    seq = np.empty(n, dtype=dt)
    if n:
        seq[0] = a
        seq[1:] = c
        seq = np.cumsum(seq, dtype=dt)  # sequential accumulation in the start's type
    return seq


@primitive(
    "fragment tract_core_dyn_slice(input: tensor<scalar>, start: integer, end: integer, len: integer,"
    " axis: integer) -> (output: tensor<scalar>);",
    REG,
)
def tract_core_dyn_slice(input: np.ndarray, *, start: Any, end: Any, len: Any = None, axis: int) -> np.ndarray:
    """``input[start:end]`` along ``axis`` (start/end are run-time values; ``len`` is a shape hint,
    often a symbol, and is not needed to evaluate)."""
    x = np.asarray(input)
    ax = norm_axis(as_int(axis), x.ndim)
    b, e = as_int(start, what="dyn_slice start"), as_int(end, what="dyn_slice end")
    if not 0 <= b <= e <= x.shape[ax]:
        raise GraphError(f"tract_core_dyn_slice: range {b}..{e} outside axis {ax} of length {x.shape[ax]}")
    idx = [slice(None)] * x.ndim
    idx[ax] = slice(b, e)
    return x[tuple(idx)].copy()


@primitive(
    "fragment tract_core_broadcast(input: tensor<scalar>, shape: integer[]) -> (output: tensor<scalar>);",
    REG,
)
def tract_core_broadcast(input: np.ndarray, *, shape: Sequence[Any]) -> np.ndarray:
    x = np.asarray(input)
    target = tuple(as_int_list(shape, what="broadcast shape"))
    try:
        out_shape = np.broadcast_shapes(x.shape, target)
    except ValueError as exc:
        raise GraphError(f"tract_core_broadcast: cannot broadcast {x.shape} to {list(target)}") from exc
    return np.array(np.broadcast_to(x, out_shape))


@primitive(
    "fragment tract_core_downsample(input: tensor<scalar>, axis: integer, stride: integer,"
    " modulo: integer = 0) -> (output: tensor<scalar>);",
    REG,
)
def tract_core_downsample(input: np.ndarray, *, axis: int, stride: int, modulo: int = 0) -> np.ndarray:
    x = np.asarray(input)
    ax = norm_axis(axis, x.ndim)
    idx = [slice(None)] * x.ndim
    stride = int(stride)
    if stride > 0:
        idx[ax] = slice(int(modulo), None, stride)
    else:
        idx[ax] = slice(x.shape[ax] - 1 - int(modulo), None, stride)
    return x[tuple(idx)].copy()


# ----------------------------------------------------------------------------------------------
# Gathers and scatters
# ----------------------------------------------------------------------------------------------
def _index_array(indices: np.ndarray, dim: int, what: str) -> np.ndarray:
    idx = np.asarray(indices)
    idx = idx if idx.dtype == np.int64 else cast_array(idx, np.dtype(np.int64))
    if idx.size and idx.min() < 0:
        idx = np.where(idx < 0, idx + dim, idx)
    if idx.size and (idx.min() < 0 or idx.max() >= dim):
        raise InputError(f"{what}: index out of range for an axis of length {dim}")
    return idx


@primitive(
    "fragment tract_core_gather(input: tensor<scalar>, indices: tensor<scalar>, axis: integer,"
    ' datum_type: string = "") -> (output: tensor<scalar>);',
    REG,
)
def tract_core_gather(input: np.ndarray, indices: np.ndarray, *, axis: int, datum_type: str = "") -> np.ndarray:
    """ONNX-style Gather; indices are cast to i64, negative ones count from the end.
    ``datum_type`` (written by tract only for an explicit output type) casts the result."""
    x = np.asarray(input)
    ax = norm_axis(axis, x.ndim)
    idx = _index_array(indices, x.shape[ax], "tract_core_gather")
    out = np.take(x, idx, axis=ax)
    if datum_type:
        out = cast_array(out, parse_datum_type(datum_type, where="tract_core_gather"))
    return out


@primitive(
    "fragment tract_core_gather_elements(input: tensor<scalar>, indices: tensor<scalar>, axis: integer)"
    " -> (output: tensor<scalar>);",
    REG,
)
def tract_core_gather_elements(input: np.ndarray, indices: np.ndarray, *, axis: int) -> np.ndarray:
    x = np.asarray(input)
    ax = norm_axis(axis, x.ndim)
    idx = _index_array(indices, x.shape[ax], "tract_core_gather_elements")
    return np.take_along_axis(x, idx, axis=ax)


@primitive(
    "fragment tract_core_gather_nd(input: tensor<scalar>, indices: tensor<scalar>, batch_dims: integer)"
    " -> (output: tensor<scalar>);",
    REG,
)
def tract_core_gather_nd(input: np.ndarray, indices: np.ndarray, *, batch_dims: int) -> np.ndarray:
    """ONNX GatherND: the last axis of ``indices`` addresses the leading axes of ``input`` after
    ``batch_dims`` shared batch axes."""
    x = np.asarray(input)
    idx = cast_array(np.asarray(indices), np.dtype(np.int64))
    b = int(batch_dims)
    k = idx.shape[-1]
    batch_shape = x.shape[:b]
    nb = int(np.prod(batch_shape, dtype=np.int64))
    xb = x.reshape((nb,) + x.shape[b:])
    ib = idx.reshape((nb, -1, k))
    outs = []
    for i in range(nb):
        coords = ib[i]
        dims = np.asarray(xb.shape[1 : 1 + k])
        coords = np.where(coords < 0, coords + dims, coords)
        outs.append(xb[i][tuple(coords.T)])
    out = np.stack(outs) if outs else np.zeros((0,) + x.shape[b + k :], x.dtype)
    return out.reshape(idx.shape[:-1] + x.shape[b + k :])


def _reduce_into(data: np.ndarray, where: tuple, updates: np.ndarray, reduction: str) -> None:
    if reduction == "none":
        data[where] = updates
    elif reduction == "add":
        np.add.at(data, where, updates)
    elif reduction == "mul":
        np.multiply.at(data, where, updates)
    elif reduction == "min":
        np.minimum.at(data, where, updates)
    elif reduction == "max":
        np.maximum.at(data, where, updates)
    else:
        raise GraphError(f"unknown scatter reduction {reduction!r}")


@primitive(
    "fragment tract_core_scatter_elements(input: tensor<scalar>, indices: tensor<scalar>, updates: tensor<scalar>,"
    ' axis: integer, reduction: string = "none") -> (output: tensor<scalar>);',
    REG,
)
def tract_core_scatter_elements(
    input: np.ndarray, indices: np.ndarray, updates: np.ndarray, *, axis: int, reduction: str = "none"
) -> np.ndarray:
    data = np.array(input, copy=True)
    ax = norm_axis(axis, data.ndim)
    idx = _index_array(indices, data.shape[ax], "tract_core_scatter_elements")
    upd = np.asarray(updates, dtype=data.dtype)
    grids = list(np.indices(idx.shape, sparse=True))
    grids[ax] = idx
    _reduce_into(data, tuple(grids), upd, reduction)
    return data


@primitive(
    "fragment tract_core_scatter_nd(input: tensor<scalar>, indices: tensor<scalar>, updates: tensor<scalar>,"
    ' reduction: string = "none") -> (output: tensor<scalar>);',
    REG,
)
def tract_core_scatter_nd(
    input: np.ndarray, indices: np.ndarray, updates: np.ndarray, *, reduction: str = "none"
) -> np.ndarray:
    """ONNX ScatterND: ``indices[..., :k]`` address the first ``k`` axes of ``input``."""
    data = np.array(input, copy=True)
    idx = cast_array(np.asarray(indices), np.dtype(np.int64))
    k = idx.shape[-1]
    flat = idx.reshape(-1, k)
    dims = np.asarray(data.shape[:k])
    flat = np.where(flat < 0, flat + dims, flat)
    upd = np.asarray(updates, dtype=data.dtype).reshape((flat.shape[0],) + data.shape[k:])
    if reduction == "none":
        for row, u in zip(flat, upd):
            data[tuple(row)] = u
    else:
        _reduce_into(data, tuple(flat.T), upd, reduction)
    return data


@primitive(
    "fragment tract_core_one_hot(input: tensor<scalar>, axis: integer, dim: integer, value_off: scalar = 0.0,"
    " value_on: scalar = 1.0) -> (output: tensor<scalar>);",
    REG,
)
def tract_core_one_hot(
    input: np.ndarray, *, axis: int, dim: int, value_off: float = 0.0, value_on: float = 1.0
) -> np.ndarray:
    """One-hot along a new axis ``axis`` of size ``dim`` (f32 values, as tract's deserializer builds them)."""
    x = cast_array(np.asarray(input), np.dtype(np.int64))
    ax = norm_axis(axis, x.ndim + 1)
    hot = np.expand_dims(x, ax) == np.arange(int(dim)).reshape([-1 if i == ax else 1 for i in range(x.ndim + 1)])
    return np.where(hot, np.float32(value_on), np.float32(value_off)).astype(np.float32)


@primitive(
    "fragment tract_onnx_non_zero(input: tensor<scalar>, count_symbol: string = \"\") -> (output: tensor<integer>);",
    "tract_onnx",
)
def tract_onnx_non_zero(input: np.ndarray, *, count_symbol: str = "") -> np.ndarray:
    """ONNX NonZero: ``[rank, n]`` i64 coordinates of the non-zero elements, row-major order."""
    x = np.asarray(input)
    return np.asarray(np.nonzero(x), dtype=np.int64).reshape(x.ndim, -1)


# ----------------------------------------------------------------------------------------------
# Linear algebra
# ----------------------------------------------------------------------------------------------
def _einsum_expr(expr: str) -> str:
    """tract writes ``a,b->c`` with single-letter axes, as numpy does; spaces are dropped."""
    return expr.replace(" ", "")


@primitive(
    'fragment tract_core_einsum(inputs: tensor<scalar>[], expr: string, acc: string, output: string = "")'
    " -> (output: tensor<scalar>);",
    REG,
)
def tract_core_einsum(inputs: Sequence[np.ndarray], *, expr: str, acc: str, output: str = "") -> np.ndarray:
    """Einstein summation computed in ``acc`` (f16 accumulation is done in f32 then rounded).

    The result has the ``acc`` type: tract's non-quantized EinSum output type is its operating type,
    and its deserializer ignores ``output`` (only ``tract_core_einsum_q`` reads it) -- checked with
    tract 0.23.9 (``acc = "f32", output = "f16"`` gives f32)."""
    acc_dt = parse_datum_type(acc, where="tract_core_einsum")
    work = float_compute_dtype(acc_dt) if acc_dt.kind == "f" else acc_dt
    arrays = [np.asarray(a).astype(work) for a in inputs]
    res = np.einsum(_einsum_expr(expr), *arrays)
    return np.asarray(res).astype(acc_dt)


# ----------------------------------------------------------------------------------------------
# Reductions, normalisation, softmax
# ----------------------------------------------------------------------------------------------
def _axes_tuple(axes: Any, rank: int) -> tuple[int, ...]:
    return tuple(sorted({norm_axis(a, rank) for a in as_int_list(axes, what="axes")}))


def _arg_reduce_last(x: np.ndarray, axes: Any, largest: bool) -> np.ndarray:
    ax_list = _axes_tuple(axes, x.ndim)
    if len(ax_list) != 1:
        raise GraphError("argmax/argmin reduce takes exactly one axis")
    ax = ax_list[0]
    flipped = np.flip(x, axis=ax)
    pos = np.argmax(flipped, axis=ax) if largest else np.argmin(flipped, axis=ax)
    return np.expand_dims(x.shape[ax] - 1 - pos, ax).astype(np.int64)


@primitive(
    "fragment tract_core_argmax_reduce_last(input: tensor<scalar>, axes: integer[]) -> (output: tensor<scalar>);",
    REG,
)
def tract_core_argmax_reduce_last(input: np.ndarray, *, axes: Sequence[int]) -> np.ndarray:
    """Index of the maximum, the last one on ties; the reduced axis is kept (size 1), i64."""
    return _arg_reduce_last(np.asarray(input), axes, True)


@primitive(
    "fragment tract_core_argmin_reduce_last(input: tensor<scalar>, axes: integer[]) -> (output: tensor<scalar>);",
    REG,
)
def tract_core_argmin_reduce_last(input: np.ndarray, *, axes: Sequence[int]) -> np.ndarray:
    return _arg_reduce_last(np.asarray(input), axes, False)


@primitive(
    "fragment tract_core_product_reduce(input: tensor<scalar>, axes: integer[]) -> (output: tensor<scalar>);",
    REG,
)
def tract_core_product_reduce(input: np.ndarray, *, axes: Sequence[int]) -> np.ndarray:
    x = np.asarray(input)
    return np.prod(x, axis=_axes_tuple(axes, x.ndim), keepdims=True).astype(x.dtype)


def _rms_norm_static(attrs: dict[str, Any]) -> Kernel | None:
    axis, eps = attrs.get("axis"), attrs.get("eps", 1e-6)
    if type(axis) is not int or not isinstance(eps, (int, float)):
        return None
    generic, array, e = tract_core_rms_norm, rms_norm_array, float(eps)

    def rms_norm(input: np.ndarray) -> np.ndarray:  # noqa: A002
        """:func:`tract_core_rms_norm` with its axis and eps read once."""
        x = input
        if type(x) is not np.ndarray or not -x.ndim <= axis < x.ndim:
            return generic(input, axis=axis, eps=eps)
        return array(x, axis + x.ndim if axis < 0 else axis, e)
    return rms_norm


@primitive(
    "fragment tract_core_rms_norm(input: tensor<scalar>, axis: integer, eps: scalar = 1e-6)"
    " -> (output: tensor<scalar>);",
    REG,
    "tract_transformers_rms_norm",
    specialize=_rms_norm_static,
    fresh_result=True,
)
def tract_core_rms_norm(input: np.ndarray, *, axis: int, eps: float = 1e-6) -> np.ndarray:
    """``x / sqrt(mean(x^2, axis) + eps)``, computed in f32 for f16/f32 (as tract), result in the input type."""
    x = input if type(input) is np.ndarray else np.asarray(input)
    return rms_norm_array(x, norm_axis(as_int(axis), x.ndim), as_float(eps))


def rms_norm_array(x: np.ndarray, ax: int, eps: float) -> np.ndarray:
    """:func:`tract_core_rms_norm` on an array, ``ax`` already in ``[0, rank)``."""
    work = float_compute_dtype(x.dtype)
    xf = x if x.dtype == work else x.astype(work)
    # np.mean's arithmetic without its Python wrapper: pairwise sum in `work`, then / count (np.mean
    # divides in f64 and rounds to `work`; so does the one-value path below)
    ms = np.add.reduce(np.square(xf), axis=ax, keepdims=True, dtype=work)
    n = x.shape[ax]
    e = work.type(eps)
    if ms.size == 1 and n:  # one vector (a decode step): scalar arithmetic, same roundings
        r = work.type(1.0) / np.sqrt(work.type(float(ms.reshape(())) / n) + e)
        y = xf * r
    else:
        ms /= np.intp(n)
        ms += e
        np.sqrt(ms, out=ms)
        y = np.multiply(xf, np.divide(work.type(1.0), ms, out=ms))
    return y if y.dtype == x.dtype else y.astype(x.dtype)


def softmax_array(x: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    """Numerically stable softmax over ``axes``, computed in f32 for f16/f32, result in the input type."""
    work = float_compute_dtype(x.dtype)
    xf = x.astype(work)
    m = np.max(xf, axis=axes, keepdims=True)
    e = np.exp(xf - m)
    return (e / np.sum(e, axis=axes, keepdims=True)).astype(x.dtype)


@primitive(
    'fragment tract_core_softmax(x: tensor<scalar>, axes: tensor<integer>, exp: string = "")'
    " -> (output: tensor<scalar>);",
    REG,
)
def tract_core_softmax(x: np.ndarray, axes: Any, *, exp: str = "") -> np.ndarray:
    """``exp`` is a legacy selector tract ignores (declared default "" = absent)."""
    arr = np.asarray(x)
    return softmax_array(arr, _axes_tuple(axes, arr.ndim))


@primitive(
    "fragment tract_core_log_softmax(x: tensor<scalar>, axes: tensor<integer>) -> (output: tensor<scalar>);",
    REG,
)
def tract_core_log_softmax(x: np.ndarray, axes: Any) -> np.ndarray:
    arr = np.asarray(x)
    ax = _axes_tuple(axes, arr.ndim)
    work = float_compute_dtype(arr.dtype)
    xf = arr.astype(work)
    m = np.max(xf, axis=ax, keepdims=True)
    s = xf - m
    return (s - np.log(np.sum(np.exp(s), axis=ax, keepdims=True))).astype(arr.dtype)


@primitive(
    "fragment tract_core_trilu(input: tensor<scalar>, k: tensor<integer>, upper: logical)"
    " -> (output: tensor<scalar>);",
    REG,
)
def tract_core_trilu(input: np.ndarray, k: Any, *, upper: bool) -> np.ndarray:
    """Keep the upper (``col >= row + k``) or lower (``col <= row + k``) triangle of the last two axes."""
    x = np.asarray(input)
    kk = as_int(k, what="trilu k")
    return np.triu(x, kk) if upper else np.tril(x, kk)


@primitive(
    "fragment tract_core_topk(input: tensor<scalar>, k: tensor<integer>, axis: integer, largest: logical)"
    " -> (values: tensor<scalar>, indices: tensor<integer>);",
    REG,
)
def tract_core_topk(input: np.ndarray, k: Any, *, axis: int, largest: bool) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` largest (or smallest) along ``axis``, sorted; ties keep index order (stable sort)."""
    x = np.asarray(input)
    ax = norm_axis(axis, x.ndim)
    kk = as_int(k, what="topk k")
    key = x.astype(np.float64)
    order = np.argsort(-key if largest else key, axis=ax, kind="stable")
    idx = np.take(order, np.arange(kk), axis=ax)
    return np.take_along_axis(x, idx, axis=ax), idx.astype(np.int64)


# ----------------------------------------------------------------------------------------------
# Element-wise
# ----------------------------------------------------------------------------------------------
def _float_unary(x: np.ndarray, fn) -> np.ndarray:
    arr = np.asarray(x)
    if arr.dtype.kind != "f":
        raise GraphError(f"expected a float tensor, got {arr.dtype}")
    work = float_compute_dtype(arr.dtype)
    with np.errstate(over="ignore"):
        return np.asarray(fn(arr.astype(work, copy=False))).astype(arr.dtype, copy=False)


def _silu(v: np.ndarray) -> np.ndarray:
    """``v / (1 + exp(-v))`` in v's type, in one scratch array."""
    e = np.negative(v)
    np.exp(e, out=e)
    e += v.dtype.type(1)
    return np.divide(v, e, out=e)


@primitive("fragment tract_core_silu(x: tensor<scalar>) -> (y: tensor<scalar>);", REG, "tract_transformers_silu",
           fresh_result=True)
def tract_core_silu(x: np.ndarray) -> np.ndarray:
    """``x * sigmoid(x)``."""
    if type(x) is np.ndarray and x.dtype == _F32:  # the common case, without the dtype dispatch
        with np.errstate(over="ignore"):
            return _silu(x)
    return _float_unary(x, _silu)


@primitive(
    "fragment tract_core_gelu_approx(input: tensor<scalar>, fast_impl: logical = false) -> (y: tensor<scalar>);",
    REG,
    "tract_transformers_gelu_approx",
)
def tract_core_gelu_approx(input: np.ndarray, *, fast_impl: bool = False) -> np.ndarray:
    """``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^p)))`` with p = 2 when ``fast_impl`` else 3."""
    p = 2 if fast_impl else 3

    def f(v: np.ndarray) -> np.ndarray:
        t = v.dtype.type
        c = t(math.sqrt(2.0 / math.pi))
        return t(0.5) * v * (t(1.0) + np.tanh(c * (v + t(0.044715) * v**p)))

    return _float_unary(input, f)


_erf_vec = np.vectorize(math.erf, otypes=[np.float64])


@primitive("fragment tract_core_erf(x: tensor<scalar>) -> (y: tensor<scalar>);", REG)
def tract_core_erf(x: np.ndarray) -> np.ndarray:
    """The error function, computed in f64 and rounded to the input type."""
    arr = np.asarray(x)
    return _erf_vec(arr.astype(np.float64)).astype(arr.dtype) if arr.size else arr.copy()


@primitive("fragment tract_core_hard_swish(x: tensor<scalar>) -> (y: tensor<scalar>);", REG)
def tract_core_hard_swish(x: np.ndarray) -> np.ndarray:
    """``x * relu6(x + 3) / 6``."""
    return _float_unary(x, lambda v: v * np.clip(v + v.dtype.type(3), 0, 6) / v.dtype.type(6))


@primitive("fragment tract_core_round_even(x: tensor<scalar>) -> (y: tensor<scalar>);", REG)
def tract_core_round_even(x: np.ndarray) -> np.ndarray:
    return np.round(np.asarray(x))


@primitive("fragment tract_core_is_nan(x: tensor<scalar>) -> (y: tensor<logical>);", REG)
def tract_core_is_nan(x: np.ndarray) -> np.ndarray:
    return np.isnan(np.asarray(x))


@primitive(
    "fragment tract_core_is_inf(input: tensor<scalar>, detect_positive: logical = true,"
    " detect_negative: logical = true) -> (output: tensor<logical>);",
    REG,
)
def tract_core_is_inf(input: np.ndarray, *, detect_positive: bool = True, detect_negative: bool = True) -> np.ndarray:
    x = np.asarray(input)
    out = np.zeros(x.shape, dtype=bool)
    if detect_positive:
        out |= np.isposinf(x)
    if detect_negative:
        out |= np.isneginf(x)
    return out


@primitive(
    "fragment tract_core_pow_const(input: tensor<scalar>, exponent: scalar) -> (output: tensor<scalar>);",
    REG,
)
def tract_core_pow_const(input: np.ndarray, *, exponent: float) -> np.ndarray:
    arr = np.asarray(input)
    return np.power(arr, arr.dtype.type(exponent)).astype(arr.dtype)


@primitive("fragment tract_core_bitnot(x: tensor<scalar>) -> (y: tensor<scalar>);", REG)
def tract_core_bitnot(x: np.ndarray) -> np.ndarray:
    return np.invert(np.asarray(x))


def _binary(fn):
    def kernel(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        a, b = np.asarray(x), np.asarray(y)
        return fn(a, b.astype(a.dtype) if a.dtype != b.dtype else b)

    return kernel


for _name, _fn in (
    ("tract_core_xor", np.logical_xor),
    ("tract_core_bitand", np.bitwise_and),
    ("tract_core_bitor", np.bitwise_or),
    ("tract_core_bitxor", np.bitwise_xor),
    ("tract_shl", np.left_shift),
    ("tract_shr", np.right_shift),
):
    primitive(f"fragment {_name}(x: tensor<scalar>, y: tensor<scalar>) -> (z: tensor<scalar>);", REG)(_binary(_fn))


# ------------------------------------------------------------------------------------------------
# facts (registry.FACTS)
# ------------------------------------------------------------------------------------------------
declare("tract_core_external", "input")
declare("tract_core_cast", "passthrough", "memo")
declare("tract_core_broadcast", "kv_expand", "memo")
declare("tract_core_softmax", "softmax")
declare("tract_core_gather", "gather", "fresh")
for _op in ("tract_core_shape_of", "tract_core_range"):
    declare(_op, "memo")
