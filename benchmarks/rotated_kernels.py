"""Thread-CPU time of the rotated-codebook kernels alone (``nnef_kv.kv.rotated.kernels``: scores and value
sums over packed codes, numba) beside exact f32 attention (``softmax_attention``, one BLAS thread), at T tokens.

Best of ``--repeat`` calls each, thread CPU time (less sensitive to other processes than wall time, not immune).
Shapes: 3 kv heads x 64 with 3 query rows a head (SmolLM2), 8 x 128 with one; bits 4, 3, 2.

Run: ``python benchmarks/rotated_kernels.py [--length 8192] [--repeat 15]``.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nnef_kv.kv.rotated import kernels as RA  # noqa: E402
from nnef_kv.kv import softmax_attention  # noqa: E402
from nnef_kv.kv.rotated.codebooks import codebook  # noqa: E402
from nnef_kv.kv.packing import RowCodec  # noqa: E402


def best(fn, args, repeat: int) -> float:
    out = []
    for _ in range(repeat):
        t = time.thread_time()
        fn(*args)
        out.append(time.thread_time() - t)
    return 1e3 * min(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args(argv)
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(0)
    t = args.length
    with threadpool_limits(1):
        for n, m, d in ((3, 3, 64), (8, 1, 128)):
            k = rng.standard_normal((1, n, t, d)).astype(np.float32)
            v = rng.standard_normal((1, n, t, d)).astype(np.float32)
            q = rng.standard_normal((1, n * m, 1, d)).astype(np.float32)
            exact = best(softmax_attention, (q, k, v, d ** -0.5), args.repeat)
            for bits in (4, 3, 2):
                codes = RowCodec(bits, d).pack(rng.integers(0, 1 << bits, (n, t, d)))
                cb = codebook(bits, d)
                qr = rng.standard_normal((n, m, d)).astype(np.float32)
                norms = rng.random((n, t)).astype(np.float32)
                w = rng.random((n, m, t)).astype(np.float32)
                RA.code_scores.jit(qr, codes, norms, cb, bits, d)  # compile / load the cache
                RA.code_values.jit(w, codes, cb, bits, d)
                s = best(RA.code_scores.jit, (qr, codes, norms, cb, bits, d), args.repeat)
                vv = best(RA.code_values.jit, (w, codes, cb, bits, d), args.repeat)
                print(f"{n} x {d}, {m} rows a head, {bits}-bit, T = {t}: scores {s:.2f} ms, values {vv:.2f} ms, "
                      f"sum {s + vv:.2f} ms; exact f32 attention {exact:.2f} ms ({(s + vv) / exact:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
