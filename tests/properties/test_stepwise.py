"""``stepwise`` runs: a call with C new tokens answers exactly as C one-token calls would have, and
leaves the same state behind (KIVI op, tract's fused op, tract's quantized dyn cache, the f32 caches),
op by op (hypothesis) and through ``Session.run(stepwise=True)`` on whole decoders."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nnef_kv.errors import InputError
from nnef_kv.interpreter.ops.tract_transformers import DynKvCache, WindowKvSdpa
from nnef_kv.kv import KiviSdpa, TractQuantizedDynKvCache, TractQuantizedKvSdpa

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _tensors(rng, b, hq, hkv, s, d, scale=1.0):
    q = rng.standard_normal((b, hq, s, d)).astype(np.float32)
    k = (rng.standard_normal((b, hkv, s, d)) * rng.uniform(0.2, 4, size=(1, 1, 1, d)) * scale).astype(np.float32)
    v = (rng.standard_normal((b, hkv, s, d)) * scale).astype(np.float32)
    return q, k, v


def _states_equal(a, b) -> bool:
    ta, tb = a.state_tensors(), b.state_tensors()
    return ta.keys() == tb.keys() and all(np.array_equal(ta[k], tb[k], equal_nan=ta[k].dtype.kind == "f")
                                          for k in ta)


def _twin(op):
    """A second op in exactly the same state (through save/restore of its tensors)."""
    other = type(op).__new__(type(op))
    other.__dict__.update({k: v for k, v in op.__dict__.items()})
    other.reset()
    other.load_state_tensors(op.state_tensors())
    return other


def _one_token_calls(op, q, k, v):
    return np.concatenate([op(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1]) for i in range(k.shape[2])],
                          axis=2)


@st.composite
def kivi_cases(draw):
    d = draw(st.sampled_from([4, 8, 16]))
    cfg = dict(scale=float(draw(st.sampled_from([0.125, 0.3]))), bits=draw(st.integers(1, 8)),
               key_group=draw(st.sampled_from([1, 2, 3, 4, 8, 16])),
               value_group=draw(st.sampled_from([g for g in (2, 4, 8, 16) if d % g == 0])),
               residual=draw(st.integers(0, 20)), sinks=draw(st.integers(0, 5)),
               params=draw(st.sampled_from(["f16", "f32"])), rotate=draw(st.sampled_from(["none", "none", "kv"])))
    hkv = draw(st.sampled_from([1, 2]))
    groups = draw(st.sampled_from([1, 2, 3]))
    history = draw(st.lists(st.integers(1, 40), max_size=3))
    chunk = draw(st.integers(2, 60))
    outliers = draw(st.booleans())
    seed = draw(st.integers(0, 2 ** 16))
    abort = draw(st.integers(0, 40))  # > 0: a stepwise call of that many tokens rolled back first
    return d, cfg, hkv, groups, history, chunk, outliers, seed, abort


@SETTINGS
@given(kivi_cases())
def test_kivi_stepwise_equals_one_token_calls(case):
    d, cfg, hkv, groups, history, chunk, outliers, seed, abort = case
    rng = np.random.default_rng(seed)
    a = KiviSdpa(**cfg)
    for s in history:
        a(*_tensors(rng, 1, hkv * groups, hkv, s, d))
    b = _twin(a) if a.len else KiviSdpa(**cfg)
    if abort:  # a run that failed after this op took its tokens: the session rolls the op back
        mark = a.checkpoint()
        a.stepwise(*_tensors(rng, 1, hkv * groups, hkv, abort, d))
        a.rollback(mark)
    q, k, v = _tensors(rng, 1, hkv * groups, hkv, chunk, d)
    if outliers:  # NaN / Inf / beyond-f16 values go to the exact side table in both runs alike
        k[0, 0, rng.integers(chunk), rng.integers(d)] = 3e4
        v[0, -1, rng.integers(chunk), rng.integers(d)] = -np.inf
    with np.errstate(invalid="ignore"):
        got = a.stepwise(q, k, v)
        want = _one_token_calls(b, q, k, v)
    assert got.shape == q.shape and got.dtype == q.dtype
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    fin = np.isfinite(want)
    # the two paths sum the same terms in different orders: quantized scores are q.min + q.(step code),
    # terms up to ~3 |q| max|k| each, so the rounding bound is eps * scale * sum_c |q_c| max|k_c| per row
    kd, vd = a.dequantized()
    with np.errstate(invalid="ignore"):
        # values kept exactly in the side table (|x| > 16384) enter the scores as exact products
        kmax = np.nanmax(np.where(np.isfinite(kd) & (np.abs(kd) <= 16384), np.abs(kd), 0), axis=2)  # [B, Hkv, D]
        vmax = float(np.nanmax(np.where(np.isfinite(vd), np.abs(vd), 0)))
    qabs = np.abs(q.reshape(1, hkv, groups, chunk, d))
    bound = (qabs * kmax[:, :, None, None, :]).sum(-1).reshape(q.shape[:3])[..., None] * cfg["scale"]
    tol = 64 * np.finfo(np.float32).eps * bound * vmax + 1e-6
    err = np.where(fin, np.abs(got - want), 0)
    assert np.all(err <= np.where(fin, 1e-5 * np.abs(want), 0) + tol), float(err.max())
    assert _states_equal(a, b)
    assert a.census() == b.census()


def test_kivi_stepwise_reads_each_group_quantized_exactly_when_decoding_would():
    """A group quantized during the stepwise call is read in full precision by the rows before the
    token that quantized it, and quantized after: so rows differ from a plain chunk call there."""
    rng = np.random.default_rng(3)
    cfg = dict(scale=0.25, bits=2, key_group=4, value_group=4, residual=4)
    a, b, c = KiviSdpa(**cfg), KiviSdpa(**cfg), KiviSdpa(**cfg)
    q, k, v = _tensors(rng, 1, 2, 1, 24, 8)
    sw = a.stepwise(q, k, v)
    np.testing.assert_allclose(sw, _one_token_calls(b, q, k, v), rtol=1e-5, atol=1e-6)
    chunk = c(q, k, v)  # a plain call reads the whole chunk in full precision (KIVI prefill)
    rows_differ = np.abs(sw - chunk).max(axis=(0, 1, 3)) > 1e-4
    assert not rows_differ[:8].any()  # rows 0..7: nothing quantized yet (window 4 + group 4)
    assert rows_differ[8:].all()


def test_kivi_stepwise_needs_one_query_per_token():
    rng = np.random.default_rng(0)
    q, k, v = _tensors(rng, 1, 2, 1, 5, 8)
    with pytest.raises(InputError, match="one query row per new token"):
        KiviSdpa(bits=4).stepwise(q[:, :, :2], k, v)


@SETTINGS
@given(st.lists(st.integers(1, 12), max_size=3), st.integers(2, 20), st.integers(1, 2), st.integers(0, 2 ** 16),
       st.integers(0, 12))
def test_tract_fused_stepwise_equals_one_token_calls(history, chunk, groups, seed, abort):
    rng = np.random.default_rng(seed)
    a = TractQuantizedKvSdpa(scale=0.2)
    for s in history:
        a(*_tensors(rng, 1, 2 * groups, 2, s, 8))
    b = _twin(a) if a.len else TractQuantizedKvSdpa(scale=0.2)
    if abort:
        mark = a.checkpoint()
        a.stepwise(*_tensors(rng, 1, 2 * groups, 2, abort, 8))
        a.rollback(mark)
    q, k, v = _tensors(rng, 1, 2 * groups, 2, chunk, 8)
    np.testing.assert_array_equal(a.stepwise(q, k, v), _one_token_calls(b, q, k, v))
    assert _states_equal(a, b)


def _chunked_cache_run(cache, x):
    """A stepwise run of a storage-only cache as the session does it: one call per chunk, cut where
    ``stepwise_splits`` says; returns, per token, the cache that chunk's call returned."""
    n = x.shape[2]
    cuts = getattr(cache, "stepwise_splits", lambda n: [])(n)
    bounds = [0, *cuts, n]
    seen = []
    for a, b in zip(bounds, bounds[1:]):
        out = cache.stepwise(x[:, :, a:b])
        seen += [out] * (b - a)
    return seen


@SETTINGS
@given(st.sampled_from([4, 8]), st.booleans(), st.lists(st.integers(1, 40), max_size=3), st.integers(2, 90),
       st.integers(0, 2 ** 16), st.integers(0, 70))
def test_quantized_dyn_cache_chunks_read_as_one_token_calls(bits, per_channel, history, chunk, seed, abort):
    """Each row of a chunk reads, at every position up to its own, exactly what its one-token call's
    cache held (causal attention over the chunk's cache then equals the one-token runs); a chunked run
    rolled back first changes nothing."""
    rng = np.random.default_rng(seed)
    a = TractQuantizedDynKvCache(bits=bits, per_channel=int(per_channel))
    for s in history:
        a(rng.standard_normal((1, 2, s, 8)).astype(np.float32))
    b = _twin(a) if a.len else TractQuantizedDynKvCache(bits=bits, per_channel=int(per_channel))
    if abort:
        mark = a.checkpoint()
        _chunked_cache_run(a, rng.standard_normal((1, 2, abort, 8)).astype(np.float32))
        a.rollback(mark)
    len0 = a.len
    x = (rng.standard_normal((1, 2, chunk, 8)) * 3).astype(np.float32)
    seen = _chunked_cache_run(a, x)
    for i in range(chunk):
        one = b(x[:, :, i:i + 1])
        np.testing.assert_array_equal(seen[i][:, :, :len0 + i + 1], one)
    assert _states_equal(a, b)


def test_quantized_dyn_cache_needs_its_cuts():
    """Without the cuts a block completed inside the chunk is read quantized by the earlier rows."""
    rng = np.random.default_rng(1)
    a, b = TractQuantizedDynKvCache(bits=4, per_channel=1), TractQuantizedDynKvCache(bits=4, per_channel=1)
    x = (rng.standard_normal((1, 1, 40, 8)) * 3).astype(np.float32)
    assert a.stepwise_splits(40) == [35]  # 4 sinks + 32: token 35 completes the first block
    whole = a(x)
    early = b(x[:, :, :20])
    assert not np.array_equal(whole[:, :, :20], early)


@SETTINGS
@given(st.lists(st.integers(1, 10), max_size=3), st.integers(2, 30), st.integers(0, 2 ** 16))
def test_f32_caches_are_chunk_invariant(history, chunk, seed):
    rng = np.random.default_rng(seed)
    a = DynKvCache(name="c", axis=2, datum_type="f32")
    for s in history:
        a(rng.standard_normal((1, 2, s, 4)).astype(np.float32))
    b = DynKvCache(name="c", axis=2, datum_type="f32")
    b.load_state_tensors(a.state_tensors())
    x = rng.standard_normal((1, 2, chunk, 4)).astype(np.float32)
    len0 = a.length
    seen = _chunked_cache_run(a, x)
    for i in range(chunk):
        np.testing.assert_array_equal(seen[i][:, :, :len0 + i + 1], b(x[:, :, i:i + 1]))
    assert _states_equal(a, b)
    w1, w2 = WindowKvSdpa(axis=2, window=7, scale=0.3), WindowKvSdpa(axis=2, window=7, scale=0.3)
    q, k, v = _tensors(rng, 1, 4, 2, chunk, 8)
    np.testing.assert_array_equal(w1.stepwise(q, k, v), _one_token_calls(w2, q, k, v))
    assert _states_equal(w1, w2)


@pytest.mark.parametrize("make", [lambda: KiviSdpa(bits=3, key_group=4, value_group=4, residual=3, sinks=1),
                                  lambda: TractQuantizedKvSdpa(scale=0.3)])
def test_stepwise_then_rollback_restores_the_state(make):
    rng = np.random.default_rng(5)
    a = make()
    a(*_tensors(rng, 1, 2, 1, 9, 8))
    before = a.state_tensors()
    mark = a.checkpoint()
    a.stepwise(*_tensors(rng, 1, 2, 1, 21, 8))
    a.rollback(mark)
    after = a.state_tensors()
    assert all(np.array_equal(before[k], after[k]) for k in before)


# ---------------------------------------------------------------------------------------------- sessions
def _decoder(cache: str, scheme: str | None, bits: int = 4):
    from nnef_kv.converters import convert
    from nnef_kv.models import DecoderConfig, build_decoder

    model = build_decoder(DecoderConfig(cache=cache, vocab=64, hidden=32, heads=4, kv_heads=2, head_dim=8, mlp=48))
    if scheme is None:
        return model
    kivi = dict(key_group=8, residual=8) if scheme == "kivi" else {}  # options the other schemes refuse
    return convert(model, scheme=scheme, bits=bits, **kivi)[0]


def _logits_one_by_one(model, ids, n0):
    from nnef_kv.validate.decode import InterpreterDecoder

    dec = InterpreterDecoder(model)
    out = [dec(np.asarray(ids[:n0]))] + [dec(np.asarray([t])) for t in ids[n0:]]
    return np.stack(out), dec


def _logits_stepwise(model, ids, n0, **run):
    from nnef_kv.validate.decode import InterpreterDecoder

    dec = InterpreterDecoder(model)
    first = dec(np.asarray(ids[:n0]))
    feed = dict(dec.cache)
    feed[dec.sig.ids_input] = np.asarray(ids[n0:], np.int64)[None]
    got = dec.session.run(feed, stepwise=True, **run)
    outs = got[0] if isinstance(got, tuple) else got
    lg = np.asarray(outs[dec.sig.logits_output])
    return np.concatenate([first[None], lg.reshape(-1, lg.shape[-1])]), dec, got


def assert_states_close(states1: list, states2: list) -> None:
    """Two sessions' KV states after the same tokens: the same tensors, floats within the rounding of a
    batched weight product (f16 ones within one f16 ulp), codes at most 1% apart (a value on a rounding edge may
    land one code over)."""
    for s1, s2 in zip(states1, states2):
        t1, t2 = s1.state_tensors(), s2.state_tensors()
        assert t1.keys() == t2.keys()
        for key in t1:
            if t1[key].dtype == np.float16:  # f16 scales: a value on an f16 rounding edge may land one ulp over
                a, b = t1[key].astype(np.float32), t2[key].astype(np.float32)
                ulp = np.spacing(np.maximum(np.abs(a), np.abs(b)).astype(np.float16)).astype(np.float32)
                bad = ~(np.isclose(a, b, rtol=1e-4, atol=1e-5, equal_nan=True) | (np.abs(a - b) <= ulp))
                assert not bad.any(), f"{key}: {int(bad.sum())} f16 values more than one ulp apart"
            elif t1[key].dtype.kind == "f":
                np.testing.assert_allclose(t1[key], t2[key], rtol=1e-4, atol=1e-5)
            else:
                assert t1[key].shape == t2[key].shape and np.sum(t1[key] != t2[key]) <= 0.01 * t1[key].size


@pytest.mark.parametrize("cache,scheme,bits", [("explicit", None, 0), ("dyn", None, 0), ("explicit", "kivi", 4),
                                               ("explicit", "kivi", 2), ("dyn", "kivi", 3), ("explicit", "tract", 8),
                                               ("explicit", "tract-cache", 4), ("dyn", "tract-cache", 8)])
def test_session_stepwise_equals_one_token_runs(cache, scheme, bits):
    """Whole decoders: the logits of every position within 1e-5 relative of one-token runs, the same
    state afterwards (within the rounding of a batched weight product), the tract-cache scheme cut at
    key-block boundaries."""
    model = _decoder(cache, scheme, bits)
    ids = [int(i) for i in np.random.default_rng(7).integers(0, 64, 90)]
    want, d1 = _logits_one_by_one(model, ids, 20)
    got, d2, _ = _logits_stepwise(model, ids, 20)
    assert got.shape == want.shape == (71, 64)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    assert_states_close(d1.session.states, d2.session.states)


def test_session_stepwise_explicit_cache_outputs_are_the_last_runs():
    model = _decoder("explicit", None)
    ids = [int(i) for i in np.random.default_rng(8).integers(0, 64, 30)]
    _, d1 = _logits_one_by_one(model, ids, 10)
    _, d2, got = _logits_stepwise(model, ids, 10)
    for i, o in d2.sig.cache_outputs.items():
        np.testing.assert_allclose(got[o], d1.cache[i], rtol=1e-5, atol=1e-6)


def test_session_stepwise_capture_and_capture_map():
    from nnef_kv.validate.capture import attention_step_indices

    model = _decoder("explicit", "kivi")
    ids = [int(i) for i in np.random.default_rng(9).integers(0, 64, 60)]
    nodes = lambda dec: [dec.session.plan.step_nodes[i] for i in attention_step_indices(dec.session.plan)]  # noqa: E731
    from nnef_kv.validate.decode import InterpreterDecoder

    dec = InterpreterDecoder(model)
    dec(np.asarray(ids[:20]))
    feed = {dec.sig.ids_input: np.asarray(ids[20:], np.int64)[None]}
    outs, caps = dec.session.run(feed, capture=nodes(dec), stepwise=True, capture_map=lambda a: a[:, :, -1:].copy())
    assert len(caps) == 2 and all(c.shape == (1, 4, 1, 8) for c in caps.values())


def test_session_stepwise_rolls_back_a_failed_chunked_run():
    model = _decoder("explicit", "tract-cache", 4)
    from nnef_kv.validate.decode import InterpreterDecoder

    ids = np.random.default_rng(10).integers(0, 64, 80).astype(np.int64)
    dec = InterpreterDecoder(model)
    dec(ids[:10])
    before = [s.state_tensors() for s in dec.session.states]
    victim = dec.session.states[-1]
    calls = {"n": 0}
    real = victim.stepwise

    def flaky(*a):
        calls["n"] += 1
        if calls["n"] == 2:  # the second chunk fails, after the first one took its tokens
            raise RuntimeError("injected")
        return real(*a)

    victim.stepwise = flaky
    with pytest.raises(Exception, match="injected"):
        dec.session.run({dec.sig.ids_input: ids[None, 10:]}, stepwise=True)
    assert calls["n"] == 2
    del victim.stepwise
    after = [s.state_tensors() for s in dec.session.states]
    assert all(all(np.array_equal(b[k], a[k]) for k in b) for b, a in zip(before, after))
    # and the session goes on as if the failed run never happened
    got = dec.session.run({dec.sig.ids_input: ids[None, 10:]}, stepwise=True)
    fresh = InterpreterDecoder(model)
    fresh(ids[:10])
    want = fresh.session.run({fresh.sig.ids_input: ids[None, 10:]}, stepwise=True)
    np.testing.assert_array_equal(got[dec.sig.logits_output], want[fresh.sig.logits_output])
