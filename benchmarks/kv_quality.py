"""Attention-output deviation of the quantized KV caches from exact f32 attention.

Protocol: causal decode, a prompt of 32 tokens then one token a step; at every step the op's output
is compared with exact f32 causal attention over the true K/V. Figure: the aggregate relative L2
deviation ``sqrt(sum ||out - ref||^2 / sum ||ref||^2)`` over the decode steps (the prompt step
excluded: it is exact for every KIVI variant, since the residual window holds the whole prompt, and
tract's fused op is not causal there). Data:

* ``gaussian``: 1024 tokens, B=1, 8 query heads, 2 kv heads, D=64, K with outlier channels
  (4 channels x10 scale and offset), V Gaussian, Q Gaussian;
* ``minilm``: the real all-MiniLM-L6-v2 Q/K/V of ``shared/fixtures/activations`` (6 layers x 12
  heads x 128 tokens, D=32), each layer's 12 heads decoded at once, aggregated over all layers/heads.

Ops: the KIVI op (key_group 32, value_group 32, residual 32, f16 params) at 8/4/3/2 bits and its
options (f32 params, clip, rotate), tract's fused ``quantized_kv_sdpa`` and tract's
``quantized_dyn_kv_cache`` (8 and 4 bits, K per channel, V per token) followed by exact attention;
and (issue 15) llama.cpp's cache types (``nnef_kv_ggml_sdpa``: q8_0, q5_1, q5_0, q4_1, q4_0, K and V
apart), Hugging Face's ``QuantizedCache`` (``nnef_kv_hf_quantized_sdpa``, quanto 4 and 2 bits with HF's
defaults: q_group_size 64, residual_length 128; and HQQ 4-bit), the KIVI variants (keys and values of
their own widths, per-token keys, no window). Each row also gives its **all-in bits per value**: every
byte the op holds at the end of the decode (codes, params, full-precision window and side tables,
allocated capacity included) x 8 / the values cached -- compare rows at equal all-in bits.

Run: ``python benchmarks/kv_quality.py`` (about a minute; ``--quick`` for the MiniLM half only);
``python benchmarks/kv_quality.py --ideas`` runs a fake-quantization study of options the op does
not have (non-uniform levels, per-channel values, query-aware key rounding).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nnef_kv.kv import (GgmlSdpa, HfQuantizedSdpa, KiviSdpa, TractQuantizedDynKvCache,  # noqa: E402
                        TractQuantizedKvSdpa, softmax_attention)

ACTIVATIONS = ROOT.parent / "shared" / "fixtures" / "activations" / "minilm_qkv_apache2_128tok.npz"
PROMPT = 32


def gaussian_data(seed: int = 0, t: int = 1024, hq: int = 8, hkv: int = 2, d: int = 64):
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((1, hkv, t, d)).astype(np.float32)
    out_ch = rng.choice(d, 4, replace=False)
    k[..., out_ch] = k[..., out_ch] * 10 + 5
    v = rng.standard_normal((1, hkv, t, d)).astype(np.float32)
    q = rng.standard_normal((1, hq, t, d)).astype(np.float32)
    return [(q, k, v, float(d ** -0.5))]


def minilm_data():
    z = np.load(ACTIVATIONS)
    scale = float(z["scale"])
    return [(z[f"layer{i}_q"][None], z[f"layer{i}_k"][None], z[f"layer{i}_v"][None], scale)
            for i in range(int(z["n_layers"]))]


class DynCacheAttention:
    """tract's storage-only quantized cache for K and V + exact causal attention over it."""

    def __init__(self, bits: int, scale: float) -> None:
        self.k = TractQuantizedDynKvCache(bits=bits, per_channel=1)
        self.v = TractQuantizedDynKvCache(bits=bits, per_channel=0)
        self.scale = scale

    def __call__(self, q, k, v):
        kf, vf = self.k(k), self.v(v)
        t, s = kf.shape[2], q.shape[2]
        mask = np.arange(t)[None, :] <= (t - s + np.arange(s))[:, None]
        return softmax_attention(q, kf, vf, self.scale, mask)

    def nbytes(self) -> dict:
        a, b = self.k.nbytes(), self.v.nbytes()
        return {k: a.get(k, 0) + b.get(k, 0) for k in ("codes", "params", "full_precision")}


def held_bytes(op) -> int:
    nb = op.nbytes()
    return int(nb.get("codes", 0) + nb.get("params", 0) + nb.get("full_precision", 0))


def deviation(make_op, datasets, bits_out: list | None = None) -> float:
    """The aggregate deviation; ``bits_out`` gets the all-in bits per value held at the end."""
    num = den = 0.0
    held = values = 0
    for q, k, v, scale in datasets:
        op = make_op(scale)
        t = k.shape[2]
        for t0, t1 in [(0, PROMPT)] + [(i, i + 1) for i in range(PROMPT, t)]:
            out = op(q[:, :, t0:t1], k[:, :, t0:t1], v[:, :, t0:t1])
            if t0 == 0:
                continue
            mask = np.arange(t1)[None, :] <= (t1 - (t1 - t0) + np.arange(t1 - t0))[:, None]
            ref = softmax_attention(q[:, :, t0:t1], k[:, :, :t1], v[:, :, :t1], scale, mask)
            num += float(np.sum((out.astype(np.float64) - ref) ** 2))
            den += float(np.sum(ref.astype(np.float64) ** 2))
        held += held_bytes(op)
        values += 2 * k.size
    if bits_out is not None:
        bits_out.append(8.0 * held / values)
    return float(np.sqrt(num / den))


def kivi(bits: int, **opts):
    kw = dict(key_group=32, value_group=32, residual=32)
    kw.update(opts)
    return lambda scale: KiviSdpa(scale=scale, bits=bits, **kw)


def ggml(kt: str, vt: str | None = None, **opts):
    return lambda scale: GgmlSdpa(scale=scale, key_type=kt, value_type=vt or kt, **opts)


def hf(bits: int, **opts):
    return lambda scale: HfQuantizedSdpa(scale=scale, bits=bits, **opts)


def issue15_variants():
    """The schemes of issue 15 (llama.cpp's, HF's, the KIVI variants)."""
    rows = [(f"ggml {t}", ggml(t)) for t in ("q8_0", "q5_1", "q5_0", "q4_1", "q4_0")]
    rows += [("ggml q4_0 keys / q8_0 values", ggml("q4_0", "q8_0")),
             ("ggml q8_0 keys / q4_0 values", ggml("q8_0", "q4_0")),
             ("ggml q4_0, residual 32 (nnef-kv's window)", ggml("q4_0", residual=32))]
    rows += [("hf quanto 4-bit (HF defaults)", hf(4)), ("hf quanto 2-bit (HF defaults)", hf(2)),
             ("hf hqq 4-bit (axis 1, group 64)", hf(4, backend="hqq", axis_key=1, axis_value=1))]
    rows += [("kivi 4-bit, residual 0", kivi(4, residual=0)), ("kivi 8/4 (keys/values)", kivi(8, value_bits=4)),
             ("kivi 4/2 (keys/values)", kivi(4, value_bits=2)), ("kivi 2/4 (keys/values)", kivi(2, value_bits=4)),
             ("kivi 4-bit per-token keys", kivi(4, key_axis="token")),
             ("kivi 2-bit per-token keys", kivi(2, key_axis="token"))]
    return rows


def variants(bits_list=(8, 4, 3, 2)):
    rows = []
    for b in bits_list:
        rows.append((f"kivi {b}-bit", kivi(b)))
        rows.append((f"kivi {b}-bit f32 params", kivi(b, params="f32")))
        rows.append((f"kivi {b}-bit clip", kivi(b, clip=True)))
        rows.append((f"kivi {b}-bit rotate v", kivi(b, rotate="v")))
        rows.append((f"kivi {b}-bit rotate kv", kivi(b, rotate="kv")))
        rows.append((f"kivi {b}-bit clip+rotate v", kivi(b, clip=True, rotate="v")))
    for b in (4, 2):
        rows.append((f"kivi {b}-bit sinks=1", kivi(b, sinks=1)))
    rows.append(("tract quantized_kv_sdpa (u8)", lambda scale: TractQuantizedKvSdpa(scale=scale)))
    rows.append(("tract quantized_dyn_kv_cache 8-bit", lambda scale: DynCacheAttention(8, scale)))
    rows.append(("tract quantized_dyn_kv_cache 4-bit", lambda scale: DynCacheAttention(4, scale)))
    return rows + issue15_variants()


def tract_gaussian() -> dict:
    """The tract fused op vs exact attention in the setting of shared/docs/quantized-kv-sdpa.md:
    Gaussian K/V (std 1, or std growing 10% a step), D = 16, 2 heads, one token a step, seeds 0-2."""
    out = {}
    for growth in (False, True):
        devs = []
        for seed in range(3):
            rng = np.random.default_rng(seed)
            op = TractQuantizedKvSdpa(scale=0.25)
            ks, vs = [], []
            for t in range(40):
                sd = 1.1 ** t if growth else 1.0
                q = rng.standard_normal((1, 2, 1, 16)).astype(np.float32)
                k = (rng.standard_normal((1, 2, 1, 16)) * sd).astype(np.float32)
                v = (rng.standard_normal((1, 2, 1, 16)) * sd).astype(np.float32)
                ks.append(k)
                vs.append(v)
                y = op(q, k, v)
                if t + 1 in (5, 10, 20, 40):
                    ref = softmax_attention(q, np.concatenate(ks, 2), np.concatenate(vs, 2), 0.25)
                    devs.append(float(np.linalg.norm(y - ref) / np.linalg.norm(ref)))
        out["std growing 10%/step" if growth else "std 1"] = (min(devs), max(devs))
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="MiniLM activations only")
    ap.add_argument("--issue15", action="store_true", help="the issue-15 schemes and the KIVI/tract rows they are "
                                                           "compared with only")
    args = ap.parse_args(argv)
    sets = {}
    if ACTIVATIONS.exists():
        sets["minilm"] = minilm_data()
    else:
        print(f"(skipping minilm: {ACTIVATIONS} not found)")
    if not args.quick:
        sets["gaussian"] = gaussian_data()
    results: dict = {}
    names = list(sets)
    print(f"{'op':44s}" + "".join(f"{n:>12s}{'bits':>7s}" for n in names) + "   seconds")
    rows = variants()
    if args.issue15:
        keep = {"kivi 8-bit", "kivi 4-bit", "kivi 2-bit", "tract quantized_dyn_kv_cache 8-bit",
                "tract quantized_dyn_kv_cache 4-bit"}
        rows = [r for r in rows if r[0] in keep] + issue15_variants()
    for label, make in rows:
        t = time.perf_counter()
        bits: dict = {}
        row = {}
        for n in names:
            got: list = []
            row[n] = deviation(make, sets[n], got)
            bits[n] = got[0]
        results[label] = {**row, **{f"{n} bits": bits[n] for n in names}}
        print(f"{label:44s}" + "".join(f"{100 * row[n]:11.3f}%{bits[n]:7.2f}" for n in names)
              + f"   {time.perf_counter() - t:6.1f}", flush=True)
    if not args.quick:
        print("tract quantized_kv_sdpa vs exact attention, Gaussian K/V, D=16, 2 heads, after 5/10/20/40 steps, "
              "3 seeds:")
        for label, (lo, hi) in tract_gaussian().items():
            print(f"  {label:22s} {100 * lo:6.1f}% .. {100 * hi:6.1f}%")
    return results


# ---------------------------------------------------------------------------------------------
# --ideas: fake-quantization study of options that are *not* in the op, on the MiniLM data.
# Same protocol (causal decode, 32-token prompt, key_group 32, value_group 32, residual 32; the
# groups quantized at step t are those ending at least 32 tokens before t), f32 params.
def _fq(x: np.ndarray, axis: int, levels: np.ndarray) -> np.ndarray:
    lo, hi = x.min(axis, keepdims=True), x.max(axis, keepdims=True)
    r = hi - lo
    u = np.where(r > 0, (x - lo) / np.where(r > 0, r, 1), 0)
    return lo + levels[np.abs(u[..., None] - levels).argmin(-1)] * r


def _qk_groups(k: np.ndarray, levels: np.ndarray) -> np.ndarray:  # per channel, groups of 32 tokens
    h, t, d = k.shape
    return _fq(k.reshape(h, t // 32, 32, d), 2, levels).reshape(h, t, d)


def _qk_query_aware(k: np.ndarray, levels: np.ndarray, cov_of_group) -> np.ndarray:
    """Per-channel codes whose rounding minimises the expected score error e^T C e, C = E[q q^T]
    (GPTQ-style error feedback over channels, vectorised over the 32 tokens of a group)."""
    h, t, d = k.shape
    nl = len(levels) - 1
    out = np.empty_like(k)
    for g in range(t // 32):
        blk = k[:, 32 * g:32 * g + 32]
        lo, hi = blk.min(1), blk.max(1)
        st = np.where(hi > lo, (hi - lo) / nl, 1.0)
        cov = cov_of_group(g)
        for hh in range(h):
            cm = cov[hh] + 1e-3 * np.trace(cov[hh]) / d * np.eye(d)
            u = np.linalg.cholesky(np.linalg.inv(cm * np.outer(st[hh], st[hh]))).T
            x = (blk[hh] - lo[hh]) / st[hh]
            qv = np.empty_like(x)
            for c in range(d):
                qv[:, c] = np.clip(np.round(x[:, c]), 0, nl)
                x[:, c + 1:] -= np.outer((x[:, c] - qv[:, c]) / u[c, c], u[c, c + 1:])
            out[hh, 32 * g:32 * g + 32] = lo[hh] + qv * st[hh]
    return out


def _fake_deviation(datasets, quant_k, quant_v) -> float:
    num = den = 0.0
    for li, (q, k, v, scale) in enumerate(datasets):
        q, k, v = q[0], k[0], v[0]
        kq = quant_k(li, q, k) if quant_k else k
        vq = quant_v(v) if quant_v else v
        for t in range(PROMPT + 1, k.shape[1] + 1):
            nq = max(0, (t - 32) // 32) * 32
            kk = np.concatenate([kq[:, :nq], k[:, nq:t]], 1)[None]
            vv = np.concatenate([vq[:, :nq], v[:, nq:t]], 1)[None]
            out = softmax_attention(q[None, :, t - 1:t], kk, vv, scale)
            ref = softmax_attention(q[None, :, t - 1:t], k[None, :, :t], v[None, :, :t], scale)
            num += float(np.sum((out.astype(np.float64) - ref) ** 2))
            den += float(np.sum(ref.astype(np.float64) ** 2))
    return float(np.sqrt(num / den))


def _lloyd_levels(bits: int, seed: int = 0) -> np.ndarray:
    """Levels in [0, 1] for min-max normalised groups of 32 Gaussian samples, endpoints kept
    (Lloyd-Max on synthetic data: calibration-free)."""
    x = np.random.default_rng(seed).standard_normal((20000, 32))
    u = ((x - x.min(1, keepdims=True)) / np.ptp(x, 1, keepdims=True)).ravel()
    lv = np.linspace(0, 1, 2 ** bits)
    for _ in range(60):
        idx = np.abs(u[:, None] - lv).argmin(1)
        lv = np.array([u[idx == i].mean() if np.any(idx == i) else lv[i] for i in range(len(lv))])
        lv[0], lv[-1] = 0.0, 1.0
    return lv


def ideas() -> None:
    data = minilm_data()
    print("fake-quantization study on MiniLM (relative L2 deviation; f32 params)")
    for bits in (4, 2):
        uni = np.linspace(0, 1, 2 ** bits)
        lloyd = _lloyd_levels(bits)
        base_k = lambda li, q, k, lv=uni: _qk_groups(k, lv)  # noqa: E731
        base_v = lambda v, lv=uni: _fq(v, 2, lv)  # noqa: E731
        rows = {
            "uniform (the op)": (base_k, base_v),
            "  keys only": (base_k, None),
            "  values only": (None, base_v),
            "non-uniform levels (Lloyd, Gaussian groups)": (lambda li, q, k: _qk_groups(k, lloyd),
                                                           lambda v: _fq(v, 2, lloyd)),
            "values per channel (not per token)": (base_k, lambda v: _qk_groups(v, uni)),
        }

        def cov_all(q):
            return lambda g: np.einsum("htd,hte->hde", q, q) / q.shape[1]

        def cov_prompt(q):
            return lambda g: np.einsum("htd,hte->hde", q[:, :PROMPT], q[:, :PROMPT]) / PROMPT

        def cov_running(q):
            def f(g):
                t = min(q.shape[1], 32 * g + 64)  # queries seen when group g is quantized
                return np.einsum("htd,hte->hde", q[:, :t], q[:, :t]) / t
            return f

        for label, cov in (("query-aware key rounding, C of all queries (oracle)", cov_all),
                           ("query-aware key rounding, C of the prompt", cov_prompt),
                           ("query-aware key rounding, C of queries so far", cov_running)):
            rows[label] = (lambda li, q, k, cov=cov: _qk_query_aware(k, uni, cov(q)), base_v)
        for label, (qk, qv) in rows.items():
            print(f"  {bits}-bit {label:52s} {100 * _fake_deviation(data, qk, qv):7.3f}%")


if __name__ == "__main__":
    if "--ideas" in sys.argv[1:]:
        ideas()
    else:
        main()
