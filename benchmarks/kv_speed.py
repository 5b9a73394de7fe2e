"""Time of one decode-step attention: exact f32 over an f32 cache vs the KIVI op on its packed cache.

Setup: B=1, 8 kv heads, 8 query heads, D=128, one query token; the cache holds T tokens (T = 512,
2048, 8192). The f32 reference is exact attention (matmul, softmax, matmul) over ``[1, 8, T, 128]``
f32 arrays (:func:`nnef_kv.kv.softmax_attention`); the KIVI op's step is the attention part of a call
(``KiviSdpa._attend``) over its packed cache (key_group 32, value_group 128, residual 32, f16 params)
at each of ``--bits`` (8 and 4 by default).

Robust on a loaded machine: in each of ``--repeat`` rounds the f32 step and every KIVI step run back
to back (interleaved, the order rotated every round), so a change of load hits all of them. Each call
is timed in wall time (``perf_counter``) and in CPU time of the thread (``thread_time``: time the
process was descheduled does not count; cache and memory-bandwidth contention still do). Reported
per T: the f32 times (best and median), and for each bit width

* ``best``   -- best-of-N ratio: fastest KIVI round / fastest f32 round (least disturbed rounds);
* ``median`` -- median of the per-round ratios;
* ``cpu``    -- the same two on CPU time (best-of-N / median).

Threads: ``--threads N`` gives BLAS N threads (threadpoolctl) *and* the KIVI op N worker threads (it
splits kv heads), so both sides use the same cores. The BLAS library, its kernel ("architecture")
and thread count are printed: on some processors ``OPENBLAS_CORETYPE`` / ``OPENBLAS_L2_SIZE`` are
set in this environment (older OpenBLAS builds need them) and select a slower kernel; to measure a
current NumPy at its best, unset both *for the benchmark command only* and check the kernel printed.

Run: ``python benchmarks/kv_speed.py`` (``--repeat 30 --threads 1 --lengths 512 2048 8192 --bits 8 4``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nnef_kv.kv import KiviSdpa, softmax_attention  # noqa: E402

H, D = 8, 128


def build_kivi(bits: int, k: np.ndarray, v: np.ndarray, threads: int = 1) -> KiviSdpa:
    """A KIVI op holding the T tokens of k, v (fed as 1024-token chunks)."""
    op = KiviSdpa(scale=D ** -0.5, bits=bits, key_group=32, value_group=128, residual=32, threads=threads)
    t = k.shape[2]
    step = 1024
    q = np.zeros((1, H, 1, D), np.float32)
    for t0 in range(0, t, step):
        op(q, k[:, :, t0:t0 + step], v[:, :, t0:t0 + step])
    return op


def blas_info() -> list[dict]:
    """BLAS libraries NumPy uses (threadpoolctl): library, version, kernel, threads."""
    from threadpoolctl import threadpool_info

    return [{k: i.get(k) for k in ("internal_api", "version", "architecture", "num_threads")}
            for i in threadpool_info() if i.get("user_api") == "blas"]


def time_rounds(fns: dict, repeat: int) -> tuple[dict, dict]:
    """Interleaved rounds (order rotated each round): wall and thread-CPU seconds per call."""
    names = list(fns)
    wall: dict[str, list[float]] = {nm: [] for nm in names}
    cpu: dict[str, list[float]] = {nm: [] for nm in names}
    for fn in fns.values():  # warm-up (buffers, caches)
        fn()
    for r in range(repeat):
        for j in range(len(names)):
            nm = names[(j + r) % len(names)]
            fn = fns[nm]
            c0 = time.thread_time()
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            c1 = time.thread_time()
            wall[nm].append(t1 - t0)
            cpu[nm].append(c1 - c0)
    return ({k: np.array(v) for k, v in wall.items()}, {k: np.array(v) for k, v in cpu.items()})


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lengths", type=int, nargs="*", default=[512, 2048, 8192])
    ap.add_argument("--bits", type=int, nargs="*", default=[8, 4])
    ap.add_argument("--json", type=str, default="", help="also write the figures to this file")
    args = ap.parse_args(argv)
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(0)
    results: dict = {"blas": None, "env": {k: os.environ.get(k) for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")},
                     "threads": args.threads, "repeat": args.repeat, "rows": {}}
    with threadpool_limits(args.threads):
        results["blas"] = blas_info()
        print(f"BLAS: {results['blas']}  env: {results['env']}")
        print(f"threads={args.threads} repeat={args.repeat}; ratios to f32: best-of-N / median of rounds, "
              f"wall and thread CPU time")
        hdr = f"{'T':>6s} {'f32 ms best/med':>16s}"
        for bits in args.bits:
            hdr += f" | {'kivi' + str(bits) + ' ms':>9s} {'wall best/med':>13s} {'cpu best/med':>12s}"
        print(hdr)
        for t in args.lengths:
            k = rng.standard_normal((1, H, t, D)).astype(np.float32)
            v = rng.standard_normal((1, H, t, D)).astype(np.float32)
            q = rng.standard_normal((1, H, 1, D)).astype(np.float32)
            qn = q.reshape(H, 1, D)
            ops = {bits: build_kivi(bits, k, v, args.threads) for bits in args.bits}
            fns = {"f32": lambda: softmax_attention(q, k, v, D ** -0.5)}
            for bits in args.bits:
                fns[f"kivi{bits}"] = (lambda op: lambda: op._attend(qn, 1))(ops[bits])
            wall, cpu = time_rounds(fns, args.repeat)
            f32w, f32c = wall["f32"], cpu["f32"]
            row = {"f32_ms_best": 1e3 * float(f32w.min()), "f32_ms_median": 1e3 * float(np.median(f32w))}
            line = f"{t:6d} {row['f32_ms_best']:7.3f}/{row['f32_ms_median']:<8.3f}"
            for bits in args.bits:
                nm = f"kivi{bits}"
                w, c = wall[nm], cpu[nm]
                row[nm] = {
                    "ms_best": 1e3 * float(w.min()), "ms_median": 1e3 * float(np.median(w)),
                    "ratio_best": float(w.min() / f32w.min()), "ratio_median": float(np.median(w / f32w)),
                    "cpu_ratio_best": float(c.min() / f32c.min()),
                    "cpu_ratio_median": float(np.median(c / np.maximum(f32c, 1e-9))),
                }
                r = row[nm]
                line += (f" | {r['ms_best']:9.3f} {r['ratio_best']:6.2f}/{r['ratio_median']:<6.2f} "
                         f"{r['cpu_ratio_best']:5.2f}/{r['cpu_ratio_median']:<6.2f}")
            results["rows"][t] = row
            print(line, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
