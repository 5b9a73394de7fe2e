"""The KIVI op: storage layout, attention on packed codes, masking, NaN/Inf, dtype, state, memory."""
from __future__ import annotations

import numpy as np
import pytest

from nnef_kv.errors import GraphError, InputError, StateError
from nnef_kv.kv import KiviSdpa, softmax_attention


def _qkv(rng, b, hq, hkv, s, d, dtype=np.float32):
    q = rng.standard_normal((b, hq, s, d)).astype(dtype)
    k = (rng.standard_normal((b, hkv, s, d)) * rng.uniform(0.2, 4, size=(1, 1, 1, d))).astype(dtype)
    v = rng.standard_normal((b, hkv, s, d)).astype(dtype)
    return q, k, v


def _causal(t: int, s: int) -> np.ndarray:
    return np.arange(t)[None, :] <= (t - s + np.arange(s))[:, None]


def _read_by_call(op, q, k, v, scale):
    """Call ``op`` and return (its output, exact attention over what the call must read: the cache
    before the call, dequantized, then the call's own tokens in full precision)."""
    kd, vd = op.dequantized() if op.len else (k[:, :, :0], v[:, :, :0])
    out = op(q, k, v)
    kd, vd = np.concatenate([kd, k], axis=2), np.concatenate([vd, v], axis=2)
    return out, softmax_attention(q, kd, vd, scale, _causal(op.len, q.shape[2]))


def _run(op, steps, rng, b=1, hq=4, hkv=2, d=16, dtype=np.float32):
    ks, vs, outs, qs = [], [], [], []
    for s in steps:
        q, k, v = _qkv(rng, b, hq, hkv, s, d, dtype)
        outs.append(op(q, k, v))
        qs.append(q)
        ks.append(k)
        vs.append(v)
    return qs, ks, vs, outs


@pytest.mark.parametrize("path", ["two_pass", "online"])
@pytest.mark.parametrize("value_group", [8, 16])
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
def test_fused_attention_equals_dequantize_then_attend(bits, value_group, path):
    """Attention on the packed codes (folded step/min, blocks of codes; two-pass softmax or online
    softmax) is the same function as exact attention over the cache as the call reads it: the cache
    before the call, dequantized, followed by the call's own tokens in full precision."""
    rng = np.random.default_rng(bits)
    op = KiviSdpa(scale=0.25, bits=bits, key_group=8, value_group=value_group, residual=8, sinks=2,
                  block_tokens=16, score_budget=1 << 22 if path == "two_pass" else 0)
    for s in [13, 1, 1, 9] + [1] * 30:
        out, ref = _read_by_call(op, *_qkv(rng, 1, 4, 2, s, 16), 0.25)
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=2e-6)
    assert op.n_quant > 0 and op.n_sink == 2


def test_residual_window_and_groups():
    rng = np.random.default_rng(0)
    op = KiviSdpa(bits=4, key_group=32, residual=32, sinks=3)
    for s in [70] + [1] * 200:
        op(*_qkv(rng, 1, 2, 2, s, 8))
        rest = op.len - op.n_sink
        assert op.n_sink == min(3, op.len)
        assert op.n_quant % 32 == 0
        if rest >= 32:
            assert 32 <= op.n_res <= 32 + 32 - 1
        else:
            assert op.n_res == rest
        assert op.n_sink + op.n_quant + op.n_res == op.len
    assert op.k_min.len == op.n_quant // 32 and op.v_min.len == op.n_quant


def test_quantization_error_within_half_step_and_f16_params_cover_range():
    rng = np.random.default_rng(1)
    for params in ("f16", "f32"):
        op = KiviSdpa(bits=4, key_group=16, value_group=8, residual=0, params=params)
        _, ks, vs, _ = _run(op, [64], rng)
        kd, vd = op.dequantized()
        k, v = ks[0], vs[0]
        kstep = np.repeat(op.k_step.view().astype(np.float32), 16, axis=1).reshape(k.shape)
        vstep = np.repeat(op.v_step.view().astype(np.float32), 8, axis=2).reshape(v.shape)
        assert np.all(np.abs(kd - k) <= kstep * 0.5 * (1 + 1e-3) + 1e-6)
        assert np.all(np.abs(vd - v) <= vstep * 0.5 * (1 + 1e-3) + 1e-6)
        assert op.k_min.view().dtype == (np.float16 if params == "f16" else np.float32)


def test_causal_prefill_is_bottom_right_aligned_and_gqa_mapping():
    rng = np.random.default_rng(2)
    op = KiviSdpa(scale=0.3, bits=8, residual=64, is_causal=True)  # everything stays exact
    q, k, v = _qkv(rng, 1, 6, 2, 5, 8)
    out = op(q, k, v)
    np.testing.assert_allclose(out, softmax_attention(q, k, v, 0.3, _causal(5, 5)), atol=1e-6)
    # first query row sees only token 0: its output is v[token 0] of its kv head (h // 3)
    np.testing.assert_allclose(out[0, :, 0], np.repeat(v[0, :, 0], 3, axis=0), atol=1e-6)
    # fewer queries than new tokens: queries are the last positions
    q2, k2, v2 = _qkv(rng, 1, 6, 2, 4, 8)
    out2 = op(q2[:, :, :2], k2, v2)
    kf, vf = np.concatenate([k, k2], 2), np.concatenate([v, v2], 2)
    np.testing.assert_allclose(out2, softmax_attention(q2[:, :, :2], kf, vf, 0.3, _causal(9, 2)), atol=1e-6)
    nc = KiviSdpa(scale=0.3, bits=8, residual=64, is_causal=False)
    np.testing.assert_allclose(nc(q, k, v), softmax_attention(q, k, v, 0.3), atol=1e-6)


def test_f16_in_f16_out():
    rng = np.random.default_rng(3)
    op = KiviSdpa(scale=0.25, bits=4, key_group=8, value_group=8, residual=8)
    op32 = KiviSdpa(scale=0.25, bits=4, key_group=8, value_group=8, residual=8)
    for s in [10] + [1] * 20:
        q, k, v = _qkv(rng, 1, 2, 1, s, 16, np.float16)
        out = op(q, k, v)
        assert out.dtype == np.float16 and out.shape == q.shape
        ref = op32(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32))
        np.testing.assert_allclose(out.astype(np.float32), ref, atol=2e-3, rtol=2e-3)
    assert op.res_k.dtype == np.float16  # full-precision window kept in the input precision


@pytest.mark.parametrize("budget", [1 << 22, 0])
def test_non_finite_values_do_not_poison_groups(budget):
    rng = np.random.default_rng(4)
    d = 8
    clean = KiviSdpa(scale=0.3, bits=4, key_group=8, value_group=8, residual=0)
    dirty = KiviSdpa(scale=0.3, bits=4, key_group=8, value_group=8, residual=0, score_budget=budget)
    q, k, v = _qkv(rng, 1, 2, 1, 8, d)
    k2, v2 = k.copy(), v.copy()
    k2[0, 0, 3, 5] = np.nan
    v2[0, 0, 6, 2] = np.inf
    v2[0, 0, 1, 1] = 1e6  # finite but beyond what f16 params hold: kept exactly too
    clean(q, k, v)
    first = dirty(q, k2, v2)  # the prompt itself is attended in full precision
    with np.errstate(invalid="ignore"):
        exact = softmax_attention(q, k2, v2, 0.3, _causal(8, 8))
    np.testing.assert_array_equal(np.isnan(first), np.isnan(exact))
    # the same queries reading the cache as it is now stored (every token quantized, outliers exact)
    out = dirty._attend(q.reshape(1, 2 * 8, d), 8).reshape(q.shape)
    assert dirty.nbytes()["outliers"] > 0 and len(dirty.k_out) == 1 and len(dirty.v_out) == 2
    kd_c, vd_c = clean.dequantized()
    kd_d, vd_d = dirty.dequantized()
    # the other values of the groups keep exactly their clean reconstruction ranges
    assert np.isnan(kd_d[0, 0, 3, 5])
    assert np.array_equal(dirty.k_min.view()[0, 0, np.arange(d) != 5], clean.k_min.view()[0, 0, np.arange(d) != 5])
    assert vd_d[0, 0, 6, 2] == np.inf and vd_d[0, 0, 1, 1] == np.float32(1e6)
    # attention follows exact f32 semantics: rows that see token 3's NaN key are NaN
    with np.errstate(invalid="ignore"):
        ref = softmax_attention(q, kd_d, vd_d, 0.3, _causal(8, 8))
        np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    finite = ~np.isnan(ref) & np.isfinite(ref)
    np.testing.assert_allclose(out[finite], ref[finite], rtol=1e-5, atol=1e-5)
    # queries before the NaN key are unharmed, except channel 2 where the Inf value times a zero
    # (masked) probability gives NaN, exactly as in f32 attention over the same cache
    assert np.all(np.isfinite(np.delete(out[0, :, :3], 2, axis=-1)))
    assert np.all(np.isnan(out[0, :, :, 2]))


@pytest.mark.parametrize("rotate", ["none", "k", "v", "kv"])
def test_state_round_trip_continues_bit_identically(rotate):
    rng = np.random.default_rng(5)
    kw = dict(scale=0.2, bits=3, key_group=8, value_group=8, residual=8, sinks=2, rotate=rotate)
    a = KiviSdpa(**kw)
    for s in [11, 1, 1, 7, 1]:
        a(*_qkv(rng, 2, 4, 2, s, 16))
    k = _qkv(rng, 2, 4, 2, 1, 16)
    k[1][0, 0, 0, 0] = np.nan  # side table saved too
    a(*k)
    st = a.state_tensors()
    assert all(isinstance(x, np.ndarray) for x in st.values())
    b = KiviSdpa(**kw)
    b.load_state_tensors({name: x.copy() for name, x in st.items()})
    for s in [1] * 20 + [5]:
        x = _qkv(rng, 2, 4, 2, s, 16)
        np.testing.assert_array_equal(a(*x), b(*x))
    assert b.nbytes()["codes"] <= a.nbytes()["codes"]  # a restored cache holds exact sizes


def test_load_state_validation():
    rng = np.random.default_rng(6)
    a = KiviSdpa(bits=4, key_group=8, value_group=8, residual=8)
    for s in [40, 1]:
        a(*_qkv(rng, 1, 2, 2, s, 16))
    st = a.state_tensors()
    with pytest.raises(StateError, match="config"):
        KiviSdpa(bits=2, key_group=8, value_group=8, residual=8).load_state_tensors(st)
    fresh = lambda: KiviSdpa(bits=4, key_group=8, value_group=8, residual=8)  # noqa: E731
    with pytest.raises(StateError, match="k_codes"):
        fresh().load_state_tensors(dict(st, k_codes=st["k_codes"][:, :8]))
    with pytest.raises(StateError, match="dtype"):
        fresh().load_state_tensors(dict(st, k_min=st["k_min"].astype(np.float32)))
    with pytest.raises(StateError, match="missing"):
        fresh().load_state_tensors({k: v for k, v in st.items() if k != "v_step"})
    with pytest.raises(StateError, match="res_k"):
        fresh().load_state_tensors(dict(st, res_k=st["res_k"][:, :-1]))
    empty = fresh()
    empty.load_state_tensors(fresh().state_tensors())
    assert empty.len == 0


def test_nbytes_counts_every_held_array():
    rng = np.random.default_rng(7)
    op = KiviSdpa(bits=4, key_group=32, value_group=16, residual=32, sinks=1)
    for s in [100] + [1] * 50:
        op(*_qkv(rng, 1, 2, 2, s, 32))
    nb = op.nbytes()
    held = sum(buf.data.nbytes for buf in (op.sink_k, op.sink_v, op.res_k, op.res_v, op.k_codes, op.v_codes,
                                           op.k_min, op.k_step, op.v_min, op.v_step))
    held += op.k_out.nbytes + op.v_out.nbytes
    assert nb["codes"] + nb["params"] + nb["full_precision"] == held
    assert nb["f32_equivalent"] == 2 * 2 * 150 * 32 * 4 and nb["f16_equivalent"] == nb["f32_equivalent"] // 2
    assert op.k_codes.data.shape[-1] == 16  # 32 codes of 4 bits in 16 bytes
    assert op.res_k.data.shape[1] == op.n_res  # the window is held at its exact size


def test_more_bits_less_error():
    rng = np.random.default_rng(8)
    q, k, v = _qkv(rng, 1, 4, 2, 200, 32)
    ref = softmax_attention(q[:, :, -1:], k, v, 0.2)
    errs = []
    for bits in (2, 3, 4, 8):
        op = KiviSdpa(scale=0.2, bits=bits, residual=0)
        op(q[:, :, :199], k[:, :, :199], v[:, :, :199])
        out = op(q[:, :, -1:], k[:, :, -1:], v[:, :, -1:])
        errs.append(float(np.linalg.norm(out - ref) / np.linalg.norm(ref)))
    assert errs == sorted(errs, reverse=True) and errs[-1] < 0.01, errs


def test_threads_give_identical_results():
    rng = np.random.default_rng(9)
    a = KiviSdpa(bits=4, residual=0, threads=1)
    b = KiviSdpa(bits=4, residual=0, threads=2)
    q, k, v = _qkv(rng, 1, 8, 8, 2048, 64)
    a(q[:, :, :1], k, v)
    b(q[:, :, :1], k, v)
    x = _qkv(rng, 1, 8, 8, 1, 64)
    np.testing.assert_array_equal(a(*x), b(*x))


def test_bad_attributes_and_inputs():
    with pytest.raises(GraphError, match="bits"):
        KiviSdpa(bits=9)
    with pytest.raises(GraphError, match="rotate"):
        KiviSdpa(rotate="q")
    with pytest.raises(GraphError, match="axis"):
        KiviSdpa(axis=1)
    op = KiviSdpa(value_group=12)
    rng = np.random.default_rng(0)
    with pytest.raises(InputError, match="value_group"):
        op(*_qkv(rng, 1, 2, 2, 1, 16))
    op = KiviSdpa()
    with pytest.raises(InputError, match="multiple"):
        op(*_qkv(rng, 1, 3, 2, 1, 16))


def test_registered_with_the_interpreter():
    from nnef_kv.core.registry import PRIMITIVES, StatefulKernel
    from nnef_kv.interpreter.catalog import lookup

    lookup("add")  # loads every op family

    prims = {name: PRIMITIVES[name] for name in
             ("nnef_kv_kivi_sdpa", "tract_transformers_quantized_kv_sdpa", "tract_transformers_quantized_dyn_kv_cache")}
    assert prims["nnef_kv_kivi_sdpa"].registry == "nnef_kv"
    assert prims["tract_transformers_quantized_kv_sdpa"].registry == "tract_transformers"
    for prim in prims.values():
        assert prim.stateful
    state = prims["nnef_kv_kivi_sdpa"].state_factory(axis=2, scale=0.125, bits=4, key_group=32, value_group=32,
                                                     residual=32, sinks=0, is_causal=True, rotate="none",
                                                     clip=False, params="f16")
    assert isinstance(state, StatefulKernel)
    sig = prims["nnef_kv_kivi_sdpa"].signature
    for attr in ("axis: integer = 2", "scale: scalar = 0.125", "bits: integer = 4", "key_group: integer = 32",
                 "value_group: integer = 32", "residual: integer = 32", "sinks: integer = 0",
                 "is_causal: logical = true"):
        assert attr in sig


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=40, deadline=None)
@given(chunks=st.lists(st.integers(1, 40), min_size=1, max_size=8), bits=st.integers(1, 8),
       sinks=st.integers(0, 3), residual=st.integers(0, 12), key_group=st.sampled_from([1, 4, 8]))
def test_storage_does_not_depend_on_chunking(chunks, bits, sinks, residual, key_group):
    """What is stored after T tokens (codes, params, window, sinks) is the same whether the tokens
    came one by one or in chunks; the window bounds hold."""
    t = sum(chunks)
    rng = np.random.default_rng(t)
    k = rng.standard_normal((1, 2, t, 8)).astype(np.float32)
    v = rng.standard_normal((1, 2, t, 8)).astype(np.float32)
    q = np.zeros((1, 2, 1, 8), np.float32)
    kw = dict(bits=bits, sinks=sinks, residual=residual, key_group=key_group, value_group=4)
    a, b = KiviSdpa(**kw), KiviSdpa(**kw)
    for i in range(t):
        a(q, k[:, :, i:i + 1], v[:, :, i:i + 1])
    pos = 0
    for c in chunks:
        b(q, k[:, :, pos:pos + c], v[:, :, pos:pos + c])
        pos += c
    sa, sb = a.state_tensors(), b.state_tensors()
    assert sa.keys() == sb.keys()
    for name in sa:
        np.testing.assert_array_equal(sa[name], sb[name], err_msg=name)
    if t - b.n_sink >= residual:
        assert residual <= b.n_res <= residual + key_group - 1


@pytest.mark.parametrize("path", ["two_pass", "online"])
@pytest.mark.parametrize("bits,key_group,d,value_group,params", [
    (4, 8, 16, 16, "f16"),   # token-planar groups, one value group
    (2, 8, 16, 4, "f32"),    # token-planar, 4 value groups, f32 params (no in-place folding)
    (1, 8, 16, 8, "f16"),    # 8 bit fields
    (1, 4, 16, 16, "f16"),   # group not a multiple of 8 codes a byte: row layout
    (4, 8, 6, 6, "f16"),     # small even head_dim: token-planar
    (4, 8, 5, 5, "f16"),     # odd head_dim: row layout with a padding nibble
    (8, 8, 16, 16, "f32"),
    (3, 8, 16, 16, "f16"),   # split fields 2 + 1
    (5, 8, 8, 4, "f16"),     # split 4 + 1
    (6, 4, 16, 16, "f16"),   # split 4 + 2
    (7, 8, 8, 8, "f32"),     # split 4 + 2 + 1
    (3, 4, 16, 16, "f16"),   # group not a multiple of 8: bitstream rows
    (3, 8, 6, 6, "f16"),     # 6 * 3 bits not whole bytes: bitstream rows
])
def test_attention_on_every_code_layout_equals_exact_attention(path, bits, key_group, d, value_group, params):
    """Every code layout (bytes, token-planar groups, split fields, rows), with the last block of codes partial, GQA
    (several query rows per kv head), prefill chunks and decode steps."""
    rng = np.random.default_rng(bits * 100 + d)
    op = KiviSdpa(scale=0.3, bits=bits, key_group=key_group, value_group=value_group, residual=4, sinks=1,
                  params=params, block_tokens=3 * key_group, score_budget=1 << 22 if path == "two_pass" else 0)
    for s in [29, 1, 1, 6] + [1] * 12:
        out, ref = _read_by_call(op, *_qkv(rng, 1, 6, 2, s, d), 0.3)
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=2e-6)
    assert op.n_quant // key_group >= 4 and (op.n_quant // key_group) % 3  # a partial last block
    splits = {3: (2, 1), 5: (4, 1), 6: (4, 2), 7: (4, 2, 1)}
    if bits == 8:
        layout = "bytes"
    elif bits in (1, 2, 4):
        layout = "token_planar" if d % (8 // bits) == 0 and key_group % (8 // bits) == 0 else "rows"
    else:
        ok = (d * bits) % 8 == 0 and all(key_group % (8 // w) == 0 for w in splits[bits])
        layout = "split" if ok else "rows"
    assert op.codec.layout == layout


def test_state_of_token_planar_codes_round_trips_and_old_layout_is_refused():
    rng = np.random.default_rng(11)
    kw = dict(scale=0.2, bits=4, key_group=8, value_group=8, residual=8)
    a = KiviSdpa(**kw)
    for s in [40, 1, 1]:
        a(*_qkv(rng, 1, 4, 2, s, 16))
    assert a.codec.token_planar
    st = a.state_tensors()
    b = KiviSdpa(**kw)
    b.load_state_tensors({k: x.copy() for k, x in st.items()})
    for _ in range(12):
        x = _qkv(rng, 1, 4, 2, 1, 16)
        np.testing.assert_array_equal(a(*x), b(*x))
    # a state written with the previous (row-planar, 8-entry config) layout is refused, not misread
    with pytest.raises(StateError, match="config"):
        KiviSdpa(**kw).load_state_tensors(dict(st, config=st["config"][:8]))
    for name in ("k_min", "v_step"):
        bad = st[name].copy()
        bad.flat[0] = np.inf
        with pytest.raises(StateError, match=name):
            KiviSdpa(**kw).load_state_tensors(dict(st, **{name: bad}))


def _old_semantics_call(op, q, k, v):
    """What the op computed before KIVI-style prefill: ingest first, then attend over the stored cache
    (the call's own tokens read quantized once their group is full)."""
    qn, ks, vs, shape, out_dtype, rv = op._prepare(q, k, v)
    op._ingest(ks, vs)
    op.len += ks.shape[1]
    return op._finish(op._attend(qn, shape[2]), shape, out_dtype, rv)


def test_prefill_is_exact_and_decode_no_worse_on_minilm():
    """A one-call prefill of 512 real tokens is exact attention; the decode steps after it deviate from
    exact attention no more than they did when a prefill read its own groups quantized."""
    from conftest import FIXTURES

    path = FIXTURES / "activations" / "minilm_qkv_apache2_128tok.npz"
    if not path.exists():
        pytest.skip(f"{path} not found")
    z = np.load(path)
    scale = float(z["scale"])
    q, k, v = (np.concatenate([z[f"layer{i}_{x}"] for i in range(6)], axis=1)[None] for x in "qkv")  # 768 tokens
    n0 = 512
    mask = _causal(n0, n0)
    for bits in (8, 4, 2):
        new = KiviSdpa(scale=scale, bits=bits, key_group=32, value_group=32, residual=32)
        old = KiviSdpa(scale=scale, bits=bits, key_group=32, value_group=32, residual=32)
        exact = softmax_attention(q[:, :, :n0], k[:, :, :n0], v[:, :, :n0], scale, mask)
        got = new(q[:, :, :n0], k[:, :, :n0], v[:, :, :n0])
        assert np.linalg.norm(got - exact) <= 1e-5 * np.linalg.norm(exact)
        prefill_old = _old_semantics_call(old, q[:, :, :n0], k[:, :, :n0], v[:, :, :n0])
        assert np.linalg.norm(prefill_old - exact) > 1e-3 * np.linalg.norm(exact)  # it was not exact
        dev = {"new": [0.0, 0.0], "old": [0.0, 0.0]}
        for t in range(n0, q.shape[2]):
            sl = slice(t, t + 1)
            ref = softmax_attention(q[:, :, sl], k[:, :, :t + 1], v[:, :, :t + 1], scale)
            for name, out in (("new", new(q[:, :, sl], k[:, :, sl], v[:, :, sl])),
                              ("old", _old_semantics_call(old, q[:, :, sl], k[:, :, sl], v[:, :, sl]))):
                dev[name][0] += float(np.sum((out.astype(np.float64) - ref) ** 2))
                dev[name][1] += float(np.sum(ref.astype(np.float64) ** 2))
        d_new, d_old = (np.sqrt(a / b) for a, b in dev.values())
        assert d_new <= d_old, (bits, d_new, d_old)


@pytest.mark.parametrize("path", ["two_pass", "online", "stepwise"])
def test_softcap_is_exact_softcapped_attention(path):
    """softcap c: scores c * tanh(scale q.k / c) before the mask and the softmax (Gemma 2)."""
    rng = np.random.default_rng(17)
    op = KiviSdpa(scale=0.7, bits=8, key_group=4, value_group=8, residual=4, softcap=1.5,
                  score_budget=0 if path == "online" else 1 << 22)
    ref = KiviSdpa(scale=0.7, bits=8, key_group=4, value_group=8, residual=4)
    for s in [9, 1, 5, 1, 1, 7]:
        q, k, v = _qkv(rng, 1, 4, 2, s, 8)
        kd, vd = op.dequantized() if op.len else (k[:, :, :0], v[:, :, :0])
        out = op.stepwise(q, k, v) if path == "stepwise" else op(q, k, v)
        ref(q, k, v)
        if path == "stepwise":
            continue  # its rows are checked against one-token calls in test_stepwise; here the math
        kf, vf = np.concatenate([kd, k], axis=2), np.concatenate([vd, v], axis=2)
        g = 2
        sc = np.einsum("bhqd,bhkd->bhqk", q, np.repeat(kf, g, axis=1)) * 0.7
        sc = 1.5 * np.tanh(sc / 1.5)
        t = kf.shape[2]
        sc = np.where(_causal(t, s)[None, None], sc, -np.inf)
        p = np.exp(sc - sc.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        want = np.einsum("bhqk,bhkd->bhqd", p, np.repeat(vf, g, axis=1))
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=2e-6)
    assert op.n_quant > 0
    with pytest.raises(GraphError, match="softcap must be a finite number >= 0"):
        KiviSdpa(softcap=-1.0)
