"""numba side of :mod:`nnef_kv.kv.rotated.kernels` (imported on first use; see that module).

Two families of cores: the first where the host has AVX-512F (:data:`VPERM`) and it pays (3 and 4 bits; 2 bits
with one query row a kv head: :func:`_vperm_pays`), the second elsewhere:

* **the codebook in a register** (``_vperm_jit``: ``_dot16``, ``_axpy16``, LLVM vector IR: numba runs no SLP
  vectorizer, and a per-lane table lookup needs ``vpermps``): the 16 (at most) codebook values sit in one
  512-bit register, and a token's codes are decoded 16 at a time by one ``vpermps`` each (planar codes: the
  16 bytes of a chunk zero-extended, field ``k`` shifted down; 3 bits: a chunk is 6 bytes, 16 codes, each lane
  taking the two bytes that hold its code by one byte shuffle and shifting them), then multiplied by the
  query rows (scores, two chains a row, one fixed-tree sum of the lanes a token) or, times each row's
  weight, added to the rows' accumulators (values). The query rows
  and accumulators are kept in the decode order (planar: coordinate ``j + k m`` at ``k mp + j``), so nothing is
  shuffled per token. Query rows sharing a kv head (GQA) are served four at a time (a padded group): one
  decode, four rows. Rows whose bytes are not whole chunks are copied into a zero-padded buffer first;
* **tables** (elsewhere): the rows sharing a kv head four at a time from tables / histograms whose entries
  are 4 floats, one a row, so that one code index gives the 4 rows' terms with one 16-byte load (scores) or
  one 16-byte load-add-store (values) (``_tables_jit``: ``_sum4``, ``_hist4``). Planar codes (1, 2, 4 bits) are
  indexed by nibble: byte ``j``'s low and high nibbles index two 16-entry slots (``2 j``, ``2 j + 1``), each
  holding the codes of ``4 / bits`` coordinates (8 KiB a group at ``D = 64``, 4 bits: L1-resident; 256-entry
  byte slots were 4x larger and slower). 3 bits: each 24-bit word of the bitstream holds 8 codes, 4 six-bit
  fields of two codes each (LSB-first, at bits 0, 6, 12, 18), extracted once into bytes, indexing 64-entry
  slots. One query row a kv head: scalar lookups in a per-row table of 256 entries a code byte (planar) or 64
  a six-bit field (3 bits), four addition chains; values: planar 1 and 2 bits a per-row histogram by byte
  value, 4 bits each code row decoded by byte (two codebook values, coordinates ``j`` and ``j + m``, from one
  8-byte table entry) and added to a row accumulator, 3 bits the six-bit field histogram.

All sums are the reference's up to the order of the f32 additions (no FMA contraction, no fastmath); NaN and
Inf propagate as IEEE arithmetic does in any order. A padding coordinate (no code, or a padding row) has a
query value of 0 against a finite codebook value, and its accumulator is never read.
"""
from __future__ import annotations

import itertools
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from llvmlite import binding as llvm_binding

from ._tables_jit import (_scores_pairs, _scores_planar, _scores_rows4, _values_decoded4, _values_pairs,
                          _values_planar, _values_rows4)
from ._vperm_jit import _scores_vperm, _values_vperm

__all__ = ["code_scores", "code_values"]

def _target_has_avx512f() -> bool:
    """numba compiles for this host's CPU (``NUMBA_CPU_NAME`` unset or ``host``, as by default) and it has
    AVX-512F; a named target CPU (portable caches) or ``NUMBA_CPU_FEATURES`` without ``+avx512f``: False."""
    from numba.core import config

    if config.CPU_NAME not in (None, "host"):
        return False
    if config.CPU_FEATURES and "+avx512f" not in config.CPU_FEATURES.split(","):
        return False
    try:
        return bool(llvm_binding.get_host_cpu_features().get("avx512f", False))
    except Exception:  # pragma: no cover - unknown host
        return False


#: the target has AVX-512F (``vpermps`` over 16 lanes): the register-codebook cores (``_vperm_jit``) run where
#: they pay, else the table cores (``_tables_jit``); tests set it False to run the table cores on such a host too
VPERM = _target_has_avx512f()


# ------------------------------------------------------------------------------------------ wrappers
def _args(codes, cb, bits, d):
    codes = np.asarray(codes, np.uint8)  # a view of the cache's buffer (rows strided by its capacity): not copied
    return codes, np.ascontiguousarray(cb, np.float32), int(bits), int(d)


#: ``threads > 1``: a call's tokens are cut into ranges of at least this many tokens, about
#: :data:`RANGES_A_THREAD` a thread, that the calling thread and the pool threads claim one at a time
MIN_TOKENS_A_RANGE = 512
RANGES_A_THREAD = 4
_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _pool(n: int) -> ThreadPoolExecutor:
    with _pools_lock:
        pool = _pools.get(n)
        if pool is None:
            pool = _pools[n] = ThreadPoolExecutor(max_workers=n, thread_name_prefix="nnef_kv_rotated")
        return pool


def _token_parts(t_len: int, threads: int) -> list[tuple[int, int]]:
    """Equal token ranges: one with one thread (or a call too small to cut), else about
    :data:`RANGES_A_THREAD` a thread, each of at least :data:`MIN_TOKENS_A_RANGE` tokens."""
    k = 1 if threads <= 1 else max(1, min(RANGES_A_THREAD * int(threads), t_len // MIN_TOKENS_A_RANGE))
    bounds = [t_len * i // k for i in range(k + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def _run(fn, calls, threads: int) -> None:
    """``fn(*args)`` for each ``args`` of ``calls``: the calling thread and ``threads - 1`` pool threads claim them
    one at a time (the cores release the GIL); returns when every call is done, not waiting for a pool thread
    that has not started (a busy core: the calling thread then does the work, near one thread's time)."""
    n = len(calls)
    if n == 1 or threads <= 1:
        for a in calls:
            fn(*a)
        return
    claim = itertools.count()  # next() is atomic under the GIL
    lock = threading.Lock()
    finished = threading.Event()
    state = {"done": 0, "error": None}

    def work() -> None:
        while (i := next(claim)) < n:
            try:
                fn(*calls[i])
            except BaseException as e:  # reported by the calling thread
                state["error"] = e
            with lock:
                state["done"] += 1
                if state["done"] == n:
                    finished.set()

    pool = _pool(threads - 1)
    for _ in range(threads - 1):
        pool.submit(work)
    work()
    finished.wait()
    if state["error"] is not None:
        raise state["error"]


def _vperm_pays(bits: int, rows: int) -> bool:
    """The register-codebook cores where they beat the tables (kernel thread-CPU, T = 8192, docs/kv.md 8.1):
    3 and 4 bits, and 2 bits with one query row a kv head; at 1 bit, and at 2 bits with GQA rows, a table
    entry covers 4 to 8 codes of 4 rows and the tables win."""
    return VPERM and (bits >= 3 or (bits == 2 and rows == 1))


def _scores_core(qr, codes, norms, cb, bits, d, out) -> None:
    if _vperm_pays(bits, qr.shape[1]):
        _scores_vperm(qr, codes, norms, cb, bits, d, out)
    elif qr.shape[1] >= 2:
        _scores_rows4(qr, codes, norms, cb, bits, d, out)
    elif bits == 3:
        _scores_pairs(qr, codes, norms, cb, d, out)
    else:
        _scores_planar(qr, codes, norms, cb, bits, d, out)


def _values_core(w, codes, cb, bits, d, out) -> None:
    if _vperm_pays(bits, w.shape[1]):
        _values_vperm(w, codes, cb, bits, d, out)
    elif w.shape[1] >= 2:
        _values_rows4(w, codes, cb, bits, d, out)
    elif bits == 3:
        _values_pairs(w, codes, cb, d, out)
    elif bits == 4:
        _values_decoded4(w, codes, cb, d, out)
    else:
        _values_planar(w, codes, cb, bits, d, out)


def code_scores(qr, codes, norms, cb, bits, d, threads=1):
    codes, cb, bits, d = _args(codes, cb, bits, d)
    qr = np.ascontiguousarray(qr, np.float32)
    norms = np.ascontiguousarray(norms, np.float32)
    out = np.empty((qr.shape[0], qr.shape[1], codes.shape[1]), np.float32)
    _run(_scores_core, [(qr, codes[:, a:b], norms[:, a:b], cb, bits, d, out[:, :, a:b])
                        for a, b in _token_parts(codes.shape[1], threads)], threads)
    return out


def code_values(w, codes, cb, bits, d, threads=1):
    codes, cb, bits, d = _args(codes, cb, bits, d)
    w = np.ascontiguousarray(w, np.float32)
    parts = _token_parts(codes.shape[1], threads)
    outs = [np.empty((w.shape[0], w.shape[1], d), np.float32) for _ in parts]
    _run(_values_core, [(w[:, :, a:b], codes[:, a:b], cb, bits, d, o) for (a, b), o in zip(parts, outs)], threads)
    for o in outs[1:]:  # the ranges' partial sums, in range order whoever ran them (f32 addition order only)
        outs[0] += o
    return outs[0]
