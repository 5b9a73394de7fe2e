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
  0, and attention adds their exact contribution back. So one NaN key makes the scores of that token NaN (as exact attention would)
  without spoiling the range of the 31 other tokens of its group.
* Optional accuracy options (NNEF attributes after the public ones): ``clip`` (MSE-optimal shrink of
  each group range, searched on a grid), ``rotate`` (orthonormal Hadamard rotation of head_dim for
  keys and/or values: ``"k"``, ``"v"``, ``"kv"``; q.k and p.V are preserved exactly in real arithmetic).

Attention never builds the f32 cache: the quantized part is read block by block (a multiple of
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
f16 params are widened with :func:`~nnef_kv.kv.common.f16_to_f32` (exact, ~4x NumPy's cast).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..errors import GraphError, InputError, StateError
from .common import BufferCheckpoint, GrowBuffer, check_qkv, expect_state, f16_to_f32
from .packing import GroupCodec
from .settings import IntSetting, Problem, first_problem

__all__ = ["KiviConfig", "KiviSdpa", "hadamard"]

CODES_LAYOUT = 2  # saved in states: 2 = GroupCodec (token-planar inside groups); 1 was planar rows
F16_SAFE = 16384.0  # with f16 params, |x| above this goes to the exact side table
_CLIP_GRID = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5)


def hadamard(d: int) -> np.ndarray:
    """An orthonormal D x D rotation: Sylvester Hadamard / sqrt(D) when D is a power of two, else a
    fixed (seed 0) random orthogonal matrix."""
    if d & (d - 1) == 0:
        h = np.ones((1, 1))
        while h.shape[0] < d:
            h = np.block([[h, h], [h, -h]])
        return (h / np.sqrt(d)).astype(np.float32)
    rng = np.random.default_rng(0)
    qm, r = np.linalg.qr(rng.standard_normal((d, d)))
    return (qm * np.sign(np.diag(r))).astype(np.float32)


#: the integer settings of the op; scheme ``kivi`` checks its options with :func:`kivi_problem` too
KIVI_SETTINGS = {"bits": IntSetting(1, 8, reason="scheme kivi takes 1..8 bits"), "key_group": IntSetting(1),
                 "value_group": IntSetting(1), "residual": IntSetting(0), "sinks": IntSetting(0),
                 "block_tokens": IntSetting(0)}


def kivi_problem(**values: object) -> Problem | None:
    """The first bad KIVI setting among ``values`` (names of :data:`KIVI_SETTINGS`), or None."""
    return first_problem(values, KIVI_SETTINGS)


@dataclass(frozen=True)
class KiviConfig:
    """The op's attributes (names as in the NNEF declaration)."""

    scale: float = 0.125
    bits: int = 4
    key_group: int = 32
    value_group: int = 32
    residual: int = 32
    sinks: int = 0
    is_causal: bool = True
    rotate: str = "none"
    clip: bool = False
    params: str = "f16"
    block_tokens: int = 0  # 0: chosen so that one block of codes is ~1 MiB of f32
    softcap: float = 0.0  # > 0: scores softcapped, softcap * tanh(scores / softcap) (Gemma 2); 0: none

    def validate(self, who: str) -> None:
        bad = kivi_problem(bits=self.bits, key_group=self.key_group, value_group=self.value_group,
                           residual=self.residual, sinks=self.sinks, block_tokens=self.block_tokens)
        if bad is not None:
            raise GraphError(f"{who}: {bad}")
        if self.rotate not in ("none", "", "k", "v", "kv"):
            raise GraphError(f"{who}: rotate must be one of none, k, v, kv, got {self.rotate!r}")
        if self.params not in ("f16", "f32"):
            raise GraphError(f"{who}: params must be 'f16' or 'f32', got {self.params!r}")
        if not self.softcap >= 0 or self.softcap == float("inf"):
            raise GraphError(f"{who}: softcap must be a finite number >= 0 (0: none), got {self.softcap}")

    @property
    def param_dtype(self) -> np.dtype:
        return np.dtype(np.float16 if self.params == "f16" else np.float32)

    def as_array(self) -> np.ndarray:
        """The config as saved in a state, with the version of the codes layout last."""
        rot = {"none": 0, "": 0, "k": 1, "v": 2, "kv": 3}[self.rotate]
        return np.array([self.bits, self.key_group, self.value_group, self.residual, self.sinks,
                         rot, int(self.clip), int(self.params == "f16"), CODES_LAYOUT], np.int64)


def _as32(a: np.ndarray) -> np.ndarray:
    """f32 view (no copy) or copy of a full-precision array."""
    return np.asarray(a, dtype=np.float32)


def _rotate(x: np.ndarray, rot: np.ndarray) -> np.ndarray:
    """``x @ rot`` over the last axis, each output a fixed-order sum of products: a row's result does
    not depend on how many rows are rotated with it (BLAS's does), so a chunk stores the same bits as
    one-token calls."""
    out = x[..., 0:1] * rot[0]
    for j in range(1, rot.shape[0]):
        out += x[..., j:j + 1] * rot[j]
    return out


def _finite_part(x: np.ndarray, offset: int):
    """``x [n, T, D]`` with its non-finite values set to 0, and ``(head, column, channel, value)`` of
    those values (column = ``offset`` + token), or None when all are finite."""
    bad = ~np.isfinite(x)
    if not bad.any():
        return x, None
    h, t, c = np.nonzero(bad)
    return np.where(bad, np.float32(0), x), (h, t + offset, c, x[h, t, c])


@dataclass(frozen=True)
class _View:
    """What one attention call reads: the full-precision sinks and window (storage dtype,
    ``[n, tokens, D]``), the first ``tq`` quantized tokens of the buffers, and ``total`` positions in
    all (``sinks + tq + window``; the last ``Sq`` are the call's queries)."""

    sink_k: np.ndarray
    sink_v: np.ndarray
    res_k: np.ndarray
    res_v: np.ndarray
    tq: int
    total: int

    @property
    def ns(self) -> int:
        return int(self.sink_k.shape[1])

    @property
    def nr(self) -> int:
        return int(self.res_k.shape[1])


class _Outliers:
    """Exact side table of values kept out of the quantized groups: (head, position, channel, value)."""

    def __init__(self) -> None:
        self.head = GrowBuffer((), (), np.int32, min_chunk=16)
        self.pos = GrowBuffer((), (), np.int64, min_chunk=16)
        self.chan = GrowBuffer((), (), np.int32, min_chunk=16)
        self.val = GrowBuffer((), (), np.float32, min_chunk=16)

    def add(self, head: np.ndarray, pos: np.ndarray, chan: np.ndarray, val: np.ndarray) -> None:
        if head.size:
            self.head.append(head.astype(np.int32))
            self.pos.append(pos.astype(np.int64))
            self.chan.append(chan.astype(np.int32))
            self.val.append(val.astype(np.float32))

    def __len__(self) -> int:
        return self.head.len

    def in_range(self, p0: int, p1: int):
        pos = self.pos.view()
        sel = np.nonzero((pos >= p0) & (pos < p1))[0]
        return self.head.view()[sel], pos[sel], self.chan.view()[sel], self.val.view()[sel]

    @property
    def nbytes(self) -> int:
        return self.head.nbytes + self.pos.nbytes + self.chan.nbytes + self.val.nbytes

    def arrays(self, prefix: str) -> dict[str, np.ndarray]:
        return {f"{prefix}_head": self.head.view().copy(), f"{prefix}_pos": self.pos.view().copy(),
                f"{prefix}_chan": self.chan.view().copy(), f"{prefix}_val": self.val.view().copy()}

    def load(self, tensors: dict[str, np.ndarray], prefix: str, who: str, n: int, tq: int, d: int) -> None:
        h = expect_state(tensors, f"{prefix}_head", None, np.int32, who)
        cnt = h.shape[0] if h.ndim == 1 else -1
        p = expect_state(tensors, f"{prefix}_pos", (cnt,), np.int64, who)
        c = expect_state(tensors, f"{prefix}_chan", (cnt,), np.int32, who)
        v = expect_state(tensors, f"{prefix}_val", (cnt,), np.float32, who)
        if h.ndim != 1 or (cnt and (h.min() < 0 or h.max() >= n or p.min() < 0 or p.max() >= tq
                                   or c.min() < 0 or c.max() >= d)):
            raise StateError(f"{who}: side table {prefix} holds entries outside the cache")
        self.head.set_exact(h)
        self.pos.set_exact(p)
        self.chan.set_exact(c)
        self.val.set_exact(v)


class KiviSdpa(BufferCheckpoint):
    """State of one ``nnef_kv_kivi_sdpa`` node: a quantized KV cache and attention over it."""

    WHO = "nnef_kv_kivi_sdpa"

    def __init__(self, axis: int = 2, scale: float = 0.125, bits: int = 4, key_group: int = 32,
                 value_group: int = 32, residual: int = 32, sinks: int = 0, is_causal: bool = True,
                 rotate: str = "none", clip: bool = False, params: str = "f16", block_tokens: int = 0,
                 threads: int = 1, score_budget: int = 1 << 22, softcap: float = 0.0) -> None:
        if int(axis) != 2:
            raise GraphError(f"{self.WHO}: only axis 2 of [B, H, S, D] is supported, got {axis}")
        self.axis = 2
        self.cfg = KiviConfig(scale=float(scale), bits=int(bits), key_group=int(key_group),
                              value_group=int(value_group), residual=int(residual), sinks=int(sinks),
                              is_causal=bool(is_causal), rotate=str(rotate), clip=bool(clip),
                              params=str(params), block_tokens=int(block_tokens), softcap=float(softcap))
        self.cfg.validate(self.WHO)
        self.levels = float((1 << self.cfg.bits) - 1)
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
        self.codec = GroupCodec(c.bits, d, c.key_group)
        self._unpack = self.codec.unpacker()  # fn(packed, out): whole groups into an f32 buffer
        rb = self.codec.row_bytes
        # codes grow by pages of >= 64 tokens, or 1/32 of what is held: < 3.2% unused capacity
        page = -(-64 // c.key_group) * c.key_group
        self.sink_k = GrowBuffer((n,), (d,), self.fp_dtype, min_chunk=max(c.sinks, 1))
        self.sink_v = GrowBuffer((n,), (d,), self.fp_dtype, min_chunk=max(c.sinks, 1))
        cap = c.residual + c.key_group - 1
        self.res_k = GrowBuffer((n,), (d,), self.fp_dtype, min_chunk=max(cap, 1))
        self.res_v = GrowBuffer((n,), (d,), self.fp_dtype, min_chunk=max(cap, 1))
        g = 1.03125
        self.k_codes = GrowBuffer((n,), (rb,), np.uint8, growth=g, min_chunk=page)
        self.v_codes = GrowBuffer((n,), (rb,), np.uint8, growth=g, min_chunk=page)
        gpage = page // c.key_group
        self.k_min = GrowBuffer((n,), (d,), pdt, growth=g, min_chunk=gpage)
        self.k_step = GrowBuffer((n,), (d,), pdt, growth=g, min_chunk=gpage)
        self.v_min = GrowBuffer((n,), (self.nvg,), pdt, growth=g, min_chunk=page)
        self.v_step = GrowBuffer((n,), (self.nvg,), pdt, growth=g, min_chunk=page)
        self.k_out = _Outliers()
        self.v_out = _Outliers()
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
    def _params(self, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Stored (min, step) for finite ranges [lo, hi] (f32 arrays, inf where a group is empty)."""
        empty = ~np.isfinite(lo)
        lo = np.where(empty, 0.0, lo).astype(np.float32)
        hi = np.where(empty, 0.0, hi).astype(np.float32)
        pdt = self.cfg.param_dtype
        mn = lo.astype(pdt)
        if pdt == np.float16:  # round min down and step up so the stored range covers [lo, hi]
            mn = np.where(mn.astype(np.float32) > lo, np.nextafter(mn, np.float16(-np.inf)), mn)
        mn32 = mn.astype(np.float32)
        st = ((hi - mn32) / np.float32(self.levels)).astype(pdt)
        if pdt == np.float16:
            short = mn32 + st.astype(np.float32) * np.float32(self.levels) < hi
            st = np.where(short, np.nextafter(st, np.float16(np.inf)), st)
        return mn, st

    def _codes(self, x: np.ndarray, mn: np.ndarray, st: np.ndarray) -> np.ndarray:
        """Codes of x (NaN = outlier, coded 0) under broadcastable stored params."""
        mn32 = mn.astype(np.float32)
        st32 = st.astype(np.float32)
        with np.errstate(invalid="ignore", divide="ignore"):
            r = np.where(st32 > 0, (x - mn32) / np.where(st32 > 0, st32, 1), 0)
        r = np.clip(np.rint(np.nan_to_num(r, nan=0.0)), 0, self.levels)
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

    def _fit(self, xc: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
        """Group params along ``axis`` of xc (NaN = ignore); MSE-optimal range shrink when ``clip``."""
        lo, hi = self._range(xc, axis)
        if not self.cfg.clip:
            return self._params(lo, hi)
        best = None
        fin = np.isfinite(xc)
        x0 = np.where(fin, xc, 0)
        mid = (lo + hi) / 2
        for a in _CLIP_GRID:
            mn, st = self._params(mid + a * (lo - mid), mid + a * (hi - mid))
            mne, ste = np.expand_dims(mn, axis), np.expand_dims(st, axis)
            rec = mne.astype(np.float32) + self._codes(xc, mne, ste) * ste.astype(np.float32)
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
        kg = kc.reshape(n, ng, c.key_group, d)
        mn, st = self._fit(kg, axis=2)  # [n, ng, d]
        codes = self._codes(kg, mn[:, :, None, :], st[:, :, None, :]).reshape(n, t, d)
        self.k_codes.append(self.codec.pack(codes))
        self.k_min.append(mn)
        self.k_step.append(st)
        if kbad.any():
            h, tt, ch = np.nonzero(kbad)
            self.k_out.add(h, tt + q0, ch, k[h, tt, ch])
        # values: per token over groups of vg channels
        vc, vbad = self._split_outliers(v)
        vgp = vc.reshape(n, t, self.nvg, self.vg)
        mn, st = self._fit(vgp, axis=3)  # [n, t, nvg]
        codes = self._codes(vgp, mn[..., None], st[..., None]).reshape(n, t, d)
        self.v_codes.append(self.codec.pack(codes))
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
        wk = np.concatenate([self.res_k.view(), k], axis=1)
        wv = np.concatenate([self.res_v.view(), v], axis=1)
        total = wk.shape[1]
        ng = max(0, (total - c.residual) // c.key_group)
        nq = ng * c.key_group
        if nq:
            self._quantize_groups(wk[:, :nq].astype(np.float32), wv[:, :nq].astype(np.float32))
        # the window is held at its exact size (at most residual + key_group - 1 tokens)
        self.res_k.set_exact(wk[:, nq:])
        self.res_v.set_exact(wv[:, nq:])

    # =============================================================================== attention
    def _block_tokens(self, n: int) -> int:
        kg = self.cfg.key_group
        bt = self.cfg.block_tokens or max(kg, (1 << 18) // max(1, n * self.d))
        return max(kg, bt // kg * kg)

    def _current_view(self) -> _View:
        """The cache as it is now (no call in progress)."""
        return _View(self.sink_k.view(), self.sink_v.view(), self.res_k.view(), self.res_v.view(),
                     self.n_quant, self.len)

    def _call_view(self, ks: np.ndarray, vs: np.ndarray) -> _View:
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
        return _View(sk, sv, rk, rv, self.n_quant, self.len + ks.shape[1])

    def _attend(self, q: np.ndarray, sq: int, view: _View | None = None) -> np.ndarray:
        """q: [n, M, D] f32 (rotated, M = group * Sq rows; row r is query r % Sq). Returns [n, M, D].
        ``view``: what is read (default: the cache as it is now).

        Heads are independent: with ``threads > 1`` and a long enough cache they are split into
        contiguous ranges processed in a thread pool (NumPy releases the GIL in its kernels)."""
        if view is None:
            view = self._current_view()
        n = q.shape[0]
        work = view.tq * n * self.d
        nth = min(self.threads, n) if work >= (1 << 20) else 1
        if nth <= 1:
            return self._attend_heads(q, sq, 0, n, 0, view)
        from concurrent.futures import ThreadPoolExecutor

        bounds = np.linspace(0, n, nth + 1).astype(int)
        if self._pool is None or self._pool._max_workers != nth:
            self._pool = ThreadPoolExecutor(max_workers=nth, thread_name_prefix="nnef_kv_kivi")
        futs = [self._pool.submit(self._attend_heads, q[bounds[i]:bounds[i + 1]], sq, int(bounds[i]),
                                  int(bounds[i + 1]), i, view) for i in range(nth)]
        return np.concatenate([f.result() for f in futs], axis=0)

    def _code_buffer(self, slot: int, n: int, rows: int) -> np.ndarray:
        buf = self._bufs.get(slot)
        if buf is None or buf.shape[1] < rows or buf.shape[0] != n:
            buf = self._bufs[slot] = np.empty((n, rows, self.d), np.float32)
        return buf

    def _attend_heads(self, q: np.ndarray, sq: int, h0: int, h1: int, slot: int, view: _View) -> np.ndarray:
        """Attention for the kv heads ``h0:h1`` (q already restricted to them); ``slot`` names the
        reusable code buffer of the calling thread. Small score matrices (decode) take the two-pass
        path, large ones (long prefill chunks) the online softmax; both read the codes block by block."""
        if self.b * self.hkv * q.shape[1] * view.total * 4 <= self.score_budget:
            return self._attend_two_pass(q, sq, h0, h1, slot, view)
        return self._attend_online(q, sq, h0, h1, slot, view)

    def _attend_two_pass(self, q: np.ndarray, sq: int, h0: int, h1: int, slot: int, view: _View) -> np.ndarray:
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
            np.matmul(q, _as32(view.sink_k[hs]).swapaxes(-1, -2), out=s[:, :, :ns])
        if tq:
            self._key_scores(s[:, :, ns:ns + tq], q, h0, h1, slot)
        if nr:
            np.matmul(q, _as32(view.res_k[hs]).swapaxes(-1, -2), out=s[:, :, ns + tq:])
        self._softcap(s)
        if c.is_causal and sq > 1:  # a single query is the last position: it sees everything
            qpos = (total - sq) + (np.arange(m) % sq)
            s[:, ~(np.arange(total)[None, :] <= qpos[:, None])] = -np.inf
        mx = s.max(axis=-1, keepdims=True)
        if not mx.min() > -np.inf:  # rows with every position masked
            mx = np.where(np.isfinite(mx), mx, np.float32(0))
        p = np.exp(np.subtract(s, mx, out=s), out=s)
        ls = p.sum(axis=-1, keepdims=True)
        out = self._value_sum(p[:, :, ns:ns + tq], h0, h1, slot) if tq else np.zeros((n, m, d), np.float32)
        if ns:
            out += np.matmul(p[:, :, :ns], _as32(view.sink_v[hs]))
        if nr:
            out += np.matmul(p[:, :, ns + tq:], _as32(view.res_v[hs]))
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
        params, a fresh exact conversion for f16 ones (:func:`f16_to_f32`, ~4x faster than NumPy's cast)."""
        a = buf.view(0, count)[hs]
        return a if a.dtype == np.float32 else f16_to_f32(a)

    def _attend_online(self, q: np.ndarray, sq: int, h0: int, h1: int, slot: int, view: _View) -> np.ndarray:
        """Online softmax over sinks, blocks of codes and window (bounded memory for long chunks)."""
        c = self.cfg
        n, m, d = q.shape
        hs = slice(h0, h1)
        total = view.total
        qpos = (total - sq) + (np.arange(m) % sq)  # absolute position of each query row
        q = q * np.float32(c.scale)  # scores are (scale q).k: the scale is folded into the query
        qmin_pos = int(qpos.min())
        mx = np.full((n, m), -np.inf, np.float32)
        ls = np.zeros((n, m), np.float32)
        acc = np.zeros((n, m, d), np.float32)

        def merge(s: np.ndarray, pv_fn, p0: int) -> None:
            """Online softmax: fold one block of scores (and its values, via pv_fn) into mx/ls/acc."""
            nonlocal mx, ls, acc
            blk = s.shape[-1]
            self._softcap(s)
            if c.is_causal and p0 + blk - 1 > qmin_pos:
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

    # ============================================================================== entry point
    def _prepare(self, q: np.ndarray, k: np.ndarray, v: np.ndarray):
        """Checks, lazy init, rotation: ``(qn [n, g*Sq, D] f32, ks, vs [n, S, D] storage dtype, shape,
        out dtype, rotate values back?)``."""
        q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
        b, hq, sq, hkv, snew, d = check_qkv(self.WHO, q, k, v)
        out_dtype = q.dtype if q.dtype in (np.float16, np.float32) else np.dtype(np.float32)
        fp = np.dtype(np.float16) if k.dtype == np.float16 and v.dtype == np.float16 else np.dtype(np.float32)
        if not self._ready:
            self._init(b, hkv, d, fp)
        elif (b, hkv, d) != (self.b, self.hkv, self.d):
            raise InputError(f"{self.WHO}: k {k.shape} does not match the cache built for "
                             f"B={self.b}, Hkv={self.hkv}, D={self.d}")
        n = b * hkv
        k32 = k.astype(np.float32).reshape(n, snew, d)
        v32 = v.astype(np.float32).reshape(n, snew, d)
        rk = self.rot is not None and self.cfg.rotate in ("k", "kv")
        rv = self.rot is not None and self.cfg.rotate in ("v", "kv")
        if rk:
            k32 = _rotate(k32, self.rot)
        if rv:
            v32 = _rotate(v32, self.rot)
        qn = q.astype(np.float32).reshape(n, (hq // hkv) * sq, d)
        if rk:
            qn = _rotate(qn, self.rot)
        return qn, k32.astype(self.fp_dtype), v32.astype(self.fp_dtype), q.shape, out_dtype, rv

    def _finish(self, out: np.ndarray, shape: tuple[int, ...], out_dtype: np.dtype, rv: bool) -> np.ndarray:
        if rv:
            out = _rotate(out, self.rot.T)
        return out.reshape(shape).astype(out_dtype)

    def __call__(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """One call: attention of ``q`` over the cache *with this call's tokens in full precision*
        (only groups quantized before the call are read quantized, as KIVI's reference does: a prompt
        attends exactly), then the call's tokens are stored by the usual rule."""
        qn, ks, vs, shape, out_dtype, rv = self._prepare(q, k, v)
        sq = shape[2]
        view = self._call_view(ks, vs)
        with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf follow f32 semantics, silently
            out = self._attend(qn, sq, view) if view.total and sq else None
        self._ingest(ks, vs)
        self.len += ks.shape[1]
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
        with np.errstate(invalid="ignore", over="ignore"):
            out = self._attend_stepwise(qn, snew, view, tq0, qcount, len0)
        return self._finish(out, shape, out_dtype, rv)

    def _attend_stepwise(self, q: np.ndarray, sq: int, view: _View, tq0: int, qcount: np.ndarray,
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
        sk, sv = _as32(view.sink_k), _as32(view.sink_v)
        rk, rv = _as32(view.res_k), _as32(view.res_v)
        width = ns + tqf + nfp
        # non-finite values: out of the products (a masked position would give 0 * inf = NaN, while the
        # row's one-token call never saw it), added back for the rows that see them
        sv, bad_s = _finite_part(sv, 0)
        vq, bad_q = _finite_part(vq, ns)
        rv, bad_r = _finite_part(rv, ns + tqf)
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
            mx = s.max(axis=-1, keepdims=True)
            if not mx.min() > -np.inf:
                mx = np.where(np.isfinite(mx), mx, np.float32(0))
            p = np.exp(np.subtract(s, mx, out=s), out=s)
            ls = p.sum(axis=-1, keepdims=True)
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
        cfg = expect_state(tensors, "config", None, np.int64, who)
        if not np.array_equal(cfg, self.cfg.as_array()):
            raise StateError(f"{who}: saved state was made with config {cfg.tolist()} "
                             f"(bits, key_group, value_group, residual, sinks, rotate, clip, f16 params, "
                             f"codes layout), "
                             f"this node has {self.cfg.as_array().tolist()}")
        shape = expect_state(tensors, "shape", (5,), np.int64, who)
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
                             f"{self.codec.row_bytes}) for {c.bits}-bit codes")
        tq = kc.shape[1]
        expected_tq = max(0, (rest - c.residual) // c.key_group) * c.key_group
        if tq != expected_tq:
            raise StateError(f"{who}: {tq} quantized tokens in k_codes, but a cache of {t} tokens holds "
                             f"{expected_tq} with residual {c.residual}, key_group {c.key_group}, sinks {c.sinks}")
        nr = rest - tq
        vc = expect_state(tensors, "v_codes", (n, tq, self.codec.row_bytes), np.uint8, who)
        pdt = c.param_dtype
        ng = tq // c.key_group
        kmn = expect_state(tensors, "k_min", (n, ng, d), pdt, who)
        kst = expect_state(tensors, "k_step", (n, ng, d), pdt, who)
        vmn = expect_state(tensors, "v_min", (n, tq, self.nvg), pdt, who)
        vst = expect_state(tensors, "v_step", (n, tq, self.nvg), pdt, who)
        rk = expect_state(tensors, "res_k", (n, nr, d), self.fp_dtype, who)
        rv = expect_state(tensors, "res_v", (n, nr, d), self.fp_dtype, who)
        for nm, arr in (("k_min", kmn), ("k_step", kst), ("v_min", vmn), ("v_step", vst)):
            if not np.all(np.isfinite(arr)) or (nm.endswith("step") and np.any(arr < 0)):
                raise StateError(f"{who}: state tensor {nm!r} holds non-finite or negative values "
                                 f"(group params are finite; steps >= 0)")
        if c.bits < 8 and tq:
            head = kc[:, :c.key_group]  # the first group: no stray padding bits
            if not np.array_equal(self.codec.pack(self.codec.unpack(head)), head):
                raise StateError(f"{who}: k_codes are not valid {c.bits}-bit packed codes")
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
        if not stepwise:
            return np.full(n, self.n_quant, np.int64)
        before = np.maximum(self.len + np.arange(n) - c.sinks, 0)
        return c.key_group * np.maximum(0, (before - c.residual) // c.key_group)

    def census(self) -> dict[str, int]:
        """Tokens held now: quantized (keys and values alike) and in full precision (sinks + window);
        ``f32_bytes``: what the same keys and values take as f32."""
        return {"tokens": int(self.len), "quantized": int(self.n_quant),
                "full_precision": int(self.n_sink + self.n_res), "f32_bytes": 8 * self.b * self.hkv * self.len * self.d}

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
        kq = (self.k_min.view().astype(np.float32)[:, :, None, :]
              + kc.reshape(n, tq // kg, kg, d) * self.k_step.view().astype(np.float32)[:, :, None, :]).reshape(n, tq, d)
        vc = self.codec.unpack(self.v_codes.view()).astype(np.float32).reshape(n, tq, self.nvg, self.vg)
        vq = (self.v_min.view().astype(np.float32)[..., None] + vc * self.v_step.view().astype(np.float32)[..., None]).reshape(n, tq, d)
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
        return kf.reshape(self.b, self.hkv, self.len, d), vf.reshape(self.b, self.hkv, self.len, d)

    def with_config(self, **changes) -> "KiviSdpa":
        """A fresh, empty cache with some attributes changed."""
        c = replace(self.cfg, **changes)
        return KiviSdpa(scale=c.scale, bits=c.bits, key_group=c.key_group, value_group=c.value_group,
                        residual=c.residual, sinks=c.sinks, is_causal=c.is_causal, rotate=c.rotate,
                        clip=c.clip, params=c.params, block_tokens=c.block_tokens, softcap=c.softcap)
