"""``nnef_kv_hf_quantized_sdpa``: Hugging Face's QuantizedCache (quanto, HQQ) reproduced, checked against
golden output of the real implementation (``tools/make_hf_cache_golden.py``), stepwise runs, checkpoint
and rollback, saved states, byte counts, refused attributes and states, NaN/Inf, and inside a graph."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nnef_kv
from nnef_kv.errors import GraphError, InputError, StateError
from nnef_kv.kv import HfQuantizedSdpa

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "fixtures" / "hf_quantized_cache_golden.npz"
SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _digest_fn():
    spec = importlib.util.spec_from_file_location("make_hf_cache_golden", ROOT / "tools" / "make_hf_cache_golden.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # numpy only at import time (torch is imported in main)
    return mod.digest


digest = _digest_fn()


def _golden_cases():
    g = np.load(GOLDEN)
    return g, sorted({k.split("/")[0] for k in g.files if "/" in k})


def _op_for(g, name):
    bits, gs, r, ak, av, be, _ = (int(x) for x in g[f"{name}/config"])
    return HfQuantizedSdpa(scale=float(g[f"{name}/scale"]), bits=bits, group_size=gs, residual=r, axis_key=ak,
                           axis_value=av, backend=("quanto", "hqq")[be])


def _replay(g, name):
    """Drive the op with the golden inputs: per call the K/V it attends (digests) and its outputs."""
    op = _op_for(g, name)
    q, k, v = g[f"{name}/q"], g[f"{name}/k"], g[f"{name}/v"]
    t0, dk, dv, outs = 0, [], [], []
    kr = vr = None
    for s in g[f"{name}/lens"]:
        sl = slice(t0, t0 + int(s))
        t0 += int(s)
        kr, vr = op.returned_kv(k[:, :, sl], v[:, :, sl])
        dk.append(digest(kr))
        dv.append(digest(vr))
        outs.append(op(q[:, :, sl], k[:, :, sl], v[:, :, sl]))
    return op, np.array(dk, np.uint64), np.array(dv, np.uint64), np.concatenate(outs, 2), kr, vr


def test_golden_file_is_small_and_has_both_backends():
    assert GOLDEN.stat().st_size < 1 << 20
    g, names = _golden_cases()
    assert {n.split("_")[0] for n in names} == {"quanto", "hqq"}
    assert "transformers 5.23.0" in [str(x) for x in g["versions"]]


@pytest.mark.parametrize("name", [n for n in _golden_cases()[1] if n.startswith("quanto")])
def test_quanto_reads_exactly_what_hf_returns(name):
    """quanto: the K/V attended at every call are bit-identical to what HF's QuantizedCache.update
    returned (exact digests of every call, the whole last call compared), across the prefill, two or
    more flushes (re-quantization of the dequantized history) and multi-token calls; f16 too; NaN/Inf
    groups as HF makes them. Attention within f32 rounding of torch's."""
    g, _ = _golden_cases()
    op, dk, dv, out, kr, vr = _replay(g, name)
    np.testing.assert_array_equal(dk, g[f"{name}/digest_k"])
    np.testing.assert_array_equal(dv, g[f"{name}/digest_v"])
    np.testing.assert_array_equal(kr, g[f"{name}/last_k"])
    np.testing.assert_array_equal(vr, g[f"{name}/last_v"])
    want = g[f"{name}/out"]
    np.testing.assert_array_equal(np.isnan(out), np.isnan(want))
    fin = np.isfinite(want)
    assert np.abs(out[fin] - want[fin]).max() <= 4e-6 + 1e-5 * np.abs(want[fin]).max()
    assert op.census()["tokens"] == int(g[f"{name}/lens"].sum())


@pytest.mark.parametrize("name", [n for n in _golden_cases()[1] if n.startswith("hqq")])
def test_hqq_reads_what_hf_returns_within_the_optimizer_rounding(name):
    """HQQ: same codes, scales bit-identical; the zero points differ in their last bits (torch's
    vectorised pow and cascade sums in the proximal optimizer), so the K/V differ by < 2e-5 absolute
    (measured 5.2e-6) for |K| up to ~10, and attention by < 3e-5 (measured 7.2e-6)."""
    g, _ = _golden_cases()
    _, _, _, out, kr, vr = _replay(g, name)
    assert np.abs(kr - g[f"{name}/last_k"]).max() < 2e-5
    assert np.abs(vr - g[f"{name}/last_v"]).max() < 2e-5
    assert np.abs(out - g[f"{name}/out"]).max() < 3e-5


# ------------------------------------------------------------------------------------- semantics
def _qkv(rng, b, hq, hkv, s, d, dtype=np.float32):
    q = rng.standard_normal((b, hq, s, d)).astype(dtype)
    k = (rng.standard_normal((b, hkv, s, d)) * rng.uniform(0.2, 4, size=(1, 1, 1, d))).astype(dtype)
    v = rng.standard_normal((b, hkv, s, d)).astype(dtype)
    return q, k, v


def _states_equal(a, b) -> bool:
    ta, tb = a.state_tensors(), b.state_tensors()
    return ta.keys() == tb.keys() and all(
        np.array_equal(ta[k], tb[k], equal_nan=ta[k].dtype.kind == "f") for k in ta)


def _softmax_ref(q, k, v, scale, causal=True):
    hq, sq = q.shape[1], q.shape[2]
    g = hq // k.shape[1]
    k = np.repeat(k.astype(np.float64), g, axis=1)
    v = np.repeat(v.astype(np.float64), g, axis=1)
    s = np.einsum("bhqd,bhtd->bhqt", q.astype(np.float64), k) * scale
    t = k.shape[2]
    if causal and sq > 1:
        s = np.where(np.arange(t)[None, :] <= (t - sq + np.arange(sq))[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhqt,bhtd->bhqd", p / p.sum(-1, keepdims=True), v)


def test_prefill_exact_then_decode_reads_the_dequantized_history_and_flushes():
    """The prefill attends exactly and is stored quantized; a decode call reads [dequantized store |
    residual | its token]; the residual holds up to residual - 1 tokens; the residual-th call
    re-quantizes the whole (dequantized) history."""
    rng = np.random.default_rng(0)
    op = HfQuantizedSdpa(scale=0.25, bits=4, group_size=16, residual=5)
    q, k, v = _qkv(rng, 1, 4, 2, 12, 16)
    np.testing.assert_allclose(op(q, k, v), _softmax_ref(q, k, v, 0.25), rtol=1e-5, atol=1e-6)
    assert op.census() == {"tokens": 12, "quantized": 12, "full_precision": 0, "f32_bytes": 8 * 2 * 12 * 16}
    kd, vd = op.dequantized()
    assert 0 < np.abs(kd - k).max() < 0.5  # stored quantized
    hist_k = kd
    for i in range(5):
        q, k, v = _qkv(rng, 1, 4, 2, 1, 16)
        kr, vr = op.returned_kv(k, v)
        np.testing.assert_array_equal(kr, np.concatenate([hist_k, op.res_k.view(), k], 2))
        out = op(q, k, v)
        np.testing.assert_allclose(out, _softmax_ref(q, kr, vr, 0.25), rtol=1e-5, atol=1e-6)
        assert op.census()["full_precision"] == (i + 1) % 5
    assert op.census()["quantized"] == 17
    # the flush re-quantized the dequantized history: the old part moved again (double quantization)
    kd2, _ = op.dequantized()
    from nnef_kv.kv.hf_quantized import quanto_dequantize, quanto_quantize
    again = quanto_dequantize(quanto_quantize(kr, 4, 0, 16), 4, 0, 16)
    np.testing.assert_array_equal(kd2, again)


def test_a_multi_token_call_flushes_by_tokens_not_calls():
    """HF counts tokens: a 6-token call with residual 4 quantizes all of them at once, while 6
    one-token calls leave 2 in the residual (and their rows read different K/V)."""
    rng = np.random.default_rng(1)
    a, b = HfQuantizedSdpa(bits=2, group_size=8, residual=4), HfQuantizedSdpa(bits=2, group_size=8, residual=4)
    x = _qkv(rng, 1, 2, 2, 9, 8)
    a(*x)
    b(*x)
    q, k, v = _qkv(rng, 1, 2, 2, 6, 8)
    chunk = a(q, k, v)
    steps = b.stepwise(q, k, v)
    assert a.census()["full_precision"] == 0 and b.census()["full_precision"] == 2
    assert np.abs(chunk - steps).max() > 1e-3


@st.composite
def configs(draw):
    backend = draw(st.sampled_from(["quanto", "hqq"]))
    d = 16
    if backend == "quanto":
        bits = draw(st.sampled_from([2, 4]))
        ak, av = draw(st.sampled_from([0, -1])), draw(st.sampled_from([0, -1]))
        # groups that fit any length: axis 0 groups within a token (g | D), axis -1 pairs of rows (g = Hkv = 2)
        g = 2 if -1 in (ak, av) else draw(st.sampled_from([4, 8, 16]))
    else:
        bits = draw(st.sampled_from([1, 2, 3, 4, 8]))
        ak = av = draw(st.sampled_from([0, 1])) if bits != 3 else 0
        # axis 1: 2 * D / g rows a token, a multiple of 8 / bits; axis 0: g rows (a multiple of 8 / bits)
        g = 4 if ak == 1 else draw(st.sampled_from([8, 16]))
    return dict(backend=backend, bits=bits, axis_key=ak, axis_value=av, group_size=g, d=d,
                residual=draw(st.integers(0, 12)), scale=draw(st.sampled_from([0.25, 0.7])))


def _build(cfg):
    c = dict(cfg)
    c.pop("d")
    return HfQuantizedSdpa(**c)


def _twin(op):
    other = HfQuantizedSdpa(scale=op.cfg.scale, bits=op.cfg.bits, group_size=op.cfg.group_size,
                            residual=op.cfg.residual, axis_key=op.cfg.axis_key, axis_value=op.cfg.axis_value,
                            backend=op.cfg.backend, is_causal=op.cfg.is_causal)
    other.load_state_tensors(op.state_tensors())
    return other


@SETTINGS
@given(configs(), st.lists(st.integers(1, 20), max_size=2), st.integers(2, 40), st.booleans(), st.integers(0, 2 ** 16))
def test_stepwise_equals_one_token_calls(cfg, history, chunk, f16, seed):
    """stepwise: the outputs of one-token calls (within f32 rounding of a batched matmul) and exactly
    the state they leave (vectorised per segment between flushes)."""
    rng = np.random.default_rng(seed)
    dt = np.float16 if f16 else np.float32
    a = _build(cfg)
    hkv = 2
    vmax = 0.0
    for s in history:
        qh, kh, vh = _qkv(rng, 1, 4, hkv, s, cfg["d"], dt)
        vmax = max(vmax, float(np.max(np.abs(vh))))
        a(qh, kh, vh)
    b = _twin(a) if a.len else _build(cfg)
    q, k, v = _qkv(rng, 1, 4, hkv, chunk, cfg["d"], dt)
    vmax = max(vmax, float(np.max(np.abs(v))))
    got = a.stepwise(q, k, v)
    want = np.concatenate([b(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1]) for i in range(chunk)], 2)
    assert got.shape == q.shape and got.dtype == q.dtype
    if f16:
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=2e-3, atol=2e-3)
    else:  # f32 rounding of a batched matmul: eps x the reductions' lengths (T keys, D) x the largest |value|
        tol = float(np.finfo(np.float32).eps) * (a.len + cfg["d"]) * vmax  # (a group's values quantize within it)
        np.testing.assert_allclose(got, want, rtol=0, atol=tol)
    assert _states_equal(a, b)
    assert a.census() == b.census()


def test_stepwise_needs_one_query_per_token():
    q, k, v = _qkv(np.random.default_rng(0), 1, 2, 1, 5, 8)
    with pytest.raises(InputError, match="one query row per new token"):
        HfQuantizedSdpa(group_size=8).stepwise(q[:, :, :2], k, v)


# ------------------------------------------------------------------------- checkpoint, state, bytes
def test_a_call_hf_refuses_leaves_the_state_unchanged_and_rollback_is_o1():
    """quanto axis -1 needs group_size | B*H*T at every quantization: a flush at a bad length raises
    InputError (HF's ValueError) with the state untouched; checkpoint/rollback undo a flush."""
    rng = np.random.default_rng(2)
    op = HfQuantizedSdpa(bits=4, group_size=8, residual=3, axis_key=-1, axis_value=-1)
    with pytest.raises(InputError, match="group_size 8 must divide"):
        op(*_qkv(rng, 1, 2, 2, 3, 8))  # 2 * 3 rows
    assert op.len == 0
    op(*_qkv(rng, 1, 2, 2, 4, 8))  # 8 rows: fine
    op(*_qkv(rng, 1, 2, 2, 1, 8))
    before = op.state_tensors()
    with pytest.raises(InputError):
        op(*_qkv(rng, 1, 2, 2, 2, 8))  # flush at 7 tokens: 14 rows
    after = op.state_tensors()
    assert all(np.array_equal(before[k], after[k]) for k in before)
    with pytest.raises(InputError):  # stepwise: rolled back by itself after its first, good segment
        op.stepwise(*_qkv(rng, 1, 2, 2, 4, 8))
    assert all(np.array_equal(before[k], v) for k, v in op.state_tensors().items())
    mark = op.checkpoint()
    held = (op.qk.codes, op.res_k.data)
    op(*_qkv(rng, 1, 2, 2, 3, 8))  # flush at 8 tokens: the store is replaced, not written into
    assert op.census()["quantized"] == 8 and held[0] is not op.qk.codes
    op.rollback(mark)
    assert op.qk.codes is held[0] and op.res_k.data is held[1]  # the very arrays: O(1), nothing copied
    assert all(np.array_equal(before[k], v) for k, v in op.state_tensors().items())
    empty = HfQuantizedSdpa()
    tok = empty.checkpoint()
    empty(*_qkv(rng, 1, 2, 2, 64, 8))
    empty.rollback(tok)
    assert empty.len == 0 and empty.nbytes()["codes"] == 0


@pytest.mark.parametrize("backend,bits,axes,g", [("quanto", 4, (0, 0), 16), ("quanto", 2, (-1, 0), 2),
                                                 ("hqq", 3, (0, 0), 16), ("hqq", 1, (1, 1), 4), ("hqq", 8, (0, 1), 16)])
def test_save_restore_continues_bit_identically(backend, bits, axes, g):
    rng = np.random.default_rng(3)
    op = HfQuantizedSdpa(bits=bits, group_size=g, residual=6, axis_key=axes[0], axis_value=axes[1], backend=backend)
    op(*_qkv(rng, 1, 4, 2, 16, 16))
    for _ in range(8):
        op(*_qkv(rng, 1, 4, 2, 1, 16))
    twin = _twin(op)
    assert _states_equal(op, twin)
    for s in [1, 1, 3, 1, 1, 1, 1, 1]:
        x = _qkv(rng, 1, 4, 2, s, 16)
        np.testing.assert_array_equal(op(*x), twin(*x))
    assert _states_equal(op, twin)


def test_bytes_held_are_counted_from_the_arrays():
    rng = np.random.default_rng(4)
    op = HfQuantizedSdpa(bits=4, group_size=64, residual=128)  # HF's defaults
    assert op.nbytes()["codes"] == 0
    op(*_qkv(rng, 1, 8, 2, 100, 64))
    for _ in range(30):
        op(*_qkv(rng, 1, 8, 2, 1, 64))
    nb = op.nbytes()
    n = 2 * 130 * 64  # values per K (or V) after 130 tokens; the store holds the 100 prefill tokens
    assert nb["codes"] == op.qk.codes.nbytes + op.qv.codes.nbytes == 2 * (2 * 100 * 64) // 2
    assert nb["params"] == 2 * 2 * (2 * 100 * 64 // 64) * 4  # f32 scale + shift per group, K and V
    assert nb["full_precision"] == op.res_k.data.nbytes + op.res_v.data.nbytes == 2 * 2 * 127 * 64 * 4
    assert nb["f32_equivalent"] == 2 * n * 4 and nb["f16_equivalent"] == 2 * n * 2
    assert op.census() == {"tokens": 130, "quantized": 100, "full_precision": 30, "f32_bytes": 2 * n * 4}
    h = HfQuantizedSdpa(bits=3, group_size=64, backend="hqq")
    h(*_qkv(rng, 1, 8, 2, 40, 64))
    assert h.nbytes()["codes"] == 2 * 7 * (2 * 40 * 64 // 64) * 4  # 64 rows -> 7 int32 words a column
    assert h.fp_window == 128 and HfQuantizedSdpa(residual=0).fp_window == 1 and h.QUANTIZED


@pytest.mark.parametrize("kwargs,match", [
    (dict(backend="fp8"), "backend"), (dict(bits=3), "bits"), (dict(bits=8), "bits"),
    (dict(backend="hqq", bits=5), "bits"), (dict(axis_key=1), "axis_key"), (dict(axis_value=2), "axis_value"),
    (dict(backend="hqq", axis_key=-1), "axis_key"), (dict(group_size=0), "group_size"),
    (dict(residual=-1), "residual"), (dict(backend="hqq", bits=3, axis_value=1), "3-bit"), (dict(axis=1), "axis 2")])
def test_bad_attributes_are_refused(kwargs, match):
    with pytest.raises(GraphError, match=match):
        HfQuantizedSdpa(**kwargs)


def test_bad_states_are_refused_naming_the_tensor():
    rng = np.random.default_rng(5)
    op = HfQuantizedSdpa(bits=4, group_size=16, residual=4)
    op(*_qkv(rng, 1, 2, 2, 8, 16))
    op(*_qkv(rng, 1, 2, 2, 1, 16))
    good = op.state_tensors()

    def load(**changes):
        t = dict(good)
        for k, v in changes.items():
            if v is None:
                t.pop(k)
            else:
                t[k] = v
        HfQuantizedSdpa(bits=4, group_size=16, residual=4).load_state_tensors(t)

    load()
    with pytest.raises(StateError, match="config"):
        HfQuantizedSdpa(bits=2, group_size=16, residual=4).load_state_tensors(good)
    with pytest.raises(StateError, match="'k_codes'"):
        load(k_codes=None)
    with pytest.raises(StateError, match="'k_codes'"):
        load(k_codes=good["k_codes"][:-1])
    with pytest.raises(StateError, match="'v_scale'"):
        load(v_scale=good["v_scale"].astype(np.float64))
    with pytest.raises(StateError, match="'k_scale'"):
        load(k_scale=-good["k_scale"])
    with pytest.raises(StateError, match="'res_v'"):
        load(res_v=good["res_v"][:, :, :0])
    with pytest.raises(StateError, match="'res_k'"):
        load(res_k=np.zeros((1, 2, 5, 16), np.float32), res_v=np.zeros((1, 2, 5, 16), np.float32),
             shape=np.array([1, 2, 16, 13, 0], np.int64))
    with pytest.raises(StateError, match="shape"):
        load(shape=np.array([1, 2, -16, 9, 0], np.int64))
    odd = HfQuantizedSdpa(bits=2, group_size=16, residual=4, backend="hqq", axis_key=1, axis_value=1)
    odd(*_qkv(rng, 1, 2, 2, 8, 16))
    t = odd.state_tensors()
    t["k_codes"] = t["k_codes"].copy()
    t["k_codes"][0, 0] = 255
    HfQuantizedSdpa(bits=2, group_size=16, residual=4, backend="hqq", axis_key=1, axis_value=1).load_state_tensors(t)
    t = HfQuantizedSdpa(bits=2, group_size=16, residual=4, axis_key=0).state_tensors()  # empty state
    HfQuantizedSdpa(bits=2, group_size=16, residual=4).load_state_tensors(t)


# ---------------------------------------------------------------------------------------- NaN/Inf
def test_non_finite_values_poison_their_whole_group_as_the_backends_do():
    """A NaN key or an Inf value: at the next flush its whole group dequantizes to NaN (NaN min/max,
    ``inf * 0``), the heads it is not in stay finite; masked positions of a prefill are not read."""
    rng = np.random.default_rng(6)
    for backend, ax in (("quanto", 0), ("hqq", 1)):
        op = HfQuantizedSdpa(bits=4, group_size=16, residual=2, backend=backend, axis_key=ax, axis_value=ax)
        q, k, v = _qkv(rng, 1, 4, 2, 8, 16)
        v[0, 1, 7, 3] = np.nan  # the prefill's last token: masked for rows 0..6
        out = op(q, k, v)
        bad = np.zeros(out.shape, bool)
        bad[0, 2:, 7, 3] = True  # only the last row of the heads reading kv head 1 sees it, in channel 3
        np.testing.assert_array_equal(np.isnan(out), bad)
        kd, vd = op.dequantized()
        assert np.isnan(vd[0, 1, 7]).all() and np.isfinite(np.delete(vd[0, 1], 7, axis=0)).all()  # one group
        op = HfQuantizedSdpa(bits=4, group_size=16, residual=2, backend=backend, axis_key=ax, axis_value=ax)
        op(*_qkv(rng, 1, 4, 2, 8, 16))
        q, k, v = _qkv(rng, 1, 4, 2, 1, 16)
        k[0, 0, 0, 5] = np.inf
        op(q, k, v)
        q, k, v = _qkv(rng, 1, 4, 2, 1, 16)
        op(q, k, v)  # the flush: the Inf key's group (token 8 of head 0) is NaN now
        kd, _ = op.dequantized()
        assert np.isnan(kd[0, 0, 8]).all() and np.isfinite(kd[0, 1]).all()
        assert np.isfinite(np.delete(kd[0, 0], 8, 0)).all()
        out = op(*_qkv(rng, 1, 4, 2, 1, 16))  # reads it: every score of kv head 0's token 8 is NaN
        assert np.isnan(out[0, :2]).all() and np.isfinite(out[0, 2:]).all()


# ------------------------------------------------------------------------------------------ graph
GRAPH = """version 1.0;
extension nnef_kv;
graph g(q, k, v) -> (o) {
  q = external<scalar>(shape = [1, 4, 1, 16]);
  k = external<scalar>(shape = [1, 2, 1, 16]);
  v = external<scalar>(shape = [1, 2, 1, 16]);
  o = nnef_kv_hf_quantized_sdpa(q, k, v, scale = 0.25, bits = 2, group_size = 16, residual = 5);
}
"""


def test_op_in_a_graph_run_by_the_interpreter():
    from nnef_kv.io.archive import Model

    sess = Model.from_text(GRAPH, {}).session()
    plain = HfQuantizedSdpa(scale=0.25, bits=2, group_size=16, residual=5)
    rng = np.random.default_rng(7)
    for _ in range(14):
        q, k, v = _qkv(rng, 1, 4, 2, 1, 16)
        np.testing.assert_array_equal(sess.run({"q": q, "k": k, "v": v})["o"], plain(q, k, v))
    nb, ref = sess.kv_cache_bytes(), plain.nbytes()
    assert all(nb[key] == ref[key] for key in ("codes", "params", "full_precision"))
    (state,) = sess.states
    assert _states_equal(state, plain)
    assert nnef_kv.parse(GRAPH).graph is not None
