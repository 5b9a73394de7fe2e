"""The KIVI decode-step attention on one and on two threads, nothing else running: T = 8192, 8 kv heads x 128,
key_group 32, value_group 128, residual 32 (``benchmarks/kv_speed.py``'s cache), BLAS held to one thread so
that no idle BLAS worker competes for the second core (kv_speed.py times an f32 side with BLAS threads between
the KIVI calls; this script isolates the op's own thread split). Rounds alternate the order of the two ops.

``--cold`` reads a 64 MiB array before each call (the codes then come from memory, as in a decoder whose
weight products ran in between); default: warm caches.

    python benchmarks/kivi_threads.py --bits 4
    python benchmarks/kivi_threads.py --bits 4 --cold
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kv_speed import D, H, build_kivi  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--cold", action="store_true")
    args = ap.parse_args(argv)
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(0)
    k = rng.standard_normal((1, H, args.tokens, D)).astype(np.float32)
    v = rng.standard_normal((1, H, args.tokens, D)).astype(np.float32)
    ops = {th: build_kivi(args.bits, k, v, threads=th) for th in (1, 2)}
    q = rng.standard_normal((H, 1, D)).astype(np.float32)
    flush = np.ones(16 << 20, np.float32)
    wall: dict[int, list[float]] = {1: [], 2: []}
    cpu: dict[int, list[float]] = {1: [], 2: []}
    with threadpool_limits(1):
        for op in ops.values():
            op._attend(q, 1)
        for r in range(args.rounds):
            for th in ((1, 2) if r % 2 else (2, 1)):
                if args.cold:
                    flush.sum()
                c0, t0 = time.thread_time(), time.perf_counter()
                ops[th]._attend(q, 1)
                wall[th].append(time.perf_counter() - t0)
                cpu[th].append(time.thread_time() - c0)
    print(f"KIVI {args.bits}-bit decode step, T = {args.tokens}, {H} kv heads x {D}, "
          f"{'cold' if args.cold else 'warm'} caches, {args.rounds} rounds (medians)")
    for th in (1, 2):
        print(f"  {th} thread(s): {1e3 * np.median(wall[th]):.3f} ms wall, calling thread CPU "
              f"{1e3 * np.median(cpu[th]):.3f} ms")
    print(f"  two threads / one: {np.median(wall[2]) / np.median(wall[1]):.2f}x")


if __name__ == "__main__":
    main()
