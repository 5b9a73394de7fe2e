"""Attention on the packed KIVI codes (the read side of :class:`~.kivi.KiviSdpa`, a mixin).

The quantized part is read block by block (a multiple of ``key_group`` tokens per block) into one reusable
f32 code buffer (or by the numba kernel of :mod:`nnef_kv.kv.kivi.kernels` for one-token calls); the
key step and min are folded into the query (``q.k = sum(q*step*code) + sum(q*min)``) and the value step
and min into the probabilities. Decode takes two passes over the blocks (scores, one exact softmax,
values); long prefill chunks merge the blocks with an online softmax (``score_budget`` picks); stepwise
calls give each query row only the groups quantized before its token. Non-finite values come back
exactly from the side tables.
"""
from __future__ import annotations

import numpy as np

from .. import blocked
from ..common import GrowBuffer, causal_keep, f16_to_f32, sink_rows, softmax_numerators
from .parts import View, as32, finite_part

__all__ = ["KiviAttention", "KERNEL_WORK", "KERNEL_WIDTH"]

#: when a call's attention runs on the numba kernels (if they apply, see ``KiviAttention._kernel_ok``):
#: some tokens are quantized and either this many quantized values are read (tokens x kv heads x
#: head_dim) or a token's keys are at least ``KERNEL_WIDTH`` wide (kv heads x head_dim): from there the
#: kernels beat the NumPy path (the figures: docs/benchmarks.md, "Where the code's thresholds come from").
#: Below both thresholds (the built-in demo model's 2 x 16, short contexts) a model never pays the
#: kernels' first-call compilation.
KERNEL_WORK = 1 << 17
KERNEL_WIDTH = 64


class KiviAttention:
    """The attention methods of :class:`~.kivi.KiviSdpa` (the state, codes and params are its)."""

    def _attend(self, q: np.ndarray, sq: int, view: View | None = None) -> np.ndarray:
        """q: [n, M, D] f32 (rotated, M = group * Sq rows; row r is query r % Sq). Returns [n, M, D].
        ``view``: what is read (default: the cache as it is now).

        Heads are independent: with ``threads > 1`` and a long enough cache they are split into
        contiguous ranges processed in a thread pool (NumPy releases the GIL in its kernels)."""
        if view is None:
            view = self._current_view()
        n = q.shape[0]
        if self._on_kernels(q.shape[1], view):
            from .kernels import decode_attention_rows

            c = self.cfg
            sk, sv = self._rows(view.sink_k, self.sink_k), self._rows(view.sink_v, self.sink_v)
            rk, rv = self._rows(view.res_k, self.res_k), self._rows(view.res_v, self.res_v)
            return decode_attention_rows(q, sk, sv, view.ns, self.k_codes.data, self.k_min.data, self.k_step.data,
                                         self.v_codes.data, self.v_min.data, self.v_step.data, view.tq, rk, rv,
                                         view.nr, scale=c.scale, bits=c.kbits, key_group=c.key_group,
                                         value_group=c.value_group, sq=sq, is_causal=c.is_causal,
                                         threads=min(self.threads, n))
        nth = min(self.threads, n) if view.tq * n * self.d >= (1 << 20) else 1
        if nth <= 1:
            return self._attend_heads(q, sq, 0, n, 0, view)
        from concurrent.futures import ThreadPoolExecutor

        bounds = np.linspace(0, n, nth + 1).astype(int)
        if self._pool is None or self._pool._max_workers != nth:
            self._pool = ThreadPoolExecutor(max_workers=nth, thread_name_prefix="nnef_kv_kivi")
        futs = [self._pool.submit(self._attend_heads, q[bounds[i]:bounds[i + 1]], sq, int(bounds[i]),
                                  int(bounds[i + 1]), i, view) for i in range(nth)]
        return np.concatenate([f.result() for f in futs], axis=0)

    @staticmethod
    def _rows(a: np.ndarray, buf: GrowBuffer) -> np.ndarray:
        """``a`` (a part of the call's view) as a C-contiguous array whose first rows are ``a``: itself, or the
        buffer it is the whole written part of (``buf.view()``: our views start at row 0), else a copy."""
        if a.flags.c_contiguous:
            return a
        if a.base is buf.data and a.shape[1] == buf.len:
            return buf.data
        return np.ascontiguousarray(a)

    def _on_kernels(self, m: int, view: View) -> bool:
        """This call's attention (``m`` query rows a kv head, over ``view``) runs on the numba kernels."""
        n = self.b * self.hkv
        return bool(view.tq and (view.tq * n * self.d >= KERNEL_WORK or n * self.d >= KERNEL_WIDTH)
                    and self._kernel_ok(m, view))

    def _kernel_ok(self, m: int, view: View) -> bool:
        """The numba decode kernels (:mod:`nnef_kv.kv.kivi.kernels`) compute this call's attention:
        numba is there (``NNEF_KV_NO_NUMBA`` unset), no outliers in the side table, no softcap, window or sink
        logits, codes in the byte or token-planar layout, a score matrix the two-pass path would take."""
        from ...kernels import numba_available

        return (not self.cfg.softcap and not self.cfg.window and not self.cfg.sink_logits
                and not len(self.k_out) and not len(self.v_out) and self.codec.layout in ("bytes", "token_planar")
                and self.b * self.hkv * m * view.total * 4 <= self.score_budget and numba_available())

    def _sink_rows(self, h0: int, h1: int, rows: np.ndarray, sq: int) -> np.ndarray | None:
        """``[n, len(rows), 1]`` f32: the sink logit of each query row of the kv heads ``h0:h1`` (row ``r`` of a
        call is query ``r % sq`` of query head ``kv head * group + r // sq``), or None without sink logits."""
        return sink_rows(self.cfg.sink_logits, self.hkv, np.arange(h0, h1), np.asarray(rows) // sq)

    @staticmethod
    def _sink_column(s: np.ndarray, keep: np.ndarray | None, sink: np.ndarray | None
                     ) -> tuple[np.ndarray, np.ndarray | None]:
        """The scores ``[n, M, T]`` with the sink logits as a last, never masked column (GPT-OSS: the softmax
        normalises over it, no value reads it)."""
        if sink is None:
            return s, keep
        s = np.concatenate([s, sink], axis=-1)
        if keep is not None:
            keep = np.concatenate([keep, np.ones((keep.shape[0], 1), bool)], axis=-1)
        return s, keep

    def _code_buffer(self, slot: int, n: int, rows: int) -> np.ndarray:
        buf = self._bufs.get(slot)
        if buf is None or buf.shape[1] < rows or buf.shape[0] != n:
            buf = self._bufs[slot] = np.empty((n, rows, self.d), np.float32)
        return buf

    def _attend_heads(self, q: np.ndarray, sq: int, h0: int, h1: int, slot: int, view: View) -> np.ndarray:
        """Attention for the kv heads ``h0:h1`` (q already restricted to them); ``slot`` names the
        reusable code buffer of the calling thread. Small score matrices (decode) take the two-pass
        path, large ones (long prefill chunks) the online softmax; both read the codes block by block."""
        if self.b * self.hkv * q.shape[1] * view.total * 4 <= self.score_budget:
            return self._attend_two_pass(q, sq, h0, h1, slot, view)
        # the online path holds, per block of tokens, scores, probabilities and the query times each key
        # group's steps for every row: a long prefill takes its rows in blocks that keep these bounded
        n, m, d = q.shape
        nt = min(self._block_tokens(self.b * self.hkv), max(1, view.total))
        rb = blocked.row_block(4 * n * nt * (3 + d // self.cfg.key_group), m)
        if rb >= m:
            return self._attend_online(q, sq, h0, h1, slot, view)
        return np.concatenate([self._attend_online(q[:, r0:r1], sq, h0, h1, slot, view, r0)
                               for r0, r1 in blocked.row_ranges(m, rb)], axis=1)

    def _attend_two_pass(self, q: np.ndarray, sq: int, h0: int, h1: int, slot: int, view: View) -> np.ndarray:
        """Scores of every position (``[n, M, T]``, small in decode), one exact softmax, then the
        values. Per block of codes only an unpack (straight into the f32 buffer) and one matmul call
        on each side; the key min, the softmax sums and the value min are whole-array operations."""
        c = self.cfg
        n, m, d = q.shape
        hs = slice(h0, h1)
        ns, tq, nr = view.ns, view.tq, view.nr
        total = view.total
        q = q * np.float32(c.scale)
        s = np.empty((n, m, total), np.float32)
        if ns:
            np.matmul(q, as32(view.sink_k[hs]).swapaxes(-1, -2), out=s[:, :, :ns])
        if tq:
            self._key_scores(s[:, :, ns:ns + tq], q, h0, h1, slot)
        if nr:
            np.matmul(q, as32(view.res_k[hs]).swapaxes(-1, -2), out=s[:, :, ns + tq:])
        self._softcap(s)
        s, keep = self._sink_column(s, causal_keep(total, m, sq, c.is_causal, c.window),
                                    self._sink_rows(h0, h1, np.arange(m), sq))
        p = softmax_numerators(s, keep)
        ls = p.sum(axis=-1, keepdims=True)
        out = self._value_sum(p[:, :, ns:ns + tq], h0, h1, slot) if tq else np.zeros((n, m, d), np.float32)
        if ns:
            out += np.matmul(p[:, :, :ns], as32(view.sink_v[hs]))
        if nr:
            out += np.matmul(p[:, :, ns + tq:total], as32(view.res_v[hs]))
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.divide(out, ls, out=out)

    def _key_scores(self, sv: np.ndarray, q: np.ndarray, h0: int, h1: int, slot: int) -> None:
        """Scores of the quantized tokens into ``sv`` ``[n, M, Tq]`` (a view of the score matrix):
        ``sum_c (q step)_c code_c + sum_c q_c min_c`` per group of ``key_group`` tokens."""
        c = self.cfg
        n, m, d = q.shape
        hs = slice(h0, h1)
        kg = c.key_group
        tq = sv.shape[-1]
        ng = tq // kg
        kmin = self._param32(self.k_min, hs, ng)  # [n, G, d]
        kstep = self._param32(self.k_step, hs, ng)
        if m == 1 and c.params == "f16":  # kstep is a fresh f32 array: fold q into it in place
            qs = np.multiply(kstep, q, out=kstep)[:, :, None, :]  # [n, G, 1, d]
        else:
            qs = q[:, None, :, :] * kstep[:, :, None, :]  # [n, G, M, d]
        qmin = np.matmul(kmin, q.swapaxes(-1, -2))  # [n, G, M]: q.min per group
        s4 = sv.reshape(n, m, ng, kg)
        so = s4.swapaxes(1, 2)  # [n, G, M, kg]: where each group's matmul writes
        gb = self._block_tokens(self.b * self.hkv) // kg  # same blocks whatever the thread split
        buf = self._code_buffer(slot, n, min(gb, ng) * kg)
        scales = self.codec.plane_scales  # codes of bit field k come out times 2 ** (k * bits)
        unpack = self.codec.block_unpacker(self.k_codes.view()[hs], buf, scaled=True)
        bt4 = buf.reshape(n, buf.shape[1] // kg, kg, d).swapaxes(-1, -2)  # [n, blocks, d, kg]
        matmul = np.matmul
        for g0 in range(0, ng, gb):
            g1 = min(ng, g0 + gb)
            unpack(g0, g1)
            matmul(qs[:, g0:g1], bt4 if g1 - g0 == bt4.shape[1] else bt4[:, :g1 - g0], out=so[:, g0:g1])
        if scales is not None:
            s4.reshape(n, m, ng, len(scales), -1)[...] *= scales
        s4 += qmin.swapaxes(1, 2)[..., None]
        if len(self.k_out):
            self._key_fix(sv, q, 0, tq, kmin, kg, h0, h1)

    def _value_sum(self, pq: np.ndarray, h0: int, h1: int, slot: int) -> np.ndarray:
        """``sum_t p_t (min_t + step_t code_t)`` over the quantized tokens, ``pq`` ``[n, M, Tq]``
        (unnormalised probabilities): the value step folded into p, the min one matmul."""
        n, m, tq = pq.shape
        d, nvg, vg = self.d, self.nvg, self.vg
        hs = slice(h0, h1)
        vmin = self._param32(self.v_min, hs, tq)  # [n, Tq, nvg]
        vstep = self._param32(self.v_step, hs, tq)
        if nvg == 1:
            pw = pq * vstep[:, None, :, 0]  # [n, M, Tq]
            base = np.matmul(pq, vmin)  # [n, M, 1]
        else:
            pw = pq[:, None, :, :] * vstep.transpose(0, 2, 1)[:, :, None, :]  # [n, nvg, M, Tq]
            base = np.repeat(np.matmul(pq, vmin), vg, axis=-1)  # [n, M, d]
        scales = self.codec.plane_scales  # codes of bit field k come out times 2 ** (k * bits)
        if scales is not None:
            pw.reshape(pw.shape[:-1] + (tq // self.cfg.key_group, len(scales), -1))[...] *= scales
        bt = self._block_tokens(self.b * self.hkv)
        nb = -(-tq // bt)
        part = np.empty((nb, n, m, d) if nvg == 1 else (nb, n, nvg, m, vg), np.float32)
        buf = self._code_buffer(slot, n, min(bt, tq))
        kg = self.cfg.key_group
        unpack = self.codec.block_unpacker(self.v_codes.view()[hs], buf, scaled=True)
        matmul = np.matmul
        for i in range(nb):
            t0, t1 = i * bt, min(tq, (i + 1) * bt)
            blk = unpack(t0 // kg, t1 // kg)
            if nvg == 1:
                matmul(pw[:, :, t0:t1], blk, out=part[i])
            else:
                matmul(pw[..., t0:t1], blk.reshape(n, t1 - t0, nvg, vg).swapaxes(1, 2), out=part[i])
        acc = part[0] if nb == 1 else part.sum(axis=0)
        if nvg > 1:
            acc = acc.swapaxes(1, 2).reshape(n, m, d)
        out = np.add(acc, base)
        if len(self.v_out):
            self._value_fix(out, pq, 0, tq, vmin, h0, h1)
        return out

    def _param32(self, buf: GrowBuffer, hs: slice, count: int | None = None) -> np.ndarray:
        """Stored group params of heads ``hs`` (the first ``count`` entries) as f32: a view for f32
        params, a fresh exact conversion for f16 ones (:func:`f16_to_f32`, faster than NumPy's cast)."""
        a = buf.view(0, count)[hs]
        return a if a.dtype == np.float32 else f16_to_f32(a)

    def _attend_online(self, q: np.ndarray, sq: int, h0: int, h1: int, slot: int, view: View,
                       r0: int = 0) -> np.ndarray:
        """Online softmax over sinks, blocks of codes and window (bounded memory for long chunks); ``q``:
        the rows ``r0:r0+M`` of the call's rows."""
        c = self.cfg
        n, m, d = q.shape
        hs = slice(h0, h1)
        total = view.total
        qpos = (total - sq) + ((r0 + np.arange(m)) % sq)  # absolute position of each query row
        q = q * np.float32(c.scale)  # scores are (scale q).k: the scale is folded into the query
        qmin_pos = int(qpos.min())
        mx = np.full((n, m), -np.inf, np.float32)
        ls = np.zeros((n, m), np.float32)
        acc = np.zeros((n, m, d), np.float32)

        def merge(s: np.ndarray, pv_fn, p0: int, raw: bool = False) -> None:
            """Online softmax: fold one block of scores (and its values, via pv_fn) into mx/ls/acc; ``raw``:
            scores neither softcapped nor masked (the sink logits)."""
            nonlocal mx, ls, acc
            blk = s.shape[-1]
            if not raw:
                self._softcap(s)
                if c.window and p0 <= int(qpos.max()) - c.window:  # some row's window starts after p0
                    jp = (p0 + np.arange(blk))[None, :]
                    keep = (jp <= qpos[:, None]) & (jp > qpos[:, None] - c.window)
                    s = np.where(keep[None], s, np.float32(-np.inf))
                elif c.is_causal and p0 + blk - 1 > qmin_pos:
                    keep = (p0 + np.arange(blk))[None, :] <= qpos[:, None]
                    s = np.where(keep[None], s, np.float32(-np.inf))
            new = np.maximum(mx, np.max(s, axis=-1))
            # rows with no finite score yet (all masked) subtract 0 instead of -inf
            safe = new if new.min() > -np.inf else np.where(np.isfinite(new), new, np.float32(0))
            alpha = np.exp(mx - safe)
            p = np.exp(s - safe[..., None])
            ls = ls * alpha + p.sum(axis=-1)
            acc = acc * alpha[..., None] + pv_fn(p)
            mx = new

        qt = np.swapaxes(q, -1, -2)
        # ---- sinks (full precision)
        if view.ns:
            ks = view.sink_k[hs].astype(np.float32)
            vs = view.sink_v[hs].astype(np.float32)
            merge(np.matmul(q, np.swapaxes(ks, -1, -2)), lambda p: np.matmul(p, vs), 0)
        # ---- quantized groups, block by block
        tq = view.tq
        if tq:
            kg = c.key_group
            bt = self._block_tokens(self.b * self.hkv)  # same blocks whatever the thread split
            buf_all = self._code_buffer(slot, n, min(bt, tq))
            kcodes, vcodes = self.k_codes.view()[hs], self.v_codes.view()[hs]
            # params of the whole quantized part, f32 (small: 2/key_group + 2/value_group per value)
            kmin, kstep = self._param32(self.k_min, hs, tq // kg), self._param32(self.k_step, hs, tq // kg)
            vmin, vstep = self._param32(self.v_min, hs, tq), self._param32(self.v_step, hs, tq)
            qmin_all = np.matmul(kmin, qt)  # [n, G, m]
            for t0 in range(0, tq, bt):
                t1 = min(tq, t0 + bt)
                nt = t1 - t0
                g0, g1 = t0 // kg, t1 // kg
                gb = g1 - g0
                buf = buf_all[:, :nt]
                self._unpack(kcodes[:, t0:t1], buf)
                # scores = sum_c (q*step)_c code_c + sum_c q_c min_c, per group of kg tokens
                qs = q[:, None, :, :] * kstep[:, g0:g1, None, :]  # [n, gb, m, d]
                s = np.matmul(qs, buf.reshape(n, gb, kg, d).swapaxes(-1, -2))  # [n, gb, m, kg]
                s += qmin_all[:, g0:g1, :, None]
                s = np.swapaxes(s, 1, 2).reshape(n, m, nt)
                if len(self.k_out):
                    self._key_fix(s, q, t0, t1, kmin, kg, h0, h1)

                def pv(p: np.ndarray, t0=t0, t1=t1, nt=nt, buf=buf) -> np.ndarray:
                    self._unpack(vcodes[:, t0:t1], buf)
                    vs = vstep[:, t0:t1]  # [n, nt, nvg]
                    vm = vmin[:, t0:t1]
                    if self.nvg == 1:
                        out = np.matmul(p * vs[:, None, :, 0], buf)  # [n, m, d]
                        out += np.matmul(p, vm)  # [n, m, 1]
                    else:
                        pw = p[:, None, :, :] * np.swapaxes(vs, 1, 2)[:, :, None, :]  # [n, nvg, m, nt]
                        cb = np.swapaxes(buf.reshape(n, nt, self.nvg, self.vg), 1, 2)  # [n, nvg, nt, vg]
                        out = np.swapaxes(np.matmul(pw, cb), 1, 2).reshape(n, m, d)
                        out += np.repeat(np.matmul(p, vm), self.vg, axis=-1)
                    if len(self.v_out):
                        self._value_fix(out, p, t0, t1, vmin, h0, h1)
                    return out

                merge(s, pv, view.ns + t0)
        # ---- residual window (full precision)
        if view.nr:
            kr = view.res_k[hs].astype(np.float32)
            vr = view.res_v[hs].astype(np.float32)
            merge(np.matmul(q, np.swapaxes(kr, -1, -2)), lambda p: np.matmul(p, vr), view.ns + tq)
        sink = self._sink_rows(h0, h1, r0 + np.arange(m), sq)
        if sink is not None:  # a softmax column no value reads
            merge(sink, lambda p: np.float32(0), 0, raw=True)
        with np.errstate(invalid="ignore", divide="ignore"):
            return acc / ls[..., None]

    def _softcap(self, s: np.ndarray) -> None:
        """``softcap * tanh(s / softcap)`` in place (f32), when the op softcaps its scores."""
        c = self.cfg.softcap
        if c:
            cap = np.float32(c)
            np.divide(s, cap, out=s)
            np.tanh(s, out=s)
            np.multiply(s, cap, out=s)

    def _key_fix(self, s, q, t0: int, t1: int, kmin, kg: int, h0: int, h1: int) -> None:
        h, pos, ch, val = self.k_out.in_range(t0, t1)
        sel = (h >= h0) & (h < h1)
        if not sel.any():
            return
        h, pos, ch, val = h[sel] - h0, pos[sel], ch[sel], val[sel]
        base = kmin[h, pos // kg, ch]  # code 0 read back as min
        with np.errstate(invalid="ignore", over="ignore"):
            corr = q[h, :, ch] * (val - base)[:, None]  # [cnt, m]
        np.add.at(np.swapaxes(s, 1, 2), (h, pos - t0), corr)

    def _value_fix(self, out, p, t0: int, t1: int, vmin, h0: int, h1: int) -> None:
        h, pos, ch, val = self.v_out.in_range(t0, t1)
        sel = (h >= h0) & (h < h1)
        if not sel.any():
            return
        h, pos, ch, val = h[sel] - h0, pos[sel], ch[sel], val[sel]
        base = vmin[h, pos, ch // self.vg]
        with np.errstate(invalid="ignore", over="ignore"):
            corr = p[h, :, pos - t0] * (val - base)[:, None]  # [cnt, m]
        np.add.at(np.swapaxes(out, 1, 2), (h, ch), corr)

    def _attend_stepwise(self, q: np.ndarray, sq: int, view: View, tq0: int, qcount: np.ndarray,
                         len0: int) -> np.ndarray:
        """Rows of ``sq`` one-token calls at once. Scores are laid out ``[sinks | every quantized
        token (after the call) | full-precision tokens from tq0 on]``: a token quantized during the
        call appears twice, and each row keeps the copy it would have read (its quantized copy only if
        it was quantized before the row's token came), causally."""
        c = self.cfg
        n, m, d = q.shape
        g = m // sq
        ns, nfp = view.ns, view.nr
        kq, vq = self._dequantized_quant()  # [n, tq, d] f32 (transient: the quantized part only)
        tqf = kq.shape[1]
        sk, sv = as32(view.sink_k), as32(view.sink_v)
        rk, rv = as32(view.res_k), as32(view.res_v)
        width = ns + tqf + nfp
        # non-finite values: out of the products (a masked position would give 0 * inf = NaN, while the
        # row's one-token call never saw it), added back for the rows that see them
        sv, bad_s = finite_part(sv, 0)
        vq, bad_q = finite_part(vq, ns)
        rv, bad_r = finite_part(rv, ns + tqf)
        bad = [b for b in (bad_s, bad_q, bad_r) if b is not None]
        q4 = (q * np.float32(c.scale)).reshape(n, g, sq, d)
        out4 = np.empty((n, g, sq, d), np.float32)
        blk = max(1, min(sq, self.score_budget // max(1, 4 * n * g * width)))
        s_pos = np.arange(ns)
        f_idx = tq0 + np.arange(nfp)  # index of each full-precision token among the non-sink ones
        for i0 in range(0, sq, blk):
            i1 = min(sq, i0 + blk)
            nb = i1 - i0
            qb = q4[:, :, i0:i1].reshape(n, g * nb, d)
            pos = len0 + np.arange(i0, i1)  # absolute position of each query
            qc = qcount[i0:i1]
            keep = np.empty((nb, width), bool)
            keep[:, :ns] = s_pos[None, :] <= pos[:, None]
            keep[:, ns:ns + tqf] = np.arange(tqf)[None, :] < qc[:, None]
            keep[:, ns + tqf:] = (f_idx[None, :] >= qc[:, None]) & (ns + f_idx[None, :] <= pos[:, None])
            if c.window:  # (no sinks with a window) the row at pos sees the positions in (pos - window, pos]
                keep[:, ns:ns + tqf] &= np.arange(tqf)[None, :] > pos[:, None] - c.window
                keep[:, ns + tqf:] &= f_idx[None, :] > pos[:, None] - c.window
            keep = np.broadcast_to(keep[None], (g, nb, width)).reshape(g * nb, width)
            s = np.empty((n, g * nb, width), np.float32)
            masked = ~keep
            if ns:
                np.matmul(qb, sk.swapaxes(-1, -2), out=s[:, :, :ns])
            if tqf:
                np.matmul(qb, kq.swapaxes(-1, -2), out=s[:, :, ns:ns + tqf])
            if nfp:
                np.matmul(qb, rk.swapaxes(-1, -2), out=s[:, :, ns + tqf:])
            self._softcap(s)
            np.copyto(s, np.float32(-np.inf), where=masked)
            # block row j * nb + i is the call's row j * sq + i0 + i
            rows = (np.arange(g * nb) // nb) * sq + i0 + np.arange(g * nb) % nb
            sink = self._sink_rows(0, n, rows, sq)
            mx = s.max(axis=-1, keepdims=True)
            if sink is not None:  # the sink logit: a softmax column no value reads
                mx = np.maximum(mx, sink)
            if not mx.min() > -np.inf:
                mx = np.where(np.isfinite(mx), mx, np.float32(0))
            p = np.exp(np.subtract(s, mx, out=s), out=s)
            ls = p.sum(axis=-1, keepdims=True)
            if sink is not None:
                ls += np.exp(sink - mx)
            o = np.zeros((n, g * nb, d), np.float32)
            if ns:
                o += np.matmul(p[:, :, :ns], sv)
            if tqf:
                o += np.matmul(p[:, :, ns:ns + tqf], vq)
            if nfp:
                o += np.matmul(p[:, :, ns + tqf:], rv)
            for h, col, ch, val in bad:
                contrib = np.where(keep[:, col].T, p[h, :, col] * val[:, None], np.float32(0))  # [cnt, rows]
                np.add.at(np.swapaxes(o, 1, 2), (h, ch), contrib)
            with np.errstate(invalid="ignore", divide="ignore"):
                o /= ls
            out4[:, :, i0:i1] = o.reshape(n, g, nb, d)
        return out4.reshape(n, m, d)
