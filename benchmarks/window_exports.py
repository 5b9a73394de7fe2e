#!/usr/bin/env python3
"""The torch-to-nnef exports that keep their sliding window (``tests/fixtures/exports/*_window``), each converted
under every scheme that keeps the window, decoded teacher-forced on their 112 tokens and measured against HF's
windowed model past the window (calls 17..105: 89 predictions an export).

Prints one row per (export, scheme): same top-1 as HF (Wilson 95% interval), mean KL(HF || converted) (normal
95% interval of the mean), the windowless model's KL (what an export that lost its window costs), and the total
at which the sliding layers' bytes held peaked (then flat: every sliding state evicts). The decode and the
settings are ``tests/e2e/test_window_exports.py``'s: KIVI at 8 bits with residual 0 and key groups of 4 (every token
but the call's read through its codes), ggml q8_0, HF's hqq at 8 bits, tract's quantized dyn cache at 8 bits.

    python benchmarks/window_exports.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import nnef_kv  # noqa: E402
import test_window_exports as W  # noqa: E402  (its decode, settings and fixtures)
from nnef_kv.errors import ConversionError  # noqa: E402
from nnef_kv.validate.metrics import kl_divergence  # noqa: E402


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return mid - half, mid + half


def main() -> int:
    past = slice(W.WINDOW, None)
    print("| export | scheme | same top [95%] | KL mean [95%] | windowless KL | bytes peak at |")
    print("|---|---|---|---|---|---|")
    for d in W.DIRS:
        h = np.load(d / "hf_ref.npz")
        model = nnef_kv.load(d / "model.nnef.tgz")
        tokens, n = [int(t) for t in h["tokens"]], int(h["n_prompt"])
        ref = h["logits"]
        lost = float(kl_divergence(ref[past], h["logits_windowless"][past]).mean())
        f32 = W._decode(W.InterpreterDecoder(model), tokens, n)
        print(f"| {d.name} | f32 | max abs diff vs HF {np.abs(f32 - ref).max():.1e} ({len(ref)} calls) | | "
              f"{lost:.3f} | |")
        for scheme, kw in [*sorted(W.SCHEMES.items()), ("tract-cache", dict(bits=8))]:
            try:
                conv, _ = W.convert(model, scheme, **kw)
            except ConversionError as exc:
                why = "softcap" if "softcap" in str(exc) else "sinks" if "sink" in str(exc) else str(exc)[:60]
                print(f"| {d.name} | {scheme} | refused ({why}) | | | |")
                continue
            dec = W.InterpreterDecoder(conv)
            held: list[int] = []
            got = W._decode(dec, tokens, n, held if scheme != "tract-cache" else None)
            same = int((got[past].argmax(-1) == ref[past].argmax(-1)).sum())
            total = got[past].shape[0]
            lo, hi = wilson(same, total)
            kl = kl_divergence(ref[past], got[past])
            half = 1.96 * kl.std(ddof=1) / np.sqrt(len(kl))
            peak = str(n + 1 + int(np.argmax(held))) if held else "-"
            print(f"| {d.name} | {scheme} | {same}/{total} [{100 * lo:.1f}, {100 * hi:.1f}]% | {kl.mean():.2e} "
                  f"[{max(0.0, kl.mean() - half):.1e}, {kl.mean() + half:.1e}] | {lost:.3f} | {peak} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
