"""Sub-byte packing: round trips for every bit width and length, byte counts, layouts."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nnef_kv.kv.packing import RowCodec, pack_bits, pack_planar, packed_len, unpack_bits, unpack_planar


@st.composite
def codes_and_bits(draw):
    bits = draw(st.integers(1, 8))
    n = draw(st.integers(1, 130))
    rows = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**32 - 1))
    codes = np.random.default_rng(seed).integers(0, 1 << bits, size=(rows, n), dtype=np.uint8)
    return bits, codes


@settings(max_examples=300, deadline=None)
@given(codes_and_bits())
def test_bitstream_round_trip(case):
    bits, codes = case
    packed = pack_bits(codes, bits)
    assert packed.dtype == np.uint8
    assert packed.shape == (codes.shape[0], packed_len(codes.shape[1], bits))
    np.testing.assert_array_equal(unpack_bits(packed, bits, codes.shape[1]), codes)


@settings(max_examples=300, deadline=None)
@given(codes_and_bits())
def test_row_codec_round_trip(case):
    bits, codes = case
    codec = RowCodec(bits, codes.shape[1])
    packed = codec.pack(codes)
    assert packed.shape[-1] == codec.row_bytes
    if not codec.planar:
        assert codec.row_bytes == packed_len(codes.shape[1], bits)
    np.testing.assert_array_equal(codec.unpack(packed), codes)
    out = np.empty(codes.shape, np.float32)
    codec.unpack(packed, out=out)
    np.testing.assert_array_equal(out, codes.astype(np.float32))


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [1, 3, 8, 31, 64, 127, 128])
def test_planar_round_trip_and_size(bits, n):
    rng = np.random.default_rng(bits * 1000 + n)
    codes = rng.integers(0, 1 << bits, size=(2, 5, n), dtype=np.uint8)
    packed = pack_planar(codes, bits)
    assert packed.shape == (2, 5, -(-n // (8 // bits)))
    np.testing.assert_array_equal(unpack_planar(packed, bits, n), codes)


def test_bitstream_is_lsb_first_and_crosses_bytes():
    # 3-bit codes 1..8 (mod 8): 001 010 011 100 101 110 111 000, LSB first
    codes = np.array([1, 2, 3, 4, 5, 6, 7, 0], np.uint8)
    word = sum(int(c) << (3 * i) for i, c in enumerate(codes))
    expected = np.array([(word >> (8 * j)) & 0xFF for j in range(3)], np.uint8)
    np.testing.assert_array_equal(pack_bits(codes, 3), expected)
    # 4-bit: tract's nibble layout, even index in the low nibble
    np.testing.assert_array_equal(pack_bits(np.array([0x1, 0xA, 0x3], np.uint8), 4), [0xA1, 0x03])


def test_packed_sizes_are_dense():
    for bits in range(1, 9):
        assert packed_len(128, bits) == 16 * bits
        assert RowCodec(bits, 128).row_bytes == 16 * bits


def test_bad_bits_rejected():
    with pytest.raises(ValueError):
        pack_bits(np.zeros(4, np.uint8), 9)
    with pytest.raises(ValueError):
        pack_planar(np.zeros(4, np.uint8), 3)
    with pytest.raises(ValueError):
        unpack_bits(np.zeros(2, np.uint8), 3, 8)


# ---------------------------------------------------------------------------- GroupCodec (the KIVI layout)
from nnef_kv.kv.packing import GroupCodec  # noqa: E402


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [1, 7, 8, 16, 128])
@pytest.mark.parametrize("group", [1, 4, 8, 32])
def test_group_codec_round_trip_and_layout(bits, n, group):
    rng = np.random.default_rng(bits * 10000 + n * 100 + group)
    codec = GroupCodec(bits, n, group)
    codes = rng.integers(0, 1 << bits, size=(3, 2 * group, n), dtype=np.uint8)
    packed = codec.pack(codes)
    # same bytes a row as the row layout, dense
    assert packed.shape == (3, 2 * group, RowCodec(bits, n).row_bytes) and packed.dtype == np.uint8
    np.testing.assert_array_equal(codec.unpack(packed), codes)
    out = np.full(codes.shape, -1.0, np.float32)
    codec.unpack(packed, out=out)
    np.testing.assert_array_equal(out, codes.astype(np.float32))
    per = 8 // bits if bits in (1, 2, 4, 8) else 0
    assert codec.token_planar == (per > 1 and n % per == 0 and group % per == 0)
    if codec.token_planar:
        # byte (r, c) of a group holds the codes of rows r, r + group/per, ... in bit fields 0, 1, ...
        sub = group // per
        g0 = packed[0, :group].reshape(sub, n)
        for k in range(per):
            np.testing.assert_array_equal((g0 >> (k * bits)) & ((1 << bits) - 1), codes[0, k * sub:(k + 1) * sub])
    elif codec.split:
        # the low w0 bits of a group: a token-planar byte matrix first, then the next field's, ...
        assert sum(codec.split) == bits and (n * bits) % 8 == 0
        w0 = codec.split[0]
        per0 = 8 // w0
        g0 = packed[0, :group].reshape(-1)[:(group // per0) * n].reshape(group // per0, n)
        low = codes[0, :group] & ((1 << w0) - 1)
        sub0 = group // per0
        for k in range(per0):
            np.testing.assert_array_equal((g0 >> (k * w0)) & ((1 << w0) - 1), low[k * sub0:(k + 1) * sub0])
        assert codec.layout == "split"
    else:
        assert codec.layout in ("rows", "bytes")
        np.testing.assert_array_equal(packed, RowCodec(bits, n).pack(codes))


@pytest.mark.parametrize("bits,n,group", [(1, 16, 8), (2, 8, 8), (4, 16, 32), (4, 7, 8), (3, 8, 8), (8, 5, 4),
                                          (5, 8, 16), (6, 4, 4), (7, 16, 8), (3, 8, 4), (3, 5, 8)])
@pytest.mark.parametrize("scaled", [False, True])
def test_block_unpacker_fills_the_buffer_block_by_block(bits, n, group, scaled):
    """The attention's inner-loop unpacker: groups g0:g1 land in the first rows of the buffer; with
    ``scaled`` the rows of (first) bit field k hold code * 2**(k*w), undone exactly by plane_scales."""
    rng = np.random.default_rng(bits + n + group)
    codec = GroupCodec(bits, n, group)
    ng = 5
    codes = rng.integers(0, 1 << bits, size=(2, ng * group, n), dtype=np.uint8)
    packed = codec.pack(codes)
    buf = np.full((2, 2 * group, n), np.nan, np.float32)  # blocks of two groups, last one partial
    fn = codec.block_unpacker(packed, buf, scaled=scaled)
    scales = codec.plane_scales if scaled else None
    for g0 in range(0, ng, 2):
        g1 = min(ng, g0 + 2)
        blk = fn(g0, g1)
        assert blk.shape == (2, (g1 - g0) * group, n) and np.shares_memory(blk, buf)
        got = blk.copy()
        if scales is not None:
            got = (got.reshape(2, g1 - g0, len(scales), -1, n) * scales[:, :, None]).reshape(got.shape)
        np.testing.assert_array_equal(got, codes[:, g0 * group:g1 * group].astype(np.float32))
    assert (codec.plane_scales is None) == (codec.layout in ("rows", "bytes"))


def test_f16_to_f32_is_exact_for_every_finite_half():
    from nnef_kv.kv import common

    h = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    h = h[np.isfinite(h)]  # zeros of both signs, subnormals, normals, the largest finite
    got = common.f16_to_f32(h)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), h.astype(np.float32).view(np.uint32))
    strided = np.random.default_rng(0).standard_normal((4, 9, 3)).astype(np.float16)[:, ::2, 1]
    np.testing.assert_array_equal(common.f16_to_f32(strided), strided.astype(np.float32))
    with pytest.raises(TypeError):
        common.f16_to_f32(np.zeros(3, np.float32))


def test_f16_to_f32_falls_back_when_subnormals_are_flushed(monkeypatch):
    from nnef_kv.kv import common

    monkeypatch.setattr(common, "_subnormals_kept", lambda: False)
    h = np.array([0.0, -0.0, 6e-8, -1e-5, 1.5, -65504.0], np.float16)
    np.testing.assert_array_equal(common.f16_to_f32(h).view(np.uint32), h.astype(np.float32).view(np.uint32))
