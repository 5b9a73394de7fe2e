"""The register-codebook cores of :mod:`nnef_kv.kv.rotated._jit` (hosts with AVX-512F; see its docstring):
each token's codes decoded 16 at a time by ``vpermps``, dotted with / added to up to four query rows."""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ...kernels._numba_common import JIT
from ._llvm import _I32, _I64, _V16B, _V16F, _V16I, _c64, _data, _loop


def _splat16(v: int) -> ir.Constant:
    return ir.Constant(_V16I, [v] * 16)


def _permps(builder, table, idx):
    """``table[idx]`` lane by lane (``vpermps``, AVX-512F): the codebook held in one register."""
    fnty = ir.FunctionType(_V16F, [_V16F, _V16I])
    fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.avx512.permvar.sf.512")
    return builder.call(fn, [table, idx])


def _hsum16(builder, v):
    """The 16 lanes summed, a fixed tree (8 + 8, 4 + 4, ...)."""
    n = 16
    while n > 1:
        h = n // 2
        lo = builder.shuffle_vector(v, v, ir.Constant(_V16I, list(range(h)) * 2 + [0] * (16 - 2 * h)))
        hi = builder.shuffle_vector(v, v, ir.Constant(_V16I, list(range(h, n)) * 2 + [0] * (16 - 2 * h)))
        v = builder.fadd(lo, hi)
        n = h
    return builder.extract_element(v, ir.Constant(_I32, 0))


def _fields_per_chunk(bits: int) -> int:
    return 1 if bits == 3 else 8 // bits


def _chunk_fields(builder, rptr, chunk, bits):
    """The code vectors of chunk ``chunk`` of a row: planar, its 16 bytes' ``8 / bits`` fields (field ``k`` of
    each byte); 3 bits, the 16 codes of its 6 bytes (48 bits, LSB first: code ``l`` at bit ``3 l``)."""
    if bits == 3:  # lane l: the two bytes holding bits 3 l .. 3 l + 2, shifted down by 3 l mod 8
        p = builder.gep(rptr, [builder.mul(chunk, _c64(6))])
        lo = builder.zext(builder.load(builder.bitcast(p, _I32.as_pointer()), align=1), _I64)
        hi = builder.load(builder.bitcast(builder.gep(p, [_c64(4)]), ir.IntType(16).as_pointer()), align=1)
        word = builder.or_(lo, builder.shl(builder.zext(hi, _I64), _c64(32)))
        b8 = builder.bitcast(word, ir.VectorType(ir.IntType(8), 8))
        mask = []
        for lane in range(16):
            i = 3 * lane // 8
            mask += [i, i + 1, 8, 8]  # element 8: a zero byte of the second operand
        b64 = builder.shuffle_vector(b8, ir.Constant(ir.VectorType(ir.IntType(8), 8), None),
                                     ir.Constant(ir.VectorType(_I32, 64), mask))
        x = builder.lshr(builder.bitcast(b64, _V16I), ir.Constant(_V16I, [3 * lane % 8 for lane in range(16)]))
        return [builder.and_(x, _splat16(7))]
    p = builder.gep(rptr, [builder.mul(chunk, _c64(16))])
    b = builder.zext(builder.load(builder.bitcast(p, _V16B.as_pointer()), align=1), _V16I)
    per = 8 // bits
    out = []
    for k in range(per):
        x = b if k == 0 else builder.lshr(b, _splat16(k * bits))
        out.append(builder.and_(x, _splat16((1 << bits) - 1)) if k < per - 1 else x)
    return out


def _vec16_at(builder, fptr, index):  # the 16 floats at float index `index`
    return builder.bitcast(builder.gep(fptr, [index]), _V16F.as_pointer())


def _literals(*xs):
    return all(isinstance(x, types.IntegerLiteral) for x in xs)


@intrinsic
def _dot16(typingctx, qp, cb16, row, nc, nr, bits):
    """``nr`` dot products (a tuple): row ``r``'s ``sum_{c < nc, k} qp[r P + (k nc + c) 16 + l] *
    cb16[field_k(row[16 c + l])]`` over lanes ``l`` (``P = (8 / bits) nc 16``): the codes of one token decoded
    once, 16 at a time, by ``vpermps`` and dotted with the ``nr`` (permuted) query rows; two chains a row."""
    if not _literals(nr, bits):
        return None
    nrl, bl = nr.literal_value, bits.literal_value
    per = _fields_per_chunk(bl)

    def codegen(context, builder, sig, args):
        qptr, _ = _data(context, builder, sig.args[0], args[0])
        cptr, _ = _data(context, builder, sig.args[1], args[1])
        rptr, _ = _data(context, builder, sig.args[2], args[2])
        rptr = builder.bitcast(rptr, ir.IntType(8).as_pointer())
        ncv = context.cast(builder, args[3], sig.args[3], types.int64)
        plen = builder.mul(ncv, _c64(16 * per))
        table = builder.load(builder.bitcast(cptr, _V16F.as_pointer()), align=4)
        zero = ir.Constant(_V16F, None)

        def body(c, accs):
            dec = [_permps(builder, table, idx) for idx in _chunk_fields(builder, rptr, c, bl)]
            accs = list(accs)
            for r in range(nrl):
                for k in range(per):
                    off = builder.add(builder.mul(_c64(r), plen),
                                      builder.mul(builder.add(builder.mul(_c64(k), ncv), c), _c64(16)))
                    qv = builder.load(_vec16_at(builder, qptr, off), align=4)
                    accs[2 * r + k % 2] = builder.fadd(accs[2 * r + k % 2], builder.fmul(qv, dec[k]))
            return accs
        accs = _loop(builder, ncv, [zero] * (2 * nrl), body, "dot16")
        sums = [_hsum16(builder, builder.fadd(accs[2 * r], accs[2 * r + 1])) for r in range(nrl)]
        return context.make_tuple(builder, sig.return_type, sums)
    return types.UniTuple(types.float32, nrl)(qp, cb16, row, nc, nr, bits), codegen


@intrinsic
def _axpy16(typingctx, acc, cb16, row, nc, w4, woff, nr, bits):
    """``acc[r P + (k nc + c) 16 + l] += w4[woff + r] * cb16[field_k(row[16 c + l])]`` for rows ``r < nr``: the
    codes of one token decoded once (as :func:`_dot16`) and added, weighted, to ``nr`` row accumulators."""
    if not _literals(nr, bits):
        return None
    nrl, bl = nr.literal_value, bits.literal_value
    per = _fields_per_chunk(bl)

    def codegen(context, builder, sig, args):
        aptr, _ = _data(context, builder, sig.args[0], args[0])
        cptr, _ = _data(context, builder, sig.args[1], args[1])
        rptr, _ = _data(context, builder, sig.args[2], args[2])
        rptr = builder.bitcast(rptr, ir.IntType(8).as_pointer())
        ncv = context.cast(builder, args[3], sig.args[3], types.int64)
        wptr, _ = _data(context, builder, sig.args[4], args[4])
        wo = context.cast(builder, args[5], sig.args[5], types.int64)
        plen = builder.mul(ncv, _c64(16 * per))
        table = builder.load(builder.bitcast(cptr, _V16F.as_pointer()), align=4)
        wvs = []
        for r in range(nrl):
            x = builder.load(builder.gep(wptr, [builder.add(wo, _c64(r))]))
            x = builder.insert_element(ir.Constant(_V16F, None), x, ir.Constant(_I32, 0))
            wvs.append(builder.shuffle_vector(x, x, ir.Constant(_V16I, [0] * 16)))

        def body(c, _):
            dec = [_permps(builder, table, idx) for idx in _chunk_fields(builder, rptr, c, bl)]
            for r in range(nrl):
                for k in range(per):
                    off = builder.add(builder.mul(_c64(r), plen),
                                      builder.mul(builder.add(builder.mul(_c64(k), ncv), c), _c64(16)))
                    p = _vec16_at(builder, aptr, off)
                    builder.store(builder.fadd(builder.load(p, align=4), builder.fmul(wvs[r], dec[k])), p, align=4)
            return []
        _loop(builder, ncv, [], body, "axpy16")
        return context.get_dummy_value()
    return types.none(acc, cb16, row, nc, w4, woff, nr, bits), codegen


@njit(**JIT)
def _vperm_geometry(bits, d, m):
    """``(nc, mp, plen)``: chunks a row (16 bytes planar, 6 bytes = 16 codes at 3 bits), bytes a row padded to
    whole chunks, floats a (permuted) query row or accumulator."""
    if bits == 3:
        nc = (d + 15) // 16
        return nc, 6 * nc, 16 * nc
    nc = (m + 15) // 16
    return nc, 16 * nc, (8 // bits) * 16 * nc


@njit(**JIT)
def _padded_codes(ch, mp, buf):
    """``ch [T, m]`` itself when its rows are whole chunks (``mp == m``), else a zero-padded copy in
    ``buf [T, mp]`` (a 16-byte or 6-byte load never reads past a row)."""
    t_len, m = ch.shape
    if mp == m:
        return ch
    for t in range(t_len):
        for j in range(m):
            buf[t, j] = ch[t, j]
    return buf[:t_len]


@njit(**JIT)
def _permuted_rows(qh, r0, g, bits, d, m, plen, qp):
    """Rows ``r0 .. r0 + g`` of ``qh`` in the decode order: row ``i`` at ``qp[i plen + k mp + j]`` = coordinate
    ``j + k m`` (``mp`` = bytes rounded up to 16; 0 where no coordinate, and for rows ``g .. 3``); 3 bits:
    ``qp[i plen + c]`` = coordinate ``c``."""
    qp[:] = 0
    if bits == 3:  # natural order
        for i in range(g):
            for c in range(d):
                qp[i * plen + c] = qh[r0 + i, c]
        return
    per = 8 // bits
    mp = plen // per
    for i in range(g):
        for k in range(per):
            for j in range(m):
                c = j + k * m
                if c < d:
                    qp[i * plen + k * mp + j] = qh[r0 + i, c]


@njit(**JIT)
def _dots1(qp, cb16, ix, nc, bits, norms_h, o):
    for t in range(ix.shape[0]):
        if bits == 4:
            s = _dot16(qp, cb16, ix[t], nc, 1, 4)
        elif bits == 3:
            s = _dot16(qp, cb16, ix[t], nc, 1, 3)
        else:
            s = _dot16(qp, cb16, ix[t], nc, 1, 2)
        o[t] = s[0] * norms_h[t]


@njit(**JIT)
def _dots4(qp, cb16, ix, nc, bits, norms_h, o4):
    for t in range(ix.shape[0]):
        if bits == 4:
            s = _dot16(qp, cb16, ix[t], nc, 4, 4)
        elif bits == 3:
            s = _dot16(qp, cb16, ix[t], nc, 4, 3)
        else:
            s = _dot16(qp, cb16, ix[t], nc, 4, 2)
        nt = norms_h[t]
        o4[t, 0] = s[0] * nt
        o4[t, 1] = s[1] * nt
        o4[t, 2] = s[2] * nt
        o4[t, 3] = s[3] * nt


@njit(**JIT)
def _scores_vperm(qr, codes, norms, cb, bits, d, out):
    n, mrows, _ = qr.shape
    t_len, m = codes.shape[1], codes.shape[2]
    nc, mp, plen = _vperm_geometry(bits, d, m)
    cb16 = np.zeros(16, np.float32)
    cb16[:cb.shape[0]] = cb
    qp = np.empty(4 * plen, np.float32)
    buf = np.zeros((t_len if mp != m else 0, mp), np.uint8)
    o4 = np.empty((t_len if mrows > 1 else 0, 4), np.float32)
    for h in range(n):
        ix = _padded_codes(codes[h], mp, buf)
        if mrows == 1:
            _permuted_rows(qr[h], 0, 1, bits, d, m, plen, qp)
            _dots1(qp, cb16, ix, nc, bits, norms[h], out[h, 0])
            continue
        for r0 in range(0, mrows, 4):
            g = min(4, mrows - r0)
            _permuted_rows(qr[h], r0, g, bits, d, m, plen, qp)
            _dots4(qp, cb16, ix, nc, bits, norms[h], o4)
            for i in range(g):
                for t in range(t_len):
                    out[h, r0 + i, t] = o4[t, i]


@njit(**JIT)
def _axpys(acc, cb16, ix, nc, w4, nr, bits):
    for t in range(ix.shape[0]):
        if nr == 1:
            if bits == 4:
                _axpy16(acc, cb16, ix[t], nc, w4, 4 * t, 1, 4)
            elif bits == 3:
                _axpy16(acc, cb16, ix[t], nc, w4, 4 * t, 1, 3)
            else:
                _axpy16(acc, cb16, ix[t], nc, w4, 4 * t, 1, 2)
        else:
            if bits == 4:
                _axpy16(acc, cb16, ix[t], nc, w4, 4 * t, 4, 4)
            elif bits == 3:
                _axpy16(acc, cb16, ix[t], nc, w4, 4 * t, 4, 3)
            else:
                _axpy16(acc, cb16, ix[t], nc, w4, 4 * t, 4, 2)


@njit(**JIT)
def _values_vperm(w, codes, cb, bits, d, out):
    n, mrows, t_len = w.shape
    m = codes.shape[2]
    nc, mp, plen = _vperm_geometry(bits, d, m)
    per = 8 // bits
    cb16 = np.zeros(16, np.float32)
    cb16[:cb.shape[0]] = cb
    acc = np.empty(4 * plen, np.float32)
    w4 = np.empty(t_len * 4, np.float32)
    buf = np.zeros((t_len if mp != m else 0, mp), np.uint8)
    for h in range(n):
        ix = _padded_codes(codes[h], mp, buf)
        for r0 in range(0, mrows, 4):
            g = min(4, mrows - r0)
            for t in range(t_len):
                for i in range(4):
                    w4[4 * t + i] = w[h, r0 + i, t] if i < g else np.float32(0)
            acc[:] = 0
            _axpys(acc, cb16, ix, nc, w4, 1 if mrows == 1 else 4, bits)
            for i in range(g):
                if bits == 3:
                    for c in range(d):
                        out[h, r0 + i, c] = acc[i * plen + c]
                    continue
                for k in range(per):
                    for j in range(m):
                        c = j + k * m
                        if c < d:
                            out[h, r0 + i, c] = acc[i * plen + k * mp + j]
