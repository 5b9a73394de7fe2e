"""KIVI variants (issue 15): keys and values of their own widths (``key_bits`` / ``value_bits``) and
per-token keys (``key_axis = "token"``): what is stored, what a call reads, stepwise runs, saved
states, checkpoint/rollback, bytes held, NaN/Inf."""
from __future__ import annotations

import numpy as np
import pytest

from nnef_kv.errors import GraphError, StateError
from nnef_kv.kv import KiviSdpa, softmax_attention

VARIANTS = [dict(bits=4, value_bits=2), dict(bits=2, value_bits=8), dict(bits=8, key_axis="token"),
            dict(bits=3, value_bits=5, key_axis="token"), dict(bits=4, key_bits=2, value_bits=4, sinks=2),
            dict(bits=4, value_bits=2, params="f32", rotate="kv")]
BASE = dict(scale=0.3, key_group=4, value_group=8, residual=4)


def _qkv(rng, s, hq=4, hkv=2, d=16):
    q = rng.standard_normal((1, hq, s, d)).astype(np.float32)
    k = (rng.standard_normal((1, hkv, s, d)) * rng.uniform(0.3, 3, size=(1, 1, 1, d))).astype(np.float32)
    v = rng.standard_normal((1, hkv, s, d)).astype(np.float32)
    return q, k, v


def _op(kw):
    return KiviSdpa(**BASE, **kw)


def _states_equal(a, b) -> bool:
    ta, tb = a.state_tensors(), b.state_tensors()
    return ta.keys() == tb.keys() and all(
        ta[k].dtype == tb[k].dtype and np.array_equal(ta[k], tb[k], equal_nan=ta[k].dtype.kind == "f") for k in ta)


def _twin(op):
    other = op.with_config()
    other.load_state_tensors(op.state_tensors())
    return other


def _one_token_calls(op, q, k, v):
    return np.concatenate([op(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1]) for i in range(k.shape[2])], 2)


@pytest.mark.parametrize("kw", VARIANTS)
def test_codes_are_of_their_own_width_and_axis(kw):
    rng = np.random.default_rng(1)
    op = _op(kw)
    q, k, v = _qkv(rng, 30)
    op(q, k, v)
    c = op.cfg
    kb, vb = c.kbits, c.vbits
    kc = op.codec.unpack(op.k_codes.view())
    vc = op.v_codec.unpack(op.v_codes.view())
    assert kc.max() <= (1 << kb) - 1 and vc.max() <= (1 << vb) - 1
    assert kc.max() == (1 << kb) - 1 and vc.max() == (1 << vb) - 1  # the ranges are used to their ends
    n, tq, d = kc.shape
    assert op.k_codes.data.shape[-1] == op.codec.row_bytes and op.v_codes.data.shape[-1] == op.v_codec.row_bytes
    if kb in (1, 2, 4, 8):
        assert op.codec.row_bytes == d * kb // 8
    # per-token keys: one (min, step) per group of value_group channels of each token; else per channel
    assert op.k_min.view().shape == ((n, tq, d // 8) if c.key_axis == "token" else (n, tq // 4, d))
    kd, vd = op.dequantized()
    kr = op.rot if c.rotate in ("k", "kv") else np.eye(d, dtype=np.float32)
    vr = op.rot if c.rotate in ("v", "kv") else np.eye(d, dtype=np.float32)
    ns = op.n_sink
    kx = (k[0] @ kr)[:, ns:ns + tq]
    vx = (v[0] @ vr)[:, ns:ns + tq]
    # every value within half a step (plus f16 rounding of the params) of its code's reading
    kstep = op.k_step.view().astype(np.float32)
    kstep = np.repeat(kstep, 8, axis=-1) if c.key_axis == "token" else np.repeat(kstep, 4, axis=1)
    vstep = np.repeat(op.v_step.view().astype(np.float32), 8, axis=-1)
    assert np.all(np.abs(kd[0, :, ns:ns + tq] - kx) <= kstep * 0.5001 + 1e-3)
    assert np.all(np.abs(vd[0, :, ns:ns + tq] - vx) <= vstep * 0.5001 + 1e-3)


@pytest.mark.parametrize("kw", VARIANTS)
def test_a_call_reads_the_stored_codes_dequantized_and_its_own_tokens_exactly(kw):
    rng = np.random.default_rng(2)
    op = _op(kw)
    op(*_qkv(rng, 21))
    kd, vd = op.dequantized()  # what was stored before the call (rotated basis)
    q, k, v = _qkv(rng, 6)
    if op.cfg.rotate != "none":
        kr, vr = op.rot, op.rot
        q_r, k_r, v_r = q @ kr, k @ kr, v @ vr
    else:
        q_r, k_r, v_r = q, k, v
    t = kd.shape[2] + 6
    mask = np.arange(t)[None, :] <= (t - 6 + np.arange(6))[:, None]
    want = softmax_attention(q_r, np.concatenate([kd, k_r], 2), np.concatenate([vd, v_r], 2), 0.3, mask)
    if op.cfg.rotate != "none":
        want = want @ op.rot.T
    got = op(q, k, v)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("kw", VARIANTS)
@pytest.mark.parametrize("history", [[], [3], [9, 1, 5]])
def test_stepwise_equals_one_token_calls(kw, history):
    rng = np.random.default_rng(3 + len(history))
    a = _op(kw)
    for s in history:
        a(*_qkv(rng, s))
    b = _twin(a) if a.len else _op(kw)
    q, k, v = _qkv(rng, 23)
    got = a.stepwise(q, k, v)
    want = _one_token_calls(b, q, k, v)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)
    assert _states_equal(a, b) and a.census() == b.census()
    want_reads = a.reads_quantized(4)
    assert len(want_reads) == 4


@pytest.mark.parametrize("kw", VARIANTS)
def test_save_restore_continues_bit_identically(kw):
    rng = np.random.default_rng(4)
    a = _op(kw)
    a(*_qkv(rng, 17))
    for _ in range(6):
        a(*_qkv(rng, 1))
    b = _twin(a)
    assert _states_equal(a, b)
    for s in (1, 5, 1, 9):
        x = _qkv(rng, s)
        np.testing.assert_array_equal(a(*x), b(*x))
    assert _states_equal(a, b)
    # a state of another width or axis is refused naming the config
    other = KiviSdpa(**BASE, bits=kw["bits"])
    with pytest.raises(StateError, match="config"):
        other.load_state_tensors(a.state_tensors())


@pytest.mark.parametrize("kw", VARIANTS)
def test_checkpoint_rollback_restores_exactly(kw):
    rng = np.random.default_rng(5)
    a = _op(kw)
    a(*_qkv(rng, 10))
    before = a.state_tensors()
    mark = a.checkpoint()
    a(*_qkv(rng, 13))
    a.stepwise(*_qkv(rng, 7))
    a.rollback(mark)
    after = a.state_tensors()
    assert before.keys() == after.keys() and all(np.array_equal(before[k], after[k]) for k in before)
    b = _op(kw)
    b.load_state_tensors(before)
    x = _qkv(rng, 3)
    np.testing.assert_array_equal(a(*x), b(*x))


@pytest.mark.parametrize("kw", VARIANTS)
def test_bytes_held_are_counted_from_the_arrays(kw):
    rng = np.random.default_rng(6)
    op = _op(kw)
    for s in [40] + [1] * 11:
        op(*_qkv(rng, s))
    nb = op.nbytes()
    assert nb["codes"] == op.k_codes.data.nbytes + op.v_codes.data.nbytes
    assert nb["params"] == sum(b.data.nbytes for b in (op.k_min, op.k_step, op.v_min, op.v_step))
    held = sum(b.data.nbytes for b in (op.sink_k, op.sink_v, op.res_k, op.res_v)) + op.k_out.nbytes + op.v_out.nbytes
    assert nb["full_precision"] == held
    assert nb["f32_equivalent"] == 2 * 2 * 51 * 16 * 4


def test_narrower_values_hold_fewer_bytes_than_the_uniform_width():
    rng = np.random.default_rng(7)
    ops = {kw: _op(dict(kw)) for kw in ((("bits", 4),), (("bits", 4), ("value_bits", 2)))}
    x = _qkv(rng, 200)
    for op in ops.values():
        op(*x)
    a, b = (op.nbytes()["codes"] for op in ops.values())
    assert b < a and b == pytest.approx(0.75 * a, rel=0.05)


@pytest.mark.parametrize("kw", VARIANTS[:4])
def test_nan_and_inf_follow_the_kivi_policy(kw):
    """A NaN key makes that token's scores NaN (rows that see it are NaN) without spoiling its group;
    an Inf value follows f32 arithmetic for the rows that see it; the side table keeps both exactly."""
    rng = np.random.default_rng(8)
    op = _op(kw)
    q, k, v = _qkv(rng, 20)
    k[0, 0, 3, 5] = np.nan
    v[0, 1, 6, 2] = np.inf
    op(q[:, :, :12], k[:, :, :12], v[:, :, :12])
    kd, vd = op.dequantized()
    assert np.isnan(kd[0, 0, 3, 5]) and np.isinf(vd[0, 1, 6, 2])
    others = np.ones(kd.shape, bool)
    others[0, 0, 3, 5] = False
    others[0, 1, 6, 2] = False
    assert np.isfinite(kd[others]).all() and np.isfinite(vd[others]).all()  # the groups are not spoiled
    with np.errstate(invalid="ignore"):
        out = op.stepwise(q[:, :, 12:], k[:, :, 12:], v[:, :, 12:])
    # every later row sees token 3: kv head 0's query heads are NaN; kv head 1's see the Inf value
    assert np.isnan(out[0, :2]).all()
    assert np.isinf(out[0, 2:, :, 2]).all() or np.isnan(out[0, 2:, :, 2]).all()
    assert np.isfinite(np.delete(out[0, 2:], 2, axis=-1)).all()


def test_bad_variant_attributes():
    with pytest.raises(GraphError, match="key_axis"):
        KiviSdpa(key_axis="head")
    with pytest.raises(GraphError, match="value_bits"):
        KiviSdpa(value_bits=9)


def test_not_a_variant_keeps_the_saved_config_and_the_packed_path():
    op = KiviSdpa(bits=4, key_bits=4, value_bits=4)
    assert not op.cfg.variant and op.cfg.as_array().tolist() == KiviSdpa(bits=4).cfg.as_array().tolist()
