"""numba side of :mod:`nnef_kv.kv.kivi.kernels` (imported on first use; see that module for the
layout, the loops and why the key core alone has ``fastmath={"reassoc"}``)."""
from __future__ import annotations

import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np
from numba import njit, prange

from ...kernels._numba_common import JIT, JIT_REASSOC, as_f32_or_u16, exp_nonpositive, fetch_add, wide_vectors, widen
from ..common import causal_keep, softmax_numerators
from .kernels import _check_codec, cache_arrays, unsupported_reason
from .kernels import attend as _attend_kernel

__all__ = ["key_scores", "value_sum", "decode_attention", "attend", "PARALLEL"]

def _prange_is_safe() -> bool:
    """numba's threading layer will be OpenMP or TBB (thread-safe); not the workqueue layer, which
    aborts the process when two Python threads enter parallel code at once."""
    import importlib

    import numba

    layer = str(numba.config.THREADING_LAYER).lower()
    if layer == "workqueue":
        return False
    for mod in ("numba.np.ufunc.tbbpool", "numba.np.ufunc.omppool"):
        try:
            importlib.import_module(mod)
            return True
        except Exception:  # pragma: no cover - depends on the installation
            continue
    return False  # pragma: no cover


#: how ``threads > 1`` splits the kv heads: "pool" (the calling thread and pool threads claim heads one
#: at a time from an atomic counter inside one nogil call each; a head no helper has claimed when the
#: caller runs out is the caller's, so a descheduled helper costs at most the head it holds) or "prange" (numba
#: ``parallel=True`` loops over the heads, OpenMP or TBB). With the other core busy, prange's
#: spinning OpenMP workers make a step many times slower than one thread, where the claiming pool stays
#: near one thread's time (benchmarks/kernels.py; docs/benchmarks.md). Default: the pool;
#: ``NNEF_KV_KIVI_PARALLEL=prange`` selects prange (when the threading layer is thread-safe).
PARALLEL = "prange" if os.environ.get("NNEF_KV_KIVI_PARALLEL", "").strip() == "prange" and _prange_is_safe() \
    else "pool"

#: a decode step is split over threads only when it reads at least this many positions x query rows x head
#: dims (all kv heads): below, waking a helper costs more than it saves (``benchmarks/kv_speed.py --threads 1``
#: / ``--threads 2``; the figures: docs/benchmarks.md, "Where the code's thresholds come from").
SPLIT_WORK = 3 << 20


# ===================================================================================== keys
@njit(**JIT_REASSOC)
def _key_head(q, codes, kmin, kstep, bits, kg, tq, out, off, qs):
    """One kv head: q [M, D] f32, codes [>= Tq, D/per] u8 (the first Tq rows are read), kmin/kstep
    [>= Tq/kg, D] (f32 or f16 bits); scores into out[:, off:off + Tq] (out [M, >= off + Tq] f32); qs a
    [D] f32 scratch."""
    wide_vectors()
    m_rows, d = q.shape
    per = 8 // bits
    sub = kg // per
    rb = d // per
    flat = codes.reshape(-1)
    for g in range(tq // kg):
        t0 = g * kg
        base = t0 * rb
        for m in range(m_rows):
            qm = q[m]
            om = out[m, off:off + tq]
            qmin = np.float32(0.0)
            for c in range(d):
                qs[c] = qm[c] * widen(kstep[g, c])
                qmin += qm[c] * widen(kmin[g, c])
            if bits == 4:
                for r in range(sub):
                    row = flat[base + r * d:base + (r + 1) * d]
                    a0 = np.float32(0.0)
                    a1 = np.float32(0.0)
                    for c in range(d):
                        b = np.uint32(row[c])
                        w = qs[c]
                        a0 += w * np.float32(np.int32(b & np.uint32(15)))
                        a1 += w * np.float32(np.int32(b >> np.uint32(4)))
                    om[t0 + r] = a0 + qmin
                    om[t0 + sub + r] = a1 + qmin
            elif bits == 8:
                for r in range(kg):
                    row = flat[base + r * d:base + (r + 1) * d]
                    a0 = np.float32(0.0)
                    for c in range(d):
                        a0 += qs[c] * np.float32(np.int32(row[c]))
                    om[t0 + r] = a0 + qmin
            elif bits == 2:
                for r in range(sub):
                    row = flat[base + r * d:base + (r + 1) * d]
                    a0 = np.float32(0.0)
                    a1 = np.float32(0.0)
                    a2 = np.float32(0.0)
                    a3 = np.float32(0.0)
                    for c in range(d):
                        b = np.uint32(row[c])
                        w = qs[c]
                        a0 += w * np.float32(np.int32(b & np.uint32(3)))
                        a1 += w * np.float32(np.int32((b >> np.uint32(2)) & np.uint32(3)))
                        a2 += w * np.float32(np.int32((b >> np.uint32(4)) & np.uint32(3)))
                        a3 += w * np.float32(np.int32(b >> np.uint32(6)))
                    om[t0 + r] = a0 + qmin
                    om[t0 + sub + r] = a1 + qmin
                    om[t0 + 2 * sub + r] = a2 + qmin
                    om[t0 + 3 * sub + r] = a3 + qmin
            else:  # 1 bit
                for r in range(sub):
                    row = flat[base + r * d:base + (r + 1) * d]
                    a0 = np.float32(0.0)
                    a1 = np.float32(0.0)
                    a2 = np.float32(0.0)
                    a3 = np.float32(0.0)
                    a4 = np.float32(0.0)
                    a5 = np.float32(0.0)
                    a6 = np.float32(0.0)
                    a7 = np.float32(0.0)
                    for c in range(d):
                        b = np.uint32(row[c])
                        w = qs[c]
                        a0 += w * np.float32(np.int32(b & np.uint32(1)))
                        a1 += w * np.float32(np.int32((b >> np.uint32(1)) & np.uint32(1)))
                        a2 += w * np.float32(np.int32((b >> np.uint32(2)) & np.uint32(1)))
                        a3 += w * np.float32(np.int32((b >> np.uint32(3)) & np.uint32(1)))
                        a4 += w * np.float32(np.int32((b >> np.uint32(4)) & np.uint32(1)))
                        a5 += w * np.float32(np.int32((b >> np.uint32(5)) & np.uint32(1)))
                        a6 += w * np.float32(np.int32((b >> np.uint32(6)) & np.uint32(1)))
                        a7 += w * np.float32(np.int32(b >> np.uint32(7)))
                    om[t0 + r] = a0 + qmin
                    om[t0 + sub + r] = a1 + qmin
                    om[t0 + 2 * sub + r] = a2 + qmin
                    om[t0 + 3 * sub + r] = a3 + qmin
                    om[t0 + 4 * sub + r] = a4 + qmin
                    om[t0 + 5 * sub + r] = a5 + qmin
                    om[t0 + 6 * sub + r] = a6 + qmin
                    om[t0 + 7 * sub + r] = a7 + qmin


@njit(**JIT)
def _key_heads(h0, h1, q, codes, kmin, kstep, bits, kg, tq, out, off):
    qs = np.empty(q.shape[2], np.float32)
    for h in range(h0, h1):
        _key_head(q[h], codes[h], kmin[h], kstep[h], bits, kg, tq, out[h], off, qs)


# =================================================================================== values
@njit(**JIT_REASSOC)
def _value_weights(pm, vmin, vstep, tq, pw, base):
    """pw[t, j] = p[t] * step[t, j] (the value step folded into the weights: the reference's products)
    and base[j] = sum_t p[t] * min[t, j], t < tq (a dot product: ``reassoc`` lets it vectorise)."""
    wide_vectors()
    nvg = vstep.shape[1]
    for j in range(nvg):
        acc = np.float32(0.0)
        for t in range(tq):
            v = pm[t]
            pw[t, j] = v * widen(vstep[t, j])
            acc += v * widen(vmin[t, j])
        base[j] = acc


@njit(**JIT)
def _values8(flat, pw, tq, d, vg, om):
    """om[c] += sum_t pw[t, j(c)] * code[t, c], 8-bit codes (plain [Tq, D] bytes), two tokens a pass."""
    wide_vectors()
    nvg = d // vg
    t = 0
    while t + 1 < tq:
        for j in range(nvg):
            c0 = j * vg
            w0 = pw[t, j]
            w1 = pw[t + 1, j]
            r0 = flat[t * d + c0:t * d + c0 + vg]
            r1 = flat[(t + 1) * d + c0:(t + 1) * d + c0 + vg]
            oj = om[c0:c0 + vg]
            for c in range(vg):
                oj[c] += w0 * np.float32(np.int32(r0[c])) + w1 * np.float32(np.int32(r1[c]))
        t += 2
    if t < tq:
        for j in range(nvg):
            c0 = j * vg
            w0 = pw[t, j]
            r0 = flat[t * d + c0:t * d + c0 + vg]
            oj = om[c0:c0 + vg]
            for c in range(vg):
                oj[c] += w0 * np.float32(np.int32(r0[c]))


@njit(**JIT)
def _values4(flat, pw, tq, d, kg, vg, om):
    """4-bit token-planar groups: byte row r of a group holds tokens r (low) and r + kg/2 (high); two
    byte rows a pass."""
    wide_vectors()
    nvg = d // vg
    sub = kg // 2
    for g in range(tq // kg):
        t0 = g * kg
        gb = t0 * (d // 2)
        r = 0
        while r + 1 < sub:
            ra = flat[gb + r * d:gb + (r + 1) * d]
            rb = flat[gb + (r + 1) * d:gb + (r + 2) * d]
            ta = t0 + r
            for j in range(nvg):
                c0 = j * vg
                w0 = pw[ta, j]
                w1 = pw[ta + sub, j]
                w2 = pw[ta + 1, j]
                w3 = pw[ta + 1 + sub, j]
                ra_j = ra[c0:c0 + vg]
                rb_j = rb[c0:c0 + vg]
                oj = om[c0:c0 + vg]
                for c in range(vg):
                    b = np.uint32(ra_j[c])
                    e = np.uint32(rb_j[c])
                    oj[c] += ((w0 * np.float32(np.int32(b & np.uint32(15)))
                               + w1 * np.float32(np.int32(b >> np.uint32(4))))
                              + (w2 * np.float32(np.int32(e & np.uint32(15)))
                                 + w3 * np.float32(np.int32(e >> np.uint32(4)))))
            r += 2
        if r < sub:
            ra = flat[gb + r * d:gb + (r + 1) * d]
            ta = t0 + r
            for j in range(nvg):
                c0 = j * vg
                w0 = pw[ta, j]
                w1 = pw[ta + sub, j]
                ra_j = ra[c0:c0 + vg]
                oj = om[c0:c0 + vg]
                for c in range(vg):
                    b = np.uint32(ra_j[c])
                    oj[c] += (w0 * np.float32(np.int32(b & np.uint32(15)))
                              + w1 * np.float32(np.int32(b >> np.uint32(4))))


@njit(**JIT)
def _values2(flat, pw, tq, d, kg, vg, om):
    """2-bit token-planar groups: byte row r holds tokens r + i * kg/4 in bit field i."""
    wide_vectors()
    nvg = d // vg
    sub = kg // 4
    for g in range(tq // kg):
        t0 = g * kg
        gb = t0 * (d // 4)
        for r in range(sub):
            ra = flat[gb + r * d:gb + (r + 1) * d]
            ta = t0 + r
            for j in range(nvg):
                c0 = j * vg
                w0 = pw[ta, j]
                w1 = pw[ta + sub, j]
                w2 = pw[ta + 2 * sub, j]
                w3 = pw[ta + 3 * sub, j]
                ra_j = ra[c0:c0 + vg]
                oj = om[c0:c0 + vg]
                for c in range(vg):
                    b = np.uint32(ra_j[c])
                    oj[c] += ((w0 * np.float32(np.int32(b & np.uint32(3)))
                               + w1 * np.float32(np.int32((b >> np.uint32(2)) & np.uint32(3))))
                              + (w2 * np.float32(np.int32((b >> np.uint32(4)) & np.uint32(3)))
                                 + w3 * np.float32(np.int32(b >> np.uint32(6)))))


@njit(**JIT)
def _values1(flat, pw, tq, d, kg, vg, om):
    """1-bit token-planar groups: byte row r holds tokens r + i * kg/8 in bit i."""
    wide_vectors()
    nvg = d // vg
    sub = kg // 8
    for g in range(tq // kg):
        t0 = g * kg
        gb = t0 * (d // 8)
        for r in range(sub):
            ra = flat[gb + r * d:gb + (r + 1) * d]
            ta = t0 + r
            for j in range(nvg):
                c0 = j * vg
                w0 = pw[ta, j]
                w1 = pw[ta + sub, j]
                w2 = pw[ta + 2 * sub, j]
                w3 = pw[ta + 3 * sub, j]
                w4 = pw[ta + 4 * sub, j]
                w5 = pw[ta + 5 * sub, j]
                w6 = pw[ta + 6 * sub, j]
                w7 = pw[ta + 7 * sub, j]
                ra_j = ra[c0:c0 + vg]
                oj = om[c0:c0 + vg]
                for c in range(vg):
                    b = np.uint32(ra_j[c])
                    oj[c] += ((((w0 * np.float32(np.int32(b & np.uint32(1)))
                                 + w1 * np.float32(np.int32((b >> np.uint32(1)) & np.uint32(1))))
                                + (w2 * np.float32(np.int32((b >> np.uint32(2)) & np.uint32(1)))
                                   + w3 * np.float32(np.int32((b >> np.uint32(3)) & np.uint32(1)))))
                               + ((w4 * np.float32(np.int32((b >> np.uint32(4)) & np.uint32(1)))
                                   + w5 * np.float32(np.int32((b >> np.uint32(5)) & np.uint32(1))))
                                  + (w6 * np.float32(np.int32((b >> np.uint32(6)) & np.uint32(1)))
                                     + w7 * np.float32(np.int32(b >> np.uint32(7)))))))


@njit(**JIT)
def _value_head(p, off, codes, vmin, vstep, bits, kg, vg, tq, out, pw, base):
    """One kv head: weights p[:, off:off + Tq] (p [M, >= off + Tq] f32), codes [>= Tq, D/per] u8 (the
    first Tq rows are read), vmin/vstep [>= Tq, D/vg] (f32 or f16 bits); out [M, D] f32 (overwritten);
    scratch pw [Tq, D/vg] and base [D/vg] f32."""
    m_rows = p.shape[0]
    d = out.shape[1]
    nvg = d // vg
    flat = codes.reshape(-1)
    for m in range(m_rows):
        om = out[m]
        _value_weights(p[m, off:off + tq], vmin, vstep, tq, pw, base)
        om[:] = 0.0
        if bits == 4:
            _values4(flat, pw, tq, d, kg, vg, om)
        elif bits == 8:
            _values8(flat, pw, tq, d, vg, om)
        elif bits == 2:
            _values2(flat, pw, tq, d, kg, vg, om)
        else:
            _values1(flat, pw, tq, d, kg, vg, om)
        for j in range(nvg):
            bj = base[j]
            oj = om[j * vg:(j + 1) * vg]
            for c in range(vg):
                oj[c] += bj


@njit(**JIT)
def _value_heads(h0, h1, p, off, codes, vmin, vstep, bits, kg, vg, tq, out):
    nvg = out.shape[2] // vg
    pw = np.empty((tq, nvg), np.float32)
    base = np.empty(nvg, np.float32)
    for h in range(h0, h1):
        _value_head(p[h], off, codes[h], vmin[h], vstep[h], bits, kg, vg, tq, out[h], pw, base)


# ============================================================ whole attention, per head range
@njit(**JIT_REASSOC)
def _dot_rows(qm, k, n_rows, out, off):
    """out[off + t] = sum_c qm[c] * k[t, c] for t < n_rows (k f32 or f16 bits): sinks and window."""
    wide_vectors()
    d = qm.shape[0]
    for t in range(n_rows):
        kt = k[t]
        acc = np.float32(0.0)
        for c in range(d):
            acc += qm[c] * widen(kt[c])
        out[off + t] = acc


@njit(**JIT)
def _axpy_rows(pm, off, v, n_rows, om):
    """om[c] += sum_t p[off + t] * v[t, c] for t < n_rows (v f32 or f16 bits)."""
    wide_vectors()
    d = om.shape[0]
    for t in range(n_rows):
        w = pm[off + t]
        vt = v[t]
        for c in range(d):
            om[c] += w * widen(vt[c])


@njit(**JIT)
def _scores_heads(h0, h1, q, sink_k, ns, kcodes, kmin, kstep, bits, kg, tq, res_k, nr, s):
    """Scores of heads h0:h1 of every position: s[h, m, :] = [sinks | quantized | window] (q scaled)."""
    qs = np.empty(q.shape[2], np.float32)
    for h in range(h0, h1):
        qh = q[h]
        sh = s[h]
        for m in range(qh.shape[0]):
            if ns:
                _dot_rows(qh[m], sink_k[h], ns, sh[m], 0)
            if nr:
                _dot_rows(qh[m], res_k[h], nr, sh[m], ns + tq)
        if tq:
            _key_head(qh, kcodes[h], kmin[h], kstep[h], bits, kg, tq, sh, ns, qs)


@njit(**JIT)
def _outputs_heads(h0, h1, p, ls, sink_v, ns, vcodes, vmin, vstep, bits, kg, vg, tq, res_v, nr, out):
    """out[h] = (p[h] @ V[h]) / ls[h] for heads h0:h1, V = [sinks | quantized | window]."""
    d = out.shape[2]
    pw = np.empty((max(tq, 1), d // vg), np.float32)
    base = np.empty(d // vg, np.float32)
    for h in range(h0, h1):
        oh = out[h]
        if tq:
            _value_head(p[h], ns, vcodes[h], vmin[h], vstep[h], bits, kg, vg, tq, oh, pw, base)
        else:
            oh[:, :] = 0.0
        for m in range(oh.shape[0]):
            om = oh[m]
            pm = p[h, m]
            if ns:
                _axpy_rows(pm, 0, sink_v[h], ns, om)
            if nr:
                _axpy_rows(pm, ns + tq, res_v[h], nr, om)
            lm = ls[h, m]
            for c in range(d):
                om[c] = om[c] / lm


@njit(**JIT_REASSOC)
def _row_sum(row, n):
    """sum(row[:n]) in lanes (``reassoc``: the sum vectorises)."""
    wide_vectors()
    acc = np.float32(0.0)
    for t in range(n):
        acc += row[t]
    return acc


@njit(**JIT)
def _softmax_head(sh, lh, keep):
    """The softmax numerators of one head's rows, in place on its scores ``sh [M, T]``, and their sums
    ``lh [M]``: the positions outside ``keep`` masked (:func:`~nnef_kv.kv.common.causal_keep`'s ``[M, T]``
    bools; an empty array when nothing is masked), the row's max subtracted, :func:`exp_nonpositive`. False
    (rows left half done) when a row's max is not finite: the reference's rule for that case looks at every
    head at once, the caller recomputes."""
    m_rows, total = sh.shape
    masked = keep.shape[0] > 0
    for m in range(m_rows):
        row = sh[m]
        if masked:
            for t in range(total):
                if not keep[m, t]:
                    row[t] = -np.inf
        mx = np.float32(-np.inf)
        nan = False
        for t in range(total):
            x = row[t]
            nan |= x != x
            mx = x if x > mx else mx
        if nan or not (mx > -np.inf and mx < np.inf):
            return False
        for t in range(total):
            row[t] = exp_nonpositive(row[t] - mx)
        lh[m] = _row_sum(row, total)
    return True


@njit(**JIT)
def _fused_head(h, qs, sk, ns, kcodes, kmin, kstep, bits, kg, tq, rk, nr, sv, vcodes, vmin, vstep, vg, rv, keep,
                s, ls, out, bad):
    """All of kv head h in one call: its scores into s[h], their softmax, its outputs into out[h]
    (bad[h] = 1 instead when a row's max is not finite)."""
    _scores_heads(h, h + 1, qs, sk, ns, kcodes, kmin, kstep, bits, kg, tq, rk, nr, s)
    if not _softmax_head(s[h], ls[h], keep):
        bad[h] = 1
        return
    _outputs_heads(h, h + 1, s, ls, sv, ns, vcodes, vmin, vstep, bits, kg, vg, tq, rv, nr, out)


@njit(**JIT)
def _fused_claim(counter, n, qs, sk, ns, kcodes, kmin, kstep, bits, kg, tq, rk, nr, sv, vcodes, vmin, vstep, vg, rv,
                 keep, s, ls, out, bad):
    """Heads claimed one at a time from the shared ``counter`` (:func:`fetch_add`) until none is left: the
    body of every thread of a decode step, one nogil call each (no GIL taken between heads)."""
    while True:
        h = fetch_add(counter)
        if h >= n:
            return
        _fused_head(h, qs, sk, ns, kcodes, kmin, kstep, bits, kg, tq, rk, nr, sv, vcodes, vmin, vstep, vg, rv, keep,
                    s, ls, out, bad)


@njit(parallel=True, cache=True, nogil=True, error_model="numpy")
def _fused_prange(n, qs, sk, ns, kcodes, kmin, kstep, bits, kg, tq, rk, nr, sv, vcodes, vmin, vstep, vg, rv, keep,
                  s, ls, out, bad):
    for h in prange(n):
        _fused_head(h, qs, sk, ns, kcodes, kmin, kstep, bits, kg, tq, rk, nr, sv, vcodes, vmin, vstep, vg, rv, keep,
                    s, ls, out, bad)


#: the fused cores' ``keep`` when nothing is masked (one array type for numba, so one compiled version)
_NO_MASK = np.ones((0, 0), np.bool_)


# ================================================================================== threads
_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _pool(n: int) -> ThreadPoolExecutor:
    with _pools_lock:
        pool = _pools.get(n)
        if pool is None:
            pool = _pools[n] = ThreadPoolExecutor(max_workers=n, thread_name_prefix="nnef_kv_kernels")
        return pool


def _current_cpu() -> Callable[[], int] | None:
    """``sched_getcpu`` of the C library (the CPU the calling thread runs on), or None where there is none."""
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).sched_getcpu
        fn.restype = ctypes.c_int
        fn.argtypes = []
        return fn if fn() >= 0 else None
    except (OSError, AttributeError):  # pragma: no cover - not glibc / not Linux
        return None


def _allowed_cpus() -> frozenset[int]:
    """The CPUs this process may run on (empty where that cannot be read: then no helper is moved)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux, or a sandbox refusing the call
        return frozenset()


_getcpu = _current_cpu() if hasattr(os, "sched_setaffinity") else None
_allowed = _allowed_cpus() if _getcpu is not None else frozenset()
_pinned = threading.local()


def _avoid_cpu(cpu: int) -> None:
    """Keep the calling (pool) thread off ``cpu``, the CPU the decode step's calling thread is on.

    Measured (a probe timing each thread of a step, BLAS on two threads and an f32 attention before each
    step, 2-vCPU machine): when a helper is woken it is often placed on its waker's CPU (the other one is
    busy with OpenBLAS's spinning idle worker), and it then keeps that CPU until it has run every head
    while the calling thread waits for it: the step takes one thread's time (docs/benchmarks.md, "Where the
    code's thresholds come from").
    A helper that moves itself to another CPU shares that one with the spinner, which yields to it. One
    ``sched_setaffinity`` call when the calling thread's CPU changed, none otherwise; nothing where the
    process may run on one CPU only or the call is refused (a cpuset changed under us)."""
    if cpu < 0 or getattr(_pinned, "avoid", None) == cpu:
        return
    _pinned.avoid = cpu
    others = _allowed - {cpu}
    if others:
        try:
            os.sched_setaffinity(0, others)
        except OSError:  # pragma: no cover - the process's CPU set changed
            pass


def _claim_helper(cpu: int, counter: np.ndarray, n: int, *args: Any) -> None:
    """A pool thread's part of a decode step: off the caller's CPU, then heads from the shared counter."""
    _avoid_cpu(cpu)
    _fused_claim(counter, n, *args)


def _over_heads(core, n: int, threads: int, *args: Any) -> None:
    """core(h, h + 1, *args) for the n heads, claimed one at a time by the calling thread and
    ``threads - 1`` pool threads (``next`` on a shared counter is atomic under the GIL; each core call
    releases it). A helper that has not started when the heads run out is cancelled, not waited for."""
    nth = max(1, min(int(threads), n))
    if nth == 1:
        core(0, n, *args)
        return
    counter = itertools.count()

    def claim() -> None:
        for h in iter(counter.__next__, n):
            if h >= n:
                return
            core(h, h + 1, *args)

    futs = [_pool(nth - 1).submit(claim) for _ in range(nth - 1)]
    claim()
    for f in futs:
        if not f.cancel():
            f.result()


def _leading(a: np.ndarray) -> np.ndarray:
    """A C-contiguous 3-D array ``B`` with ``a == B[:, :a.shape[1]]``: ``a`` itself, the array whose
    leading rows ``a`` is (a ``GrowBuffer.view()``, or a range of its heads: no copy), or a contiguous
    copy."""
    if a.flags.c_contiguous:
        return a
    b = a.base
    if (isinstance(b, np.ndarray) and b.ndim == 3 and b.flags.c_contiguous and b.dtype == a.dtype
            and b.shape[2] == a.shape[2] and b.shape[1] >= a.shape[1] and a.strides == b.strides):
        off = a.__array_interface__["data"][0] - b.__array_interface__["data"][0]
        h0, rem = divmod(off, b.strides[0]) if b.strides[0] else (0, off)
        if rem == 0 and 0 <= h0 and h0 + a.shape[0] <= b.shape[0]:
            return b[h0:h0 + a.shape[0]]
    return np.ascontiguousarray(a)


def _params(a: np.ndarray, shape: tuple[int, int, int], name: str) -> np.ndarray:
    """Group params for the cores: f16 as uint16 bits, else float32; leading rows of a C-contiguous array."""
    a = np.asarray(a)
    if a.shape != shape:
        raise ValueError(f"{name} has shape {a.shape}, expected {shape}")
    if a.dtype not in (np.float16, np.float32):
        a = a.astype(np.float32)
    return as_f32_or_u16(_leading(a))


# ================================================================================ wrappers
def _into(a: np.ndarray, n: int, m: int, t: int) -> tuple[np.ndarray, int] | None:
    """(C-contiguous [n, m, T] array, offset) such that ``a`` is ``array[:, :, offset:offset + t]``, or
    None (then the caller goes through a contiguous copy)."""
    if a.dtype != np.float32 or a.shape != (n, m, t):
        return None
    if a.flags.c_contiguous:
        return a, 0
    b = a.base
    while b is not None and not (isinstance(b, np.ndarray) and b.ndim == 3 and b.flags.c_contiguous):
        b = getattr(b, "base", None)
    if b is None or b.dtype != np.float32 or b.shape[:2] != (n, m) or a.strides != b.strides:
        return None
    off = (a.__array_interface__["data"][0] - b.__array_interface__["data"][0]) // 4
    if not 0 <= off <= b.shape[2] - t:
        return None
    return b, int(off)


def _check_key_args(q, k_codes, bits, key_group):
    q = np.ascontiguousarray(q, dtype=np.float32)
    if q.ndim != 3:
        raise ValueError(f"q must be [n, M, D], got shape {q.shape}")
    n, _, d = q.shape
    bits, kg = int(bits), int(key_group)
    _check_codec(bits, d, kg)
    codes = np.asarray(k_codes)
    tq = codes.shape[1] if codes.ndim == 3 else -1
    if codes.dtype != np.uint8 or codes.shape != (n, tq, d // (8 // bits)) or tq % kg:
        raise ValueError(f"k_codes of shape {codes.shape} do not hold whole groups of {kg} tokens for "
                         f"{n} heads of D={d} at {bits} bits")
    return q, codes, bits, kg


def _key_scores_into(q, codes, kmin, kstep, bits, kg, s, off, threads):
    tq = codes.shape[1]
    _over_heads(_key_heads, q.shape[0], threads, q, _leading(codes), kmin, kstep, bits, kg, tq, s, off)


def key_scores(q: np.ndarray, k_codes: np.ndarray, k_min: np.ndarray, k_step: np.ndarray, bits: int,
               key_group: int, out: np.ndarray | None = None, threads: int = 1) -> np.ndarray:
    """numba side of :func:`nnef_kv.kv.kivi.kernels.key_scores`."""
    q, codes, bits, kg = _check_key_args(q, k_codes, bits, key_group)
    n, m, _ = q.shape
    tq = codes.shape[1]
    kshape = (n, tq // kg, q.shape[2])
    kmin, kstep = _params(k_min, kshape, "k_min"), _params(k_step, kshape, "k_step")
    if out is None:
        out = np.empty((n, m, tq), np.float32)
    if tq == 0:
        return out
    target = _into(out, n, m, tq)
    if target is None:
        tmp = np.empty((n, m, tq), np.float32)
        _key_scores_into(q, codes, kmin, kstep, bits, kg, tmp, 0, threads)
        out[...] = tmp
    else:
        _key_scores_into(q, codes, kmin, kstep, bits, kg, target[0], target[1], threads)
    return out


def value_sum(p: np.ndarray, v_codes: np.ndarray, v_min: np.ndarray, v_step: np.ndarray, bits: int,
              key_group: int, value_group: int, threads: int = 1) -> np.ndarray:
    """numba side of :func:`nnef_kv.kv.kivi.kernels.value_sum`."""
    p = np.asarray(p, dtype=np.float32)
    bits, kg = int(bits), int(key_group)
    codes = np.asarray(v_codes)
    n, m, tq = p.shape
    if codes.dtype != np.uint8 or codes.ndim != 3:
        raise ValueError(f"v_codes must be uint8 [n, Tq, D/per], got {codes.dtype} {codes.shape}")
    d = codes.shape[2] * (8 // bits)
    _check_codec(bits, d, kg)
    vg = min(int(value_group), d)
    if d % vg or codes.shape[:2] != (n, tq) or tq % kg:
        raise ValueError(f"v_codes of shape {codes.shape} do not fit p {p.shape}, key_group {kg}, "
                         f"value_group {value_group}")
    vshape = (n, tq, d // vg)
    vmin, vstep = _params(v_min, vshape, "v_min"), _params(v_step, vshape, "v_step")
    out = np.empty((n, m, d), np.float32)
    if tq == 0:
        out[...] = 0.0
        return out
    src = _into(p, n, m, tq) or (np.ascontiguousarray(p), 0)
    _over_heads(_value_heads, n, threads, src[0], src[1], _leading(codes), vmin, vstep, bits, kg, vg, tq, out)
    return out


def _full(a: np.ndarray, shape: tuple[int, int, int], name: str) -> np.ndarray:
    """A full-precision cache part (sinks, window) for the cores: f16 as uint16 bits, else float32."""
    a = np.asarray(a)
    if a.shape != shape:
        raise ValueError(f"{name} has shape {a.shape}, expected {shape}")
    if a.dtype not in (np.float16, np.float32):
        a = a.astype(np.float32)
    return as_f32_or_u16(_leading(a))


def decode_attention(q: np.ndarray, sink_k: np.ndarray, sink_v: np.ndarray, k_codes: np.ndarray,
                     k_min: np.ndarray, k_step: np.ndarray, v_codes: np.ndarray, v_min: np.ndarray,
                     v_step: np.ndarray, res_k: np.ndarray, res_v: np.ndarray, *, scale: float, bits: int,
                     key_group: int, value_group: int, sq: int = 1, is_causal: bool = True,
                     threads: int = 1) -> np.ndarray:
    """numba side of :func:`nnef_kv.kv.kivi.kernels.decode_attention`.

    A kv head is one nogil numba call (scores, softmax, outputs: :func:`_fused_head`); ``threads > 1``
    splits the heads over the calling thread and pool threads that claim them from an atomic counter,
    or over numba prange (``PARALLEL``); see :func:`_decode`."""
    q, kcodes, bits, kg = _check_key_args(q, k_codes, bits, key_group)
    n, m, d = q.shape
    tq = kcodes.shape[1]
    ns, nr = np.shape(sink_k)[1], np.shape(res_k)[1]
    vg = min(int(value_group), d)
    if d % vg:
        raise ValueError(f"head_dim {d} is not a multiple of value_group {value_group}")
    vcodes = np.asarray(v_codes)
    if vcodes.dtype != np.uint8 or vcodes.shape != kcodes.shape:
        raise ValueError(f"v_codes {vcodes.dtype} {vcodes.shape} do not match k_codes {kcodes.shape}")
    kshape, vshape = (n, tq // kg, d), (n, tq, d // vg)
    kmin, kstep = _params(k_min, kshape, "k_min"), _params(k_step, kshape, "k_step")
    vmin, vstep = _params(v_min, vshape, "v_min"), _params(v_step, vshape, "v_step")
    sk, sv = _full(sink_k, (n, ns, d), "sink_k"), _full(sink_v, (n, ns, d), "sink_v")
    rk, rv = _full(res_k, (n, nr, d), "res_k"), _full(res_v, (n, nr, d), "res_v")
    kcodes, vcodes = _leading(kcodes), _leading(vcodes)
    return _decode(q, sk, sv, ns, kcodes, kmin, kstep, vcodes, vmin, vstep, tq, rk, rv, nr, scale, bits, kg, vg, sq,
                   is_causal, max(1, min(int(threads), n)))


def decode_attention_rows(q: np.ndarray, sink_k: np.ndarray, sink_v: np.ndarray, ns: int, k_codes: np.ndarray,
                          k_min: np.ndarray, k_step: np.ndarray, v_codes: np.ndarray, v_min: np.ndarray,
                          v_step: np.ndarray, tq: int, res_k: np.ndarray, res_v: np.ndarray, nr: int, *,
                          scale: float, bits: int, key_group: int, value_group: int, sq: int = 1,
                          is_causal: bool = True, threads: int = 1) -> np.ndarray:
    """numba side of :func:`nnef_kv.kv.kivi.kernels.decode_attention_rows`: the arrays are
    C-contiguous and their first ``ns`` / ``tq`` / ``nr`` rows are read (a KV cache's buffers as they are,
    spare capacity after them), so no view needs resolving; the cores and the softmax are
    :func:`decode_attention`'s."""
    q = np.ascontiguousarray(q, dtype=np.float32)
    n, m, d = q.shape
    bits, kg = int(bits), int(key_group)
    vg = min(int(value_group), d)
    arrays = (sink_k, sink_v, k_codes, k_min, k_step, v_codes, v_min, v_step, res_k, res_v)
    rows = (ns, ns, tq, tq // kg, tq // kg, tq, tq, tq, nr, nr)
    for a, r in zip(arrays, rows):
        if type(a) is not np.ndarray or not a.flags.c_contiguous or a.ndim != 3 or a.shape[0] != n or a.shape[1] < r:
            raise ValueError(f"decode_attention_rows: an array of shape {np.shape(a)} does not hold {r} rows of "
                             f"{n} heads as a C-contiguous [n, rows, width] array")
    if tq % kg or d % vg or k_codes.dtype != np.uint8 or v_codes.dtype != np.uint8:
        raise ValueError(f"decode_attention_rows: {tq} quantized tokens, key_group {kg}, head_dim {d}, "
                         f"value_group {value_group}, codes {k_codes.dtype}/{v_codes.dtype}")
    sk, sv, kmin, kstep, vmin, vstep, rk, rv = (
        a if a.dtype in (np.float32, np.float16) else a.astype(np.float32)
        for a in (sink_k, sink_v, k_min, k_step, v_min, v_step, res_k, res_v))
    sk, sv, kmin, kstep, vmin, vstep, rk, rv = (as_f32_or_u16(a) for a in (sk, sv, kmin, kstep, vmin, vstep, rk, rv))
    return _decode(q, sk, sv, int(ns), k_codes, kmin, kstep, v_codes, vmin, vstep, int(tq), rk, rv, int(nr), scale,
                   bits, kg, vg, sq, is_causal, max(1, min(int(threads), n)))


def _decode(q, sk, sv, ns, kcodes, kmin, kstep, vcodes, vmin, vstep, tq, rk, rv, nr, scale, bits, kg, vg, sq,
            is_causal, nth) -> np.ndarray:
    """The attention proper, the arrays ready for the cores: each kv head in one nogil call
    (:func:`_fused_head`: its scores, their softmax, its outputs), the heads claimed one at a time by the
    calling thread and ``nth - 1`` pool threads from a shared atomic counter (:func:`_fused_claim`: one
    call a thread, so no thread takes the GIL between heads), or split by numba prange (``PARALLEL``); one
    thread below ``SPLIT_WORK``.
    Every thread count gives the same bits (a head is computed by the same code whoever claims it).
    When some row's max is not finite, the reference's rule (which looks at every head at once) is
    followed instead: the scores again, NumPy's softmax on all of them, the outputs (:func:`_decode_numpy_softmax`)."""
    n, m, d = q.shape
    total = ns + tq + nr
    if total * n * m * d < SPLIT_WORK:
        nth = 1
    qs = q * np.float32(scale)
    s = np.empty((n, m, total), np.float32)
    ls = np.empty((n, m), np.float32)
    out = np.empty((n, m, d), np.float32)
    bad = np.zeros(n, np.uint8)
    keep = causal_keep(total, m, sq, is_causal)
    args = (qs, sk, ns, kcodes, kmin, kstep, bits, kg, tq, rk, nr, sv, vcodes, vmin, vstep, vg, rv,
            _NO_MASK if keep is None else keep, s, ls, out, bad)
    if nth > 1 and PARALLEL == "prange":
        import numba

        saved = numba.get_num_threads()
        numba.set_num_threads(min(nth, numba.config.NUMBA_NUM_THREADS))
        try:
            _fused_prange(n, *args)
        finally:
            numba.set_num_threads(saved)
    else:
        counter = np.zeros(1, np.int64)
        helpers = []
        if nth > 1:
            cpu = _getcpu() if _getcpu is not None and len(_allowed) > 1 else -1
            helpers = [_pool(nth - 1).submit(_claim_helper, cpu, counter, n, *args) for _ in range(nth - 1)]
        _fused_claim(counter, n, *args)
        for f in helpers:  # a helper that has not started finds no head left: cancelled, not waited for
            if not f.cancel():
                f.result()
    if bad.any():
        return _decode_numpy_softmax(qs, sk, sv, ns, kcodes, kmin, kstep, vcodes, vmin, vstep, tq, rk, rv, nr, bits,
                                     kg, vg, keep, s)
    return out


def _decode_numpy_softmax(qs, sk, sv, ns, kcodes, kmin, kstep, vcodes, vmin, vstep, tq, rk, rv, nr, bits, kg, vg, keep,
                          s) -> np.ndarray:
    """Scores of every position, the reference's softmax in NumPy over all heads at once
    (:func:`softmax_numerators`: its rule for rows whose max is not finite), then the outputs; one thread."""
    n, m, d = qs.shape
    _scores_heads(0, n, qs, sk, ns, kcodes, kmin, kstep, bits, kg, tq, rk, nr, s)
    p = softmax_numerators(s, keep)
    ls = p.sum(axis=-1)
    out = np.empty((n, m, d), np.float32)
    _outputs_heads(0, n, p, ls, sv, ns, vcodes, vmin, vstep, bits, kg, vg, tq, rv, nr, out)
    return out


def attend(sdpa: Any, q: np.ndarray, sq: int = 1, threads: int | None = None) -> np.ndarray:
    """numba side of :func:`nnef_kv.kv.kivi.kernels.attend`."""
    q = np.asarray(q, dtype=np.float32)
    if unsupported_reason(sdpa, q.shape[1]) is not None:
        return _attend_kernel.reference(sdpa, q, sq, threads)
    nth = sdpa.threads if threads is None else int(threads)
    return decode_attention(q, **cache_arrays(sdpa), sq=sq, threads=nth)
