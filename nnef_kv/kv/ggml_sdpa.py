"""llama.cpp's quantized KV cache (``-ctk`` / ``-ctv``) as the attention op ``nnef_kv_ggml_sdpa``.

Storage, per (batch, kv head), in sequence order::

    [ tokens stored in key_type / value_type (ggml blocks, or f16/f32 rows) | window (f32/f16) ]

* Every token's K row and V row are stored as llama.cpp stores them in its KV cache: cut into blocks
  of 32 values along head_dim and quantized with ggml's reference quantizer of ``key_type`` /
  ``value_type`` (:func:`nnef_kv.kv.ggml.quantize`, bit-exact with ``quantize_row_<type>_ref``):
  ``q8_0``, ``q4_0``, ``q4_1``, ``q5_0``, ``q5_1``, ``iq4_nl``; or ``f16`` (rounded to nearest even,
  overflowing to +-inf beyond the f16 range, as ggml's f32->f16 copy) and ``f32`` (exact). Keys and
  values independently (``key_type = "q4_0", value_type = "q8_0"``). Each token is quantized on its
  own (no grouping across tokens), so what is stored never depends on how the tokens were chunked.
  head_dim must be a multiple of 32.
* The blocks are held as ggml's bytes, uint8 ``[B*Hkv, T, D/32, block_bytes]`` (the ``k_cache`` /
  ``v_cache`` state tensors; ``f16``/``f32`` types as ``[B*Hkv, T, D]`` arrays of that dtype) in
  append-only :class:`~nnef_kv.kv.common.GrowBuffer` s. No f32 copy of the cache is kept between
  calls: attention dequantizes it per call, block of tokens by block of tokens.

**What a call reads.** llama.cpp copies the batch's new K/V rows into the cache (``cpy_k`` /
``cpy_v``) *before* the attention reads the cache back (``get_k`` / ``get_v``), so a prompt attends
to its own tokens quantized. With ``residual = 0`` (the default) this op does the same: the call's
tokens are quantized first, and every query reads every token through its ggml blocks. That is
llama.cpp's semantics, and a chunked call already answers each row exactly as one-token calls
would (a token is quantized before anyone reads it).

**``residual`` (nnef-kv's option, not llama.cpp's).** With ``residual = r > 0`` the newest ``r``
tokens are kept in full precision (f16 when k and v come in as f16, else f32) and each is quantized
when it leaves the window, so exactly ``min(T, r)`` tokens are held in full precision. What a call
reads then follows the KIVI op's convention: the tokens stored in the cache types before the call
are read dequantized, the window *and the call's own tokens* in full precision (tokens that leave
the window during the call are quantized after the attention). :meth:`stepwise` answers row ``i``
as its one-token call would: the tokens more than ``r`` positions before it dequantized, the others
in full precision.

**Attention**: exact softmax in f32 over the dequantized cache (and the window), GQA (query head
``h`` reads kv head ``h // (Hq / Hkv)``), scores ``scale * q.k``, causal masking (``is_causal``)
bottom-right aligned: query row ``i`` of ``Sq`` sits at position ``T - Sq + i``. Output in q's shape
and dtype (f16 in, f16 out, computed in f32). The cache is read in blocks of tokens (dequantized into
a transient f32 block) merged with an online softmax, queries in blocks of rows so that a score block
stays within ``score_budget`` bytes. This reproduces the *cache* of llama.cpp, not its kernels'
arithmetic: llama.cpp's CPU kernels also round q to the dot-product type of the K cache (q8_0/q8_1
for the block types, f16 for an f16 cache) and accumulate f16 V in f16; this op keeps q and every
sum in f32, so a comparison with an f16 cache isolates the effect of the cache type. (llama.cpp needs
flash attention for a quantized V cache; the cache contents are the same either way.)

**NaN / Inf** (:mod:`nnef_kv.kv.ggml`'s policy): a block of 32 values holding a NaN or +-Inf is
stored poisoned and dequantizes to 32 NaN; other blocks, tokens and heads are unaffected (the
``f16`` / ``f32`` types keep NaN/Inf as they are; ``f16`` turns finite values beyond its range into
+-inf). In the attention a NaN key element makes that token's score NaN, so every output row of every query
(of that kv head) that sees the token is all NaN; queries that do not see it (causal mask) are
unaffected. A NaN value element makes the output channels of its block NaN for the queries that see
the token (a masked token contributes nothing: no ``0 * NaN``). Infinite scores/values follow f32
arithmetic. The same holds in the full-precision window, value by value.

**``rotate``** (llama.cpp's attention rotation, on by default there since 2026-04 and turned off by
``LLAMA_ATTN_ROT_DISABLE=1``; off by default here, ``--rotate`` in ``convert``): when the key type is a
quantized type (not f16/f32) and head_dim is a multiple of 64, q and k are multiplied block by block along
head_dim by the Walsh-Hadamard matrix :func:`nnef_kv.kv.ggml.walsh_hadamard` of size
:func:`~nnef_kv.kv.ggml.attn_rot_size` (the largest power of two >= 64 dividing head_dim) before k is stored;
when the value type is quantized, v is rotated by 64 x 64 blocks before it is stored and the attention
output rotated back (the matrix is its own inverse). Scores and outputs are unchanged in real arithmetic;
only what the blocks quantize changes. The window (``residual``) holds rotated rows too, and
:meth:`GgmlSdpa.dequantized` returns the rotated basis.

The class works without a graph: ``op = GgmlSdpa(scale=0.125, key_type="q4_0"); y = op(q, k, v)``;
it is registered as ``nnef_kv_ggml_sdpa`` (:data:`SIGNATURE`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import GraphError, InputError, StateError
from ..core.registry import stateful
from . import ggml
from .common import (BufferCheckpoint, GrowBuffer, check_sink_logits, evict_page, evicted_tokens,
                     expect_config_and_shape, expect_state, sink_rows, start_call)

__all__ = ["CACHE_TYPES", "GGML_TYPE_IDS", "GgmlSdpa", "GgmlSdpaConfig"]

GGML_TYPE_IDS = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "iq4_nl": 20}
"""The cache types and their ``ggml_type`` enum values (saved in a state's ``config``)."""

CACHE_TYPES = tuple(GGML_TYPE_IDS)
STATE_LAYOUT = 1  # last entry of a saved config: 1 = blocks [n, T, D/32, block_bytes], window [n, min(T, r), D]
_FLOAT_TYPES = {"f32": np.dtype(np.float32), "f16": np.dtype(np.float16)}
# bytes of each block that are the f16 scale d (and min m); the rest (int8/nibble codes, q5 high bits) are codes
_PARAM_BYTES = {"q8_0": 2, "q4_0": 2, "q4_1": 4, "q5_0": 2, "q5_1": 4, "iq4_nl": 2}
_NEG_INF = np.float32(-np.inf)


@dataclass(frozen=True)
class GgmlSdpaConfig:
    """The op's attributes (names as in the NNEF declaration), plus the Python-only ``block_tokens``."""

    scale: float = 0.125
    key_type: str = "q8_0"
    value_type: str = "q8_0"
    residual: int = 0
    is_causal: bool = True
    block_tokens: int = 0  # tokens dequantized at a time; 0: ~1 MiB of f32 per block
    rotate: bool = False  # llama.cpp's Hadamard rotation of quantized K / V (see the module docstring)
    window: int = 0  # > 0: a sliding window, a query at position p sees the keys in (p - window, p]
    sink_logits: tuple = ()  # one learned logit per query head, a softmax column of its own (GPT-OSS); (): none

    def validate(self, who: str) -> None:
        for nm in ("key_type", "value_type"):
            t = getattr(self, nm)
            if t not in GGML_TYPE_IDS:
                raise GraphError(f"{who}: {nm} must be one of {', '.join(CACHE_TYPES)}, got {t!r}")
        for nm in ("residual", "block_tokens", "window"):
            if getattr(self, nm) < 0:
                raise GraphError(f"{who}: {nm} must be >= 0, got {getattr(self, nm)}")
        if not np.isfinite(self.scale):
            raise GraphError(f"{who}: scale must be finite, got {self.scale}")
        if self.window and not self.is_causal:
            raise GraphError(f"{who}: a sliding window (window = {self.window}) needs is_causal = true")
        check_sink_logits(who, self.sink_logits)

    def as_array(self) -> np.ndarray:
        """The config as saved in a state: ggml type ids of K and V, residual, state layout."""
        # appended only when on: states saved before rotate / window load unchanged
        extra = ([int(self.rotate)] if self.rotate or self.window else []) + ([self.window] if self.window else [])
        return np.array([GGML_TYPE_IDS[self.key_type], GGML_TYPE_IDS[self.value_type], self.residual,
                         STATE_LAYOUT] + extra, np.int64)


class _TypedRows:
    """The tokens of K or V stored in one cache type, in an append-only GrowBuffer: ggml blocks uint8
    ``[n, T, D/32, block_bytes]``, or ``[n, T, D]`` f16/f32 rows."""

    def __init__(self, type_: str, n: int, d: int) -> None:
        self.type = type_
        self.d = d
        if type_ in _FLOAT_TYPES:
            self.dtype, self.tail = _FLOAT_TYPES[type_], (d,)
        else:
            self.dtype, self.tail = np.dtype(np.uint8), (d // ggml.QK, ggml.block_bytes(type_))
        # pages of >= 64 tokens or 1/32 of what is held: < 3.2% unused capacity on long caches
        self.buf = GrowBuffer((n,), self.tail, self.dtype, growth=1.03125, min_chunk=64)

    @property
    def is_blocks(self) -> bool:
        return self.type not in _FLOAT_TYPES

    def encode(self, x: np.ndarray) -> np.ndarray:
        """``x [n, S, D]`` (f32/f16) -> what is stored for those tokens."""
        if not self.is_blocks:
            with np.errstate(over="ignore"):  # f32 -> f16 beyond 65504: +-inf, as ggml
                return np.ascontiguousarray(x, dtype=self.dtype)
        return ggml.quantize(x, self.type).data

    def decode(self, items: np.ndarray) -> np.ndarray:
        """Stored items ``[n, S, ...]`` -> f32 ``[n, S, D]``."""
        if not self.is_blocks:
            return items.astype(np.float32)
        return ggml.GgmlBlocks(self.type, items).dequantize()

    def nbytes(self) -> tuple[int, int, int]:
        """(codes, params, spare) bytes of the whole allocated capacity; ``spare`` (unused capacity) is
        part of the two others. Float rows are all codes."""
        total = self.buf.nbytes
        spare = total - self.buf.view().nbytes
        if not self.is_blocks:
            return total, 0, spare
        nblocks = total // self.tail[1]
        params = nblocks * _PARAM_BYTES[self.type]
        return total - params, params, spare


@dataclass(frozen=True)
class _Segment:
    """Tokens an attention call reads from one source: absolute positions ``c0 .. c0 + count``;
    ``k``/``v`` stored items (``decode`` gives f32) or full-precision rows (``decode`` None);
    ``rule``: which of them a query at position ``p`` sees: ``"all"`` (``j <= p`` when causal),
    ``"quant"`` (``j < p - residual``), ``"window"`` (``p - residual <= j <= p``)."""

    c0: int
    k: np.ndarray
    v: np.ndarray
    kdec: object
    vdec: object
    rule: str

    @property
    def count(self) -> int:
        return int(self.k.shape[1])

    def read(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """f32 K, V ``[n, b - a, D]`` of absolute positions ``a .. b``."""
        i, j = a - self.c0, b - self.c0
        kb, vb = self.k[:, i:j], self.v[:, i:j]
        kb = self.kdec(kb) if self.kdec is not None else kb.astype(np.float32)
        vb = self.vdec(vb) if self.vdec is not None else vb.astype(np.float32)
        return kb, vb


#: the op's NNEF declaration: its registration (below), and what tools read of its parameters
SIGNATURE = (
    'fragment nnef_kv_ggml_sdpa(q: tensor<scalar>, k: tensor<scalar>, v: tensor<scalar>, '
    'axis: integer = 2, scale: scalar = 0.125, key_type: string = "q8_0", value_type: string = "q8_0", '
    'residual: integer = 0, is_causal: logical = true, rotate: logical = false, window: integer = 0, '
    'sink_logits: scalar[] = []) -> (output: tensor<scalar>);'
)


@stateful(SIGNATURE, "nnef_kv", role="attention+kv",
          describe="llama.cpp ggml-typed cache (q8_0 ... iq4_nl, f16, f32) + attention")
class GgmlSdpa(BufferCheckpoint):
    """State of one ``nnef_kv_ggml_sdpa`` node: llama.cpp's ggml-typed KV cache and attention over it
    (see the module docstring)."""

    WHO = "nnef_kv_ggml_sdpa"
    QUANTIZED = True
    _CHECKPOINT_ATTRS = ("len", "evicted")

    def __init__(self, axis: int = 2, scale: float = 0.125, key_type: str = "q8_0", value_type: str = "q8_0",
                 residual: int = 0, is_causal: bool = True, block_tokens: int = 0,
                 score_budget: int = 1 << 22, rotate: bool = False, window: int = 0, sink_logits: Any = ()) -> None:
        if int(axis) != 2:
            raise GraphError(f"{self.WHO}: only axis 2 of [B, H, S, D] is supported, got {axis}")
        self.axis = 2
        self.cfg = GgmlSdpaConfig(scale=float(scale), key_type=str(key_type).lower(),
                                  value_type=str(value_type).lower(), residual=int(residual),
                                  is_causal=bool(is_causal), block_tokens=int(block_tokens), rotate=bool(rotate),
                                  window=int(window), sink_logits=tuple(float(x) for x in np.ravel(sink_logits)))
        self.cfg.validate(self.WHO)
        # bytes of one [kv heads, query rows, tokens] f32 score block (bounds long prefill chunks)
        self.score_budget = int(score_budget)
        self.reset()

    # ================================================================================== state
    def reset(self) -> None:
        self.b = self.hkv = self.d = 0
        self.fp_dtype = np.dtype(np.float32)
        self.len = 0
        self.evicted = 0  # sliding window: tokens dropped from the front of the stored blocks (absolute positions)
        self._ready = False

    def _init(self, b: int, hkv: int, d: int, fp_dtype: np.dtype) -> None:
        n = b * hkv
        self.b, self.hkv, self.d = b, hkv, d
        self.fp_dtype = np.dtype(fp_dtype)
        self.k_cache = _TypedRows(self.cfg.key_type, n, d)
        self.v_cache = _TypedRows(self.cfg.value_type, n, d)
        win = max(self.cfg.residual, 1)
        self.res_k = GrowBuffer((n,), (d,), self.fp_dtype, min_chunk=win)
        self.res_v = GrowBuffer((n,), (d,), self.fp_dtype, min_chunk=win)
        c = self.cfg
        kn = ggml.attn_rot_size(d, "key") if c.rotate and c.key_type not in _FLOAT_TYPES else 0
        vn = ggml.attn_rot_size(d, "value") if c.rotate and c.value_type not in _FLOAT_TYPES else 0
        self.k_rot = ggml.walsh_hadamard(kn) if kn else None
        self.v_rot = ggml.walsh_hadamard(vn) if vn else None
        self._ready = True

    @property
    def n_quant(self) -> int:
        """Tokens stored in the cache types (key_type / value_type)."""
        return self.k_cache.buf.len if self._ready else 0

    @property
    def n_res(self) -> int:
        """Tokens in the full-precision window."""
        return self.res_k.len if self._ready else 0

    # ============================================================================== entry points
    def __call__(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """One call: with ``residual = 0`` the new tokens are quantized, then ``q`` attends to the whole
        cache (llama.cpp); with a window, ``q`` attends to the cache as stored before the call plus the
        call's tokens in full precision, and the tokens leaving the window are quantized afterwards."""
        return self._run(q, k, v, stepwise=False)

    def stepwise(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """``S`` new tokens with one query row each, answered as ``S`` one-token calls would have been
        (row ``i`` reads dequantized the tokens more than ``residual`` positions before it, the others
        in full precision; causal whatever ``is_causal`` says, as a one-token call sees only the past),
        leaving the same state (the stored blocks do not depend on chunking). Vectorised."""
        return self._run(q, k, v, stepwise=True)

    def _run(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, stepwise: bool) -> np.ndarray:
        fresh = not self._ready
        try:
            return self._call(q, k, v, stepwise)
        except BaseException:
            if fresh:  # a failed first call leaves the state as it found it
                self.reset()
            raise

    def _check_call(self, dims: tuple[int, ...], q: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        d = dims[-1]
        if d % ggml.QK:
            raise InputError(f"{self.WHO}: head_dim D = {d} is not a multiple of {ggml.QK} "
                             f"(ggml blocks hold {ggml.QK} values along head_dim)")
        for nm, t in (("q", q), ("k", k), ("v", v)):
            if t.dtype.kind not in "fiub":
                raise InputError(f"{self.WHO}: {nm} has dtype {t.dtype}, expected a float tensor")

    def _prepare(self, q: np.ndarray, k: np.ndarray, v: np.ndarray):
        """Checks and lazy init: ``(q [n, g, Sq, D] f32, k, v [n, S, D] window dtype, q shape, out dtype)``."""
        q, k, v, (b, hq, sq, hkv, snew, d), out_dtype = start_call(self, q, k, v, self._check_call)
        n, g = b * hkv, hq // hkv
        qn = q.astype(np.float32).reshape(n, g, sq, d)  # query head h = kv head * g + i
        if self.k_rot is not None:  # llama.cpp: q and k rotated alike, before k is stored
            qn = ggml.hadamard_blocks(qn, self.k_rot)
            k = ggml.hadamard_blocks(k.astype(np.float32), self.k_rot)
        if self.v_rot is not None:
            v = ggml.hadamard_blocks(v.astype(np.float32), self.v_rot)
        with np.errstate(over="ignore"):
            ks = k.reshape(n, snew, d).astype(self.fp_dtype)
            vs = v.reshape(n, snew, d).astype(self.fp_dtype)
        return qn, ks, vs, q.shape, out_dtype

    def _call(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, stepwise: bool) -> np.ndarray:
        qn, ks, vs, shape, out_dtype = self._prepare(q, k, v)
        sq, snew = shape[2], ks.shape[1]
        if stepwise and sq != snew:
            raise InputError(f"{self.WHO}: a stepwise call needs one query row per new token, got {sq} "
                             f"queries for {snew} tokens")
        r = self.cfg.residual
        tq0, total = self.evicted + self.n_quant, self.len + snew
        # window + new tokens (positions tq0 .. total); the oldest nq of them leave the window
        wk = np.concatenate([self.res_k.view(), ks], axis=1) if r else ks
        wv = np.concatenate([self.res_v.view(), vs], axis=1) if r else vs
        nq = max(0, wk.shape[1] - r)
        kc, vc = self.k_cache, self.v_cache
        new_k, new_v = kc.encode(wk[:, :nq]), vc.encode(wv[:, :nq])
        stored = _Segment(self.evicted, kc.buf.view(), vc.buf.view(), kc.decode, vc.decode, "all")
        if r == 0:  # llama.cpp: the call's tokens are in the cache, quantized, before attention reads it
            segs = [stored, _Segment(tq0, new_k, new_v, kc.decode, vc.decode, "all")]
        elif not stepwise:  # the cache as stored before the call + window and new tokens in full precision
            segs = [stored, _Segment(tq0, wk, wv, None, None, "all")]
        else:  # every row reads each token as its one-token call would: old ones quantized, recent ones not
            segs = [stored, _Segment(tq0, new_k, new_v, kc.decode, vc.decode, "quant"),
                    _Segment(tq0, wk, wv, None, None, "window")]
        if total and sq:
            pos = total - sq + np.arange(sq)
            with np.errstate(invalid="ignore", over="ignore", divide="ignore"):  # NaN/Inf: f32 semantics
                out = self._attend(qn, pos, segs, causal=self.cfg.is_causal or stepwise)
                if self.v_rot is not None:  # the output back from the values' rotated basis
                    out = ggml.hadamard_blocks(out, self.v_rot)
            out = out.reshape(shape).astype(out_dtype)
        else:
            out = np.zeros(shape, out_dtype)
        # commit (nothing above wrote into the state: a failure leaves it untouched)
        if nq:
            kc.buf.append(new_k)
            vc.buf.append(new_v)
        if r:
            self.res_k.set_exact(wk[:, nq:])
            self.res_v.set_exact(wv[:, nq:])
        self.len = total
        self._evict()
        return out

    def _evict(self) -> None:
        """Sliding window: drop the stored tokens no future query sees (positions <= len - window), a page
        at a time (:func:`~.common.evict_page`)."""
        w = self.cfg.window
        if not w:
            return
        drop = evicted_tokens(self.len - w + 1, self.evicted + self.n_quant, evict_page(w)) - self.evicted
        if drop:
            self.k_cache.buf.drop_front(drop)
            self.v_cache.buf.drop_front(drop)
            self.evicted += drop

    # =============================================================================== attention
    def _block_tokens(self, n: int) -> int:
        bt = self.cfg.block_tokens or (1 << 18) // max(1, n * self.d)
        return max(1, bt)

    def _bounds(self, seg: _Segment, pos: np.ndarray, causal: bool) -> tuple[np.ndarray, np.ndarray]:
        """Per query row, the absolute positions ``[lo, hi)`` of ``seg`` it sees."""
        r = self.cfg.residual
        c0, c1 = seg.c0, seg.c0 + seg.count
        if seg.rule == "all":
            lo, hi = np.full_like(pos, c0), (pos + 1 if causal else np.full_like(pos, c1))
        elif seg.rule == "quant":
            lo, hi = np.full_like(pos, c0), pos - r
        else:
            lo, hi = pos - r, pos + 1
        if self.cfg.window:
            lo = np.maximum(lo, pos - self.cfg.window + 1)
        return np.maximum(lo, c0), np.minimum(hi, c1)

    def _attend(self, q: np.ndarray, pos: np.ndarray, segs: list[_Segment], causal: bool) -> np.ndarray:
        """q ``[n, g, Sq, D]`` f32, ``pos`` the absolute position of each query row. Online softmax over
        blocks of tokens (each dequantized once), queries in blocks of rows; returns ``[n, g, Sq, D]``."""
        n, g, sq, d = q.shape
        scale = np.float32(self.cfg.scale)
        mx = np.full((n, g, sq), -np.inf, np.float32)
        ls = np.zeros((n, g, sq), np.float32)
        acc = np.zeros((n, g, sq, d), np.float32)
        bt = self._block_tokens(n)
        rb = max(1, min(sq, self.score_budget // max(1, 4 * n * g * min(bt, int(pos[-1]) + 1))))
        for seg in segs:
            if not seg.count:
                continue
            lo, hi = self._bounds(seg, pos, causal)
            for t0 in range(seg.c0, seg.c0 + seg.count, bt):
                t1 = min(seg.c0 + seg.count, t0 + bt)
                rows = np.nonzero(np.minimum(hi, t1) > np.maximum(lo, t0))[0]  # rows seeing some token
                if not rows.size:
                    continue
                kb, vb = seg.read(t0, t1)
                kt = kb.swapaxes(-1, -2)
                vbad = ~np.isfinite(vb)
                bad_cols = np.nonzero(vbad.any(axis=(0, 2)))[0]
                if bad_cols.size:  # non-finite values: out of the matmul, added back for the rows seeing them
                    vnf = np.where(vbad, vb, np.float32(0))
                    vb = np.where(vbad, np.float32(0), vb)
                jpos = np.arange(t0, t1)
                for i0 in range(int(rows[0]), int(rows[-1]) + 1, rb):  # visible rows are contiguous
                    i1 = min(int(rows[-1]) + 1, i0 + rb)
                    m = i1 - i0
                    s = np.matmul(q[:, :, i0:i1].reshape(n, g * m, d), kt).reshape(n, g, m, t1 - t0)
                    s *= scale
                    keep = (jpos[None, :] >= lo[i0:i1, None]) & (jpos[None, :] < hi[i0:i1, None])
                    if not keep.all():
                        s[:, :, ~keep] = _NEG_INF
                    m_old = mx[:, :, i0:i1]
                    new = np.maximum(m_old, s.max(axis=-1))
                    safe = np.where(new == _NEG_INF, np.float32(0), new)  # rows that see nothing yet
                    alpha = np.exp(m_old - safe)
                    p = np.exp(np.subtract(s, safe[..., None], out=s), out=s)
                    ls[:, :, i0:i1] = ls[:, :, i0:i1] * alpha + p.sum(axis=-1)
                    pv = np.matmul(p.reshape(n, g * m, t1 - t0), vb).reshape(n, g, m, d)
                    for c in bad_cols:
                        contrib = p[:, :, :, c, None] * vnf[:, None, None, c, :]  # [n, g, m, d]
                        pv += np.where(keep[None, None, :, c, None], contrib, np.float32(0))
                    acc[:, :, i0:i1] = acc[:, :, i0:i1] * alpha[..., None] + pv
                    mx[:, :, i0:i1] = new
        sink = sink_rows(self.cfg.sink_logits, self.hkv, np.arange(n), np.arange(g))  # [n, g, 1]
        if sink is not None:  # a softmax column no value reads (GPT-OSS's learned sinks)
            new = np.maximum(mx, sink)
            alpha = np.exp(mx - new)
            ls = ls * alpha + np.exp(sink - new)
            acc *= alpha[..., None]
        return acc / ls[..., None]

    # ================================================================================ protocol
    def _buffers(self) -> list[GrowBuffer]:
        if not self._ready:
            return []
        return [self.k_cache.buf, self.v_cache.buf, self.res_k, self.res_v]

    def state_tensors(self) -> dict[str, np.ndarray]:
        cfg = self.cfg.as_array()
        if not self._ready:
            return {"config": cfg, "shape": np.zeros(5, np.int64)}
        return {
            "config": cfg,
            "shape": np.array([self.b, self.hkv, self.d, self.len, int(self.fp_dtype == np.float16)], np.int64),
            "k_cache": self.k_cache.buf.view().copy(), "v_cache": self.v_cache.buf.view().copy(),
            "res_k": self.res_k.view().copy(), "res_v": self.res_v.view().copy(),
        }

    def load_state_tensors(self, tensors: dict[str, np.ndarray]) -> None:
        who = self.WHO
        shape = expect_config_and_shape(tensors, who, self.cfg.as_array(),
                                        "ggml type ids of K and V, residual, state layout")
        b, hkv, d, t, f16 = (int(x) for x in shape)
        if min(b, hkv, d, t) < 0 or f16 not in (0, 1) or (b == 0) != (hkv == 0 or d == 0) \
                or (b == 0 and t) or d % ggml.QK:
            raise StateError(f"{who}: state tensor 'shape' holds an invalid [B, Hkv, D, T, f16 window] "
                             f"{shape.tolist()} (D must be a multiple of {ggml.QK})")
        if b == 0:
            self.reset()
            return
        r, w = self.cfg.residual, self.cfg.window
        n, nr = b * hkv, min(t, r)
        tq = t - nr
        fp = np.dtype(np.float16 if f16 else np.float32)
        evicted = 0
        if w:  # a sliding window drops whole pages of dead tokens: what the saved blocks do not hold
            held = np.shape(tensors.get("k_cache", ()))
            held_tq = int(held[1]) if len(held) >= 2 else tq
            evicted = tq - held_tq
            if evicted != evicted_tokens(t - w + 1, tq, evict_page(w)):
                raise StateError(f"{who}: state tensor 'k_cache' holds {held_tq} tokens of a cache of {t} with "
                                 f"{nr} in the window: a sliding window of {w} holds "
                                 f"{tq - evicted_tokens(t - w + 1, tq, evict_page(w))}")
            tq = held_tq
        # check everything before touching the state: a refused state leaves this one as it was
        arrays = {}
        for name, typ in (("k_cache", self.cfg.key_type), ("v_cache", self.cfg.value_type)):
            rows = _TypedRows(typ, 1, d)
            arrays[name] = expect_state(tensors, name, (n, tq) + rows.tail, rows.dtype, who)
        for name in ("res_k", "res_v"):
            arrays[name] = expect_state(tensors, name, (n, nr, d), fp, who)
        self.reset()
        self._init(b, hkv, d, fp)
        for buf, name in ((self.k_cache.buf, "k_cache"), (self.v_cache.buf, "v_cache")):
            buf.reserve(tq)
            buf.append(arrays[name])
        self.res_k.set_exact(arrays["res_k"])
        self.res_v.set_exact(arrays["res_v"])
        self.len = t
        self.evicted = evicted

    @property
    def fp_window(self) -> int:
        """The most tokens held in full precision between calls (``residual``): a context longer than
        this is read partly through the ggml blocks; with 0 every token is quantized as it arrives."""
        return self.cfg.residual

    @property
    def window_text(self) -> str:
        r = self.cfg.residual
        return f"residual {r}" if r else "no full-precision window (every token quantized as it arrives)"

    def reads_quantized(self, n: int, stepwise: bool = True) -> np.ndarray:
        """Tokens read through the cache types (``key_type`` / ``value_type``, f16/f32 included) by the
        query of each of the next ``n`` tokens. ``residual = 0``: every token the row sees, its own
        included (``len + i + 1`` causally, ``len + n`` otherwise); with a window, in one call every row
        reads the tokens stored before the call, stepwise row ``i`` the tokens more than ``residual``
        positions before its own (``max(0, len + i - residual)``)."""
        r, i = self.cfg.residual, np.arange(n, dtype=np.int64)
        if self.cfg.window:  # the tokens above, within the row's window (p - window, p]
            p = self.len + i
            lo = np.maximum(0, p - self.cfg.window + 1)
            if r == 0:
                return p + 1 - lo
            if not stepwise:
                return np.maximum(0, self.evicted + self.n_quant - np.maximum(lo, self.evicted))
            return np.maximum(0, p - r - lo)
        if r == 0:
            return self.len + i + 1 if (stepwise or self.cfg.is_causal) else np.full(n, self.len + n, np.int64)
        if not stepwise:
            return np.full(n, self.n_quant, np.int64)
        return np.maximum(0, self.len + i - r)

    def census(self) -> dict[str, int]:
        """Tokens held now: ``quantized`` = stored in the cache types (key_type / value_type, f16/f32
        types included), ``full_precision`` = the window; ``f32_bytes``: the same keys and values as f32."""
        out = {"tokens": int(self.len), "quantized": int(self.n_quant), "full_precision": int(self.n_res),
                "f32_bytes": 8 * self.b * self.hkv * self.len * self.d}
        if self.cfg.window:  # a sliding window: tokens dropped from the front
            out["evicted"] = int(self.evicted)
        return out

    def nbytes(self) -> dict[str, int]:
        """Bytes of the arrays held, allocated capacity included. ``codes`` + ``params`` = the bytes of
        the K and V block buffers exactly (``params``: each block's f16 ``d`` (and ``m`` for q4_1/q5_1);
        ``codes``: the rest of the block; f16/f32 cache types: all ``codes``); ``full_precision``: the
        window; ``spare``: the unused capacity of the block buffers (already inside codes + params)."""
        if not self._ready:
            return {"codes": 0, "params": 0, "full_precision": 0, "spare": 0,
                    "f32_equivalent": 0, "f16_equivalent": 0}
        kc, kp, ks = self.k_cache.nbytes()
        vc, vp, vs = self.v_cache.nbytes()
        n_values = 2 * self.b * self.hkv * self.len * self.d
        return {"codes": kc + vc, "params": kp + vp, "full_precision": self.res_k.nbytes + self.res_v.nbytes,
                "spare": ks + vs, "f32_equivalent": 4 * n_values, "f16_equivalent": 2 * n_values}

    # ================================================================================ helpers
    def dequantized(self) -> tuple[np.ndarray, np.ndarray]:
        """The cache as a query reads it now, K and V ``[B, Hkv, T, D]`` f32 (stored tokens decoded,
        then the window; with a sliding window, the ``T`` tokens held, after the ``evicted`` ones); for tests
        and measurements: the attention never builds it."""
        if not self._ready:
            z = np.zeros((0, 0, 0, 0), np.float32)
            return z, z
        shp = (self.b, self.hkv, self.len - self.evicted, self.d)
        kf = np.concatenate([self.k_cache.decode(self.k_cache.buf.view()), self.res_k.view().astype(np.float32)], 1)
        vf = np.concatenate([self.v_cache.decode(self.v_cache.buf.view()), self.res_v.view().astype(np.float32)], 1)
        return kf.reshape(shp), vf.reshape(shp)
