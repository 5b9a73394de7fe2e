"""Each tract_core_* / tract_transformers_* kernel against tract 0.23.9 on a tiny graph.

Every case writes a one-op NNEF graph to a temp folder, runs it in tract with random inputs, and compares
with the nnef-kv kernel called directly on the same inputs (f32: atol=rtol=1e-5, f16: 1e-3, ints exact).
When ``nnef_kv.load(...).session()`` is available the same graph also runs through the interpreter.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pytest

from conftest import requires_tract
from tract_oracle import Graph, assert_close, tract_run

from nnef_kv.interpreter.catalog import PRIMITIVES, lookup
from nnef_kv.interpreter.ops import tract_core as tc
from nnef_kv.interpreter.ops import tract_core_signal as ts
from nnef_kv.interpreter.ops import tract_transformers as tt

pytestmark = [requires_tract, pytest.mark.tract]

RNG = np.random.default_rng(1234)


def f32(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def f16(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float16)


def ints(lo: int, hi: int, *shape: int, dtype=np.int64) -> np.ndarray:
    return RNG.integers(lo, hi, size=shape).astype(dtype)


@dataclass
class Case:
    id: str
    graph: Graph
    expect: Callable[..., Any]  # our kernel(s) on the graph inputs -> array or tuple of arrays
    marks: tuple = field(default_factory=tuple)


def one(id: str, inputs: dict[str, np.ndarray], call: str, expect, *, ext=("tract_core",), outputs=("y",)) -> Case:
    """A case whose body is ``<outputs> = <call>;``."""
    lhs = ", ".join(outputs) if len(outputs) == 1 else "(" + ", ".join(outputs) + ")"
    return Case(id, Graph(inputs, [f"{lhs} = {call};"], outputs, extensions=ext), expect)


TT = ("tract_core", "tract_transformers")


def _cases() -> list[Case]:
    c: list[Case] = []
    x = f32(2, 3, 4)
    # casts
    xc = (f32(3, 5) * 300).astype(np.float32)
    c.append(one("cast_f32_i64", {"x": xc}, 'tract_core_cast(x, to = "i64")', lambda x: tc.tract_core_cast(x, to="i64")))
    c.append(one("cast_f32_i8_saturate", {"x": xc}, 'tract_core_cast(x, to = "I8")', lambda x: tc.tract_core_cast(x, to="I8")))
    c.append(one("cast_f32_u8_saturate", {"x": xc}, 'tract_core_cast(x, to = "u8")', lambda x: tc.tract_core_cast(x, to="u8")))
    c.append(one("cast_f32_f16", {"x": f32(4, 4)}, 'tract_core_cast(x, to = "f16")', lambda x: tc.tract_core_cast(x, to="f16")))
    c.append(one("cast_i64_f32", {"x": ints(-50, 50, 6)}, 'tract_core_cast(x, to = "f32")', lambda x: tc.tract_core_cast(x, to="f32")))
    c.append(one("cast_f32_bool", {"x": np.array([0.0, 1.5, -2.0, 0.0], np.float32)}, 'tract_core_cast(x, to = "bool")', lambda x: tc.tract_core_cast(x, to="bool")))
    c.append(one("cast_bool_f32", {"x": np.array([True, False, True])}, 'tract_core_cast(x, to = "f32")', lambda x: tc.tract_core_cast(x, to="f32")))
    # gathers / scatters
    emb = f32(10, 6)
    tok = ints(-10, 10, 2, 3)
    c.append(one("gather_axis0", {"w": emb, "i": tok}, "tract_core_gather(w, i, axis = 0)", lambda w, i: tc.tract_core_gather(w, i, axis=0)))
    c.append(one("gather_axis1_i32", {"w": emb, "i": ints(0, 6, 4, dtype=np.int32)}, "tract_core_gather(w, i, axis = 1)", lambda w, i: tc.tract_core_gather(w, i, axis=1)))
    ge_idx = ints(-4, 4, 2, 3, 5)
    c.append(one("gather_elements", {"x": x, "i": ge_idx}, "tract_core_gather_elements(x, i, axis = 2)", lambda x, i: tc.tract_core_gather_elements(x, i, axis=2)))
    c.append(one("gather_nd", {"x": x, "i": ints(0, 2, 4, 2)}, "tract_core_gather_nd(x, i, batch_dims = 0)", lambda x, i: tc.tract_core_gather_nd(x, i, batch_dims=0)))
    c.append(one("gather_nd_batch", {"x": x, "i": ints(0, 3, 2, 5, 1)}, "tract_core_gather_nd(x, i, batch_dims = 1)", lambda x, i: tc.tract_core_gather_nd(x, i, batch_dims=1)))
    data = f32(5, 3)
    sidx = np.array([[[4], [0]]], np.int64)
    upd = f32(1, 2, 3)
    c.append(one("scatter_nd", {"d": data, "i": sidx, "u": upd}, 'tract_core_scatter_nd(d, i, u, reduction = "none")', lambda d, i, u: tc.tract_core_scatter_nd(d, i, u, reduction="none")))
    c.append(one("scatter_nd_add", {"d": data, "i": np.array([[1], [1], [3]], np.int64), "u": f32(3, 3)}, 'tract_core_scatter_nd(d, i, u, reduction = "add")', lambda d, i, u: tc.tract_core_scatter_nd(d, i, u, reduction="add")))
    se_idx = np.array([[1, 0, 2], [0, 2, 1]], np.int64)
    c.append(one("scatter_elements", {"d": f32(3, 3), "i": se_idx, "u": f32(2, 3)}, "tract_core_scatter_elements(d, i, u, axis = 0)", lambda d, i, u: tc.tract_core_scatter_elements(d, i, u, axis=0)))
    c.append(one("scatter_elements_add", {"d": f32(3, 3), "i": np.array([[1, 1, 0]], np.int64), "u": f32(1, 3)}, 'tract_core_scatter_elements(d, i, u, axis = 1, reduction = "add")', lambda d, i, u: tc.tract_core_scatter_elements(d, i, u, axis=1, reduction="add")))
    c.append(one("non_zero", {"x": (f32(3, 4) > 0).astype(np.float32)}, "tract_onnx_non_zero(x)", lambda x: tc.tract_onnx_non_zero(x), ext=("tract_core", "tract_onnx")))
    c.append(one("one_hot", {"x": ints(0, 5, 2, 3)}, "tract_core_one_hot(x, axis = 1, dim = 5)", lambda x: tc.tract_core_one_hot(x, axis=1, dim=5)))
    # einsum and matmul
    a, b = f32(3, 4), f32(5, 4)
    c.append(one("einsum_mk_nk", {"a": a, "b": b}, 'tract_core_einsum([a, b], expr = "mk,nk->mn", acc = "f32", output = "")', lambda a, b: tc.tract_core_einsum([a, b], expr="mk,nk->mn", acc="f32")))
    c.append(one("einsum_output_attr_ignored", {"a": a, "b": b}, 'tract_core_einsum([a, b], expr = "mk,nk->mn", acc = "f32", output = "f16")', lambda a, b: tc.tract_core_einsum([a, b], expr="mk,nk->mn", acc="f32", output="f16")))
    c.append(one("einsum_three_inputs", {"a": a, "b": b, "z": f32(5)}, 'tract_core_einsum([a, b, z], expr = "mk,nk,n->m", acc = "f32")', lambda a, b, z: tc.tract_core_einsum([a, b, z], expr="mk,nk,n->m", acc="f32")))
    q4, k4 = f32(1, 2, 3, 4), f32(1, 2, 5, 4)
    c.append(one("einsum_attention", {"a": q4, "b": k4}, 'tract_core_einsum([a, b], expr = "bhmk,bhnk->bhmn", acc = "f32")', lambda a, b: tc.tract_core_einsum([a, b], expr="bhmk,bhnk->bhmn", acc="f32")))
    c.append(one("einsum_f16", {"a": f16(3, 8), "b": f16(8, 2)}, 'tract_core_einsum([a, b], expr = "mk,kn->mn", acc = "f16")', lambda a, b: tc.tract_core_einsum([a, b], expr="mk,kn->mn", acc="f16")))
    # shape, range, slices, broadcast
    # tract's shape_of yields TDim, which its Python API cannot return: cast to i64 in the graph
    c.append(one("shape_of", {"x": x}, 'tract_core_cast(tract_core_shape_of(x), to = "i64")', lambda x: tc.tract_core_shape_of(x)))
    c.append(Case("range_int", Graph({"x": x}, ["y = tract_core_range(1, 11, 3);", "z = add(x, 0.0);"], ["y", "z"]), lambda x: (tc.tract_core_range(start=1, end=11, step=3), x)))
    c.append(Case("range_neg", Graph({"x": x}, ["y = tract_core_range(5, -3, -2);", "z = add(x, 0.0);"], ["y", "z"]), lambda x: (tc.tract_core_range(start=5, end=-3, step=-2), x)))
    c.append(Case("range_f32", Graph({"x": x}, ["y = tract_core_range(0.5, 3.0, 0.1);", "z = add(x, 0.0);"], ["y", "z"]), lambda x: (tc.tract_core_range(start=np.float32(0.5), end=np.float32(3.0), step=np.float32(0.1)), x)))
    c.append(one("dyn_slice", {"x": f32(2, 7, 3)}, "tract_core_dyn_slice(x, 2, 6, len = 4, axis = 1)", lambda x: tc.tract_core_dyn_slice(x, start=2, end=6, len=4, axis=1)))
    c.append(one("broadcast", {"x": f32(3, 1)}, "tract_core_broadcast(x, shape = [2, 3, 4])", lambda x: tc.tract_core_broadcast(x, shape=[2, 3, 4])))
    c.append(one("downsample", {"x": f32(2, 9)}, "tract_core_downsample(x, axis = 1, stride = 2, modulo = 1)", lambda x: tc.tract_core_downsample(x, axis=1, stride=2, modulo=1)))
    # reductions, norms, softmax
    c.append(one("argmax_last", {"x": np.array([[1, 3, 3, 0], [2, 2, 1, 2]], np.float32)}, "tract_core_argmax_reduce_last(x, axes = [1])", lambda x: tc.tract_core_argmax_reduce_last(x, axes=[1])))
    c.append(one("argmin_last", {"x": np.array([[1, 0, 3, 0], [2, 2, 1, 1]], np.float32)}, "tract_core_argmin_reduce_last(x, axes = [1])", lambda x: tc.tract_core_argmin_reduce_last(x, axes=[1])))
    c.append(one("argmax_random_axis0", {"x": x}, "tract_core_argmax_reduce_last(x, axes = [0])", lambda x: tc.tract_core_argmax_reduce_last(x, axes=[0])))
    c.append(one("product_reduce", {"x": x}, "tract_core_product_reduce(x, axes = [1, 2])", lambda x: tc.tract_core_product_reduce(x, axes=[1, 2])))
    c.append(one("rms_norm", {"x": f32(1, 3, 16)}, "tract_core_rms_norm(x, axis = 2, eps = 1e-5)", lambda x: tc.tract_core_rms_norm(x, axis=2, eps=1e-5)))
    c.append(one("rms_norm_default_eps", {"x": f32(2, 8, 3) * 1e-3}, "tract_core_rms_norm(x, axis = 1)", lambda x: tc.tract_core_rms_norm(x, axis=1)))
    c.append(one("rms_norm_alias_f16", {"x": f16(1, 2, 32)}, "tract_transformers_rms_norm(x, axis = 2, eps = 1e-6)", lambda x: PRIMITIVES["tract_transformers_rms_norm"].kernel(x, axis=2, eps=1e-6), ext=TT))
    c.append(one("softmax", {"x": x}, "tract_core_softmax(x, axes = [2])", lambda x: tc.tract_core_softmax(x, [2])))
    c.append(one("softmax_2axes_legacy_exp", {"x": x}, 'tract_core_softmax(x, axes = [1, 2], exp = "fast_compact")', lambda x: tc.tract_core_softmax(x, [1, 2], exp="fast_compact")))
    c.append(one("softmax_f16", {"x": f16(2, 16)}, "tract_core_softmax(x, axes = [1])", lambda x: tc.tract_core_softmax(x, [1])))
    c.append(one("log_softmax", {"x": x}, "tract_core_log_softmax(x, axes = [2])", lambda x: tc.tract_core_log_softmax(x, [2])))
    for up, k in ((True, 0), (True, 1), (False, 0), (False, -1)):
        c.append(one(f"trilu_{'u' if up else 'l'}{k}", {"x": f32(2, 4, 5)}, f"tract_core_trilu(x, {k}, upper = {'true' if up else 'false'})", lambda x, up=up, k=k: tc.tract_core_trilu(x, np.int64(k), upper=up)))
    c.append(one("topk_largest", {"x": x}, "tract_core_topk(x, 2, axis = 2, largest = true)", lambda x: tc.tract_core_topk(x, np.int64(2), axis=2, largest=True), outputs=("v", "i")))
    c.append(one("topk_smallest_ties", {"x": np.array([[3, 1, 1, 2, 1]], np.float32)}, "tract_core_topk(x, 3, axis = 1, largest = false)", lambda x: tc.tract_core_topk(x, np.int64(3), axis=1, largest=False), outputs=("v", "i")))
    # element-wise
    xe = f32(4, 8) * 3
    c.append(one("silu", {"x": xe}, "tract_core_silu(x)", lambda x: tc.tract_core_silu(x)))
    c.append(one("silu_f16", {"x": f16(4, 8)}, "tract_core_silu(x)", lambda x: tc.tract_core_silu(x)))
    c.append(one("silu_transformers_alias", {"x": xe}, "tract_transformers_silu(x)", lambda x: tc.tract_core_silu(x), ext=TT))
    c.append(one("gelu_approx", {"x": xe}, "tract_core_gelu_approx(x, fast_impl = false)", lambda x: tc.tract_core_gelu_approx(x, fast_impl=False)))
    c.append(one("gelu_approx_fast", {"x": xe}, "tract_core_gelu_approx(x, fast_impl = true)", lambda x: tc.tract_core_gelu_approx(x, fast_impl=True)))
    c.append(one("erf", {"x": xe}, "tract_core_erf(x)", lambda x: tc.tract_core_erf(x)))
    c.append(one("hard_swish", {"x": xe}, "tract_core_hard_swish(x)", lambda x: tc.tract_core_hard_swish(x)))
    c.append(one("round_even", {"x": np.array([0.5, 1.5, 2.5, -0.5, -1.5, 1.2], np.float32)}, "tract_core_round_even(x)", lambda x: tc.tract_core_round_even(x)))
    c.append(one("is_nan", {"x": np.array([0.0, np.nan, 1.0], np.float32)}, "tract_core_is_nan(x)", lambda x: tc.tract_core_is_nan(x)))
    c.append(one("is_inf", {"x": np.array([0.0, np.inf, -np.inf, 1.0], np.float32)}, "tract_core_is_inf(x, detect_negative = false)", lambda x: tc.tract_core_is_inf(x, detect_negative=False)))
    c.append(one("pow_const", {"x": np.abs(xe)}, "tract_core_pow_const(x, exponent = 1.5)", lambda x: tc.tract_core_pow_const(x, exponent=1.5)))
    c.append(one("bitnot", {"x": ints(-9, 9, 5, dtype=np.int32)}, "tract_core_bitnot(x)", lambda x: tc.tract_core_bitnot(x)))
    c.append(one("bitand", {"x": ints(0, 99, 5, dtype=np.int32), "z": ints(0, 99, 5, dtype=np.int32)}, "tract_core_bitand(x, z)", lambda x, z: PRIMITIVES["tract_core_bitand"].kernel(x, z)))
    c.append(one("xor", {"x": np.array([True, False, True]), "z": np.array([True, True, False])}, "tract_core_xor(x, z)", lambda x, z: PRIMITIVES["tract_core_xor"].kernel(x, z)))
    # transformers
    q, k, v = f32(1, 4, 3, 8), f32(1, 2, 5, 8), f32(1, 2, 5, 8)
    sd = "tract_transformers_sdpa"
    c.append(one("sdpa_gqa_nomask", {"q": q, "k": k, "v": v}, f'{sd}(q, k, v, datum_type = "f32", acc_datum_type = "f32", is_causal = false)', lambda q, k, v: tt.tract_transformers_sdpa(q, k, v), ext=TT))
    c.append(one("sdpa_gqa_causal_sq_lt_skv", {"q": q, "k": k, "v": v}, f'{sd}(q, k, v, datum_type = "f32", acc_datum_type = "f32", is_causal = true)', lambda q, k, v: tt.tract_transformers_sdpa(q, k, v, is_causal=True), ext=TT))
    # Sq > Skv with is_causal: the first Sq - Skv rows see no key -> NaN in tract 0.23.9 as here
    c.append(one("sdpa_causal_sq_gt_skv_nan_rows", {"q": f32(1, 2, 5, 4), "k": f32(1, 2, 3, 4), "v": f32(1, 2, 3, 4)}, f'{sd}(q, k, v, datum_type = "f32", acc_datum_type = "f32", is_causal = true)', lambda q, k, v: tt.tract_transformers_sdpa(q, k, v, is_causal=True), ext=TT))
    qs = f32(1, 2, 4, 8)
    ks, vs = f32(1, 2, 4, 8), f32(1, 2, 4, 8)
    c.append(one("sdpa_causal_square_scale", {"q": qs, "k": ks, "v": vs}, f'{sd}(q, k, v, scale = 0.3, datum_type = "f32", acc_datum_type = "f32", is_causal = true)', lambda q, k, v: tt.tract_transformers_sdpa(q, k, v, scale=0.3, is_causal=True), ext=TT))
    m4 = f32(1, 1, 3, 5)
    c.append(one("sdpa_gqa_mask4d", {"q": q, "k": k, "v": v, "m": m4}, f'{sd}(q, k, v, m, datum_type = "f32", acc_datum_type = "f32", is_causal = false)', lambda q, k, v, m: tt.tract_transformers_sdpa(q, k, v, m), ext=TT))
    m2 = f32(3, 5)
    c.append(one("sdpa_mask2d_leading_axes", {"q": q, "k": k, "v": v, "m": m2}, f'{sd}(q, k, v, m, datum_type = "f32", acc_datum_type = "f32", is_causal = false, scale = 0.5)', lambda q, k, v, m: tt.tract_transformers_sdpa(q, k, v, m, scale=0.5), ext=TT))
    mh = f32(1, 4, 3, 5)
    c.append(one("sdpa_gqa_mask_per_head", {"q": q, "k": k, "v": v, "m": mh}, f'{sd}(q, k, v, m, datum_type = "f32", acc_datum_type = "f32", is_causal = false)', lambda q, k, v, m: tt.tract_transformers_sdpa(q, k, v, m), ext=TT))
    q3, k3, v3 = f32(2, 3, 8), f32(2, 6, 8), f32(2, 6, 4)
    c.append(one("sdpa_rank3_causal", {"q": q3, "k": k3, "v": v3}, f'{sd}(q, k, v, datum_type = "f32", acc_datum_type = "f32", is_causal = true)', lambda q, k, v: tt.tract_transformers_sdpa(q, k, v, is_causal=True), ext=TT))
    qh, kh, vh = f16(1, 4, 2, 8), f16(1, 2, 6, 8), f16(1, 2, 6, 8)
    c.append(one("sdpa_f16_acc_f32", {"q": qh, "k": kh, "v": vh}, f'{sd}(q, k, v, datum_type = "f16", acc_datum_type = "f32", is_causal = true)', lambda q, k, v: tt.tract_transformers_sdpa(q, k, v, datum_type="f16", acc_datum_type="f32", is_causal=True), ext=TT))
    c.append(one("sdpa_f16_acc_f16", {"q": qh, "k": kh, "v": vh}, f'{sd}(q, k, v, datum_type = "f16", acc_datum_type = "f16", is_causal = false)', lambda q, k, v: tt.tract_transformers_sdpa(q, k, v, datum_type="f16", acc_datum_type="f16"), ext=TT))
    c.append(one("sdpa_f16_mask_f16", {"q": qh, "k": kh, "v": vh, "m": f16(1, 1, 2, 6)}, f'{sd}(q, k, v, m, datum_type = "f16", acc_datum_type = "f32", is_causal = false)', lambda q, k, v, m: tt.tract_transformers_sdpa(q, k, v, m, datum_type="f16", acc_datum_type="f32"), ext=TT))
    # a rank-1 mask [Skv] gets leading unit axes; tract 0.23.9's FlashSDPA then fails to broadcast it over
    # Sq ("incompatible shapes"), so tract runs the same mask pre-broadcast to [1, 1, Sq, Skv]
    m1 = f32(5)
    c.append(one("sdpa_mask_rank1", {"q": q, "k": k, "v": v, "m": np.broadcast_to(m1, (1, 1, 3, 5)).copy()}, f'{sd}(q, k, v, m, datum_type = "f32", acc_datum_type = "f32", is_causal = false)', lambda q, k, v, m: tt.tract_transformers_sdpa(q, k, v, m[0, 0, 0]), ext=TT))
    c.append(one("sdpa_dv_differs", {"q": q, "k": k, "v": f32(1, 2, 5, 6)}, f'{sd}(q, k, v, datum_type = "f32", acc_datum_type = "f32", is_causal = true)', lambda q, k, v: tt.tract_transformers_sdpa(q, k, v, is_causal=True), ext=TT))
    sc, smk = f32(1, 2, 3, 5), f32(1, 1, 3, 5)
    c.append(one("scaled_masked_softmax", {"x": sc, "m": smk}, "tract_transformers_scaled_masked_softmax(x, m, scale = 0.25, post_softmax_mask = false)", lambda x, m: tt.tract_transformers_scaled_masked_softmax(x, m, scale=0.25), ext=TT))
    bm = RNG.integers(0, 2, size=(1, 1, 3, 5)).astype(bool)
    bm[..., 0] = True
    c.append(one("scaled_masked_softmax_bool_post", {"x": sc, "m": bm}, "tract_transformers_scaled_masked_softmax(x, m, scale = 0.5, post_softmax_mask = true)", lambda x, m: tt.tract_transformers_scaled_masked_softmax(x, m, scale=0.5, post_softmax_mask=True), ext=TT))
    xr = f32(1, 2, 3, 8)
    ang = f32(1, 1, 3, 8)
    c.append(one("apply_rope", {"x": xr, "c": np.cos(ang), "s": np.sin(ang)}, "tract_transformers_apply_rope(x, c, s)", lambda x, c_, s: tt.tract_transformers_apply_rope(x, c_, s), ext=TT))
    c.append(one("apply_rope_f16", {"x": xr.astype(np.float16), "c": np.cos(ang).astype(np.float16), "s": np.sin(ang).astype(np.float16)}, "tract_transformers_apply_rope(x, c, s)", lambda x, c_, s: tt.tract_transformers_apply_rope(x, c_, s), ext=TT))
    cx, cw, cs = f16(1, 6, 1), f16(6, 4), f16(1, 6, 4)
    c.append(one("causal_conv1d_update", {"x": cx, "w": cw, "s": cs}, "tract_transformers_causal_conv1d_update(x, w, s)", lambda x, w, s: tt.tract_transformers_causal_conv1d_update(x, w, s), ext=TT, outputs=("y", "st")))
    W = 128  # tract 0.23.9 requires width 128; [B, S, H, W] with S > 1 runs the recurrence
    for seq, heads in ((1, 1), (3, 2)):
        gq, gk, gv = f16(1, seq, heads, W), f16(1, seq, heads, W), f16(1, seq, heads, W)
        gg = (-np.abs(f32(1, seq, heads))).astype(np.float32)
        gb = np.abs(f16(1, seq, heads))
        gs = (f32(1, heads, W, W) * 0.1).astype(np.float32)
        c.append(one(f"gdn_recurrent_s{seq}_h{heads}", {"q": gq, "k": gk, "v": gv, "ld": gg, "b": gb, "s": gs}, "tract_transformers_gdn_recurrent(q, k, v, ld, b, s)", lambda q, k, v, g, b, s: tt.tract_transformers_gdn_recurrent(q, k, v, g, b, s), ext=TT, outputs=("y", "st")))
    c += _signal_cases()
    return c


def _signal_cases() -> list[Case]:
    c: list[Case] = []

    def const(vals) -> str:
        return "[" + ", ".join(repr(float(v)) for v in vals) + "]"

    img = f32(1, 2, 4, 5)
    resize_cases = [
        ("linear_half_pixel_up", [1, 1, 2, 2], None, "half_pixel", "linear", "floor"),
        ("linear_align_corners", [1, 1, 1.5, 2], None, "align_corners", "linear", "floor"),
        ("linear_down_frac", [1, 1, 0.5, 0.6], None, "half_pixel", "linear", "floor"),
        ("nearest_asym_floor", [1, 1, 2, 3], None, "asymmetric", "nearest", "floor"),
        ("nearest_round_prefer_ceil", [1, 1, 1.5, 2.5], None, "half_pixel", "nearest", "round_prefer_ceil"),
        ("cubic_half_pixel", [1, 1, 2, 1.5], None, "half_pixel", "cubic", "floor"),
        ("linear_pytorch_half_pixel", [1, 1, 2, 2], None, "pytorch_half_pixel", "linear", "floor"),
        ("sizes_nearest", None, [1, 2, 7, 3], "asymmetric", "nearest", "floor"),
        ("sizes_linear", None, [1, 2, 6, 9], "half_pixel", "linear", "floor"),
    ]
    for name, scales, sizes, coord, interp, near in resize_cases:
        aux = "scales" if scales is not None else "sizes"
        vals = scales if scales is not None else sizes
        body = [
            f"aux = {const(vals)};",
            f"y = tract_core_resize(x, {aux} = aux, coord_transformer = '{coord}', interpolator = '{interp}', nearest_mode = '{near}');",
        ]
        kw = dict(coord_transformer=coord, interpolator=interp, nearest_mode=near)
        if scales is not None:
            fn = lambda x, v=np.asarray(vals, np.float32), kw=kw: ts.tract_core_resize(x, v, None, **kw)
        else:
            fn = lambda x, v=np.asarray(vals, np.float32), kw=kw: ts.tract_core_resize(x, None, v, **kw)
        c.append(Case(f"resize_{name}", Graph({"x": img}, body, ["y"]), fn))
    c.append(one("resize_f16", {"x": img.astype(np.float16)}, "tract_core_resize(x, scales = [1.0, 1.0, 2.0, 2.0], interpolator = 'linear')", lambda x: ts.tract_core_resize(x, np.array([1, 1, 2, 2], np.float32), interpolator="linear")))

    gx = f32(2, 3, 4, 5)
    grid = (f32(2, 3, 6, 2) * 0.8).astype(np.float32)  # some points fall outside [-1, 1]
    for mode in ("bilinear", "nearest"):
        for pad in ("zeros", "border", "reflection"):
            for ac in (False, True):
                call = f"tract_core_grid_sample(x, g, mode = '{mode}', padding_mode = '{pad}', align_corners = {'true' if ac else 'false'})"
                c.append(one(f"grid_sample_{mode}_{pad}_{'ac' if ac else 'noac'}", {"x": gx, "g": grid}, call,
                             lambda x, g, m=mode, p=pad, a=ac: ts.tract_core_grid_sample(x, g, mode=m, padding_mode=p, align_corners=a)))
    c.append(one("grid_sample_3d", {"x": f32(1, 2, 3, 4, 5), "g": f32(1, 2, 3, 4, 3) * 0.9}, "tract_core_grid_sample(x, g, mode = 'bilinear', padding_mode = 'zeros', align_corners = false)",
                 lambda x, g: ts.tract_core_grid_sample(x, g, mode="bilinear", padding_mode="zeros", align_corners=False)))

    sig = f32(2, 16, 2)
    c.append(one("fft", {"x": sig}, "tract_core_fft(x, axis = 1, inverse = false)", lambda x: ts.tract_core_fft(x, axis=1, inverse=False)))
    c.append(one("fft_inverse", {"x": sig}, "tract_core_fft(x, axis = 1, inverse = true)", lambda x: ts.tract_core_fft(x, axis=1, inverse=True)))
    c.append(one("stft_nowindow", {"x": sig}, "tract_core_stft(x, axis = 1, frame = 8, stride = 3)", lambda x: ts.tract_core_stft(x, axis=1, frame=8, stride=3)))
    win = np.hanning(6).astype(np.float32)
    # tract wants the window as a constant (it reads it as a tensor value, not a wire)
    c.append(Case("stft_window_padded", Graph({"x": sig}, [f"w = {const(win)};", "y = tract_core_stft(x, axis = 1, frame = 8, stride = 2, window = w);"], ["y"]),
                  lambda x: ts.tract_core_stft(x, win, axis=1, frame=8, stride=2)))

    c.append(one("lstm_epilogue", {"p": f32(3, 16), "cp": f32(3, 4)}, "tract_core_lstm_epilogue(p, cp, hidden = 4)", lambda p, cp: ts.tract_core_lstm_epilogue(p, cp, hidden=4), outputs=("h", "ct")))
    c.append(one("lstm_epilogue_f16", {"p": f16(2, 16), "cp": f16(2, 4)}, "tract_core_lstm_epilogue(p, cp, hidden = 4)", lambda p, cp: ts.tract_core_lstm_epilogue(p, cp, hidden=4), outputs=("h", "ct")))
    c.append(one("gru_epilogue_f16", {"a": f16(3, 12), "b": f16(3, 12), "p": f16(3, 4)}, "tract_core_gru_epilogue(a, b, p, hidden = 4)", lambda a, b, p: ts.tract_core_gru_epilogue(a, b, p, hidden=4)))
    h = 4
    c.append(one("gru_epilogue", {"a": f32(3, 3 * h), "b": f32(3, 3 * h), "p": f32(3, h)}, f"tract_core_gru_epilogue(a, b, p, hidden = {h})", lambda a, b, p: ts.tract_core_gru_epilogue(a, b, p, hidden=h)))
    return c


CASES = _cases()


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_kernel_matches_tract(case: Case, tmp_path) -> None:
    folder = case.graph.write(tmp_path / case.id)
    inputs = list(case.graph.inputs.values())
    want = tract_run(folder, inputs)
    got = case.expect(*[a.copy() for a in inputs])
    got = list(got) if isinstance(got, tuple) else [got]
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w, what=f"{case.id} output {i}")


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_session_matches_tract(case: Case, tmp_path) -> None:
    """The same one-op graph through nnef-kv's interpreter (``nnef_kv.load(...).session().run``)."""
    import nnef_kv

    folder = case.graph.write(tmp_path / case.id)
    inputs = list(case.graph.inputs.values())
    want = tract_run(folder, inputs)
    try:
        session = nnef_kv.load(folder).session()
    except (ImportError, AttributeError, NotImplementedError) as exc:
        pytest.skip(f"nnef_kv.load(...).session() not available yet: {exc!r}")
    outs = session.run({k: v.copy() for k, v in case.graph.inputs.items()})
    got = list(outs.values())
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert_close(np.asarray(g), w, what=f"session {case.id} output {i}")


def test_every_case_op_is_registered() -> None:
    """The ops exercised above are all in the registry under their tract names."""
    import re

    for case in CASES:
        for line in case.graph.body:
            for name in re.findall(r"\b(tract_\w+)\(", line):
                assert lookup(name) is not None, name


def test_dyn_kv_cache_state_protocol() -> None:
    from nnef_kv.core.registry import StatefulKernel

    cache = tt.DynKvCache(name="k", axis=2, datum_type="f32", past_sequence_shape=[1, 2, "P", 4], input_sequence_shape=[1, 2, "S", 4])
    assert isinstance(cache, StatefulKernel)
    assert cache.symbol_bindings() == {"P": 0}
    a, b = f32(1, 2, 3, 4), f32(1, 2, 1, 4)
    np.testing.assert_array_equal(cache(a), a)
    out = cache(b)
    np.testing.assert_array_equal(out, np.concatenate([a, b], axis=2))
    assert cache.symbol_bindings() == {"P": 4}
    # the buffer keeps spare capacity for later appends: counted in full, never less than what it holds
    per_entry = out.nbytes // out.shape[2]
    assert cache.capacity >= 4
    assert cache.nbytes() == {"codes": 0, "params": 0, "full_precision": cache.capacity * per_entry}
    assert not out.flags.writeable
    saved = cache.state_tensors()
    cache.reset()
    assert cache.state_tensors() == {} and cache.nbytes()["full_precision"] == 0
    cache.load_state_tensors(saved)
    np.testing.assert_array_equal(cache(b), np.concatenate([a, b, b], axis=2))
    with pytest.raises(Exception):
        cache(f32(1, 3, 1, 4))  # head count changed


def test_sdpa_causal_is_bottom_right_aligned() -> None:
    """With Sq < Skv the last query row sees every key, the first sees Skv - Sq + 1 keys."""
    m = tt.causal_mask(2, 5)
    assert m.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]


def test_sdpa_rejects_bad_heads() -> None:
    from nnef_kv.errors import GraphError

    with pytest.raises(GraphError, match="multiple"):
        tt.sdpa_array(f32(1, 3, 2, 4), f32(1, 2, 2, 4), f32(1, 2, 2, 4))


# ----------------------------------------------------------------------------------------------
# Reference I/O of the shared conformance corpus for the single-op cases
# ----------------------------------------------------------------------------------------------
def _conformance_cases() -> list[tuple[str, Callable[[dict], list[np.ndarray]], list[str]]]:
    def io(d: dict, *names: str) -> list[np.ndarray]:
        return [d[n] for n in names]

    def scatter_nd_block(d: dict) -> list[np.ndarray]:
        from conftest import CONFORMANCE
        from nnef_kv.tensors.dat import read_tensor

        idx = read_tensor(CONFORMANCE / "tract-harness/scatter-nd-block/indices.0.dat")
        return [tc.tract_core_scatter_nd(d["data"], idx, d["updates"], reduction="none")]

    f16 = lambda a: a.astype(np.float16)  # noqa: E731 - the harness runs these with --allow-float-casts
    return [
        ("qwen35-recurrent/gdn-recurrent",
         lambda d: [o.astype(np.float32) for o in tt.tract_transformers_gdn_recurrent(
             f16(d["query"]), f16(d["key"]), f16(d["value"]), d["log_decay"], f16(d["beta"]), d["initial_state"])],
         ["output", "final_state"]),
        # reference written by tract HEAD (0.23.9 refuses a [C, k] state): the 4-tap update itself
        ("qwen35-recurrent/causal-conv1d-update",
         lambda d: [o.astype(np.float32) for o in tt.tract_transformers_causal_conv1d_update(
             f16(d["input"]), f16(d["weight"]), f16(d["initial_state"]))],
         ["output", "final_state"]),
        ("scatter-nd-block", scatter_nd_block, ["out"]),
        ("grid_sample/grid_sample_identity",
         lambda d: [ts.tract_core_grid_sample(d["input_0"], np.array([[[[-1.0, -1.0], [1.0, -1.0]], [[-1.0, 1.0], [1.0, 1.0]]]], np.float32),
                                              mode="bilinear", padding_mode="zeros", align_corners=True)],
         ["output_0"]),
        ("resize/core_resize_linear",
         lambda d: [ts.tract_core_resize(d["input_0"], np.array([1.0, 1.0, 2.0], np.float32), interpolator="linear", coord_transformer="half_pixel")],
         ["output_0"]),
        ("resize/core_resize_nearest",
         lambda d: [ts.tract_core_resize(d["input_0"], np.array([1.0, 1.0, 2.0, 2.0], np.float32), interpolator="nearest", coord_transformer="asymmetric", nearest_mode="floor")],
         ["output_0"]),
        ("resize/core_resize_sizes",
         lambda d: [ts.tract_core_resize(d["input_0"], None, np.array([1.0, 1.0, 4.0, 4.0], np.float32), interpolator="nearest", coord_transformer="asymmetric", nearest_mode="floor")],
         ["output_0"]),
        ("non_zero_two_nodes",
         lambda d: [tc.tract_core_cast(tc.tract_onnx_non_zero(d["input_0"]), to="i32"),
                    tc.tract_core_cast(tc.tract_onnx_non_zero(d["input_0"] > 1), to="i32")],
         ["output_0", "output_1"]),
    ]


CONFORMANCE_CASES = _conformance_cases()


@pytest.mark.parametrize("case", CONFORMANCE_CASES, ids=[c[0] for c in CONFORMANCE_CASES])
def test_kernel_matches_conformance_reference(case, shared_dir) -> None:
    path, run, names = case
    ref = dict(np.load(shared_dir / "conformance" / "tract-harness" / path / "io.npz"))
    got = run(ref)
    assert len(got) == len(names)
    for name, g in zip(names, got):
        want = ref[name]
        # f16 computations compared on f32 references: f16 tolerance
        tol = 1e-3 if "qwen35" in path else 1e-5
        assert g.shape == want.shape and g.dtype == want.dtype, (name, g.shape, g.dtype, want.shape, want.dtype)
        np.testing.assert_allclose(g, want, atol=tol, rtol=tol, err_msg=f"{path}: {name}")


def test_sdpa_bool_mask_refused_like_tract(tmp_path) -> None:
    """tract 0.23.9 refuses a bool SDPA mask at codegen ("Mask must be floating point"); so does nnef-kv."""
    from nnef_kv.errors import GraphError

    q, k, v = f32(1, 4, 3, 8), f32(1, 2, 5, 8), f32(1, 2, 5, 8)
    m = RNG.integers(0, 2, size=(1, 1, 3, 5)).astype(bool)
    g = Graph({"q": q, "k": k, "v": v, "m": m}, ['y = tract_transformers_sdpa(q, k, v, m, datum_type = "f32", acc_datum_type = "f32", is_causal = false);'], ["y"], extensions=TT)
    with pytest.raises(Exception, match="floating point"):
        tract_run(g.write(tmp_path / "bool_mask"), [q, k, v, m])
    with pytest.raises(GraphError, match="float"):
        tt.tract_transformers_sdpa(q, k, v, m)


# ----------------------------------------------------------------------------------------------
# tract_core_scan loop (driven by the graph builder; here with a hand-written body)
# ----------------------------------------------------------------------------------------------
def test_scan_loop_reproduces_gru_epilogue_reference(shared_dir) -> None:
    """conformance tract-harness/gru-epilogue: a scan over time whose body is einsum + gru_epilogue."""
    from nnef_kv.interpreter.ops.tract_scan import ScanLoop, ScanSpec
    from nnef_kv.tensors.dat import read_tensor

    case = shared_dir / "conformance" / "tract-harness" / "gru-epilogue"
    ref = dict(np.load(case / "io.npz"))
    W = read_tensor(case / "Y.extracted.Y.Xt_WT.prop_axis.a.input_1.dat")
    R, Rb, Wb = (read_tensor(case / f"{n}.dat") for n in ("R", "Y.Rb_all", "Y.Wb_all"))
    x = ref["X"]
    xw = np.matmul(x.reshape(8, 5), W.T).reshape(4, 2, 12)

    def body(v: dict) -> dict:
        xh = np.squeeze(v["Y_extracted_Y_Xt_WT"], 0) + v["Y_Wb_all"]
        h = np.squeeze(v["h_source"], 0)
        rh = tc.tract_core_einsum([h, v["R"]], expr="mk,nk->mn", acc="f32") + v["Y_Rb_all"]
        return {"Y_y_h": ts.tract_core_gru_epilogue(xh, rh, h, hidden=4)[None]}

    spec = ScanSpec(scan=(("Y_extracted_Y_Xt_WT", 0, 1),), full=("R", "Y_Rb_all", "Y_Wb_all"),
                    state=(("h_source", "Y_y_h"),), outputs=(("Y_y_h", "full", 0, 1), ("Y_y_h", "last", 0, 1)))
    loop = ScanLoop(spec, body)
    y, y_h = loop([xw], [R, Rb, Wb], [np.zeros((1, 2, 4), np.float32)])
    np.testing.assert_allclose(y[:, None], ref["Y"], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(y_h, ref["Y_h"], atol=1e-5, rtol=1e-5)
    # the hidden state persists across runs (reset_every_turn = false), as in tract, until reset()
    saved = loop.state_tensors()
    y2, _ = loop([xw], [R, Rb, Wb], [np.zeros((1, 2, 4), np.float32)])
    assert not np.allclose(y2, y)
    loop.load_state_tensors(saved)
    y3, _ = loop([xw], [R, Rb, Wb], [np.zeros((1, 2, 4), np.float32)])
    np.testing.assert_array_equal(y3, y2)
    loop.reset()
    y4, _ = loop([xw], [R, Rb, Wb], [np.zeros((1, 2, 4), np.float32)])
    np.testing.assert_array_equal(y4, y)


def test_scan_loop_backward_chunks_match_tract(tmp_path) -> None:
    """A backward scan (chunk -1) with a running-sum state, nnef-kv's loop vs tract 0.23.9."""
    from nnef_kv.interpreter.ops.tract_scan import ScanLoop, ScanSpec

    x = f32(5, 3)
    frag = """fragment body(acc: tensor<scalar>, xi: tensor<scalar>) -> (acc_out: tensor<scalar>, y: tensor<scalar>)
{
  acc_out = add(acc, xi);
  y = mul(acc_out, 2.0);
}
"""
    g = Graph({"x": x}, [
        "init = [[0.0, 0.0, 0.0]];",
        '(ys, last) = tract_core_scan(body = "body", scan = [("xi", x, 0, -1)], full = [], state = [("acc", init, "acc_out")],'
        ' output = [("y", "full", 0, -1), ("acc_out", "last", 0, 1)]);',
    ], ["ys", "last"], fragments=frag)
    want = tract_run(g.write(tmp_path / "scan"), [x])
    spec = ScanSpec(scan=(("xi", 0, -1),), state=(("acc", "acc_out"),), outputs=(("y", "full", 0, -1), ("acc_out", "last", 0, 1)))

    def body(v: dict) -> dict:
        acc = (v["acc"] + v["xi"]).astype(np.float32)
        return {"acc_out": acc, "y": (acc * np.float32(2.0)).astype(np.float32)}

    got = ScanLoop(spec, body)([x], [], [np.zeros((1, 3), np.float32)])
    for g_, w_ in zip(got, want):
        assert_close(g_, w_, what="scan backward")
