"""The ggml KV op ``nnef_kv_ggml_sdpa`` (llama.cpp's -ctk/-ctv cache types): stored blocks, attention
over them, stepwise runs, checkpoint/rollback, saved state, bytes held, NaN/Inf, the op in a graph."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nnef_kv.errors import GraphError, InputError, StateError
from nnef_kv.kv import GgmlSdpa, ggml, softmax_attention

TYPES = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl", "f16", "f32")
BLOCK_TYPES = TYPES[:6]
# every K type with q8_0 values, every V type with q8_0 keys, a few mixed pairs and an f16 cache
PAIRS = sorted({(t, "q8_0") for t in TYPES} | {("q8_0", t) for t in TYPES}
               | {("q4_0", "q5_1"), ("iq4_nl", "q4_1"), ("q5_0", "f16"), ("f16", "f16")})


def _qkv(rng, b, hq, hkv, s, d, dtype=np.float32, kscale=None):
    q = rng.standard_normal((b, hq, s, d)).astype(dtype)
    ks = rng.uniform(0.2, 4, size=(1, 1, 1, d)) if kscale is None else kscale
    k = (rng.standard_normal((b, hkv, s, d)) * ks).astype(dtype)
    v = rng.standard_normal((b, hkv, s, d)).astype(dtype)
    return q, k, v


def f32_attention_tolerance(k: np.ndarray, v: np.ndarray) -> float:
    """How far two f32 attentions over the same K/V may differ by summation order alone: eps x the lengths of
    the two reductions (head_dim D for the scores, the T keys for the weighted sum) x the largest |value|.
    Absolute: an output near 0 is a sum of values of either sign (0.0512 from values near 1: a relative
    tolerance would ask for more digits than f32 holds; blocks merged by an online softmax round their own
    way, and how far numba's and NumPy's reductions land apart depends on the platform)."""
    t, d = k.shape[-2], k.shape[-1]
    return float(np.finfo(np.float32).eps) * (t + d) * float(np.max(np.abs(v)))


def _causal(t: int, s: int) -> np.ndarray:
    return np.arange(t)[None, :] <= (t - s + np.arange(s))[:, None]


def _stored(x: np.ndarray, type_: str) -> np.ndarray:
    """What a token row of ``type_`` reads back as (f32), computed with ggml.py directly."""
    if type_ == "f32":
        return x.astype(np.float32)
    if type_ == "f16":
        return x.astype(np.float16).astype(np.float32)
    return ggml.dequantize(ggml.quantize(x, type_))


def _expected_read(ks, vs, len0, r, kt, vt):
    """K, V as a call must read them (all tokens so far, this call's included, ``[B, Hkv, T, D]``):
    residual 0 -> every token through its type (llama.cpp); else the tokens stored before the call
    (all but the newest ``r`` of the ``len0`` previous ones) through their type, the rest exact."""
    k, v = np.concatenate(ks, axis=2), np.concatenate(vs, axis=2)
    tq = k.shape[2] if r == 0 else max(0, len0 - r)
    kd = np.concatenate([_stored(k[:, :, :tq], kt), k[:, :, tq:].astype(np.float32)], axis=2)
    vd = np.concatenate([_stored(v[:, :, :tq], vt), v[:, :, tq:].astype(np.float32)], axis=2)
    return kd, vd


def _states_equal(a, b) -> bool:
    ta, tb = a.state_tensors(), b.state_tensors()
    return ta.keys() == tb.keys() and all(
        ta[k].dtype == tb[k].dtype and np.array_equal(ta[k], tb[k], equal_nan=ta[k].dtype.kind == "f") for k in ta)


def _twin(op: GgmlSdpa) -> GgmlSdpa:
    other = GgmlSdpa(scale=op.cfg.scale, key_type=op.cfg.key_type, value_type=op.cfg.value_type,
                     residual=op.cfg.residual, is_causal=op.cfg.is_causal)
    other.load_state_tensors(op.state_tensors())
    return other


def _rounding_bound(op, q, scale):
    """f32 rounding of two attention runs that sum the same terms in different orders: a score s
    carries ~eps |s|, so an output differs by ~eps (1 + max |s|) max |v| (cancelling sums included)."""
    kd, vd = op.dequantized()
    b, hkv, _, d = kd.shape
    qg = q.reshape(b, hkv, -1, d).astype(np.float32)
    with np.errstate(invalid="ignore"):
        s = np.abs(np.matmul(qg, np.swapaxes(np.nan_to_num(kd), -1, -2))) * scale
        vmax = float(np.max(np.abs(np.nan_to_num(vd)), initial=0))
    return 16 * np.finfo(np.float32).eps * (1 + float(s.max(initial=0))) * max(vmax, 1.0)


def _one_token_calls(op, q, k, v):
    return np.concatenate([op(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1]) for i in range(k.shape[2])],
                          axis=2)


# ------------------------------------------------------------------------------------ storage, attention
@pytest.mark.parametrize("residual", [0, 5])
@pytest.mark.parametrize("kt,vt", PAIRS)
def test_blocks_and_attention_match_ggml(kt, vt, residual):
    """Stored blocks are ggml.quantize of each token's rows (bit-exact), the window the exact tokens;
    every call's output is exact f32 attention over what it must read (GQA, B = 2, prefill chunks then
    decode steps; small token blocks and score budget so several blocks and row blocks are merged)."""
    rng = np.random.default_rng(TYPES.index(kt) * 100 + TYPES.index(vt) * 10 + residual)
    op = GgmlSdpa(scale=0.2, key_type=kt, value_type=vt, residual=residual, block_tokens=7, score_budget=3000)
    ks, vs = [], []
    for s in [13, 1, 1, 9, 1, 1, 1, 3]:
        q, k, v = _qkv(rng, 2, 4, 2, s, 64)
        len0 = op.len
        ks.append(k)
        vs.append(v)
        kd, vd = _expected_read(ks, vs, len0, residual, kt, vt)
        out = op(q, k, v)
        ref = softmax_attention(q, kd, vd, 0.2, _causal(op.len, s))
        assert out.shape == q.shape and out.dtype == np.float32
        np.testing.assert_allclose(out, ref, rtol=0, atol=f32_attention_tolerance(kd, vd))
    k, v = np.concatenate(ks, 2).reshape(4, -1, 64), np.concatenate(vs, 2).reshape(4, -1, 64)
    tq = op.len - min(op.len, residual)
    assert (op.n_quant, op.n_res) == (tq, op.len - tq)
    for cache, x, t in ((op.k_cache, k, kt), (op.v_cache, v, vt)):
        held = cache.buf.view()
        if t in BLOCK_TYPES:
            assert held.dtype == np.uint8 and held.shape == (4, tq, 2, ggml.block_bytes(t))
            np.testing.assert_array_equal(held, ggml.quantize(x[:, :tq], t).data)
        else:
            assert held.dtype == np.dtype(t.replace("f", "float"))
            np.testing.assert_array_equal(held, x[:, :tq].astype(held.dtype))
    np.testing.assert_array_equal(op.res_k.view(), k[:, tq:])
    np.testing.assert_array_equal(op.res_v.view(), v[:, tq:])
    kd, vd = op.dequantized()
    np.testing.assert_array_equal(kd.reshape(4, -1, 64), np.concatenate([_stored(k[:, :tq], kt), k[:, tq:]], 1))
    np.testing.assert_array_equal(vd.reshape(4, -1, 64), np.concatenate([_stored(v[:, :tq], vt), v[:, tq:]], 1))


def test_prefill_reads_its_own_tokens_quantized_unless_a_window_keeps_them():
    """residual 0: a prompt attends to its tokens through the blocks (llama.cpp writes the cache first);
    with a window the call's own tokens are read in full precision (KIVI's convention)."""
    rng = np.random.default_rng(1)
    q, k, v = _qkv(rng, 1, 4, 2, 40, 32)
    exact = softmax_attention(q, k, v, 0.25, _causal(40, 40))
    ll = GgmlSdpa(scale=0.25, key_type="q4_0", value_type="q4_0")(q, k, v)
    ref = softmax_attention(q, _stored(k, "q4_0"), _stored(v, "q4_0"), 0.25, _causal(40, 40))
    np.testing.assert_allclose(ll, ref, rtol=1e-5, atol=2e-6)
    assert np.abs(ll - exact).max() > 1e-2
    win = GgmlSdpa(scale=0.25, key_type="q4_0", value_type="q4_0", residual=8)
    np.testing.assert_allclose(win(q, k, v), exact, rtol=1e-5, atol=2e-6)
    assert (win.n_quant, win.n_res) == (32, 8)  # the 32 oldest left the window after the attention


def test_causal_alignment_gqa_and_non_causal():
    rng = np.random.default_rng(2)
    op = GgmlSdpa(scale=0.3, key_type="f32", value_type="f32")  # exact storage
    q, k, v = _qkv(rng, 1, 6, 2, 5, 32)
    out = op(q, k, v)
    np.testing.assert_allclose(out[0, :, 0], np.repeat(v[0, :, 0], 3, axis=0), atol=1e-6)  # h -> h // 3
    q2, k2, v2 = _qkv(rng, 1, 6, 2, 4, 32)
    out2 = op(q2[:, :, :2], k2, v2)  # fewer queries than new tokens: they are the last positions
    kf, vf = np.concatenate([k, k2], 2), np.concatenate([v, v2], 2)
    np.testing.assert_allclose(out2, softmax_attention(q2[:, :, :2], kf, vf, 0.3, _causal(9, 2)), rtol=1e-5, atol=1e-6)
    nc = GgmlSdpa(scale=0.3, key_type="q8_0", value_type="q5_1", residual=2, is_causal=False)
    ref = softmax_attention(q, k, v, 0.3)  # all in the window or the call: exact
    np.testing.assert_allclose(nc(q, k, v), ref, rtol=1e-5, atol=1e-6)
    kd, vd = nc.dequantized()
    out3 = nc(q2, k2, v2)
    ref3 = softmax_attention(q2, np.concatenate([kd, k2], 2), np.concatenate([vd, v2], 2), 0.3)
    np.testing.assert_allclose(out3, ref3, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("residual", [0, 6])
def test_f16_in_f16_out(residual):
    """f16 inputs: computed in f32 (the same numbers as an f32 op fed the same values), output f16,
    window held in f16."""
    rng = np.random.default_rng(3)
    op = GgmlSdpa(scale=0.25, key_type="q4_1", value_type="q8_0", residual=residual)
    op32 = GgmlSdpa(scale=0.25, key_type="q4_1", value_type="q8_0", residual=residual)
    for s in [10, 1, 1, 4, 1]:
        q, k, v = _qkv(rng, 1, 4, 2, s, 32, np.float16)
        out = op(q, k, v)
        assert out.dtype == np.float16 and out.shape == q.shape
        want = op32(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32))
        np.testing.assert_array_equal(out, want.astype(np.float16))
    assert op.res_k.dtype == np.float16 and op.state_tensors()["shape"][4] == 1
    np.testing.assert_array_equal(op.k_cache.buf.view(), op32.k_cache.buf.view())


def test_q8_0_is_close_to_an_f16_cache_and_orders_as_expected():
    """The same decode with every cache type: deviation from an f16 cache grows as the bits shrink."""
    rng = np.random.default_rng(4)
    q, k, v = _qkv(rng, 1, 4, 2, 160, 64, kscale=1.0)
    err = {}
    for t in ("f16", "q8_0", "q5_1", "q4_0"):
        op = GgmlSdpa(scale=0.125, key_type=t, value_type=t)
        op(q[:, :, :128], k[:, :, :128], v[:, :, :128])
        outs = np.concatenate([op(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1]) for i in range(128, 160)], 2)
        err[t] = outs
    ref = err.pop("f16")
    dev = {t: float(np.linalg.norm(o - ref) / np.linalg.norm(ref)) for t, o in err.items()}
    assert dev["q8_0"] < 0.01 and dev["q8_0"] < dev["q5_1"] < dev["q4_0"], dev


# ----------------------------------------------------------------------------------------------- stepwise
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def stepwise_cases(draw):
    kt, vt = draw(st.sampled_from(TYPES)), draw(st.sampled_from(TYPES))
    residual = draw(st.sampled_from([0, 0, 1, 3, 8, 17]))
    hkv, groups = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2, 3]))
    history = draw(st.lists(st.integers(1, 30), max_size=3))
    chunk = draw(st.integers(2, 40))
    causal = draw(st.booleans())
    nan = draw(st.booleans())
    b, d = draw(st.sampled_from([(1, 32), (1, 64), (2, 32)]))
    return kt, vt, residual, hkv, groups, history, chunk, causal, nan, b, d, draw(st.integers(0, 2 ** 16))


@SETTINGS
@given(stepwise_cases())
def test_stepwise_equals_one_token_calls(case):
    """A stepwise chunk answers as one-token calls (within f32 rounding, NaN where they have NaN) and
    leaves bit-identical state tensors; a plain chunk call leaves that same state too."""
    kt, vt, residual, hkv, groups, history, chunk, causal, nan, bsz, d, seed = case
    rng = np.random.default_rng(seed)
    kw = dict(scale=0.2, key_type=kt, value_type=vt, residual=residual, is_causal=causal)
    a = GgmlSdpa(**kw, block_tokens=int(rng.integers(5, 40)), score_budget=int(rng.choice([1 << 22, 4000])))
    for s in history:
        a(*_qkv(rng, bsz, hkv * groups, hkv, s, d))
    b = _twin(a) if a.len else GgmlSdpa(**kw)
    c = _twin(a) if a.len else GgmlSdpa(**kw)
    q, k, v = _qkv(rng, bsz, hkv * groups, hkv, chunk, d)
    if nan:  # a poisoned key block and a poisoned value block, read by the rows that see them only
        k[0, 0, rng.integers(chunk), rng.integers(d)] = np.nan
        v[-1, -1, rng.integers(chunk), rng.integers(d)] = np.nan
    got = a.stepwise(q, k, v)
    want = _one_token_calls(b, q, k, v)
    c(q, k, v)
    assert got.shape == q.shape and got.dtype == q.dtype
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=_rounding_bound(a, q, 0.2))
    assert _states_equal(a, b) and _states_equal(a, c) and a.census() == b.census()


def test_stepwise_with_a_window_reads_each_token_as_decoding_would():
    """With a window a chunk call reads all its tokens in full precision; stepwise rows read the tokens
    more than ``residual`` before them dequantized, like their one-token calls. Without a window a chunk
    call already is stepwise (every token is quantized before anyone reads it)."""
    rng = np.random.default_rng(5)
    q, k, v = _qkv(rng, 1, 2, 1, 24, 32)
    kw = dict(scale=0.3, key_type="q4_0", value_type="q4_0", residual=4)
    sw = GgmlSdpa(**kw).stepwise(q, k, v)
    np.testing.assert_allclose(sw, _one_token_calls(GgmlSdpa(**kw), q, k, v), rtol=1e-5, atol=2e-6)
    differ = np.abs(sw - GgmlSdpa(**kw)(q, k, v)).max(axis=(0, 1, 3)) > 1e-6
    assert not differ[:5].any() and differ[5:].all()  # row i >= 5 reads token i - 5 quantized
    plain = GgmlSdpa(scale=0.3, key_type="q4_0", value_type="q4_0")
    plain_sw = GgmlSdpa(scale=0.3, key_type="q4_0", value_type="q4_0").stepwise(q, k, v)
    np.testing.assert_allclose(plain(q, k, v), plain_sw, rtol=1e-5, atol=2e-6)


def test_stepwise_needs_one_query_per_token():
    rng = np.random.default_rng(0)
    q, k, v = _qkv(rng, 1, 2, 1, 5, 32)
    op = GgmlSdpa()
    with pytest.raises(InputError, match="one query row per new token"):
        op.stepwise(q[:, :, :2], k, v)
    assert op.len == 0 and not op._buffers()  # the failed first call left nothing behind


# ----------------------------------------------------------------------------- checkpoint, state, bytes
ROLLBACK_KINDS = [dict(key_type="q4_0", value_type="q8_0"), dict(key_type="iq4_nl", value_type="q5_1", residual=3),
                  dict(key_type="f16", value_type="q4_1", residual=40)]


@pytest.mark.parametrize("kw", ROLLBACK_KINDS)
def test_checkpoint_rollback_after_a_failed_call(kw):
    rng = np.random.default_rng(6)
    op, ref = GgmlSdpa(scale=0.25, **kw), GgmlSdpa(scale=0.25, **kw)
    x = _qkv(rng, 1, 4, 2, 30, 32)
    np.testing.assert_array_equal(op(*x), ref(*x))
    before = op.state_tensors()
    mark = op.checkpoint()
    op(*_qkv(rng, 1, 4, 2, 45, 32))  # crosses block pages and the window
    op.stepwise(*_qkv(rng, 1, 4, 2, 3, 32))
    with pytest.raises(InputError, match="does not match the cache"):
        op(*_qkv(rng, 1, 4, 4, 2, 32))  # the run fails
    after_fail = op.state_tensors()
    op.rollback(mark)
    assert _states_equal(op, ref) and all(np.array_equal(before[n], op.state_tensors()[n]) for n in before)
    assert op.len == 30 and op.k_cache.buf.len == ref.k_cache.buf.len
    assert after_fail["shape"][3] == 78  # the failed call itself changed nothing
    for s in (10, 1, 1):
        x = _qkv(rng, 1, 4, 2, s, 32)
        np.testing.assert_array_equal(op(*x), ref(*x))
    fresh, empty = GgmlSdpa(**kw), GgmlSdpa(**kw)
    mark = fresh.checkpoint()
    fresh(*_qkv(rng, 1, 4, 2, 5, 32))
    fresh.rollback(mark)
    assert _states_equal(fresh, empty)


@settings(max_examples=40, deadline=None)
@given(kind=st.integers(0, len(ROLLBACK_KINDS) - 1), seed=st.integers(0, 2 ** 16),
       plan=st.lists(st.tuples(st.integers(1, 9) | st.integers(28, 70), st.sampled_from(["keep", "abort", "abort2"]),
                               st.booleans()), min_size=1, max_size=8))
def test_rollback_restores_exactly(kind, seed, plan):
    """Checkpoint, one or two calls (plain or stepwise, crossing pages and the window), rollback: the
    state equals, tensor for tensor, and answers exactly like, one only given the kept calls."""
    rng = np.random.default_rng(seed)
    state, ref = GgmlSdpa(scale=0.25, **ROLLBACK_KINDS[kind]), GgmlSdpa(scale=0.25, **ROLLBACK_KINDS[kind])
    for n, what, step in plan:
        if what != "keep":
            mark = state.checkpoint()
            (state.stepwise if step else state)(*_qkv(rng, 1, 4, 2, n, 32))
            if what == "abort2":
                state(*_qkv(rng, 1, 4, 2, 3, 32))
            state.rollback(mark)
            assert _states_equal(state, ref)
        x = _qkv(rng, 1, 4, 2, n, 32)
        np.testing.assert_array_equal(state(*x), ref(*x))
    assert _states_equal(state, ref) and state.nbytes() == ref.nbytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("kw", ROLLBACK_KINDS)
def test_save_restore_continues_bit_identically(kw, dtype):
    rng = np.random.default_rng(7)
    a = GgmlSdpa(scale=0.2, **kw)
    for s in [11, 1, 1, 7, 1]:
        a(*_qkv(rng, 2, 4, 2, s, 64, dtype))
    st_ = a.state_tensors()
    assert set(st_) == {"config", "shape", "k_cache", "v_cache", "res_k", "res_v"}
    b = GgmlSdpa(scale=0.2, **kw)
    b.load_state_tensors({name: x.copy() for name, x in st_.items()})
    assert _states_equal(a, b) and b.census() == a.census()
    for s in [1] * 12 + [5, 1]:
        x = _qkv(rng, 2, 4, 2, s, 64, dtype)
        np.testing.assert_array_equal(a(*x), b(*x))
    assert _states_equal(a, b)


def test_bad_state_is_refused_naming_the_tensor():
    rng = np.random.default_rng(8)
    kw = dict(key_type="q4_1", value_type="q8_0", residual=4)
    a = GgmlSdpa(**kw)
    for s in [20, 1]:
        a(*_qkv(rng, 1, 2, 2, s, 64))
    st_ = a.state_tensors()
    fresh = lambda: GgmlSdpa(**kw)
    cases = {
        "config": dict(st_, config=GgmlSdpa(key_type="q4_0", value_type="q8_0", residual=4).state_tensors()["config"]),
        "missing": {n: x for n, x in st_.items() if n != "v_cache"},
        "k_cache.*dtype": dict(st_, k_cache=st_["k_cache"].astype(np.int8)),
        "k_cache.*shape": dict(st_, k_cache=st_["k_cache"][:, :-1]),
        "v_cache": dict(st_, v_cache=st_["v_cache"][..., :20]),  # q4_1's 20-byte blocks for q8_0
        "res_k": dict(st_, res_k=st_["res_k"][:, :-1]),
        "res_v.*dtype": dict(st_, res_v=st_["res_v"].astype(np.float16)),
        "'shape'": dict(st_, shape=np.array([1, 2, 48, 21, 0], np.int64)),
    }
    # T inconsistent with what is held: 22 tokens claimed, 21 held -> the cache of 18 expected
    cases["k_cache"] = dict(st_, shape=np.array([1, 2, 64, 22, 0], np.int64))
    for match, tensors in cases.items():
        b = fresh()
        b(*_qkv(rng, 1, 2, 2, 3, 64))
        before = b.state_tensors()
        with pytest.raises(StateError, match=match):
            b.load_state_tensors(tensors)
        assert all(np.array_equal(before[n], b.state_tensors()[n]) for n in before)  # left as it was
    empty = fresh()
    empty.load_state_tensors(fresh().state_tensors())
    assert empty.len == 0 and empty.nbytes()["codes"] == 0


def test_bytes_held_are_the_blocks():
    """q4_0 (18-byte blocks: f16 d + 16 bytes of nibbles) at T tokens: T * D/32 * 18 bytes per head for
    K and for V, plus the GrowBuffers' spare capacity, counted explicitly; no f32 copy is kept."""
    rng = np.random.default_rng(9)
    b, hkv, d = 2, 2, 64
    op = GgmlSdpa(key_type="q4_0", value_type="q4_0")
    for s in [100] + [1] * 37:
        op(*_qkv(rng, b, 4, hkv, s, d))
    t = op.len
    nb = op.nbytes()
    held = op.k_cache.buf.data.nbytes + op.v_cache.buf.data.nbytes
    spare = sum((c.buf.capacity - c.buf.len) * (d // 32) * 18 * b * hkv for c in (op.k_cache, op.v_cache))
    assert nb["codes"] + nb["params"] == held == t * (d // 32) * 18 * 2 * b * hkv + spare
    assert nb["spare"] == spare and spare < 0.5 * held
    cap = op.k_cache.buf.capacity + op.v_cache.buf.capacity
    assert nb["params"] == cap * b * hkv * (d // 32) * 2 and nb["codes"] == cap * b * hkv * (d // 32) * 16
    assert nb["full_precision"] == 0
    assert nb["f32_equivalent"] == 2 * b * hkv * t * d * 4 == op.census()["f32_bytes"]
    assert nb["f16_equivalent"] == nb["f32_equivalent"] // 2
    other = {n: a for n, a in vars(op).items() if isinstance(a, np.ndarray)}
    assert not other  # nothing but the buffers
    # a restored state holds its tokens in pages of 64: spare < 64 tokens
    r = _twin(op)
    assert r.nbytes()["spare"] == (r.k_cache.buf.capacity - t) * (d // 32) * 18 * b * hkv * 2
    # every type: params are the f16 d (and m), the rest codes; float types are all codes
    for kt in TYPES:
        o = GgmlSdpa(key_type=kt, value_type=kt, residual=3)
        o(*_qkv(rng, 1, 2, 1, 70, 32))
        n_cap = o.k_cache.buf.capacity * 2  # K and V, one head, one block per token
        per = {"q4_1": 4, "q5_1": 4, "f16": 0, "f32": 0}.get(kt, 2)
        size = ggml.block_bytes(kt) if kt in BLOCK_TYPES else 32 * (2 if kt == "f16" else 4)
        got = o.nbytes()
        assert got["params"] == n_cap * per and got["codes"] == n_cap * (size - per), kt
        assert got["full_precision"] == 2 * 3 * 32 * 4 and o.census()["full_precision"] == 3


def test_nan_and_inf_follow_the_block_policy():
    rng = np.random.default_rng(10)
    d = 64
    q, k, v = _qkv(rng, 1, 4, 2, 12, d)
    k[0, 0, 4, 7] = np.nan  # kv head 0, token 4, block 0 of its key
    v[0, 1, 8, 40] = np.inf  # kv head 1, token 8, block 1 of its value
    op = GgmlSdpa(scale=0.25, key_type="q4_0", value_type="q8_0")
    out = op(q, k, v)
    kb = op.k_cache.buf.view()
    assert kb[0, 4, 0, :2].view("<u2")[0] == 0x7E00 and not kb[0, 4, 0, 2:].any()  # poisoned block
    np.testing.assert_array_equal(kb[0, 4, 1], ggml.quantize(k[0, 0, 4], "q4_0").data[1])  # the other block
    kd, vd = op.dequantized()
    assert np.isnan(kd[0, 0, 4, :32]).all() and np.isfinite(kd[0, 0, 4, 32:]).all()
    assert np.isnan(vd[0, 1, 8, 32:]).all() and np.isfinite(vd[0, 1, 8, :32]).all()
    # query heads 0, 1 read kv head 0: rows from position 4 on are all NaN, earlier rows finite
    assert np.isnan(out[0, :2, 4:]).all() and np.isfinite(out[0, :2, :4]).all()
    # query heads 2, 3 read kv head 1: from position 8 on the channels of the poisoned value block are NaN
    assert np.isnan(out[0, 2:, 8:, 32:]).all() and np.isfinite(out[0, 2:, 8:, :32]).all()
    assert np.isfinite(out[0, 2:, :8]).all()  # masked tokens contribute nothing (no 0 * NaN)
    fin = np.isfinite(out)
    ref = softmax_attention(q, np.nan_to_num(kd, nan=0.0), np.nan_to_num(vd, nan=0.0), 0.25, _causal(12, 12))
    np.testing.assert_allclose(out[fin], ref[fin], rtol=1e-5, atol=2e-6)
    # decoding on: the NaN key reaches every later query of kv head 0, nothing else changes
    step = op(*_qkv(rng, 1, 4, 2, 1, d))
    assert np.isnan(step[0, :2]).all() and np.isnan(step[0, 2:, :, 32:]).all()
    assert np.isfinite(step[0, 2:, :, :32]).all()
    # in the window (residual) values are kept as they are: only the NaN/Inf element's channel suffers
    w = GgmlSdpa(scale=0.25, key_type="q4_0", value_type="q8_0", residual=16)
    out_w = w(q, k, v)
    assert np.isnan(out_w[0, :2, 4:]).all() and np.isfinite(out_w[0, :2, :4]).all()
    assert np.isinf(out_w[0, 2:, 8:, 40]).all() and np.isfinite(np.delete(out_w[0, 2:], 40, axis=-1)).all()
    # an f16 cache turns finite values beyond the f16 range into inf, as llama.cpp's f16 cache does
    f = GgmlSdpa(key_type="f16", value_type="f16")
    kk = k.copy()
    kk[0, 0, 2, 3] = 1e6
    f(q, np.nan_to_num(kk), np.nan_to_num(v, posinf=0.0))
    assert np.isinf(f.dequantized()[0][0, 0, 2, 3])


# ------------------------------------------------------------------------------------ attributes, graph
def test_bad_attributes_and_inputs():
    with pytest.raises(GraphError, match="key_type"):
        GgmlSdpa(key_type="q6_k")
    with pytest.raises(GraphError, match="value_type"):
        GgmlSdpa(value_type="bf16")
    with pytest.raises(GraphError, match="residual"):
        GgmlSdpa(residual=-1)
    with pytest.raises(GraphError, match="axis"):
        GgmlSdpa(axis=1)
    assert GgmlSdpa(key_type="Q4_0").cfg.key_type == "q4_0"
    rng = np.random.default_rng(11)
    op = GgmlSdpa()
    with pytest.raises(InputError, match=r"nnef_kv_ggml_sdpa: head_dim D = 48 is not a multiple of 32"):
        op(*_qkv(rng, 1, 2, 2, 1, 48))
    with pytest.raises(InputError, match="multiple"):
        op(*_qkv(rng, 1, 3, 2, 1, 32))
    assert op.len == 0
    op(*_qkv(rng, 1, 2, 2, 2, 32))
    assert op.fp_window == 0 and GgmlSdpa(residual=9).fp_window == 9 and GgmlSdpa.QUANTIZED
    out = op(*_qkv(rng, 1, 2, 2, 0, 32)[:1], np.zeros((1, 2, 0, 32), np.float32), np.zeros((1, 2, 0, 32), np.float32))
    assert out.shape == (1, 2, 0, 32)


def test_registered_with_its_declaration():
    from nnef_kv.core.registry import PRIMITIVES, StatefulKernel
    from nnef_kv.kv.ggml_sdpa import GgmlSdpa

    prim = PRIMITIVES["nnef_kv_ggml_sdpa"]
    assert prim.registry == "nnef_kv" and prim.stateful and prim.state_factory is GgmlSdpa
    for attr in ('axis: integer = 2', 'scale: scalar = 0.125', 'key_type: string = "q8_0"',
                 'value_type: string = "q8_0"', 'residual: integer = 0', 'is_causal: logical = true'):
        assert attr in prim.signature
    state = prim.state_factory(axis=2, scale=0.125, key_type="q4_0", value_type="q8_0", residual=0, is_causal=True)
    assert isinstance(state, StatefulKernel) and isinstance(state, GgmlSdpa)
    from nnef_kv.kv.kivi.sdpa import SIGNATURE as KIVI_SIGNATURE

    assert KIVI_SIGNATURE.startswith("fragment nnef_kv_kivi_sdpa(") and "key_type" not in KIVI_SIGNATURE
    assert PRIMITIVES["nnef_kv_kivi_sdpa"].decl.name == "nnef_kv_kivi_sdpa"


GRAPH = """version 1.0;
extension nnef_kv;
extension tract_symbol S;
extension tract_symbol H;
graph g(q, k, v, q2) -> (o, o2) {
  q = external<scalar>(shape = [1, 4, S, 32]);
  k = external<scalar>(shape = [1, 2, S, 32]);
  v = external<scalar>(shape = [1, 2, S, 32]);
  q2 = external<scalar>(shape = [1, H, S, 32]);
  o = nnef_kv_ggml_sdpa(q, k, v, scale = 0.25, key_type = "q4_0", value_type = "q8_0", residual = 2);
  o2 = nnef_kv_ggml_sdpa(q2, k, v, key_type = "iq4_nl", value_type = "f16");
}
"""


def test_the_op_in_a_graph(tmp_path):
    """Two ggml nodes in a graph run by the interpreter: same outputs as the plain classes, bytes,
    a run failing in the second node rolled back in the first, save/restore of the session state."""
    from nnef_kv.io.archive import Model

    model = Model.from_text(GRAPH, {})
    sess = model.session()
    plain = GgmlSdpa(scale=0.25, key_type="q4_0", value_type="q8_0", residual=2)
    plain2 = GgmlSdpa(key_type="iq4_nl", value_type="f16")
    rng = np.random.default_rng(12)

    def feed(s=1, h2=2):
        q, k, v = _qkv(rng, 1, 4, 2, s, 32)
        return {"q": q, "k": k, "v": v, "q2": q[:, :h2]}

    for s in [5, 1, 1, 1, 3]:
        x = feed(s)
        got = sess.run(x)
        np.testing.assert_array_equal(got["o"], plain(x["q"], x["k"], x["v"]))
        np.testing.assert_array_equal(got["o2"], plain2(x["q2"], x["k"], x["v"]))
    nb = sess.kv_cache_bytes()
    ref = [plain.nbytes(), plain2.nbytes()]
    assert all(nb[key] == ref[0][key] + ref[1][key] for key in ("codes", "params", "full_precision"))
    before = [s.state_tensors() for s in sess.states]
    with pytest.raises(InputError, match="not a multiple"):
        sess.run(feed(2, h2=3))  # the second node fails after the first one took the two tokens
    assert all(np.array_equal(b[n], s.state_tensors()[n]) for b, s in zip(before, sess.states) for n in b)
    path = tmp_path / "state.tar"
    sess.save_state(path)
    restored = model.session(state=path)
    for s in [1, 1, 4, 1]:
        x = feed(s)
        a, b = sess.run(x), restored.run(x)
        np.testing.assert_array_equal(a["o"], b["o"])
        np.testing.assert_array_equal(a["o2"], b["o2"])
    other = Model.from_text(GRAPH.replace('key_type = "q4_0"', 'key_type = "q5_0"'), {})
    with pytest.raises(StateError):  # another model (and another config of the node)
        other.session(state=path)
