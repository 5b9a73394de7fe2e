"""``reads_quantized`` of the llama.cpp (ggml) and Hugging Face ops, against brute-force counts.

ggml: for each query row, the output the op gave is matched against exact attention over the history
with its first ``c`` tokens read through the cache type (and the rest exact), for every ``c``: the ``c``
that reproduces the row is the count of quantized entries it read. HF: replayed one-token calls, the
number of leading positions of what the layer returns (``returned_kv``) that differ from the exact
history (the dequantized store) for each call."""
from __future__ import annotations

import numpy as np
import pytest

from nnef_kv.kv import GgmlSdpa, HfQuantizedSdpa, ggml


def _stored(x: np.ndarray, t: str) -> np.ndarray:
    if t == "f32":
        return x.astype(np.float32)
    if t == "f16":
        return x.astype(np.float16).astype(np.float32)
    return ggml.dequantize(ggml.quantize(x, t))


def _attend_row(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """q [Hq, D] over k, v [Hkv, T, D] (GQA), exact, f64."""
    hq, hkv = q.shape[0], k.shape[0]
    g = hq // hkv
    out = np.empty(q.shape)
    for h in range(hq):
        s = k[h // g].astype(np.float64) @ q[h].astype(np.float64) * scale
        p = np.exp(s - s.max())
        out[h] = p @ v[h // g] / p.sum()
    return out


def _brute_counts(out, q, k, v, first, kt, vt, scale, causal=True):
    """Per query row ``i`` of ``out`` [1, Hq, S, D] (positions ``first + i``): the ``c`` whose reading
    (first ``c`` tokens dequantized) reproduces it best, or -1 when two readings are as close (one token
    seen: every key gives the same output)."""
    kd, vd = _stored(k, kt)[0], _stored(v, vt)[0]
    k0, v0 = k[0].astype(np.float32), v[0].astype(np.float32)
    total = k.shape[2]
    got = []
    for i in range(out.shape[2]):
        p = first + i
        end = p + 1 if causal else total
        errs = []
        for c in range(end + 1):
            kk = np.concatenate([kd[:, :c], k0[:, c:end]], axis=1)
            vv = np.concatenate([vd[:, :c], v0[:, c:end]], axis=1)
            errs.append(np.abs(_attend_row(q[0, :, i], kk, vv, scale) - out[0, :, i]).max())
        errs = np.array(errs)
        best = int(np.argmin(errs))
        assert errs[best] < 1e-4, (i, errs[best])
        got.append(best if np.sort(errs)[1] > 10 * errs[best] else -1)
    return np.array(got)


def _agree(brute: np.ndarray, want: np.ndarray) -> bool:
    sure = brute >= 0
    return sure.mean() >= 0.75 and np.array_equal(brute[sure], np.asarray(want)[sure])


@pytest.mark.parametrize("kt,vt,residual", [("q4_0", "q8_0", 0), ("q5_1", "q4_1", 0), ("q4_0", "q4_0", 5),
                                            ("q8_0", "iq4_nl", 3)])
def test_ggml_reads_quantized_matches_a_brute_force_count(kt, vt, residual):
    rng = np.random.default_rng(3)
    hq, hkv, d, n0, n1 = 4, 2, 32, 7, 9
    q = rng.standard_normal((1, hq, n0 + n1, d)).astype(np.float32)
    k = (rng.standard_normal((1, hkv, n0 + n1, d)) * 2).astype(np.float32)
    v = rng.standard_normal((1, hkv, n0 + n1, d)).astype(np.float32)
    op = GgmlSdpa(scale=0.3, key_type=kt, value_type=vt, residual=residual)
    want0 = op.reads_quantized(n0, stepwise=False)
    out0 = op(q[:, :, :n0], k[:, :, :n0], v[:, :, :n0])
    # a call reads the window and its own tokens exactly (residual > 0): the brute force sees that
    assert _agree(_brute_counts(out0, q[:, :, :n0], k[:, :, :n0], v[:, :, :n0], 0, kt, vt, 0.3), want0)
    want1 = op.reads_quantized(n1, stepwise=True)
    out1 = op.stepwise(q[:, :, n0:], k[:, :, n0:], v[:, :, n0:])
    assert _agree(_brute_counts(out1, q[:, :, n0:], k, v, n0, kt, vt, 0.3), want1)
    # one call after a history: every row reads the tokens stored before it (window on) or all it sees
    more = 4
    qm = rng.standard_normal((1, hq, more, d)).astype(np.float32)
    km = (rng.standard_normal((1, hkv, more, d)) * 2).astype(np.float32)
    vm = rng.standard_normal((1, hkv, more, d)).astype(np.float32)
    want2 = op.reads_quantized(more, stepwise=False)
    out2 = op(qm, km, vm)
    kall, vall = np.concatenate([k, km], 2), np.concatenate([v, vm], 2)
    assert _agree(_brute_counts(out2, qm, kall, vall, n0 + n1, kt, vt, 0.3), want2)
    if residual:
        assert want2.tolist() == [n0 + n1 - residual] * more
    else:
        assert want2.tolist() == list(range(n0 + n1 + 1, n0 + n1 + more + 1))


def test_ggml_non_causal_call_reads_every_token():
    op = GgmlSdpa(key_type="q8_0", value_type="q8_0", is_causal=False)
    assert op.reads_quantized(3, stepwise=False).tolist() == [3, 3, 3]
    assert op.reads_quantized(3, stepwise=True).tolist() == [1, 2, 3]  # a one-token call sees the past only


def _hf_brute(op: HfQuantizedSdpa, k: np.ndarray, v: np.ndarray) -> list[int]:
    """One-token calls: how many leading positions of the returned K differ from the exact history."""
    got, hist = [], []
    for i in range(k.shape[2]):
        kr, _ = op.returned_kv(k[:, :, i:i + 1], v[:, :, i:i + 1])
        hist.append(k[:, :, i:i + 1])
        exact = np.concatenate(hist, axis=2)
        diff = np.nonzero(np.any(kr != exact, axis=(0, 1, 3)))[0]
        got.append(int(diff[-1]) + 1 if diff.size else 0)
        q = np.zeros((1, k.shape[1], 1, k.shape[3]), np.float32)
        op(q, k[:, :, i:i + 1], v[:, :, i:i + 1])
    return got


@pytest.mark.parametrize("backend,bits,residual,prefill", [("quanto", 4, 5, 6), ("quanto", 2, 1, 4), ("hqq", 4, 4, 0),
                                                           ("quanto", 4, 3, 0), ("hqq", 2, 0, 8)])
def test_hf_reads_quantized_matches_a_replay(backend, bits, residual, prefill):
    rng = np.random.default_rng(7)
    hkv, d, n = 2, 16, 13
    k = rng.standard_normal((1, hkv, prefill + n, d)).astype(np.float32)
    v = rng.standard_normal((1, hkv, prefill + n, d)).astype(np.float32)
    kw = dict(bits=bits, group_size=16, residual=residual, backend=backend, axis_key=0, axis_value=0)
    op, twin = HfQuantizedSdpa(**kw), HfQuantizedSdpa(**kw)
    q = np.zeros((1, hkv, prefill, d), np.float32)
    if prefill:
        assert op.reads_quantized(prefill, stepwise=False).tolist() == [0] * prefill
        op(q, k[:, :, :prefill], v[:, :, :prefill])
        twin(q, k[:, :, :prefill], v[:, :, :prefill])
    want = op.reads_quantized(n, stepwise=True)
    brute = _hf_brute(twin, k, v) if not prefill else None
    if prefill:  # the twin already holds the prefill: replay the rest, the history includes it
        got, hist = [], [k[:, :, :prefill]]
        for i in range(prefill, prefill + n):
            kr, _ = twin.returned_kv(k[:, :, i:i + 1], v[:, :, i:i + 1])
            hist.append(k[:, :, i:i + 1])
            diff = np.nonzero(np.any(kr != np.concatenate(hist, 2), axis=(0, 1, 3)))[0]
            got.append(int(diff[-1]) + 1 if diff.size else 0)
            twin(np.zeros((1, hkv, 1, d), np.float32), k[:, :, i:i + 1], v[:, :, i:i + 1])
        brute = got
    assert want.tolist() == brute
    # the op's own stepwise run leaves the same state as the replay
    qq = np.zeros((1, hkv, n, d), np.float32)
    op.stepwise(qq, k[:, :, prefill:], v[:, :, prefill:])
    assert op.n_quant == twin.n_quant and op.len == twin.len
    # and in one call every row reads the whole store
    assert op.reads_quantized(3, stepwise=False).tolist() == [op.n_quant] * 3
