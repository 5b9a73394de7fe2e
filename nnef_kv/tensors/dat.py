"""The NNEF binary tensor file (``.dat``): a 128-byte little-endian header then the payload.

Header layout (offsets in bytes): magic ``4E EF`` (0), version major/minor (2, 3), payload length
u32 (4), rank u32 <= 8 (8), eight u32 extents (12), bits per item u32 (44), item type u32 whose
low 16 bits are the type code and high 16 bits the vendor (48), 76 reserved bytes (52).

Item types read and written:

=========================  =====================  ==========================================
vendor / code              bits                   Python value
=========================  =====================  ==========================================
0 / 0 IEEE float           16, 32, 64             float16/32/64 array
0 / 1 unsigned, 2 q-uint   8, 16, 32, 64          uint array
0 / 3 q-int, 4 signed      8, 16, 32, 64          int array
0 / 5 bool                 1 (MSB first), 8       bool array
'TR' / 0x1000 string       any (tract: 2^32-1)    object array of ``str``
'TR' / 0 complex float     32, 64, 128            (re, im) f16 structured / complex64 / complex128
'TR' / 4 complex int       32, 64, 128            (re, im) structured int16/32/64
'TR' / 0x2040, 0x3040      Q4_0 legacy / GGML     :class:`BlockQuantTensor`
'TR' / 0x3080, 0x3081      Q8_1                   :class:`BlockQuantTensor`
=========================  =====================  ==========================================

Round trips are bit-exact: :func:`read_tensor` with ``with_info=True`` also returns a
:class:`DatInfo` (the header fields that a numpy dtype does not say: item type code, bits, vendor,
version, reserved bytes, payload length of string tensors, trailing bytes) and
:func:`write_tensor` with ``info=`` writes exactly those again. Without ``info`` the writer uses
the Khronos encoding (unsigned = 1, signed = 4, bool = 1 bit), which both Khronos' ``nnef`` and
tract read.

Where the two tools differ, nnef-kv follows tract (the oracle for archives): any minor version of
major 1 is read (Khronos: only 1.0); an item type 1 with a non-zero first reserved word stays
unsigned (Khronos' reader reinterprets it as signed); a 1-bit bool payload may hold one byte more
than needed; bytes after the payload are ignored (kept in ``DatInfo.trailing``). Q8_1 is read under
both codes tract uses (0x3080 read by tract, 0x3081 written by tract).

Large payloads are not copied: a path is memory-mapped read-only and arrays are ``np.frombuffer``
views into the map (or into the bytes given to :func:`decode_tensor`).
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field, replace
from typing import BinaryIO, Union

import numpy as np

from ..atomic import atomic_write
from ..errors import LimitError, TensorFileError
from ..limits import Limits, current_limits
from ..targets import kind_of, path_arg, resolve
from .blockquant import FORMATS as BLOCK_FORMATS
from .blockquant import BlockQuantTensor

__all__ = [
    "BlockQuantTensor",
    "DatInfo",
    "TensorValue",
    "read_tensor",
    "write_tensor",
    "decode_tensor",
    "encode_tensor",
    "encode_parts",
    "default_info",
    "info_fits",
    "HEADER_SIZE",
    "TRACT_VENDOR",
]

HEADER_SIZE = 128
MAGIC = b"\x4e\xef"
MAX_RANK = 8
TRACT_VENDOR = (ord("T") << 8) | ord("R")  # 0x5452
STRING_BITS = 0xFFFFFFFF

FLOAT, UINT, QUINT, QINT, INT, BOOL = 0, 1, 2, 3, 4, 5
TR_COMPLEX_FLOAT, TR_COMPLEX_INT, TR_STRING = 0x0000, 0x0004, 0x1000

_HEADER = struct.Struct("<2sBBII8III")  # magic, major, minor, data length, rank, extents, bits, item type
_RESERVED = HEADER_SIZE - _HEADER.size  # 76

TensorValue = Union[np.ndarray, BlockQuantTensor]

_COMPLEX_F16 = np.dtype([("re", "<f2"), ("im", "<f2")])
_COMPLEX_INT = {bits: np.dtype([("re", f"<i{bits // 16}"), ("im", f"<i{bits // 16}")]) for bits in (32, 64, 128)}


@dataclass(frozen=True)
class DatInfo:
    """How a tensor was (or will be) encoded: the header fields that the value's dtype does not fix.

    ``shape`` and ``data_length`` are the header's extents and payload length as read.
    """

    item_type: int
    bits_per_item: int
    vendor: int = 0
    shape: tuple[int, ...] = ()
    data_length: int = 0
    version: tuple[int, int] = (1, 0)
    reserved: bytes = field(default=bytes(_RESERVED), repr=False)
    trailing: bytes = field(default=b"", repr=False)

    @property
    def type_name(self) -> str:
        """Short human description, e.g. ``"f32"``, ``"i64 (quantized signed)"``, ``"Q4_0 (legacy order)"``."""
        return describe(self.vendor, self.item_type, self.bits_per_item)


def describe(vendor: int, code: int, bits: int) -> str:
    """Human name of an item type triple."""
    if vendor == 0:
        names = {
            FLOAT: f"f{bits}",
            UINT: f"u{bits}",
            QUINT: f"u{bits} (quantized unsigned)",
            QINT: f"i{bits} (quantized signed)",
            INT: f"i{bits}",
            BOOL: f"bool ({bits} bit{'s' if bits != 1 else ''})",
        }
        return names.get(code, f"unknown item type {code}")
    if vendor == TRACT_VENDOR:
        if code == TR_STRING:
            return "string"
        if code == TR_COMPLEX_FLOAT:
            return f"complex f{bits // 2}"
        if code == TR_COMPLEX_INT:
            return f"complex i{bits // 2}"
        if code in BLOCK_FORMATS:
            fmt = BLOCK_FORMATS[code][0]
            detail = {
                0x2040: "legacy order",
                0x3040: "GGML order",
                0x3080: "tract read code",
                0x3081: "tract write code",
            }
            return f"{fmt} ({detail[code]})"
        return f"unknown tract item type 0x{code:04x}"
    return f"unknown vendor 0x{vendor:04x} item type {code}"


# ----------------------------------------------------------------------------------------------
# dtype <-> item type
# ----------------------------------------------------------------------------------------------
def _plain_dtype(vendor: int, code: int, bits: int) -> np.dtype | None:
    """numpy dtype of a fixed-size item type, or None when it is not one."""
    if vendor == 0:
        if code == FLOAT and bits in (16, 32, 64):
            return np.dtype(f"<f{bits // 8}")
        if code in (UINT, QUINT) and bits in (8, 16, 32, 64):
            return np.dtype(f"<u{bits // 8}")
        if code in (QINT, INT) and bits in (8, 16, 32, 64):
            return np.dtype(f"<i{bits // 8}")
        if code == BOOL and bits in (1, 8):
            return np.dtype(np.bool_)
        return None
    if vendor == TRACT_VENDOR:
        if code == TR_COMPLEX_FLOAT:
            return {32: _COMPLEX_F16, 64: np.dtype("<c8"), 128: np.dtype("<c16")}.get(bits)
        if code == TR_COMPLEX_INT:
            return _COMPLEX_INT.get(bits)
    return None


def _is_string_array(arr: np.ndarray) -> bool:
    if arr.dtype.kind == "U":
        return True
    if arr.dtype == object:
        return all(isinstance(x, str) for x in arr.flat)
    return False


def default_info(value: TensorValue) -> DatInfo:
    """The encoding nnef-kv uses for a value when nothing else is known (Khronos codes)."""
    if isinstance(value, BlockQuantTensor):
        return DatInfo(value.item_type, STRING_BITS, TRACT_VENDOR, value.shape)
    arr = np.asarray(value)
    dt = arr.dtype
    shape = tuple(int(d) for d in arr.shape)
    if dt.kind == "f" and dt.itemsize in (2, 4, 8):
        return DatInfo(FLOAT, dt.itemsize * 8, 0, shape)
    if dt.kind == "u" and dt.itemsize in (1, 2, 4, 8):
        return DatInfo(UINT, dt.itemsize * 8, 0, shape)
    if dt.kind == "i" and dt.itemsize in (1, 2, 4, 8):
        return DatInfo(INT, dt.itemsize * 8, 0, shape)
    if dt.kind == "b":
        return DatInfo(BOOL, 1, 0, shape)
    if dt.kind == "c" and dt.itemsize in (8, 16):
        return DatInfo(TR_COMPLEX_FLOAT, dt.itemsize * 8, TRACT_VENDOR, shape)
    if dt == _COMPLEX_F16.newbyteorder("="):
        return DatInfo(TR_COMPLEX_FLOAT, 32, TRACT_VENDOR, shape)
    for bits, cdt in _COMPLEX_INT.items():
        if dt == cdt.newbyteorder("="):
            return DatInfo(TR_COMPLEX_INT, bits, TRACT_VENDOR, shape)
    if _is_string_array(arr):
        return DatInfo(TR_STRING, STRING_BITS, TRACT_VENDOR, shape)
    raise TensorFileError(f"no .dat item type for numpy dtype {dt}")


def info_fits(info: DatInfo, value: TensorValue) -> bool:
    """Whether ``info`` can encode ``value`` (same kind of item; the shape may differ)."""
    if isinstance(value, BlockQuantTensor):
        return info.vendor == TRACT_VENDOR and info.item_type == value.item_type
    arr = np.asarray(value)
    if info.vendor == TRACT_VENDOR and info.item_type == TR_STRING:
        return _is_string_array(arr)
    dt = _plain_dtype(info.vendor, info.item_type, info.bits_per_item)
    return dt is not None and dt.newbyteorder("=") == arr.dtype.newbyteorder("=")


# ----------------------------------------------------------------------------------------------
# decoding
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Header:
    major: int
    minor: int
    data_length: int
    shape: tuple[int, ...]
    bits: int
    code: int
    vendor: int
    reserved: bytes


def _parse_header(raw: bytes | memoryview, name: str) -> _Header:
    if len(raw) < HEADER_SIZE:
        raise TensorFileError(f"{name}: truncated header ({len(raw)} bytes, 128 expected)")
    magic, major, minor, length, rank, *rest = _HEADER.unpack_from(raw, 0)
    extents, bits, item_type = rest[:8], rest[8], rest[9]
    if magic != MAGIC:
        raise TensorFileError(f"{name}: not an NNEF tensor file (magic {bytes(magic).hex()}, expected 4eef)")
    if major != 1:
        raise TensorFileError(f"{name}: unsupported tensor file version {major}.{minor} (1.x expected)")
    if rank > MAX_RANK:
        raise TensorFileError(f"{name}: rank {rank} exceeds the maximum of {MAX_RANK}")
    return _Header(
        major=major,
        minor=minor,
        data_length=length,
        shape=tuple(extents[:rank]),
        bits=bits,
        code=item_type & 0xFFFF,
        vendor=item_type >> 16,
        reserved=bytes(raw[_HEADER.size:HEADER_SIZE]),
    )


def _count(h: _Header, name: str) -> int:
    count, nonzero = 1, 1
    for d in h.shape:
        count *= d
        nonzero *= d or 1
    # numpy cannot describe an array whose non-zero extents multiply past ~2^63 bytes, even an empty one
    # (shape [50331650, 0, 1392508931, 65536]): refuse those too (2^58 items leaves room for 16-byte items)
    if nonzero >= 1 << 58:
        what = "dims" if count else "non-zero dims"
        raise TensorFileError(f"{name}: the product of {what} {list(h.shape)} overflows")
    return count


def _check_limit(nbytes: int, limits: Limits, name: str) -> None:
    if nbytes > limits.max_tensor_bytes:
        raise LimitError(f"{name}: tensor payload of {nbytes} bytes exceeds max_tensor_bytes={limits.max_tensor_bytes}")


def _payload_length(h: _Header, name: str) -> int | None:
    """Payload bytes the header announces (None for strings, whose length is read item by item)."""
    count = _count(h, name)
    if h.vendor not in (0, TRACT_VENDOR):
        raise TensorFileError(f"{name}: unknown item type vendor 0x{h.vendor:04x}")
    if h.vendor == TRACT_VENDOR and h.code == TR_STRING:
        return None
    if h.vendor == TRACT_VENDOR and h.code in BLOCK_FORMATS:
        if len(h.shape) < 2:
            raise TensorFileError(f"{name}: block-quantized tensor of rank {len(h.shape)} (>= 2 expected)")
        k = count // h.shape[0] if h.shape[0] else int(np.prod(h.shape[1:], dtype=object))
        if k % 32:
            raise TensorFileError(f"{name}: block-quantized rows of {k} values are not a multiple of 32")
        expected = count // 32 * BLOCK_FORMATS[h.code][1]
        if expected != h.data_length:
            raise TensorFileError(
                f"{name}: data size {h.data_length} != {expected} bytes for {describe(h.vendor, h.code, h.bits)} "
                f"of shape {list(h.shape)}"
            )
        return expected
    dt = _plain_dtype(h.vendor, h.code, h.bits)
    if dt is None:
        raise TensorFileError(
            f"{name}: unsupported item type {describe(h.vendor, h.code, h.bits)} with {h.bits} bits per item"
        )
    expected = (count * h.bits + 7) // 8
    if h.vendor == 0 and h.code == BOOL and h.data_length == expected + 1 and count * h.bits % 8 == 0:
        return h.data_length  # tract accepts one spare byte for bools when the bits fill whole bytes
    if expected != h.data_length:
        raise TensorFileError(
            f"{name}: data size {h.data_length} bytes does not match shape {list(h.shape)} x {h.bits} bits "
            f"({expected} bytes expected)"
        )
    return expected


def _decode_strings(h: _Header, payload: memoryview, name: str, limits: Limits) -> tuple[np.ndarray, int]:
    count = _count(h, name)
    if count * 4 > len(payload):
        raise TensorFileError(f"{name}: {count} strings cannot fit in {len(payload)} payload bytes")
    out = np.empty(count, dtype=object)
    pos = 0
    for i in range(count):
        if pos + 4 > len(payload):
            raise TensorFileError(f"{name}: string {i} length runs past the end of the file")
        (n,) = struct.unpack_from("<I", payload, pos)
        pos += 4
        if pos + n > len(payload):
            raise TensorFileError(f"{name}: string {i} of {n} bytes runs past the end of the file")
        _check_limit(pos + n, limits, name)
        try:
            out[i] = bytes(payload[pos : pos + n]).decode("utf-8")
        except UnicodeDecodeError as e:
            raise TensorFileError(f"{name}: string {i} is not valid UTF-8 ({e.reason} at byte {e.start})") from None
        pos += n
    return out.reshape(h.shape), pos


def _decode_payload(
    h: _Header, payload: memoryview, name: str, limits: Limits, keep_trailing: bool = True
) -> tuple[TensorValue, DatInfo]:
    length = _payload_length(h, name)
    if length is None:
        value, used = _decode_strings(h, payload, name, limits)
    else:
        _check_limit(length, limits, name)
        if len(payload) < length:
            raise TensorFileError(f"{name}: truncated file ({len(payload)} payload bytes, {length} expected)")
        used = length
        data = payload[:length]
        if h.vendor == TRACT_VENDOR and h.code in BLOCK_FORMATS:
            blocks = np.frombuffer(data, dtype=np.uint8)
            value = BlockQuantTensor(shape=h.shape, blocks=blocks, item_type=h.code)
        elif h.vendor == 0 and h.code == BOOL and h.bits == 1:
            count = _count(h, name)
            bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), count=count)
            value = bits.astype(np.bool_).reshape(h.shape)
        elif h.vendor == 0 and h.code == BOOL:
            raw = np.frombuffer(data, dtype=np.uint8, count=_count(h, name))
            # bytes other than 0/1 mean true; normalise them (the only non-exact round trip)
            value = (raw.view(np.bool_) if not (raw > 1).any() else raw != 0).reshape(h.shape)
        else:
            dt = _plain_dtype(h.vendor, h.code, h.bits)
            assert dt is not None
            value = np.frombuffer(data, dtype=dt).reshape(h.shape)
    trailing = bytes(payload[used:]) if keep_trailing and len(payload) > used else b""
    info = DatInfo(
        item_type=h.code,
        bits_per_item=h.bits,
        vendor=h.vendor,
        shape=h.shape,
        data_length=h.data_length,
        version=(h.major, h.minor),
        reserved=h.reserved,
        trailing=trailing,
    )
    return value, info


def decode_tensor(
    buffer: bytes | bytearray | memoryview | mmap.mmap, *, name: str = "<tensor>", limits: Limits | None = None
) -> tuple[TensorValue, DatInfo]:
    """Decode a whole ``.dat`` file held in memory; arrays are read-only views into ``buffer``."""
    limits = limits or current_limits()
    view = memoryview(buffer).cast("B") if not isinstance(buffer, memoryview) else buffer.cast("B")
    h = _parse_header(view[:HEADER_SIZE], name)
    return _decode_payload(h, view[HEADER_SIZE:], name, limits)


def read_tensor(
    source: str | os.PathLike | BinaryIO,
    *,
    with_info: bool = False,
    limits: Limits | None = None,
    name: str | None = None,
) -> TensorValue | tuple[TensorValue, DatInfo]:
    """Read a ``.dat`` file from a path (memory-mapped) or a binary file object.

    Returns a numpy array (a :class:`BlockQuantTensor` for Q4_0/Q8_1), or ``(value, DatInfo)``
    with ``with_info=True``. Errors are :class:`TensorFileError` naming the file.
    """
    limits = limits or current_limits()
    if isinstance(source, (str, os.PathLike, bytes, bytearray)) or not hasattr(source, "read"):
        path = path_arg(source, "nnef_kv.read_tensor", "the path of a .dat file or a binary file object")
        label = name or path
        kind = kind_of(resolve(path))
        if kind != "file":
            raise TensorFileError(f"{label}: {'no such file' if kind == 'absent' else 'is a ' + kind}, not a .dat file")
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size == 0:
                    raise TensorFileError(f"{label}: truncated header (0 bytes, 128 expected)")
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise TensorFileError(f"{label}: cannot read ({e.strerror or e})") from None
        value, info = decode_tensor(mm, name=label, limits=limits)
    else:
        label = name or getattr(source, "name", None) or "<stream>"
        label = str(label)
        raw = source.read(HEADER_SIZE)
        h = _parse_header(raw, label)
        length = _payload_length(h, label)
        if length is None:  # strings: the payload ends where the last string ends
            payload = _read_bounded(source, limits.max_tensor_bytes + 1)
        else:
            _check_limit(length, limits, label)
            payload = _read_bounded(source, length)
        value, info = _decode_payload(h, memoryview(payload), label, limits, keep_trailing=length is None)
    return (value, info) if with_info else value


def _read_bounded(source: BinaryIO, most: int, chunk: int = 1 << 20) -> bytes:
    """Read until EOF or ``most`` bytes, in chunks (``read(huge)`` may allocate ``huge`` upfront)."""
    parts: list[bytes] = []
    total = 0
    while total < most:
        piece = source.read(min(chunk, most - total))
        if not piece:
            break
        parts.append(piece)
        total += len(piece)
    return b"".join(parts)


# ----------------------------------------------------------------------------------------------
# encoding
# ----------------------------------------------------------------------------------------------
def _header_bytes(info: DatInfo, shape: tuple[int, ...], data_length: int, name: str) -> bytes:
    if len(shape) > MAX_RANK:
        raise TensorFileError(f"{name}: rank {len(shape)} exceeds the maximum of {MAX_RANK}")
    if any(d >= 1 << 32 for d in shape) or data_length >= 1 << 32:
        raise TensorFileError(f"{name}: shape {list(shape)} / {data_length} bytes do not fit the u32 header fields")
    extents = list(shape) + [0] * (MAX_RANK - len(shape))
    head = _HEADER.pack(
        MAGIC,
        info.version[0],
        info.version[1],
        data_length,
        len(shape),
        *extents,
        info.bits_per_item,
        (info.vendor << 16) | info.item_type,
    )
    reserved = info.reserved if len(info.reserved) == _RESERVED else bytes(_RESERVED)
    return head + reserved


def encode_parts(
    value: TensorValue, info: DatInfo | None = None, *, name: str = "<tensor>"
) -> list[bytes | memoryview]:
    """The bytes of a ``.dat`` file as a list of buffers (header first); large arrays are not copied.

    ``info`` (from :func:`read_tensor` ``with_info=True``) is honoured when it fits the value
    (:func:`info_fits`); otherwise :class:`TensorFileError`.
    """
    if info is None:
        info = default_info(value)
    elif not info_fits(info, value):
        raise TensorFileError(f"{name}: encoding {info.type_name} does not fit a value of {_kind(value)}")
    if isinstance(value, BlockQuantTensor):
        payload: list[bytes | memoryview] = [memoryview(np.ascontiguousarray(value.blocks)).cast("B")]
        # tract reads block-quant files of rank >= 2 only: a rank-1 tensor is stored as [1, n]
        shape = value.shape if len(value.shape) >= 2 else (1, *value.shape)
        length = value.nbytes
    else:
        arr = np.asarray(value)
        shape = tuple(int(d) for d in arr.shape)
        same_shape = shape == info.shape
        if info.vendor == TRACT_VENDOR and info.item_type == TR_STRING:
            chunks: list[bytes | memoryview] = []
            for s in arr.reshape(-1):
                b = str(s).encode("utf-8")
                chunks.append(struct.pack("<I", len(b)) + b)
            payload = [b"".join(chunks)]  # type: ignore[arg-type]
            true_len = len(payload[0])
            # tract writes count * size_of::<String>() here and ignores it on reading: keep what was read
            length = info.data_length if (same_shape and info.data_length) else true_len
        elif info.vendor == 0 and info.item_type == BOOL and info.bits_per_item == 1:
            packed = np.packbits(arr.reshape(-1).astype(np.bool_)).tobytes()
            length = len(packed)
            if same_shape and info.data_length == length + 1:
                packed += b"\0"
                length += 1
            payload = [packed]
        elif info.vendor == 0 and info.item_type == BOOL:
            payload = [np.ascontiguousarray(arr, dtype=np.bool_).view(np.uint8).tobytes()]
            length = len(payload[0])
            if same_shape and info.data_length == length + 1:
                payload.append(b"\0")
                length += 1
        else:
            dt = _plain_dtype(info.vendor, info.item_type, info.bits_per_item)
            assert dt is not None
            data = np.ascontiguousarray(arr, dtype=dt)
            payload = [memoryview(data.reshape(-1)).cast("B")] if data.size else [b""]
            length = data.nbytes
    if info.trailing and shape == info.shape:  # bytes after the payload, kept as read
        payload.append(info.trailing)
    return [_header_bytes(info, shape, length, name), *payload]


def _kind(value: TensorValue) -> str:
    if isinstance(value, BlockQuantTensor):
        return repr(value)
    return f"dtype {np.asarray(value).dtype}"


def encode_tensor(value: TensorValue, info: DatInfo | None = None, *, name: str = "<tensor>") -> bytes:
    """The bytes of a ``.dat`` file (a copy; prefer :func:`write_tensor` for large tensors)."""
    return b"".join(bytes(p) for p in encode_parts(value, info, name=name))


def write_tensor(
    target: str | os.PathLike | BinaryIO, value: TensorValue, *, info: DatInfo | None = None
) -> None:
    """Write a ``.dat`` file to a path (atomically) or to a binary file object."""
    if isinstance(target, (str, os.PathLike, bytes, bytearray)) or not hasattr(target, "write"):
        name = path_arg(target, "nnef_kv.write_tensor", "the path of the .dat file to write or a binary file object")
        parts = encode_parts(value, info, name=name)
        with atomic_write(name) as f:
            for p in parts:
                f.write(p)
    else:
        parts = encode_parts(value, info, name=str(getattr(target, "name", "<stream>")))
        for p in parts:
            target.write(p)


def payload_size(parts: list[bytes | memoryview]) -> int:
    """Total bytes of :func:`encode_parts` output."""
    return sum(memoryview(p).nbytes for p in parts)


def with_shape(info: DatInfo, shape: tuple[int, ...]) -> DatInfo:
    """``info`` for a value of another shape (drops the fields tied to the old payload)."""
    return replace(info, shape=tuple(shape), data_length=0, trailing=b"")

