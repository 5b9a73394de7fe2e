"""Dense runs (interpreter/plan/dense.py, kernels/dense.py) and attention segments (interpreter/plan/segments.py)
replay a decode step's members with the members' own bits.

Each comparison decodes one model twice in lockstep, the same plan with the replays on and off
(``dense.REPLAY``, ``segments.REPLAY``: off, a run or segment runs its member steps one by one), with the
decode kernels on as by default, and compares every output with ``assert_array_equal``: on the built-in
decoder in its forms, on the torch-to-nnef exports of the fixtures, and with NaN / Inf / huge values in the
caches. The other tests check that the replays are taken where they should be and not elsewhere (a prefill's
rows, a gate kernel switched off, numba off), that a value a run keeps to itself can still be captured, and
the kernel's program checks and its NumPy reference."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nnef_kv
from conftest import FIXTURES
from nnef_kv.interpreter.plan import dense as plan_dense
from nnef_kv.interpreter.plan import patterns as plan_patterns
from nnef_kv.interpreter.plan import segments as plan_segments
from nnef_kv.interpreter.plan.dense import Run
from nnef_kv.interpreter.plan.segments import Segment
from nnef_kv.interpreter.session import Session
from nnef_kv.kernels import dense as kdense
from nnef_kv.kernels import numba_available
from nnef_kv.models import DecoderConfig, build_decoder
from nnef_kv.validate.decode import detect_signature

needs_numba = pytest.mark.skipif(not numba_available(), reason="numba is not installed (or NNEF_KV_NO_NUMBA=1)")
EXPORTS = sorted(p for p in (FIXTURES / "exports").glob("*/model.nnef.tgz") if p.parent.name != "llama_sdpa") \
    if (FIXTURES / "exports").is_dir() else []  # (llama_sdpa's graph takes one prompt length: as test_patterns)
#: f32 exports whose MLP blocks make runs (f16 weights do not; Q4_0 ones when numba is off and they are
#: dequantized; GPT-2's MLP is GELU)
WITH_RUNS = {"llama_default", "llamamha_sdpa", "qwen2_default", "gemma_default", "phi3_default"}
SMALL = dict(vocab=64, hidden=64, heads=4, head_dim=16, mlp=96)


def _replays(plan) -> list:
    return [s for s in plan.steps if isinstance(s, (Run, Segment))]


def _decode(session: Session, prompt: np.ndarray, steps: int, replay: bool, caches: dict | None = None) -> list:
    """Prompt then ``steps`` greedy one-token calls with the replays on or off; every call's outputs."""
    sig = detect_signature(session.plan)
    c = {k: v.copy() for k, v in caches.items()} if caches is not None else sig.empty_caches()
    ids = prompt[None]
    got = []
    plan_dense.REPLAY[0] = plan_segments.REPLAY[0] = replay
    try:
        with np.errstate(all="ignore"):
            for _ in range(steps + 1):
                out = session.run({sig.ids_input: ids, **c}) if sig.explicit else session.run({sig.ids_input: ids})
                got.append({k: np.array(v, copy=True) for k, v in out.items()})
                if sig.explicit:
                    c = {i: out[o] for i, o in sig.cache_outputs.items()}
                logits = np.asarray(out[sig.logits_output]).reshape(-1, np.shape(out[sig.logits_output])[-1])[-1]
                tok = int(np.nanargmax(logits)) if np.isfinite(logits).any() else 0
                ids = np.array([[tok]], np.int64)
    finally:
        plan_dense.REPLAY[0] = plan_segments.REPLAY[0] = True
    return got


def _same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=f"call {i}: output {k}")


def _counts(plan) -> tuple[int, int]:
    """(calls that ran members one by one, member fallbacks) summed over the plan's runs and segments."""
    reps = _replays(plan)
    return sum(s.member_runs for s in reps), sum(s.fallbacks for s in reps)


@pytest.mark.parametrize("cache,kv_heads,weights,layers", [("explicit", 2, "f32", 2), ("explicit", 4, "f32", 3),
                                                           ("explicit", 1, "f32", 1), ("dyn", 2, "f32", 2),
                                                           ("explicit", 2, "q4_0", 2)])
def test_replays_decode_bit_identically_to_their_members(cache, kv_heads, weights, layers) -> None:
    cfg = DecoderConfig(cache=cache, kv_heads=kv_heads, weights=weights, layers=layers, **SMALL)
    model = build_decoder(cfg)
    s = Session(model)
    prompt = np.arange(7, dtype=np.int64)
    on = _decode(s, prompt, 10, True)
    before = _counts(s.plan)
    off = _decode(Session(model), prompt, 10, False)  # the same plan, a session of its own (states)
    _same(on, off)
    if weights == "f32" and cache == "explicit":
        assert s.plan.info["dense_runs"] == layers and s.plan.info["attention_segments"] == layers
        if numba_available():
            # a run replays every decode step (the prompt's rows run the members); a segment every call
            # after the first (the RoPE kernel is compiled by its members' first call)
            assert before[0] <= 2 * layers + layers, before
            assert before[1] == 0


@pytest.mark.parametrize("path", EXPORTS, ids=lambda p: p.parent.name)
def test_replays_of_exports_decode_bit_identically(path) -> None:
    model = nnef_kv.load(path)
    s = Session(model)
    assert s.plan.info["dense_runs"] > 0 or path.parent.name not in WITH_RUNS
    prompt = np.arange(5, dtype=np.int64)
    on = _decode(s, prompt, 6, True)
    runs = [r for r in _replays(s.plan) if isinstance(r, Run)]
    members = sum(r.member_runs for r in runs)
    _same(on, _decode(Session(model), prompt, 6, False))
    if numba_available():  # the prompt's rows and the first decode step (kernels compiling) ran the members
        assert members <= 2 * len(runs), members


SPECIALS = st.sampled_from([np.nan, np.inf, -np.inf, 3e38, -3e38, 1e20, 0.0])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kv_heads=st.sampled_from([1, 2, 4]), past=st.integers(0, 5),
       specials=st.lists(st.tuples(st.integers(0, 10_000), SPECIALS), max_size=6), seed=st.integers(0, 2 ** 16))
def test_replays_with_special_values_are_the_members_bits(kv_heads, past, specials, seed) -> None:
    cfg = DecoderConfig(cache="explicit", kv_heads=kv_heads, layers=2, **SMALL)
    model = build_decoder(cfg)
    s = Session(model)
    sig = detect_signature(s.plan)
    rng = np.random.default_rng(seed)
    caches = {}
    for k, v in sig.empty_caches().items():
        shape = list(v.shape)
        shape[2] = past
        c = rng.standard_normal(shape).astype(np.float32)
        for pos, val in specials:
            if c.size:
                c.reshape(-1)[pos % c.size] = val
        caches[k] = c
    prompt = rng.integers(0, 64, 3).astype(np.int64)
    _same(_decode(s, prompt, 4, True, caches), _decode(Session(model), prompt, 4, False, caches))


def test_one_and_two_threads_replay_the_same_bits() -> None:
    cfg = DecoderConfig(cache="explicit", kv_heads=2, layers=2, **SMALL)
    model = build_decoder(cfg)
    prompt = np.arange(6, dtype=np.int64)
    _same(_decode(Session(model, threads=1), prompt, 6, True), _decode(Session(model, threads=2), prompt, 6, True))


@needs_numba
def test_a_run_replays_one_row_and_runs_its_members_otherwise(monkeypatch) -> None:
    cfg = DecoderConfig(cache="explicit", kv_heads=2, layers=2, **SMALL)
    s = Session(build_decoder(cfg))
    sig = detect_signature(s.plan)
    runs = [r for r in _replays(s.plan) if isinstance(r, Run)]
    assert runs and all(r.ops[0].kind == "product" for r in runs)
    caches = sig.empty_caches()

    def call(ids):
        nonlocal caches
        out = s.run({sig.ids_input: np.asarray(ids, np.int64), **caches})
        caches = {i: out[o] for i, o in sig.cache_outputs.items()}

    call([[1, 2, 3]])  # a prompt: three rows, the members
    call([[4]])  # compiles what the members call
    before = sum(r.member_runs for r in runs)
    call([[5]])
    assert sum(r.member_runs for r in runs) == before  # one row: replayed
    call([[6, 7]])
    assert sum(r.member_runs for r in runs) == before + len(runs)  # two rows: the members
    plan_patterns.GATE_KERNEL[0] = False  # the members' gate on NumPy's calls: no replay
    try:
        call([[8]])
    finally:
        plan_patterns.GATE_KERNEL[0] = True
    assert sum(r.member_runs for r in runs) == before + 2 * len(runs)
    monkeypatch.setenv("NNEF_KV_NO_NUMBA", "1")  # numba off: the members (on BLAS and NumPy)
    call([[9]])
    assert sum(r.member_runs for r in runs) == before + 3 * len(runs)


def test_a_value_kept_inside_a_run_can_be_captured() -> None:
    """The RMS norm inside a run is not materialised; capturing it runs the unfused plan and gives its value."""
    cfg = DecoderConfig(cache="explicit", kv_heads=2, layers=2, **SMALL)
    s = Session(build_decoder(cfg))
    run = next(r for r in _replays(s.plan) if isinstance(r, Run))
    rms = next(nd for st_, nd in run.members if nd.op == "rms_norm")
    sig = detect_signature(s.plan)
    feed = {sig.ids_input: np.array([[3]], np.int64), **sig.empty_caches()}
    outs, caps = s.run(feed, capture=[rms.name])
    plain = Session(build_decoder(cfg))
    ref_outs, ref_caps = plain.run(feed, capture=[rms.name])
    np.testing.assert_array_equal(caps[rms.name], ref_caps[rms.name])
    for k in outs:
        np.testing.assert_array_equal(outs[k], ref_outs[k])


def test_products_too_large_to_keep_on_one_thread_stay_steps(monkeypatch) -> None:
    """A product at least MIN_ROWS_SPLIT_BYTES large (two threads split it) is never a run member."""
    monkeypatch.setattr(plan_dense, "MIN_ROWS_SPLIT_BYTES", 64 * 96 * 4)  # the MLP's products and up
    cfg = DecoderConfig(cache="explicit", kv_heads=2, layers=2, **SMALL)
    s = Session(build_decoder(cfg))
    for r in (r for r in _replays(s.plan) if isinstance(r, Run)):
        assert all(op.w.nbytes < 64 * 96 * 4 for op in r.ops if op.kind == "product")


# -- the kernel -----------------------------------------------------------------------------------------------
def _program(rng, k: int, f: int, with_gate: bool):
    wq = (rng.standard_normal((3 * k, k)) * 0.2).astype(np.float32)
    wg = (rng.standard_normal((2 * f, k)) * 0.2).astype(np.float32)
    wd = (rng.standard_normal((k, f)) * 0.2).astype(np.float32)
    wn = rng.standard_normal((1, k)).astype(np.float32)
    code = [[kdense.PRODUCT, 0, 0, 0, -1], [kdense.SLICE, 2, 0, k, -1], [kdense.ADD, 1, 3, 0, -1],
            [kdense.RMS, 4, 3, 0, -1], [kdense.PRODUCT, 5, 1, 0, 1], [kdense.SLICE, 6, 0, f, -1],
            [kdense.SLICE, 6, f, 2 * f, -1]]
    code += [[kdense.GATE, 7, 8, 0, -1]] if with_gate else [[kdense.ADD, 7, 8, 0, -1]]
    code += [[kdense.PRODUCT, 9, 2, 0, -1], [kdense.ADD, 4, 10, 0, 0], [kdense.RMS, 11, -1, 0, 2]]
    eps = np.full(len(code), 1e-5, np.float32)
    return np.array(code, np.int64), eps, [wq, wg, wd, wn], (k, 2 * f, k)


@needs_numba
@settings(max_examples=30, deadline=None)
@given(k=st.integers(1, 80), f=st.integers(1, 70), seed=st.integers(0, 2 ** 16), with_gate=st.booleans())
def test_run_ops_is_its_reference_within_the_products_rounding(k, f, seed, with_gate) -> None:
    rng = np.random.default_rng(seed)
    code, eps, weights, widths = _program(rng, k, f, with_gate)
    ins = (rng.standard_normal((1, k)).astype(np.float32), rng.standard_normal((1, k)).astype(np.float32))
    a = tuple(np.full((1, n), np.nan, np.float32) for n in widths)
    b = tuple(np.full((1, n), np.nan, np.float32) for n in widths)
    kdense.run_ops.jit(code, eps, weights, ins, a)
    kdense.run_ops.reference(code, eps, weights, ins, b)
    for x, y in zip(a, b):  # BLAS's sums and the kernel's: another order, a few ulp apart
        np.testing.assert_allclose(x, y, rtol=2e-4, atol=2e-4 * max(1.0, float(np.max(np.abs(y)))))


@pytest.mark.parametrize("edit,match", [
    (lambda c, w: c.__setitem__((0, 1), 9), "does not exist"),
    (lambda c, w: c.__setitem__((1, 3), 10_000), "columns"),
    (lambda c, w: c.__setitem__((2, 2), 2), "widths"),
    (lambda c, w: c.__setitem__((3, 2), 0), "RMS weight"),
    (lambda c, w: c.__setitem__((0, 0), 7), "unknown operation"),
    (lambda c, w: c.__setitem__((9, 4), 1), "output 1"),
])
def test_run_ops_refuses_a_bad_program(edit, match) -> None:
    rng = np.random.default_rng(0)
    code, eps, weights, widths = _program(rng, 8, 6, True)
    edit(code, weights)
    outs = tuple(np.empty((1, n), np.float32) for n in widths)
    ins = (np.zeros((1, 8), np.float32), np.zeros((1, 8), np.float32))
    with pytest.raises(ValueError, match=match):
        kdense.run_ops(code, eps, weights, ins, outs)


def test_run_products_read_the_weights_their_steps_read(tmp_path, monkeypatch) -> None:
    """A product's weight memory-mapped from a ``.tar`` is copied into huge pages by the plan (its step reads the
    copy); the run's program reads that copy too, not the archive's pages."""
    from nnef_kv.interpreter.plan import weights as plan_weights
    from nnef_kv.tensors import hugepages

    monkeypatch.setattr(plan_weights, "MIN_HUGE_BYTES", 1)  # the small decoder's weights move too
    monkeypatch.delenv(hugepages.ENV, raising=False)
    cfg = DecoderConfig(cache="explicit", kv_heads=2, layers=2, **SMALL)
    path = nnef_kv.save(build_decoder(cfg), tmp_path / "m.tar")
    s = Session(nnef_kv.load(path))
    moved = 0
    for run in (r for r in _replays(s.plan) if isinstance(r, Run)):
        steps = [st_ for st_, _ in run.members if hasattr(st_, "product")]
        for step, op in zip(steps, [op for op in run.ops if op.kind == "product"]):
            slot = step.product[1]
            if isinstance(slot, int):  # a single product: its weight is the step's constant at that slot
                assert np.shares_memory(op.w, s.plan.base[slot])
                moved += hugepages.holds(plan_weights._root(s.plan.base[slot]))
    assert moved >= 2 * cfg.layers - 1  # the output and down projections (the last layer's o at least)
