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
what the caches use for single rows. :class:`GroupCodec` is what the KIVI cache stores: for 2, 4 and 8
codes a byte it packs *across tokens* inside each group of ``group`` tokens (see its docstring), so that
unpacking writes long contiguous runs of whole rows (the layout the attention matmuls read).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["pack_bits", "unpack_bits", "pack_planar", "unpack_planar", "packed_len", "RowCodec", "GroupCodec"]


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


_SPLITS = {3: (2, 1), 5: (4, 1), 6: (4, 2), 7: (4, 2, 1)}  # field widths of the split layout


@dataclass(frozen=True)
class GroupCodec:
    """Codes of rows of ``n`` channels stored in groups of ``group`` consecutive rows (tokens).

    With ``per = 8 // bits`` codes a byte (bits 1, 2, 4), ``n % per == 0`` and ``group % per == 0``,
    the layout is **token-planar** inside each group: the group's ``group * n * bits / 8`` bytes are a
    ``[group / per, n]`` byte matrix whose byte ``(r, c)`` holds the codes of channel ``c`` for rows
    ``r, r + group/per, r + 2 group/per, ...`` (row ``k * group/per + r`` in bit field ``k``). Unpacking
    a group is then ``per`` shift-and-mask operations, each writing ``group / per`` whole rows (long
    contiguous runs, straight into the f32 buffer the attention matmuls read). The packed array keeps
    the shape ``[..., rows, row_bytes]`` (``row_bytes = n / per``): only the order of the bytes inside a
    group differs. 8 bits are plain bytes.

    3, 5, 6 and 7 bits are **split** into token-planar fields of 2/1, 4/1, 4/2 and 4/2/1 bits when
    ``n * bits % 8 == 0`` and ``group`` is a multiple of every field's codes-a-byte: the group's bytes
    are the token-planar byte matrices of the low bits, then of the next bits, ...; a code is
    ``low | next << w0 | ...``. Unpacking is a few whole-array uint8 operations a field and one cast.
    Other cases (sizes that do not divide) use :class:`RowCodec` row by row.
    """

    bits: int
    n: int
    group: int

    def __post_init__(self) -> None:
        _check_bits(self.bits)
        if self.n < 1 or self.group < 1:
            raise ValueError("rows must hold at least one code and groups at least one row")

    @property
    def per(self) -> int:
        return 8 // self.bits if self.bits in (1, 2, 4, 8) else 0

    @property
    def token_planar(self) -> bool:
        """True when groups are packed across tokens (bits 1/2/4 with sizes that divide)."""
        per = self.per
        return per > 1 and self.n % per == 0 and self.group % per == 0

    @property
    def split(self) -> tuple[int, ...] | None:
        """Field widths of the split layout (3 -> (2, 1), 5 -> (4, 1), 6 -> (4, 2), 7 -> (4, 2, 1)),
        or None when it does not apply."""
        ws = _SPLITS.get(self.bits)
        if ws is None or (self.n * self.bits) % 8 or any(self.group % (8 // w) for w in ws):
            return None
        return ws

    @property
    def layout(self) -> str:
        """``"bytes"`` (8 bits), ``"token_planar"`` (1/2/4), ``"split"`` (3/5/6/7) or ``"rows"``."""
        if self.bits == 8:
            return "bytes"
        if self.token_planar:
            return "token_planar"
        return "split" if self.split else "rows"

    @property
    def row_codec(self) -> RowCodec:
        return RowCodec(self.bits, self.n)

    @property
    def row_bytes(self) -> int:
        return self.row_codec.row_bytes

    def pack(self, codes: np.ndarray) -> np.ndarray:
        """``[..., rows, n]`` codes (rows a multiple of ``group``) -> ``[..., rows, row_bytes]`` uint8."""
        codes = np.asarray(codes)
        if self.split:
            return self._pack_split(codes)
        if not self.token_planar:
            return self.row_codec.pack(codes)
        *lead, rows, n = codes.shape
        if rows % self.group:
            raise ValueError(f"{rows} rows are not whole groups of {self.group}")
        per, sub = self.per, self.group // self.per
        c = codes.reshape(*lead, rows // self.group, per, sub, n).astype(np.uint8) & np.uint8((1 << self.bits) - 1)
        out = c[..., 0, :, :].copy()
        for k in range(1, per):
            out |= c[..., k, :, :] << np.uint8(k * self.bits)
        return out.reshape(*lead, rows, self.row_bytes)

    def _pack_split(self, codes: np.ndarray) -> np.ndarray:
        *lead, rows, n = codes.shape
        if rows % self.group:
            raise ValueError(f"{rows} rows are not whole groups of {self.group}")
        ng = rows // self.group
        c = codes.reshape(*lead, ng, self.group, n).astype(np.uint8)
        parts, shift = [], 0
        for w in self.split:
            per = 8 // w
            f = ((c >> np.uint8(shift)) & np.uint8((1 << w) - 1)).reshape(*lead, ng, per, self.group // per, n)
            b = f[..., 0, :, :].copy()
            for k in range(1, per):
                b |= f[..., k, :, :] << np.uint8(k * w)
            parts.append(b.reshape(*lead, ng, -1))
            shift += w
        return np.concatenate(parts, axis=-1).reshape(*lead, rows, self.row_bytes)

    def _split_unpacker(self, packed: np.ndarray, cap: int = 0):
        """``fn(g0, g1, out)`` for the split layout: groups ``g0:g1`` of ``packed`` ``[L, rows, rb]``
        into ``out`` ``[L, (g1-g0)*group, n]`` (any dtype), through uint8 scratch of ``cap`` groups
        (allocated once; ``cap = 0``: per call)."""
        g, n = self.group, self.n
        lead = packed.shape[0]
        flat = packed.reshape(lead, packed.shape[1] // g, g * self.row_bytes)
        fields = []  # (byte offset, bytes, [per,1,1] shifts, mask, field width, left shift)
        off = shift = 0
        for w in self.split:
            per = 8 // w
            nbytes = (g // per) * n
            fields.append((off, nbytes, per, (np.arange(per, dtype=np.uint8) * np.uint8(w)).reshape(per, 1, 1),
                           np.uint8((1 << w) - 1), np.uint8(shift)))
            off += nbytes
            shift += w
        scr = np.empty((2, lead, cap, g, n), np.uint8) if cap else None

        def fn(g0: int, g1: int, out: np.ndarray) -> np.ndarray:
            nb = g1 - g0
            if scr is not None and nb <= cap:
                acc, tmp = scr[0, :, :nb], scr[1, :, :nb]
            else:
                acc, tmp = np.empty((2, lead, nb, g, n), np.uint8)
            for i, (o, nbytes, per, sh, mask, ls) in enumerate(fields):
                src = flat[:, g0:g1, o:o + nbytes].reshape(lead, nb, 1, g // per, n)
                dst = (acc if i == 0 else tmp).reshape(lead, nb, per, g // per, n)
                np.right_shift(src, sh, out=dst)
                np.bitwise_and(dst, mask, out=dst)
                if i:
                    np.left_shift(tmp, ls, out=tmp)
                    np.bitwise_or(acc, tmp, out=acc)
            np.copyto(out, acc.reshape(lead, nb * g, n), casting="unsafe")
            return out
        return fn

    def _split_scaled_unpacker(self, packed: np.ndarray, buf: np.ndarray):
        """``block_unpacker(scaled=True)`` of the split layout, in f32 with ANDs only (NumPy's uint8
        shifts are slow): the first field's rows come out scaled like a token-planar layout
        (:attr:`plane_scales`); each further field is ANDed out (``next * 2**(j w)`` in its own row
        pattern), multiplied by the exact power of two that puts it at ``2**shift`` times the first
        field's scale of the same row, and added."""
        g, n = self.group, self.n
        lead = packed.shape[0]
        cap = buf.shape[1] // g
        flat = packed.reshape(lead, packed.shape[1] // g, g * self.row_bytes)
        rows = np.arange(g)
        w0 = self.split[0]
        k0 = rows // (g // (8 // w0))
        fields = []  # (byte offset, bytes, per, [per,1,1] masks, [per,1,1] f32 factors or None)
        off = shift = 0
        for i, w in enumerate(self.split):
            per = 8 // w
            sub = g // per
            masks = (np.uint8((1 << w) - 1) << (np.arange(per, dtype=np.uint8) * np.uint8(w))).reshape(per, 1, 1)
            fac = None
            if i:  # constant over each field's rows (narrower fields split the first field's rows)
                expo = (k0 * w0 + shift - (rows // sub) * w).reshape(per, sub)
                assert np.all(expo == expo[:, :1])
                fac = (np.float32(2.0) ** expo[:, :1].astype(np.float32)).reshape(per, 1, 1)
            fields.append((off, sub * n, per, masks, fac))
            off += sub * n
            shift += w
        dst = buf[:, :cap * g].reshape(lead, cap, g, n)
        tmp = np.empty((lead, cap, g, n), buf.dtype)
        band, mul, add = np.bitwise_and, np.multiply, np.add

        def fn(g0: int, g1: int) -> np.ndarray:
            nb = g1 - g0
            d4 = dst if nb == cap else dst[:, :nb]
            t4 = tmp if nb == cap else tmp[:, :nb]
            for o, nbytes, per, masks, fac in fields:
                src = flat[:, g0:g1, o:o + nbytes].reshape(lead, nb, 1, g // per, n)
                if fac is None:
                    band(src, masks, out=d4.reshape(lead, nb, per, g // per, n), casting="unsafe")
                else:
                    t5 = t4.reshape(lead, nb, per, g // per, n)
                    band(src, masks, out=t5, casting="unsafe")
                    mul(t5, fac, out=t5)
                    add(d4, t4, out=d4)
            return buf[:, :nb * g]
        return fn

    def unpack(self, packed: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Inverse of :meth:`pack`: ``[..., rows, row_bytes]`` -> ``[..., rows, n]`` codes (uint8, or
        cast into ``out`` of any numeric dtype, e.g. the f32 buffer of the attention)."""
        packed = np.asarray(packed)
        if out is None:
            out = np.empty(packed.shape[:-1] + (self.n,), np.uint8)
        return self.unpacker()(packed, out)

    def unpacker(self):
        """``fn(packed, out) -> out``: :meth:`unpack` with the layout decisions taken once (the
        attention calls it once per block; ``out`` is required, its last axis ``n``)."""
        if self.split:
            g = self.group

            def unpack_split(packed: np.ndarray, out: np.ndarray) -> np.ndarray:
                rows, nb = packed.shape[-2:]
                if nb != self.row_bytes or rows % g or out.shape[-1] != self.n:
                    raise ValueError(f"packed codes of shape {packed.shape} are not whole groups of {g} rows "
                                     f"of {self.row_bytes} bytes")
                if packed.size == 0:
                    return out
                p3 = packed.reshape((-1, rows, nb))
                o3 = out.reshape((-1, rows, self.n))
                self._split_unpacker(p3)(0, rows // g, o3)
                return out
            return unpack_split
        if not self.token_planar:
            if self.bits == 8:
                def unpack8(packed: np.ndarray, out: np.ndarray) -> np.ndarray:
                    np.copyto(out, packed, casting="unsafe")
                    return out
                return unpack8
            rc = self.row_codec
            return lambda packed, out: rc.unpack(packed, out=out)
        per, sub, n, group, rb = self.per, self.group // self.per, self.n, self.group, self.row_bytes
        mask = np.uint8((1 << self.bits) - 1)
        shifts = [np.uint8(k * self.bits) for k in range(per)]

        def unpack_groups(packed: np.ndarray, out: np.ndarray) -> np.ndarray:
            lead, (rows, nb) = packed.shape[:-2], packed.shape[-2:]
            if nb != rb or rows % group or out.shape[-1] != n:
                raise ValueError(f"packed codes of shape {packed.shape} are not whole groups of {group} rows "
                                 f"of {rb} bytes")
            ng = rows // group
            src = packed.reshape(lead + (ng, sub, n))
            dst = out.reshape(lead + (ng, per, sub, n))
            np.bitwise_and(src, mask, out=dst[..., 0, :, :], casting="unsafe")
            for k in range(1, per - 1):
                np.bitwise_and(np.right_shift(src, shifts[k]), mask, out=dst[..., k, :, :], casting="unsafe")
            np.right_shift(src, shifts[per - 1], out=dst[..., per - 1, :, :], casting="unsafe")
            return out
        return unpack_groups

    @property
    def plane_scales(self) -> np.ndarray | None:
        """For :meth:`block_unpacker` with ``scaled=True``: ``2 ** -(k * bits)`` for bit field ``k``
        (f32, shape ``[per, 1]``, to broadcast over the ``group / per`` rows of each field); ``None``
        when the layout is not token-planar (then the codes come out unscaled)."""
        if self.split:  # the split layout scales like its first (token-planar) field
            w0 = self.split[0]
            return (np.float32(2.0) ** -np.arange(0, 8, w0, dtype=np.float32)).reshape(8 // w0, 1)
        if not self.token_planar:
            return None
        return (np.float32(2.0) ** -np.arange(0, 8, self.bits, dtype=np.float32)).reshape(self.per, 1)

    def block_unpacker(self, packed: np.ndarray, buf: np.ndarray, scaled: bool = False):
        """``fn(g0, g1) -> view``: unpack groups ``g0:g1`` of ``packed`` ``[L, rows, row_bytes]``
        (whole groups) into ``buf[:, :(g1 - g0) * group]`` and return that view; ``buf`` is
        ``[L, cap, n]`` with ``cap`` a multiple of ``group`` (any numeric dtype, f32 for the attention).

        The views of both arrays are built once, so a block costs only its ``per`` NumPy operations
        (the attention's inner loop). ``scaled=True`` (token-planar layout only) leaves each code in
        its bit field: rows of field ``k`` come out as ``code * 2 ** (k * bits)``, one AND per field
        (NumPy's uint8 AND is SIMD, its uint8 right shift is not: ~17% faster for 4 bits); the caller
        multiplies what it computes from those rows by :attr:`plane_scales` (exact: powers of two)."""
        g = self.group
        cap = buf.shape[1] // g
        lead = packed.shape[0]
        if self.split and scaled:
            return self._split_scaled_unpacker(packed, buf)
        if self.split:
            split_fn = self._split_unpacker(packed, cap)

            def split_block(g0: int, g1: int) -> np.ndarray:
                return split_fn(g0, g1, buf[:, :(g1 - g0) * g])
            return split_block
        if not self.token_planar:
            unpack = self.unpacker()

            def rows_fn(g0: int, g1: int) -> np.ndarray:
                return unpack(packed[:, g0 * g:g1 * g], buf[:, :(g1 - g0) * g])
            return rows_fn
        per, sub, n = self.per, g // self.per, self.n
        src = packed.reshape(lead, packed.shape[1] // g, sub, n)
        dst = buf[:, :cap * g].reshape(lead, cap, per, sub, n)
        planes = [dst[:, :, k] for k in range(per)]
        field = (1 << self.bits) - 1
        masks = [np.uint8(field << (k * self.bits)) for k in range(per)]
        mask = np.uint8(field)
        shifts = [np.uint8(k * self.bits) for k in range(per)]
        last = per - 1
        band, rshift = np.bitwise_and, np.right_shift

        def scaled_fn(g0: int, g1: int) -> np.ndarray:
            nb = g1 - g0
            sv = src[:, g0:g1]
            pl = planes if nb == cap else [p[:, :nb] for p in planes]
            for k in range(per):
                band(sv, masks[k], out=pl[k], casting="unsafe")
            return buf[:, :nb * g]

        def groups_fn(g0: int, g1: int) -> np.ndarray:
            nb = g1 - g0
            sv = src[:, g0:g1]
            pl = planes if nb == cap else [p[:, :nb] for p in planes]
            band(sv, mask, out=pl[0], casting="unsafe")
            for k in range(1, last):
                band(rshift(sv, shifts[k]), mask, out=pl[k], casting="unsafe")
            rshift(sv, shifts[last], out=pl[last], casting="unsafe")
            return buf[:, :nb * g]
        return scaled_fn if scaled else groups_fn
