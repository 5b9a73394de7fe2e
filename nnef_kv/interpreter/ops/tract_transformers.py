"""Kernels of tract's ``tract_transformers_*`` operations (registry ``tract_transformers``).

Semantics follow ``sonos/tract`` ``transformers/src/ops/*.rs`` and are checked against tract 0.23.9 in
``tests/oracle/test_tract_ops.py`` and ``tests/oracle/test_tract_decode.py``. The quantized KV ops
(``tract_transformers_quantized_dyn_kv_cache``, ``tract_transformers_quantized_kv_sdpa``) are registered in
their state modules (``nnef_kv.kv.tract_fused``, ``nnef_kv.kv.tract_dyn_cache``), the full-precision states
(``dyn_kv_cache``, ``window_kv_sdpa``) in ``nnef_kv.kv.exact``, each on its class, with every other KV state.

Precision: ``sdpa`` computes scores, softmax and the weighted sum in f32 whenever ``acc_datum_type`` is
f16 or f32 (tract's optimized CPU kernel, FlashSdpaOp, accumulates in f32 whatever the float input
type), and casts the result to the type of ``q``.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ...errors import GraphError
from ...core.registry import Kernel, primitive
from ...kv.exact import DynKvCache, WindowKvSdpa, causal_mask, sdpa_array
from ...core.coerce import as_float, float_compute_dtype, parse_datum_type

REG = "tract_transformers"


# ----------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------
def _sdpa_static(attrs: dict[str, Any]) -> Kernel | None:
    """``tract_transformers_sdpa`` with its datum types and scale parsed once (mask handled as the
    generic kernel does: the declared default ``false`` means none)."""
    try:
        acc = parse_datum_type(attrs.get("acc_datum_type", "f32"), where="tract_transformers_sdpa acc_datum_type")
        parse_datum_type(attrs.get("datum_type", "f32"), where="tract_transformers_sdpa datum_type")
        scale = attrs.get("scale")
        sc = None if scale is None or as_float(scale) == 0.0 else as_float(scale)
    except Exception:  # noqa: BLE001 - the generic kernel reports it, at run time, with the node
        return None
    causal = bool(attrs.get("is_causal", False))

    def sdpa(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: Any = None) -> np.ndarray:
        if mask is not None and np.ndim(mask) == 0 and np.asarray(mask).dtype == np.bool_ and not bool(mask):
            mask = None
        return sdpa_array(q, k, v, mask, scale=sc, is_causal=causal, acc_dtype=acc)
    return sdpa


@primitive(
    "fragment tract_transformers_sdpa(q: tensor<scalar>, k: tensor<scalar>, v: tensor<scalar>,"
    " mask: tensor<scalar> = false, scale: scalar = 0.0, datum_type: string = \"f32\","
    ' acc_datum_type: string = "f32", is_causal: logical = false) -> (output: tensor<scalar>);',
    REG,
    specialize=_sdpa_static,
    role="attention",
    describe="exact attention (f32 accumulation)",
)
def tract_transformers_sdpa(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    mask: np.ndarray | None = None,
    *,
    scale: float | None = None,
    datum_type: str = "f32",
    acc_datum_type: str = "f32",
    is_causal: bool = False,
) -> np.ndarray:
    """tract's SDPA. ``mask`` and ``scale`` are optional in tract (read with ``get_named_arg_as``);
    the declaration spells "absent" as ``mask = false`` and ``scale = 0.0`` (a zero scale is
    meaningless, so 0.0 / None mean 1/sqrt(D))."""
    acc = parse_datum_type(acc_datum_type, where="tract_transformers_sdpa acc_datum_type")
    parse_datum_type(datum_type, where="tract_transformers_sdpa datum_type")
    if mask is not None and np.ndim(mask) == 0 and np.asarray(mask).dtype == np.bool_ and not bool(mask):
        mask = None  # the declared default `false`: no mask
    sc = None if scale is None or as_float(scale) == 0.0 else as_float(scale)
    return sdpa_array(q, k, v, mask, scale=sc, is_causal=bool(is_causal), acc_dtype=acc)


@primitive(
    "fragment tract_transformers_scaled_masked_softmax(input: tensor<scalar>, mask: tensor<scalar>,"
    " scale: scalar, post_softmax_mask: logical = false) -> (output: tensor<scalar>);",
    REG,
)
def tract_transformers_scaled_masked_softmax(
    input: np.ndarray, mask: np.ndarray, *, scale: float, post_softmax_mask: bool = False
) -> np.ndarray:
    """Softmax over the last axis of ``input * scale + mask`` (float mask), or of
    ``where(mask, input * scale, -inf)`` (bool mask; ``post_softmax_mask`` then zeroes masked-out
    outputs). Computed in f32 for f16/f32 input; result in the input type."""
    x = np.asarray(input)
    m = np.asarray(mask)
    work = float_compute_dtype(x.dtype)
    scaled = x.astype(work) * work.type(as_float(scale))
    if m.dtype == np.bool_:
        pre = np.where(m, scaled, work.type(-np.inf))
    else:
        pre = scaled + m.astype(work)
    mx = np.max(pre, axis=-1, keepdims=True)
    e = np.exp(pre - mx)
    out = e / np.sum(e, axis=-1, keepdims=True)
    if post_softmax_mask and m.dtype == np.bool_:
        out = np.where(m, out, work.type(0))
    return out.astype(x.dtype)


@primitive(
    "fragment tract_transformers_apply_rope(input: tensor<scalar>, cos: tensor<scalar>, sin: tensor<scalar>)"
    " -> (output: tensor<scalar>);",
    REG,
)
def tract_transformers_apply_rope(input: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = concat(-x[..., D/2:], x[..., :D/2])``,
    each product and the sum rounded to the input type (tract evaluates them as separate ops)."""
    x = np.asarray(input)
    dt = x.dtype
    d = x.shape[-1]
    if d % 2:
        raise GraphError(f"tract_transformers_apply_rope: last axis ({d}) must be even")
    half = d // 2
    rot = np.empty_like(x)
    np.negative(x[..., half:], out=rot[..., :half])
    rot[..., half:] = x[..., :half]
    c, s = np.asarray(cos).astype(dt, copy=False), np.asarray(sin).astype(dt, copy=False)
    out = np.multiply(x, c)
    try:
        rot *= s  # all three in dt: the product np.multiply(rot, s) would make, written over rot
    except ValueError:  # sin broadcasts to a larger shape than x
        rot = np.multiply(rot, s)
    out += rot
    return out


# ----------------------------------------------------------------------------------------------
# Recurrent decoder blocks (Qwen3.5)
# ----------------------------------------------------------------------------------------------
def _causal_conv1d_update(input: np.ndarray, weight: np.ndarray, initial_state: np.ndarray):
    x, w, st = np.asarray(input), np.asarray(weight), np.asarray(initial_state)
    kw = w.shape[-1]
    ch = x.size
    if w.size != ch * kw or st.size != ch * kw:
        raise GraphError(
            f"causal_conv1d_update: weight {w.shape} / state {st.shape} do not fit {ch} channels of width {kw}"
        )
    xf = x.reshape(ch).astype(np.float32)
    wf = w.reshape(ch, kw).astype(np.float32)
    sf = st.reshape(ch, kw)
    new_state = np.concatenate([sf[:, 1:], x.reshape(ch, 1).astype(st.dtype)], axis=1)
    acc = np.zeros(ch, dtype=np.float32)
    for tap in range(kw - 1):  # same order of f32 additions as tract
        acc = acc + sf[:, tap + 1].astype(np.float32) * wf[:, tap]
    acc = acc + xf * wf[:, kw - 1]
    out = acc / (np.float32(1.0) + np.exp(-acc))
    return out.astype(x.dtype).reshape(x.shape), new_state.reshape(st.shape)


@primitive(
    "fragment tract_transformers_causal_conv1d_update(input: tensor<scalar>, weight: tensor<scalar>,"
    " initial_state: tensor<scalar>) -> (output: tensor<scalar>, final_state: tensor<scalar>);",
    REG,
    "tract_qwen35_causal_conv1d_update",
)
def tract_transformers_causal_conv1d_update(input: np.ndarray, weight: np.ndarray, initial_state: np.ndarray):
    """One step of a depthwise causal conv1d with SiLU: the state (last ``width`` inputs per channel)
    shifts left by one, takes ``input``; ``output = silu(sum(state * weight))`` accumulated in f32."""
    return _causal_conv1d_update(input, weight, initial_state)


@primitive(
    "fragment tract_transformers_gdn_recurrent(query: tensor<scalar>, key: tensor<scalar>, value: tensor<scalar>,"
    " log_decay: tensor<scalar>, beta: tensor<scalar>, initial_state: tensor<scalar>)"
    " -> (output: tensor<scalar>, final_state: tensor<scalar>);",
    REG,
    "tract_qwen35_gdn_recurrent",
)
def tract_transformers_gdn_recurrent(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    log_decay: np.ndarray,
    beta: np.ndarray,
    initial_state: np.ndarray,
):
    """The gated delta rule, step by step over the sequence axis.

    tract 0.23.9 layout: query/key/value ``[B, S, H, W]``, log_decay/beta ``[B, S, H]``, state
    ``[B, H, W, W]`` (f32). Per step and head, q and k are L2-normalised (eps 1e-6 inside the sqrt),
    ``S' = S * exp(g) + k (beta (v - k^T S exp(g)))`` and ``out = q^T S' / sqrt(W)``, all in f32;
    output in the query's type, state in the state's type."""
    q, k, v = (np.asarray(a) for a in (query, key, value))
    st = np.asarray(initial_state)
    if q.ndim != 4 or k.shape != q.shape or v.shape != q.shape:
        raise GraphError(f"gdn_recurrent: query/key/value must be [B, S, H, W], got {q.shape}, {k.shape}, {v.shape}")
    bsz, seq, heads, width = q.shape
    if st.shape != (bsz, heads, width, width):
        raise GraphError(f"gdn_recurrent: state {st.shape} does not fit query {q.shape}")
    g = np.asarray(log_decay).astype(np.float32).reshape(bsz, seq, heads)
    bt = np.asarray(beta).astype(np.float32).reshape(bsz, seq, heads)
    S = st.astype(np.float32).copy()  # [B, H, row, col]
    out = np.empty(q.shape, dtype=np.float32)
    eps = np.float32(1e-6)
    for t in range(seq):
        qf, kf, vf = (a[:, t].astype(np.float32) for a in (q, k, v))  # [B, H, W]
        qn = qf / np.sqrt(np.sum(qf * qf, axis=-1, keepdims=True) + eps)
        kn = kf / np.sqrt(np.sum(kf * kf, axis=-1, keepdims=True) + eps)
        decay = np.exp(g[:, t])[:, :, None, None]
        decayed = S * decay
        predicted = np.einsum("bhr,bhrc->bhc", kn, decayed)
        residual = (vf - predicted) * bt[:, t][:, :, None]
        S = decayed + kn[:, :, :, None] * residual[:, :, None, :]
        out[:, t] = np.einsum("bhr,bhrc->bhc", qn, S) / np.float32(math.sqrt(width))
    return out.astype(q.dtype), S.astype(st.dtype)


__all__ = ["causal_mask", "sdpa_array", "DynKvCache", "WindowKvSdpa"]
