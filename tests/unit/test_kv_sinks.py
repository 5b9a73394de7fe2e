"""GPT-OSS's attention sinks in the KIVI, ggml and HF ops (``sink_logits``: one learned logit per query head, a
softmax column no value reads): every KIVI attention path (two-pass, online, stepwise, the dequantized variant, a
sliding window) equals the reference softmax over ``[scores | sink]`` when every token is in full precision, and
the sinks add no error of their own on quantized codes; ggml with f32 rows is that reference, the HF op is it
over what HF's layer returns; a wrong count fails naming the op."""
from __future__ import annotations

import numpy as np
import pytest

from nnef_kv.errors import GraphError
from nnef_kv.kv.ggml_sdpa import GgmlSdpa
from nnef_kv.kv.hf_quantized import HfQuantizedSdpa
from nnef_kv.kv.kivi import KiviSdpa

B, HQ, HKV, D, T, PROMPT = 1, 4, 2, 32, 40, 8
SINKS = (np.random.default_rng(5).standard_normal(HQ) * 2).astype(np.float32)
PATHS = {"two-pass": {}, "online": dict(score_budget=1), "variant": dict(key_bits=8, value_bits=8, key_axis="token"),
         "window": dict(window=8)}


def _reference(q, k, v, sinks, window=0):
    """softmax([q.K^T / sqrt(D) masked | sink]) without its last column, times V (f64)."""
    g = HQ // HKV
    kr, vr = np.repeat(k, g, 1).astype(np.float64), np.repeat(v, g, 1).astype(np.float64)
    s = q.astype(np.float64) @ kr.swapaxes(-1, -2) / np.sqrt(D)
    qp, kp = k.shape[2] - q.shape[2] + np.arange(q.shape[2]), np.arange(k.shape[2])
    keep = (kp[None] <= qp[:, None]) & ((kp[None] > qp[:, None] - window) if window else True)
    s = np.where(keep, s, -np.inf)
    col = np.broadcast_to(np.asarray(sinks, np.float64)[None, :, None, None], s.shape[:3] + (1,))
    c = np.concatenate([s, col], -1)
    p = np.exp(c - c.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True))[..., :-1] @ vr


def _data(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((B, h, T, D)).astype(np.float32) for h in (HQ, HKV, HKV)]


def _run(st, q, k, v, stepwise):
    outs = [st(q[:, :, :PROMPT], k[:, :, :PROMPT], v[:, :, :PROMPT])]
    if stepwise:
        outs.append(st.stepwise(q[:, :, PROMPT:], k[:, :, PROMPT:], v[:, :, PROMPT:]))
    else:
        outs += [st(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1]) for t in range(PROMPT, T)]
    return np.concatenate(outs, 2)


def _want(q, k, v, sinks, window=0):
    calls = [(0, PROMPT)] + [(t, t + 1) for t in range(PROMPT, T)]
    return np.concatenate([_reference(q[:, :, a:b], k[:, :, :b], v[:, :, :b], sinks, window) for a, b in calls], 2)


@pytest.mark.parametrize("stepwise", [False, True], ids=["calls", "stepwise"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_full_precision_equals_the_sink_column_softmax(path, stepwise) -> None:
    q, k, v = _data()
    kw = PATHS[path]
    st = KiviSdpa(scale=1 / np.sqrt(D), bits=8, key_group=4, value_group=32, residual=64, sink_logits=SINKS, **kw)
    got = _run(st, q, k, v, stepwise)
    want = _want(q, k, v, SINKS, kw.get("window", 0))
    assert np.abs(got - want).max() <= 1e-5
    assert np.abs(_want(q, k, v, SINKS - 1e9, kw.get("window", 0)) - want).max() > 0.1  # the sinks matter


@pytest.mark.parametrize("path", sorted(PATHS))
def test_on_quantized_codes_the_sinks_add_no_error(path) -> None:
    """8-bit codes for every token: the error against the exact attention is no larger with the sinks than
    without (the sink column is exact; it only rescales)."""
    q, k, v = _data(1)
    kw = PATHS[path]
    errs = []
    for sinks in (SINKS, ()):
        st = KiviSdpa(scale=1 / np.sqrt(D), bits=8, key_group=4, value_group=32, residual=0, sink_logits=sinks, **kw)
        got = _run(st, q, k, v, False)
        ref_sinks = SINKS if len(sinks) else np.full(HQ, -1e9, np.float32)
        errs.append(float(np.abs(got - _want(q, k, v, ref_sinks, kw.get("window", 0))).max()))
    assert 0 < errs[0] <= 1.5 * errs[1], errs


def test_the_decode_kernels_are_not_used_with_sinks(monkeypatch) -> None:
    import nnef_kv.kv.kivi.kernels as ka

    monkeypatch.setattr(ka, "decode_attention_rows", lambda *a, **k: pytest.fail("kernel used with sink logits"))
    q, k, v = _data()
    st = KiviSdpa(scale=1 / np.sqrt(D), bits=8, key_group=4, value_group=32, residual=0, sink_logits=SINKS)
    _run(st, q, k, v, False)


def test_a_count_other_than_the_query_heads_is_refused() -> None:
    q, k, v = _data()
    for st in (KiviSdpa(scale=0.2, bits=8, key_group=4, value_group=32, residual=0, sink_logits=SINKS[:3]),
               GgmlSdpa(scale=0.2, sink_logits=SINKS[:3]), HfQuantizedSdpa(scale=0.2, sink_logits=SINKS[:3])):
        with pytest.raises(GraphError, match=f"{st.WHO}: sink_logits holds 3 logits, q has 4 heads"):
            st(q[:, :, :2], k[:, :, :2], v[:, :, :2])
    for cls in (KiviSdpa, GgmlSdpa, HfQuantizedSdpa):
        with pytest.raises(GraphError, match="sink_logits must be finite"):
            cls(sink_logits=[float("nan")] * 4)


@pytest.mark.parametrize("stepwise", [False, True], ids=["calls", "stepwise"])
@pytest.mark.parametrize("kw", [{}, dict(window=8), dict(residual=4, block_tokens=8)],
                         ids=["plain", "window", "blocks"])
def test_ggml_with_f32_rows_is_the_sink_column_softmax(kw, stepwise) -> None:
    q, k, v = _data(2)
    st = GgmlSdpa(scale=1 / np.sqrt(D), key_type="f32", value_type="f32", sink_logits=SINKS, **kw)
    got = _run(st, q, k, v, stepwise)
    assert np.abs(got - _want(q, k, v, SINKS, kw.get("window", 0))).max() <= 1e-5


@pytest.mark.parametrize("kw", [dict(backend="hqq", bits=8, group_size=32, residual=4), dict(bits=4, residual=8),
                                dict(backend="hqq", bits=4, group_size=32, residual=4, window=8)],
                         ids=["hqq8", "quanto4", "hqq4-window"])
def test_hf_is_the_sink_column_softmax_over_what_its_layer_returns(kw) -> None:
    q, k, v = _data(3)
    st = HfQuantizedSdpa(scale=1 / np.sqrt(D), sink_logits=SINKS, **kw)
    st(q[:, :, :PROMPT], k[:, :, :PROMPT], v[:, :, :PROMPT])
    for t in range(PROMPT, T):
        kr, vr = st.returned_kv(k[:, :, t:t + 1], v[:, :, t:t + 1])
        got = st(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1])
        # with a window the layer returns a suffix of the positions (what a later query still sees): the
        # window counts back from its last one
        want = _reference(q[:, :, t:t + 1], kr, vr, SINKS, kw.get("window", 0))
        assert np.abs(got - want).max() <= 1e-5, t
