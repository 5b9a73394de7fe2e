"""The two quantizers of Hugging Face's ``QuantizedCache`` (see :mod:`.hf_quantized` for the facts they
follow): optimum-quanto's grouped affine quantizer and HQQ's (with its zero-point optimizer). A
:class:`QStore` holds one quantized tensor (codes, scale, shift) as the cache keeps it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import InputError
from .packing import pack_planar, unpack_planar

__all__ = ["QStore", "quanto_quantize", "quanto_dequantize", "quanto_grouped_shape", "quanto_param_axis",
           "hqq_quantize", "hqq_dequantize", "hqq_rows", "hqq_pack", "hqq_unpack", "hqq_packed_shape"]

_HQQ_ITERS, _HQQ_BETA, _HQQ_LP = 20, 10.0, 0.7


@dataclass(frozen=True)
class QStore:
    """One quantized tensor as the backend holds it (immutable: a flush makes a new one).

    ``shape``: the ``[B, H, T, D]`` it stands for; ``codes``: packed codes; ``scale``, ``shift``:
    quanto's scale and shift (``x = scale * code - shift``) or HQQ's scale and zero
    (``x = (code - zero) * scale``)."""

    shape: tuple[int, int, int, int]
    codes: np.ndarray
    scale: np.ndarray
    shift: np.ndarray

    @property
    def nbytes_codes(self) -> int:
        return int(self.codes.nbytes)

    @property
    def nbytes_params(self) -> int:
        return int(self.scale.nbytes + self.shift.nbytes)


# ================================================================================ quanto
def quanto_grouped_shape(shape: tuple[int, ...], axis: int, g: int, who: str) -> tuple[int, int]:
    n = int(np.prod(shape))
    axis_dim = shape[0] if axis == 0 else shape[-1]
    numel = n // axis_dim if axis_dim else 0
    if g > numel or numel % g:
        raise InputError(f"{who}: quanto cannot group a {list(shape)} tensor along axis {axis}: group_size {g} "
                         f"must divide {numel} (HF's cache raises ValueError here)")
    return (n // g, g) if axis == 0 else (g, n // g)


def _quanto_group(x: np.ndarray, axis: int, g: int) -> np.ndarray:
    if axis == 0:
        return x.reshape(-1, g)
    d = x.shape[-1]
    ag = x.size // d // g
    return x.reshape(ag, g, d).transpose(1, 2, 0).reshape(g, d * ag)


def _quanto_ungroup(gx: np.ndarray, axis: int, shape: tuple[int, ...]) -> np.ndarray:
    if axis == 0:
        return gx.reshape(shape)
    g, d = gx.shape[0], shape[-1]
    return gx.reshape(g, d, gx.size // g // d).transpose(2, 0, 1).reshape(shape)


def quanto_param_axis(gshape: tuple[int, int], axis: int) -> int:
    """The dimension the min/max reduce over (MaxOptimizer; axis None when the group axis has size 1)."""
    if axis == 0 and gshape[0] != 1:
        return 1
    return 0


def quanto_quantize(x: np.ndarray, bits: int, axis: int, g: int, who: str = "quanto") -> QStore:
    """``MaxOptimizer`` + ``quantize_weight`` of ``x [B, H, T, D]`` (f32 or f16, arithmetic in its dtype)."""
    dt = x.dtype
    quanto_grouped_shape(x.shape, axis, g, who)
    gx = _quanto_group(np.ascontiguousarray(x), axis, g)
    red = quanto_param_axis(gx.shape, axis)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        rmin = np.min(gx, axis=red, keepdims=True)
        rmax = np.max(gx, axis=red, keepdims=True)
        scale = (rmax - rmin) / dt.type((1 << bits) - 1)
        shift = -rmin
        data = np.rint((gx + shift) / scale)
    codes = np.where(np.isnan(data), 0, np.clip(data, 0, (1 << bits) - 1)).astype(np.uint8)
    packed = np.ascontiguousarray(pack_planar(codes.T, bits).T)
    return QStore(tuple(int(s) for s in x.shape), packed, scale, shift)


def _quanto_codes(st: QStore, bits: int, axis: int, g: int) -> np.ndarray:
    rows, _ = quanto_grouped_shape(st.shape, axis, g, "quanto")
    return unpack_planar(st.codes.T, bits, rows).T


def quanto_dequantize(st: QStore, bits: int, axis: int, g: int) -> np.ndarray:
    codes = _quanto_codes(st, bits, axis, g)
    with np.errstate(invalid="ignore", over="ignore"):
        x = st.scale * codes.astype(st.scale.dtype)
        x -= st.shift
    return _quanto_ungroup(x, axis, st.shape)


# ================================================================================ HQQ
def hqq_rows(shape: tuple[int, ...], axis: int, g: int, bits: int, who: str) -> int:
    n = int(np.prod(shape))
    if n % g or n == 0:
        raise InputError(f"{who}: HQQ cannot group a {list(shape)} tensor: group_size {g} must divide its "
                         f"{n} values (HF's cache fails here)")
    rows = n // g if axis == 1 else g
    if bits in (1, 2, 4) and rows % (8 // bits):
        raise InputError(f"{who}: HQQ {bits}-bit packing needs the {rows} rows of the grouped {list(shape)} "
                         f"tensor to be a multiple of {8 // bits} (HF's cache fails here)")
    return rows


def hqq_pack(codes: np.ndarray, bits: int) -> np.ndarray:
    if bits == 8:
        return codes.astype(np.uint8)
    if bits == 3:
        rows = codes.shape[0]
        pad = np.zeros((10 * (-(-rows // 10)), codes.shape[1]), np.int32)
        pad[:rows] = codes
        step = pad.shape[0] // 10
        out = np.zeros((step, codes.shape[1]), np.int32)
        for k in range(10):
            out |= pad[k * step:(k + 1) * step] << np.int32(27 - 3 * k)
        return out
    per = 8 // bits
    step = codes.shape[0] // per
    out = np.zeros((step, codes.shape[1]), np.uint8)
    for k in range(per):
        out |= codes[k * step:(k + 1) * step].astype(np.uint8) << np.uint8(bits * (per - 1 - k))
    return out


def hqq_unpack(packed: np.ndarray, bits: int, rows: int) -> np.ndarray:
    if bits == 8:
        return packed
    if bits == 3:
        step = packed.shape[0]
        out = np.empty((10 * step, packed.shape[1]), np.uint8)
        for k in range(10):
            out[k * step:(k + 1) * step] = (packed >> np.int32(27 - 3 * k)) & 7
        return out[:rows]
    per = 8 // bits
    step = packed.shape[0]
    out = np.empty((per * step, packed.shape[1]), np.uint8)
    mask = np.uint8((1 << bits) - 1)
    for k in range(per):
        out[k * step:(k + 1) * step] = (packed >> np.uint8(bits * (per - 1 - k))) & mask
    return out


def hqq_packed_shape(rows: int, cols: int, bits: int) -> tuple[tuple[int, int], np.dtype]:
    if bits == 8:
        return (rows, cols), np.dtype(np.uint8)
    if bits == 3:
        return (-(-rows // 10), cols), np.dtype(np.int32)
    return (rows // (8 // bits), cols), np.dtype(np.uint8)


def hqq_quantize(x: np.ndarray, bits: int, axis: int, g: int, who: str = "hqq") -> QStore:
    """``hqq.core.quantize.Quantizer.quantize`` (proximal optimizer, CPU f32) of ``x [B, H, T, D]``;
    scale (inverted) and zero cast to ``x``'s dtype as HF's layer does."""
    hqq_rows(x.shape, axis, g, bits, who)
    f32 = np.float32
    w = x.astype(f32).reshape(-1, g) if axis == 1 else x.astype(f32).reshape(g, -1)
    max_v = f32((1 << bits) - 1)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        mn = np.min(w, axis=axis, keepdims=True)
        mx = np.max(w, axis=axis, keepdims=True)
        denom = mx - mn
        s = (f32(1.0) / denom) * max_v  # torch's `int / tensor` is reciprocal(tensor) * int
        s = np.where(np.abs(denom) <= f32(1e-4), f32(1.0), s)
        s = np.where(np.isnan(s), s, np.minimum(s, f32(2e4)))
        z = -mn * s
        best = f32(np.inf)
        inv_beta = f32(1.0 / _HQQ_BETA)
        expo = f32(_HQQ_LP - 1)
        for _ in range(_HQQ_ITERS):
            wq = np.clip(np.rint(w * s + z), f32(0), max_v)
            wr = (wq - z) / s
            e = w - wr
            a = np.abs(e)
            # |e|**-0.3 rounded from f64: closer to torch's vectorised (Sleef) powf than NumPy's f32 pow
            pw = np.power(a.astype(np.float64), np.float64(expo)).astype(f32)
            a = np.maximum(a - inv_beta * pw, f32(0)) * np.sign(e)
            z = np.mean(wq - (w - a) * s, axis=axis, keepdims=True, dtype=f32)
            err = np.mean(np.abs(w - wr), dtype=f32)
            if err < best:
                best = err
            else:
                break
        wq = np.clip(np.rint(w * s + z), f32(0), max_v)
        scale = f32(1.0) / s
    codes = np.where(np.isnan(wq), 0, wq).astype(np.uint8)
    dt = x.dtype
    return QStore(tuple(int(v) for v in x.shape), hqq_pack(codes, bits), scale.astype(dt), z.astype(dt))


def hqq_dequantize(st: QStore, bits: int, axis: int, g: int) -> np.ndarray:
    rows = hqq_rows(st.shape, axis, g, bits, "hqq")
    codes = hqq_unpack(st.codes, bits, rows)
    dt = st.scale.dtype
    with np.errstate(invalid="ignore", over="ignore"):
        x = (codes.astype(dt) - st.shift) * st.scale
    return x.reshape(st.shape)


# ================================================================================ the op
