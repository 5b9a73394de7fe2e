"""Sub-byte packing of quantization codes (1..8 bits per code), vectorised with NumPy.

Two layouts, both along the last axis of a ``[..., n]`` array of codes:

* **bitstream** (:func:`pack_bits` / :func:`unpack_bits`): codes laid LSB-first one after the
  other, crossing byte boundaries when ``bits`` does not divide 8 (3, 5, 6, 7 bits). ``n`` codes take
  ``ceil(n * bits / 8)`` bytes. For 4 bits this is tract's nibble layout (even index = low nibble).
* **planar** (:func:`pack_planar` / :func:`unpack_planar`, bits 1, 2, 4, 8 only): with
  ``per = 8 // bits`` codes a byte and ``m = ceil(n / per)`` bytes, byte ``j`` holds codes
  ``j, j + m, j + 2m, ...`` (code ``k*m + j`` in bit field ``k``). Unpacking is ``per`` whole-row
  shift-and-mask operations writing contiguous slices, which is what the attention kernel wants.

:class:`RowCodec` picks the layout for a bit width (planar when possible, bitstream otherwise) and is
what the caches use.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["pack_bits", "unpack_bits", "pack_planar", "unpack_planar", "packed_len", "RowCodec"]


def _check_bits(bits: int) -> None:
    if not 1 <= int(bits) <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")


def packed_len(n: int, bits: int) -> int:
    """Bytes taken by ``n`` codes of ``bits`` bits (both layouts)."""
    _check_bits(bits)
    return (n * bits + 7) // 8


def pack_bits(codes: np.ndarray, bits: int) -> np.ndarray:
    """Bitstream-pack the last axis of ``codes`` (values < 2**bits) into uint8."""
    _check_bits(bits)
    codes = np.asarray(codes)
    n = codes.shape[-1]
    lead = codes.shape[:-1]
    out_len = packed_len(n, bits)
    if bits == 8:
        return codes.astype(np.uint8, copy=True)
    groups = -(-n // 8)  # 8 codes fill exactly `bits` bytes
    padded = np.zeros(lead + (groups * 8,), dtype=np.uint64)
    padded[..., :n] = codes & ((1 << bits) - 1)
    padded = padded.reshape(lead + (groups, 8))
    shifts = (np.arange(8, dtype=np.uint64) * np.uint64(bits))
    words = np.bitwise_or.reduce(padded << shifts, axis=-1)  # [..., groups], < 2**(8*bits)
    byte_shifts = np.arange(bits, dtype=np.uint64) * np.uint64(8)
    out = ((words[..., None] >> byte_shifts) & np.uint64(0xFF)).astype(np.uint8)
    return out.reshape(lead + (groups * bits,))[..., :out_len].copy()


def unpack_bits(packed: np.ndarray, bits: int, n: int) -> np.ndarray:
    """Inverse of :func:`pack_bits`: ``[..., ceil(n*bits/8)]`` uint8 -> ``[..., n]`` uint8 codes."""
    _check_bits(bits)
    packed = np.asarray(packed, dtype=np.uint8)
    lead = packed.shape[:-1]
    if packed.shape[-1] != packed_len(n, bits):
        raise ValueError(f"{packed.shape[-1]} bytes cannot hold exactly {n} codes of {bits} bits")
    if bits == 8:
        return packed.copy()
    groups = -(-n // 8)
    buf = np.zeros(lead + (groups * bits,), dtype=np.uint64)
    buf[..., : packed.shape[-1]] = packed
    buf = buf.reshape(lead + (groups, bits))
    words = np.bitwise_or.reduce(buf << (np.arange(bits, dtype=np.uint64) * np.uint64(8)), axis=-1)
    shifts = np.arange(8, dtype=np.uint64) * np.uint64(bits)
    codes = ((words[..., None] >> shifts) & np.uint64((1 << bits) - 1)).astype(np.uint8)
    return codes.reshape(lead + (groups * 8,))[..., :n].copy()


def pack_planar(codes: np.ndarray, bits: int) -> np.ndarray:
    """Planar-pack the last axis (bits 1, 2, 4 or 8); see the module docstring."""
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"planar layout needs bits in 1, 2, 4, 8, got {bits}")
    codes = np.asarray(codes)
    n = codes.shape[-1]
    per = 8 // bits
    m = -(-n // per)
    padded = np.zeros(codes.shape[:-1] + (m * per,), dtype=np.uint8)
    padded[..., :n] = codes & ((1 << bits) - 1)
    out = np.zeros(codes.shape[:-1] + (m,), dtype=np.uint8)
    for k in range(per):
        out |= padded[..., k * m : (k + 1) * m] << np.uint8(k * bits)
    return out


def unpack_planar(packed: np.ndarray, bits: int, n: int, out: np.ndarray | None = None) -> np.ndarray:
    """Inverse of :func:`pack_planar`. ``out`` (any numeric dtype, last axis ``n``) receives the codes."""
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"planar layout needs bits in 1, 2, 4, 8, got {bits}")
    packed = np.asarray(packed)
    per = 8 // bits
    m = packed.shape[-1]
    if m != -(-n // per):
        raise ValueError(f"{m} bytes cannot hold exactly {n} codes of {bits} bits")
    if out is None:
        out = np.empty(packed.shape[:-1] + (n,), dtype=np.uint8)
    if bits == 8:
        np.copyto(out, packed, casting="unsafe")
        return out
    mask = np.uint8((1 << bits) - 1)
    for k in range(per):
        lo, hi = k * m, min((k + 1) * m, n)
        if lo >= hi:
            break
        src = packed[..., : hi - lo]
        if k == 0:
            np.bitwise_and(src, mask, out=out[..., lo:hi], casting="unsafe")
        elif k == per - 1:
            np.right_shift(src, np.uint8(k * bits), out=out[..., lo:hi], casting="unsafe")
        else:
            np.bitwise_and(src >> np.uint8(k * bits), mask, out=out[..., lo:hi], casting="unsafe")
    return out


@dataclass(frozen=True)
class RowCodec:
    """Packs rows of ``n`` codes at ``bits`` bits: planar for 1/2/4/8 bits, bitstream otherwise."""

    bits: int
    n: int

    def __post_init__(self) -> None:
        _check_bits(self.bits)
        if self.n < 1:
            raise ValueError("rows must hold at least one code")

    @property
    def planar(self) -> bool:
        return self.bits in (1, 2, 4, 8)

    @property
    def row_bytes(self) -> int:
        if self.planar:
            return -(-self.n // (8 // self.bits))
        return packed_len(self.n, self.bits)

    def pack(self, codes: np.ndarray) -> np.ndarray:
        return pack_planar(codes, self.bits) if self.planar else pack_bits(codes, self.bits)

    def unpack(self, packed: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        if self.planar:
            return unpack_planar(packed, self.bits, self.n, out=out)
        codes = unpack_bits(packed, self.bits, self.n)
        if out is None:
            return codes
        np.copyto(out, codes, casting="unsafe")
        return out
