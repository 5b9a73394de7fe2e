"""tract's two quantized-KV ops reproduced in NumPy, checked against tract 0.23.9 itself."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import requires_tract
from nnef_kv.errors import InputError, StateError
from nnef_kv.kv import TractQuantizedDynKvCache, TractQuantizedKvSdpa, softmax_attention
from nnef_kv.kv.common import round_half_away


def _steps(prefill=(7, 5, 3), decode=200):
    return list(prefill) + [1] * decode + [4]


def _qkv(rng, b, hq, hkv, s, d, dtype=np.float32, kscale=3.0):
    q = (rng.standard_normal((b, hq, s, d)) * 1.5).astype(dtype)
    k = (rng.standard_normal((b, hkv, s, d)) * kscale).astype(dtype)
    v = rng.standard_normal((b, hkv, s, d)).astype(dtype)
    return q, k, v


def test_round_half_away_from_zero():
    x = np.array([0.5, 1.5, 2.5, -0.5, -2.5, 0.49999997, 254.5, 1e8], np.float32)
    np.testing.assert_array_equal(round_half_away(x), np.array([1, 2, 3, -1, -3, 0, 255, 1e8], np.float32))


@requires_tract
@pytest.mark.parametrize("scale", [0.25, None])
def test_quantized_kv_sdpa_parity_f32_gqa(scale):
    from tract_oracle import TractOracleSdpa

    rng = np.random.default_rng(1)
    b, hq, hkv, d = 1, 8, 2, 16  # GQA, 4 query heads per kv head
    oracle = TractOracleSdpa(b, hq, hkv, d, scale=scale)
    ours = TractQuantizedKvSdpa(scale=scale)
    worst = 0.0
    for s in _steps():
        q, k, v = _qkv(rng, b, hq, hkv, s, d)
        a, c = oracle(q, k, v), ours(q, k, v)
        assert c.shape == q.shape and c.dtype == np.float32
        worst = max(worst, float(np.abs(a - c).max()))
    assert ours.len == 219
    assert worst <= 1e-5, worst


@requires_tract
def test_quantized_kv_sdpa_parity_f16():
    from tract_oracle import TractOracleSdpa

    rng = np.random.default_rng(2)
    b, hq, hkv, d = 2, 4, 1, 8
    oracle = TractOracleSdpa(b, hq, hkv, d, scale=0.3, dtype=np.float16)
    ours = TractQuantizedKvSdpa(scale=0.3)
    for s in _steps(prefill=(3,), decode=40):
        q, k, v = _qkv(rng, b, hq, hkv, s, d, dtype=np.float16)
        a, c = oracle(q, k, v), ours(q, k, v)
        assert c.dtype == np.float16
        # both cast the same f32 result to f16: at most one f16 ulp apart
        ulp = np.spacing(np.abs(a.astype(np.float32)).astype(np.float16)).astype(np.float32)
        assert np.all(np.abs(a.astype(np.float32) - c.astype(np.float32)) <= ulp), s


def test_quantized_kv_sdpa_is_not_causal_and_drifts():
    """Documented tract behaviour: a multi-token step attends to its future tokens, and old key
    codes are re-read under the newest running range."""
    rng = np.random.default_rng(3)
    op = TractQuantizedKvSdpa(scale=0.5)
    q, k, v = _qkv(rng, 1, 2, 2, 4, 8)
    out = op(q, k, v)
    kf, vf = op.dequantized()
    np.testing.assert_allclose(out, softmax_attention(q, kf, vf, 0.5), atol=1e-6)
    before = op.dequantized()[0][:, :, :4].copy()
    op(q[:, :, :1], k[:, :, :1] * 100, v[:, :, :1])  # widens every channel's range
    assert not np.allclose(op.dequantized()[0][:, :, :4], before, atol=0.1)


def test_quantized_kv_sdpa_state_round_trip_and_nbytes():
    rng = np.random.default_rng(4)
    a = TractQuantizedKvSdpa(scale=0.25)
    for s in (5, 1, 1):
        a(*_qkv(rng, 1, 4, 2, s, 8))
    st = a.state_tensors()
    b = TractQuantizedKvSdpa(scale=0.25)
    b.load_state_tensors(st)
    for _ in range(5):
        x = _qkv(rng, 1, 4, 2, 1, 8)
        np.testing.assert_array_equal(a(*x), b(*x))
    nb = a.nbytes()
    assert nb["codes"] == a.k_codes.data.nbytes + a.v_codes.data.nbytes
    assert nb["params"] == a.v_params.data.nbytes + a.ch_lo.nbytes + a.ch_step.nbytes
    assert nb["f32_equivalent"] == 2 * 2 * 12 * 8 * 4
    bad = dict(st, k_codes=st["k_codes"][:, :-1])
    with pytest.raises(StateError, match="k_codes"):
        TractQuantizedKvSdpa().load_state_tensors(bad)
    with pytest.raises(StateError, match="dtype"):
        TractQuantizedKvSdpa().load_state_tensors(dict(st, k_lo=st["k_lo"].astype(np.float64)))
    with pytest.raises(InputError):
        a(*_qkv(rng, 1, 4, 1, 1, 8))  # kv heads changed


# ---------------------------------------------------------------- quantized_dyn_kv_cache
@requires_tract
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("per_channel", [0, 1])
@pytest.mark.parametrize("d", [16, 7])
def test_dyn_kv_cache_parity(bits, per_channel, d):
    from tract_oracle import TractOracleDynCache

    rng = np.random.default_rng(bits * 10 + per_channel + d)
    b, h = 2, 3
    oracle = TractOracleDynCache(b, h, d, bits, bool(per_channel))
    ours = TractQuantizedDynKvCache(bits=bits, per_channel=per_channel)
    chan = rng.uniform(0.1, 5, size=(1, 1, 1, d))
    for s in [3, 1, 2, 40] + [1] * 60 + [33, 1]:
        x = (rng.standard_normal((b, h, s, d)) * chan).astype(np.float32)
        a, c = oracle(x), ours(x)
        assert a.shape == c.shape
        np.testing.assert_array_equal(a, c)  # bit-exact
    assert ours.len == 140


@requires_tract
def test_dyn_kv_cache_parity_f16():
    from tract_oracle import TractOracleDynCache

    rng = np.random.default_rng(9)
    oracle = TractOracleDynCache(1, 2, 8, 4, True, dtype=np.float16)
    ours = TractQuantizedDynKvCache(bits=4, per_channel=1, datum_type="f16")
    for s in [5] + [1] * 40:
        x = rng.standard_normal((1, 2, s, 8)).astype(np.float16)
        a, c = oracle(x), ours(x)
        assert c.dtype == np.float16
        np.testing.assert_array_equal(a, c)


def test_dyn_kv_cache_storage_and_state():
    rng = np.random.default_rng(5)
    for per_channel in (0, 1):
        a = TractQuantizedDynKvCache(bits=4, per_channel=per_channel)
        for s in (3, 40, 1, 1):
            a(rng.standard_normal((1, 2, s, 6)).astype(np.float32))
        assert a.sink.len == 4
        if per_channel:
            assert a.params.len == 1 and a.residual.len == 45 - 4 - 32
        nb = a.nbytes()
        held = a.sink.data.nbytes + a.packed.data.nbytes + a.params.data.nbytes
        held += a.residual.data.nbytes if per_channel else 0
        assert nb["codes"] + nb["params"] + nb["full_precision"] == held
        assert a.packed.data.shape[-1] == 3  # 6 codes of 4 bits
        b = TractQuantizedDynKvCache(bits=4, per_channel=per_channel)
        b.load_state_tensors(a.state_tensors())
        for _ in range(40):
            x = rng.standard_normal((1, 2, 1, 6)).astype(np.float32)
            np.testing.assert_array_equal(a(x), b(x))
        with pytest.raises(StateError):
            TractQuantizedDynKvCache(bits=8, per_channel=per_channel).load_state_tensors(a.state_tensors())


def test_dyn_kv_cache_rejects_bad_attributes():
    from nnef_kv.errors import GraphError

    with pytest.raises(GraphError, match="bits"):
        TractQuantizedDynKvCache(name="k0", bits=3)
    with pytest.raises(GraphError, match="axis"):
        TractQuantizedDynKvCache(name="k0", axis=1)
