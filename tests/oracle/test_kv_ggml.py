"""ggml block quantizers (nnef_kv.kv.ggml): bit-exact with llama.cpp's reference C and with gguf.quants.

Three independent references:

* ``GOLDEN``: SHA-256 of the bytes written by ggml's ``quantize_row_<type>_ref`` (ggml-quants.c built
  for x86-64 with gcc -O3, no FMA; identical at -O0) for the deterministic inputs of
  :func:`golden_inputs` (4,592 blocks: wide dynamic range, exact rounding midpoints for every type,
  one-ulp nudges around them, signed zeros, constant blocks, subnormal f16 scales, blocks whose
  ``1/d`` overflows, q4_1/q5_1 ranges that overflow float32). The inputs are built from bit patterns
  and exact float32 operations only, so they are the same on every platform.
* ``gguf.quants`` (skipped when gguf is absent): quantize for q8_0..q5_1, dequantize for all six.
  gguf differs from the C code in one documented way, the sign of a zero ``d``/``m`` (see
  :func:`gguf_bytes_c_semantics`), and bytes are only compared on blocks where C is defined.
* :func:`iq4_nl_scalar_ref`: a straight scalar float32 transcription of ``quantize_row_iq4_nl_impl``
  (gguf has no iq4_nl quantizer), used with hypothesis.
"""
from __future__ import annotations

import hashlib
import importlib.util
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nnef_kv.errors import InputError, StateError
from nnef_kv.kv import ggml
from nnef_kv.kv.ggml import (
    BLOCK_BYTES,
    GGML_TYPES,
    IQ4_NL_VALUES,
    GgmlBlocks,
    bits_per_value,
    dequantize,
    quantize,
)

F32 = np.float32
GGUF_QUANT_TYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")  # gguf.quants has no iq4_nl quantizer
HAVE_GGUF = importlib.util.find_spec("gguf") is not None


# --------------------------------------------------------------------------------------------- helpers
def _splitmix(n: int, salt: int) -> np.ndarray:
    """n deterministic uint64 values (splitmix64 of 0..n-1 + salt), wrap-around uint64 arithmetic."""
    z = np.arange(n, dtype=np.uint64) + np.uint64((salt * 0x9E3779B97F4A7C15) % 2**64)
    z = z * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _f32_from_fields(sign, exp, mant) -> np.ndarray:
    bits = (np.asarray(sign, np.uint32) << np.uint32(31)) | (np.asarray(exp, np.uint32) << np.uint32(23)) \
        | (np.asarray(mant, np.uint32) & np.uint32(0x7FFFFF))
    return bits.view(np.float32)


def golden_inputs() -> np.ndarray:
    """[N, 32] float32 blocks, deterministic and platform independent (bits and exact f32 ops)."""
    out = []
    # 1. random values, per-block exponent over the whole float32 range, elements up to 2**-35 smaller
    # (exponent field 0: subnormals and zeros)
    n = 512
    r = _splitmix(n * 32, 1).reshape(n, 32)
    e_blk = (_splitmix(n, 2) % np.uint64(254)).astype(np.int64)[:, None] + 1
    drop = (r >> np.uint64(59)).astype(np.int64) + 4 * ((r >> np.uint64(57)) & np.uint64(1)).astype(np.int64)
    e = np.maximum(e_blk - drop, 0)
    out.append(_f32_from_fields((r >> np.uint64(63)), e, (r & np.uint64(0x7FFFFF))))
    # 2. a dynamic range typical of activations: exponents 120..132
    r = _splitmix(n * 32, 3).reshape(n, 32)
    e = 120 + (r >> np.uint64(60)).astype(np.int64) % 13
    out.append(_f32_from_fields((r >> np.uint64(59)) & np.uint64(1), e, r & np.uint64(0x7FFFFF)))
    # 3. exact rounding midpoints (k + 1/2) * d for each type's grid, the extreme value pinned
    m = 128
    r = _splitmix(m * 32, 4).reshape(m, 32)
    d = _f32_from_fields(0, 110 + (_splitmix(m, 5) % np.uint64(30)).astype(np.int64), _splitmix(m, 6))[:, None]
    kk = (r % np.uint64(1 << 16)).astype(np.int64)
    for lo, hi, pin in ((-8, 8, -8), (-8, 8, 8), (-16, 16, -16), (-16, 16, 16), (-127, 127, 127)):
        k = lo + kk % (hi - lo)
        x = (k.astype(F32) + F32(0.5)) * d
        x[:, 0] = F32(pin) * d[:, 0]
        out.append(x)
    for nmax in (15, 31):  # affine grids: min and max pinned, the rest on midpoints
        k = kk % nmax
        base = F32(3)
        x = (k.astype(F32) + F32(0.5)) * d + base
        x[:, 0] = base
        x[:, 1] = F32(nmax) * d[:, 0] + base
        out.append(x)
    mid = (IQ4_NL_VALUES[:-1].astype(F32) + IQ4_NL_VALUES[1:].astype(F32)) * F32(0.5)
    x = mid[kk % 15] * d
    x[:, 0] = F32(-127) * d[:, 0]
    out.append(x)
    # 4. one-ulp nudges around all the midpoint blocks
    mids = np.concatenate(out[2:])
    out.append(np.nextafter(mids, F32(np.inf)))
    out.append(np.nextafter(mids, F32(-np.inf)))
    # 5. special blocks
    z = ((_splitmix(64 * 32, 7).reshape(64, 32) >> np.uint64(63)).astype(np.uint32) << np.uint32(31)).view(F32)
    out.append(z)  # signed zeros
    nz = z.copy()
    nz[:, 7] = F32(0.25)
    out.append(nz)  # non-negative with signed zeros: q4_1's min is a zero
    out.append(np.repeat(_f32_from_fields(0, 100 + np.arange(64) % 60, _splitmix(64, 8))[:, None], 32, 1))
    out.append(-out[-1])  # constant blocks, both signs
    alt = np.where(np.arange(32) % 2 == 0, F32(1), F32(-1)) * _f32_from_fields(0, 120 + np.arange(16), 0)[:, None]
    out.append(alt.astype(F32))
    tiny = _f32_from_fields(_splitmix(64 * 32, 9).reshape(64, 32) >> np.uint64(63), 0,
                            _splitmix(64 * 32, 10).reshape(64, 32) >> np.uint64(40 + 0))  # subnormal f32
    tiny[:, 3] = 0
    out.append(tiny)  # 1/d overflows: C's undefined float->int conversion (x86: 0)
    big = _f32_from_fields(_splitmix(32 * 32, 11).reshape(32, 32) >> np.uint64(63), 254,
                           _splitmix(32 * 32, 12).reshape(32, 32))
    big[:, 0] = F32(3e38)
    big[:, 1] = F32(-3e38)
    out.append(big)  # max - min overflows float32 in q4_1/q5_1
    one_huge = out[1][:32].copy()
    one_huge[np.arange(32), np.arange(32)] = np.array([1e4, -1e4, 7e5, -7e5] * 8, F32)
    out.append(one_huge)
    f16_sub = out[1][32:64] * F32(2.0 ** -20)  # d below 2**-14: subnormal f16 scale
    out.append(f16_sub)
    out.append(out[1][64:96] * F32(2.0 ** -40))  # d rounds to f16 zero
    out.append(out[1][96:128] * F32(2.0 ** 17))  # d overflows f16
    x = np.concatenate(out).astype(F32)
    assert np.isfinite(x).all()
    return x


GOLDEN = {  # sha256 of ggml's quantize_row_<type>_ref bytes for golden_inputs() (4,592 blocks)
    "q8_0": "52589af784010ac61f7a562c53a9ff9ac1187d83959933ef3a2393b8b22d664a",
    "q4_0": "a00c85693ce281c71eee6c07c9b65c343e53660eb0c29769bb3d4efdcc920d4b",
    "q4_1": "8ed390609502156f73359741fc3d1f95c87d270838b9d09585871587c886e59d",
    "q5_0": "d15a430705e7565b3cf1f5892c327d8059a214e161fcef0988e74d78af5eb740",
    "q5_1": "e0e97be576c8c5ca72abc5ed1e4465c672defacb3b20970f7846f7bb932bddff",
    # iq4_nl: ggml with the zeroed indices for amax < 1e-15 blocks (older ggml leaves stale ones there)
    "iq4_nl": "62082e81fb55d79c2f73a6f89ee1be99f8aabf5ba271e33a00b1c527aa08fc2a",
}


def _blocks(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, F32).reshape(-1, 32)


def c_undefined_blocks(x: np.ndarray, t: str) -> np.ndarray:
    """Blocks (of finite values) where ggml's C hands NaN/inf to a float->int conversion (UB in C)."""
    b = _blocks(x)
    with np.errstate(all="ignore"):
        if t == "q8_0":
            d = np.abs(b).max(-1) / F32(127)
            return (d != 0) & np.isinf(F32(1) / d)
        if t in ("q4_0", "q5_0"):
            d = np.abs(b).max(-1) / F32(8 if t == "q4_0" else 16)
            return (d != 0) & np.isinf(F32(1) / d)
        if t in ("q4_1", "q5_1"):
            rng = b.max(-1) - b.min(-1)
            d = rng / F32(15 if t == "q4_1" else 31)
            return np.isinf(rng) | ((d != 0) & np.isinf(F32(1) / d))
    return np.zeros(b.shape[0], bool)  # iq4_nl: no such step


def gguf_quantize(x: np.ndarray, t: str) -> np.ndarray:
    """gguf.quants.quantize, reshaped to [..., nblocks, block_bytes] (its NaN-cast warnings silenced)."""
    gq = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        raw = gq.quantize(np.asarray(x, F32), getattr(GGMLQuantizationType, t.upper()))
    return raw.reshape(x.shape[:-1] + (-1, BLOCK_BYTES[t]))


def gguf_dequantize(raw: np.ndarray, t: str) -> np.ndarray:
    gq = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return gq.dequantize(raw, getattr(GGMLQuantizationType, t.upper()))


def gguf_bytes_c_semantics(x: np.ndarray, raw: np.ndarray, t: str) -> np.ndarray:
    """gguf's bytes with the one known divergence from ggml-quants.c put back to C's semantics.

    * q4_0/q5_0: C keeps ``max = 0.0f`` when no ``fabsf(v)`` exceeds it (all-zero block), so ``d = 0.0f/-8``
      is -0.0 (f16 0x8000); gguf takes ``max = x[argmax |x|] = x[0]``, giving +0.0 when x[0] is -0.0.
    * q4_1/q5_1: C's ``if (v < min) min = v;`` keeps the *first* zero as ``min`` (its sign goes to ``m``) and
      an all-zero block has ``d = (x0 - x0)/15 = +0.0``; gguf's ``blocks.min()``/``max()`` pick any zero.
    """
    raw = raw.copy().reshape(-1, BLOCK_BYTES[t])
    b = _blocks(x)
    allzero = (b == 0).all(-1)
    if t in ("q4_0", "q5_0"):
        raw[allzero, 0:2] = (0x00, 0x80)
    elif t in ("q4_1", "q5_1"):
        first_min = b[np.arange(len(b)), np.argmin(b, -1)]
        zmin = first_min == 0
        raw[zmin, 2] = 0
        raw[zmin, 3] = np.where(np.signbit(first_min[zmin]), 0x80, 0x00)
        raw[allzero, 0:2] = 0
    return raw.reshape(x.shape[:-1] + (-1, BLOCK_BYTES[t]))


def iq4_nl_scalar_ref(block: np.ndarray) -> bytes:
    """Scalar float32 transcription of quantize_row_iq4_nl_impl(32, 32, ..., quant_weights=NULL, ntry=-1)."""
    x = [F32(v) for v in block]
    vals = [int(v) for v in IQ4_NL_VALUES]

    def best_index(v):  # nearest, ties upward; v + v and the integer sums compared exactly
        v2 = F32(v + v)
        return sum(1 for i in range(1, 16) if v2 >= F32(vals[i - 1] + vals[i]))

    amax, mx = F32(0), F32(0)
    for v in x:
        if abs(v) > amax:
            amax, mx = abs(v), v
    if amax < F32(1e-15):
        return bytes(18)
    d = F32(mx / F32(vals[0]))
    inv = F32(F32(1) / d)
    idx = [best_index(F32(inv * v)) for v in x]
    sumqx = sumq2 = F32(0)
    for v, i in zip(x, idx):
        w, q = F32(v * v), F32(vals[i])
        sumqx = F32(sumqx + F32(F32(w * q) * v))
        sumq2 = F32(sumq2 + F32(F32(w * q) * q))
    d = F32(sumqx / sumq2) if sumq2 > 0 else F32(0)
    h = np.array([d], F32).astype(np.float16).view("<u2")[0]
    qs = bytes(idx[j] | (idx[j + 16] << 4) for j in range(16))
    return bytes([int(h) & 0xFF, int(h) >> 8]) + qs


def q(x: np.ndarray, t: str) -> GgmlBlocks:
    """quantize() with every warning turned into an error (the module must not leak any)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return quantize(x, t)


def dq(b: GgmlBlocks) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return dequantize(b)


def assert_same_floats(a: np.ndarray, b: np.ndarray) -> None:
    """Bitwise equal float32 arrays, any NaN matching any NaN."""
    a, b = np.asarray(a, F32), np.asarray(b, F32)
    assert a.shape == b.shape
    both_nan = np.isnan(a) & np.isnan(b)
    bad = (a.view(np.uint32) != b.view(np.uint32)) & ~both_nan
    assert not bad.any(), (f"{int(bad.sum())} values differ, first at {np.argwhere(bad)[0]}: "
                           f"{a[bad][:4]} vs {b[bad][:4]}")


def check_against_gguf(x: np.ndarray, t: str) -> None:
    """Bytes (where C is defined, gguf's zero signs put back to C's) and dequantized floats vs gguf."""
    mine = q(x, t)
    ref = gguf_bytes_c_semantics(x, gguf_quantize(x, t), t)
    assert ref.shape == mine.data.shape
    ok = ~c_undefined_blocks(x, t).reshape(mine.data.shape[:-1])
    bad = np.any(ref != mine.data, axis=-1) & ok
    assert not bad.any(), (f"{t}: {int(bad.sum())} blocks differ from gguf; first block input "
                           f"{_blocks(x)[np.flatnonzero(bad.ravel())[0]]}")
    assert_same_floats(dq(mine), gguf_dequantize(mine.to_ggml_bytes(), t).reshape(x.shape))


# ------------------------------------------------------------------------------------ basics and API
def test_sizes_and_bits_per_value():
    assert GGML_TYPES == ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl")
    assert [bits_per_value(t) for t in GGML_TYPES] == [8.5, 4.5, 5.0, 5.5, 6.0, 4.5]
    assert [ggml.block_bytes(t) for t in GGML_TYPES] == [34, 18, 20, 22, 24, 18]
    assert bits_per_value("Q4_0") == 4.5
    x = np.zeros((2, 3, 128), F32)
    for t in GGML_TYPES:
        b = q(x, t)
        assert b.data.dtype == np.uint8 and b.data.shape == (2, 3, 4, BLOCK_BYTES[t])
        assert b.nbytes == 2 * 3 * 4 * BLOCK_BYTES[t] == x.size * bits_per_value(t) / 8
        assert b.shape == x.shape and b.nblocks == 24 and b.bits_per_value == bits_per_value(t)


def test_gguf_block_sizes_agree():
    gguf = pytest.importorskip("gguf")
    for t in GGML_TYPES:
        assert gguf.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, t.upper())] == (32, BLOCK_BYTES[t])
    assert tuple(gguf.quants.IQ4_NL.kvalues) == tuple(int(v) for v in IQ4_NL_VALUES)


@pytest.mark.parametrize("shape", [(33,), (2, 48), (31,), ()])
def test_last_axis_must_be_whole_blocks(shape):
    with pytest.raises(InputError, match="multiple of 32"):
        quantize(np.zeros(shape, F32), "q8_0")


def test_bad_type_and_dtype():
    with pytest.raises(InputError, match="unknown block type"):
        quantize(np.zeros(32, F32), "q6_k")
    with pytest.raises(InputError, match="dtype"):
        quantize(np.zeros(32, np.complex64), "q4_0")
    with pytest.raises(InputError):
        dequantize(np.zeros((1, 18), np.uint8))


def test_blocks_validation():
    with pytest.raises(StateError):
        GgmlBlocks("q4_0", np.zeros((2, 17), np.uint8))
    with pytest.raises(StateError):
        GgmlBlocks("q4_0", np.zeros((2, 18), np.int8))
    with pytest.raises(StateError):
        GgmlBlocks("q4_0", np.zeros(18, np.uint8))
    with pytest.raises(StateError):
        GgmlBlocks.from_ggml_bytes("q4_1", np.zeros((3, 21), np.uint8))
    with pytest.raises(InputError, match="no min"):
        q(np.ones(32, F32), "q8_0").mins()
    assert GgmlBlocks("Q4_0", np.zeros((1, 18), np.uint8)).type == "q4_0"


def test_empty_and_leading_axes():
    for t in GGML_TYPES:
        b = q(np.zeros((0, 3, 64), F32), t)
        assert b.data.shape == (0, 3, 2, BLOCK_BYTES[t]) and dq(b).shape == (0, 3, 64) and b.nbytes == 0
        b = q(np.zeros((5, 0), F32), t)
        assert b.data.shape == (5, 0, BLOCK_BYTES[t]) and dq(b).shape == (5, 0)


def test_input_cast_to_float32_and_layout_independent():
    rng = np.random.default_rng(3)
    x64 = rng.normal(size=(4, 96)) * 3
    x32 = x64.astype(F32)
    for t in GGML_TYPES:
        ref = q(x32, t).data
        assert np.array_equal(q(x64, t).data, ref)
        assert np.array_equal(q(np.asfortranarray(x32), t).data, ref)
        assert np.array_equal(q(x32[::-1], t).data, ref[::-1])
        assert np.array_equal(q(x32.astype(np.float16), t).data, q(x32.astype(np.float16).astype(F32), t).data)
        assert np.array_equal(q(x32.reshape(2, 2, 96), t).data.reshape(4, 3, -1), ref)
    assert np.array_equal(q(np.arange(-16, 16), "q8_0").data, q(np.arange(-16, 16, dtype=F32), "q8_0").data)


@pytest.mark.parametrize("t", GGML_TYPES)
def test_accessors(t):
    rng = np.random.default_rng(11)
    x = (rng.normal(size=(3, 2, 64)) * rng.uniform(0.01, 100, size=(3, 2, 1))).astype(F32)
    b = q(x, t)
    codes, levels, scales = b.codes(), b.levels(), b.scales()
    assert codes.dtype == np.uint8 and codes.shape == (3, 2, 2, 32)
    assert levels.dtype == np.int8 and levels.shape == codes.shape
    assert scales.dtype == np.float32 and scales.shape == (3, 2, 2)
    assert np.array_equal(b.scale_bits().view(np.float16).astype(F32), scales)
    ncodes = {"q8_0": 256, "q5_0": 32, "q5_1": 32}.get(t, 16)
    assert codes.max() < ncodes
    expect = levels.astype(F32) * scales[..., None]
    if t in ("q4_1", "q5_1"):
        expect = expect + b.mins()[..., None]
    assert_same_floats(dq(b), expect.reshape(x.shape))
    assert_same_floats(b.dequantize(), dq(b))
    raw = b.to_ggml_bytes()
    assert raw.shape == (3, 2, 2 * BLOCK_BYTES[t])
    assert np.array_equal(GgmlBlocks.from_ggml_bytes(t, raw).data, b.data)
    # the layout of the stored fields, decoded by hand
    blk = b.data.reshape(-1, BLOCK_BYTES[t])
    qs = blk[:, -16:] if t != "q8_0" else blk[:, 2:]
    if t == "q8_0":
        assert np.array_equal(codes.reshape(-1, 32), qs)
    else:
        low = np.concatenate([qs & 15, qs >> 4], axis=-1)
        hi = 0
        if t in ("q5_0", "q5_1"):
            o = 2 if t == "q5_0" else 4
            qh = blk[:, o:o + 4].copy().view("<u4")[:, 0]
            hi = ((qh[:, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
        assert np.array_equal(codes.reshape(-1, 32), low | hi)
    off = {"q4_0": 8, "q5_0": 16}.get(t, 0)
    if t == "iq4_nl":
        assert np.array_equal(levels, IQ4_NL_VALUES[codes])
    elif t == "q8_0":
        assert np.array_equal(levels, codes.view(np.int8))
    else:
        assert np.array_equal(levels.astype(int), codes.astype(int) - off)


# ----------------------------------------------------------------------- bit-exactness vs ggml's C
@pytest.fixture(scope="module")
def golden_x() -> np.ndarray:
    return golden_inputs()


@pytest.mark.parametrize("t", GGML_TYPES)
def test_golden_bytes_from_ggml_c(golden_x, t):
    b = q(golden_x, t)
    assert hashlib.sha256(b.data.tobytes()).hexdigest() == GOLDEN[t]


NAMED = {  # bytes written by ggml's quantize_row_<type>_ref for small adversarial blocks (see named_block)
    "neg_zero_first": {  # all zeros, x[0] = -0.0: q4_0/q5_0 keep max = +0.0 so d = -0.0 (0x8000)
        "q8_0": "00000000000000000000000000000000000000000000000000000000000000000000",
        "q4_0": "008088888888888888888888888888888888",
        "q4_1": "0000008000000000000000000000000000000000",
        "q5_0": "0080ffffffff00000000000000000000000000000000",
        "q5_1": "000000800000000000000000000000000000000000000000",
        "iq4_nl": "000000000000000000000000000000000000",
    },
    "zeros_pos_first": {
        "q8_0": "00000000000000000000000000000000000000000000000000000000000000000000",
        "q4_0": "008088888888888888888888888888888888",
        "q4_1": "0000000000000000000000000000000000000000",
        "q5_0": "0080ffffffff00000000000000000000000000000000",
        "q5_1": "000000000000000000000000000000000000000000000000",
        "iq4_nl": "000000000000000000000000000000000000",
    },
    "min_is_neg_zero": {  # q4_1/q5_1: m is the first zero, -0.0 (0x8000)
        "q8_0": "081c00000000007f0000000000000000000000000000000000000000000000000000",
        "q4_0": "00ac88888888888088888888888888888888",
        "q4_1": "4428008000000000000f00000000000000000000",
        "q5_0": "00a8dfffffff00000000000000000000000000000000",
        "q5_1": "212400802000000000000000000f00000000000000000000",
        "iq4_nl": "089c88888888888088888888888888888888",
    },
    "roundf_edges": {  # q8_0 with d = 1: 0.49999997 -> 0, +-2.5 -> +-3, +-0.5 -> +-1, 126.5 -> 127
        "q8_0": "003c7f0003fd01ff7f00000000000000000000000000000000000000000000000000",
        "q4_0": "f0cb80888888888880888888888888888888",
        "q4_1": "514800c10f00010000000f000000000000000000",
        "q5_0": "f0c7beffffff00000000000000000000000000000000",
        "q5_1": "2d4400c1410000001f11111011101f111111111111111111",
        "iq4_nl": "fcbb80888888888880888888888888888888",
    },
    "subnormal_inputs": {  # 1/d overflows to inf: C's (undefined) conversion of inf/NaN gives 0 on x86-64
        "q8_0": "00000000000000000000000000000000000000000000000000000000000000000000",
        "q4_0": "008000000000000000000000000000000000",
        "q4_1": "0000008000000000000000000000000000000000",
        "q5_0": "00800000000000000000000000000000000000000000",
        "q5_1": "000000800000000000000000000000000000000000000000",
        "iq4_nl": "000000000000000000000000000000000000",
    },
    "all_equal": {
        "q8_0": "d6187f7f7f7f7f7f7f7f7f7f7f7f7f7f7f7f7f7f7f7f7f7f7f7f7f7f7f7f7f7f7f7f",
        "q4_0": "cda800000000000000000000000000000000",
        "q4_1": "0000cd3400000000000000000000000000000000",
        "q5_0": "cda40000000000000000000000000000000000000000",
        "q5_1": "0000cd340000000000000000000000000000000000000000",
        "iq4_nl": "d69800000000000000000000000000000000",
    },
    "alternating": {
        "q8_0": "0c22817f817f817f817f817f817f817f817f817f817f817f817f817f817f817f817f",
        "q4_0": "003200ff00ff00ff00ff00ff00ff00ff00ff",
        "q4_1": "663200be00ff00ff00ff00ff00ff00ff00ff00ff",
        "q5_0": "002eaaaaaaaa00ff00ff00ff00ff00ff00ff00ff00ff",
        "q5_1": "322e00beaaaaaaaa00ff00ff00ff00ff00ff00ff00ff00ff",
        "iq4_nl": "612200ff00ff00ff00ff00ff00ff00ff00ff",
    },
    "one_huge": {
        "q8_0": "ec540000000000000000000000000000000000810000000000000000000000000000",
        "q4_0": "e26488088888888888888888888888888888",
        "q4_1": "3561e2f0ff0fffffffffffffffffffffffffffff",
        "q5_0": "e260fffffdff00000000000000000000000000000000",
        "q5_1": "0a5de2f0fffffdffff0fffffffffffffffffffffffffffff",
        "iq4_nl": "ec5488088888888888888888888888888888",
    },
}


def named_block(name: str) -> np.ndarray:
    if name == "neg_zero_first":
        return np.array([-0.0] + [0.0] * 31, F32)
    if name == "zeros_pos_first":
        return np.array([0.0, -0.0] * 16, F32)
    if name == "min_is_neg_zero":
        z = np.array([-0.0, 0.0] * 16, F32)
        z[5] = 0.5
        return z
    if name == "roundf_edges":
        r = np.zeros(32, F32)
        r[:7] = [127, np.nextafter(F32(0.5), F32(0)), 2.5, -2.5, 0.5, -0.5, 126.5]
        return r
    if name == "subnormal_inputs":
        t = np.zeros(32, F32)
        t[:3] = [1e-45, -1e-45, 3e-39]
        return t
    if name == "all_equal":
        return np.full(32, F32(0.3))
    if name == "alternating":
        return np.where(np.arange(32) % 2, F32(1.5), F32(-1.5))
    if name == "one_huge":
        h = np.full(32, F32(0.01))
        h[17] = -1e4
        return h
    raise KeyError(name)


@pytest.mark.parametrize("name", sorted(NAMED))
def test_named_blocks_from_ggml_c(name):
    x = named_block(name)
    for t in GGML_TYPES:
        assert q(x, t).data[0].tobytes().hex() == NAMED[name][t], (name, t)


@pytest.mark.parametrize("t", GGUF_QUANT_TYPES)
def test_gguf_on_golden_inputs(golden_x, t):
    check_against_gguf(golden_x.reshape(-1, 4, 32).reshape(-1, 128), t)


def test_gguf_dequantizes_named_blocks_like_us():
    x = np.stack([named_block(n) for n in sorted(NAMED)])
    for t in GGML_TYPES:
        b = q(x, t)
        assert_same_floats(dq(b), gguf_dequantize(b.to_ggml_bytes(), t))


def test_known_gguf_divergence_is_only_zero_signs():
    """What gguf_bytes_c_semantics patches really is gguf's behaviour (if gguf fixes it, this still passes)."""
    x = np.stack([named_block("neg_zero_first"), named_block("min_is_neg_zero")])
    for t in ("q4_0", "q5_0", "q4_1", "q5_1"):
        ref = gguf_quantize(x, t)
        fixed = gguf_bytes_c_semantics(x, ref, t)
        assert np.array_equal(fixed, q(x, t).data)
        changed = ref != fixed
        assert not changed[..., 4:].any()  # only d/m bytes are touched


def random_rows(kind: str, rng: np.random.Generator, n: int) -> np.ndarray:
    shape = (n, 32)
    if kind == "normal":
        return rng.normal(size=shape)
    if kind == "uniform":
        return rng.uniform(-1, 1, size=shape)
    if kind == "heavy_tailed":
        return rng.standard_cauchy(size=shape)
    if kind == "student_t2":
        return rng.standard_t(2, size=shape) * 0.1
    if kind == "tiny_1e-30":
        return rng.normal(size=shape) * 1e-30
    if kind == "huge_1e4":
        return rng.normal(size=shape) * 1e4
    if kind == "per_block_scale":
        return rng.normal(size=shape) * 10.0 ** rng.uniform(-40, 30, size=(n, 1))
    if kind == "outlier_channels":  # KV-like: a few channels much larger
        x = rng.normal(size=shape)
        x[:, [3, 17]] *= 40
        return x
    if kind == "positive":
        return rng.exponential(size=shape)
    if kind == "few_levels":  # many exact ties
        return rng.integers(-8, 9, size=shape) * rng.choice([1.0, 0.5, 1 / 3, 0.1, 1e-3], size=(n, 1))
    raise KeyError(kind)


KINDS = ["normal", "uniform", "heavy_tailed", "student_t2", "tiny_1e-30", "huge_1e4", "per_block_scale",
         "outlier_channels", "positive", "few_levels"]


@pytest.mark.parametrize("kind", KINDS)
def test_gguf_on_random_rows(kind):
    rng = np.random.default_rng(KINDS.index(kind))
    x = random_rows(kind, rng, 512).astype(F32).reshape(64, 8, 32).reshape(64, 256)
    for t in GGUF_QUANT_TYPES:
        check_against_gguf(x, t)


def test_gguf_on_midpoint_constructions():
    """x = (k + 1/2) * d on each type's own grid (d taken as gguf/ggml will compute it), and 1-ulp nudges."""
    rng = np.random.default_rng(5)
    n = 256
    d = rng.uniform(1e-3, 10, size=(n, 1)).astype(F32)
    rows = {}
    k = rng.integers(-8, 8, size=(n, 32))
    x = (k + F32(0.5)) * d
    x[:, 0] = -8 * d[:, 0]
    rows["q4_0"] = x
    k = rng.integers(-16, 16, size=(n, 32))
    x = (k + F32(0.5)) * d
    x[:, 0] = -16 * d[:, 0]
    rows["q5_0"] = x
    k = rng.integers(-127, 127, size=(n, 32))
    x = (k + F32(0.5)) * d
    x[:, 0] = 127 * d[:, 0]
    rows["q8_0"] = x
    for t, nmax in (("q4_1", 15), ("q5_1", 31)):
        x = (rng.integers(0, nmax, size=(n, 32)) + F32(0.5)) * d - F32(1)
        x[:, 0], x[:, 1] = -1, nmax * d[:, 0] - 1
        rows[t] = x
    for t, x in rows.items():
        x = x.astype(F32)
        for y in (x, np.nextafter(x, F32(np.inf)), np.nextafter(x, F32(-np.inf))):
            check_against_gguf(y, t)


def test_gguf_on_adversarial_rows():
    rows = [np.zeros(32), -np.zeros(32), np.full(32, 0.7), np.full(32, -3e4), np.full(32, 65504.0 * 8),
            np.where(np.arange(32) % 2, 1.0, -1.0), np.where(np.arange(32) % 2, 1e4, -1e-4),
            np.r_[1e4, np.full(31, 1e-3)], np.r_[np.full(31, 1e-3), -1e4],
            np.linspace(-1, 1, 32), np.linspace(0, 31, 32), np.linspace(-16, 15, 32) * 0.37,
            np.r_[np.full(16, 1e-7), np.full(16, -1e-7)],  # subnormal f16 scales
            np.full(32, 6e-8), np.full(32, 1e-30), np.full(32, 3e38), np.r_[3e38, -3e38, np.zeros(30)]]
    x = np.stack(rows).astype(F32)
    for t in GGUF_QUANT_TYPES:
        check_against_gguf(x, t)
        check_against_gguf(-x, t)


@st.composite
def float_arrays(draw, max_abs=None, max_blocks=3):
    """Random shapes [..., 32*nb] and values: raw float32s (subnormals, extremes) or scaled distributions."""
    kind = draw(st.sampled_from(["floats", "floats", "dist", "dist", "ints"]))
    if kind == "floats":
        nb = draw(st.integers(1, 2))
        bound = {} if max_abs is None else {"min_value": -max_abs, "max_value": max_abs}
        elems = st.floats(width=32, allow_nan=False, allow_infinity=False, **bound)
        vals = draw(st.lists(elems, min_size=32 * nb, max_size=32 * nb))
        return np.array(vals, F32).reshape(1, 32 * nb)
    lead = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    nb = draw(st.integers(1, max_blocks))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    shape = lead + (32 * nb,)
    if kind == "ints":
        x = rng.integers(-20, 21, size=shape) * F32(draw(st.sampled_from([1.0, 0.25, 0.1, 3.0])))
    else:
        x = random_rows(draw(st.sampled_from(KINDS)), rng, int(np.prod(shape)) // 32).reshape(shape)
    x = x.astype(F32)
    if max_abs is not None:
        x = np.clip(x, -max_abs, max_abs)
    return x


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(float_arrays())
def test_gguf_hypothesis(x):
    for t in GGUF_QUANT_TYPES:
        check_against_gguf(x, t)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(float_arrays(max_blocks=2))
def test_iq4_nl_against_scalar_reference(x):
    b = q(x, "iq4_nl")
    got = b.data.reshape(-1, 18)
    with np.errstate(all="ignore"):
        for i, blk in enumerate(_blocks(x)):
            assert got[i].tobytes() == iq4_nl_scalar_ref(blk), blk
    if HAVE_GGUF:
        assert_same_floats(dq(b), gguf_dequantize(b.to_ggml_bytes(), "iq4_nl").reshape(x.shape))


@pytest.mark.parametrize("kind", KINDS)
def test_iq4_nl_random_rows_against_scalar_reference(kind):
    rng = np.random.default_rng(100 + KINDS.index(kind))
    x = random_rows(kind, rng, 24).astype(F32)
    got = q(x, "iq4_nl").data
    with np.errstate(all="ignore"):
        for i in range(len(x)):
            assert got[i, 0].tobytes() == iq4_nl_scalar_ref(x[i])


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(GGML_TYPES), st.integers(1, 6), st.integers(0, 2**32 - 1))
def test_dequantize_any_bytes_like_gguf(t, nb, seed):
    """Arbitrary block bytes (f16 NaN/inf/subnormal scales, any codes) dequantize exactly like gguf."""
    raw = np.random.default_rng(seed).integers(0, 256, size=(2, nb * BLOCK_BYTES[t]), dtype=np.uint8)
    b = GgmlBlocks.from_ggml_bytes(t, raw)
    assert_same_floats(dq(b), gguf_dequantize(raw, t))


# ------------------------------------------------------------------ round-trip error (no gguf needed)
def check_error_bounds(x: np.ndarray, t: str) -> None:
    """|x - deq| within half a step (a full step where q4_0/q5_0 clamp), plus the f16 rounding of d/m."""
    b = q(x, t)
    xb = _blocks(x).astype(np.float64)
    deq = dq(b).reshape(-1, 32).astype(np.float64)
    d16 = b.scales().reshape(-1, 1).astype(np.float64)
    err = np.abs(xb - deq)
    amax = np.abs(xb).max(-1, keepdims=True)
    slack = 1e-6 * amax + 1e-37
    if t == "q8_0":
        d = amax / 127
        bound = 0.5 * d + 128 * np.abs(d - d16)
    elif t in ("q4_0", "q5_0"):
        nmax = 8 if t == "q4_0" else 16
        mx = xb[np.arange(len(xb)), np.argmax(np.abs(xb), -1)][:, None]
        d = np.abs(mx) / nmax
        with np.errstate(all="ignore"):
            s = np.where(mx != 0, xb / (mx / -nmax), 0)  # position on the grid; > nmax - 1/2 is clamped
        bound = np.where(s > nmax - 0.5, 1.0, 0.5) * d + nmax * np.abs(d - d16)
        assert (err <= 0.5 * d + nmax * np.abs(d - d16) + slack)[s <= nmax - 0.5 - 1e-3].all()
    elif t in ("q4_1", "q5_1"):
        nmax = 15 if t == "q4_1" else 31
        mn, mx = xb.min(-1, keepdims=True), xb.max(-1, keepdims=True)
        d = (mx - mn) / nmax
        m16 = b.mins().reshape(-1, 1).astype(np.float64)
        bound = 0.5 * d + nmax * np.abs(d - d16) + np.abs(mn - m16)
    else:  # iq4_nl: indices nearest on the table scaled by max/-127; d is least squares for them
        live = amax[:, 0] >= 1e-15
        assert (deq[~live] == 0).all()
        xl = xb[live]
        mx = xl[np.arange(len(xl)), np.argmax(np.abs(xl), -1)][:, None]
        s = xl / (mx / -127)
        lv = b.levels().reshape(-1, 32)[live].astype(np.float64)
        dist = np.abs(s[..., None] - IQ4_NL_VALUES.astype(np.float64)).min(-1)
        assert (np.abs(s - lv) <= dist + 1e-4 * np.abs(s) + 1e-4).all()
        w = xl * xl
        d_ls = (w * lv * xl).sum(-1) / (w * lv * lv).sum(-1)
        dl16 = d16[live, 0]
        assert (np.abs(dl16 - d_ls) <= np.abs(d_ls) * (2.0 ** -11 + 1e-5) + 6e-8).all()
        bound = np.zeros_like(xb)
        # |s - T[idx]| <= 14 (s reaches +127, the top entry is 113); then the move from max/-127 to d
        bound[live] = np.abs(mx) / 127 * 14 + 127 * np.abs(np.abs(mx) / 127 - np.abs(dl16[:, None]))
        bound[~live] = amax[~live]
    assert (err <= bound + slack).all(), (t, float((err - bound - slack).max()))


@pytest.mark.parametrize("t", GGML_TYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_error_bounds_random(t, kind):
    x = random_rows(kind, np.random.default_rng(200 + KINDS.index(kind)), 256)
    check_error_bounds(np.clip(x, -6e4, 6e4).astype(F32), t)  # keep d finite in f16


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(float_arrays(max_abs=6e4))
def test_error_bounds_hypothesis(x):
    for t in GGML_TYPES:
        check_error_bounds(x, t)


def test_error_bounds_golden(golden_x):
    x = golden_x[np.abs(golden_x).max(-1) <= 6e4]
    for t in GGML_TYPES:
        check_error_bounds(x, t)


def test_exact_grid_values_round_trip():
    """Values on a block's own grid (with an f16-exact scale) come back exactly."""
    rng = np.random.default_rng(9)
    d = F32(0.125)
    for t, lo, hi, pin in (("q8_0", -127, 128, 127), ("q4_0", -8, 8, -8), ("q5_0", -16, 16, -16)):
        k = rng.integers(lo, hi, size=(16, 32))
        k[:, 0] = pin
        x = (k * d).astype(F32)
        assert_same_floats(dq(q(x, t)), x)
    for t, nmax in (("q4_1", 15), ("q5_1", 31)):
        k = rng.integers(0, nmax + 1, size=(16, 32))
        k[:, 0], k[:, 1] = 0, nmax
        x = (k * d - F32(2)).astype(F32)
        assert_same_floats(dq(q(x, t)), x)


# ----------------------------------------------------------------------------------- NaN / Inf policy
def poisoned_block(t: str) -> bytes:
    head = bytes([0x00, 0x7E]) * (2 if t in ("q4_1", "q5_1") else 1)
    return head + bytes(BLOCK_BYTES[t] - len(head))


NONFINITE = [np.nan, -np.nan, np.inf, -np.inf,
             np.array([0x7F800001], np.uint32).view(F32)[0],  # signalling NaN
             np.array([0xFFFFFFFF], np.uint32).view(F32)[0]]  # negative NaN, full payload


@pytest.mark.parametrize("t", GGML_TYPES)
@pytest.mark.parametrize("bad", NONFINITE, ids=["nan", "-nan", "inf", "-inf", "snan", "nan_payload"])
def test_nonfinite_block_is_poisoned(t, bad):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 5, 32 * 3)).astype(F32)
    clean = q(x, t)
    pos = [(0, 0, 0), (1, 2, 31 + 32), (2, 4, 95), (1, 1, 50), (1, 1, 51)]  # first/last value of a block, two in one
    for p in pos:
        x[p] = bad
    b = q(x, t)
    hit = np.zeros((3, 5, 3), bool)
    for i, j, k in pos:
        hit[i, j, k // 32] = True
    assert (b.data[hit] == np.frombuffer(poisoned_block(t), np.uint8)).all()
    assert np.array_equal(b.data[~hit], clean.data[~hit])  # other blocks untouched
    y = dq(b).reshape(3, 5, 3, 32)
    assert np.isnan(y[hit]).all()
    assert_same_floats(y[~hit], dq(clean).reshape(3, 5, 3, 32)[~hit])
    assert np.isnan(b.scales()[hit]).all() and (b.codes()[hit] == 0).all()
    if t in ("q4_1", "q5_1"):
        assert np.isnan(b.mins()[hit]).all()
    assert np.array_equal(q(x, t).data, b.data)  # deterministic


@pytest.mark.parametrize("t", GGML_TYPES)
def test_nonfinite_every_position_and_all_nonfinite(t):
    base = np.linspace(-2, 3, 32, dtype=F32)
    x = np.repeat(base[None], 32, 0)
    x[np.arange(32), np.arange(32)] = np.nan
    assert all(blk.tobytes() == poisoned_block(t) for blk in q(x, t).data)
    for fill in (np.nan, np.inf, -np.inf):
        assert q(np.full(32, fill, F32), t).data[0].tobytes() == poisoned_block(t)
    mixed = np.full(32, np.inf, F32)
    mixed[::2] = -np.inf
    mixed[5] = np.nan
    assert q(mixed, t).data[0].tobytes() == poisoned_block(t)


def test_float64_beyond_float32_range_poisons():
    x = np.ones((2, 32))
    x[1, 4] = 1e39  # finite in float64, inf once cast to float32
    for t in GGML_TYPES:
        b = q(x, t)
        assert b.data[1, 0].tobytes() == poisoned_block(t) and b.data[0, 0].tobytes() != poisoned_block(t)


@pytest.mark.parametrize("t", GGUF_QUANT_TYPES)
def test_nonfinite_agrees_with_gguf_in_value(t):
    """gguf propagates a NaN into d (all-NaN block); with an Inf every finite value reads back NaN there too."""
    rng = np.random.default_rng(1)
    for bad in (np.nan, np.inf, -np.inf):
        x = rng.normal(size=(8, 32)).astype(F32)
        x[np.arange(8), rng.integers(0, 32, 8)] = bad
        theirs = gguf_dequantize(gguf_quantize(x, t).reshape(8, -1), t)
        assert np.isnan(dq(q(x, t))).all()
        assert np.isnan(theirs[np.isfinite(x)]).all()


def test_degenerate_finite_blocks_no_warnings(golden_x):
    """Overflowing 1/d, overflowing max-min, f16 overflow of d: C semantics, no warning, deterministic."""
    special = np.stack([np.full(32, 3e38, F32), np.r_[F32(3e38), F32(-3e38), np.zeros(30, F32)],
                        np.full(32, 1e-45, F32), np.full(32, 2e19, F32), np.r_[F32(-2e19), np.ones(31, F32)]])
    for t in GGML_TYPES:
        for x in (golden_x, special):
            b = q(x, t)
            dq(b)
            assert np.array_equal(q(x, t).data, b.data)
    b = q(special, "q4_1")  # max - min = inf: d = inf, C's codes are all 0, every value reads NaN
    assert np.isinf(b.scales()[1, 0]) and (b.codes()[1] == 0).all() and np.isnan(dq(b)[1]).all()
    b = q(special, "iq4_nl")  # x*x overflows: sumqx/sumq2 is NaN in C as well
    assert np.isnan(b.scales()[3:, 0]).all()
