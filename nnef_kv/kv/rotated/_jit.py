"""numba side of :mod:`nnef_kv.kv.rotated.kernels` (imported on first use; see that module).

Two families of cores, the first where the host has AVX-512F (:data:`VPERM`), the second elsewhere:

* **the codebook in a register** (:func:`_dot16`, :func:`_axpy16`, LLVM vector IR: numba runs no SLP
  vectorizer, and a per-lane table lookup needs ``vpermps``): the 16 (at most) codebook values sit in one
  512-bit register, and a token's codes are decoded 16 at a time by one ``vpermps`` each (planar codes: the
  16 bytes of a chunk zero-extended, field ``k`` shifted down; 3 bits: the 48 bits of 16 codes broadcast and
  shifted lane by lane), then multiplied by the query rows (scores, two chains a row, one fixed-tree sum of
  the lanes a token) or, times each row's weight, added to the rows' accumulators (values). The query rows
  and accumulators are kept in the decode order (planar: coordinate ``j + k m`` at ``k mp + j``), so nothing is
  shuffled per token. Query rows sharing a kv head (GQA) are served four at a time (a padded group): one
  decode, four rows. Rows whose bytes are not whole chunks are copied into a zero-padded buffer first;
* **tables** (no AVX-512): the rows sharing a kv head four at a time from tables / histograms whose entries
  are 4 floats, one a row, so that one code index gives the 4 rows' terms with one 16-byte load (scores) or
  one 16-byte load-add-store (values) (:func:`_sum4`, :func:`_hist4`). Planar codes (1, 2, 4 bits) are
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

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from ...kernels._numba_common import JIT

__all__ = ["code_scores", "code_values"]

_F32 = ir.FloatType()
_V4 = ir.VectorType(_F32, 4)
_I64 = ir.IntType(64)


def _c64(v: int) -> ir.Constant:
    return ir.Constant(_I64, v)


def _data(context, builder, ty, val):
    """(data pointer, stride of axis 0 in bytes) of an array argument."""
    a = context.make_array(ty)(context, builder, val)
    return a.data, builder.extract_value(a.strides, 0)


def _byte(builder, ptr, stride, j):
    p = builder.gep(builder.bitcast(ptr, ir.IntType(8).as_pointer()), [builder.mul(j, stride)])
    return builder.zext(builder.load(p), _I64)


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


def _loop(builder, count, phis, body_fn, name):
    """``for i in range(count)`` with loop-carried values ``phis`` (initial LLVM values); ``body_fn(i, vals)``
    returns the next values; returns the final ones."""
    entry = builder.block
    check = builder.append_basic_block(f"{name}.check")
    body = builder.append_basic_block(f"{name}.body")
    done = builder.append_basic_block(f"{name}.done")
    builder.branch(check)
    builder.position_at_end(check)
    i = builder.phi(_I64)
    i.add_incoming(_c64(0), entry)
    ps = []
    for v in phis:
        p = builder.phi(v.type)
        p.add_incoming(v, entry)
        ps.append(p)
    builder.cbranch(builder.icmp_signed("<", i, count), body, done)
    builder.position_at_end(body)
    nxt = body_fn(i, ps)
    end = builder.block
    i.add_incoming(builder.add(i, _c64(1)), end)
    for p, v in zip(ps, nxt):
        p.add_incoming(v, end)
    builder.branch(check)
    builder.position_at_end(done)
    return ps


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


# ------------------------------------------------------------------------- AVX-512: codebook in a register
#: the host has AVX-512F (vpermps over 16 lanes): planar codes (1, 2, 4 bits) take the :func:`_dot16` /
#: :func:`_axpy16` cores; tests set it False to run the table cores on such a host too
VPERM = bool(llvm_binding.get_host_cpu_features().get("avx512f", False))
_I32 = ir.IntType(32)
_V16F = ir.VectorType(_F32, 16)
_V16I = ir.VectorType(_I32, 16)
_V16B = ir.VectorType(ir.IntType(8), 16)


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
    if bits == 3:
        p = builder.gep(rptr, [builder.mul(chunk, _c64(6))])
        lo = builder.zext(builder.load(builder.bitcast(p, _I32.as_pointer()), align=1), _I64)
        hi = builder.load(builder.bitcast(builder.gep(p, [_c64(4)]), ir.IntType(16).as_pointer()), align=1)
        word = builder.or_(lo, builder.shl(builder.zext(hi, _I64), _c64(32)))
        v64 = ir.VectorType(_I64, 16)
        wv = builder.insert_element(ir.Constant(v64, None), word, ir.Constant(_I32, 0))
        wv = builder.shuffle_vector(wv, wv, ir.Constant(_V16I, [0] * 16))
        x = builder.lshr(wv, ir.Constant(v64, [3 * lane for lane in range(16)]))
        return [builder.and_(builder.trunc(x, _V16I), _splat16(7))]
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
        elif bits == 2:
            s = _dot16(qp, cb16, ix[t], nc, 1, 2)
        else:
            s = _dot16(qp, cb16, ix[t], nc, 1, 1)
        o[t] = s[0] * norms_h[t]


@njit(**JIT)
def _dots4(qp, cb16, ix, nc, bits, norms_h, o4):
    for t in range(ix.shape[0]):
        if bits == 4:
            s = _dot16(qp, cb16, ix[t], nc, 4, 4)
        elif bits == 3:
            s = _dot16(qp, cb16, ix[t], nc, 4, 3)
        elif bits == 2:
            s = _dot16(qp, cb16, ix[t], nc, 4, 2)
        else:
            s = _dot16(qp, cb16, ix[t], nc, 4, 1)
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
            elif bits == 2:
                _axpy16(acc, cb16, ix[t], nc, w4, 4 * t, 1, 2)
            else:
                _axpy16(acc, cb16, ix[t], nc, w4, 4 * t, 1, 1)
        else:
            if bits == 4:
                _axpy16(acc, cb16, ix[t], nc, w4, 4 * t, 4, 4)
            elif bits == 3:
                _axpy16(acc, cb16, ix[t], nc, w4, 4 * t, 4, 3)
            elif bits == 2:
                _axpy16(acc, cb16, ix[t], nc, w4, 4 * t, 4, 2)
            else:
                _axpy16(acc, cb16, ix[t], nc, w4, 4 * t, 4, 1)


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

# ------------------------------------------------------------------------------------------ wrappers
def _args(codes, cb, bits, d):
    codes = np.asarray(codes, np.uint8)  # a view of the cache's buffer (rows strided by its capacity): not copied
    return codes, np.ascontiguousarray(cb, np.float32), int(bits), int(d)


#: tokens a thread takes at least when a call is split over threads (smaller calls run on one thread)
MIN_TOKENS_A_THREAD = 1024
_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()


def _pool(n: int) -> ThreadPoolExecutor:
    with _pools_lock:
        pool = _pools.get(n)
        if pool is None:
            pool = _pools[n] = ThreadPoolExecutor(max_workers=n, thread_name_prefix="nnef_kv_rotated")
        return pool


def _token_parts(t_len: int, threads: int) -> list[tuple[int, int]]:
    """Equal token ranges, one a thread (one range when the call is too small to split)."""
    k = max(1, min(int(threads), t_len // MIN_TOKENS_A_THREAD))
    bounds = [t_len * i // k for i in range(k + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def _run(fn, calls) -> None:
    """``fn(*args)`` for each ``args`` of ``calls``: the first on the calling thread, the others on pool threads
    (the cores release the GIL)."""
    if len(calls) == 1:
        fn(*calls[0])
        return
    futs = [_pool(len(calls) - 1).submit(fn, *a) for a in calls[1:]]
    fn(*calls[0])
    for f in futs:
        f.result()


def _scores_core(qr, codes, norms, cb, bits, d, out) -> None:
    if VPERM:
        _scores_vperm(qr, codes, norms, cb, bits, d, out)
    elif qr.shape[1] >= 2:
        _scores_rows4(qr, codes, norms, cb, bits, d, out)
    elif bits == 3:
        _scores_pairs(qr, codes, norms, cb, d, out)
    else:
        _scores_planar(qr, codes, norms, cb, bits, d, out)


def _values_core(w, codes, cb, bits, d, out) -> None:
    if VPERM:
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
                        for a, b in _token_parts(codes.shape[1], threads)])
    return out


def code_values(w, codes, cb, bits, d, threads=1):
    codes, cb, bits, d = _args(codes, cb, bits, d)
    w = np.ascontiguousarray(w, np.float32)
    parts = _token_parts(codes.shape[1], threads)
    outs = [np.empty((w.shape[0], w.shape[1], d), np.float32) for _ in parts]
    _run(_values_core, [(w[:, :, a:b], codes[:, a:b], cb, bits, d, o) for (a, b), o in zip(parts, outs)])
    for o in outs[1:]:  # the threads' partial sums (f32 addition order only)
        outs[0] += o
    return outs[0]
