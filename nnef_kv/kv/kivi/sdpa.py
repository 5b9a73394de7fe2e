"""The accurate KIVI cache + attention of ``nnef_kv_kivi_sdpa`` (NumPy, no graph needed).

Storage, per (batch, kv head), in sequence order::

    [ sinks (f32/f16, forever) | quantized groups (packed codes + f16 params) | residual window (f32/f16) ]

* Keys: asymmetric affine codes **per channel**, one ``(min, step)`` per channel for each group of
  ``key_group`` tokens, frozen when the group is quantized. Values: **per token**, one ``(min, step)``
  per group of ``value_group`` channels. ``bits`` 1..8, packed with :mod:`nnef_kv.kv.packing`.
* The newest ``residual`` tokens (at least) stay in full precision; when the window holds
  ``residual + key_group`` tokens its oldest ``key_group`` tokens are quantized together (so at most
  ``residual + key_group - 1`` are in full precision). The first ``sinks`` tokens never are.
* Group params are stored in ``params`` dtype (``"f16"`` default, ``"f32"`` option); codes are
  computed against the *stored* (rounded) params, the f16 ``min`` rounded down and ``step`` up so the
  group range stays covered.
* Non-finite values (NaN, +-Inf) and, with f16 params, finite values with ``|x| > 16384`` never
  enter a group's min/max: they are kept exactly in a side table (head, position, channel, value;
  counted in ``nbytes()['full_precision']``, and on their own in ``['outliers']``), their code is
  0, and attention adds their exact contribution back. So one NaN key makes the scores of that token NaN
  (as exact attention would) without spoiling the range of the 31 other tokens of its group.
* Optional accuracy options (NNEF attributes after the public ones): ``clip`` (MSE-optimal shrink of
  each group range, searched on a grid), ``rotate`` (orthonormal Hadamard rotation of head_dim for
  keys and/or values: ``"k"``, ``"v"``, ``"kv"``; q.k and p.V are preserved exactly in real arithmetic).
* Variants (issue 15, attributes after ``softcap``): ``key_bits`` / ``value_bits`` (0: ``bits``) give the
  keys and the values their own widths; ``key_axis = "token"`` quantizes keys per token like values
  (one ``(min, step)`` per group of ``value_group`` channels of each token) instead of per channel. The
  tokens still move out of the window ``key_group`` at a time. A variant's attention reads the
  dequantized codes (:mod:`.variant`), the same readings as the packed-code path.

Attention (:mod:`.attend`) never builds the f32 cache: the quantized part is read block by block (a multiple of
``key_group`` tokens per block) into one reusable f32 code buffer; the key step and min are folded
into the query (``q.k = sum(q*step*code) + sum(q*min)``) and the value step and min into the
probabilities. Decode (a small ``[heads, rows, T]`` score matrix) takes two passes over the blocks
(scores, one exact softmax, values); long prefill chunks merge the blocks with an online softmax
(``score_budget`` picks). Causal masking (``is_causal``) aligns the ``Sq`` queries with the last
``Sq`` positions of the cache (bottom-right).

Codes are stored with :class:`~nnef_kv.kv.packing.GroupCodec`: inside each group of ``key_group``
tokens the 1/2/4-bit codes are packed across tokens (and 3/5/6/7 bits split into such fields), so
unpacking a block is a few whole-array ANDs straight into the f32 buffer; bit field ``k`` comes out
times ``2**(k*w)`` and the exact power-of-two factor is folded into the key scores / value weights.
f16 params are widened with :func:`~nnef_kv.kv.common.f16_to_f32` (exact, faster than NumPy's cast).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from ...errors import GraphError, InputError, StateError
from ...core.registry import stateful
from ..common import (BufferCheckpoint, GrowBuffer, evict_page, evicted_tokens, expect_config_and_shape, expect_state,
                     start_call)
from .attend import KiviAttention
from .config import CODES_LAYOUT, KIVI_SETTINGS, KiviConfig, hadamard, kivi_problem
from .parts import Outliers, View, rotate
from .variant import KiviDequantizedAttention
from ..packing import GroupCodec

__all__ = ["KiviConfig", "KiviSdpa", "hadamard", "kivi_problem", "KIVI_SETTINGS", "CODES_LAYOUT"]

F16_SAFE = 16384.0  # with f16 params, |x| above this goes to the exact side table
_CLIP_GRID = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5)
SINK_CHUNK = 256  # the most tokens a sink or window buffer reserves at once (more grow the buffer as they come)


#: the op's NNEF declaration: its registration (below), and what tools read of its parameters
SIGNATURE = (
    'fragment nnef_kv_kivi_sdpa(q: tensor<scalar>, k: tensor<scalar>, v: tensor<scalar>, '
    'axis: integer = 2, scale: scalar = 0.125, bits: integer = 4, key_group: integer = 32, '
    'value_group: integer = 32, residual: integer = 32, sinks: integer = 0, is_causal: logical = true, '
    'rotate: string = "none", clip: logical = false, params: string = "f16", softcap: scalar = 0.0, '
    'key_bits: integer = 0, value_bits: integer = 0, key_axis: string = "channel", window: integer = 0, '
    'sink_logits: scalar[] = []) -> (output: tensor<scalar>);'
)


@stateful(SIGNATURE, "nnef_kv", role="attention+kv", describe="nnef-kv KIVI cache (1..8 bits) + attention")
class KiviSdpa(KiviAttention, KiviDequantizedAttention, BufferCheckpoint):
    """State of one ``nnef_kv_kivi_sdpa`` node: a quantized KV cache and attention over it."""

    WHO = "nnef_kv_kivi_sdpa"
    _CHECKPOINT_ATTRS = ("len", "evicted")

    def __init__(self, axis: int = 2, scale: float = 0.125, bits: int = 4, key_group: int = 32,
                 value_group: int = 32, residual: int = 32, sinks: int = 0, is_causal: bool = True,
                 rotate: str = "none", clip: bool = False, params: str = "f16", block_tokens: int = 0,
                 threads: int = 1, score_budget: int = 1 << 22, softcap: float = 0.0, key_bits: int = 0,
                 value_bits: int = 0, key_axis: str = "channel", window: int = 0, sink_logits: Any = ()) -> None:
        if int(axis) != 2:
            raise GraphError(f"{self.WHO}: only axis 2 of [B, H, S, D] is supported, got {axis}")
        self.axis = 2
        self.cfg = KiviConfig(scale=float(scale), bits=int(bits), key_group=int(key_group),
                              value_group=int(value_group), residual=int(residual), sinks=int(sinks),
                              is_causal=bool(is_causal), rotate=str(rotate), clip=bool(clip),
                              params=str(params), block_tokens=int(block_tokens), softcap=float(softcap),
                              key_bits=int(key_bits), value_bits=int(value_bits), key_axis=str(key_axis),
                              window=int(window), sink_logits=tuple(float(x) for x in np.ravel(sink_logits)))
        self.cfg.validate(self.WHO)
        self.k_levels = float((1 << self.cfg.kbits) - 1)
        self.levels = self.k_levels  # the default of the quantizer: the keys' (bits=8 key_bits=value_bits=4 is 4-bit)
        self.v_levels = float((1 << self.cfg.vbits) - 1)
        self.threads = max(1, int(threads))  # worker threads of the attention (not an NNEF attribute)
        # bytes of a [heads, rows, T] f32 score matrix up to which the two-pass path is used
        self.score_budget = int(score_budget)
        self.reset()

    # ================================================================================== state
    def reset(self) -> None:
        self.b = self.hkv = self.d = 0
        self.vg = 0
        self.fp_dtype = np.dtype(np.float32)
        self.len = 0
        self.evicted = 0  # sliding window: quantized tokens dropped from the front (whole groups)
        self._ready = False
        self._pool = None

    def _init(self, b: int, hkv: int, d: int, fp_dtype: np.dtype) -> None:
        c = self.cfg
        n = b * hkv
        self.b, self.hkv, self.d = b, hkv, d
        self.vg = min(c.value_group, d)
        if d % self.vg:
            raise InputError(f"{self.WHO}: head_dim {d} is not a multiple of value_group {c.value_group}")
        self.nvg = d // self.vg
        self.fp_dtype = np.dtype(fp_dtype)
        pdt = c.param_dtype
        self.codec = GroupCodec(c.kbits, d, c.key_group)  # the keys' (and, not a variant, the values')
        self.v_codec = self.codec if c.vbits == c.kbits else GroupCodec(c.vbits, d, c.key_group)
        self._unpack = self.codec.unpacker()  # fn(packed, out): whole groups into an f32 buffer
        rb = self.codec.row_bytes
        # codes grow by pages of >= 64 tokens, or 1/32 of what is held: < 3.2% unused capacity
        page = -(-64 // c.key_group) * c.key_group
        # memory follows the tokens held, not the settings: a huge sinks (or residual) reserves nothing up front
        sink_chunk, cap = max(1, min(c.sinks, SINK_CHUNK)), max(1, min(c.residual + c.key_group - 1, SINK_CHUNK))
        self.sink_k = GrowBuffer((n,), (d,), self.fp_dtype, min_chunk=sink_chunk)
        self.sink_v = GrowBuffer((n,), (d,), self.fp_dtype, min_chunk=sink_chunk)
        self.res_k = GrowBuffer((n,), (d,), self.fp_dtype, min_chunk=cap)
        self.res_v = GrowBuffer((n,), (d,), self.fp_dtype, min_chunk=cap)
        g = 1.03125
        self.k_codes = GrowBuffer((n,), (rb,), np.uint8, growth=g, min_chunk=page)
        self.v_codes = GrowBuffer((n,), (self.v_codec.row_bytes,), np.uint8, growth=g, min_chunk=page)
        gpage = page // c.key_group
        ktail, kpage = ((self.nvg,), page) if c.key_axis == "token" else ((d,), gpage)
        self.k_min = GrowBuffer((n,), ktail, pdt, growth=g, min_chunk=kpage)
        self.k_step = GrowBuffer((n,), ktail, pdt, growth=g, min_chunk=kpage)
        self.v_min = GrowBuffer((n,), (self.nvg,), pdt, growth=g, min_chunk=page)
        self.v_step = GrowBuffer((n,), (self.nvg,), pdt, growth=g, min_chunk=page)
        self.k_out = Outliers()
        self.v_out = Outliers()
        self.rot = hadamard(d) if c.rotate in ("k", "v", "kv") else None
        self._bufs: dict[int, np.ndarray] = {}
        self._ready = True

    @property
    def n_sink(self) -> int:
        return self.sink_k.len if self._ready else 0

    @property
    def n_quant(self) -> int:
        return self.k_codes.len if self._ready else 0

    @property
    def n_res(self) -> int:
        return self.res_k.len if self._ready else 0

    # ============================================================================ quantization
    def _params(self, lo: np.ndarray, hi: np.ndarray, levels: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Stored (min, step) for finite ranges [lo, hi] (f32 arrays, inf where a group is empty)."""
        levels = self.levels if levels is None else levels
        empty = ~np.isfinite(lo)
        lo = np.where(empty, 0.0, lo).astype(np.float32)
        hi = np.where(empty, 0.0, hi).astype(np.float32)
        pdt = self.cfg.param_dtype
        mn = lo.astype(pdt)
        if pdt == np.float16:  # round min down and step up so the stored range covers [lo, hi]
            mn = np.where(mn.astype(np.float32) > lo, np.nextafter(mn, np.float16(-np.inf)), mn)
        mn32 = mn.astype(np.float32)
        st = ((hi - mn32) / np.float32(levels)).astype(pdt)
        if pdt == np.float16:
            short = mn32 + st.astype(np.float32) * np.float32(levels) < hi
            st = np.where(short, np.nextafter(st, np.float16(np.inf)), st)
        return mn, st

    def _codes(self, x: np.ndarray, mn: np.ndarray, st: np.ndarray, levels: float | None = None) -> np.ndarray:
        """Codes of x (NaN = outlier, coded 0) under broadcastable stored params."""
        mn32 = mn.astype(np.float32)
        st32 = st.astype(np.float32)
        with np.errstate(invalid="ignore", divide="ignore"):
            r = np.where(st32 > 0, (x - mn32) / np.where(st32 > 0, st32, 1), 0)
        r = np.clip(np.rint(np.nan_to_num(r, nan=0.0)), 0, self.levels if levels is None else levels)
        return r.astype(np.uint8)

    def _split_outliers(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """x (f32) -> (x with outliers as NaN, mask of outliers)."""
        lim = F16_SAFE if self.cfg.param_dtype == np.float16 else np.inf
        bad = ~np.isfinite(x) | (np.abs(x) > lim)
        return np.where(bad, np.float32(np.nan), x), bad

    def _range(self, xc: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
        lo = np.fmin.reduce(xc, axis=axis, initial=np.inf)
        hi = np.fmax.reduce(xc, axis=axis, initial=-np.inf)
        return lo, hi

    def _fit(self, xc: np.ndarray, axis: int, levels: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Group params along ``axis`` of xc (NaN = ignore); MSE-optimal range shrink when ``clip``."""
        lo, hi = self._range(xc, axis)
        if not self.cfg.clip:
            return self._params(lo, hi, levels)
        best = None
        fin = np.isfinite(xc)
        x0 = np.where(fin, xc, 0)
        mid = (lo + hi) / 2
        for a in _CLIP_GRID:
            mn, st = self._params(mid + a * (lo - mid), mid + a * (hi - mid), levels)
            mne, ste = np.expand_dims(mn, axis), np.expand_dims(st, axis)
            rec = mne.astype(np.float32) + self._codes(xc, mne, ste, levels) * ste.astype(np.float32)
            err = np.sum(np.where(fin, (rec - x0) ** 2, 0), axis=axis)
            if best is None:
                best = (err, mn, st)
            else:
                better = err < best[0]
                best = (np.where(better, err, best[0]), np.where(better, mn, best[1]), np.where(better, st, best[2]))
        return best[1], best[2]

    def _quantize_groups(self, k: np.ndarray, v: np.ndarray) -> None:
        """Quantize ``ng * key_group`` oldest window tokens: k, v ``[n, ng*kg, D]`` (f32, rotated)."""
        c = self.cfg
        n, t, d = k.shape
        ng = t // c.key_group
        q0 = self.n_quant
        # keys: per channel over each group of kg tokens
        kc, kbad = self._split_outliers(k)
        if c.key_axis == "token":  # per token, groups of vg channels (as values)
            kgp = kc.reshape(n, t, self.nvg, self.vg)
            mn, st = self._fit(kgp, axis=3, levels=self.k_levels)  # [n, t, nvg]
            codes = self._codes(kgp, mn[..., None], st[..., None], self.k_levels).reshape(n, t, d)
        else:
            kg = kc.reshape(n, ng, c.key_group, d)
            mn, st = self._fit(kg, axis=2, levels=self.k_levels)  # [n, ng, d]
            codes = self._codes(kg, mn[:, :, None, :], st[:, :, None, :], self.k_levels).reshape(n, t, d)
        self.k_codes.append(self.codec.pack(codes))
        self.k_min.append(mn)
        self.k_step.append(st)
        if kbad.any():
            h, tt, ch = np.nonzero(kbad)
            self.k_out.add(h, tt + q0, ch, k[h, tt, ch])
        # values: per token over groups of vg channels
        vc, vbad = self._split_outliers(v)
        vgp = vc.reshape(n, t, self.nvg, self.vg)
        mn, st = self._fit(vgp, axis=3, levels=self.v_levels)  # [n, t, nvg]
        codes = self._codes(vgp, mn[..., None], st[..., None], self.v_levels).reshape(n, t, d)
        self.v_codes.append(self.v_codec.pack(codes))
        self.v_min.append(mn)
        self.v_step.append(st)
        if vbad.any():
            h, tt, ch = np.nonzero(vbad)
            self.v_out.add(h, tt + q0, ch, v[h, tt, ch])

    def _ingest(self, k: np.ndarray, v: np.ndarray) -> None:
        """k, v: [n, S, D] in storage dtype (already rotated)."""
        c = self.cfg
        ns = min(max(c.sinks - self.sink_k.len, 0), k.shape[1])
        if ns:
            self.sink_k.append(k[:, :ns])
            self.sink_v.append(v[:, :ns])
            k, v = k[:, ns:], v[:, ns:]
        if k.shape[1] == 0:
            return
        self._store_window(np.concatenate([self.res_k.view(), k], axis=1),
                           np.concatenate([self.res_v.view(), v], axis=1))

    def _store_window(self, wk: np.ndarray, wv: np.ndarray) -> None:
        """The window after a call: ``wk, wv`` (fresh ``[n, T, D]`` arrays of this state, storage dtype,
        the old window then the call's non-sink tokens). Its oldest whole groups beyond ``residual`` are
        quantized; the rest is held at its exact size (at most ``residual + key_group - 1`` tokens), the
        arrays themselves when nothing was quantized."""
        c = self.cfg
        total = wk.shape[1]
        ng = max(0, (total - c.residual) // c.key_group)
        nq = ng * c.key_group
        if nq:
            self._quantize_groups(wk[:, :nq].astype(np.float32), wv[:, :nq].astype(np.float32))
            self.res_k.set_exact(wk[:, nq:])
            self.res_v.set_exact(wv[:, nq:])
        else:
            self.res_k.adopt(wk)
            self.res_v.adopt(wv)

    # =============================================================================== attention
    def _block_tokens(self, n: int) -> int:
        kg = self.cfg.key_group
        bt = self.cfg.block_tokens or max(kg, (1 << 18) // max(1, n * self.d))
        return max(kg, bt // kg * kg)

    def _current_view(self) -> View:
        """The cache as it is now (no call in progress)."""
        return View(self.sink_k.view(), self.sink_v.view(), self.res_k.view(), self.res_v.view(),
                     self.n_quant, self.len - self.evicted)

    def _call_view(self, ks: np.ndarray, vs: np.ndarray) -> View:
        """What a call bringing ``ks, vs`` (``[n, S, D]``, storage dtype) reads *before* it ingests them:
        the groups quantized before the call, everything else (sinks, window, the call's own tokens) in
        full precision."""
        ns_new = min(max(self.cfg.sinks - self.sink_k.len, 0), ks.shape[1])
        sk, sv = self.sink_k.view(), self.sink_v.view()
        if ns_new:
            sk = np.concatenate([sk, ks[:, :ns_new]], axis=1)
            sv = np.concatenate([sv, vs[:, :ns_new]], axis=1)
        rk, rv = self.res_k.view(), self.res_v.view()
        if ks.shape[1] > ns_new:
            rk = np.concatenate([rk, ks[:, ns_new:]], axis=1)
            rv = np.concatenate([rv, vs[:, ns_new:]], axis=1)
        return View(sk, sv, rk, rv, self.n_quant, self.len - self.evicted + ks.shape[1])

    # ============================================================================== entry point
    def _prepare(self, q: np.ndarray, k: np.ndarray, v: np.ndarray):
        """Checks, lazy init, rotation: ``(qn [n, g*Sq, D] f32, ks, vs [n, S, D] storage dtype, shape,
        out dtype, rotate values back?)``."""
        q, k, v, (b, hq, sq, hkv, snew, d), out_dtype = start_call(self, q, k, v)
        n = b * hkv
        # no copies where the dtype is already right: ks, vs are only ever copied into the cache, qn only read
        k32 = k.astype(np.float32, copy=False).reshape(n, snew, d)
        v32 = v.astype(np.float32, copy=False).reshape(n, snew, d)
        rk = self.rot is not None and self.cfg.rotate in ("k", "kv")
        rv = self.rot is not None and self.cfg.rotate in ("v", "kv")
        if rk:
            k32 = rotate(k32, self.rot)
        if rv:
            v32 = rotate(v32, self.rot)
        qn = q.astype(np.float32, copy=False).reshape(n, (hq // hkv) * sq, d)
        if rk:
            qn = rotate(qn, self.rot)
        return (qn, k32.astype(self.fp_dtype, copy=False), v32.astype(self.fp_dtype, copy=False), q.shape, out_dtype,
                rv)

    def _finish(self, out: np.ndarray, shape: tuple[int, ...], out_dtype: np.dtype, rv: bool) -> np.ndarray:
        if rv:
            out = rotate(out, self.rot.T)
        return out.reshape(shape).astype(out_dtype, copy=False)

    def __call__(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """One call: attention of ``q`` over the cache *with this call's tokens in full precision*
        (only groups quantized before the call are read quantized, as KIVI's reference does: a prompt
        attends exactly), then the call's tokens are stored by the usual rule."""
        qn, ks, vs, shape, out_dtype, rv = self._prepare(q, k, v)
        sq = shape[2]
        attend = self._attend_dequantized if self.cfg.variant else self._attend
        if ks.shape[1] and self.sink_k.len >= self.cfg.sinks:  # no new sinks: the call's window read and kept
            wk = np.concatenate([self.res_k.view(), ks], axis=1)
            wv = np.concatenate([self.res_v.view(), vs], axis=1)
            view = View(self.sink_k.view(), self.sink_v.view(), wk, wv, self.n_quant,
                        self.len - self.evicted + ks.shape[1])
            with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf follow f32 semantics, silently
                out = attend(qn, sq, view) if sq else None
            self._store_window(wk, wv)
        else:
            view = self._call_view(ks, vs)
            with np.errstate(invalid="ignore", over="ignore"):
                out = attend(qn, sq, view) if view.total and sq else None
            self._ingest(ks, vs)
        self.len += ks.shape[1]
        self._evict()
        if out is None:
            return np.zeros(shape, out_dtype)
        return self._finish(out, shape, out_dtype, rv)

    def stepwise(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """``S`` new tokens with one query row each, answered exactly as ``S`` one-token calls would
        have been (row ``i`` reads quantized only the groups quantized before token ``i`` arrived),
        leaving the same state; vectorised (the quantized part is dequantized once, rows in blocks)."""
        qn, ks, vs, shape, out_dtype, rv = self._prepare(q, k, v)
        sq, snew = shape[2], ks.shape[1]
        if sq != snew:
            raise InputError(f"{self.WHO}: a stepwise call needs one query row per new token, got {sq} "
                             f"queries for {snew} tokens")
        if snew <= 1:
            return self(q, k, v)
        len0 = self.len
        view = self._call_view(ks, vs)  # sinks after the call; the pre-call window + the new tokens
        tq0 = view.tq
        self._ingest(ks, vs)
        self.len += snew
        c = self.cfg
        before = np.maximum(len0 + np.arange(snew) - c.sinks, 0)  # non-sink tokens before row i's own
        qcount = c.key_group * np.maximum(0, (before - c.residual) // c.key_group)
        # positions from the first token held on (a sliding window evicts after the call, not during it)
        ev = self.evicted
        with np.errstate(invalid="ignore", over="ignore"):
            out = self._attend_stepwise(qn, snew, view, tq0, np.maximum(qcount - ev, 0), len0 - ev)
        self._evict()
        return self._finish(out, shape, out_dtype, rv)

    def _evict(self) -> None:
        """Sliding window: drop the quantized groups no future query sees (every token at a position <= len -
        window), a page of groups at a time (:func:`~.common.evict_page`)."""
        w = self.cfg.window
        if not w:
            return
        kg = self.cfg.key_group
        drop = evicted_tokens(self.len - w + 1, self.evicted + self.n_quant, evict_page(w, kg)) - self.evicted
        if not drop:
            return
        for buf in (self.k_codes, self.v_codes, self.v_min, self.v_step):
            buf.drop_front(drop)
        kdrop = drop if self.cfg.key_axis == "token" else drop // kg
        self.k_min.drop_front(kdrop)
        self.k_step.drop_front(kdrop)
        self.k_out.drop_front(drop)
        self.v_out.drop_front(drop)
        self.evicted += drop

    # ================================================================================ protocol
    def _buffers(self) -> list[GrowBuffer]:
        if not self._ready:
            return []
        bufs = [self.sink_k, self.sink_v, self.res_k, self.res_v, self.k_codes, self.v_codes,
                self.k_min, self.k_step, self.v_min, self.v_step]
        for t in (self.k_out, self.v_out):
            bufs += [t.head, t.pos, t.chan, t.val]
        return bufs

    def state_tensors(self) -> dict[str, np.ndarray]:
        cfg = self.cfg.as_array()
        if not self._ready:
            return {"config": cfg, "shape": np.zeros(5, np.int64)}
        st = {
            "config": cfg,
            "shape": np.array([self.b, self.hkv, self.d, self.len, int(self.fp_dtype == np.float16)], np.int64),
            "sink_k": self.sink_k.view().copy(), "sink_v": self.sink_v.view().copy(),
            "res_k": self.res_k.view().copy(), "res_v": self.res_v.view().copy(),
            "k_codes": self.k_codes.view().copy(), "v_codes": self.v_codes.view().copy(),
            "k_min": self.k_min.view().copy(), "k_step": self.k_step.view().copy(),
            "v_min": self.v_min.view().copy(), "v_step": self.v_step.view().copy(),
        }
        st.update(self.k_out.arrays("k_out"))
        st.update(self.v_out.arrays("v_out"))
        return st

    def load_state_tensors(self, tensors: dict[str, np.ndarray]) -> None:
        who = self.WHO
        shape = expect_config_and_shape(tensors, who, self.cfg.as_array(), "bits, key_group, value_group, residual, "
                                        "sinks, rotate, clip, f16 params, codes layout")
        b, hkv, d, t, f16 = (int(x) for x in shape)
        if min(b, hkv, d, t) < 0 or f16 not in (0, 1):
            raise StateError(f"{who}: invalid state shape {shape.tolist()}")
        self.reset()
        if b == 0:
            return
        c = self.cfg
        self._init(b, hkv, d, np.float16 if f16 else np.float32)
        n = b * hkv
        ns = min(t, c.sinks)
        rest = t - ns
        sk = expect_state(tensors, "sink_k", (n, ns, d), self.fp_dtype, who)
        sv = expect_state(tensors, "sink_v", (n, ns, d), self.fp_dtype, who)
        kc = expect_state(tensors, "k_codes", None, np.uint8, who)
        if kc.ndim != 3 or kc.shape[0] != n or kc.shape[2] != self.codec.row_bytes or kc.shape[1] % c.key_group:
            raise StateError(f"{who}: k_codes has shape {kc.shape}, expected ({n}, multiple of {c.key_group}, "
                             f"{self.codec.row_bytes}) for {c.kbits}-bit codes")
        tq = kc.shape[1]
        quantized = max(0, (rest - c.residual) // c.key_group) * c.key_group
        evicted = evicted_tokens(t - c.window + 1, quantized, evict_page(c.window, c.key_group)) if c.window else 0
        expected_tq = quantized - evicted
        if tq != expected_tq:
            held = f" (window {c.window}: {evicted} evicted)" if c.window else ""
            raise StateError(f"{who}: {tq} quantized tokens in k_codes, but a cache of {t} tokens holds "
                             f"{expected_tq} with residual {c.residual}, key_group {c.key_group}, sinks {c.sinks}"
                             f"{held}")
        nr = rest - quantized
        vc = expect_state(tensors, "v_codes", (n, tq, self.v_codec.row_bytes), np.uint8, who)
        pdt = c.param_dtype
        ng = tq // c.key_group
        kshape = (n, tq, self.nvg) if c.key_axis == "token" else (n, ng, d)
        kmn = expect_state(tensors, "k_min", kshape, pdt, who)
        kst = expect_state(tensors, "k_step", kshape, pdt, who)
        vmn = expect_state(tensors, "v_min", (n, tq, self.nvg), pdt, who)
        vst = expect_state(tensors, "v_step", (n, tq, self.nvg), pdt, who)
        rk = expect_state(tensors, "res_k", (n, nr, d), self.fp_dtype, who)
        rv = expect_state(tensors, "res_v", (n, nr, d), self.fp_dtype, who)
        for nm, arr in (("k_min", kmn), ("k_step", kst), ("v_min", vmn), ("v_step", vst)):
            if not np.all(np.isfinite(arr)) or (nm.endswith("step") and np.any(arr < 0)):
                raise StateError(f"{who}: state tensor {nm!r} holds non-finite or negative values "
                                 f"(group params are finite; steps >= 0)")
        if c.kbits < 8 and tq:
            head = kc[:, :c.key_group]  # the first group: no stray padding bits
            if not np.array_equal(self.codec.pack(self.codec.unpack(head)), head):
                raise StateError(f"{who}: k_codes are not valid {c.kbits}-bit packed codes")
        if c.vbits < 8 and tq:
            head = vc[:, :c.key_group]
            if not np.array_equal(self.v_codec.pack(self.v_codec.unpack(head)), head):
                raise StateError(f"{who}: v_codes are not valid {c.vbits}-bit packed codes")
        self.sink_k.set_exact(sk)
        self.sink_v.set_exact(sv)
        self.res_k.set_exact(rk)
        self.res_v.set_exact(rv)
        for buf, arr in ((self.k_codes, kc), (self.v_codes, vc), (self.k_min, kmn), (self.k_step, kst),
                         (self.v_min, vmn), (self.v_step, vst)):
            buf.reserve(arr.shape[1])
            buf.append(arr)
        self.k_out.load(tensors, "k_out", who, n, tq, d)
        self.v_out.load(tensors, "v_out", who, n, tq, d)
        self.len = t
        self.evicted = evicted

    QUANTIZED = True

    @property
    def fp_window(self) -> int:
        """The most tokens a query can read in full precision (first sinks, then the newest
        ``residual + key_group``): a context must be longer than this for quantized entries to be read."""
        return self.cfg.sinks + self.cfg.residual + self.cfg.key_group

    @property
    def window_text(self) -> str:
        c = self.cfg
        return f"residual {c.residual} + key_group {c.key_group}" + (f" + sinks {c.sinks}" if c.sinks else "")

    def reads_quantized(self, n: int, stepwise: bool = True):
        """Quantized entries the query of each of the next ``n`` tokens reads: in one-token (stepwise)
        runs, the groups quantized before that token; in one call, the groups quantized before the call."""
        c = self.cfg
        p = self.len + np.arange(n)
        lo = np.maximum(0, p - c.window + 1) if c.window else np.zeros(n, np.int64)  # the first position seen
        if not stepwise:
            return np.maximum(0, self.evicted + self.n_quant - np.maximum(lo, self.evicted))
        before = np.maximum(p - c.sinks, 0)
        return np.maximum(0, c.key_group * np.maximum(0, (before - c.residual) // c.key_group) - lo)

    def census(self) -> dict[str, int]:
        """Tokens held now: quantized (keys and values alike) and in full precision (sinks + window);
        ``f32_bytes``: what the same keys and values take as f32."""
        out = {"tokens": int(self.len), "quantized": int(self.n_quant),
                "full_precision": int(self.n_sink + self.n_res), "f32_bytes": 8 * self.b * self.hkv * self.len * self.d}
        if self.cfg.window:  # a sliding window: tokens dropped from the front
            out["evicted"] = int(self.evicted)
        return out

    def nbytes(self) -> dict[str, int]:
        if not self._ready:
            return {"codes": 0, "params": 0, "full_precision": 0, "outliers": 0,
                    "f32_equivalent": 0, "f16_equivalent": 0}
        n_values = 2 * self.b * self.hkv * self.len * self.d
        return {
            "codes": self.k_codes.nbytes + self.v_codes.nbytes,
            "params": self.k_min.nbytes + self.k_step.nbytes + self.v_min.nbytes + self.v_step.nbytes,
            # the exact side table is full precision too; "outliers" repeats its share for information
            "full_precision": (self.sink_k.nbytes + self.sink_v.nbytes + self.res_k.nbytes + self.res_v.nbytes
                               + self.k_out.nbytes + self.v_out.nbytes),
            "outliers": self.k_out.nbytes + self.v_out.nbytes,
            "f32_equivalent": 4 * n_values,
            "f16_equivalent": 2 * n_values,
        }

    # ================================================================================ helpers
    def _dequantized_quant(self) -> tuple[np.ndarray, np.ndarray]:
        """The quantized part, K and V ``[n, Tq, D]`` f32 (rotated basis), outliers at their exact
        values."""
        n, d = self.b * self.hkv, self.d
        kg = self.cfg.key_group
        tq = self.n_quant
        kc = self.codec.unpack(self.k_codes.view()).astype(np.float32)
        if self.cfg.key_axis == "token":
            kq = (self.k_min.view().astype(np.float32)[..., None] + kc.reshape(n, tq, self.nvg, self.vg)
                  * self.k_step.view().astype(np.float32)[..., None]).reshape(n, tq, d)
        else:
            kq = (self.k_min.view().astype(np.float32)[:, :, None, :] + kc.reshape(n, tq // kg, kg, d)
                  * self.k_step.view().astype(np.float32)[:, :, None, :]).reshape(n, tq, d)
        vc = self.v_codec.unpack(self.v_codes.view()).astype(np.float32).reshape(n, tq, self.nvg, self.vg)
        vq = (self.v_min.view().astype(np.float32)[..., None]
              + vc * self.v_step.view().astype(np.float32)[..., None]).reshape(n, tq, d)
        h, pos, ch, val = self.k_out.in_range(0, tq)
        kq[h, pos, ch] = val
        h, pos, ch, val = self.v_out.in_range(0, tq)
        vq[h, pos, ch] = val
        return kq, vq

    def dequantized(self) -> tuple[np.ndarray, np.ndarray]:
        """The cache as the attention sees it, K and V ``[B, Hkv, T, D]`` f32, in the *rotated*
        basis when ``rotate`` is on (for tests and measurements; attention never calls this)."""
        d = self.d
        kq, vq = self._dequantized_quant()
        kf = np.concatenate([self.sink_k.view().astype(np.float32), kq, self.res_k.view().astype(np.float32)], 1)
        vf = np.concatenate([self.sink_v.view().astype(np.float32), vq, self.res_v.view().astype(np.float32)], 1)
        held = self.len - self.evicted  # a sliding window: the tokens after the evicted ones
        return kf.reshape(self.b, self.hkv, held, d), vf.reshape(self.b, self.hkv, held, d)

    def with_config(self, **changes) -> "KiviSdpa":
        """A fresh, empty cache with some attributes changed."""
        c = replace(self.cfg, **changes)
        return KiviSdpa(scale=c.scale, bits=c.bits, key_group=c.key_group, value_group=c.value_group,
                        residual=c.residual, sinks=c.sinks, is_causal=c.is_causal, rotate=c.rotate,
                        clip=c.clip, params=c.params, block_tokens=c.block_tokens, softcap=c.softcap,
                        key_bits=c.key_bits, value_bits=c.value_bits, key_axis=c.key_axis, window=c.window,
                        sink_logits=c.sink_logits)
