"""Bytes held by the quantized KV caches at T = 4096 tokens, against an f32 (and f16) cache.

Setup: B=1, 8 kv heads, D=128, T=4096 tokens fed as a 1024-token prompt then one token a step is
not needed for the figure (the storage after T tokens does not depend on how they were chunked), so
the tokens are fed in chunks of 256. Every figure is ``nbytes()`` of the op: the NumPy ``nbytes``
of every array it holds (codes, group params, full-precision sinks and residual window, the exact
side table, preallocated capacity included). The f32 reference is ``2 * B * H * T * D * 4`` bytes.

KIVI config: key_group 32, value_group 128, residual 32, f16 params. tract's
``quantized_dyn_kv_cache`` holds one cache for K (per channel) and one for V (per token).

Window rows (issue 25): a Mistral-shaped layer (8 kv heads x 128, sliding window 4096) after 32k tokens,
f32 (``nnef_kv_ggml_sdpa`` with the f32 type, a plain cache) and KIVI-8 / KIVI-4, with and without the window;
bytes held by one layer, times 32 for the model (every layer of Mistral 7B slides; the layers hold the same).

Run: ``python benchmarks/kv_memory.py`` (``--window`` for the window rows only).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nnef_kv.kv import GgmlSdpa, KiviSdpa, TractQuantizedDynKvCache, TractQuantizedKvSdpa  # noqa: E402

B, H, T, D = 1, 8, 4096, 128
CHUNK = 256


def _feed(call, rng) -> None:
    for _ in range(T // CHUNK):
        k = rng.standard_normal((B, H, CHUNK, D)).astype(np.float32)
        v = rng.standard_normal((B, H, CHUNK, D)).astype(np.float32)
        call(k, v)


def held(nb: dict) -> int:
    return nb["codes"] + nb["params"] + nb["full_precision"]


def main() -> dict:
    rng = np.random.default_rng(0)
    f32 = 2 * B * H * T * D * 4
    rows = {}
    q = np.zeros((B, H, 1, D), np.float32)
    for bits in (8, 4, 3, 2):
        op = KiviSdpa(scale=D ** -0.5, bits=bits, key_group=32, value_group=128, residual=32, params="f16")
        _feed(lambda k, v: op(q, k, v), rng)
        rows[f"kivi {bits}-bit"] = op.nbytes()
    for bits in (8, 4):
        kc = TractQuantizedDynKvCache(bits=bits, per_channel=1)
        vc = TractQuantizedDynKvCache(bits=bits, per_channel=0)
        _feed(lambda k, v: (kc(k), vc(v)), rng)
        nk, nv = kc.nbytes(), vc.nbytes()
        rows[f"tract quantized_dyn_kv_cache {bits}-bit"] = {key: nk[key] + nv[key] for key in nk}
    op = TractQuantizedKvSdpa(scale=D ** -0.5)
    _feed(lambda k, v: op(q, k, v), rng)
    rows["tract quantized_kv_sdpa (u8)"] = op.nbytes()

    print(f"T={T} D={D} kv heads={H}: f32 cache {f32} bytes ({f32 / 2**20:.1f} MiB)")
    print(f"{'op':36s} {'codes':>10s} {'params':>9s} {'full prec':>10s} {'total':>10s} "
          f"{'bits/val':>8s} {'vs f32':>7s} {'vs f16':>7s}")
    out = {}
    for label, nb in rows.items():
        total = held(nb)
        assert nb["f32_equivalent"] == f32, (label, nb)
        ratio = f32 / total
        out[label] = {"bytes": total, "x_vs_f32": ratio, "x_vs_f16": ratio / 2, **nb}
        print(f"{label:36s} {nb['codes']:10d} {nb['params']:9d} {nb['full_precision']:10d} "
              f"{total:10d} {8 * total / (f32 / 4):8.3f} {ratio:6.2f}x {ratio / 2:6.2f}x")
    return out


#: the window rows: Mistral 7B's attention (32 layers, 8 kv heads x 128, sliding window 4096) at 32k tokens
WIN_LAYERS, WIN, WIN_T = 32, 4096, 32768


def window_rows() -> dict:
    """Bytes held by one sliding layer after ``WIN_T`` tokens fed in chunks of 256, with and without the window."""
    q = np.zeros((B, H, 1, D), np.float32)
    makers = {"f32": lambda w: GgmlSdpa(scale=D ** -0.5, key_type="f32", value_type="f32", window=w),
              "kivi 8-bit": lambda w: KiviSdpa(scale=D ** -0.5, bits=8, value_group=128, window=w),
              "kivi 4-bit": lambda w: KiviSdpa(scale=D ** -0.5, bits=4, value_group=128, window=w)}
    print(f"\nMistral-shaped layer: {H} kv heads x {D}, sliding window {WIN}, {WIN_T} tokens "
          f"(bytes held by one layer; x {WIN_LAYERS} layers)")
    print(f"{'cache':12s} {'no window':>14s} {'window ' + str(WIN):>14s} {'ratio':>7s} {'model, window':>15s}")
    out = {}
    for label, make in makers.items():
        held_by = {}
        for w in (0, WIN):
            rng = np.random.default_rng(1)
            op = make(w)
            for _ in range(WIN_T // CHUNK):
                k = rng.standard_normal((B, H, CHUNK, D)).astype(np.float32)
                op(q, k, rng.standard_normal((B, H, CHUNK, D)).astype(np.float32))
            held_by[w] = held(op.nbytes())
        out[label] = held_by
        print(f"{label:12s} {held_by[0]:14,d} {held_by[WIN]:14,d} {held_by[0] / held_by[WIN]:6.2f}x "
              f"{WIN_LAYERS * held_by[WIN] / 2**20:12.1f} MiB")
    return out


if __name__ == "__main__":
    if "--window" not in sys.argv[1:]:
        main()
    window_rows()
