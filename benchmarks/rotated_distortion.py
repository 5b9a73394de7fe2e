"""Relative squared error of what the rotated-codebook op and llama.cpp's q4_0 / q5_1 (with and without its
rotation) store, for 4096 Gaussian 64-dim vectors with channel scales 0.1..5 (docs/kv.md 8.3).

Run: ``python benchmarks/rotated_distortion.py``.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nnef_kv.kv import ggml  # noqa: E402
from nnef_kv.kv.rotated import RotatedSdpa  # noqa: E402


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sum((a - b) ** 2) / np.sum(b ** 2))


def main() -> None:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((1, 1, 4096, 64)) * rng.uniform(0.1, 5, (1, 1, 1, 64))).astype(np.float32)
    q = np.zeros((1, 1, 0, 64), np.float32)
    for bits in (3, 4):
        op = RotatedSdpa(bits=bits)
        op(q, x, x)
        kd, _ = op.dequantized()
        print(f"rotated:{bits}: relative squared error {rel(kd, x):.5f}, {bits + 16 / 64} bits a value")
    h = ggml.walsh_hadamard(64)
    for t in ("q4_0", "q5_1"):
        for rot in (False, True):
            xr = ggml.hadamard_blocks(x, h) if rot else x
            d = ggml.dequantize(ggml.quantize(xr, t))
            print(f"{t}{'+rotate' if rot else ''}: relative squared error {rel(d, xr):.5f}, "
                  f"{ggml.bits_per_value(t)} bits a value")


if __name__ == "__main__":
    main()
