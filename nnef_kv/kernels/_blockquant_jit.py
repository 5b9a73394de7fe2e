"""numba side of :mod:`nnef_kv.kernels.blockquant` (imported on first use; see that module)."""
from __future__ import annotations

import numpy as np
from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import config as numba_config
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ._numba_common import JIT, h2f, wide_vectors, widen
from . import blockquant as _bq
from .blockquant import PackedWeights, _check_x
from .blockquant import matmul as _matmul_kernel

__all__ = ["matmul", "matvec"]

_F8 = np.float32(8.0)
#: outputs a tile of the one-row Q4_0 cores (SmolLM2-135M shapes, weights from memory: the lookup core as fast
#: at 1024 to 4096 and slower at 512, the plain core fastest at 1024; docs/benchmarks.md, "Where the code's
#: thresholds come from")
ROW_TILE = 1024


@intrinsic
def _prefetch_l2(typingctx, arr, i, j):
    """Hint that ``arr[i, j]`` (a 2-D array) will be read soon: LLVM's ``llvm.prefetch`` (read, locality 2:
    ``prefetcht1`` on x86, into L2; a no-op where the target has no prefetch). No bounds check: the
    callers pass indices inside the array."""
    if not (isinstance(arr, types.Array) and arr.ndim == 2):
        return None

    def codegen(context, builder, sig, args):
        aryty = sig.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        inds = [context.cast(builder, args[1], sig.args[1], types.intp),
                context.cast(builder, args[2], sig.args[2], types.intp)]
        ptr = cgutils.get_item_pointer2(context, builder, data=ary.data, shape=cgutils.unpack_tuple(builder, ary.shape),
                                        strides=cgutils.unpack_tuple(builder, ary.strides), layout=aryty.layout,
                                        inds=inds, wraparound=False, boundscheck=False)
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        name = "llvm.prefetch.p0" if str(i8p) == "ptr" else "llvm.prefetch.p0i8"  # opaque / typed pointers
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), name)
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(2), i32(1)])
        return context.get_dummy_value()
    return types.none(arr, i, j), codegen


def _permvar_available() -> bool:
    """numba compiles for this host (the default) and the host has AVX-512F (``vpermps`` on zmm)."""
    if (numba_config.CPU_NAME or "host") != "host" or numba_config.CPU_FEATURES:
        return False
    try:
        return bool(llvm_binding.get_host_cpu_features().get("avx512f", False))
    except Exception:  # pragma: no cover - unknown host
        return False


#: the one-row Q4_0 core looks products up in a table with AVX-512's vpermps (:func:`_q4_row_lut`)
HAVE_PERMVAR = _permvar_available()

_V16F = ir.VectorType(ir.FloatType(), 16)
_V16I = ir.VectorType(ir.IntType(32), 16)


def _item_ptr(context, builder, aryty, ary_val, inds):
    ary = context.make_array(aryty)(context, builder, ary_val)
    return cgutils.get_item_pointer2(context, builder, data=ary.data, shape=cgutils.unpack_tuple(builder, ary.shape),
                                     strides=cgutils.unpack_tuple(builder, ary.strides), layout=aryty.layout,
                                     inds=inds, wraparound=False, boundscheck=False)


def _q4_block_lanes(groups: int):
    """An intrinsic ``(codes, sbits, tab, acc, b, j, ja)``: ``acc[ja + i] += d[b, j + i] * sum_k tab[k, q[k, j + i]]``
    for ``i < 16 * groups``, over block ``b``'s 32 inputs ``k``, with ``tab[k, v] = x[k] * (v - 8)`` (f32
    [K, 16]). A 16-float table of one input's products is one zmm and ``vpermps``
    (``llvm.x86.avx512.permvar.sf.512``, which reads the low 4 bits of each index) picks a product for 16
    outputs at once from their codes, in place of sign extension, int -> float and a multiply. A byte row
    is loaded ``16 * groups`` codes at a time (64: a whole cache line, used at once: with N a multiple of
    4096 the 16 rows of a block fall in one L1 set and a line read 16 bytes at a time was evicted before
    its last use). The 32 products of an output are summed as :func:`_q4_row_plain`'s tree (pairs of a
    byte row, then pairs of pairs: built here as a binary counter), so the results are its, bit for bit.
    No bounds check: ``j + 16 * groups <= N``, ``ja + 16 * groups <= len(acc)``. Only where
    :data:`HAVE_PERMVAR`."""
    @intrinsic
    def block(typingctx, codes, sbits, tab, acc, b, j, ja):
        def codegen(context, builder, sig, args):
            ct, st, tt, at = sig.args[:4]
            cv, sv, tv, av = args[:4]
            intp = context.get_value_type(types.intp)
            b_, j_, ja_ = (context.cast(builder, v, t, types.intp) for v, t in zip(args[4:], sig.args[4:]))
            perm = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16F, [_V16F, _V16I]),
                                                  "llvm.x86.avx512.permvar.sf.512")
            four = ir.Constant(_V16I, [4] * 16)
            row_t = ir.VectorType(ir.IntType(8), 16 * groups).as_pointer()
            stacks: list[list[tuple[int, ir.Value]]] = [[] for _ in range(groups)]
            for i in range(16):
                r = builder.add(builder.mul(b_, intp(16)), intp(i))
                k = builder.mul(r, intp(2))
                raw = builder.load(builder.bitcast(_item_ptr(context, builder, ct, cv, [r, j_]), row_t), align=1)
                t0 = builder.load(builder.bitcast(_item_ptr(context, builder, tt, tv, [k, intp(0)]),
                                                  _V16F.as_pointer()), align=4)
                k1 = builder.add(k, intp(1))
                t1 = builder.load(builder.bitcast(_item_ptr(context, builder, tt, tv, [k1, intp(0)]),
                                                  _V16F.as_pointer()), align=4)
                for g in range(groups):
                    part = raw if groups == 1 else builder.shuffle_vector(
                        raw, raw, ir.Constant(_V16I, list(range(16 * g, 16 * g + 16))))
                    idx = builder.zext(part, _V16I)
                    v = builder.fadd(builder.call(perm, [t0, idx]), builder.call(perm, [t1, builder.lshr(idx, four)]))
                    size = 1
                    while stacks[g] and stacks[g][-1][0] == size:
                        v = builder.fadd(stacks[g].pop()[1], v)
                        size *= 2
                    stacks[g].append((size, v))
            half_t = ir.VectorType(ir.HalfType(), 16).as_pointer()
            for g in range(groups):
                (_, total), = stacks[g]
                sp = _item_ptr(context, builder, st, sv, [b_, builder.add(j_, intp(16 * g))])
                d = builder.fpext(builder.load(builder.bitcast(sp, half_t), align=2), _V16F)
                ap = builder.bitcast(_item_ptr(context, builder, at, av, [builder.add(ja_, intp(16 * g))]),
                                     _V16F.as_pointer())
                builder.store(builder.fadd(builder.load(ap, align=4), builder.fmul(d, total)), ap, align=4)
            return context.get_dummy_value()
        return types.none(codes, sbits, tab, acc, b, j, ja), codegen
    return block


_q4_block16 = _q4_block_lanes(1)
_q4_block64 = _q4_block_lanes(4)


@intrinsic
def _q4_table_row(typingctx, tab, k, xk):
    """``tab[k, v] = xk * (v - 8)`` for v in 0..15 (f32 [K, 16]): one broadcast, one multiply, one store of 16
    floats (the plain loop was vectorised over ``k`` into scatters). The products are IEEE f32 products,
    the same values as ``xk * np.float32(v - 8)``. No bounds check."""
    def codegen(context, builder, sig, args):
        intp = context.get_value_type(types.intp)
        k_ = context.cast(builder, args[1], sig.args[1], types.intp)
        xv = context.cast(builder, args[2], sig.args[2], types.float32)
        splat = builder.insert_element(ir.Constant(_V16F, ir.Undefined), xv, ir.IntType(32)(0))
        splat = builder.shuffle_vector(splat, splat, ir.Constant(_V16I, [0] * 16))
        vals = ir.Constant(_V16F, [float(v - 8) for v in range(16)])
        ptr = builder.bitcast(_item_ptr(context, builder, sig.args[0], args[0], [k_, intp(0)]), _V16F.as_pointer())
        builder.store(builder.fmul(splat, vals), ptr, align=4)
        return context.get_dummy_value()
    return types.none(tab, k, xk), codegen


@njit(**JIT)
def _tile(n: int, m: int) -> int:
    """Output tile: ``acc`` and ``tmp`` (``2 * m * tile`` floats, 16 KiB each at most; measured: 2048
    outputs for one row is ~20% faster than 512)."""
    t = max(64, min(2048, 8192 // max(1, m))) // 16 * 16
    return min(t, n)


@njit(**JIT)
def _q4_rows(codes, sbits, x, y):
    """y[m, :] = x[m, :] @ W.T for Q4_0 codes [K/2, N] (uint8), f16 scale bits [K/32, N] (uint16); a few rows
    (one row takes :func:`_q4_row`)."""
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


@njit(**JIT)
def _q4_row_plain(codes, sbits, x, y):
    """y = x @ W.T for ONE row ``x`` [K] (f32) -> ``y`` [N], Q4_0 codes [K/2, N] (uint8), f16 scale bits
    [K/32, N] (uint16): the decode-step path.

    For a tile of ROW_TILE outputs and a block of 32 inputs (16 byte rows), one pass over the outputs: the
    32 products ``x[k] * (q - 8)`` (``q - 8`` exact in f32: the products are the reference's bit for bit)
    summed as a tree in registers (no ``tmp`` array stored and reloaded every four byte rows), times the
    block's scale (F16C where the host has it), added to ``acc``: only the summation order differs from the
    dequantized product. Before a block, the next block's codes and scales (the next tile's first block
    after the last) are prefetched into L2: with 16 rows at stride N the hardware prefetcher alone left
    the small products waiting on memory (benchmarks/kernels.py --only q4row)."""
    wide_vectors()
    k2, n = codes.shape
    nb = k2 // 16
    tw = min(n, ROW_TILE)
    acc = np.empty(tw, np.float32)
    for n0 in range(0, n, tw):
        n1 = min(n, n0 + tw)
        w = n1 - n0
        acc[:w] = 0.0
        for b in range(nb):
            bp, f0, f1 = b + 1, n0, n1
            if bp == nb:
                bp, f0, f1 = 0, n1, min(n, n1 + tw)
            if bp < nb and f0 < f1:
                for rr in range(bp * 16, bp * 16 + 16):
                    for jj in range(f0, f1, 64):
                        _prefetch_l2(codes, rr, jj)
                for jj in range(f0, f1, 32):
                    _prefetch_l2(sbits, bp, jj)
            r = b * 16
            k = b * 32
            s = sbits[b, n0:n1]
            c0 = codes[r + 0, n0:n1]
            c1 = codes[r + 1, n0:n1]
            c2 = codes[r + 2, n0:n1]
            c3 = codes[r + 3, n0:n1]
            c4 = codes[r + 4, n0:n1]
            c5 = codes[r + 5, n0:n1]
            c6 = codes[r + 6, n0:n1]
            c7 = codes[r + 7, n0:n1]
            c8 = codes[r + 8, n0:n1]
            c9 = codes[r + 9, n0:n1]
            c10 = codes[r + 10, n0:n1]
            c11 = codes[r + 11, n0:n1]
            c12 = codes[r + 12, n0:n1]
            c13 = codes[r + 13, n0:n1]
            c14 = codes[r + 14, n0:n1]
            c15 = codes[r + 15, n0:n1]
            xa0, xb0, xa1, xb1, xa2, xb2, xa3, xb3 = (
                x[k + 0], x[k + 1], x[k + 2], x[k + 3], x[k + 4], x[k + 5], x[k + 6], x[k + 7])
            xa4, xb4, xa5, xb5, xa6, xb6, xa7, xb7 = (
                x[k + 8], x[k + 9], x[k + 10], x[k + 11], x[k + 12], x[k + 13], x[k + 14], x[k + 15])
            xa8, xb8, xa9, xb9, xa10, xb10, xa11, xb11 = (
                x[k + 16], x[k + 17], x[k + 18], x[k + 19], x[k + 20], x[k + 21], x[k + 22], x[k + 23])
            xa12, xb12, xa13, xb13, xa14, xb14, xa15, xb15 = (
                x[k + 24], x[k + 25], x[k + 26], x[k + 27], x[k + 28], x[k + 29], x[k + 30], x[k + 31])
            for j in range(w):
                e0 = np.uint32(c0[j])
                e1 = np.uint32(c1[j])
                e2 = np.uint32(c2[j])
                e3 = np.uint32(c3[j])
                e4 = np.uint32(c4[j])
                e5 = np.uint32(c5[j])
                e6 = np.uint32(c6[j])
                e7 = np.uint32(c7[j])
                e8 = np.uint32(c8[j])
                e9 = np.uint32(c9[j])
                e10 = np.uint32(c10[j])
                e11 = np.uint32(c11[j])
                e12 = np.uint32(c12[j])
                e13 = np.uint32(c13[j])
                e14 = np.uint32(c14[j])
                e15 = np.uint32(c15[j])
                p0 = (xa0 * (np.float32(np.int32(e0 & np.uint32(15))) - _F8)
                      + xb0 * (np.float32(np.int32(e0 >> np.uint32(4))) - _F8))
                p1 = (xa1 * (np.float32(np.int32(e1 & np.uint32(15))) - _F8)
                      + xb1 * (np.float32(np.int32(e1 >> np.uint32(4))) - _F8))
                p2 = (xa2 * (np.float32(np.int32(e2 & np.uint32(15))) - _F8)
                      + xb2 * (np.float32(np.int32(e2 >> np.uint32(4))) - _F8))
                p3 = (xa3 * (np.float32(np.int32(e3 & np.uint32(15))) - _F8)
                      + xb3 * (np.float32(np.int32(e3 >> np.uint32(4))) - _F8))
                p4 = (xa4 * (np.float32(np.int32(e4 & np.uint32(15))) - _F8)
                      + xb4 * (np.float32(np.int32(e4 >> np.uint32(4))) - _F8))
                p5 = (xa5 * (np.float32(np.int32(e5 & np.uint32(15))) - _F8)
                      + xb5 * (np.float32(np.int32(e5 >> np.uint32(4))) - _F8))
                p6 = (xa6 * (np.float32(np.int32(e6 & np.uint32(15))) - _F8)
                      + xb6 * (np.float32(np.int32(e6 >> np.uint32(4))) - _F8))
                p7 = (xa7 * (np.float32(np.int32(e7 & np.uint32(15))) - _F8)
                      + xb7 * (np.float32(np.int32(e7 >> np.uint32(4))) - _F8))
                p8 = (xa8 * (np.float32(np.int32(e8 & np.uint32(15))) - _F8)
                      + xb8 * (np.float32(np.int32(e8 >> np.uint32(4))) - _F8))
                p9 = (xa9 * (np.float32(np.int32(e9 & np.uint32(15))) - _F8)
                      + xb9 * (np.float32(np.int32(e9 >> np.uint32(4))) - _F8))
                p10 = (xa10 * (np.float32(np.int32(e10 & np.uint32(15))) - _F8)
                      + xb10 * (np.float32(np.int32(e10 >> np.uint32(4))) - _F8))
                p11 = (xa11 * (np.float32(np.int32(e11 & np.uint32(15))) - _F8)
                      + xb11 * (np.float32(np.int32(e11 >> np.uint32(4))) - _F8))
                p12 = (xa12 * (np.float32(np.int32(e12 & np.uint32(15))) - _F8)
                      + xb12 * (np.float32(np.int32(e12 >> np.uint32(4))) - _F8))
                p13 = (xa13 * (np.float32(np.int32(e13 & np.uint32(15))) - _F8)
                      + xb13 * (np.float32(np.int32(e13 >> np.uint32(4))) - _F8))
                p14 = (xa14 * (np.float32(np.int32(e14 & np.uint32(15))) - _F8)
                      + xb14 * (np.float32(np.int32(e14 >> np.uint32(4))) - _F8))
                p15 = (xa15 * (np.float32(np.int32(e15 & np.uint32(15))) - _F8)
                      + xb15 * (np.float32(np.int32(e15 >> np.uint32(4))) - _F8))
                acc[j] += widen(s[j]) * ((((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7)))
                                         + (((p8 + p9) + (p10 + p11)) + ((p12 + p13) + (p14 + p15))))
        y[n0:n1] = acc[:w]


@njit(**JIT)
def _q4_row_lut(codes, sbits, x, y):
    """:func:`_q4_row_plain` (same tiles, products and summation tree: the same results, bit for bit) with
    the products looked up: ``tab[k, v] = x[k] * (v - 8)`` once a call (16 K products, the plain core's
    exactly), then :func:`_q4_block64` for 64 outputs at a time, :func:`_q4_block16` for 16, scalar code
    reading the same table for the last ``w % 16`` outputs of a tile. The next block's codes and scales
    (the next tile's first block after the last) are prefetched into L2 spread over the block's pass, 16
    lines (one a byte row) before every 64 outputs: a burst of a whole block's lines at its start was
    slower (benchmarks/kernels.py --only q4row). Only where :data:`HAVE_PERMVAR`."""
    wide_vectors()
    k2, n = codes.shape
    nb = k2 // 16
    tw = min(n, ROW_TILE)
    acc = np.empty(tw, np.float32)
    tab = np.empty((2 * k2, 16), np.float32)
    for k in range(2 * k2):
        _q4_table_row(tab, k, x[k])
    ps = np.empty(16, np.float32)
    for n0 in range(0, n, tw):
        n1 = min(n, n0 + tw)
        w = n1 - n0
        w64 = w - w % 64
        w16 = w - w % 16
        acc[:w] = 0.0
        for b in range(nb):
            bp, f0 = b + 1, n0
            if bp == nb:
                bp, f0 = 0, n1
            ahead = bp < nb and f0 < n
            for j in range(0, w64, 64):
                if ahead and f0 + j < n:
                    for rr in range(bp * 16, bp * 16 + 16):
                        _prefetch_l2(codes, rr, f0 + j)
                    _prefetch_l2(sbits, bp, f0 + j)
                    _prefetch_l2(sbits, bp, min(n - 1, f0 + j + 32))
                _q4_block64(codes, sbits, tab, acc, b, n0 + j, j)
            for j in range(w64, w16, 16):
                _q4_block16(codes, sbits, tab, acc, b, n0 + j, j)
            for j in range(w16, w):
                for i in range(16):
                    c = codes[b * 16 + i, n0 + j]
                    ps[i] = tab[2 * (b * 16 + i), c & 15] + tab[2 * (b * 16 + i) + 1, c >> 4]
                h = 16
                while h > 1:
                    h //= 2
                    for i in range(h):
                        ps[i] = ps[2 * i] + ps[2 * i + 1]
                acc[j] += widen(sbits[b, n0 + j]) * ps[0]
        y[n0:n1] = acc[:w]


#: the one-row Q4_0 core in use (the table lookup where the host has AVX-512F)
_q4_row = _q4_row_lut if HAVE_PERMVAR else _q4_row_plain


@njit(**JIT)
def _q8_rows(codes, sbits, x, y):
    """y[m, :] = x[m, :] @ W.T for Q8_1 codes [K, N] (int8), f16 scale bits [K/32, N] (uint16)."""
    wide_vectors()
    k, n = codes.shape
    m_rows = x.shape[0]
    nb = k // 32
    tw = _tile(n, m_rows)
    acc = np.empty((m_rows, tw), np.float32)
    tmp = np.empty((m_rows, tw), np.float32)
    sc = np.empty(tw, np.float32)
    cf = np.empty(tw, np.float32)
    for n0 in range(0, n, tw):
        n1 = min(n, n0 + tw)
        w = n1 - n0
        acc[:, :w] = 0.0
        for b in range(nb):
            tmp[:, :w] = 0.0
            if m_rows == 1:  # four rows (inputs) a pass
                t0 = tmp[0]
                for r in range(b * 32, b * 32 + 32, 4):
                    s0 = codes[r, n0:n1]
                    s1 = codes[r + 1, n0:n1]
                    s2 = codes[r + 2, n0:n1]
                    s3 = codes[r + 3, n0:n1]
                    xa = x[0, r]
                    xb = x[0, r + 1]
                    xc = x[0, r + 2]
                    xd = x[0, r + 3]
                    for j in range(w):
                        t0[j] += ((xa * np.float32(np.int32(s0[j])) + xb * np.float32(np.int32(s1[j])))
                                  + (xc * np.float32(np.int32(s2[j])) + xd * np.float32(np.int32(s3[j]))))
            else:
                for r in range(b * 32, b * 32 + 32):
                    s0 = codes[r, n0:n1]
                    for j in range(w):
                        cf[j] = np.float32(np.int32(s0[j]))
                    for m in range(m_rows):
                        xa = x[m, r]
                        tm = tmp[m]
                        for j in range(w):
                            tm[j] += xa * cf[j]
            s = sbits[b, n0:n1]
            for j in range(w):
                sc[j] = h2f(s[j])
            for m in range(m_rows):
                am = acc[m]
                tm = tmp[m]
                for j in range(w):
                    am[j] += sc[j] * tm[j]
        y[:, n0:n1] = acc[:, :w]


@njit(**JIT)
def _q4_dequant_block(codes, sbits, k0, k1, n0, n1, out):
    """out[k - k0, j] = W[n0 + j, k] as f32 for k in [k0, k1) (multiples of 32), Q4_0."""
    wide_vectors()
    w = n1 - n0
    sc = np.empty(w, np.float32)
    for b in range(k0 // 32, k1 // 32):
        s = sbits[b, n0:n1]
        for j in range(w):
            sc[j] = h2f(s[j])
        for r in range(b * 16, b * 16 + 16):
            src = codes[r, n0:n1]
            o0 = out[2 * r - k0]
            o1 = out[2 * r + 1 - k0]
            for j in range(w):
                c = np.uint32(src[j])
                o0[j] = (np.float32(np.int32(c & np.uint32(15))) - _F8) * sc[j]
                o1[j] = (np.float32(np.int32(c >> np.uint32(4))) - _F8) * sc[j]


@njit(**JIT)
def _q8_dequant_block(codes, sbits, k0, k1, n0, n1, out):
    """out[k - k0, j] = W[n0 + j, k] as f32 for k in [k0, k1) (multiples of 32), Q8_1."""
    wide_vectors()
    w = n1 - n0
    sc = np.empty(w, np.float32)
    for b in range(k0 // 32, k1 // 32):
        s = sbits[b, n0:n1]
        for j in range(w):
            sc[j] = h2f(s[j])
        for r in range(b * 32, b * 32 + 32):
            src = codes[r, n0:n1]
            o = out[r - k0]
            for j in range(w):
                o[j] = np.float32(np.int32(src[j])) * sc[j]


#: blocks of W.T dequantized for BLAS: TILE_K inputs x TILE_N outputs (512 KiB of f32, in L2)
TILE_K, TILE_N = 256, 512


def _blas_tiles(p: PackedWeights, x: np.ndarray, y: np.ndarray) -> None:
    """Many rows: dequantize [TILE_K, TILE_N] blocks of W.T (numba) and multiply each with BLAS,
    summing the K blocks of an output tile (the dequantized values are exactly the reference's)."""
    k, n = p.k, p.n
    deq = _q4_dequant_block if p.format == "Q4_0" else _q8_dequant_block
    sbits = p.scales.view(np.uint16)
    m = x.shape[0]
    for n0 in range(0, n, TILE_N):
        n1 = min(n, n0 + TILE_N)
        w = n1 - n0
        buf = np.empty((TILE_K, w), np.float32)
        part = np.empty((m, w), np.float32)
        acc = None
        for k0 in range(0, k, TILE_K):
            k1 = min(k, k0 + TILE_K)
            blk = buf if k1 - k0 == TILE_K else np.empty((k1 - k0, w), np.float32)
            deq(p.codes, sbits, k0, k1, n0, n1, blk)
            if acc is None:
                acc = np.matmul(x[:, k0:k1], blk)
            else:
                np.matmul(x[:, k0:k1], blk, out=part)
                acc += part
        y[:, n0:n1] = acc


def matmul(p: PackedWeights, x: np.ndarray) -> np.ndarray:
    """numba side of :func:`nnef_kv.kernels.blockquant.matmul` (same signature and results up to f32
    summation order)."""
    x = _check_x(p, x)
    if not p.finite_scales:
        return _matmul_kernel.reference(p, x)
    lead = x.shape[:-1]
    x2 = np.ascontiguousarray(x.reshape(-1, p.k))
    m = x2.shape[0]
    y = np.empty((m, p.n), np.float32)
    if m == 0:
        return y.reshape(lead + (p.n,))
    if m > _bq.BLAS_ROWS[p.format]:
        _blas_tiles(p, x2, y)
    elif p.format == "Q4_0" and m == 1:
        _q4_row(p.codes, p.scales.view(np.uint16), x2[0], y[0])
    elif p.format == "Q4_0":
        _q4_rows(p.codes, p.scales.view(np.uint16), x2, y)
    else:
        _q8_rows(p.codes, p.scales.view(np.uint16), x2, y)
    return y.reshape(lead + (p.n,))


def matvec(p: PackedWeights, x: np.ndarray) -> np.ndarray:
    """numba side of :func:`nnef_kv.kernels.blockquant.matvec`."""
    x = _check_x(p, x)
    if x.ndim != 1:
        raise ValueError(f"matvec needs a vector, got shape {x.shape}")
    return matmul(p, x)
