"""Time of the KIVI op's chunk paths: a 4096-token prefill in 256-token chunks (ordinary calls) and 1024
teacher-forced tokens as ``stepwise=True`` chunks of 64 (8 kv heads x 128, 4 bits, key_group 32,
value_group 128, residual 32; best of 3). Run it on two checkouts to compare them, alternating (the
machine is shared): ``PYTHONPATH=OLD python benchmarks/kivi_chunks.py``, then ``PYTHONPATH=NEW ...``
(from a folder outside both checkouts, so that PYTHONPATH decides which one is imported).
"""
from __future__ import annotations

import time

import numpy as np

import nnef_kv
from nnef_kv.kv import KiviSdpa

H, D, T = 8, 128, 4096


def run(q: np.ndarray, k: np.ndarray, v: np.ndarray, chunk: int, stepwise: bool, tokens: int) -> float:
    op = KiviSdpa(scale=D ** -0.5, bits=4, key_group=32, value_group=128, residual=32)
    call = op.stepwise if stepwise else op
    t0 = time.perf_counter()
    for t in range(0, tokens, chunk):
        call(q[:, :, t:t + chunk], k[:, :, t:t + chunk], v[:, :, t:t + chunk])
    return time.perf_counter() - t0


def main() -> None:
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, H, T, D)).astype(np.float32) for _ in range(3))
    cases = {"prefill 4096 in chunks of 256": (256, False, T), "stepwise 1024 in chunks of 64": (64, True, 1024)}
    print(f"nnef_kv from {nnef_kv.__file__}")
    for chunk, stepwise, tokens in cases.values():  # warm-up (first calls, numba cache loads)
        run(q, k, v, chunk, stepwise, tokens)
    for name, case in cases.items():
        print(f"{name}: {min(run(q, k, v, *case) for _ in range(3)) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
