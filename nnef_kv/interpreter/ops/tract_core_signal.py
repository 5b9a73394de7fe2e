"""Kernels of tract's resampling, spectral and recurrent-cell ``tract_core_*`` operations:
``tract_core_resize``, ``tract_core_grid_sample``, ``tract_core_fft``, ``tract_core_stft``,
``tract_core_gru_epilogue``.

Semantics follow ``sonos/tract`` ``core/src/ops/nn/resize.rs``, ``core/src/ops/nn/grid_sample.rs``,
``core/src/ops/fft.rs`` and ``core/src/ops/gru_cell.rs``; all compute in f32 (f64 for f64 FFTs) and
return the input's type, as tract does.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import GraphError
from ...core.registry import primitive
from ...core.coerce import as_int, float_compute_dtype, norm_axis

REG = "tract_core"
F32 = np.float32


# ----------------------------------------------------------------------------------------------
# Resize
# ----------------------------------------------------------------------------------------------
def _coord(mode: str, x_out: np.ndarray, scale: np.float32, len_in: int, len_out: int) -> np.ndarray:
    """Output index -> input coordinate (f32), ONNX ``coordinate_transformation_mode``."""
    x = x_out.astype(F32)
    half = F32(0.5)
    if mode == "half_pixel":
        return (x + half) / scale - half
    if mode == "align_corners":
        width = scale * F32(len_in)
        if width == F32(1.0):
            return np.zeros_like(x)
        return (x * F32(len_in - 1)) / (width - F32(1.0))
    if mode == "asymmetric":
        return x / scale
    if mode == "pytorch_half_pixel":
        return (x + half) / scale - half if len_out > 1 else np.full_like(x, -half)
    if mode == "half_pixel_symmetric":
        adjustment = F32(len_out) / (scale * F32(len_in))
        offset = F32(len_in) / F32(2.0) * (F32(1.0) - adjustment)
        return offset + (x + half) / scale - half
    if mode == "tf_half_pixel_for_nn":
        return (x + half) / scale
    raise GraphError(f"tract_core_resize: unknown coord_transformer {mode!r}")


def _cubic_kernel(s: np.ndarray, a: np.float32 = F32(-0.75)) -> np.ndarray:
    s = np.abs(s)
    near = (a + F32(2)) * s * s * s - (a + F32(3)) * s * s + F32(1)
    far = a * s * s * s - F32(5) * a * s * s + F32(8) * a * s - F32(4) * a
    return np.where(s <= 1, near, np.where(s <= 2, far, F32(0))).astype(F32)


def _resize_axis(data: np.ndarray, axis: int, scale: np.float32, len_out: int, *, coord: str, interp: str, nearest: str) -> np.ndarray:
    len_in = data.shape[axis]
    x_in = _coord(coord, np.arange(len_out), scale, len_in, len_out)
    cell = np.ceil(x_in) - F32(1.0)
    r = (x_in - cell).astype(F32)  # in (0, 1]
    window = 4 if interp == "cubic" else 2
    first = cell.astype(np.int64) + 1 - window // 2
    taps = first[:, None] + np.arange(window)[None, :]
    idx = np.clip(taps, 0, len_in - 1)
    if interp == "linear":
        offs = (F32(1 - window // 2) + np.arange(window, dtype=F32))[None, :] - r[:, None]
        w = np.clip(F32(1.0) - np.abs(offs), 0, 1).astype(F32)
    elif interp == "cubic":
        offs = (F32(1 - window // 2) + np.arange(window, dtype=F32))[None, :] - r[:, None]
        w = _cubic_kernel(offs)
    elif interp == "nearest":
        if nearest == "floor":
            right = r == F32(1.0)
        elif nearest == "round_prefer_ceil":
            right = (r == F32(1.0)) | (r >= F32(0.5))
        else:
            raise GraphError(f"tract_core_resize: unknown nearest_mode {nearest!r}")
        w = np.stack([~right, right], axis=1).astype(F32)
    else:
        raise GraphError(f"tract_core_resize: unknown interpolator {interp!r}")
    moved = np.moveaxis(data, axis, -1)
    out = np.zeros(moved.shape[:-1] + (len_out,), dtype=F32)
    for k in range(window):
        out = out + moved[..., idx[:, k]] * w[:, k]
    return np.moveaxis(out, -1, axis)


@primitive(
    "fragment tract_core_resize(input: tensor<scalar>, scales: tensor<scalar> = false,"
    ' sizes: tensor<scalar> = false, coord_transformer: string = "half_pixel",'
    ' interpolator: string = "nearest", nearest_mode: string = "floor") -> (output: tensor<scalar>);',
    REG,
)
def tract_core_resize(
    input: np.ndarray,
    scales: Any = None,
    sizes: Any = None,
    *,
    coord_transformer: str = "half_pixel",
    interpolator: str = "nearest",
    nearest_mode: str = "floor",
) -> np.ndarray:
    """Separable resampling of every axis whose size changes (ONNX Resize without ROI).

    Exactly one of ``scales`` / ``sizes`` (one value per axis); the declared default ``false`` and
    None both mean absent. Output size for a scale ``s``: ``n * s`` when ``s`` is integral, else
    ``floor(n * s)`` in f32. Computed in f32, result in the input type."""
    x = np.asarray(input)

    def absent(v: Any) -> bool:
        return v is None or (np.ndim(v) == 0 and np.asarray(v).dtype == np.bool_ and not bool(v))

    if absent(scales) == absent(sizes):
        raise GraphError("tract_core_resize: give exactly one of scales or sizes")
    shape = list(x.shape)
    if not absent(scales):
        sc = np.asarray(scales, dtype=F32).reshape(-1)
        if sc.size != x.ndim:
            raise GraphError(f"tract_core_resize: {sc.size} scales for a tensor of rank {x.ndim}")
        out_shape = [n * int(s) if np.round(s) == s else int(F32(n) * s) for n, s in zip(shape, sc)]
    else:
        out_shape = [int(v) for v in np.asarray(sizes).reshape(-1)]
        if len(out_shape) != x.ndim:
            raise GraphError(f"tract_core_resize: {len(out_shape)} sizes for a tensor of rank {x.ndim}")
        sc = np.asarray([F32(o) / F32(n) for o, n in zip(out_shape, shape)], dtype=F32)
    data = x.astype(F32)
    for axis, (s, n_out) in enumerate(zip(sc, out_shape)):
        if data.shape[axis] == n_out and s == F32(1.0):
            continue
        data = _resize_axis(
            data, axis, F32(s), n_out, coord=coord_transformer, interp=interpolator, nearest=nearest_mode
        )
    return data.astype(x.dtype)


# ----------------------------------------------------------------------------------------------
# GridSample
# ----------------------------------------------------------------------------------------------
def _reflect(x: np.ndarray, lo: float, hi: float) -> np.ndarray:
    rng = F32(hi - lo)
    if rng == 0:
        return np.full_like(x, F32(lo))
    lo32, hi32 = F32(lo), F32(hi)
    below, above = x < lo32, x > hi32
    dx = np.where(below, lo32 - x, np.where(above, x - hi32, F32(0)))
    n = np.trunc(dx / rng).astype(np.int64)
    r = dx - n.astype(F32) * rng
    even = n % 2 == 0
    from_below = np.where(even, lo32 + r, hi32 - r)
    from_above = np.where(even, hi32 - r, lo32 + r)
    return np.where(below, from_below, np.where(above, from_above, x)).astype(F32)


@primitive(
    "fragment tract_core_grid_sample(input: tensor<scalar>, grid: tensor<scalar>, mode: string = \"bilinear\","
    ' padding_mode: string = "zeros", align_corners: logical = false) -> (output: tensor<scalar>);',
    REG,
)
def tract_core_grid_sample(
    input: np.ndarray, grid: np.ndarray, *, mode: str = "bilinear", padding_mode: str = "zeros", align_corners: bool = False
) -> np.ndarray:
    """ONNX/PyTorch GridSample: input ``[N, C, D1..Dk]``, grid ``[N, O1..Ok, k]`` of normalized
    coordinates in ``[-1, 1]`` (last entry = first spatial axis reversed: x, y, ...). Modes
    bilinear (k-linear) and nearest (round half to even); paddings zeros, border, reflection."""
    x = np.asarray(input)
    xf = x.astype(F32)
    g = np.asarray(grid).astype(F32)
    n, c = x.shape[:2]
    sizes = x.shape[2:]
    k = len(sizes)
    if g.shape[0] != n or g.shape[-1] != k or g.ndim != k + 2:
        raise GraphError(f"tract_core_grid_sample: grid {g.shape} does not fit input {x.shape}")
    if mode not in ("bilinear", "nearest"):
        raise GraphError(f"tract_core_grid_sample: mode {mode!r} is not supported by nnef-kv")
    if padding_mode not in ("zeros", "border", "reflection"):
        raise GraphError(f"tract_core_grid_sample: unknown padding_mode {padding_mode!r}")
    out_sp = g.shape[1:-1]
    # pixel coordinates per spatial axis d: grid[..., k-1-d]
    coords = []
    bounds = []
    for d, size in enumerate(sizes):
        gc = g[..., k - 1 - d]
        if align_corners:
            pc = (gc + F32(1)) / F32(2) * F32(size - 1)
            bounds.append((0.0, float(size - 1)))
        else:
            pc = ((gc + F32(1)) * F32(size) - F32(1)) / F32(2)
            bounds.append((-0.5, float(size) - 0.5))
        coords.append(pc.astype(F32))
    if mode == "nearest":
        coords = [np.round(pc).astype(F32) for pc in coords]  # numpy rounds half to even, like tract
    oob = np.zeros(g.shape[:-1], dtype=bool)
    for pc, (lo, hi) in zip(coords, bounds):
        oob |= (pc < F32(lo)) | (pc > F32(hi))
    padded = []
    for pc, (lo, hi) in zip(coords, bounds):
        if padding_mode == "border":
            q = np.clip(pc, F32(0), F32(hi + lo))
        elif padding_mode == "reflection":
            q = _reflect(pc, lo, hi)
        else:
            q = pc
        padded.append(np.where(oob, q, pc).astype(F32))  # tract pads only out-of-bounds points
    batch_idx = np.arange(n).reshape((n,) + (1,) * len(out_sp))

    def pixel(icoords: list[np.ndarray]) -> np.ndarray:
        """Values ``[N, O.., C]`` at integer coordinates, padded as configured."""
        valid = np.ones(g.shape[:-1], dtype=bool)
        fixed = []
        for ic, size, (lo, hi) in zip(icoords, sizes, bounds):
            if padding_mode == "zeros":
                valid &= (ic >= 0) & (ic < size)
                fixed.append(np.clip(ic, 0, size - 1))
            elif padding_mode == "border":
                fixed.append(np.clip(ic, 0, size - 1))
            else:
                fixed.append(_reflect(ic.astype(F32), lo, hi).astype(np.int64))
        vals = np.moveaxis(xf, 1, -1)[(batch_idx, *fixed)]  # [N, O.., C]
        return np.where(valid[..., None], vals, F32(0))

    if mode == "nearest":
        res = pixel([p.astype(np.int64) for p in padded])
    else:
        res = np.zeros(g.shape[:-1] + (c,), dtype=F32)
        floors = [np.floor(p) for p in padded]
        for corner in range(1 << k):
            weight = np.ones(g.shape[:-1], dtype=F32)
            icoords = []
            for d, (p, lo_f) in enumerate(zip(padded, floors)):
                lo_i = lo_f.astype(np.int64)
                if (corner >> d) & 1 == 0:
                    icoords.append(lo_i)
                    weight = weight * ((lo_i + 1).astype(F32) - p)
                else:
                    icoords.append(lo_i + 1)
                    weight = weight * (p - lo_i.astype(F32))
            res = res + weight[..., None] * pixel(icoords)
    return np.moveaxis(res, -1, 1).astype(x.dtype)


# ----------------------------------------------------------------------------------------------
# FFT / STFT (complex numbers as a trailing axis of 2: re, im)
# ----------------------------------------------------------------------------------------------
def _to_complex(x: np.ndarray, where: str) -> np.ndarray:
    if x.ndim < 2 or x.shape[-1] != 2:
        raise GraphError(f"{where}: the last axis must be 2 (real, imaginary), got shape {x.shape}")
    wide = x.astype(np.float64)
    return wide[..., 0] + 1j * wide[..., 1]


def _from_complex(z: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return np.stack([z.real, z.imag], axis=-1).astype(dtype)


@primitive(
    "fragment tract_core_fft(input: tensor<scalar>, axis: integer, inverse: logical) -> (output: tensor<scalar>);",
    REG,
)
def tract_core_fft(input: np.ndarray, *, axis: int, inverse: bool) -> np.ndarray:
    """Complex FFT along ``axis``; the inverse is unnormalized (rustfft convention, as tract)."""
    x = np.asarray(input)
    z = _to_complex(x, "tract_core_fft")
    ax = norm_axis(axis, z.ndim)
    res = np.fft.ifft(z, axis=ax) * z.shape[ax] if inverse else np.fft.fft(z, axis=ax)
    return _from_complex(res, x.dtype)


@primitive(
    "fragment tract_core_stft(input: tensor<scalar>, axis: integer, frame: integer, stride: integer,"
    " window: tensor<scalar> = false) -> (output: tensor<scalar>);",
    REG,
)
def tract_core_stft(input: np.ndarray, window: Any = None, *, axis: int, frame: int, stride: int) -> np.ndarray:
    """Frames of ``frame`` samples every ``stride`` along ``axis`` (a new frame axis is inserted at
    ``axis + 1``), each multiplied by ``window`` (zero-padded symmetrically to ``frame``) and FFT'd."""
    x = np.asarray(input)
    z = _to_complex(x, "tract_core_stft")
    ax = norm_axis(axis, z.ndim)
    frame, stride = as_int(frame), as_int(stride)
    n = z.shape[ax]
    frames = (n - frame) // stride + 1
    if frames <= 0:
        raise GraphError(f"tract_core_stft: {n} samples are fewer than a frame of {frame}")
    idx = stride * np.arange(frames)[:, None] + np.arange(frame)[None, :]
    zz = np.moveaxis(z, ax, -1)[..., idx]  # [..., frames, frame]
    has_window = not (window is None or (np.ndim(window) == 0 and np.asarray(window).dtype == np.bool_))
    if has_window:
        win = np.asarray(window).astype(float_compute_dtype(x.dtype)).reshape(-1)
        pad_left = (frame - win.size) // 2
        full = np.zeros(frame, dtype=np.float64)
        full[pad_left : pad_left + win.size] = win
        zz = zz * full
    spec = np.fft.fft(zz, axis=-1)
    spec = np.moveaxis(spec, (-2, -1), (ax, ax + 1))
    return _from_complex(spec, x.dtype)


# ----------------------------------------------------------------------------------------------
# GRU epilogue
# ----------------------------------------------------------------------------------------------
@primitive(
    "fragment tract_core_gru_epilogue(xh: tensor<scalar>, rh: tensor<scalar>, h_prev: tensor<scalar>,"
    " hidden: integer) -> (output: tensor<scalar>);",
    REG,
)
def tract_core_gru_epilogue(xh: np.ndarray, rh: np.ndarray, h_prev: np.ndarray, *, hidden: int) -> np.ndarray:
    """ONNX GRU cell with ``linear_before_reset``: gates z, r, h in ``[rows, 3*hidden]``;
    ``Ht = ht + zt * (h_prev - ht)``; rows and result shape follow ``h_prev``."""
    hp = np.asarray(h_prev)
    dt = hp.dtype
    h = as_int(hidden)
    rows = hp.size // h
    a = np.asarray(xh).astype(F32)
    b = np.asarray(rh).astype(F32)
    a = np.broadcast_to(a.reshape(-1, 3 * h), (rows, 3 * h)) if a.size in (3 * h, rows * 3 * h) else a
    b = np.broadcast_to(b.reshape(-1, 3 * h), (rows, 3 * h)) if b.size in (3 * h, rows * 3 * h) else b
    if a.shape != (rows, 3 * h) or b.shape != (rows, 3 * h):
        raise GraphError(f"tract_core_gru_epilogue: xh/rh must be [{rows}, {3 * h}], got {xh.shape} / {rh.shape}")
    hpf = hp.reshape(rows, h).astype(F32)

    def sigmoid(v: np.ndarray) -> np.ndarray:
        return F32(1) / (F32(1) + np.exp(-v))

    z = sigmoid(a[:, :h] + b[:, :h])
    r = sigmoid(a[:, h : 2 * h] + b[:, h : 2 * h])
    ht = np.tanh(a[:, 2 * h :] + r * b[:, 2 * h :])
    out = ht + z * (hpf - ht)
    return out.astype(dt).reshape(hp.shape)


@primitive(
    "fragment tract_core_lstm_epilogue(preact: tensor<scalar>, c_prev: tensor<scalar>, hidden: integer)"
    " -> (ht: tensor<scalar>, ct: tensor<scalar>);",
    REG,
)
def tract_core_lstm_epilogue(preact: np.ndarray, c_prev: np.ndarray, *, hidden: int) -> tuple[np.ndarray, np.ndarray]:
    """ONNX LSTM cell epilogue, gates i, o, f, c in ``preact [rows, 4*hidden]``:
    ``Ct = f * c_prev + i * tanh(c)``, ``Ht = o * tanh(Ct)``; shapes follow ``c_prev``."""
    cp = np.asarray(c_prev)
    dt = cp.dtype
    h = as_int(hidden)
    rows = cp.size // h
    p = np.asarray(preact)
    if p.size != rows * 4 * h:
        raise GraphError(f"tract_core_lstm_epilogue: preact must be [{rows}, {4 * h}], got {p.shape}")
    work = float_compute_dtype(dt)
    pf = p.reshape(rows, 4 * h).astype(work)
    gates = work.type(1) / (work.type(1) + np.exp(-pf[:, : 3 * h]))
    i, o, f = gates[:, :h], gates[:, h : 2 * h], gates[:, 2 * h :]
    cc = np.tanh(pf[:, 3 * h :])
    ct = (f * cp.reshape(rows, h).astype(work) + i * cc).astype(dt)
    ht = (np.tanh(ct.astype(work)) * o).astype(dt)
    return ht.reshape(cp.shape), ct.reshape(cp.shape)
