"""The table cores of :mod:`nnef_kv.kv.rotated._jit` (hosts without AVX-512; see its docstring): per-row or
per-group tables and histograms indexed by code nibbles, bytes or six-bit fields."""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from ...kernels._numba_common import JIT
from ._llvm import _V4, _byte, _c64, _data, _loop


def _vec_ptr(builder, fptr, entry):  # the 4 floats of entry `entry` (float index 4 * entry)
    return builder.bitcast(builder.gep(fptr, [builder.mul(entry, _c64(4))]), _V4.as_pointer())


def _index_pair(builder, rptr, rst, j, nib, ent):
    """The two table entries byte ``j`` of a row selects: nibble mode, slots ``2j`` / ``2j + 1`` of 16 entries
    (low / high nibble); byte mode, slots ``2j`` / ``2j + 1`` of ``ent`` entries indexed by bytes ``2j`` and
    ``2j + 1``."""
    if nib:
        x = _byte(builder, rptr, rst, j)
        base = builder.mul(j, _c64(32))
        return (builder.add(base, builder.and_(x, _c64(15))),
                builder.add(builder.add(base, _c64(16)), builder.lshr(x, _c64(4))))
    j0 = builder.mul(j, _c64(2))
    j1 = builder.add(j0, _c64(1))
    return (builder.add(builder.mul(j0, ent), _byte(builder, rptr, rst, j0)),
            builder.add(builder.mul(j1, ent), _byte(builder, rptr, rst, j1)))


def _sum4_codegen(nib):
    def codegen(context, builder, sig, args):
        tptr, _ = _data(context, builder, sig.args[0], args[0])
        rptr, rst = _data(context, builder, sig.args[1], args[1])
        n = context.cast(builder, args[2], sig.args[2], types.int64)
        ent = context.cast(builder, args[3], sig.args[3], types.int64)
        zero = ir.Constant(_V4, None)

        def body(j, acc):
            e0, e1 = _index_pair(builder, rptr, rst, j, nib, ent)
            return [builder.fadd(acc[0], builder.load(_vec_ptr(builder, tptr, e0), align=4)),
                    builder.fadd(acc[1], builder.load(_vec_ptr(builder, tptr, e1), align=4))]
        a, b = _loop(builder, n, [zero, zero], body, "sum4")
        s = builder.fadd(a, b)
        return context.make_tuple(builder, sig.return_type,
                                  [builder.extract_element(s, ir.Constant(ir.IntType(32), k)) for k in range(4)])
    return codegen


def _hist4_codegen(nib):
    def codegen(context, builder, sig, args):
        hptr, _ = _data(context, builder, sig.args[0], args[0])
        rptr, rst = _data(context, builder, sig.args[1], args[1])
        n = context.cast(builder, args[2], sig.args[2], types.int64)
        ent = context.cast(builder, args[3], sig.args[3], types.int64)
        wptr, _ = _data(context, builder, sig.args[4], args[4])
        wv = builder.load(_vec_ptr(builder, wptr, context.cast(builder, args[5], sig.args[5], types.int64)), align=4)

        def body(j, _):
            for e in _index_pair(builder, rptr, rst, j, nib, ent):
                p = _vec_ptr(builder, hptr, e)
                builder.store(builder.fadd(builder.load(p, align=4), wv), p, align=4)
            return []
        _loop(builder, n, [], body, "hist4")
        return context.get_dummy_value()
    return codegen


def _check4(tab, row):
    return (isinstance(tab, types.Array) and tab.ndim == 1 and tab.dtype == types.float32 and tab.layout == "C"
            and isinstance(row, types.Array) and row.ndim == 1 and row.dtype == types.uint8)


@intrinsic
def _sum4(typingctx, tab, row, n, ent, nib):
    """Four sums in one vector: ``sum`` over the ``2 n`` entries that row's ``n`` bytes (nibble mode) or
    ``2 n`` bytes (byte mode) select of ``tab[4 e : 4 e + 4]`` (two chains, even and odd slots), as a
    4-tuple. ``nib`` must be a literal bool."""
    if not (_check4(tab, row) and isinstance(nib, types.BooleanLiteral)):
        return None
    return types.UniTuple(types.float32, 4)(tab, row, n, ent, nib), _sum4_codegen(nib.literal_value)


@intrinsic
def _hist4(typingctx, hist, row, n, ent, w4, woff, nib):
    """``hist[4 e : 4 e + 4] += w4[4 woff : 4 woff + 4]`` for each entry ``e`` row selects (as :func:`_sum4`)."""
    if not (_check4(hist, row) and isinstance(nib, types.BooleanLiteral)):
        return None
    return types.none(hist, row, n, ent, w4, woff, nib), _hist4_codegen(nib.literal_value)



# ------------------------------------------------------------------------------------------ layouts
@njit(**JIT)
def _layout(bits, d, m, nib):
    """``(coord [S, F], ent)``: slot ``s`` of a table holds the codes of coordinates ``coord[s, k]`` (-1:
    none) in its index's bit fields ``k`` (``bits`` wide, LSB first), ``ent`` indices a slot. Planar codes:
    one slot a byte (``nib`` False: 256 entries) or a nibble (16 entries, slot ``2 j + h`` = nibble ``h`` of
    byte ``j``); 3 bits: one slot per six-bit field of two codes (64 entries), an even number of slots (a
    last empty one when ``ceil(d / 2)`` is odd)."""
    if bits == 3:
        ns = (d + 1) // 2
        coord = np.full((ns + ns % 2, 2), -1, np.int64)
        for c in range(d):
            coord[c // 2, c % 2] = c
        return coord, 64
    if nib:
        nf = 4 // bits
        coord = np.full((2 * m, nf), -1, np.int64)
        for j in range(m):
            for h in range(2):
                for k in range(nf):
                    c = j + (h * nf + k) * m
                    if c < d:
                        coord[2 * j + h, k] = c
        return coord, 16
    per = 8 // bits
    coord = np.full((m, per), -1, np.int64)
    for j in range(m):
        for k in range(per):
            if j + k * m < d:
                coord[j, k] = j + k * m
    return coord, 256


@njit(**JIT)
def _pair_fields(rows, d, out):
    """3-bit bitstream rows ``[T, bytes]`` -> their six-bit fields ``[T, S]`` (field ``s`` = codes ``2 s`` and
    ``2 s + 1``; a last padding field, if any, 0)."""
    t_len, nb = rows.shape
    ns = (d + 1) // 2
    full = d // 8  # whole 24-bit words: 8 codes, 4 fields
    for t in range(t_len):
        row = rows[t]
        o = out[t]
        for g in range(full):
            w = np.int64(row[3 * g]) | (np.int64(row[3 * g + 1]) << 8) | (np.int64(row[3 * g + 2]) << 16)
            o[4 * g] = w & 63
            o[4 * g + 1] = (w >> 6) & 63
            o[4 * g + 2] = (w >> 12) & 63
            o[4 * g + 3] = (w >> 18) & 63
        for s in range(4 * full, ns):
            bit = 6 * s
            i = bit >> 3
            sh = bit & 7
            v = np.int64(row[i]) >> sh
            if sh > 2 and i + 1 < nb:
                v |= np.int64(row[i + 1]) << (8 - sh)
            o[s] = v & 63
        for s in range(ns, out.shape[1]):
            o[s] = 0


# -------------------------------------------------------------------------------- several rows (GQA)
@njit(**JIT)
def _tables4(qh, r0, mrows, cb, bits, coord, ent, tab):
    """``tab[4 (s ent + e) + i]`` = what index ``e`` of slot ``s`` adds to the score of row ``r0 + i`` (0 for a
    padding row)."""
    ns, nf = coord.shape
    mask = (1 << bits) - 1
    ncb = 1 << bits
    part = np.zeros((nf, ncb, 4), np.float32)
    for s in range(ns):
        for k in range(nf):
            c = coord[s, k]
            for e in range(ncb):
                for i in range(4):
                    part[k, e, i] = qh[r0 + i, c] * cb[e] if (c >= 0 and r0 + i < mrows) else np.float32(0)
        base = s * ent * 4
        for e in range(ent):
            for i in range(4):
                acc = part[0, e & mask, i]
                for k in range(1, nf):
                    acc += part[k, (e >> (k * bits)) & mask, i]
                tab[base + e * 4 + i] = acc


@njit(**JIT)
def _scores_rows4(qr, codes, norms, cb, bits, d, out):
    n, mrows, _ = qr.shape
    t_len, m = codes.shape[1], codes.shape[2]
    nib = bits != 3
    coord, ent = _layout(bits, d, m, nib)
    ns = coord.shape[0]
    tab = np.empty(ns * ent * 4, np.float32)
    fields = np.empty((t_len if bits == 3 else 0, ns), np.uint8)
    for h in range(n):
        ix = codes[h]
        if bits == 3:
            _pair_fields(codes[h], d, fields)
            ix = fields
        for r0 in range(0, mrows, 4):
            _tables4(qr[h], r0, mrows, cb, bits, coord, ent, tab)
            for t in range(t_len):
                if nib:
                    s0, s1, s2, s3 = _sum4(tab, ix[t], m, ent, True)
                else:
                    s0, s1, s2, s3 = _sum4(tab, ix[t], ns // 2, ent, False)
                nt = norms[h, t]
                out[h, r0, t] = s0 * nt
                if r0 + 1 < mrows:
                    out[h, r0 + 1, t] = s1 * nt
                if r0 + 2 < mrows:
                    out[h, r0 + 2, t] = s2 * nt
                if r0 + 3 < mrows:
                    out[h, r0 + 3, t] = s3 * nt


@njit(**JIT)
def _values_rows4(w, codes, cb, bits, d, out):
    n, mrows, t_len = w.shape
    m = codes.shape[2]
    nib = bits != 3
    coord, ent = _layout(bits, d, m, nib)
    ns, nf = coord.shape
    mask = (1 << bits) - 1
    hist = np.empty(ns * ent * 4, np.float32)
    w4 = np.empty(t_len * 4, np.float32)
    fields = np.empty((t_len if bits == 3 else 0, ns), np.uint8)
    for h in range(n):
        ix = codes[h]
        if bits == 3:
            _pair_fields(codes[h], d, fields)
            ix = fields
        for r0 in range(0, mrows, 4):
            for t in range(t_len):
                for i in range(4):
                    w4[4 * t + i] = w[h, r0 + i, t] if r0 + i < mrows else np.float32(0)
            hist[:] = 0
            for t in range(t_len):
                if nib:
                    _hist4(hist, ix[t], m, ent, w4, t, True)
                else:
                    _hist4(hist, ix[t], ns // 2, ent, w4, t, False)
            for i in range(min(4, mrows - r0)):
                out[h, r0 + i, :] = 0
            for s in range(ns):
                for e in range(ent):
                    o = (s * ent + e) * 4
                    for k in range(nf):
                        c = coord[s, k]
                        if c < 0:
                            continue
                        v = cb[(e >> (k * bits)) & mask]
                        for i in range(min(4, mrows - r0)):
                            x = hist[o + i]
                            if x != 0:  # index never seen with a weight (0 * cb adds 0: skipping it is exact)
                                out[h, r0 + i, c] += x * v


# ----------------------------------------------------------------------------------------- one row
@njit(**JIT)
def _byte_tables(qrow, cb, bits, d, m, tab):  # tab [m, 256]: what byte value b at byte j adds to the score
    per = 8 // bits
    mask = (1 << bits) - 1
    for j in range(m):
        for b in range(256):
            acc = np.float32(0.0)
            for k in range(per):
                c = j + k * m
                if c < d:
                    acc += qrow[c] * cb[(b >> (k * bits)) & mask]
            tab[j, b] = acc


@njit(**JIT)
def _scores_planar(qr, codes, norms, cb, bits, d, out):
    n, mrows, _ = qr.shape
    t_len, m = codes.shape[1], codes.shape[2]
    tr = np.empty((m, 256), np.float32)  # one row's table at a time
    for h in range(n):
        ch = codes[h]
        for r in range(mrows):
            _byte_tables(qr[h, r], cb, bits, d, m, tr)
            o = out[h, r]
            m4 = m - m % 4
            for t in range(t_len):
                row = ch[t]
                a0 = a1 = a2 = a3 = np.float32(0.0)  # four chains of additions, not one
                for j in range(0, m4, 4):
                    a0 += tr[j, row[j]]
                    a1 += tr[j + 1, row[j + 1]]
                    a2 += tr[j + 2, row[j + 2]]
                    a3 += tr[j + 3, row[j + 3]]
                for j in range(m4, m):
                    a0 += tr[j, row[j]]
                o[t] = ((a0 + a1) + (a2 + a3)) * norms[h, t]


@njit(**JIT)
def _pair_tables(qrow, cb, coord, tab):  # tab [S, 64]: what six-bit field value e of slot s adds to the score
    for s in range(coord.shape[0]):
        for e in range(64):
            acc = np.float32(0.0)
            for k in range(2):
                c = coord[s, k]
                if c >= 0:
                    acc += qrow[c] * cb[(e >> (3 * k)) & 7]
            tab[s, e] = acc


@njit(**JIT)
def _scores_pairs(qr, codes, norms, cb, d, out):
    n, mrows, _ = qr.shape
    t_len = codes.shape[1]
    coord, _ent = _layout(3, d, 0, False)
    ns = coord.shape[0]
    tab = np.empty((ns, 64), np.float32)
    fields = np.empty((t_len, ns), np.uint8)
    n4 = ns - ns % 4
    for h in range(n):
        _pair_fields(codes[h], d, fields)
        for r in range(mrows):
            _pair_tables(qr[h, r], cb, coord, tab)
            o = out[h, r]
            for t in range(t_len):
                row = fields[t]
                a0 = a1 = a2 = a3 = np.float32(0.0)
                for j in range(0, n4, 4):
                    a0 += tab[j, row[j]]
                    a1 += tab[j + 1, row[j + 1]]
                    a2 += tab[j + 2, row[j + 2]]
                    a3 += tab[j + 3, row[j + 3]]
                for j in range(n4, ns):
                    a0 += tab[j, row[j]]
                o[t] = ((a0 + a1) + (a2 + a3)) * norms[h, t]


@njit(**JIT)
def _values_planar(w, codes, cb, bits, d, out):
    n, mrows, t_len = w.shape
    m = codes.shape[2]
    per = 8 // bits
    mask = (1 << bits) - 1
    hr = np.empty((m, 256), np.float32)  # one row's histogram at a time
    for h in range(n):
        ch = codes[h]
        for r in range(mrows):
            hr[:] = 0
            wr = w[h, r]
            for t in range(t_len):
                row = ch[t]
                wt = wr[t]
                for j in range(m):
                    hr[j, row[j]] += wt
            o = out[h, r]
            o[:] = 0
            for j in range(m):
                for b in range(256):
                    x = hr[j, b]
                    if x == 0:  # byte value never seen with a weight (0 * cb adds 0: skipping it is exact)
                        continue
                    for k in range(per):
                        c = j + k * m
                        if c < d:
                            o[c] += x * cb[(b >> (k * bits)) & mask]


@njit(**JIT)
def _values_decoded4(w, codes, cb, d, out):
    """4 bits, one row at a time: each code row decoded by byte (two codebook values, ``j`` and ``j + m``, from
    one 8-byte table entry) into ``[2 m]`` and added times the weight to the row's accumulator."""
    n, mrows, t_len = w.shape
    m = codes.shape[2]
    pt = np.empty(512, np.float32)
    for b in range(256):
        pt[2 * b] = cb[b & 15]
        pt[2 * b + 1] = cb[b >> 4]
    pt64 = pt.view(np.uint64)
    dec = np.empty(2 * m, np.float32)
    dec64 = dec.view(np.uint64)
    acc = np.empty(2 * m, np.float32)
    for h in range(n):
        ch = codes[h]
        for r in range(mrows):
            acc[:] = 0
            wr = w[h, r]
            for t in range(t_len):
                row = ch[t]
                for j in range(m):
                    dec64[j] = pt64[row[j]]
                wt = wr[t]
                for c in range(2 * m):
                    acc[c] += wt * dec[c]
            for j in range(m):
                out[h, r, j] = acc[2 * j]
                if j + m < d:
                    out[h, r, j + m] = acc[2 * j + 1]


@njit(**JIT)
def _values_pairs(w, codes, cb, d, out):
    n, mrows, t_len = w.shape
    coord, _ent = _layout(3, d, 0, False)
    ns = coord.shape[0]
    hist = np.empty((ns, 64), np.float32)
    fields = np.empty((t_len, ns), np.uint8)
    for h in range(n):
        _pair_fields(codes[h], d, fields)
        for r in range(mrows):
            hist[:] = 0
            wr = w[h, r]
            for t in range(t_len):
                row = fields[t]
                wt = wr[t]
                for j in range(ns):
                    hist[j, row[j]] += wt
            o = out[h, r]
            o[:] = 0
            for s in range(ns):
                for e in range(64):
                    x = hist[s, e]
                    if x == 0:
                        continue
                    for k in range(2):
                        c = coord[s, k]
                        if c >= 0:
                            o[c] += x * cb[(e >> (3 * k)) & 7]
