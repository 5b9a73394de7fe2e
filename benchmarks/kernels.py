"""The numba kernels of ``nnef_kv.kernels`` against f32 NumPy/BLAS, paired and interleaved.

(a) Q4_0 / Q8_1 weight products (``nnef_kv.kernels.blockquant``) against f32 BLAS with the dequantized
    weights, BLAS pinned to one thread (threadpoolctl): matvec 4096x4096, [512 -> 1536], [512 -> 8192],
    and a few row counts M (decode / short prefill, the BLAS_ROWS crossover).
(b) KIVI decode-step attention on packed codes (``nnef_kv.kv.kivi.kernels.attend``): T tokens,
    8 kv heads x 128, key_group 32, value_group 32 and 128, residual 32, bits 1/2/4/8, one query row a
    head, against exact f32 attention on an f32 cache (NumPy matmul, softmax, matmul on
    ``[8, 1, T]`` scores), on one thread (kernel threads=1, BLAS 1) and two (kernel threads=2, BLAS 2);
    the NumPy path of ``KiviSdpa`` is shown beside for reference.

Every figure is the median over rounds of the per-round ratio ``kernel time / f32 time``, the two sides
timed back to back in each round in alternating order (the machine is shared: pairing cancels most of
the drift). The first call of each kernel (JIT compile, or loading numba's on-disk cache) is timed
separately and printed, and kept out of the figures.

    python benchmarks/kernels.py                 # everything
    python benchmarks/kernels.py --quick         # fewer rounds, T = 2048
    python benchmarks/kernels.py --only kivi     # or: --only weights
    python benchmarks/kernels.py --only q4row    # one-row Q4_0 core, old vs new, SmolLM2-135M shapes
    python benchmarks/kernels.py --only decode   # the decoder-block kernels: attention, RMS, RoPE, gate

(c) ``--only q4row``: the one-row Q4_0 core (the decode step's path) against a copy of the core it replaced
    (``_OLD_Q4_SRC`` below, kept here only), on one thread, on the Q4_0 linears of a SmolLM2-135M-shaped
    decode step: 30 layers of q|k|v [576 -> 960], o [576 -> 576], gate|up [576 -> 3072], down [1536 -> 576],
    then the LM head [576 -> 49152]; random codes and f16 scales (~76 MB, more than the L3), called in the
    step's order so each weight comes from memory. A round runs the whole step with one core then the other
    (alternating which goes first), each call timed; per shape: best over rounds and the median per-round
    ratio old / new.
(d) ``--only decode``: the decode-step kernels against the NumPy calls the plan's fused forms make otherwise
    (their references), one thread: ``kernels.attend`` (SmolLM2-135M's 9 query heads on 3 kv heads x 64, one
    query row, a causal mask row, K/V read in place from a cache buffer with room to grow) at T keys, the
    crossover behind ``attend.MAX_KEYS``; ``kernels.rowwise`` RMS norm (576 wide) and RoPE (9 heads x 64), and
    ``kernels.gate`` (SwiGLU, 1536 wide, the halves of a stacked product) at 1 and 512 rows; a 512-token
    prefill's blocks through ``attend.softmax_rows``. The compiled cores are timed (what a plan step calls), the
    references as the plan calls them.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's nnef_kv first

from threadpoolctl import threadpool_limits  # noqa: E402

from nnef_kv.tensors.blockquant import BlockQuantTensor  # noqa: E402
from nnef_kv.kernels import blockquant as bq  # noqa: E402
from nnef_kv.kv.kivi import kernels as ka  # noqa: E402
from nnef_kv.kernels import numba_available  # noqa: E402
from nnef_kv.kv.kivi import KiviSdpa  # noqa: E402


def paired(a: Callable[[], object], b: Callable[[], object], rounds: int, inner: int = 1) -> tuple[float, float, float]:
    """Median of per-round ratios time(b) / time(a), with the medians of both times (seconds); the order
    of a and b alternates from round to round; ``inner`` calls a side per timing."""
    ta, tb, ratios = [], [], []
    for i in range(rounds):
        order = (a, b) if i % 2 == 0 else (b, a)
        t = {}
        for f in order:
            t0 = time.perf_counter()
            for _ in range(inner):
                f()
            t[f] = (time.perf_counter() - t0) / inner
        ta.append(t[a])
        tb.append(t[b])
        ratios.append(t[b] / t[a])
    return float(np.median(ratios)), float(np.median(ta)), float(np.median(tb))


def first_call(f: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


# ============================================================================ (a) weights
def bench_weights(rounds: int) -> None:
    print("== (a) block-quantized weight products, y = x @ W.T, BLAS on 1 thread ==")
    rng = np.random.default_rng(0)
    shapes = [(4096, 4096), (1536, 512), (8192, 512)]  # (N outputs, K inputs)
    jit_printed = set()
    with threadpool_limits(1):
        for fmt in ("Q4_0", "Q8_1"):
            for n, k in shapes:
                w = rng.standard_normal((n, k)).astype(np.float32)
                t = BlockQuantTensor.quantize_q4_0(w) if fmt == "Q4_0" else BlockQuantTensor.quantize_q8_1(w)
                p = bq.repack(t)
                wd = np.ascontiguousarray(t.dequantize().reshape(n, k))
                x = rng.standard_normal(k).astype(np.float32)
                if fmt not in jit_printed:
                    print(
                        f"  {fmt} first call (JIT compile or cache load): {first_call(lambda: bq.matvec(p, x)):.2f} s"
                    )
                    jit_printed.add(fmt)
                np.testing.assert_allclose(bq.matvec(p, x), wd @ x, rtol=1e-3, atol=1e-3)
                inner = max(1, int(2e6 // (n * k)))
                r, tf, tk = paired(lambda: wd @ x, lambda: bq.matvec(p, x), rounds, inner)
                print(f"  {fmt} matvec [{k} -> {n}]: f32 gemv {tf * 1e3:7.3f} ms, kernel {tk * 1e3:7.3f} ms, "
                      f"kernel/f32 = {r:.2f}  ({p.bits_per_weight:.2f} bits a weight)")
            n = k = 4096
            w = rng.standard_normal((n, k)).astype(np.float32)
            t = BlockQuantTensor.quantize_q4_0(w) if fmt == "Q4_0" else BlockQuantTensor.quantize_q8_1(w)
            p = bq.repack(t)
            wd = np.ascontiguousarray(t.dequantize().reshape(n, k))
            for m in (2, 4, 8, 16, 32, 64):
                x = rng.standard_normal((m, k)).astype(np.float32)
                saved = dict(bq.BLAS_ROWS)
                try:
                    bq.BLAS_ROWS[fmt] = 1 << 30
                    first_call(lambda: bq.matmul.jit(p, x))
                    r1, tf, t1 = paired(lambda: x @ wd.T, lambda: bq.matmul.jit(p, x), max(3, rounds // 3))
                    bq.BLAS_ROWS[fmt] = 0
                    first_call(lambda: bq.matmul.jit(p, x))
                    r2, _, t2 = paired(lambda: x @ wd.T, lambda: bq.matmul.jit(p, x), max(3, rounds // 3))
                finally:
                    bq.BLAS_ROWS.update(saved)
                print(f"  {fmt} matmul M={m:3d} [4096 -> 4096]: f32 {tf * 1e3:7.2f} ms; row kernel/f32 = {r1:.2f}, "
                      f"tiles+BLAS/f32 = {r2:.2f}  (rows {t1 * 1e3:.2f} ms, tiles {t2 * 1e3:.2f} ms; "
                      f"BLAS_ROWS = {bq.BLAS_ROWS[fmt]})")


# ============================================================================ (c) one-row Q4_0 core
def _old_q4_core():
    """The one-row core replaced on branch q4-kernel, compiled from the copy below (not cached)."""
    from numba import njit

    from nnef_kv.kernels._blockquant_jit import _F8
    from nnef_kv.kernels._numba_common import JIT, h2f, wide_vectors

    @njit(**dict(JIT, cache=False))
    def _tile(n, m):
        t = max(64, min(2048, 8192 // max(1, m))) // 16 * 16
        return min(t, n)

    g = {"np": np, "njit": njit, "JIT": dict(JIT, cache=False), "h2f": h2f, "wide_vectors": wide_vectors,
         "_F8": _F8, "_tile": _tile}
    exec(compile(_OLD_Q4_SRC, "<_q4_rows_old>", "exec"), g)
    return g["_q4_rows_old"]


_OLD_Q4_SRC = """
@njit(**JIT)
def _q4_rows_old(codes, sbits, x, y):
    # the Q4_0 row core before branch q4-kernel (one row: four byte rows a pass into tmp)
    wide_vectors()
    k2, n = codes.shape
    m_rows = x.shape[0]
    nb = k2 // 16
    tw = _tile(n, m_rows)
    acc = np.empty((m_rows, tw), np.float32)
    tmp = np.empty((m_rows, tw), np.float32)
    sc = np.empty(tw, np.float32)
    lo = np.empty(tw, np.float32)
    hi = np.empty(tw, np.float32)
    for n0 in range(0, n, tw):
        n1 = min(n, n0 + tw)
        w = n1 - n0
        acc[:, :w] = 0.0
        for b in range(nb):
            tmp[:, :w] = 0.0
            if m_rows == 1:  # four byte rows (eight inputs) a pass
                t0 = tmp[0]
                for r in range(b * 16, b * 16 + 16, 4):
                    s0 = codes[r, n0:n1]
                    s1 = codes[r + 1, n0:n1]
                    s2 = codes[r + 2, n0:n1]
                    s3 = codes[r + 3, n0:n1]
                    xa = x[0, 2 * r]
                    xb = x[0, 2 * r + 1]
                    xc = x[0, 2 * r + 2]
                    xd = x[0, 2 * r + 3]
                    xe = x[0, 2 * r + 4]
                    xf = x[0, 2 * r + 5]
                    xg = x[0, 2 * r + 6]
                    xh = x[0, 2 * r + 7]
                    for j in range(w):
                        c = np.uint32(s0[j])
                        e = np.uint32(s1[j])
                        f = np.uint32(s2[j])
                        g = np.uint32(s3[j])
                        t0[j] += (((xa * (np.float32(np.int32(c & np.uint32(15))) - _F8)
                                    + xb * (np.float32(np.int32(c >> np.uint32(4))) - _F8))
                                   + (xc * (np.float32(np.int32(e & np.uint32(15))) - _F8)
                                      + xd * (np.float32(np.int32(e >> np.uint32(4))) - _F8)))
                                  + ((xe * (np.float32(np.int32(f & np.uint32(15))) - _F8)
                                      + xf * (np.float32(np.int32(f >> np.uint32(4))) - _F8))
                                     + (xg * (np.float32(np.int32(g & np.uint32(15))) - _F8)
                                        + xh * (np.float32(np.int32(g >> np.uint32(4))) - _F8))))
            else:
                for r in range(b * 16, b * 16 + 16):
                    s0 = codes[r, n0:n1]
                    for j in range(w):  # decode once, use for every row
                        c = np.uint32(s0[j])
                        lo[j] = np.float32(np.int32(c & np.uint32(15))) - _F8
                        hi[j] = np.float32(np.int32(c >> np.uint32(4))) - _F8
                    for m in range(m_rows):
                        xa = x[m, 2 * r]
                        xb = x[m, 2 * r + 1]
                        tm = tmp[m]
                        for j in range(w):
                            tm[j] += xa * lo[j] + xb * hi[j]
            s = sbits[b, n0:n1]
            for j in range(w):
                sc[j] = h2f(s[j])
            for m in range(m_rows):
                am = acc[m]
                tm = tmp[m]
                for j in range(w):
                    am[j] += sc[j] * tm[j]
        y[:, n0:n1] = acc[:, :w]

"""

#: a SmolLM2-135M decode step's Q4_0 products (name, N outputs, K inputs): a layer's, then the LM head
SMOL_LAYER = [("q|k|v", 960, 576), ("o", 576, 576), ("gate|up", 3072, 576), ("down", 576, 1536)]
SMOL_HEAD = ("head", 49152, 576)


def bench_q4_row(rounds: int, layers: int = 30) -> None:
    from nnef_kv.kernels._blockquant_jit import _q4_row

    old_core = _old_q4_core()
    print(f"== (c) one-row Q4_0 core, old vs new ({_q4_row.py_func.__name__}), SmolLM2-135M step ({layers} layers "
          f"+ LM head), 1 thread ==")
    rng = np.random.default_rng(0)
    weights = []
    for name, n, k in SMOL_LAYER * layers + [SMOL_HEAD]:
        weights.append((name, rng.integers(0, 256, (k // 2, n), dtype=np.uint8),
                        (rng.standard_normal((k // 32, n)) * 0.02).astype(np.float16).view(np.uint16)))
    xs = {k: rng.standard_normal(k).astype(np.float32) for k in {s[2] for s in SMOL_LAYER + [SMOL_HEAD]}}
    mb = sum(c.nbytes + s.nbytes for _, c, s in weights) / 1e6

    def new(c, s, x, y):
        _q4_row(c, s, x, y)

    def old(c, s, x, y):
        old_core(c, s, x.reshape(1, -1), y.reshape(1, -1))

    for _, c, s in weights[:4] + weights[-1:]:  # compile / load, and the two agree
        x = xs[c.shape[0] * 2]
        y0, y1 = np.empty(c.shape[1], np.float32), np.empty(c.shape[1], np.float32)
        old(c, s, x, y0)
        new(c, s, x, y1)
        np.testing.assert_allclose(y1, y0, rtol=1e-4, atol=1e-4 * float(np.abs(y0).max()))

    def step(f) -> dict[str, float]:
        t: dict[str, float] = {}
        for nm, c, s in weights:
            x, y = xs[c.shape[0] * 2], np.empty(c.shape[1], np.float32)
            t0 = time.perf_counter()
            f(c, s, x, y)
            t[nm] = t.get(nm, 0.0) + time.perf_counter() - t0
        t["step"] = sum(t.values())
        return t

    print(f"  weights {mb:.1f} MB; load average before: {os.getloadavg()}")
    res: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    for i in range(rounds):
        for nm, f in ((("old", old), ("new", new)) if i % 2 == 0 else (("new", new), ("old", old))):
            res[nm].append(step(f))
    for key in [s[0] for s in SMOL_LAYER] + [SMOL_HEAD[0], "step"]:
        bo = min(t[key] for t in res["old"]) * 1e3
        bn = min(t[key] for t in res["new"]) * 1e3
        ratio = float(np.median([a[key] / b[key] for a, b in zip(res["old"], res["new"])]))
        mw = sum(c.size * 2 for nm, c, _ in weights if key in (nm, "step")) / 1e6
        print(f"  {key:8s} {mw:6.1f} M weights: old {bo:6.2f} ms, new {bn:6.2f} ms (best of {rounds}); "
              f"old/new median {ratio:.2f}x, best {bo / bn:.2f}x; new {mw / bn:.1f} G weights/s")
    print(f"  load average after: {os.getloadavg()}")


# ============================================================================== (b) KIVI
def make_cache(t: int, bits: int, value_group: int, hkv: int = 8, d: int = 128, seed: int = 0) -> KiviSdpa:
    rng = np.random.default_rng(seed)
    sd = KiviSdpa(bits=bits, key_group=32, value_group=value_group, residual=32, sinks=0)
    k = rng.standard_normal((1, hkv, t, d)).astype(np.float32)
    v = rng.standard_normal((1, hkv, t, d)).astype(np.float32)
    q = rng.standard_normal((1, hkv, 1, d)).astype(np.float32)
    for t0 in range(0, t, 1024):  # prefill in chunks of 1024 tokens, one query row each
        sd(q, k[:, :, t0:t0 + 1024], v[:, :, t0:t0 + 1024])
    return sd


def f32_attention(q: np.ndarray, kf: np.ndarray, vf: np.ndarray, scale: float) -> np.ndarray:
    s = np.matmul(q * np.float32(scale), kf.swapaxes(-1, -2))  # [n, 1, T]
    s -= s.max(axis=-1, keepdims=True)
    p = np.exp(s, out=s)
    out = np.matmul(p, vf)
    return out / p.sum(axis=-1, keepdims=True)


def bench_kivi(t: int, rounds: int, bit_list: list[int], groups: list[int], rows: int = 1) -> None:
    print(f"== (b) KIVI decode attention, T = {t}, 8 kv heads x 128, key_group 32, residual 32, "
          f"M = {rows} query row(s) a kv head ==")
    rng = np.random.default_rng(1)
    hkv, d = 8, 128
    kf = rng.standard_normal((hkv, t, d)).astype(np.float32)
    vf = rng.standard_normal((hkv, t, d)).astype(np.float32)
    q = rng.standard_normal((hkv, rows, d)).astype(np.float32)
    jit_done = False
    for vg in groups:
        for bits in bit_list:
            sd = make_cache(t, bits, vg)
            assert ka.unsupported_reason(sd, rows) is None
            if not jit_done:
                for nth in (1, 2):
                    print(f"  first call (JIT compile or cache load), threads={nth}: "
                          f"{first_call(lambda: ka.attend.jit(sd, q, 1, nth)):.2f} s")
                jit_done = True
            ka.attend.jit(sd, q, 1, 2)
            ref = sd._attend(q, 1)
            got = ka.attend.jit(sd, q, 1, 1)
            err = float(np.abs(got - ref).max())
            cells = []
            for nth in (1, 2):
                with threadpool_limits(nth):
                    r, tf, tk = paired(lambda: f32_attention(q, kf, vf, 0.125),
                                       lambda: ka.attend.jit(sd, q, 1, nth), rounds)
                    sd.threads = nth
                    rn, _, tn = paired(lambda: f32_attention(q, kf, vf, 0.125), lambda: sd._attend(q, 1),
                                       max(3, rounds // 2))
                    sd.threads = 1
                cells.append(f"{nth} thr: f32 {tf * 1e3:6.2f} ms, kernel {tk * 1e3:6.2f} ms = {r:.2f}x "
                             f"(NumPy path {rn:.2f}x)")
            print(f"  {bits} bits, value_group {vg:3d}: " + " | ".join(cells) + f"  max|diff| vs NumPy {err:.1e}")


def bench_parallel(t: int, rounds: int) -> None:
    """threads=2 against threads=1 for each way of splitting the heads (4 bits), each mode in its own
    process: numba's OpenMP workers spin after a prange call and would slow whatever runs next."""
    import subprocess
    print(f"== splitting the 8 kv heads over 2 threads, 4 bits, value_group 32, T = {t} "
          f"(each mode in a fresh process) ==")
    for mode in ("pool", "prange"):
        out = subprocess.run([sys.executable, __file__, "--speedup", mode, "--tokens", str(t), "--rounds", str(rounds)],
                             capture_output=True, text=True)
        print("  " + (out.stdout.strip() or out.stderr.strip()[-500:]))


def speedup(mode: str, t: int, rounds: int) -> None:
    from nnef_kv.kv.kivi import _jit as kj
    kj.PARALLEL = mode
    rng = np.random.default_rng(2)
    q = rng.standard_normal((8, 1, 128)).astype(np.float32)
    sd = make_cache(t, 4, 32)
    jt = first_call(lambda: ka.attend.jit(sd, q, 1, 2))
    ka.attend.jit(sd, q, 1, 1)
    with threadpool_limits(1):
        r, t1, t2 = paired(lambda: ka.attend.jit(sd, q, 1, 1), lambda: ka.attend.jit(sd, q, 1, 2), rounds)
    print(f"{mode:6s}: threads=1 {t1 * 1e3:.2f} ms, threads=2 {t2 * 1e3:.2f} ms, 2 threads / 1 thread = {r:.2f} "
          f"(first call with threads=2: {jt:.2f} s)")


# ============================================================================ (d) decode-step kernels
def bench_decode(rounds: int) -> None:
    from nnef_kv.kernels import attend, gate, rowwise

    rng = np.random.default_rng(0)
    inner = 50
    print("\n== decode-step kernels vs the NumPy calls they stand for (one thread; us a call, median of paired "
          "rounds; ratio = NumPy / kernel)")
    for t in (16, 64, 256, 1024, 2048, 4096):
        q = rng.standard_normal((1, 9, 1, 64)).astype(np.float32)
        kb = rng.standard_normal((1, 3, t + 64, 64)).astype(np.float32)
        vb = rng.standard_normal((1, 3, t + 64, 64)).astype(np.float32)
        k, v = kb[:, :, :t], vb[:, :, :t]
        mask = np.zeros((1, 1, 1, t), np.float32)
        sc = np.float32(0.125)
        out, ref = np.empty((1, 9, 1, 64), np.float32), np.empty((1, 9, 1, 64), np.float32)
        attend.attend_rows(q, k, v, mask, 3, sc, out)
        core = attend.attend_rows.hot()
        r, tk, tn = paired(lambda: core(q, k, v, mask, 3, sc, True, out),
                           lambda: attend.attend_rows.reference(q, k, v, mask, 3, sc, ref), rounds, inner)
        print(f"attention, 9 heads on 3 kv heads x 64, T = {t:5d}: kernel {tk * 1e6:7.1f} us, NumPy {tn * 1e6:7.1f} "
              f"us: {r:.2f}x")
    for rows in (1, 512):
        x = rng.standard_normal((rows, 576)).astype(np.float32)
        w = rng.standard_normal(576).astype(np.float32)
        y = np.empty_like(x)
        rowwise.rms_rows(x, np.float32(1e-5), w, y)
        rms = rowwise.rms_rows.hot()
        r, tk, tn = paired(lambda: rms(x, np.float32(1e-5), w, y),
                           lambda: rowwise.rms_rows.reference(x, np.float32(1e-5), w, y), rounds, inner)
        print(f"RMS norm, {rows:3d} x 576: kernel {tk * 1e6:7.1f} us, NumPy {tn * 1e6:7.1f} us: {r:.2f}x")
        xr = rng.standard_normal((1, 9, rows, 64)).astype(np.float32)
        cs = rng.standard_normal((1, 1, rows, 64)).astype(np.float32)
        o = np.empty_like(xr)
        rowwise.rope_half(xr, cs, cs, o)
        rope = rowwise.rope_half.hot()
        r, tk, tn = paired(lambda: rope(xr, cs, cs, o), lambda: rowwise.rope_half.reference(xr, cs, cs, o),
                           rounds, inner)
        print(f"RoPE, 9 heads x {rows:3d} x 64: kernel {tk * 1e6:7.1f} us, NumPy {tn * 1e6:7.1f} us: {r:.2f}x")
        gu = rng.standard_normal((rows, 3072)).astype(np.float32)
        g, u = gu[:, :1536], gu[:, 1536:]  # the halves of a stacked gate|up product, as the plan has them
        go, gr = np.empty((rows, 1536), np.float32), np.empty((rows, 1536), np.float32)
        gate.silu_gate(g, u, go)
        silu = gate.silu_gate.hot()
        r, tk, tn = paired(lambda: silu(g, u, go), lambda: gate.silu_gate.reference(g, u, gr), rounds, inner)
        print(f"SwiGLU gate, {rows:3d} x 1536: kernel {tk * 1e6:7.1f} us, NumPy {tn * 1e6:7.1f} us: {r:.2f}x")
    # a 512-token prefill's attention blocks: 32 query rows of 9 heads over the keys they see, causal mask
    mask = np.where(np.triu(np.ones((512, 512), bool), 1), np.float32(-3.4e38), np.float32(0))[None, None]
    scores = {i0: rng.standard_normal((1, 9, 32, i0 + 32)).astype(np.float32) * 8 for i0 in range(0, 512, 32)}
    work = {i0: s.copy() for i0, s in scores.items()}
    sc = np.float32(0.125)
    attend.softmax_rows(work[0], mask[:, :, :32, :32], sc)
    smx = attend.softmax_rows.hot()

    def blocks(kernel: bool) -> None:
        for i0, s in scores.items():
            w = work[i0]
            np.copyto(w, s)
            mb = mask[:, :, i0:i0 + 32, :i0 + 32]
            if kernel:
                smx(w, mb, sc, True)
            else:
                attend.softmax_rows.reference(w, mb, sc)
    r, tk, tn = paired(lambda: blocks(True), lambda: blocks(False), rounds, 1)
    print(f"block softmax, a 512-token prefill's 16 blocks of 9 x 32 rows (copies included): kernel "
          f"{tk * 1e3:6.2f} ms, NumPy {tn * 1e3:6.2f} ms a layer: {r:.2f}x")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds, T = 2048")
    ap.add_argument("--only", choices=["weights", "kivi", "q4row", "decode"], default=None)
    ap.add_argument("--rounds", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=0)
    ap.add_argument("--parallel", choices=["pool", "prange"], default=None,
                    help="how the KIVI kernels split heads over threads (default: nnef_kv.kv.kivi._jit.PARALLEL)")
    ap.add_argument("--bits", default="1,2,4,8", help="KIVI bit widths, comma-separated (default 1,2,4,8)")
    ap.add_argument("--groups", default="32,128", help="KIVI value groups, comma-separated (default 32,128)")
    ap.add_argument("--rows", type=int, default=1, help="query rows a kv head (GQA group), default 1")
    ap.add_argument("--speedup", choices=["pool", "prange"], default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not numba_available():
        print("numba is not available (or NNEF_KV_NO_NUMBA=1): nothing to measure")
        return 1
    rounds = args.rounds or (7 if args.quick else 21)
    t = args.tokens or (2048 if args.quick else 8192)
    if args.speedup:
        speedup(args.speedup, t, rounds)
        return 0
    from nnef_kv.kv.kivi import _jit as kj
    kj.PARALLEL = args.parallel or kj.PARALLEL
    print(f"load average before: {os.getloadavg()}; KIVI heads split by: {kj.PARALLEL}")
    if args.only in (None, "weights"):
        bench_weights(rounds)
    if args.only in (None, "q4row"):
        with threadpool_limits(1):
            bench_q4_row(rounds)
    if args.only in (None, "decode"):
        with threadpool_limits(1):
            bench_decode(rounds)
    if args.only in (None, "kivi"):
        bench_kivi(t, rounds, [int(b) for b in args.bits.split(",")], [int(g) for g in args.groups.split(",")],
                   args.rows)
        bench_parallel(t, rounds)
    print(f"load average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
