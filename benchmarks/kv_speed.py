"""Time of one decode-step attention: the KIVI op on its packed cache vs two exact f32 attentions.

Setup: B=1, 8 kv heads, 8 query heads, D=128, one query token; the cache holds T tokens (T = 512, 2048,
8192 by default). Three sides, timed back to back in each round (interleaved, the order rotated every
round, so a change of load hits all of them):

* ``f32``   -- exact attention (matmul, softmax, matmul) over ``[1, 8, T, 128]`` f32 arrays
  (:func:`nnef_kv.kv.softmax_attention`), this benchmark's historical baseline;
* ``f32i``  -- the interpreter's own exact path, what a decoder with ``tract_transformers_dyn_kv_cache``
  and ``tract_transformers_sdpa`` runs: the planned sdpa kernel over the dyn cache's buffer (the fastest
  exact path the package has);
* ``kivi<b>`` -- the attention part of a KIVI call (``KiviSdpa._attend``) over its packed cache (key_group
  32, value_group 128, residual 32, f16 params) at each of ``--bits``: the numba kernels of
  :mod:`nnef_kv.kv.kivi.kernels` when they apply (numba importable, ``NNEF_KV_NO_NUMBA`` unset),
  else the NumPy path. ``numba kernels: off`` in the header when they do not run.

Each call is timed in wall time and CPU time of the thread. Reported per T: the two f32 times (median),
and for each bit width the KIVI time and the median of the per-round ratios to each f32 side
(``kivi / f32``, ``kivi / f32i``: < 1 = KIVI faster), wall and thread CPU time. The first call of each
KIVI op (numba JIT compile or loading its on-disk cache) is timed apart and printed, never in a round.

Threads: ``--threads N`` gives BLAS N threads (threadpoolctl: both f32 sides) *and* the KIVI op N worker
threads (it splits kv heads), so all sides may use the same cores. The BLAS library, its kernel
("architecture") and thread count are printed: on some processors ``OPENBLAS_CORETYPE`` /
``OPENBLAS_L2_SIZE`` are set in this environment (older OpenBLAS builds need them) and select a slower
kernel; to measure a current NumPy at its best, unset both *for the benchmark command only*.

Run: ``python benchmarks/kv_speed.py --threads 1`` and ``--threads 2`` (``--repeat 30 --lengths 512 2048 8192
--bits 8 4 2 1``). ``--rotated`` times the rotated-codebook op instead (:func:`rotated_main`: 3 kv heads x 64 and
8 x 128, rotated 4/3/2-bit against exact f32, T = 8192 by default; ``--threads N``: BLAS and the rotated op's
loops over the codes, which split the tokens, both N threads).
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


def interpreter_f32(k: np.ndarray, v: np.ndarray):
    """The interpreter's exact decode attention: ``tract_transformers_sdpa`` (its planned, specialised
    kernel) over the buffers of two ``tract_transformers_dyn_kv_cache`` states holding k, v."""
    from nnef_kv.interpreter.catalog import lookup
    from nnef_kv.interpreter.plan.specialize import specialize
    from nnef_kv.kv.exact import DynKvCache

    caches = []
    for name, x in (("k", k), ("v", v)):
        c = DynKvCache(name=name, axis=2, datum_type="f32", past_sequence_shape=[1, H, "P", D],
                       input_sequence_shape=[1, H, "S", D])
        c(x)
        caches.append(c)
    sdpa = specialize(lookup("tract_transformers_sdpa"), {"scale": D ** -0.5, "datum_type": "f32",
                                                         "acc_datum_type": "f32", "is_causal": True})
    assert sdpa is not None
    kc, vc = caches[0].cache, caches[1].cache
    return lambda q: sdpa(q, kc, vc)


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
    ap.add_argument("--bits", type=int, nargs="*", default=[8, 4, 2, 1])
    ap.add_argument("--json", type=str, default="", help="also write the figures to this file")
    args = ap.parse_args(argv)
    from threadpoolctl import threadpool_limits

    from nnef_kv.kernels import numba_available

    rng = np.random.default_rng(0)
    results: dict = {"blas": None, "env": {k: os.environ.get(k) for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")},
                     "threads": args.threads, "repeat": args.repeat, "numba": numba_available(), "rows": {}}
    with threadpool_limits(args.threads):
        results["blas"] = blas_info()
        print(f"BLAS: {results['blas']}  env: {results['env']}")
        print(f"threads={args.threads} (BLAS and the KIVI op) repeat={args.repeat}; numba kernels: "
              f"{'on' if results['numba'] else 'off (NumPy path)'}; load average "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        print("per T: f32 = softmax_attention, f32i = the interpreter's sdpa over its dyn cache (medians); "
              "per bit width: KIVI ms, then the median of per-round ratios kivi/f32 and kivi/f32i, wall | CPU")
        for t in args.lengths:
            k = rng.standard_normal((1, H, t, D)).astype(np.float32)
            v = rng.standard_normal((1, H, t, D)).astype(np.float32)
            q = rng.standard_normal((1, H, 1, D)).astype(np.float32)
            qn = q.reshape(H, 1, D)
            ops = {bits: build_kivi(bits, k, v, args.threads) for bits in args.bits}
            f32i = interpreter_f32(k, v)
            got_a, got_b = softmax_attention(q, k, v, D ** -0.5), f32i(q)
            first = {}
            for bits, op in ops.items():  # the first call: JIT compile or cache load, kept out of the rounds
                t0 = time.perf_counter()
                op._attend(qn, 1)
                first[bits] = time.perf_counter() - t0
            fns = {"f32": lambda: softmax_attention(q, k, v, D ** -0.5), "f32i": lambda: f32i(q)}
            for bits in args.bits:
                fns[f"kivi{bits}"] = (lambda op: lambda: op._attend(qn, 1))(ops[bits])
            wall, cpu = time_rounds(fns, args.repeat)
            row = {"f32_ms": 1e3 * float(np.median(wall["f32"])), "f32i_ms": 1e3 * float(np.median(wall["f32i"])),
                   "f32_vs_f32i_max_abs_diff": float(np.abs(got_a - got_b).max())}
            print(f"T = {t}: f32 {row['f32_ms']:.3f} ms, f32i {row['f32i_ms']:.3f} ms "
                  f"(max |f32 - f32i| {row['f32_vs_f32i_max_abs_diff']:.1e})")
            for bits in args.bits:
                nm = f"kivi{bits}"
                w, c = wall[nm], cpu[nm]
                f32w, f32c = wall["f32"], cpu["f32"]
                r = {  # best-of-N and median against f32 (the figures of earlier versions), then both f32 sides
                    "ms_best": 1e3 * float(w.min()), "ms_median": 1e3 * float(np.median(w)),
                    "ratio_best": float(w.min() / f32w.min()), "ratio_median": float(np.median(w / f32w)),
                    "cpu_ratio_best": float(c.min() / max(f32c.min(), 1e-9)),
                    "cpu_ratio_median": float(np.median(c / np.maximum(f32c, 1e-9))),
                    "ms": 1e3 * float(np.median(w)), "first_call_s": first[bits],
                    "ratio_f32": float(np.median(w / wall["f32"])), "ratio_f32i": float(np.median(w / wall["f32i"])),
                    "cpu_ratio_f32": float(np.median(c / np.maximum(cpu["f32"], 1e-9))),
                    "cpu_ratio_f32i": float(np.median(c / np.maximum(cpu["f32i"], 1e-9))),
                }
                row[nm] = r
                print(f"  {nm}: {r['ms']:7.3f} ms; kivi/f32 {r['ratio_f32']:.2f}x, kivi/f32i "
                      f"{r['ratio_f32i']:.2f}x (CPU {r['cpu_ratio_f32']:.2f}x | {r['cpu_ratio_f32i']:.2f}x); "
                      f"first call {r['first_call_s']:.2f} s", flush=True)
            results["rows"][t] = row
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


def rotated_main(argv=None) -> dict:
    """``--rotated``: the attention part of a decode step of ``nnef_kv_rotated_sdpa`` read from its codes
    (:meth:`RotatedSdpa.attend_cache`, numba kernels unless ``NNEF_KV_NO_NUMBA=1``) against exact f32 attention
    (:func:`softmax_attention`, GQA) over the same T tokens, at SmolLM2's shape (3 kv heads x 64, 9 query
    heads) and 8 kv heads x 128 (8 query heads), interleaved rounds as above; the ratio is the median of the
    per-round ratios (< 1: the codes are faster)."""
    from nnef_kv.kv.rotated import RotatedSdpa

    ap = argparse.ArgumentParser(description=rotated_main.__doc__.split("\n")[0])
    ap.add_argument("--rotated", action="store_true")
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lengths", type=int, nargs="*", default=[8192])
    ap.add_argument("--bits", type=int, nargs="*", default=[4, 3, 2])
    ap.add_argument("--json", type=str, default="")
    args = ap.parse_args(argv)
    from threadpoolctl import threadpool_limits

    from nnef_kv.kernels import numba_available

    rng = np.random.default_rng(0)
    results: dict = {"threads": args.threads, "numba": numba_available(), "rows": {}}
    with threadpool_limits(args.threads):
        print(f"BLAS: {blas_info()}; threads={args.threads}; numba kernels: {'on' if results['numba'] else 'off'}; "
              f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        for hkv, hq, d in ((3, 9, 64), (8, 8, 128)):
            for t in args.lengths:
                k = rng.standard_normal((1, hkv, t, d)).astype(np.float32)
                v = rng.standard_normal((1, hkv, t, d)).astype(np.float32)
                q = rng.standard_normal((1, hq, 1, d)).astype(np.float32)
                ops = {}
                for bits in args.bits:
                    op = RotatedSdpa(scale=d ** -0.5, bits=bits, threads=args.threads)
                    for t0 in range(0, t, 1024):
                        op(q[:, :, :0], k[:, :, t0:t0 + 1024], v[:, :, t0:t0 + 1024])
                    t0 = time.perf_counter()
                    op.attend_cache(q)  # the first call: JIT compile or cache load
                    ops[bits] = (op, time.perf_counter() - t0)
                fns = {"f32": lambda: softmax_attention(q, k, v, d ** -0.5)}
                for bits in args.bits:
                    fns[f"rot{bits}"] = (lambda op: lambda: op.attend_cache(q))(ops[bits][0])
                wall, cpu = time_rounds(fns, args.repeat)
                key = f"{hkv}x{d} T={t}"
                row = {"f32_ms": 1e3 * float(np.median(wall["f32"]))}
                print(f"{key} (query heads {hq}): f32 {row['f32_ms']:.3f} ms")
                for bits in args.bits:
                    w, c = wall[f"rot{bits}"], cpu[f"rot{bits}"]
                    r = {"ms": 1e3 * float(np.median(w)), "ratio_f32": float(np.median(w / wall["f32"])),
                         "cpu_ratio_f32": float(np.median(c / np.maximum(cpu["f32"], 1e-9))),
                         "ratio_best": float(w.min() / wall["f32"].min()), "first_call_s": ops[bits][1]}
                    row[f"rot{bits}"] = r
                    print(f"  rotated {bits}-bit: {r['ms']:7.3f} ms; rot/f32 {r['ratio_f32']:.2f}x (CPU "
                          f"{r['cpu_ratio_f32']:.2f}x, best/best {r['ratio_best']:.2f}x); first call "
                          f"{r['first_call_s']:.2f} s", flush=True)
                results["rows"][key] = row
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    if "--rotated" in sys.argv[1:]:
        rotated_main()
    else:
        main()
