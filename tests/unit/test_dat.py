"""The ``.dat`` codec: bit-exact round trips, Khronos ``nnef`` both ways, tract's vendor types, errors."""
from __future__ import annotations

import io
import struct
import tarfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from nnef_kv.errors import LimitError, TensorFileError
from nnef_kv.tensors.blockquant import Q4_0_GGML, Q4_0_LEGACY, Q8_1_READ, Q8_1_WRITTEN, BlockQuantTensor
from nnef_kv.tensors.dat import (
    TRACT_VENDOR,
    DatInfo,
    decode_tensor,
    encode_tensor,
    read_tensor,
    write_tensor,
)
from nnef_kv.limits import Limits

from conftest import SHARED, requires_khronos, requires_shared

SPEC_DTYPES = [np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64,
               np.uint8, np.uint16, np.uint32, np.uint64, np.bool_]


def _header(*, magic=b"\x4e\xef", version=(1, 0), length=0, shape=(), bits=32, code=0, vendor=0) -> bytes:
    extents = list(shape) + [0] * (8 - len(shape))
    return struct.pack(
        "<2sBBII8III", magic, *version, length, len(shape), *extents, bits, (vendor << 16) | code
    ) + bytes(76)


def _shared_dat_files() -> list[tuple[str, bytes]]:
    """Every .dat of the shared corpus, on disk or inside an archive, as (name, bytes)."""
    out = []
    for p in sorted(SHARED.rglob("*.dat")):
        out.append((str(p.relative_to(SHARED)), p.read_bytes()))
    for p in sorted([*SHARED.rglob("*.tgz"), *SHARED.rglob("*.tar")]):
        with tarfile.open(p) as t:
            for m in t.getmembers():
                if m.isfile() and m.name.endswith(".dat"):
                    out.append((f"{p.relative_to(SHARED)}:{m.name}", t.extractfile(m).read()))
    return out


# ----------------------------------------------------------------------------------------------
# the corpus
# ----------------------------------------------------------------------------------------------
@requires_shared
def test_every_shared_dat_round_trips_bit_exactly():
    files = _shared_dat_files()
    assert len(files) >= 80  # 89 in the corpus + the fixtures' archives
    kinds = set()
    for name, raw in files:
        value, info = decode_tensor(raw, name=name)
        kinds.add(info.type_name)
        assert encode_tensor(value, info, name=name) == raw, name
    assert {"f32", "f64", "u8", "i64 (quantized signed)", "Q4_0 (legacy order)"} <= kinds


@requires_shared
def test_path_reads_are_read_only_views(tmp_path):
    p = SHARED / "conformance/tract-harness/gru-epilogue/R.dat"
    arr = read_tensor(p)
    assert isinstance(arr, np.ndarray) and arr.dtype == np.float32
    assert not arr.flags.writeable and not arr.flags.owndata  # a view into the mapped file
    with open(p, "rb") as f:
        assert np.array_equal(read_tensor(f), arr)


@requires_shared
def test_tract_i64_written_as_quantized_signed_keeps_its_code():
    p = SHARED / "conformance/tract-harness/scatter-nd-block/indices.0.dat"
    value, info = read_tensor(p, with_info=True)
    assert value.dtype == np.int64 and (info.item_type, info.bits_per_item) == (3, 64)
    assert encode_tensor(value, info) == p.read_bytes()
    assert encode_tensor(value) != p.read_bytes()  # default = Khronos signed (code 4)
    assert decode_tensor(encode_tensor(value))[1].item_type == 4


@requires_shared
def test_legacy_q4_0_requantizes_to_the_same_bytes():
    """tract's quantizer applied to tract-written Q4_0 values gives back tract's exact blocks."""
    p = SHARED / "conformance/tract-harness/q40_linear_followed_slice/linear__var0_q4_0.dat"
    q, info = read_tensor(p, with_info=True)
    assert isinstance(q, BlockQuantTensor) and q.item_type == Q4_0_LEGACY and q.format == "Q4_0"
    values = q.dequantize()
    assert values.dtype == np.float32 and values.shape == q.shape
    again = BlockQuantTensor.quantize_q4_0(values, item_type=Q4_0_LEGACY)
    assert again == q
    ggml = q.to_ggml_order()
    assert ggml.item_type == Q4_0_GGML and ggml != q
    assert np.array_equal(ggml.dequantize(), values)
    assert BlockQuantTensor.quantize_q4_0(values) == ggml


# ----------------------------------------------------------------------------------------------
# Khronos nnef, both ways
# ----------------------------------------------------------------------------------------------
def _sample(dtype, shape=(2, 3, 5)) -> np.ndarray:
    rng = np.random.default_rng(3)
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    if np.issubdtype(dtype, np.floating):
        a = rng.standard_normal(shape).astype(dtype)
        for i, special in enumerate([np.inf, -np.inf, np.nan][: a.size]):
            a.flat[i] = special
        return a
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)


@requires_khronos
@pytest.mark.parametrize("dtype", SPEC_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(), (7,), (2, 3, 5), (1, 1, 1, 1, 1, 1, 1, 9)])
def test_khronos_reads_ours_and_we_read_theirs(tmp_path, dtype, shape):
    import nnef

    a = _sample(dtype, shape)
    ours = tmp_path / "ours.dat"
    write_tensor(ours, a)
    with open(ours, "rb") as f:
        theirs_read = nnef.read_tensor(f)
    assert theirs_read.dtype == a.dtype and theirs_read.shape == a.shape
    assert theirs_read.tobytes() == a.tobytes()  # bitwise, NaN included

    theirs = tmp_path / "theirs.dat"
    with open(theirs, "wb") as f:
        nnef.write_tensor(f, a)
    assert theirs.read_bytes() == ours.read_bytes()
    back = read_tensor(theirs)
    assert back.dtype == a.dtype and back.shape == a.shape and back.tobytes() == a.tobytes()


@requires_khronos
@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.uint8, np.uint64], ids=lambda d: np.dtype(d).name)
def test_khronos_quantized_codes_round_trip(tmp_path, dtype):
    import nnef

    a = _sample(dtype)
    p = tmp_path / "q.dat"
    with open(p, "wb") as f:
        nnef.write_tensor(f, a, quantized=True)
    value, info = read_tensor(p, with_info=True)
    assert info.item_type == (3 if np.issubdtype(dtype, np.signedinteger) else 2)
    assert np.array_equal(value, a)
    out = tmp_path / "again.dat"
    write_tensor(out, value, info=info)
    assert out.read_bytes() == p.read_bytes()
    with open(out, "rb") as f:
        got, quantized = nnef.read_tensor(f, return_quantization=True)
    assert quantized and np.array_equal(got, a)


# ----------------------------------------------------------------------------------------------
# tract's encodings and vendor types
# ----------------------------------------------------------------------------------------------
def test_bool_8_bits_and_1_bit():
    a = np.array([[True, False, True], [False, False, True]])
    one = encode_tensor(a)
    assert len(one) == 128 + 1 and one[128] == 0b10100100  # MSB first, zero padded
    eight = encode_tensor(a, DatInfo(item_type=5, bits_per_item=8))
    assert eight[128:] == bytes([1, 0, 1, 0, 0, 1])
    for raw in (one, eight):
        v, info = decode_tensor(raw)
        assert v.dtype == np.bool_ and np.array_equal(v, a)
        assert encode_tensor(v, info) == raw
    # tract accepts one spare byte when the bits fill whole bytes; kept on rewrite
    raw = _header(length=2, shape=(8,), bits=1, code=5) + b"\xff\x00"
    v, info = decode_tensor(raw)
    assert v.all() and encode_tensor(v, info) == raw
    raw8 = _header(length=4, shape=(3,), bits=8, code=5) + b"\x01\x00\x01\x00"
    v, info = decode_tensor(raw8)
    assert v.tolist() == [True, False, True] and encode_tensor(v, info) == raw8
    with pytest.raises(TensorFileError, match="data size"):
        decode_tensor(_header(length=5, shape=(3,), bits=8, code=5) + bytes(5))


def test_nonzero_bool_bytes_mean_true():
    raw = _header(length=3, shape=(3,), bits=8, code=5) + bytes([0, 7, 1])
    v, _ = decode_tensor(raw)
    assert v.tolist() == [False, True, True]


def test_strings_round_trip_with_tracts_data_length():
    a = np.array([["a", "", "ünï"], ["deux mots", "x" * 300, "\u00e9"]], dtype=object)
    raw = encode_tensor(a)
    v, info = decode_tensor(raw)
    assert v.dtype == object and v.shape == (2, 3) and v.tolist() == a.tolist()
    assert (info.vendor, info.item_type, info.bits_per_item) == (TRACT_VENDOR, 0x1000, 0xFFFFFFFF)
    # tract writes count * 24 as the data length and ignores it on reading: keep it
    tract_raw = bytearray(raw)
    tract_raw[4:8] = struct.pack("<I", 6 * 24)
    v2, info2 = decode_tensor(bytes(tract_raw))
    assert v2.tolist() == a.tolist() and encode_tensor(v2, info2) == bytes(tract_raw)
    assert encode_tensor(np.array(["u", "vw"])) == encode_tensor(np.array(["u", "vw"], dtype=object))


def test_complex_types():
    c = (np.arange(6) + 1j * np.arange(6)[::-1]).astype(np.complex64).reshape(2, 3)
    for arr in (c, c.astype(np.complex128)):
        v, info = decode_tensor(encode_tensor(arr))
        assert info.vendor == TRACT_VENDOR and info.item_type == 0 and info.bits_per_item == arr.itemsize * 8
        assert v.dtype == arr.dtype and np.array_equal(v, arr)
    ci = np.zeros(4, dtype=[("re", "<i4"), ("im", "<i4")])
    ci["re"], ci["im"] = [1, 2, 3, 4], [-1, -2, -3, -4]
    raw = encode_tensor(ci)
    v, info = decode_tensor(raw)
    assert (info.item_type, info.bits_per_item) == (4, 64) and v.tobytes() == ci.tobytes()


@pytest.mark.parametrize("item_type", [Q4_0_LEGACY, Q4_0_GGML, Q8_1_READ, Q8_1_WRITTEN])
def test_block_quant_round_trip_and_dequantize(item_type):
    rng = np.random.default_rng(1)
    values = rng.standard_normal((3, 2, 64)).astype(np.float32)
    q = (BlockQuantTensor.quantize_q4_0 if item_type in (Q4_0_LEGACY, Q4_0_GGML) else BlockQuantTensor.quantize_q8_1)(
        values, item_type=item_type
    )
    assert q.shape == (3, 2, 64) and q.n_blocks == 3 * 2 * 2
    deq = q.dequantize()
    err = np.abs(deq - values).max(axis=-1)
    scale = np.abs(values).max(axis=-1)
    assert (err <= scale / (8 if q.format == "Q4_0" else 127) * 1.01).all()
    raw = encode_tensor(q)
    back, info = decode_tensor(raw)
    assert back == q and info.item_type == item_type and encode_tensor(back, info) == raw
    assert np.array_equal(back.dequantize(), deq)


def test_q4_0_nibble_orders_by_hand():
    d = np.float16(0.5)
    codes = np.arange(32) % 16
    ggml = bytes(np.array([d]).view(np.uint8)) + bytes((codes[j] | (codes[j + 16] << 4)) for j in range(16))
    legacy = bytes(np.array([d]).view(np.uint8)) + bytes((codes[2 * j] | (codes[2 * j + 1] << 4)) for j in range(16))
    want = ((codes - 8) * 0.5).astype(np.float32).reshape(1, 32)
    for code, blocks in ((Q4_0_GGML, ggml), (Q4_0_LEGACY, legacy)):
        raw = _header(length=18, shape=(1, 32), bits=0xFFFFFFFF, code=code, vendor=TRACT_VENDOR) + blocks
        q, _ = decode_tensor(raw)
        assert np.array_equal(q.dequantize(), want)


def test_q8_1_rounds_half_away_from_zero_and_stores_the_sum():
    values = np.zeros((1, 32), np.float32)
    values[0, 0] = 127.0  # scale 1.0
    values[0, 1:4] = [2.5, -2.5, 0.49999997]
    q = BlockQuantTensor.quantize_q8_1(values)
    assert q.codes()[0, :4].tolist() == [127, 3, -3, 0]
    assert np.frombuffer(q.blocks[2:4].tobytes(), "<f2")[0] == np.float16(127.49999997)


# ----------------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------------
BAD = {
    "magic": (_header(magic=b"NN", length=4, shape=(1,)) + bytes(4), "magic"),
    "version": (_header(version=(2, 0), length=4, shape=(1,)) + bytes(4), "version 2.0"),
    "rank": (_header(length=4, shape=(1,))[:8] + struct.pack("<I", 9) + _header()[12:] + bytes(4), "rank 9"),
    "size": (_header(length=8, shape=(3,)) + bytes(8), "data size"),
    "truncated": (_header(length=12, shape=(3,)) + bytes(8), "truncated"),
    "short header": (b"\x4e\xef\x01\x00", "truncated header"),
    "item type": (_header(length=3, shape=(3,), bits=8, code=9), "unsupported item type"),
    "bits": (_header(length=3, shape=(2,), bits=12, code=1) + bytes(3), "unsupported"),
    "vendor": (_header(length=4, shape=(1,), vendor=0x1234) + bytes(4), "vendor"),
    "overflow": (_header(length=4, shape=(1 << 31,) * 3, bits=8, code=1) + bytes(4), "overflows"),
    "utf8": (
        _header(shape=(1,), bits=0xFFFFFFFF, code=0x1000, vendor=TRACT_VENDOR) + struct.pack("<I", 2) + b"\xff\xfe",
        "UTF-8",
    ),
    "string length": (
        _header(shape=(2,), bits=0xFFFFFFFF, code=0x1000, vendor=TRACT_VENDOR)
        + struct.pack("<I", 1)
        + b"a"
        + struct.pack("<I", 9)
        + b"abc",
        "past the end",
    ),
    "string count": (
        _header(shape=(1000,), bits=0xFFFFFFFF, code=0x1000, vendor=TRACT_VENDOR) + bytes(8),
        "cannot fit",
    ),
    "block quant rank": (
        _header(length=18, shape=(32,), bits=0xFFFFFFFF, code=0x3040, vendor=TRACT_VENDOR) + bytes(18),
        "rank 1",
    ),
    "block quant size": (
        _header(length=10, shape=(1, 32), bits=0xFFFFFFFF, code=0x3040, vendor=TRACT_VENDOR) + bytes(10),
        "data size",
    ),
    "block quant code": (
        _header(length=18, shape=(1, 32), bits=0xFFFFFFFF, code=0x3090, vendor=TRACT_VENDOR) + bytes(18),
        "unsupported",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_files_raise_tensor_file_error_naming_the_file(tmp_path, case):
    raw, words = BAD[case]
    p = tmp_path / "weights.dat"
    p.write_bytes(raw)
    with pytest.raises(TensorFileError) as e:
        read_tensor(p)
    assert str(p) in str(e.value) and words in str(e.value)
    with pytest.raises(TensorFileError, match="weights.dat"):
        with open(p, "rb") as f:
            read_tensor(f)


def test_empty_file_and_missing_file(tmp_path):
    p = tmp_path / "empty.dat"
    p.write_bytes(b"")
    with pytest.raises(TensorFileError, match="empty.dat"):
        read_tensor(p)
    with pytest.raises(TensorFileError, match="nope.dat"):
        read_tensor(tmp_path / "nope.dat")


def test_max_tensor_bytes_is_enforced(tmp_path):
    p = tmp_path / "big.dat"
    write_tensor(p, np.zeros(1000, np.float32))
    with pytest.raises(LimitError, match="big.dat"):
        read_tensor(p, limits=Limits(max_tensor_bytes=3999))
    assert read_tensor(p, limits=Limits(max_tensor_bytes=4000)).shape == (1000,)
    s = encode_tensor(np.array(["x" * 100] * 10))
    with pytest.raises(LimitError):
        decode_tensor(s, limits=Limits(max_tensor_bytes=500))


def test_write_refuses_what_it_cannot_encode(tmp_path):
    with pytest.raises(TensorFileError):
        encode_tensor(np.zeros((1,) * 9, np.float32))
    with pytest.raises(TensorFileError):
        encode_tensor(np.array([object()]))
    with pytest.raises(TensorFileError, match="does not fit"):
        encode_tensor(np.zeros(3, np.float32), DatInfo(item_type=3, bits_per_item=64))
    # a failed path write leaves nothing behind
    with pytest.raises(TensorFileError):
        write_tensor(tmp_path / "x.dat", np.array([object()]))
    assert not list(tmp_path.iterdir())


def test_trailing_bytes_are_ignored_but_kept():
    raw = encode_tensor(np.arange(3, dtype=np.float32)) + b"junk"
    v, info = decode_tensor(raw)
    assert v.tolist() == [0, 1, 2] and info.trailing == b"junk" and encode_tensor(v, info) == raw


def test_minor_versions_of_major_1_are_read_and_kept():
    raw = bytearray(encode_tensor(np.arange(2, dtype=np.int32)))
    raw[3] = 5
    v, info = decode_tensor(bytes(raw))
    assert info.version == (1, 5) and encode_tensor(v, info) == bytes(raw)


# ----------------------------------------------------------------------------------------------
# properties
# ----------------------------------------------------------------------------------------------
_dtypes = st.sampled_from([np.dtype(d).newbyteorder("<") for d in SPEC_DTYPES] + [np.dtype("<c8"), np.dtype("<c16")])
_shapes = hnp.array_shapes(min_dims=0, max_dims=8, min_side=0, max_side=4)


@settings(max_examples=150, deadline=None)
@given(hnp.arrays(_dtypes, _shapes))
def test_codec_round_trip_property(arr):
    raw = encode_tensor(arr)
    v, info = decode_tensor(raw)
    assert v.dtype == arr.dtype and v.shape == arr.shape
    assert v.tobytes() == arr.tobytes()
    assert encode_tensor(v, info) == raw
    with io.BytesIO(raw) as f:
        assert read_tensor(f).tobytes() == arr.tobytes()


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 3), st.sampled_from([32, 64])),
                  elements=st.floats(-1e4, 1e4, width=32)),
       st.sampled_from([Q4_0_LEGACY, Q4_0_GGML, Q8_1_WRITTEN]))
def test_block_quant_property(values, item_type):
    fn = BlockQuantTensor.quantize_q8_1 if item_type == Q8_1_WRITTEN else BlockQuantTensor.quantize_q4_0
    q = fn(values, item_type=item_type)
    raw = encode_tensor(q)
    back, info = decode_tensor(raw)
    assert back == q and encode_tensor(back, info) == raw
    # requantizing dequantized values is a fixed point (the scale is recovered exactly)
    deq = q.dequantize()
    if np.isfinite(deq).all() and (q.scales() != 0).all():
        assert np.array_equal(fn(deq, item_type=item_type).dequantize(), deq)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(max_size=20), min_size=0, max_size=12))
def test_string_property(items):
    arr = np.array(items, dtype=object)
    v, info = decode_tensor(encode_tensor(arr))
    assert v.tolist() == items


def test_str_and_pathlib_paths(tmp_path):
    a = np.arange(5, dtype=np.uint16)
    write_tensor(str(tmp_path / "a.dat"), a)
    assert np.array_equal(read_tensor(Path(tmp_path / "a.dat")), a)


def test_rank_1_block_quant_is_stored_as_a_row():
    q = BlockQuantTensor.quantize_q4_0(np.linspace(-1, 1, 64, dtype=np.float32))
    assert q.shape == (64,)
    back, info = decode_tensor(encode_tensor(q))
    assert info.shape == (1, 64) and back.reshaped((64,)) == q


def test_block_quant_trailing_bytes_are_kept():
    q = BlockQuantTensor.quantize_q8_1(np.ones((2, 32), np.float32))
    raw = encode_tensor(q) + b"\x01\x02"
    back, info = decode_tensor(raw)
    assert back == q and encode_tensor(back, info) == raw


def test_reserved_bytes_are_kept_and_the_legacy_signed_flag_is_ignored_like_tract():
    """Khronos' reader turns item type 1 with a non-zero first reserved word into signed; tract
    (the oracle) does not look at it. nnef-kv reads unsigned and writes the reserved bytes back."""
    raw = bytearray(encode_tensor(np.array([255, 1], dtype=np.uint8)))
    raw[52] = 1
    v, info = decode_tensor(bytes(raw))
    assert v.dtype == np.uint8 and v.tolist() == [255, 1]
    assert info.reserved[0] == 1 and encode_tensor(v, info) == bytes(raw)
