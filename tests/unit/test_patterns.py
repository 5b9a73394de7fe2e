"""Plan-time chain fusion, shape memos and the explicit-cache append (interpreter/plan/patterns.py,
attention.py, chains.py, cache_append.py) compute what the unfused plan computes, bit for bit.

Every comparison is the optimised plan against one built with ``fuse_ops=False, specialize_kernels=False``
(no chains, no memos, no cache append, no fuse.py pairs, no specialisation), decoding a prompt and one-token
steps with the explicit caches fed back, outputs compared with ``assert_array_equal`` (NaN equal to NaN):
on every torch-to-nnef export of the shared fixtures, on the built-in decoder in its forms, and on the
built-in decoder with NaN / Inf / huge values placed in its caches and embeddings (hypothesis).

The RMS norm and RoPE kernels (nnef_kv/kernels/rowwise.py) run in these comparisons as they run by default:
they give NumPy's bits. The decode-step attention kernel (nnef_kv/kernels/attend.py) sums in another order and
the SwiGLU gate kernel (nnef_kv/kernels/gate.py) has its own exp: these comparisons turn them off
(``attention.DECODE_KERNEL``, ``patterns.GATE_KERNEL``); :func:`test_the_attention_kernel_in_real_decodes` and
:func:`test_the_gate_kernel_in_real_decodes` check each of their calls in the same decodes against the exact
values, within their error bounds."""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nnef_kv
from conftest import FIXTURES
from nnef_kv.interpreter.plan import attention as plan_attention
from nnef_kv.interpreter.plan import patterns as plan_patterns
from nnef_kv.interpreter.plan import build_plan, get_plan
from nnef_kv.interpreter.plan.cache_append import grow_concat
from nnef_kv.interpreter.plan.chains import chain_members
from nnef_kv.interpreter.session import Session
from nnef_kv.kernels import attend, gate, numba_available
from nnef_kv.models import DecoderConfig, build_decoder, build_decoder_weights
from nnef_kv.validate.decode import detect_signature

EXPORTS = sorted(p for p in (FIXTURES / "exports").glob("*/model.nnef.tgz") if p.parent.name != "llama_sdpa") \
    if (FIXTURES / "exports").is_dir() else []
EXPORTS += [p for p in (FIXTURES / "llama_gqa" / "model.nnef.tgz", FIXTURES / "gpt2" / "model.nnef.tgz") if p.is_file()]


@pytest.fixture(autouse=True)
def _numpy_attention():
    """The fused attention and SwiGLU gate make the unfused chain's NumPy calls (bit for bit), not the
    kernels'."""
    plan_attention.DECODE_KERNEL[0] = False
    plan_patterns.GATE_KERNEL[0] = False
    yield
    plan_attention.DECODE_KERNEL[0] = True
    plan_patterns.GATE_KERNEL[0] = True


def _pair(model_fast, model_plain):
    """The optimised and the plain session of one model (two model objects: each caches its plan)."""
    fast = get_plan(model_fast)
    plain = build_plan(fast.graph, fuse_ops=False, specialize_kernels=False)
    object.__setattr__(model_plain, "_nnef_kv_plan", (model_plain.document, plain))
    return Session(model_fast), Session(model_plain)


def _steps(plan) -> list:
    """The plan's (step, node) pairs, a run's (:mod:`nnef_kv.interpreter.plan.dense`) or a segment's
    (:mod:`~nnef_kv.interpreter.plan.segments`) replaced by its members'."""
    return [pair for st, node in zip(plan.steps, plan.step_nodes)
            for pair in (st.members if hasattr(st, "members") else [(st, node)])]


def _step_nodes(plan) -> list:
    return [n for _, n in _steps(plan)]


def _step_ops(plan) -> list[str]:
    return [n.op for n in _step_nodes(plan)]


def _decode_both(a: Session, b: Session, prompt: np.ndarray, steps: int, caches: dict | None = None,
                 mutate=None) -> int:
    """Prompt then ``steps`` one-token calls on both sessions; every output equal. Returns the calls made."""
    sig = detect_signature(a.plan)
    ca = dict(caches) if caches is not None else sig.empty_caches()
    cb = {k: v.copy() for k, v in ca.items()}
    ids = prompt[None]
    calls = 0
    with np.errstate(all="ignore"):
        for step in range(steps + 1):
            ra = a.run({sig.ids_input: ids, **ca}) if sig.explicit else a.run({sig.ids_input: ids})
            rb = b.run({sig.ids_input: ids, **cb}) if sig.explicit else b.run({sig.ids_input: ids})
            for name in ra:
                np.testing.assert_array_equal(ra[name], rb[name], err_msg=f"call {step}: output {name}")
            calls += 1
            if sig.explicit:
                ca = {i: ra[o] for i, o in sig.cache_outputs.items()}
                cb = {i: rb[o] for i, o in sig.cache_outputs.items()}
            logits = np.asarray(ra[sig.logits_output])
            tok = int(np.nanargmax(logits.reshape(-1, logits.shape[-1])[-1])) if np.isfinite(logits).any() else 0
            ids = np.array([[tok]], np.int64)
    return calls


@pytest.mark.skipif(not EXPORTS, reason="no torch-to-nnef exports in the shared fixtures")
@pytest.mark.parametrize("path", EXPORTS, ids=lambda p: p.parent.name)
def test_every_export_decodes_bit_identically_fused_and_unfused(path: Path) -> None:
    a, b = _pair(nnef_kv.load(path), nnef_kv.load(path))
    rng = np.random.default_rng(0)
    vocab = int(np.asarray(a.run({**detect_signature(a.plan).empty_caches(),
                                  detect_signature(a.plan).ids_input: np.zeros((1, 1), np.int64)}
                                 if detect_signature(a.plan).explicit else
                                 {detect_signature(a.plan).ids_input: np.zeros((1, 1), np.int64)})
                           [detect_signature(a.plan).logits_output]).shape[-1])
    a.reset()
    assert _decode_both(a, b, rng.integers(0, vocab, 7).astype(np.int64), 10) == 11


def test_the_chains_of_a_torch_to_nnef_llama_export_are_found() -> None:
    path = FIXTURES / "exports" / "llama_default" / "model.nnef.tgz"
    if not path.is_file():
        pytest.skip("fixture export not found")
    plan = get_plan(nnef_kv.load(path))
    ops = _step_ops(plan)
    layers = 2
    assert ops.count("rms_norm") == 2 * layers + 1  # two a layer and the final norm
    assert ops.count("rope") == 2 * layers and ops.count("attention") == layers
    assert ops.count("silu_gate") == layers and ops.count("view") >= 3 * layers
    assert plan.info["cache_appends"] == 2 * layers and plan.info["memo_steps"] > 100
    assert plan.info["fused_projections"] == 3 * layers  # k, v join q; up joins gate
    assert plan.info["steps"] < plan.info["nodes"] // 3
    # the GQA repeat (2 query heads a kv head) is read in place: its tiles run inside the attention chains'
    # fallback only
    assert "tile" not in ops
    att = [m for m in _step_nodes(plan) if m.op == "attention"]
    assert all("tile" in [n.op for n in chain_members(m)] for m in att)
    plain = build_plan(plan.graph, fuse_ops=False, specialize_kernels=False)
    assert "tile" in [n.op for n in plain.step_nodes]
    # and the fast forms run (no fallback) on a decode of this f32 export
    s = Session(nnef_kv.load(path))
    sig = detect_signature(s.plan)
    caches = sig.empty_caches()
    for ids in (np.arange(5)[None], np.array([[3]]), np.array([[4]])):
        out = s.run({sig.ids_input: ids.astype(np.int64), **caches})
        caches = {i: out[o] for i, o in sig.cache_outputs.items()}
    slow = {n.op: st.fallbacks for st, n in zip(s.plan.steps, s.plan.step_nodes) if hasattr(st, "fallbacks")}
    assert slow and not any(slow.values()), slow


@pytest.mark.parametrize("cache,kv_heads,weights", [("explicit", 2, "f32"), ("explicit", 4, "f32"),
                                                    ("dyn", 2, "f32"), ("explicit", 2, "q4_0")])
def test_built_in_decoder_decodes_bit_identically(cache: str, kv_heads: int, weights: str) -> None:
    cfg = DecoderConfig(cache=cache, vocab=64, hidden=64, heads=4, kv_heads=kv_heads, head_dim=16, mlp=96,
                        weights=weights)
    a, b = _pair(build_decoder(cfg), build_decoder(cfg))
    assert a.plan.info["fused_chains"] > 0
    _decode_both(a, b, np.arange(9, dtype=np.int64), 12)


SPECIALS = st.sampled_from([np.nan, np.inf, -np.inf, 3e38, -3e38, 1e20, 0.0])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kv_heads=st.sampled_from([1, 2, 4]), prompt=st.integers(1, 6), past=st.integers(0, 5),
       cache_specials=st.lists(st.tuples(st.integers(0, 10 ** 6), SPECIALS), max_size=4),
       embed_specials=st.lists(st.tuples(st.integers(0, 10 ** 6), SPECIALS), max_size=3),
       seed=st.integers(0, 2 ** 31 - 1))
def test_special_values_take_the_same_path_fused_and_unfused(kv_heads, prompt, past, cache_specials,
                                                             embed_specials, seed) -> None:
    """NaN, +-Inf and huge values in the caches (attention: scores, softmax, values) and in the embedding
    rows (rms_norm: x*x overflows, NaN means; rope; the SiLU gate), GQA and MHA, a prompt over a non-empty
    cache: the fast forms and their fallbacks give the unfused plan's bits."""
    cfg = DecoderConfig(cache="explicit", vocab=32, hidden=32, heads=4, kv_heads=kv_heads, head_dim=8, mlp=64)
    w = build_decoder_weights(cfg)
    emb = w["model.embed_tokens.weight"].copy()
    for pos, val in embed_specials:
        emb.flat[pos % emb.size] = val
    w["model.embed_tokens.weight"] = emb
    from nnef_kv.io.archive import Model
    from nnef_kv.models.llama import build_decoder_text

    text = build_decoder_text(cfg)
    a, b = _pair(Model.from_text(text, dict(w)), Model.from_text(text, dict(w)))
    rng = np.random.default_rng(seed)
    caches = {}
    for name in detect_signature(a.plan).cache_inputs:
        c = rng.standard_normal((1, kv_heads, past, 8)).astype(np.float32)
        caches[name] = c
    names = sorted(caches)
    for pos, val in cache_specials:
        c = caches[names[pos % len(names)]]
        if c.size:
            c.flat[pos % c.size] = val
    _decode_both(a, b, rng.integers(0, 32, prompt).astype(np.int64), 3, caches)


def test_capturing_an_inner_value_of_a_chain_runs_the_unfused_plan() -> None:
    cfg = DecoderConfig(cache="explicit", vocab=32, hidden=32, heads=4, kv_heads=2, head_dim=8, mlp=64)
    model = build_decoder(cfg)
    s = Session(model)
    sig = detect_signature(s.plan)
    inner = "layer0_input_norm_rsqrt"  # inside the first rms_norm chain
    assert s.plan.slot_of(inner) in s.plan.elided
    feed = {sig.ids_input: np.array([[1, 2, 3]], np.int64), **sig.empty_caches()}
    outs, caps = s.run(feed, capture=[inner])
    plain = build_plan(s.plan.graph, fuse_ops=False)
    from nnef_kv.interpreter.plan import bind_inputs, execute

    v = bind_inputs(plain, feed)
    execute(plain, v, [], keep=frozenset({plain.slot_of(inner)}))
    np.testing.assert_array_equal(caps[inner], v[plain.slot_of(inner)])
    np.testing.assert_array_equal(outs[sig.logits_output], v[dict(plain.outputs)[sig.logits_output]])


def test_shape_memo_values_are_read_only_and_follow_the_shapes() -> None:
    cfg = DecoderConfig(cache="explicit", vocab=32, hidden=32, heads=4, kv_heads=2, head_dim=8, mlp=64)
    s = Session(build_decoder(cfg))
    sig = detect_signature(s.plan)
    memo = [i for i, n in enumerate(s.plan.step_nodes) if n.op.startswith("shapes:")]
    assert memo
    seen = []
    for ids in (np.array([[1, 2, 3]]), np.array([[4]]), np.array([[5, 6]])):
        out = s.run({sig.ids_input: ids.astype(np.int64), **sig.empty_caches()}, capture=[
            n.outputs[0] for n in []] or None)
        seen.append(np.asarray(out[sig.logits_output]).shape)
    node = s.plan.step_nodes[memo[0]]
    outs, caps = s.run({sig.ids_input: np.array([[7]], np.int64), **sig.empty_caches()}, capture=[node])
    val = caps[node.name]
    if isinstance(val, np.ndarray) and val.size:
        assert not val.flags.writeable


# ------------------------------------------------------------------------------------------------
# the explicit-cache append
# ------------------------------------------------------------------------------------------------
def _arr(rng, t: int) -> np.ndarray:
    return rng.standard_normal((1, 2, t, 4)).astype(np.float32)


def test_grow_concat_is_concat_and_grows_in_place_only_from_the_last_view() -> None:
    rng = np.random.default_rng(0)
    first = _arr(rng, 3)
    a = grow_concat([first, _arr(rng, 2)], 2)
    assert a.shape == (1, 2, 5, 4) and not np.shares_memory(a, first)
    keep = a.copy()
    new = _arr(rng, 1)
    b = grow_concat([a, new], 2)  # the last view: grown in place
    assert np.shares_memory(a, b) and b.base is a.base
    np.testing.assert_array_equal(b, np.concatenate([keep, new], axis=2))
    np.testing.assert_array_equal(a, keep)  # a view handed out earlier never changes
    c = grow_concat([a, _arr(rng, 1)], 2)  # an older view again (a retried step, a branch): a copy
    assert not np.shares_memory(c, b)
    np.testing.assert_array_equal(b[:, :, :5], keep)
    np.testing.assert_array_equal(c[:, :, :5], keep)
    d = grow_concat([b[...], _arr(rng, 1)], 2)  # another view of the same memory: a copy too
    assert not np.shares_memory(d, b)
    e = grow_concat([b, _arr(rng, 0)], 2)  # nothing new
    np.testing.assert_array_equal(e, b)
    for other in ([b.astype(np.float64), _arr(rng, 1)], [b, _arr(rng, 1)[..., :3]]):  # dtypes / shapes differ
        with np.errstate(all="ignore"):
            try:
                want = np.concatenate([x.astype(np.result_type(*other)) for x in other], axis=2)
            except ValueError:
                with pytest.raises(ValueError):
                    grow_concat(other, 2)
                continue
        np.testing.assert_array_equal(grow_concat(other, 2), want)


def test_grow_concat_past_its_capacity_and_from_two_threads() -> None:
    rng = np.random.default_rng(1)
    x = grow_concat([_arr(rng, 0), _arr(rng, 1)], 2)
    ref = np.asarray(x).copy()
    for _ in range(300):  # several reallocations
        new = _arr(rng, 1)
        ref = np.concatenate([ref, new], axis=2)
        x = grow_concat([x, new], 2)
    np.testing.assert_array_equal(x, ref)
    results: list[np.ndarray] = []
    news = [_arr(rng, 1) for _ in range(2)]
    start = threading.Barrier(2)

    def run(i: int) -> None:
        start.wait()
        results.append((i, grow_concat([x, news[i]], 2)))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, r in results:  # both calls got their own, correct result whichever claimed the room
        np.testing.assert_array_equal(r, np.concatenate([ref, news[i]], axis=2))


@settings(max_examples=300, deadline=None)
@given(data=st.data(), nd=st.integers(1, 5), count=st.integers(1, 3))
def test_concat_order_is_the_layout_numpy_gives_concatenate(data, nd: int, count: int) -> None:
    """The buffer of an explicit cache is laid out as ``np.concatenate`` lays out its result (what the
    products reading it see): the order re-implemented in cache_append.concat_order, against NumPy."""
    from nnef_kv.interpreter.plan.cache_append import concat_order

    axis = data.draw(st.integers(0, nd - 1))
    shape = data.draw(st.lists(st.integers(0, 3), min_size=nd, max_size=nd))
    arrays = []
    for _ in range(count):
        sh = list(shape)
        sh[axis] = data.draw(st.integers(0, 3))
        perm = data.draw(st.permutations(range(nd)))
        a = np.zeros([sh[i] for i in perm], np.float32).transpose(np.argsort(perm))
        if data.draw(st.booleans()):  # a strided view of a larger array
            big = np.zeros([sh[i] * 2 + 1 for i in perm], np.float32).transpose(np.argsort(perm))
            a = big[tuple(slice(0, s) for s in sh)]
        arrays.append(a)
    got = np.concatenate(arrays, axis=axis)
    if got.size == 0:
        return
    order = concat_order(arrays)
    strides = [0] * nd
    step = got.itemsize
    for ax in reversed(order):
        strides[ax] = step
        step *= got.shape[ax]
    assert tuple(strides) == got.strides


def _decoder_session(path) -> Session:
    """A session of an export of the fixtures, or of the built-in explicit-cache GQA decoder."""
    if path == "built-in":
        return Session(build_decoder(DecoderConfig(cache="explicit", vocab=64, hidden=64, heads=4, kv_heads=2,
                                                   head_dim=16, mlp=96)))
    return Session(nnef_kv.load(path))


@pytest.mark.skipif(not numba_available(), reason="numba is not installed (or NNEF_KV_NO_NUMBA=1)")
@pytest.mark.parametrize("path", EXPORTS + ["built-in"], ids=lambda p: p if isinstance(p, str) else p.parent.name)
def test_the_attention_kernel_in_real_decodes(path, monkeypatch) -> None:
    """With the decode-step attention kernel on (the default), every call it makes while an export (or the
    built-in GQA decoder) decodes is within the kernel's error bound of the exact attention of the same inputs,
    and decode steps do take it."""
    plan_attention.DECODE_KERNEL[0] = True
    x = np.zeros((1, 1, 1, 4), np.float32)
    attend.attend_rows(x, x, x, None, 1, None, np.empty_like(x))  # the plan then takes the compiled core
    calls: list[int] = []
    real_hot = attend.attend_rows.hot

    def checking_hot():
        fn = real_hot()
        assert fn is not None and fn is not attend.attend_rows

        def run(q, k, v, mask, g, scale, scaled, out):
            fn(q, k, v, mask, g, scale, scaled, out)
            mask = None if mask.size == 0 else mask  # the core's NO_MASK
            scale = scale if scaled else None
            ex = attend.exact(q, k, v, mask, g, scale)
            bound = attend.error_bound(q, k, v, mask, g, scale)
            fin = np.isfinite(ex)
            assert np.all(np.abs(out - ex)[fin] <= bound[fin])
            assert np.array_equal(np.isnan(out), np.isnan(ex))
            calls.append(q.shape[2])
        return run

    monkeypatch.setattr(attend.attend_rows, "hot", checking_hot)
    s = _decoder_session(path)
    sig = detect_signature(s.plan)
    caches = sig.empty_caches() if sig.explicit else {}
    for ids in (np.arange(6)[None], np.array([[3]]), np.array([[4]]), np.array([[1]])):
        out = s.run({sig.ids_input: ids.astype(np.int64), **caches})
        if sig.explicit:
            caches = {i: out[o] for i, o in sig.cache_outputs.items()}
    att = sum(1 for n in s.plan.step_nodes if n.op == "attention")
    if att:
        assert calls.count(1) >= 3 * att, (att, calls)  # every decode step's attention took the kernel


@pytest.mark.skipif(not numba_available(), reason="numba is not installed (or NNEF_KV_NO_NUMBA=1)")
@pytest.mark.parametrize("path", EXPORTS + ["built-in"], ids=lambda p: p if isinstance(p, str) else p.parent.name)
def test_the_gate_kernel_in_real_decodes(path, monkeypatch) -> None:
    """With the SwiGLU gate kernel on (the default), every call it makes while an export (or the built-in
    decoder) prefills and decodes is within the kernel's error bound of the exact gate of the same inputs, and
    every fused gate on float32 values takes it."""
    plan_patterns.GATE_KERNEL[0] = True
    x = np.zeros((1, 4), np.float32)
    gate.silu_gate(x, x, np.empty_like(x))  # the plan then takes the compiled core
    calls: list[tuple[int, ...]] = []
    real_hot = gate.silu_gate.hot

    def checking_hot():
        fn = real_hot()
        assert fn is not None and fn is not gate.silu_gate

        def run(g, u, out):
            fn(g, u, out)
            ex, bound = gate.exact(g, u), gate.error_bound(g, u)
            assert np.all(np.abs(out - ex) <= bound)
            calls.append(g.shape)
        return run

    monkeypatch.setattr(gate.silu_gate, "hot", checking_hot)
    s = _decoder_session(path)
    sig = detect_signature(s.plan)
    caches = sig.empty_caches() if sig.explicit else {}
    for ids in (np.arange(6)[None], np.array([[3]]), np.array([[4]])):
        out = s.run({sig.ids_input: ids.astype(np.int64), **caches})
        if sig.explicit:
            caches = {i: out[o] for i, o in sig.cache_outputs.items()}
    gates = [st for st, n in _steps(s.plan) if n.op == "silu_gate"]
    slow = sum(st.fallbacks for st in gates)  # a gate on float16 values takes the unfused steps
    assert len(calls) == 3 * len(gates) - slow, (len(gates), slow, calls)
    assert path != "built-in" or (gates and not slow)


def test_prefill_blocks_read_a_read_only_mask_once(monkeypatch) -> None:
    """The cuts of a prefill's blocks are read off the graph's mask (a shape memo's value: read-only) once for
    every layer and the next prefill of that length, and the result is the same bits as reading them each time;
    a writeable mask (one a caller feeds and may change) is never remembered."""
    from nnef_kv.kv import blocked

    cfg = DecoderConfig(vocab=64, hidden=64, layers=3, heads=4, kv_heads=2, head_dim=16, mlp=96)
    ids = np.random.default_rng(3).integers(0, 64, (1, 96)).astype(np.int64)
    read: list[int] = []
    real = blocked.mask_cut

    def counting(mb):
        read.append(mb.shape[2])
        return real(mb)
    monkeypatch.setattr(blocked, "mask_cut", counting)
    s = Session(build_decoder(cfg))
    sig = detect_signature(s.plan)
    feed = {**sig.empty_caches(), sig.ids_input: ids}
    first = s.run(feed)[sig.logits_output]
    blocks = len(read)
    assert blocks > 1  # one layer's blocks read the mask, the other two layers' took the cuts remembered
    again = s.run(feed)[sig.logits_output]
    assert len(read) == blocks  # the next prefill of this length: the memo's same mask object
    plan_attention._CUTS[0] = None  # forgotten: every layer reads the mask
    monkeypatch.setattr(plan_attention, "_mask_cuts", lambda mv: None)
    fresh = s.run(feed)[sig.logits_output]
    assert len(read) == blocks + 3 * blocks
    np.testing.assert_array_equal(first, again)
    np.testing.assert_array_equal(first, fresh)
    ro = np.zeros((4, 4), np.float32)
    ro.flags.writeable = False
    view = ro[None, None]
    assert plan_attention._mask_cuts(view) is plan_attention._mask_cuts(view)
    rw = np.zeros((4, 4), np.float32)
    assert plan_attention._mask_cuts(rw) is None
    ro_view_of_rw = rw[None, None]
    ro_view_of_rw.flags.writeable = False
    assert plan_attention._mask_cuts(ro_view_of_rw) is None  # its base may still change
