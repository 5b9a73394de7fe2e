"""Golden data for ``nnef_kv_hf_quantized_sdpa``: the real Hugging Face ``QuantizedCache`` driven with seeded K/V.

Runs outside the project's venv, in one with torch, transformers 5.x and the backends::

    python3 -m venv /work/hf-venv
    /work/hf-venv/bin/pip install torch transformers==5.23.0 optimum-quanto hqq numpy
    /work/hf-venv/bin/python tools/make_hf_cache_golden.py [tests/fixtures/hf_quantized_cache_golden.npz]

For each case a one-layer ``QuantizedCache(backend, LlamaConfig(...), nbits, axis_key, axis_value,
q_group_size, residual_length)`` gets a prefill and then decode calls (one token, and a few
multi-token calls) crossing two or more flushes of the residual window. Per call it records what
``cache.update`` returns (the K/V the layer hands to attention) as an exact digest of its bits, the
whole returned K/V of the last call, and the attention output: exact softmax in torch float32,
``softmax(scale * q k^T)`` with a bottom-right causal mask for multi-token calls, GQA by
``repeat_interleave`` (query head h reads kv head h // (Hq / Hkv)).

Stored per case ``<name>/...``: ``config`` (bits, group_size, residual, axis_key, axis_value,
backend 0 quanto / 1 hqq, f16), ``scale``, ``lens`` (tokens per call), ``q``, ``k``, ``v`` (the
calls' inputs concatenated along the token axis), ``out`` (attention outputs, likewise), ``digest_k``,
``digest_v`` (uint64 per call, :func:`digest`), ``last_k``, ``last_v`` (the last call's returned K/V).
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "hf_quantized_cache_golden.npz"


def digest(a: np.ndarray) -> np.uint64:
    """Exact fingerprint of an array's bits: ``sum_i (i + 1) * bits_i`` mod 2**64 over the raw (u16 or
    u32) words, plus the shape; every NaN counted as one canonical NaN (signs and payloads of NaNs
    depend on which operation made them)."""
    a = np.ascontiguousarray(np.where(np.isnan(a), np.array(np.nan, a.dtype), a))
    w = a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32).ravel().astype(np.uint64)
    with np.errstate(over="ignore"):
        s = np.sum(w * (np.arange(w.size, dtype=np.uint64) + np.uint64(1)), dtype=np.uint64)
        for i, n in enumerate(a.shape):
            s = s + np.uint64(n) * np.uint64(1000003 ** (i + 1) % (1 << 63))
    return np.uint64(s)


CASES = [
    # name, backend, bits, group, residual, axis_key, axis_value, D, prefill, calls, f16, nan
    # D = 32 < group 64: a quanto axis-0 group is two tokens of one head, and straddles heads when T is odd
    ("quanto_a0", "quanto", 4, 64, 16, 0, 0, 32, 21, [1] * 20 + [5] + [1] * 20, False, False),
    # KIVI-like: keys per channel over 32 consecutive (B, H, T) rows, values per token; B*H*T % 32 == 0 at flushes
    ("quanto_k-1_v0_2bit", "quanto", 2, 32, 16, -1, 0, 32, 32, [1] * 32 + [16], False, False),
    ("quanto_a-1", "quanto", 4, 32, 16, -1, -1, 16, 16, [1] * 34, False, False),
    ("quanto_f16", "quanto", 4, 64, 12, 0, 0, 32, 30, [1] * 26 + [3], True, False),
    ("quanto_nan", "quanto", 4, 64, 8, 0, 0, 32, 20, [1] * 20, False, True),
    ("hqq_a0", "hqq", 4, 64, 16, 0, 0, 32, 20, [1] * 34 + [4], False, False),
    ("hqq_a1_2bit", "hqq", 2, 64, 16, 1, 1, 32, 20, [1] * 32, False, False),
]


def causal_attention(torch, q, k, v, scale):
    hq, hkv = q.shape[1], k.shape[1]
    k = k.float().repeat_interleave(hq // hkv, dim=1)
    v = v.float().repeat_interleave(hq // hkv, dim=1)
    s = torch.matmul(q.float(), k.transpose(-1, -2)) * scale
    sq, t = q.shape[2], k.shape[2]
    if sq > 1:
        keep = torch.arange(t)[None, :] <= (t - sq + torch.arange(sq))[:, None]
        s = s.masked_fill(~keep, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v)


def run_case(torch, case, seed):
    from transformers import LlamaConfig
    from transformers.cache_utils import QuantizedCache

    _, backend, bits, group, residual, ak, av, d, prefill, calls, f16, nan = case
    hkv, hq = 2, 4
    cfg = LlamaConfig(num_hidden_layers=1, num_attention_heads=hq, num_key_value_heads=hkv, hidden_size=hq * d,
                      head_dim=d, intermediate_size=16, vocab_size=16)
    cache = QuantizedCache(backend=backend, config=cfg, nbits=bits, axis_key=ak, axis_value=av, q_group_size=group,
                           residual_length=residual)
    gen = torch.Generator().manual_seed(seed)
    dt = torch.float16 if f16 else torch.float32
    scale = float(1.0 / np.sqrt(d))
    lens = [prefill] + list(calls)
    chan = torch.rand(1, 1, 1, d, generator=gen) * 3 + 0.25  # per-channel key ranges, as real keys have
    qs, ks, vs, outs, dks, dvs = [], [], [], [], [], []
    last = None
    for i, s in enumerate(lens):
        q = torch.randn(1, hq, s, d, generator=gen)
        k = (torch.randn(1, hkv, s, d, generator=gen) * chan).to(dt)
        v = torch.randn(1, hkv, s, d, generator=gen).to(dt)
        if nan and i in (3, 12):  # a NaN key and an Inf value in decode steps
            k[0, 0, 0, 5] = float("nan")
            v[0, 1, 0, 7] = float("inf")
        kr, vr = cache.update(k, v, layer_idx=0)
        out = causal_attention(torch, q, kr, vr, scale)
        qs.append(q.numpy())
        ks.append(k.numpy())
        vs.append(v.numpy())
        outs.append(out.numpy())
        dks.append(digest(kr.numpy()))
        dvs.append(digest(vr.numpy()))
        last = (kr.numpy().copy(), vr.numpy().copy())
    return {
        "config": np.array([bits, group, residual, ak, av, 0 if backend == "quanto" else 1, int(f16)], np.int64),
        "scale": np.float64(scale), "lens": np.array(lens, np.int64),
        "q": np.concatenate(qs, 2), "k": np.concatenate(ks, 2), "v": np.concatenate(vs, 2),
        "out": np.concatenate(outs, 2), "digest_k": np.array(dks, np.uint64), "digest_v": np.array(dvs, np.uint64),
        "last_k": last[0], "last_v": last[1],
    }


def main(argv: list[str]) -> None:
    import torch
    import transformers

    warnings.filterwarnings("ignore")
    out_path = Path(argv[1]) if len(argv) > 1 else OUT
    data = {}
    versions = [f"torch {torch.__version__}", f"transformers {transformers.__version__}"]
    for mod in ("optimum.quanto", "hqq"):
        try:
            m = __import__(mod, fromlist=["__version__"])
            versions.append(f"{mod} {getattr(m, '__version__', '?')}")
        except ImportError:
            versions.append(f"{mod} missing")
    for i, case in enumerate(CASES):
        try:
            res = run_case(torch, case, 1000 + i)
        except ImportError as e:
            print(f"skip {case[0]}: {e}")
            continue
        for key, val in res.items():
            data[f"{case[0]}/{key}"] = val
        print(f"{case[0]}: {len(res['lens'])} calls, {res['k'].shape[2]} tokens")
    data["versions"] = np.array(versions)
    np.savez_compressed(out_path, **data)
    print(f"wrote {out_path} ({out_path.stat().st_size} bytes): {', '.join(versions)}")


if __name__ == "__main__":
    main(sys.argv)
