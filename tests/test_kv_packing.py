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
