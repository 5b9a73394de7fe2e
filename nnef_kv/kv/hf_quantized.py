"""Hugging Face transformers 5.x ``QuantizedCache`` as an attention op: ``nnef_kv_hf_quantized_sdpa``.

A NumPy reproduction, written from the facts below (read from transformers 5.23.0, optimum-quanto
0.2.7 and hqq 0.2.8.post1; no code copied), of one layer of ``QuantizedCache(backend="quanto"|"hqq")``
followed by exact softmax attention over what the layer returns. Cross-checked against the real
layer by ``tools/make_hf_cache_golden.py`` -> ``tests/fixtures/hf_quantized_cache_golden.npz``.

Facts (paths relative to site-packages)
---------------------------------------
**The layer** (``transformers/cache_utils.py``):

* ``QuantizedLayer.__init__`` (l. 761-768): defaults ``nbits=4, axis_key=0, axis_value=0,
  q_group_size=64, residual_length=128``; ``QuantizedCache.__init__`` (l. 2147-2193, l. 2185) passes only the
  arguments given, so these are the cache's defaults too (``backend`` has no default).
* ``QuantizedLayer.update`` (l. 781-821), per call with ``S`` new tokens:

  - ``cumulative_length += S`` (l. 794);
  - **first call (prefill)** (l. 797-801): the call's K and V are returned *unchanged* (the prefill
    attends exactly) and the whole of them is quantized into ``_quantized_keys/_values``; the
    full-precision residual is an empty (1-D) tensor;
  - **later calls** (l. 803-821): the quantized store is *dequantized* (l. 803-804), the call returns
    ``cat([dequantized store, residual, new tokens], dim=-2)`` (l. 808-809): the residual and the
    call's own tokens in full precision, everything older dequantized. Then, if
    ``residual_len + S >= residual_length`` (l. 810-811; tokens counted, not calls), the **whole returned
    tensor is quantized again** (l. 812-813) -- the dequantized history is re-quantized with new
    groups (double quantization, error compounding at every flush) -- and the residual emptied;
    otherwise the new tokens are appended to the residual (l. 819-820).
  - So with one-token calls the residual holds 0..residual_length-1 tokens and every
    ``residual_length``-th call flushes; a multi-token call with ``residual_len + S >= residual_length``
    quantizes all of its tokens at once. ``residual_length <= 1`` flushes at every call.
* ``QuantoQuantizedLayer`` (l. 854-906): ``nbits`` in {2, 4} (``qint2``/``qint4``), axes in {0, -1},
  ``MaxOptimizer`` (l. 896), ``_quantize`` = ``MaxOptimizer()(t, qtype, axis, q_group_size)`` then
  ``quantize_weight(t, qtype, axis, scale, shift, q_group_size)`` (l. 898-903); ``_dequantize`` =
  ``qtensor.dequantize()``.
* ``HQQQuantizedLayer`` (l. 909-963, ``_quantize`` l. 945): ``nbits`` in {1, 2, 3, 4, 8}, axes in {0, 1},
  ``hqq.core.quantize.Quantizer.quantize(t, axis, device, compute_dtype=key dtype, nbits,
  group_size)`` with its defaults ``channel_wise=True, optimize=True, round_zero=False``; the meta
  ``scale``/``zero`` are cast to the compute dtype (``Quantizer.cuda`` -> ``to_inplace``).

**quanto** (``optimum/quanto``):

* grouping, ``tensor/grouped.py`` ``group`` (l. 17-36), on the contiguous ``[B, H, T, D]`` tensor:
  ``axis = 0``: ``reshape(-1, group_size)`` -- groups of ``group_size`` *consecutive elements* in
  row-major order (one token's channels when ``D == group_size``; several tokens of one head when
  ``D < group_size``; straddling heads when ``T * D`` is not a multiple). Needs ``group_size`` to divide
  ``H * T * D`` (l. 24-25, else ``ValueError``). ``axis = -1``: the flattened ``(B, H, T)`` rows cut in
  runs of ``group_size`` consecutive rows, one group per (run, channel) -- per-channel groups over
  ``group_size`` tokens (KIVI's key grouping), straddling heads and batches when ``T`` is not a
  multiple; needs ``group_size`` to divide ``B * H * T`` (so most flushes fail in HF unless
  ``B*H*T`` is a multiple). Grouped shapes ``[N/g, g]`` (axis 0) and ``[g, N/g]`` (axis -1).
* ``MaxOptimizer`` (``tensor/optimizers/max_optimizer.py`` l. 27-37, called from
  ``affine_optimizer.py`` l. 85-97): ``rmin/rmax`` over each group (``amin``/``amax``, NaN propagates),
  ``scale = (rmax - rmin) / (2**bits - 1)``, ``shift = -rmin``, both in the input's dtype (l. 92-93
  assert it). When the grouped tensor has one group only along ``axis`` (``shape[axis] == 1``, l. 89-90:
  axis 0 with ``N == group_size``) the reduction runs over the other dimension: one scale per element,
  0, and the values come back exactly.
* ``quantize_affine`` (``library/quantize.py`` l. 64-78): ``code = clamp(round((x + shift) / scale),
  0, 2**bits - 1)`` -> uint8; ``torch.round`` is half to even; NaN codes become 0.
* storage: ``PackedTensor`` (``tensor/packed.py`` ``pack_weights`` l. 24-66): the ``[rows, cols]``
  codes packed along rows, ``ceil(rows / per)`` bytes per column (``per = 8 / bits``), byte ``r`` holding
  rows ``r, r + m, ...`` in bit fields 0, ``bits``, ... (``m = ceil(rows / per)``): exactly
  :func:`~nnef_kv.kv.packing.pack_planar` of the transposed codes.
* dequantize (``tensor/qbits.py`` ``QBitsDequantizer`` l. 27-49, ``dqt -= shift`` l. 45):
  ``x = scale * code - shift`` in the scale dtype (two roundings), ungrouped back to ``[B, H, T, D]``.

**HQQ** (``hqq/core``):

* ``Quantizer.quantize`` (``quantize.py`` l. 76-180; grouping l. 106-111, scale/zero l. 121-130):
  ``group_size`` must divide ``numel`` (assert, l. 94-100); ``W = t.float()``, ``axis = 1``:
  ``reshape(-1, g)`` (consecutive elements, like quanto's axis 0); ``axis = 0``: ``reshape(g, -1)``
  and min/max over dim 0: group ``j`` is the elements ``j, j + N/g, j + 2N/g, ...`` (strided across
  the whole tensor). ``scale = (2**b - 1) / (max - min)``
  (an inverse scale; torch evaluates ``int / tensor`` as ``reciprocal(tensor) * int``, two roundings),
  1.0 where ``|max - min| <= 1e-4``, clamped to ``<= 2e4``; ``zero = -min * scale``.
* optimizer ``optimize_weights_proximal_legacy`` (``optimize.py`` l. 201-255, the default, l. 259):
  f32 on CPU; up to 20 iterations of ``W_q = clamp(round(W * s + z))``, ``W_r = (W_q - z) / s``,
  ``W_e = shrink_lp(W - W_r, beta=10, p=0.7)`` (``sign(x) * max(|x| - |x|**-0.3 / beta, 0)``; beta
  is never increased in this version), ``z = mean(W_q - (W - W_e) * s)`` over the group; it stops at
  the first iteration whose mean ``|W - W_r|`` (over the whole tensor, before that iteration's update)
  is not below the best so far -- *keeping that iteration's updated zero* -- and quantizes once more
  with the final zero. The scale is never changed. A NaN anywhere makes every error NaN: one iteration.
* stored: ``meta["scale"] = 1 / s`` and ``zero`` (cast to the compute dtype), codes packed along the
  rows (``bitpack.py``: 8 bits as uint8; 4/2/1 bits the first ``rows/per`` rows in the *high* bits,
  rows must be a multiple of ``per`` or HQQ fails; 3 bits: rows padded to a multiple of 10, ten codes
  in an int32, first in bits 27..29), ``1 / s`` taken at l. 154. Dequantize (``quantize.py``
  l. 184-199): ``(code - zero) * scale`` in the compute dtype. With ``axis = 1`` and 3 bits HQQ
  slices the unpacked rows to ``shape[0] * shape[1] // group_size`` (l. 190-195), which is wrong for
  a 4-D tensor: HF's HQQ 3-bit cache with ``axis 1`` fails at its first decode step, so this op
  refuses it.

What this op does
-----------------
``q [B, Hq, Sq, D]``, ``k, v`` this call's new tokens ``[B, Hkv, S, D]``; the K/V it attends are
exactly what the HF layer's ``update`` returns for that call (same arithmetic, same dtype: f16 when k
and v are f16, else f32), then exact softmax attention in f32 (``scale * q.k``; GQA query head
``h -> h // (Hq / Hkv)``; causal bottom-right aligned: query row ``i`` at position ``T - Sq + i``,
as HF's causal mask for a prefill chunk). Calls that HF refuses (a group size that does not divide
the tensor at a quantization, HQQ's packing) raise ``InputError`` and leave the state unchanged.

* **Stepwise** (:meth:`HfQuantizedSdpa.stepwise`): the flush rule counts tokens, so one ``S``-token
  call differs from ``S`` one-token calls (it quantizes all of its tokens at once, and the rows of a
  one-token sequence read the store as it was at their own call). ``stepwise`` reproduces the
  one-token calls *vectorised per segment between flushes*: inside a segment the quantized store is
  fixed, so its rows are one causal attention over ``[dequantized store | residual | segment]``;
  each flush re-quantizes the history once, as the one-token calls would. An empty cache makes the
  first token a one-token prefill.
* **Non-finite values**: reproduced as the backends do them (well defined in IEEE arithmetic): a NaN
  or an infinity in a group makes its min/max/scale non-finite and the *whole group* dequantizes to
  NaN (``inf * 0 = NaN``), and since every flush re-quantizes the whole history, a NaN group spreads
  to whatever groups overlap it after the next flush (quanto groups move when ``T * D`` changes).
  HQQ: a NaN anywhere stops the optimizer after one iteration. In the attention, positions a row
  does not see (causal mask) contribute nothing, not even ``0 * NaN`` (so ``stepwise`` equals one-token
  calls); a row that sees nothing outputs 0.
* **Memory** (:meth:`nbytes`): ``codes`` = the packed code arrays as the backend holds them (quanto:
  ``ceil(rows/per) * cols`` bytes per store; HQQ: uint8 or, 3 bits, int32 words of ten codes),
  ``params`` = scale + shift (quanto) or scale + zero (HQQ) arrays in the K/V dtype (one pair a group),
  ``full_precision`` = the residual buffers' allocated capacity.

Cross-check (``tests/oracle/test_kv_hf_op.py``): quanto -- the K/V attended at every call are bit-identical
to what HF's ``update`` returned (f32 and f16, axes 0/-1, NaN/Inf included); HQQ -- same codes and
scales, zero points a few ulps apart (torch's Sleef ``pow`` and cascade sums in the optimizer; the
``|e|**-0.3`` here is taken in f64 and rounded, the closest cheap match), K/V within 5.3e-6.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import GraphError, InputError, StateError
from ..core.registry import stateful
from . import blocked
from .common import (BufferCheckpoint, GrowBuffer, check_sink_logits, expect_config_and_shape, expect_state,
                     sink_rows, start_call)
from .hf_quantizers import (QStore, hqq_dequantize, hqq_pack, hqq_packed_shape, hqq_quantize, hqq_rows, hqq_unpack,
                            quanto_dequantize, quanto_grouped_shape, quanto_param_axis, quanto_quantize)
from .packing import pack_planar, unpack_planar

__all__ = ["HfQuantizedConfig", "HfQuantizedSdpa", "QStore", "quanto_quantize", "quanto_dequantize",
           "hqq_quantize", "hqq_dequantize"]

STATE_LAYOUT = 1
_BACKENDS = ("quanto", "hqq")


@dataclass(frozen=True)
class HfQuantizedConfig:
    """The op's attributes (HF names: ``nbits``, ``q_group_size``, ``residual_length``)."""

    scale: float = 0.125
    bits: int = 4
    group_size: int = 64
    residual: int = 128
    axis_key: int = 0
    axis_value: int = 0
    backend: str = "quanto"
    is_causal: bool = True
    window: int = 0  # > 0: a sliding window, a query at position p sees the keys in (p - window, p]
    sink_logits: tuple = ()  # one learned logit per query head, a softmax column of its own (GPT-OSS); (): none

    def validate(self, who: str) -> None:
        check_sink_logits(who, self.sink_logits)
        if self.backend not in _BACKENDS:
            raise GraphError(f"{who}: backend must be 'quanto' or 'hqq', got {self.backend!r}")
        allowed_bits = (2, 4) if self.backend == "quanto" else (1, 2, 3, 4, 8)
        if self.bits not in allowed_bits:
            raise GraphError(f"{who}: bits for the {self.backend} backend must be one of {list(allowed_bits)}, "
                             f"got {self.bits}")
        axes = (0, -1) if self.backend == "quanto" else (0, 1)
        for nm in ("axis_key", "axis_value"):
            if getattr(self, nm) not in axes:
                raise GraphError(f"{who}: {nm} for the {self.backend} backend must be one of {list(axes)}, "
                                 f"got {getattr(self, nm)}")
        if self.group_size < 1:
            raise GraphError(f"{who}: group_size must be >= 1, got {self.group_size}")
        if self.residual < 0:
            raise GraphError(f"{who}: residual must be >= 0, got {self.residual}")
        if self.window < 0:
            raise GraphError(f"{who}: window must be >= 0 (0: none), got {self.window}")
        if self.window and not self.is_causal:
            raise GraphError(f"{who}: a sliding window (window = {self.window}) needs is_causal = true")
        if self.backend == "hqq" and self.bits == 3 and 1 in (self.axis_key, self.axis_value):
            raise GraphError(f"{who}: HQQ 3-bit with axis 1 cannot be dequantized by HQQ (it slices the codes "
                             f"to shape[0] * shape[1] // group_size rows): HF's cache fails at its first decode step")

    def as_array(self) -> np.ndarray:
        extra = [self.window] if self.window else []  # appended only when on: earlier states load unchanged
        return np.array([self.bits, self.group_size, self.residual, self.axis_key, self.axis_value,
                         _BACKENDS.index(self.backend), STATE_LAYOUT] + extra, np.int64)


#: the op's NNEF declaration: its registration (below), and what tools read of its parameters
SIGNATURE = (
    'fragment nnef_kv_hf_quantized_sdpa(q: tensor<scalar>, k: tensor<scalar>, v: tensor<scalar>, '
    'axis: integer = 2, scale: scalar = 0.125, bits: integer = 4, group_size: integer = 64, '
    'residual: integer = 128, axis_key: integer = 0, axis_value: integer = 0, '
    'backend: string = "quanto", is_causal: logical = true, window: integer = 0, '
    'sink_logits: scalar[] = []) -> (output: tensor<scalar>);'
)


@stateful(SIGNATURE, "nnef_kv", role="attention+kv",
          describe="Hugging Face QuantizedCache (quanto / HQQ) + attention")
class HfQuantizedSdpa(BufferCheckpoint):
    """State of one ``nnef_kv_hf_quantized_sdpa`` node: HF's ``QuantizedLayer`` + exact attention."""

    WHO = "nnef_kv_hf_quantized_sdpa"
    QUANTIZED = True
    _CHECKPOINT_ATTRS = ("len", "qk", "qv", "evicted")

    def __init__(self, axis: int = 2, scale: float = 0.125, bits: int = 4, group_size: int = 64,
                 residual: int = 128, axis_key: int = 0, axis_value: int = 0, backend: str = "quanto",
                 is_causal: bool = True, window: int = 0, sink_logits: Any = ()) -> None:
        if int(axis) != 2:
            raise GraphError(f"{self.WHO}: only axis 2 of [B, H, S, D] is supported, got {axis}")
        self.axis = 2
        self.cfg = HfQuantizedConfig(scale=float(scale), bits=int(bits), group_size=int(group_size),
                                     residual=int(residual), axis_key=int(axis_key), axis_value=int(axis_value),
                                     backend=str(backend), is_causal=bool(is_causal), window=int(window),
                                     sink_logits=tuple(float(x) for x in np.ravel(sink_logits)))
        self.cfg.validate(self.WHO)
        self.reset()

    # ------------------------------------------------------------------------------ state
    def reset(self) -> None:
        self.b = self.hkv = self.d = 0
        self.fp_dtype = np.dtype(np.float32)
        self.len = 0
        self.evicted = 0  # sliding window: tokens dropped from the front at a quantization (absolute positions)
        self.qk: QStore | None = None
        self.qv: QStore | None = None
        self._ready = False

    def _init(self, b: int, hkv: int, d: int, fp_dtype: np.dtype) -> None:
        self.b, self.hkv, self.d = b, hkv, d
        self.fp_dtype = np.dtype(fp_dtype)
        cap = max(self.cfg.residual - 1, 1)  # the residual holds at most residual - 1 tokens between calls
        self.res_k = GrowBuffer((b, hkv), (d,), self.fp_dtype, growth=1.0, min_chunk=cap)
        self.res_v = GrowBuffer((b, hkv), (d,), self.fp_dtype, growth=1.0, min_chunk=cap)
        self._ready = True

    def _buffers(self) -> list[GrowBuffer]:
        return [self.res_k, self.res_v] if self._ready else []

    @property
    def n_res(self) -> int:
        return self.res_k.len if self._ready else 0

    @property
    def n_quant(self) -> int:
        return self.qk.shape[2] if self.qk is not None else 0

    # ------------------------------------------------------------------------- backend
    def _quantize(self, x: np.ndarray, axis: int) -> QStore:
        c = self.cfg
        fn = quanto_quantize if c.backend == "quanto" else hqq_quantize
        return fn(x, c.bits, axis, c.group_size, self.WHO)

    def _dequantize(self, st: QStore, axis: int) -> np.ndarray:
        c = self.cfg
        fn = quanto_dequantize if c.backend == "quanto" else hqq_dequantize
        return fn(st, c.bits, axis, c.group_size)

    def dequantized(self) -> tuple[np.ndarray, np.ndarray]:
        """The quantized store as HF dequantizes it, K and V ``[B, Hkv, Tq, D]`` in the K/V dtype."""
        if self.qk is None:
            z = np.zeros((self.b, self.hkv, 0, self.d), self.fp_dtype)
            return z, z.copy()
        return self._dequantize(self.qk, self.cfg.axis_key), self._dequantize(self.qv, self.cfg.axis_value)

    # ------------------------------------------------------------------------- one call
    def _prepare(self, q, k, v):
        q, k, v, _, out_dtype = start_call(self, q, k, v)
        return q, k.astype(self.fp_dtype), v.astype(self.fp_dtype), out_dtype

    def _update(self, ks: np.ndarray, vs: np.ndarray) -> tuple[np.ndarray, np.ndarray, tuple]:
        """HF's ``QuantizedLayer.update`` without touching the state: the K/V the call returns and the
        new state ``(len, qk, qv, flush?, evicted)``; raises InputError where HF's quantizer fails. A sliding
        window quantizes only the tokens a future query still sees (``evicted``: the first position kept)."""
        c = self.cfg
        s = ks.shape[2]
        if self.qk is None:  # prefill: returned as is, stored quantized
            if s == 0:
                raise InputError(f"{self.WHO}: the first call brings no token: HF's quantizers fail on an empty tensor")
            cut, ev = self._kept_from(ks.shape[2], self.len + s)
            return ks, vs, (self.len + s, self._quantize(ks[:, :, cut:], c.axis_key),
                            self._quantize(vs[:, :, cut:], c.axis_value), None, ev)
        dk, dv = self.dequantized()
        rk, rv = self.res_k.view(), self.res_v.view()
        kr = np.concatenate([dk, rk, ks], axis=2)
        vr = np.concatenate([dv, rv, vs], axis=2)
        if self.n_res + s >= c.residual:
            cut, ev = self._kept_from(kr.shape[2], self.len + s)
            return kr, vr, (self.len + s, self._quantize(kr[:, :, cut:], c.axis_key),
                            self._quantize(vr[:, :, cut:], c.axis_value), True, ev)
        return kr, vr, (self.len + s, self.qk, self.qv, False, self.evicted)

    def _kept_from(self, held: int, length: int) -> tuple[int, int]:
        """At a quantization of the ``held`` tokens returned (the last of ``length``): how many to leave out
        (no future query sees them: positions <= length - window) and the first position kept."""
        w = self.cfg.window
        if not w:
            return 0, self.evicted
        first = length - held  # position of the first token returned
        cut = min(held - 1, max(0, length - w + 1 - first))  # keep one token at least: a store is never empty
        return cut, first + cut

    def returned_kv(self, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """What HF's ``update`` returns for a call bringing ``k, v`` -- the K/V this op's next call
        attends -- without changing the state (for tests and measurements)."""
        k, v = np.asarray(k), np.asarray(v)
        if self._ready and (k.shape[0], k.shape[1], k.shape[3]) != (self.b, self.hkv, self.d):
            raise InputError(f"{self.WHO}: k {k.shape} does not match the cache")
        fp = self.fp_dtype if self._ready else (
            np.dtype(np.float16) if k.dtype == np.float16 and v.dtype == np.float16 else np.dtype(np.float32))
        kr, vr, _ = self._update(k.astype(fp), v.astype(fp))
        return kr, vr

    def _commit(self, new: tuple, ks: np.ndarray, vs: np.ndarray) -> None:
        self.len, self.qk, self.qv, flush, self.evicted = new
        if flush:
            self.res_k.drop_front(self.res_k.len)  # a new array: a checkpoint's mark stays valid
            self.res_v.drop_front(self.res_v.len)
        elif flush is False and ks.shape[2]:
            self.res_k.append(ks)
            self.res_v.append(vs)

    def __call__(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        q, ks, vs, out_dtype = self._prepare(q, k, v)
        kr, vr, new = self._update(ks, vs)
        out = self._attend(q, kr, vr)
        self._commit(new, ks, vs)
        return out.astype(out_dtype)

    def stepwise(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """``S`` new tokens with one query row each, answered as ``S`` one-token calls would be and
        leaving their state: vectorised per segment between flushes (one dequantization and one causal
        attention per segment; each flush re-quantizes the history, as the one-token calls do)."""
        q = np.asarray(q)
        k = np.asarray(k)
        if q.ndim == 4 and k.ndim == 4 and q.shape[2] != k.shape[2]:
            raise InputError(f"{self.WHO}: a stepwise call needs one query row per new token, got {q.shape[2]} "
                             f"queries for {k.shape[2]} tokens")
        q, ks, vs, out_dtype = self._prepare(q, k, v)
        s = ks.shape[2]
        if s <= 1:
            return self(q, k, v)
        mark = self.checkpoint()
        outs = []
        try:
            i = 0
            while i < s:
                if self.qk is None:  # the first token of an empty cache is a one-token prefill
                    m = 1
                else:
                    m = min(s - i, max(self.cfg.residual - self.n_res, 1))
                seg = slice(i, i + m)
                kr, vr, new = self._update(ks[:, :, seg], vs[:, :, seg])
                outs.append(self._attend(q[:, :, seg], kr, vr, causal=True))  # row j: its own call
                self._commit(new, ks[:, :, seg], vs[:, :, seg])
                i += m
        except BaseException:
            self.rollback(mark)
            raise
        return np.concatenate(outs, axis=2).astype(out_dtype)

    # ------------------------------------------------------------------------- attention
    def _attend(self, q: np.ndarray, kr: np.ndarray, vr: np.ndarray, causal: bool | None = None) -> np.ndarray:
        """Exact softmax attention in f32 of ``q [B, Hq, Sq, D]`` over ``kr, vr [B, Hkv, T, D]``
        (``causal``: bottom-right causal mask; default ``is_causal``). Scores above
        :data:`~.blocked.SCORE_BYTES` are computed in blocks of query rows (a causal block over the keys
        its rows see: the others contribute nothing either way)."""
        b, hq, sq, d = q.shape
        hkv, t = kr.shape[1], kr.shape[2]
        g = hq // hkv
        if sq == 0 or t == 0:
            return np.zeros(q.shape, np.float32)
        causal = (self.cfg.is_causal if causal is None else causal) and (sq > 1 or self.cfg.window > 0)
        k32 = kr.astype(np.float32)
        v32 = vr.astype(np.float32)
        bq = blocked.row_block(b * hq * t * 4, sq)
        if causal and sq >= 2 * blocked.CAUSAL_ROWS and 2 * sq > t:
            bq = min(bq, max(blocked.CAUSAL_ROWS, -(-sq // blocked.CAUSAL_BLOCKS)))  # blocks that skip unseen keys
        if bq >= sq:
            qpos = (t - sq) + (np.arange(g * sq) % sq) if causal else None
            out = self._attend_rows(q.astype(np.float32).reshape(b, hkv, g * sq, d), k32, v32, qpos,
                                    self._sinks(np.arange(g * sq) // sq))
            return out.reshape(b, hq, sq, d)
        q5 = q.astype(np.float32).reshape(b, hkv, g, sq, d)
        out5 = np.empty((b, hkv, g, sq, d), np.float32)
        for i0, i1 in blocked.row_ranges(sq, bq):
            m = i1 - i0
            qpos = (t - sq) + i0 + (np.arange(g * m) % m) if causal else None
            tb = min(t, max(1, t - sq + i1)) if causal else t
            ob = self._attend_rows(q5[:, :, :, i0:i1].reshape(b, hkv, g * m, d), k32[:, :, :tb], v32[:, :, :tb], qpos,
                                   self._sinks(np.arange(g * m) // m))
            out5[:, :, :, i0:i1] = ob.reshape(b, hkv, g, m, d)
        return out5.reshape(b, hq, sq, d)

    def _sinks(self, group_of_row: np.ndarray) -> np.ndarray | None:
        """``[1, Hkv, R, 1]``: the sink logit of each row (query head ``h * group + group_of_row[r]``), or None."""
        rows = sink_rows(self.cfg.sink_logits, self.hkv, np.arange(self.hkv), group_of_row)
        return None if rows is None else rows[None]

    def _attend_rows(self, qn: np.ndarray, k32: np.ndarray, v32: np.ndarray, qpos: np.ndarray | None,
                     sink: np.ndarray | None = None) -> np.ndarray:
        """``qn [B, Hkv, R, D]`` (f32) attending over ``k32, v32 [B, Hkv, T, D]``; ``qpos``: each row's
        absolute position under a causal mask (row ``r`` sees keys ``0..=qpos[r]``), None: every key; ``sink``
        ``[1, Hkv, R, 1]``: each row's learned sink logit, a softmax column no value reads (GPT-OSS)."""
        t = k32.shape[2]
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            s = np.matmul(qn, k32.swapaxes(-1, -2))
            s *= np.float32(self.cfg.scale)
            keep = None
            if qpos is not None:
                keep = np.arange(t)[None, :] <= qpos[:, None]  # [R, T]
                if self.cfg.window:  # a sliding window: (qpos - window, qpos]
                    keep &= np.arange(t)[None, :] > qpos[:, None] - self.cfg.window
                s[:, :, ~keep] = -np.inf
            mx = s.max(axis=-1, keepdims=True)
            if sink is not None:
                mx = np.maximum(mx, sink)
            mx = np.where(mx == -np.inf, np.float32(0), mx)
            p = np.exp(np.subtract(s, mx, out=s), out=s)  # in place: one score block at a time
            ls = p.sum(axis=-1, keepdims=True)
            if sink is not None:
                ls = ls + np.exp(sink - mx)
            fin = np.isfinite(v32)
            if fin.all() or keep is None:
                out = np.matmul(p, v32)
            else:  # masked positions contribute nothing, not even 0 * NaN
                out = np.matmul(p, np.where(fin, v32, np.float32(0)))
                bb, hh, tt, cc = np.nonzero(~fin)
                val = v32[bb, hh, tt, cc]
                contrib = np.where(keep[:, tt].T, p[bb, hh, :, tt] * val[:, None], np.float32(0))  # [cnt, rows]
                np.add.at(out.transpose(0, 1, 3, 2), (bb, hh, cc), contrib)
            return np.where(ls > 0, out / np.where(ls > 0, ls, 1), np.float32(0)) if (ls == 0).any() else out / ls

    # ------------------------------------------------------------------------- protocol
    @property
    def fp_window(self) -> int:
        """The most tokens a one-token call reads in full precision: the residual (at most
        ``residual - 1`` tokens) and its own token. (A multi-token call reads all of its own tokens in
        full precision, and a decode step after a short prefill already reads the prefill quantized.)"""
        return max(self.cfg.residual, 1)

    @property
    def window_text(self) -> str:
        return f"residual_length {self.cfg.residual} (HF's residual, flushed when full)"

    def reads_quantized(self, n: int, stepwise: bool = True) -> np.ndarray:
        """Tokens each of the next ``n`` queries reads from the dequantized store. In one call: none when
        the cache is empty (HF returns a prefill as it is), else the whole store (every row sees it). In
        one-token calls: the store at that token's call, replayed with HF's flush rule (the first token of
        an empty cache is a prefill reading nothing; a call that brings the residual to ``residual``
        tokens quantizes the whole history after its attention)."""
        have, nq, nres, length, ev = self.qk is not None, self.n_quant, self.n_res, self.len, self.evicted
        w = self.cfg.window

        def seen(p: int, ev: int, nq: int) -> int:  # stored tokens within the window of a query at p
            return max(0, ev + nq - max(ev, p - w + 1)) if w else nq

        if not stepwise:
            return np.array([seen(self.len + i, ev, nq) if have else 0 for i in range(n)], np.int64)
        out = np.zeros(n, np.int64)
        for i in range(n):
            length += 1
            if not have:  # the prefill is stored quantized, nothing read quantized
                have, nres = True, 0
                ev = self._kept_from(length - ev, length)[1]
                nq = length - ev
                continue
            out[i] = seen(length - 1, ev, nq)
            if nres + 1 >= self.cfg.residual:
                ev = self._kept_from(length - ev, length)[1]
                nq, nres = length - ev, 0
            else:
                nres += 1
        return out

    def census(self) -> dict[str, int]:
        out = {"tokens": int(self.len), "quantized": int(self.n_quant), "full_precision": int(self.n_res),
                "f32_bytes": 8 * self.b * self.hkv * self.len * self.d}
        if self.cfg.window:  # a sliding window: tokens dropped from the front
            out["evicted"] = int(self.evicted)
        return out

    def nbytes(self) -> dict[str, int]:
        if not self._ready:
            return {"codes": 0, "params": 0, "full_precision": 0, "f32_equivalent": 0, "f16_equivalent": 0}
        stores = [st for st in (self.qk, self.qv) if st is not None]
        n_values = 2 * self.b * self.hkv * self.len * self.d
        return {"codes": sum(st.nbytes_codes for st in stores),
                "params": sum(st.nbytes_params for st in stores),
                "full_precision": self.res_k.nbytes + self.res_v.nbytes,
                "f32_equivalent": 4 * n_values, "f16_equivalent": 2 * n_values}

    def state_tensors(self) -> dict[str, np.ndarray]:
        cfg = self.cfg.as_array()
        if not self._ready:
            return {"config": cfg, "shape": np.zeros(5, np.int64)}
        st = {"config": cfg,
              "shape": np.array([self.b, self.hkv, self.d, self.len, int(self.fp_dtype == np.float16)], np.int64),
              "res_k": self.res_k.view().copy(), "res_v": self.res_v.view().copy()}
        if self.cfg.window:
            st["evicted"] = np.array([self.evicted], np.int64)
        for nm, q in (("k", self.qk), ("v", self.qv)):
            if q is not None:
                st[f"{nm}_codes"] = q.codes.copy()
                st[f"{nm}_scale"] = q.scale.copy()
                st[f"{nm}_shift"] = q.shift.copy()
        return st

    def _expected_store(self, shape: tuple[int, int, int, int], axis: int):
        """(codes shape, codes dtype, params shape) of a store of ``shape``; InputError if impossible."""
        c = self.cfg
        if c.backend == "quanto":
            gs = quanto_grouped_shape(shape, axis, c.group_size, self.WHO)
            per = 8 // c.bits
            red = quanto_param_axis(gs, axis)
            pshape = (gs[0], 1) if red == 1 else (1, gs[1])
            return (-(-gs[0] // per), gs[1]), np.dtype(np.uint8), pshape
        rows = hqq_rows(shape, axis, c.group_size, c.bits, self.WHO)
        cols = int(np.prod(shape)) // rows
        cshape, cdt = hqq_packed_shape(rows, cols, c.bits)
        return cshape, cdt, ((rows, 1) if axis == 1 else (1, cols))

    def load_state_tensors(self, tensors: dict[str, np.ndarray]) -> None:
        who = self.WHO
        shape = expect_config_and_shape(tensors, who, self.cfg.as_array(),
                                        "bits, group_size, residual, axis_key, axis_value, backend, layout")
        b, hkv, d, t, f16 = (int(x) for x in shape)
        empty = b == hkv == d == t == f16 == 0
        if not empty and (min(b, hkv, d, t) < 1 or f16 not in (0, 1)):
            raise StateError(f"{who}: invalid state shape {shape.tolist()} (B, Hkv, D, tokens, f16)")
        self.reset()
        if empty:
            return
        fp = np.dtype(np.float16 if f16 else np.float32)
        try:
            rk = expect_state(tensors, "res_k", None, fp, who)
            if rk.ndim != 4 or rk.shape[:2] != (b, hkv) or rk.shape[3] != d or rk.shape[2] > t:
                raise StateError(f"{who}: state tensor 'res_k' has shape {rk.shape}, "
                                 f"expected ({b}, {hkv}, <= {t}, {d})")
            nr = rk.shape[2]
            rv = expect_state(tensors, "res_v", rk.shape, fp, who)
            ev = int(expect_state(tensors, "evicted", (1,), np.int64, who)[0]) if self.cfg.window else 0
            if not 0 <= ev <= max(0, t - nr - 1) or (ev and ev > t - self.cfg.window + 1):
                raise StateError(f"{who}: state tensor 'evicted' says {ev} tokens left a cache of {t} (window "
                                 f"{self.cfg.window}, {nr} in the residual): only tokens no query sees leave it")
            tq = t - nr - ev
            if nr >= max(self.cfg.residual, 1):
                raise StateError(f"{who}: state tensor 'res_k' holds {nr} tokens, but the residual holds fewer "
                                 f"than residual = {self.cfg.residual} between calls")
            stores = {}
            if tq == 0:
                raise StateError(f"{who}: a cache of {t} tokens holds them all in the residual: the first call "
                                 f"always quantizes its tokens (state tensor 'res_k')")
            for nm, axis in (("k", self.cfg.axis_key), ("v", self.cfg.axis_value)):
                try:
                    cshape, cdt, pshape = self._expected_store((b, hkv, tq, d), axis)
                except InputError as e:
                    raise StateError(f"{who}: state tensor '{nm}_codes': {e}") from None
                codes = expect_state(tensors, f"{nm}_codes", cshape, cdt, who)
                sc = expect_state(tensors, f"{nm}_scale", pshape, fp, who)
                sh = expect_state(tensors, f"{nm}_shift", pshape, fp, who)
                with np.errstate(invalid="ignore"):
                    if np.any(sc < 0) or (self.cfg.backend == "hqq" and np.any(sc == 0)):
                        raise StateError(f"{who}: state tensor '{nm}_scale' holds negative (or, HQQ, zero) scales")
                st = QStore((b, hkv, tq, d), np.ascontiguousarray(codes).copy(), sc.copy(), sh.copy())
                if not self._codes_canonical(st, axis):
                    raise StateError(f"{who}: state tensor '{nm}_codes' holds bits no {self.cfg.bits}-bit "
                                     f"{self.cfg.backend} packing sets")
                stores[nm] = st
        except StateError:
            self.reset()
            raise
        self._init(b, hkv, d, fp)
        self.res_k.set_exact(rk)
        self.res_v.set_exact(rv)
        self.qk, self.qv = stores["k"], stores["v"]
        self.len = t
        self.evicted = ev

    def _codes_canonical(self, st: QStore, axis: int) -> bool:
        c = self.cfg
        if c.backend == "quanto":
            rows = quanto_grouped_shape(st.shape, axis, c.group_size, self.WHO)[0]
            codes = unpack_planar(st.codes.T, c.bits, rows).T
            return np.array_equal(np.ascontiguousarray(pack_planar(codes.T, c.bits).T), st.codes)
        if c.bits == 8:
            return True
        rows = hqq_rows(st.shape, axis, c.group_size, c.bits, self.WHO)
        codes = hqq_unpack(st.codes, c.bits, rows)
        return np.array_equal(hqq_pack(codes, c.bits), st.codes)
