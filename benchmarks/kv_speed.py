"""Time of one decode-step attention: exact f32 over an f32 cache vs the KIVI op on its packed cache.

Setup: B=1, 8 kv heads, 8 query heads, D=128, one query token; the cache holds T tokens (T = 512,
2048, 8192). The f32 reference is exact attention (matmul, softmax, matmul) over ``[1, 8, T, 128]``
f32 arrays; the KIVI op's step is the attention part of a call (``KiviSdpa._attend``) over its packed
cache (key_group 32, value_group 128, residual 32). The three are timed back to back in each round
(so a load change on the machine hits all three), ``--repeat`` rounds; the figures are the median
time of each, the median of the per-round ratios to f32, and the ratio of the fastest rounds
(least disturbed by other processes).

Threads: ``--threads N`` gives BLAS N threads (threadpoolctl) *and* the KIVI op N worker threads
(it splits kv heads; NumPy releases the GIL in its kernels), so both sides use the same cores.

Run: ``python benchmarks/kv_speed.py`` (``--repeat 30 --threads 1``).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nnef_kv.kv import KiviSdpa, softmax_attention  # noqa: E402

H, D = 8, 128


def build_kivi(bits: int, k: np.ndarray, v: np.ndarray, threads: int = 1) -> KiviSdpa:
    op = KiviSdpa(scale=D ** -0.5, bits=bits, key_group=32, value_group=128, residual=32, threads=threads)
    t = k.shape[2]
    step = 1024
    q = np.zeros((1, H, 1, D), np.float32)
    for t0 in range(0, t, step):
        op(q, k[:, :, t0:t0 + step], v[:, :, t0:t0 + step])
    return op


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lengths", type=int, nargs="*", default=[512, 2048, 8192])
    args = ap.parse_args(argv)
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(0)
    results = {}
    print(f"threads={args.threads} repeat={args.repeat}")
    print(f"{'T':>6s} {'f32 ms':>9s} {'kivi8 ms':>9s} {'ratio':>6s} {'kivi4 ms':>9s} {'ratio':>6s}")
    with threadpool_limits(args.threads):
        for t in args.lengths:
            k = rng.standard_normal((1, H, t, D)).astype(np.float32)
            v = rng.standard_normal((1, H, t, D)).astype(np.float32)
            q = rng.standard_normal((1, H, 1, D)).astype(np.float32)
            qn = q.reshape(H, 1, D)
            ops = {bits: build_kivi(bits, k, v, args.threads) for bits in (8, 4)}
            fns = {"f32": lambda: softmax_attention(q, k, v, D ** -0.5),
                   "kivi8": lambda: ops[8]._attend(qn, 1), "kivi4": lambda: ops[4]._attend(qn, 1)}
            times: dict[str, list[float]] = {name: [] for name in fns}
            for fn in fns.values():
                fn()
            for _ in range(args.repeat):
                for name, fn in fns.items():
                    t0 = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t0)
            f32 = np.array(times["f32"])
            row = {"f32_ms": 1e3 * float(np.median(f32)), "f32_min_ms": 1e3 * float(f32.min())}
            for name in ("kivi8", "kivi4"):
                arr = np.array(times[name])
                row[f"{name}_ms"] = 1e3 * float(np.median(arr))
                row[f"{name}_ratio"] = float(np.median(arr / f32))
                row[f"{name}_min_ms"] = 1e3 * float(arr.min())
                row[f"{name}_min_ratio"] = float(arr.min() / f32.min())
            results[t] = row
            print(f"{t:6d} {row['f32_ms']:9.3f} {row['kivi8_ms']:9.3f} {row['kivi8_ratio']:6.2f} "
                  f"{row['kivi4_ms']:9.3f} {row['kivi4_ratio']:6.2f}   min-time ratios: "
                  f"{row['kivi8_min_ratio']:.2f} {row['kivi4_min_ratio']:.2f}")
    return results


if __name__ == "__main__":
    main()
