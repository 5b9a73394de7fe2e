"""Sliding windows in the attention ops nnef-kv owns (``window`` on nnef_kv_kivi_sdpa, nnef_kv_ggml_sdpa,
nnef_kv_hf_quantized_sdpa): a query at position p sees the keys in (p - W, p]; tokens no later query sees are
dropped, so the state stays bounded; one-token calls, stepwise runs, chunked calls, checkpoints and saved
states agree."""
from __future__ import annotations

import numpy as np
import pytest

from nnef_kv.errors import GraphError, StateError
from nnef_kv.kv.common import causal_keep, evict_page, evicted_tokens
from nnef_kv.kv.ggml_sdpa import GgmlSdpa
from nnef_kv.kv.hf_quantized import HfQuantizedSdpa
from nnef_kv.kv.kivi import KiviSdpa

W = 24
SCALE = 0.2
#: one setting of each op and its variants (the constructor, its keyword arguments)
OPS = {
    "kivi8": (KiviSdpa, dict(bits=8)),
    "kivi4": (KiviSdpa, dict(bits=4, key_group=16, residual=8)),
    "kivi_variant": (KiviSdpa, dict(bits=4, value_bits=2, residual=0, key_group=8)),
    "kivi_token_keys": (KiviSdpa, dict(bits=4, key_axis="token", key_group=8, residual=4)),
    "kivi_rotated": (KiviSdpa, dict(bits=4, rotate="kv", key_group=8, residual=4)),
    "ggml_f32": (GgmlSdpa, dict(key_type="f32", value_type="f32")),
    "ggml_q4_0": (GgmlSdpa, dict(key_type="q4_0", value_type="q8_0", residual=5)),
    "ggml_rotate": (GgmlSdpa, dict(key_type="q4_0", value_type="q4_0", rotate=True)),
    "hf_quanto": (HfQuantizedSdpa, dict(bits=4, group_size=32, residual=6)),
    "hf_hqq": (HfQuantizedSdpa, dict(backend="hqq", bits=8, group_size=32, residual=1)),
}


def _make(name: str, **extra) -> object:
    cls, kw = OPS[name]
    return cls(scale=SCALE, window=W, **kw, **extra)


def _qkv(t: int, d: int = 64, seed: int = 0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((1, 4, t, d)).astype(np.float32), rng.standard_normal((1, 2, t, d)).astype(np.float32),
            rng.standard_normal((1, 2, t, d)).astype(np.float32))


def _windowed(q, k, v, window: int = W) -> np.ndarray:
    """Exact attention of q's rows (the last of k's positions) over k, v with the sliding window."""
    g = q.shape[1] // k.shape[1]
    kk, vv = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    t, sq = k.shape[2], q.shape[2]
    s = np.einsum("bhqd,bhtd->bhqt", q.astype(np.float64), kk) * SCALE
    p = (t - sq) + np.arange(sq)[:, None]
    j = np.arange(t)[None, :]
    s = np.where((j <= p) & (j > p - window), s, -np.inf)
    e = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhqt,bhtd->bhqd", e / e.sum(-1, keepdims=True), vv)


def _calls(op, q, k, v, step: int = 1) -> np.ndarray:
    t = k.shape[2]
    return np.concatenate([op(q[:, :, a:a + step], k[:, :, a:a + step], v[:, :, a:a + step])
                           for a in range(0, t, step)], axis=2)


def _held(op) -> int:
    nb = op.nbytes()
    return nb["codes"] + nb["params"] + nb["full_precision"]


# -- the pieces ----------------------------------------------------------------------------------
def test_the_window_mask() -> None:
    keep = causal_keep(10, 3, 3, True, window=4)
    want = np.array([[j <= p and j > p - 4 for j in range(10)] for p in (7, 8, 9)])
    assert np.array_equal(keep, want)
    assert causal_keep(4, 1, 1, True, window=4) is None  # the only query sees every position
    assert causal_keep(5, 1, 1, True, window=4).tolist() == [[False, True, True, True, True]]


def test_eviction_is_a_function_of_the_counts() -> None:
    assert evict_page(24) == 64 and evict_page(4096) == 256 and evict_page(24, 48) == 96
    assert evicted_tokens(63, 200, 64) == 0 and evicted_tokens(64, 200, 64) == 64
    assert evicted_tokens(500, 130, 64) == 128  # never more than the store holds, whole pages


@pytest.mark.parametrize("cls", [KiviSdpa, GgmlSdpa, HfQuantizedSdpa])
def test_bad_windows_are_refused(cls) -> None:
    with pytest.raises(GraphError, match="window must be >= 0"):
        cls(window=-1)
    with pytest.raises(GraphError, match="needs is_causal"):
        cls(window=8, is_causal=False)


def test_kivi_sinks_and_a_window_are_refused() -> None:
    with pytest.raises(GraphError, match="no sinks"):
        KiviSdpa(window=8, sinks=4)


# -- the ops ---------------------------------------------------------------------------------------
def test_ggml_f32_with_a_window_is_exact_windowed_attention() -> None:
    q, k, v = _qkv(300)
    want = np.concatenate([_windowed(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1]) for t in range(300)], 2)
    for step in (1, 37):
        op = _make("ggml_f32")
        np.testing.assert_allclose(_calls(op, q, k, v, step), want, atol=2e-6)
        assert op.evicted > 0
    got = _make("ggml_f32").stepwise(q, k, v)
    np.testing.assert_allclose(got, want, atol=2e-6)


@pytest.mark.parametrize("name", [n for n in OPS if n.startswith("kivi") and "rotated" not in n])
def test_each_kivi_step_reads_its_window_of_the_cache_it_holds(name: str) -> None:
    """The oracle: exact windowed attention over what the op holds (``dequantized()``: the tokens after the
    evicted ones, as the attention reads them) and the call's own token."""
    q, k, v = _qkv(200, seed=1)
    op = _make(name)
    worst = 0.0
    for t in range(200):
        if op.len:
            kd, vd = op.dequantized()
            kk = np.concatenate([kd, k[:, :, t:t + 1]], axis=2)
            vv = np.concatenate([vd, v[:, :, t:t + 1]], axis=2)
            want = _windowed(q[:, :, t:t + 1], kk, vv)
        got = op(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1])
        if t:
            worst = max(worst, float(np.abs(got - want).max()))
        assert op.len - op.evicted <= W + evict_page(W, op.cfg.key_group) + op.cfg.residual + op.cfg.key_group
    assert worst < 2e-5 and op.evicted > 0


@pytest.mark.parametrize("name", [n for n in OPS if n.startswith("hf")])
def test_each_hf_step_reads_its_window_of_what_the_layer_returns(name: str) -> None:
    q, k, v = _qkv(200, seed=2)
    op = _make(name)
    worst = 0.0
    for t in range(200):
        if op.len:
            kr, vr = op.returned_kv(k[:, :, t:t + 1], v[:, :, t:t + 1])
            want = _windowed(q[:, :, t:t + 1], kr, vr)
        got = op(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1])
        if t:
            worst = max(worst, float(np.abs(got - want).max()))
    assert worst < 2e-5 and op.evicted > 0 and op.n_quant < W + op.cfg.residual


@pytest.mark.parametrize("name", sorted(OPS))
def test_stepwise_equals_one_token_calls_and_leaves_their_state(name: str) -> None:
    q, k, v = _qkv(230, seed=3)
    one, step = _make(name), _make(name)
    want = _calls(one, q, k, v)
    got = np.concatenate([step.stepwise(q[:, :, a:a + 41], k[:, :, a:a + 41], v[:, :, a:a + 41])
                          for a in range(0, 230, 41)], axis=2)
    np.testing.assert_allclose(got, want, atol=5e-6)
    assert (step.len, step.evicted, step.n_quant, step.n_res) == (one.len, one.evicted, one.n_quant, one.n_res)
    x = _qkv(1, seed=4)
    np.testing.assert_allclose(step(*x), one(*x), atol=5e-6)


@pytest.mark.parametrize("name", sorted(OPS))
def test_a_chunked_call_sees_its_own_tokens_through_the_window(name: str) -> None:
    """A prefill longer than the window: each row sees only the last W positions (its own tokens in full
    precision, as a call reads them), so it is the exact windowed attention where the cache types are exact
    and close to it otherwise; the state is bounded afterwards."""
    q, k, v = _qkv(150, seed=5)
    op = _make(name)
    got = op(q, k, v)
    want = _windowed(q, k, v)
    tol = 2e-6 if name in ("ggml_f32",) or name.startswith(("kivi", "hf")) else 0.5
    np.testing.assert_allclose(got, want, atol=tol)
    assert op.evicted > 0


def test_kivi_online_softmax_keeps_the_window() -> None:
    q, k, v = _qkv(180, seed=6)
    a, b = _make("kivi4"), _make("kivi4", score_budget=256)  # b: the online path for every chunk
    for s0 in range(0, 180, 30):
        sl = slice(s0, s0 + 30)
        np.testing.assert_allclose(b(q[:, :, sl], k[:, :, sl], v[:, :, sl]), a(q[:, :, sl], k[:, :, sl], v[:, :, sl]),
                                   atol=5e-6)


@pytest.mark.parametrize("name", sorted(OPS))
def test_bytes_held_stop_growing_past_the_window(name: str) -> None:
    q, k, v = _qkv(600, seed=7)
    op = _make(name)
    held = []
    for t in range(600):
        op(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1])
        held.append(_held(op))
    assert max(held[300:]) <= max(held[:300])  # a page (64 tokens) + the window are held from ~100 tokens on
    unbounded = OPS[name][0](scale=SCALE, **OPS[name][1])
    _calls(unbounded, q, k, v)
    assert _held(unbounded) > 2 * max(held[300:])  # without the window: all 600 tokens


@pytest.mark.parametrize("name", sorted(OPS))
def test_rollback_undoes_an_eviction(name: str) -> None:
    q, k, v = _qkv(160, seed=8)
    op = _make(name)
    _calls(op, q[:, :, :80], k[:, :, :80], v[:, :, :80])
    mark, ev0 = op.checkpoint(), op.evicted
    first = _calls(op, q[:, :, 80:], k[:, :, 80:], v[:, :, 80:])
    assert op.evicted > ev0
    op.rollback(mark)
    assert op.evicted == ev0 and op.len == 80
    np.testing.assert_array_equal(_calls(op, q[:, :, 80:], k[:, :, 80:], v[:, :, 80:]), first)


@pytest.mark.parametrize("name", sorted(OPS))
def test_a_saved_windowed_state_continues_bit_identically(name: str) -> None:
    q, k, v = _qkv(170, seed=9)
    op = _make(name)
    _calls(op, q[:, :, :130], k[:, :, :130], v[:, :, :130])
    assert op.evicted > 0
    saved = op.state_tensors()
    back = _make(name)
    back.load_state_tensors(saved)
    assert (back.len, back.evicted) == (op.len, op.evicted)
    np.testing.assert_array_equal(_calls(back, q[:, :, 130:], k[:, :, 130:], v[:, :, 130:]),
                                  _calls(op, q[:, :, 130:], k[:, :, 130:], v[:, :, 130:]))
    with pytest.raises(StateError):  # a state saved without its window does not load into a windowed node
        plain = OPS[name][0](scale=SCALE, **OPS[name][1])
        plain.load_state_tensors(saved)


def test_a_state_holding_evicted_tokens_is_refused() -> None:
    q, k, v = _qkv(130, seed=10)
    op = _make("ggml_q4_0")
    _calls(op, q, k, v)
    saved = op.state_tensors()
    saved["k_cache"] = np.concatenate([saved["k_cache"][:, :1], saved["k_cache"]], axis=1)
    saved["v_cache"] = np.concatenate([saved["v_cache"][:, :1], saved["v_cache"]], axis=1)
    with pytest.raises(StateError, match="sliding window of 24 holds"):
        _make("ggml_q4_0").load_state_tensors(saved)


def test_reads_quantized_counts_only_the_window() -> None:
    op = _make("ggml_q4_0")
    _calls(op, *_qkv(100, seed=11))
    assert op.reads_quantized(3).tolist() == [W - 1 - 5] * 3  # (p - W, p] less the 5 newest, kept exact
    kivi = _make("kivi4")
    _calls(kivi, *_qkv(100, seed=11))
    counts = kivi.reads_quantized(40)
    assert counts.max() <= W and counts.min() >= 0
    hf = _make("hf_quanto")
    _calls(hf, *_qkv(100, seed=11))
    assert hf.reads_quantized(10).max() <= W
