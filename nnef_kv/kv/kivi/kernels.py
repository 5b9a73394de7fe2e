"""KIVI decode-step attention read straight from the packed codes (numba), beside a NumPy reference.

The cache is the one of :class:`nnef_kv.kv.kivi.KiviSdpa` (see that module): per kv head, sinks and a
residual window in full precision and, between them, ``Tq`` quantized tokens stored with
:class:`~nnef_kv.kv.packing.GroupCodec` ``(bits, D, key_group)``:

* keys ``k_codes`` uint8 ``[n, Tq, D/per]`` (``per = 8 // bits``), per channel in groups of ``key_group``
  tokens, ``k = k_min + k_step * code`` with ``k_min`` / ``k_step`` ``[n, Tq/key_group, D]``;
* values ``v_codes`` (same codec), per token in groups of ``vg = min(value_group, D)`` channels,
  ``v = v_min + v_step * code`` with ``v_min`` / ``v_step`` ``[n, Tq, D/vg]``;
* params f16 (default) or f32. Inside a group of ``key_group`` tokens the 1/2/4-bit codes are
  **token-planar**: the group's bytes are a ``[key_group/per, D]`` byte matrix whose byte ``(r, c)``
  holds channel ``c`` of the tokens ``r + i * key_group/per`` in bit field ``i``; 8 bits are plain
  ``[Tq, D]`` bytes. The kernels read that layout as it is (no conversion, no f32 code buffer).

**Loops** (numba side; a kv head is one nogil call: its scores, their softmax, its outputs):

* keys: ``s[t] = sum_c (q step)_c code[t, c] + sum_c q_c min_c`` (the key step folded into the query,
  as in ``KiviSdpa._key_scores``). Each byte row of a group gives ``per`` tokens at once; the inner loop
  is a dot product over the ``D`` contiguous channels with ``per`` accumulators. A dot product only
  vectorises when the sum may be split into lanes, so the dot-product cores (keys, sinks and window
  scores, the ``sum_t p_t min_t`` of the values) are compiled with LLVM's ``reassoc`` flag
  (``fastmath={"reassoc"}``), not ``fastmath=True``: no ``nnan``/``ninf`` (NaN and Inf propagate
  exactly as in IEEE arithmetic: a sum holding a NaN, or +Inf and -Inf, is NaN in any order, one
  holding infinities of one sign is that infinity in any order), no ``contract`` (no FMA: every product
  is the rounded f32 product of the reference), no approximate functions. So the result differs from
  the reference only by the order of the f32 additions (lanes then a tree, instead of BLAS's order),
  which is what the tests bound. Without it the loop stays scalar, several times slower
  (docs/benchmarks.md, "Where the code's thresholds come from").
* values: ``out[c] += sum_t (p_t step_t) code[t, c]`` plus ``sum_t p_t min_t`` per value group: the
  inner loop runs over the ``vg`` contiguous channels of a value group with the token weights
  broadcast (two byte rows a pass at 4 and 8 bits), the axpy shape that vectorises with plain IEEE
  arithmetic (``fastmath`` off); sinks and window values are axpy loops too.
* the softmax, per row of a head, in the same call: the scores of every position (sinks, quantized
  tokens, window) in one ``[n, M, T]`` matrix, the causal mask, the row's max subtracted, an exp
  (``exp_nonpositive`` of ``_numba_common``: NumPy's exp cannot be called without the GIL, LLVM's stays
  a scalar libm call; within 1 ulp, where NumPy's float32 exp is within 2.4), the sum in lanes. A row
  whose max is not finite makes the whole call follow the reference's rule instead (it looks at every
  head at once): the scores again, NumPy's softmax over all heads, the outputs, on one thread.
* ``threads > 1``: the calling thread and pool threads each make one nogil call that claims heads from
  an atomic counter until none is left (no GIL between heads), or numba ``prange`` over the heads
  (``nnef_kv.kv.kivi._jit.PARALLEL``; see there and ``_avoid_cpu`` for the measurements). Every
  thread count gives the same bits: a head is the same code whoever runs it.

**Scope.** The kernels take caches without outliers (the exact side table of non-finite or huge keys
and values): :func:`attend` falls back to ``KiviSdpa``'s own NumPy path when there are outliers, for the
``"split"`` / ``"rows"`` codec layouts (3, 5, 6, 7 bits, or sizes that do not divide), and when the score
matrix would exceed the cache's ``score_budget`` (long prefill chunks: the online-softmax path).
Where it runs: ``KiviSdpa._attend`` (``nnef_kv/kv/kivi/attend.py``) calls :func:`decode_attention_rows` on
the cache's buffers when the kernels apply and pay (``KiviSdpa._on_kernels``: some tokens quantized, a
wide enough cache, no outliers, no softcap, a two-pass-sized score matrix), else its NumPy path;
:func:`attend` (``attend(sdpa, qn, sq)``) chooses the same way. The key and value cores decode the codes
once per query row: the cost grows with ``M`` (GQA rows), where BLAS reuses its f32 block.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..common import causal_keep, softmax_numerators
from ..packing import GroupCodec
from ...kernels import kernel

__all__ = ["key_scores", "value_sum", "decode_attention", "decode_attention_rows", "attend", "unsupported_reason",
           "two_pass"]


def _f32(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=np.float32)


def _check_codec(bits: int, d: int, key_group: int) -> GroupCodec:
    codec = GroupCodec(int(bits), int(d), int(key_group))
    if codec.layout not in ("bytes", "token_planar"):
        raise ValueError(f"{bits}-bit codes with D={d}, key_group={key_group} use the '{codec.layout}' layout; "
                         f"the kernels read 'bytes' (8 bits) and 'token_planar' (1, 2, 4 bits) only")
    return codec


# ================================================================================= references
@kernel("nnef_kv.kv.kivi._jit:key_scores")
def key_scores(q: np.ndarray, k_codes: np.ndarray, k_min: np.ndarray, k_step: np.ndarray, bits: int,
               key_group: int, out: np.ndarray | None = None, threads: int = 1) -> np.ndarray:
    """Scores of the quantized keys: ``out[h, m, t] = sum_c q[h, m, c] * k[h, t, c]`` computed as
    ``(q * step) . code + q . min`` per group of ``key_group`` tokens.

    ``q`` ``[n, M, D]`` float32 (already times the attention scale), ``k_codes`` ``[n, Tq, D/per]`` uint8
    (GroupCodec layout), ``k_min`` / ``k_step`` ``[n, Tq/key_group, D]`` f16 or f32. ``out`` (optional,
    ``[n, M, Tq]`` float32, any strides: e.g. a slice of the whole score matrix) receives the scores and
    is returned. ``threads``: kv heads split over that many threads (numba side)."""
    q = _f32(q)
    n, m, d = q.shape
    codec = _check_codec(bits, d, key_group)
    tq = k_codes.shape[1]
    ng = tq // key_group
    codes = codec.unpack(k_codes).astype(np.float32).reshape(n, ng, key_group, d)
    kmin, kstep = _f32(k_min), _f32(k_step)
    qs = q[:, None, :, :] * kstep[:, :, None, :]  # [n, G, M, D]
    s = np.matmul(qs, codes.swapaxes(-1, -2))  # [n, G, M, kg]
    s += np.matmul(kmin, q.swapaxes(-1, -2))[..., None]  # q . min per group
    res = s.swapaxes(1, 2).reshape(n, m, tq)
    if out is None:
        return res
    out[...] = res
    return out


@kernel("nnef_kv.kv.kivi._jit:value_sum")
def value_sum(p: np.ndarray, v_codes: np.ndarray, v_min: np.ndarray, v_step: np.ndarray, bits: int,
              key_group: int, value_group: int, threads: int = 1) -> np.ndarray:
    """``sum_t p[h, m, t] * v[h, t, :]`` over the quantized tokens -> ``[n, M, D]`` float32, computed as
    ``(p * step) . code + p . min`` per value group.

    ``p`` ``[n, M, Tq]`` float32 (any strides), ``v_codes`` ``[n, Tq, D/per]`` uint8 (GroupCodec layout,
    groups of ``key_group`` tokens), ``v_min`` / ``v_step`` ``[n, Tq, D/vg]`` f16 or f32 with
    ``vg = min(value_group, D)``."""
    p = _f32(p)
    n, m, tq = p.shape
    d = v_codes.shape[2] * (8 // bits)
    _check_codec(bits, d, key_group)
    vg = min(int(value_group), d)
    nvg = d // vg
    codes = GroupCodec(bits, d, key_group).unpack(v_codes).astype(np.float32)  # [n, Tq, D]
    vmin, vstep = _f32(v_min), _f32(v_step)
    pw = p[:, None, :, :] * np.swapaxes(vstep, 1, 2)[:, :, None, :]  # [n, nvg, M, Tq]
    cb = np.swapaxes(codes.reshape(n, tq, nvg, vg), 1, 2)  # [n, nvg, Tq, vg]
    out = np.swapaxes(np.matmul(pw, cb), 1, 2).reshape(n, m, d)
    out += np.repeat(np.matmul(p, vmin), vg, axis=-1)
    return out


def two_pass(ks: Callable[..., np.ndarray], vs: Callable[..., np.ndarray], q: np.ndarray, sink_k: np.ndarray,
             sink_v: np.ndarray, k_codes: np.ndarray, k_min: np.ndarray, k_step: np.ndarray,
             v_codes: np.ndarray, v_min: np.ndarray, v_step: np.ndarray, res_k: np.ndarray, res_v: np.ndarray,
             *, scale: float, bits: int, key_group: int, value_group: int, sq: int = 1,
             is_causal: bool = True, threads: int = 1) -> np.ndarray:
    """The steps of ``KiviSdpa._attend_two_pass`` (without outliers) with the quantized parts done by
    ``ks`` (:func:`key_scores`-like) and ``vs`` (:func:`value_sum`-like)."""
    q = _f32(q)
    n, m, d = q.shape
    ns, tq, nr = sink_k.shape[1], k_codes.shape[1], res_k.shape[1]
    total = ns + tq + nr
    q = q * np.float32(scale)
    s = np.empty((n, m, total), np.float32)
    if ns:
        np.matmul(q, _f32(sink_k).swapaxes(-1, -2), out=s[:, :, :ns])
    if tq:
        ks(q, k_codes, k_min, k_step, bits, key_group, out=s[:, :, ns:ns + tq], threads=threads)
    if nr:
        np.matmul(q, _f32(res_k).swapaxes(-1, -2), out=s[:, :, ns + tq:])
    p = softmax_numerators(s, causal_keep(total, m, sq, is_causal))
    ls = p.sum(axis=-1, keepdims=True)
    if tq:
        out = vs(p[:, :, ns:ns + tq], v_codes, v_min, v_step, bits, key_group, value_group, threads=threads)
    else:
        out = np.zeros((n, m, d), np.float32)
    if ns:
        out += np.matmul(p[:, :, :ns], _f32(sink_v))
    if nr:
        out += np.matmul(p[:, :, ns + tq:], _f32(res_v))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.divide(out, ls, out=out)


@kernel("nnef_kv.kv.kivi._jit:decode_attention")
def decode_attention(q: np.ndarray, sink_k: np.ndarray, sink_v: np.ndarray, k_codes: np.ndarray,
                     k_min: np.ndarray, k_step: np.ndarray, v_codes: np.ndarray, v_min: np.ndarray,
                     v_step: np.ndarray, res_k: np.ndarray, res_v: np.ndarray, *, scale: float, bits: int,
                     key_group: int, value_group: int, sq: int = 1, is_causal: bool = True,
                     threads: int = 1) -> np.ndarray:
    """Attention of ``q`` ``[n, M, D]`` (float32, rotated like the cache; row ``r`` is query ``r % sq``,
    ``M = group * sq``) over a KIVI cache without outliers -> ``[n, M, D]`` float32: what
    ``KiviSdpa._attend_two_pass`` returns for the same arrays.

    ``sink_k`` / ``sink_v`` ``[n, ns, D]`` and ``res_k`` / ``res_v`` ``[n, nr, D]`` full precision (f32 or
    f16); the quantized part as in :func:`key_scores` / :func:`value_sum`. ``scale`` multiplies ``q``
    first (as the op does); causal masking (``sq > 1``) aligns the queries with the last positions."""
    return two_pass(key_scores.reference, value_sum.reference, q, sink_k, sink_v, k_codes, k_min, k_step,
                    v_codes, v_min, v_step, res_k, res_v, scale=scale, bits=bits, key_group=key_group,
                    value_group=value_group, sq=sq, is_causal=is_causal, threads=threads)


@kernel("nnef_kv.kv.kivi._jit:decode_attention_rows")
def decode_attention_rows(q: np.ndarray, sink_k: np.ndarray, sink_v: np.ndarray, ns: int, k_codes: np.ndarray,
                          k_min: np.ndarray, k_step: np.ndarray, v_codes: np.ndarray, v_min: np.ndarray,
                          v_step: np.ndarray, tq: int, res_k: np.ndarray, res_v: np.ndarray, nr: int, *,
                          scale: float, bits: int, key_group: int, value_group: int, sq: int = 1,
                          is_causal: bool = True, threads: int = 1) -> np.ndarray:
    """:func:`decode_attention` on a cache's buffers as they are: C-contiguous ``[n, rows, width]`` arrays of
    which the first ``ns`` (sinks), ``tq`` (codes, value params; ``tq / key_group`` key params) and ``nr``
    (window) rows are read."""
    ng = tq // key_group
    return decode_attention.reference(
        q, sink_k[:, :ns], sink_v[:, :ns], k_codes[:, :tq], k_min[:, :ng], k_step[:, :ng], v_codes[:, :tq],
        v_min[:, :tq], v_step[:, :tq], res_k[:, :nr], res_v[:, :nr], scale=scale, bits=bits, key_group=key_group,
        value_group=value_group, sq=sq, is_causal=is_causal, threads=threads)


# ================================================================================ KiviSdpa glue
def unsupported_reason(sdpa: Any, m: int) -> str | None:
    """Why :func:`attend` would not use the kernels for this cache and ``m`` query rows (None: it would)."""
    if not getattr(sdpa, "_ready", False) or sdpa.len == 0:
        return "empty cache"
    if len(sdpa.k_out) or len(sdpa.v_out):
        return "the cache holds outliers (exact side table)"
    if sdpa.codec.layout not in ("bytes", "token_planar"):
        return f"codes layout '{sdpa.codec.layout}' ({sdpa.cfg.bits} bits)"
    if sdpa.b * sdpa.hkv * m * sdpa.len * 4 > sdpa.score_budget:
        return "score matrix above score_budget (online-softmax path)"
    return None


def cache_arrays(sdpa: Any) -> dict[str, Any]:
    """The arrays and attributes of a :class:`~nnef_kv.kv.kivi.KiviSdpa` that :func:`decode_attention`
    takes (views, no copies)."""
    c = sdpa.cfg
    return dict(sink_k=sdpa.sink_k.view(), sink_v=sdpa.sink_v.view(), k_codes=sdpa.k_codes.view(),
                k_min=sdpa.k_min.view(), k_step=sdpa.k_step.view(), v_codes=sdpa.v_codes.view(),
                v_min=sdpa.v_min.view(), v_step=sdpa.v_step.view(), res_k=sdpa.res_k.view(),
                res_v=sdpa.res_v.view(), scale=c.scale, bits=c.bits, key_group=c.key_group,
                value_group=c.value_group, is_causal=c.is_causal)


@kernel("nnef_kv.kv.kivi._jit:attend")
def attend(sdpa: Any, q: np.ndarray, sq: int = 1, threads: int | None = None) -> np.ndarray:
    """What ``sdpa._attend(q, sq)`` returns (``q`` ``[n, M, D]`` float32, rotated): reference =
    ``KiviSdpa``'s own NumPy path; numba side = :func:`decode_attention` when
    :func:`unsupported_reason` is None, else that same NumPy path."""
    if threads is not None and threads != sdpa.threads:
        saved, sdpa.threads = sdpa.threads, int(threads)
        try:
            return sdpa._attend(q, sq)
        finally:
            sdpa.threads = saved
    return sdpa._attend(q, sq)
