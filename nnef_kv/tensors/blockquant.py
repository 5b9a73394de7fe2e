"""tract's block-quantized weight tensors (Q4_0, Q8_1) as stored in ``.dat`` files.

Both formats cut the flattened tensor into blocks of 32 values along the last axis (``[m, k]``
with ``k % 32 == 0``) and store one f16 scale per block:

* Q4_0 (18 bytes a block): f16 ``d`` then 16 bytes of 4-bit codes ``q``; value = ``(q - 8) * d``.
  GGML nibble order (tract item type ``0x3040``): byte ``j`` holds element ``j`` (low nibble) and
  element ``j + 16`` (high nibble). tract's legacy order (``0x2040``): byte ``j`` holds elements
  ``2j`` (low) and ``2j + 1`` (high).
* Q8_1 (36 bytes a block): f16 ``d``, f16 sum of the block (ignored when decoding), 32 x i8
  ``q``; value = ``q * d``. tract reads item type ``0x3080`` and writes ``0x3081``.

:class:`BlockQuantTensor` keeps the raw blocks exactly as read so that writing it back produces
the same bytes; :meth:`BlockQuantTensor.dequantize` gives float32 values computed the way tract
does (f16 scale widened to f32, one f32 product per value).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import TensorFileError

BLOCK_LEN = 32

Q4_0_LEGACY = 0x2040
Q4_0_GGML = 0x3040
Q8_1_READ = 0x3080
Q8_1_WRITTEN = 0x3081

#: tract item type code -> (format name, bytes per block)
FORMATS: dict[int, tuple[str, int]] = {
    Q4_0_LEGACY: ("Q4_0", 18),
    Q4_0_GGML: ("Q4_0", 18),
    Q8_1_READ: ("Q8_1", 36),
    Q8_1_WRITTEN: ("Q8_1", 36),
}


def block_bytes(item_type: int) -> int:
    """Bytes of one block for a tract block-quant item type code."""
    return FORMATS[item_type][1]


@dataclass(frozen=True, eq=False)
class BlockQuantTensor:
    """A block-quantized tensor: raw blocks (uint8, as in the file), its shape and its format.

    ``shape`` is the shape recorded in the file (tract writes ``[prod(shape[:-1]), shape[-1]]``; the
    graph's ``variable(shape=...)`` gives the logical shape, see :meth:`reshaped`).
    """

    shape: tuple[int, ...]
    blocks: np.ndarray
    item_type: int = Q4_0_GGML

    def __post_init__(self) -> None:
        if self.item_type not in FORMATS:
            raise TensorFileError(f"unknown block-quant item type 0x{self.item_type:04x}")
        if len(self.shape) < 1:
            raise TensorFileError("a block-quant tensor needs rank >= 1")
        if self.blocks.dtype != np.uint8 or self.blocks.ndim != 1:
            raise TensorFileError("block-quant data must be a flat uint8 array")
        count = int(np.prod(self.shape, dtype=object))
        if count % BLOCK_LEN:
            raise TensorFileError(f"block-quant shape {self.shape} is not a multiple of {BLOCK_LEN} values")
        expected = count // BLOCK_LEN * self.block_bytes
        if self.blocks.size != expected:
            raise TensorFileError(
                f"{self.format} data of {self.blocks.size} bytes does not fit shape {list(self.shape)} "
                f"({expected} bytes expected)"
            )

    # ------------------------------------------------------------------------------------------
    @property
    def format(self) -> str:
        """``"Q4_0"`` or ``"Q8_1"``."""
        return FORMATS[self.item_type][0]

    @property
    def block_bytes(self) -> int:
        return FORMATS[self.item_type][1]

    @property
    def n_blocks(self) -> int:
        return self.blocks.size // self.block_bytes

    @property
    def nbytes(self) -> int:
        """Bytes held (the raw blocks)."""
        return int(self.blocks.nbytes)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self) -> np.dtype:
        """The dtype :meth:`dequantize` produces (float32)."""
        return np.dtype(np.float32)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, BlockQuantTensor)
            and self.shape == other.shape
            and self.item_type == other.item_type
            and self.blocks.tobytes() == other.blocks.tobytes()
        )

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"BlockQuantTensor({self.format}, shape={list(self.shape)}, item_type=0x{self.item_type:04x})"

    def reshaped(self, shape: tuple[int, ...] | list[int]) -> "BlockQuantTensor":
        """The same blocks under another shape of the same size whose last axis keeps whole blocks."""
        shape = tuple(int(d) for d in shape)
        if int(np.prod(shape, dtype=object)) != self.size:
            raise TensorFileError(f"cannot view {self!r} as shape {list(shape)}")
        return BlockQuantTensor(shape=shape, blocks=self.blocks, item_type=self.item_type)

    # ------------------------------------------------------------------------------------------
    def _block_view(self) -> np.ndarray:
        return self.blocks.reshape(self.n_blocks, self.block_bytes)

    def codes(self) -> np.ndarray:
        """Per-value integer codes in logical order, shape ``(n_blocks, 32)``.

        Q4_0: 0..15 (zero point 8); Q8_1: signed -128..127.
        """
        b = self._block_view()
        if self.format == "Q8_1":
            return b[:, 4:].view(np.int8)
        nib = b[:, 2:]
        low, high = nib & 0x0F, nib >> 4
        if self.item_type == Q4_0_LEGACY:
            out = np.empty((self.n_blocks, BLOCK_LEN), dtype=np.uint8)
            out[:, 0::2], out[:, 1::2] = low, high
            return out
        return np.concatenate([low, high], axis=1)

    def scales(self) -> np.ndarray:
        """Per-block f16 scale ``d``, shape ``(n_blocks,)``."""
        return np.ascontiguousarray(self._block_view()[:, 0:2]).view("<f2").reshape(-1)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """``np.asarray(t)``: the dequantized values (a new float32 array each time)."""
        values = self.dequantize()
        return values if dtype is None else values.astype(dtype, copy=False)

    def dequantize(self) -> np.ndarray:
        """float32 values of ``shape``, as tract computes them."""
        d = self.scales().astype(np.float32)[:, None]
        q = self.codes()
        if self.format == "Q4_0":
            values = (q.astype(np.int8) - np.int8(8)).astype(np.float32) * d
        else:
            values = q.astype(np.float32) * d
        return values.reshape(self.shape)

    def to_ggml_order(self) -> "BlockQuantTensor":
        """A Q4_0 legacy-order tensor rewritten in GGML nibble order (what tract does on load)."""
        if self.item_type != Q4_0_LEGACY:
            return self
        return _pack_q4_0(self.shape, self.scales(), self.codes(), Q4_0_GGML)

    # ------------------------------------------------------------------------------------------
    @classmethod
    def quantize_q4_0(cls, values: np.ndarray, item_type: int = Q4_0_GGML) -> "BlockQuantTensor":
        """Quantize float values to Q4_0 the way tract's quantizer does (see module docstring)."""
        with np.errstate(all="ignore"):  # inf/NaN follow IEEE then Rust's saturating casts, as in tract
            return cls._quantize_q4_0(values, item_type)

    @classmethod
    def _quantize_q4_0(cls, values: np.ndarray, item_type: int) -> "BlockQuantTensor":
        blocks, shape = _blocks_of(values)
        m = _signed_absmax(blocks)
        scale = (m / np.float32(-8.0)).astype(np.float32)
        with np.errstate(divide="ignore"):
            r_scale = np.where(scale == 0, np.float32(0), np.float32(1) / scale).astype(np.float32)
        x = blocks * r_scale[:, None] + np.float32(8.5)
        q = _saturating_i8(x)
        q = np.minimum(q, 15).astype(np.uint8) & 0x0F
        with np.errstate(over="ignore"):
            return _pack_q4_0(shape, scale.astype(np.float16), q, item_type)

    @classmethod
    def quantize_q8_1(cls, values: np.ndarray, item_type: int = Q8_1_WRITTEN) -> "BlockQuantTensor":
        """Quantize float values to Q8_1 the way tract's quantizer does."""
        with np.errstate(all="ignore"):
            return cls._quantize_q8_1(values, item_type)

    @classmethod
    def _quantize_q8_1(cls, values: np.ndarray, item_type: int) -> "BlockQuantTensor":
        blocks, shape = _blocks_of(values)
        m = _signed_absmax(blocks)
        scale = (m / np.float32(127.0)).astype(np.float32)
        with np.errstate(divide="ignore"):
            r_scale = np.where(scale == 0, np.float32(0), np.float32(1) / scale).astype(np.float32)
        x = blocks * r_scale[:, None]
        t = np.trunc(x)
        rounded = t + np.sign(x) * (np.abs(x - t) >= 0.5)  # half away from zero, like f32::round
        q = _saturating_i8(rounded).astype(np.int8)
        total = np.cumsum(blocks, axis=1, dtype=np.float32)[:, -1] if blocks.size else np.zeros(0, np.float32)
        out = np.empty((blocks.shape[0], 36), dtype=np.uint8)
        with np.errstate(over="ignore"):  # f16 overflow gives inf, as in tract
            out[:, 0:2] = scale.astype("<f2").view(np.uint8).reshape(-1, 2)
            out[:, 2:4] = total.astype("<f2").view(np.uint8).reshape(-1, 2)
        out[:, 4:] = q.view(np.uint8)
        return cls(shape=shape, blocks=out.reshape(-1), item_type=item_type)


def _blocks_of(values: np.ndarray) -> tuple[np.ndarray, tuple[int, ...]]:
    arr = np.asarray(values, dtype=np.float32)
    if arr.ndim < 1 or arr.size % BLOCK_LEN or (arr.shape[-1] % BLOCK_LEN):
        raise TensorFileError(f"block quantization needs a last axis multiple of {BLOCK_LEN}, "
                              f"got shape {list(arr.shape)}")
    return arr.reshape(-1, BLOCK_LEN), tuple(int(d) for d in arr.shape)


def _signed_absmax(blocks: np.ndarray) -> np.ndarray:
    """Per block, the first value of largest magnitude, with its sign (tract's strict ``<`` scan
    starting from +0.0: a block of zeros or NaNs gives +0.0; NaN never wins a comparison)."""
    a = np.abs(blocks)
    a = np.where(np.isnan(a), -np.inf, a)
    idx = np.argmax(a, axis=1)
    m = blocks[np.arange(blocks.shape[0]), idx]
    best = a[np.arange(blocks.shape[0]), idx]
    return np.where(best > 0, m, np.float32(0.0)).astype(np.float32)


def _saturating_i8(x: np.ndarray) -> np.ndarray:
    """Rust's ``f32 as i8``: truncate toward zero, saturate, NaN -> 0."""
    x = np.where(np.isnan(x), 0, x)
    return np.clip(np.trunc(x), -128, 127).astype(np.int16)


def _pack_q4_0(shape: tuple[int, ...], scales: np.ndarray, codes: np.ndarray, item_type: int) -> BlockQuantTensor:
    n = codes.shape[0]
    out = np.empty((n, 18), dtype=np.uint8)
    out[:, 0:2] = np.asarray(scales, dtype="<f2").view(np.uint8).reshape(-1, 2)
    codes = codes.astype(np.uint8) & 0x0F
    if item_type == Q4_0_LEGACY:
        out[:, 2:] = codes[:, 0::2] | (codes[:, 1::2] << 4)
    else:
        out[:, 2:] = codes[:, :16] | (codes[:, 16:] << 4)
    return BlockQuantTensor(shape=tuple(shape), blocks=out.reshape(-1), item_type=item_type)
