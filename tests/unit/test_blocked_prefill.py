"""Attention over a long prefill in blocks of query rows (``nnef_kv/kv/blocked.py``): the blocked result
equals the one-call result (<= 1e-5 relative) on every exact path that sees a prefill, and the blocks bound
the memory one attention takes (issue 26 point 3)."""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from nnef_kv.interpreter.session import Session
from nnef_kv.kv import blocked
from nnef_kv.kv.exact import sdpa_array
from nnef_kv.kv.hf_quantized import HfQuantizedSdpa
from nnef_kv.kv.kivi import KiviSdpa
from nnef_kv.kv.tract_fused import TractQuantizedKvSdpa, softmax_attention
from nnef_kv.models import DecoderConfig, build_decoder
from nnef_kv.validate.decode import detect_signature

ONE_CALL = 1 << 50  # a budget no test reaches: every attention in one block


def _rel(got: np.ndarray, ref: np.ndarray) -> float:
    assert got.shape == ref.shape and np.array_equal(np.isnan(got), np.isnan(ref))
    fin = np.isfinite(ref)
    return float(np.max(np.abs(got[fin] - ref[fin])) / max(np.max(np.abs(ref[fin])), 1e-30))


@pytest.fixture
def count_blocks(monkeypatch):
    """The number of blocks of each call that takes its queries in blocks."""
    seen: list[int] = []
    real = blocked.row_ranges

    def ranges(rows: int, block: int) -> list[tuple[int, int]]:
        got = real(rows, block)
        seen.append(len(got))
        return got
    monkeypatch.setattr(blocked, "row_ranges", ranges)
    return seen


def _qkv(hq: int, hkv: int, sq: int, skv: int, d: int = 16, seed: int = 0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((1, hq, sq, d)).astype(np.float32),
            rng.standard_normal((1, hkv, skv, d)).astype(np.float32),
            rng.standard_normal((1, hkv, skv, d)).astype(np.float32))


@pytest.mark.parametrize("hq,hkv,sq,skv,kind", [
    (4, 2, 70, 70, "causal"), (4, 2, 70, 90, "causal"), (4, 4, 70, 50, "causal"), (6, 2, 67, 67, "causal"),
    (6, 2, 40, 55, "mask"), (6, 2, 80, 90, "mask"), (4, 4, 33, 33, "mask-heads"), (4, 4, 70, 70, "mask-heads"),
    (2, 1, 33, 40, "none")])
def test_sdpa_blocked_equals_one_call(monkeypatch, count_blocks, hq, hkv, sq, skv, kind) -> None:
    q, k, v = _qkv(hq, hkv, sq, skv)
    mask = None
    if kind.startswith("mask"):
        fut = np.arange(skv)[None, :] > (np.arange(sq) + skv - sq)[:, None]
        mask = (fut * np.float32(-1e9)).astype(np.float32)[None, None]
        if kind == "mask-heads":
            mask = np.repeat(mask, hq, axis=1) + np.random.default_rng(1).standard_normal((1, hq, sq, skv)).astype(
                np.float32)
    causal = kind == "causal"
    if kind == "mask" and sq > 64:  # a hard mask: blocks leave out the keys it hides
        monkeypatch.setattr(blocked, "unseen_from", _counting(blocked.unseen_from, cuts := []))
    monkeypatch.setattr(blocked, "SCORE_BYTES", ONE_CALL)
    monkeypatch.setattr(blocked, "CAUSAL_BLOCKS", 1)
    ref = sdpa_array(q, k, v, mask, is_causal=causal)
    assert count_blocks == []  # the one-call arithmetic
    monkeypatch.setattr(blocked, "SCORE_BYTES", hq * skv * 4 * 7)  # 7 query rows a block
    got = sdpa_array(q, k, v, mask, is_causal=causal)
    assert count_blocks[-1] == -(-sq // 7)
    assert _rel(got, ref) <= 1e-5
    if kind == "mask" and sq > 64:
        assert any(c < skv for c in cuts)


def _counting(fn, seen: list):
    def wrapped(*a):
        got = fn(*a)
        seen.append(got)
        return got
    return wrapped


def test_sdpa_causal_blocks_keep_non_finite_values_as_one_call(monkeypatch) -> None:
    """A value that is not finite where a row cannot see it: one call gives NaN (0 * inf), and so do the
    blocks (they keep every key then)."""
    q, k, v = _qkv(2, 1, 40, 40)
    v[0, 0, 30, 3] = np.inf
    monkeypatch.setattr(blocked, "SCORE_BYTES", ONE_CALL)
    monkeypatch.setattr(blocked, "CAUSAL_BLOCKS", 1)
    with np.errstate(invalid="ignore"):
        ref = sdpa_array(q, k, v, is_causal=True)
        monkeypatch.setattr(blocked, "SCORE_BYTES", 2 * 40 * 4 * 5)
        got = sdpa_array(q, k, v, is_causal=True)
    assert np.isnan(ref[0, :, :30]).any()
    assert _rel(got, ref) <= 1e-5


@pytest.mark.parametrize("cache,spelling", [("explicit", "torch-to-nnef"), ("dyn", "torch-to-nnef"),
                                            ("dyn", "tract")])
def test_decoder_prefill_blocked_equals_one_call(monkeypatch, count_blocks, cache, spelling) -> None:
    """The built-in decoder's prefill (the plan's fused attention chain for the explicit form,
    ``tract_transformers_sdpa`` with a mask / causal for the dyn forms), 96 tokens then one decode step."""
    cfg = DecoderConfig(cache=cache, spelling=spelling, vocab=64, hidden=64, layers=2, heads=4, kv_heads=2,
                        head_dim=16, mlp=96)
    ids = np.random.default_rng(3).integers(0, 64, (1, 96)).astype(np.int64)

    def run(budget: int) -> list[np.ndarray]:
        monkeypatch.setattr(blocked, "SCORE_BYTES", budget)
        s = Session(build_decoder(cfg))
        sig = detect_signature(s.plan)
        feed = {**sig.empty_caches(), sig.ids_input: ids} if sig.explicit else {sig.ids_input: ids}
        out = s.run(feed)
        got = [out[sig.logits_output]] + [out[o] for o in sorted(sig.cache_outputs.values())]
        nxt = {sig.ids_input: np.array([[5]], np.int64)}
        if sig.explicit:
            nxt.update({i: out[o] for i, o in sig.cache_outputs.items()})
        got.append(s.run(nxt)[sig.logits_output])
        slow = [st.fallbacks for st, n in zip(s.plan.steps, s.plan.step_nodes) if n.op == "attention"]
        assert not any(slow)
        return got

    monkeypatch.setattr(blocked, "CAUSAL_BLOCKS", 1)
    ref = run(ONE_CALL)
    assert count_blocks == []
    got = run(4 * 96 * 4 * 10)  # 10 query rows a block
    assert max(count_blocks) == 10  # the prefill's attentions took 10 blocks
    for a, b in zip(got, ref):
        assert _rel(a, b) <= 1e-5


def test_hf_prefill_blocked_equals_one_call(monkeypatch, count_blocks) -> None:
    q, k, v = _qkv(4, 2, 80, 80, d=32)
    monkeypatch.setattr(blocked, "SCORE_BYTES", ONE_CALL)
    monkeypatch.setattr(blocked, "CAUSAL_BLOCKS", 1)
    op = HfQuantizedSdpa(scale=0.2, residual=16, group_size=32)
    ref = op(q, k, v)
    ref_step = op(q[:, :, :1], k[:, :, :1], v[:, :, :1])
    monkeypatch.setattr(blocked, "SCORE_BYTES", 4 * 80 * 4 * 9)
    op = HfQuantizedSdpa(scale=0.2, residual=16, group_size=32)
    got = op(q, k, v)
    assert count_blocks[-1] == 9
    assert _rel(got, ref) <= 1e-5
    assert _rel(op(q[:, :, :1], k[:, :, :1], v[:, :, :1]), ref_step) <= 1e-5


def test_kivi_online_prefill_blocked_equals_one_call(monkeypatch, count_blocks) -> None:
    """KIVI's online softmax (a prefill whose scores exceed ``score_budget``) with its rows in blocks."""
    q, k, v = _qkv(4, 2, 160, 160, d=32)

    def run() -> np.ndarray:
        op = KiviSdpa(scale=0.2, bits=4, key_group=32, value_group=32, residual=32, score_budget=1024)
        return op(q, k, v)
    monkeypatch.setattr(blocked, "SCORE_BYTES", ONE_CALL)
    ref = run()
    assert count_blocks == []  # one call: the online path as it was
    monkeypatch.setattr(blocked, "SCORE_BYTES", 1 << 18)
    got = run()
    assert count_blocks and count_blocks[-1] > 1
    assert _rel(got, ref) <= 1e-5


def test_tract_quantized_sdpa_prefill_blocked_equals_one_call(monkeypatch, count_blocks) -> None:
    """tract's quantized KV op (no causal mask) and the exact softmax beside it (a bool mask)."""
    q, k, v = _qkv(4, 2, 60, 60, d=32)
    keep = np.arange(60)[None, :] <= np.arange(60)[:, None]
    monkeypatch.setattr(blocked, "SCORE_BYTES", ONE_CALL)
    ref, ref_masked = TractQuantizedKvSdpa(scale=0.2)(q, k, v), softmax_attention(q, k, v, 0.2, keep)
    assert count_blocks == []
    monkeypatch.setattr(blocked, "SCORE_BYTES", 4 * 60 * 4 * 8)
    got, got_masked = TractQuantizedKvSdpa(scale=0.2)(q, k, v), softmax_attention(q, k, v, 0.2, keep)
    assert count_blocks == [8, 8]
    assert _rel(got, ref) <= 1e-5 and _rel(got_masked, ref_masked) <= 1e-5


def _peak(fn) -> int:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


MiB = 1 << 20


@pytest.mark.parametrize("path", ["sdpa-causal", "sdpa-mask", "hf", "kivi", "tract-quantized"])
def test_one_attention_at_2048_tokens_stays_under_a_bound(monkeypatch, path) -> None:
    """Peak memory traced during one attention over a 2048-token prefill (4 query heads, 2 kv heads of 64):
    the one-call scores alone are 64 MiB; with the default budget (32 MiB) the peak stays under 48 MiB,
    which the one-call version exceeds."""
    assert blocked.SCORE_BYTES == 32 * MiB
    q, k, v = _qkv(4, 2, 2048, 2048, d=64)
    mask = None
    if path == "sdpa-mask":
        mask = (np.triu(np.ones((2048, 2048), np.float32), 1) * np.float32(-1e9))[None, None]

    def attend() -> None:
        if path.startswith("sdpa"):
            sdpa_array(q, k, v, mask, is_causal=mask is None)
        elif path == "hf":
            HfQuantizedSdpa(scale=0.125)(q, k, v)
        elif path == "tract-quantized":
            TractQuantizedKvSdpa(scale=0.125)(q, k, v)
        else:
            KiviSdpa(scale=0.125)(q, k, v)
    bound = 48 * MiB
    blocked_peak = _peak(attend)
    monkeypatch.setattr(blocked, "SCORE_BYTES", ONE_CALL)
    monkeypatch.setattr(blocked, "CAUSAL_BLOCKS", 1)
    one_call_peak = _peak(attend)
    assert blocked_peak < bound < one_call_peak, (blocked_peak / MiB, one_call_peak / MiB)


def test_plan_attention_at_2048_tokens_stays_under_a_bound(monkeypatch) -> None:
    """The plan's fused attention chain (the explicit-cache form): the peak traced during a 2048-token
    prefill of a one-layer decoder (4 heads of 64), with a 4 MiB score budget. The graph's own causal mask
    (``[1, 1, 2048, 2048]`` f32 and the values it is made from, about 45 MiB) is there in both runs; the
    one-call scores (64 MiB) come on top of it, a block's (4 MiB) stay under the 72 MiB bound."""
    cfg = DecoderConfig(vocab=64, hidden=64, layers=1, heads=4, kv_heads=2, head_dim=64, mlp=96)
    ids = np.random.default_rng(3).integers(0, 64, (1, 2048)).astype(np.int64)

    def prefill_peak() -> int:
        s = Session(build_decoder(cfg))
        sig = detect_signature(s.plan)
        feed = {**sig.empty_caches(), sig.ids_input: ids}
        return _peak(lambda: s.run(feed))
    monkeypatch.setattr(blocked, "SCORE_BYTES", 4 * MiB)
    blocked_peak = prefill_peak()
    monkeypatch.setattr(blocked, "SCORE_BYTES", ONE_CALL)
    monkeypatch.setattr(blocked, "CAUSAL_BLOCKS", 1)
    one_call_peak = prefill_peak()
    assert blocked_peak < 72 * MiB < one_call_peak, (blocked_peak / MiB, one_call_peak / MiB)


def test_plan_blocks_leave_out_only_keys_whose_weight_is_exactly_zero() -> None:
    """The fused chain's blocks leave out the trailing keys of a block only when the mask puts them so far
    below every row's visible keys (against a bound of the scores) that one call weights them exactly 0."""
    q, k, v = _qkv(4, 2, 64, 64)
    smax = blocked.score_bound(q, k, v, np.float32(0.25))
    s = 0.25 * np.einsum("bhqd,bhkd->bhqk", q, np.repeat(k, 2, axis=1))
    assert smax is not None and np.max(np.abs(s)) <= smax
    fut = np.arange(64)[None, :] > np.arange(64)[:, None]
    hard = (fut * np.float32(-1e9)).astype(np.float32)[None, None]
    assert blocked.unseen_from(hard[:, :, 16:32], smax) == 32  # rows 16..31 see keys 0..31
    assert blocked.unseen_from(hard[:, :, 48:64], smax) == 64  # the last rows see every key
    soft = (fut * np.float32(-2 * smax - 50)).astype(np.float32)[None, None]  # exp(-50): small, not 0
    assert blocked.unseen_from(soft[:, :, 16:32], smax) == 64
    inf = np.where(fut, np.float32(-np.inf), np.float32(0))[None, None]
    assert blocked.unseen_from(inf[:, :, 0:8], smax) == 8
    assert blocked.unseen_from(np.full((1, 1, 8, 64), -np.inf, np.float32), smax) == 64  # rows that see nothing
    for bad in ("q", "k", "v"):
        arrays = {"q": q.copy(), "k": k.copy(), "v": v.copy()}
        arrays[bad][0, 0, 5, 3] = np.nan if bad != "v" else np.inf
        assert blocked.score_bound(arrays["q"], arrays["k"], arrays["v"], None) is None
    big = blocked.score_bound(q * np.float32(1e18), k, v, None)  # scores beyond what a -1e9 mask hides
    assert big is None or blocked.unseen_from(hard[:, :, 16:32], big) == 64
