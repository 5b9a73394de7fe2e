"""nnef_kv.kernels: the numba kernels against their NumPy references (differential, hypothesis).

Every differential test runs twice through the ``mode`` fixture: with numba, and with the forced
fallback ``NNEF_KV_NO_NUMBA=1`` (then the public kernels run the references); both must agree with the
reference within the f32 summation-order bounds below. ``test_same_results_in_a_subprocess_without_numba``
checks the same thing across processes (the variable read at start-up, numba never imported).

Tolerances are derived, not loose constants: a dot product of ``n`` terms summed in another order
differs by at most ~``2 n eps sum |terms|`` (``eps = 2**-24``); the weight product's bound is
``4 K eps (|x| @ |W|.T)``; the attention's follows the error of the scores (``D eps max_t |q|.|k_t|``,
which moves the softmax weights by that relative amount) and of the value sums.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nnef_kv.tensors.blockquant import Q4_0_GGML, Q4_0_LEGACY, BlockQuantTensor
from conftest import requires_numba
from nnef_kv.kernels import NO_NUMBA_ENV, numba_available
from nnef_kv.kernels import blockquant as bq
from nnef_kv.kernels import gemv as gv
from nnef_kv.kv.kivi import kernels as ka
from nnef_kv.kv.kivi import KiviSdpa

REPO = Path(__file__).resolve().parents[2]
EPS = float(np.finfo(np.float32).eps) / 2  # unit roundoff 2**-24
HYP = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


# ===================================================================================== dispatch
def test_import_of_nnef_kv_and_the_kernel_modules_does_not_import_numba():
    code = ("import sys, nnef_kv, nnef_kv.kernels, nnef_kv.kernels.blockquant, nnef_kv.kernels.gemv, "
            "nnef_kv.kernels.attend, nnef_kv.kernels.rowwise, nnef_kv.interpreter.plan.patterns, "
            "nnef_kv.kv.kivi.kernels, "
            "nnef_kv.interpreter, nnef_kv.kv; print('numba' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_forced_fallback_runs_the_reference(monkeypatch):
    monkeypatch.setenv(NO_NUMBA_ENV, "1")
    assert not numba_available()
    rng = np.random.default_rng(0)
    p = bq.repack(BlockQuantTensor.quantize_q4_0(rng.standard_normal((40, 64)).astype(np.float32)))
    x = rng.standard_normal((3, 64)).astype(np.float32)
    assert np.array_equal(bq.matmul(p, x), bq.matmul.reference(p, x))  # bit for bit: the same function


@requires_numba
def test_f16_widening_is_exact_for_every_pattern():
    from numba import njit

    from nnef_kv.kernels._numba_common import h2f, half_bits_to_f32, widen

    @njit
    def conv(a, o1, o2, o3):
        for i in range(a.size):
            o1[i] = h2f(a[i])
            o2[i] = half_bits_to_f32(a[i])
            o3[i] = widen(a[i])

    a = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    outs = [np.empty(a.size, np.float32) for _ in range(3)]
    conv(a, *outs)
    ref = a.view(np.float16).astype(np.float32)
    nan = np.isnan(ref)
    assert np.array_equal(outs[0].view(np.uint32), ref.view(np.uint32))  # payloads included
    for o in outs[1:]:
        assert np.array_equal(o[~nan].view(np.uint32), ref[~nan].view(np.uint32)) and np.isnan(o[nan]).all()


@requires_numba
def test_wide_vector_hint_reaches_llvm():
    """On AVX-512 hosts the cores carry LLVM's "prefer-vector-width"="512" (a hint: same results up to
    the lane count of the reassociated sums); elsewhere nothing is added."""
    from numba import njit

    from nnef_kv.kernels._numba_common import WIDE, wide_vectors

    @njit
    def scale(a, out):
        wide_vectors()
        for i in range(a.size):
            out[i] = a[i] * np.float32(2)

    a = np.arange(64, dtype=np.float32)
    out = np.empty_like(a)
    scale(a, out)
    assert np.array_equal(out, 2 * a)
    assert ('"prefer-vector-width"="512"' in scale.inspect_llvm(scale.signatures[0])) == WIDE


# ================================================================================= weights
def _quantized(rng, n: int, k: int, fmt: str, scale: float = 1.0) -> BlockQuantTensor:
    w = (rng.standard_normal((n, k)) * scale).astype(np.float32)
    if fmt == "Q8_1":
        return BlockQuantTensor.quantize_q8_1(w)
    return BlockQuantTensor.quantize_q4_0(w, item_type=Q4_0_LEGACY if fmt == "Q4_0_legacy" else Q4_0_GGML)


FORMATS = st.sampled_from(["Q4_0", "Q4_0_legacy", "Q8_1"])


@HYP
@given(n=st.integers(1, 70), blocks=st.integers(1, 8), fmt=FORMATS, seed=st.integers(0, 2**31 - 1))
def test_repack_is_exact(n, blocks, fmt, seed):
    t = _quantized(np.random.default_rng(seed), n, 32 * blocks, fmt)
    p = bq.repack(t)
    assert p.n == n and p.k == 32 * blocks
    assert np.array_equal(bq.dequantize_t(p).view(np.uint32), t.dequantize().reshape(n, -1).T.view(np.uint32))
    assert p.bits_per_weight == (4.5 if fmt.startswith("Q4_0") else 8.5)


def _check_product(y: np.ndarray, x: np.ndarray, w: np.ndarray) -> None:
    """y against x @ w (w = W.T [K, N]): same NaN/Inf pattern, finite values within the bound."""
    with np.errstate(invalid="ignore", over="ignore"):
        ref = np.matmul(x.astype(np.float64), w.astype(np.float64))
        ref32 = np.matmul(x, w)
        bound = 4 * w.shape[0] * EPS * np.matmul(np.abs(x).astype(np.float64), np.abs(w).astype(np.float64))
    assert y.shape == ref32.shape and y.dtype == np.float32
    assert np.array_equal(np.isnan(y), np.isnan(ref32))
    inf = np.isinf(ref32)
    assert np.array_equal(y[inf], ref32[inf])
    fin = np.isfinite(ref32)
    assert np.all(np.abs(y[fin] - ref[fin]) <= bound[fin] + 1e-30)


@HYP
@given(m=st.integers(0, 24), n=st.integers(1, 70), blocks=st.integers(1, 6), fmt=FORMATS,
       vector=st.booleans(), special=st.lists(st.sampled_from([np.nan, np.inf, -np.inf, 0.0]), max_size=3),
       seed=st.integers(0, 2**31 - 1))
def test_matmul_matches_the_dequantized_product(mode, m, n, blocks, fmt, vector, special, seed):
    """Q4_0 / Q8_1 products (row kernels for M <= BLAS_ROWS, blocks + BLAS above) against the f32
    product with the dequantized weights; NaN / Inf / 0 placed in x."""
    rng = np.random.default_rng(seed)
    k = 32 * blocks
    t = _quantized(rng, n, k, fmt)
    p = bq.repack(t)
    x = rng.standard_normal(k if vector else (m, k)).astype(np.float32)
    flat = x.reshape(-1)
    for val in special if x.size else []:
        flat[rng.integers(0, x.size)] = val
    with np.errstate(invalid="ignore"):
        y = bq.matvec(p, x) if vector else bq.matmul(p, x)
    _check_product(y, x, bq.dequantize_t(p))


@pytest.mark.parametrize("fmt", ["Q4_0", "Q8_1"])
def test_matmul_rank3_input_and_both_row_paths(mode, fmt):
    rng = np.random.default_rng(3)
    p = bq.repack(_quantized(rng, 100, 96, fmt))
    for m in (1, 2, bq.BLAS_ROWS[fmt], bq.BLAS_ROWS[fmt] + 1, 40):
        x = rng.standard_normal((2, m, 96)).astype(np.float32)
        y = bq.matmul(p, x)
        assert y.shape == (2, m, 100)
        _check_product(y.reshape(-1, 100), x.reshape(-1, 96), bq.dequantize_t(p))


@requires_numba
@HYP
@given(n=st.sampled_from([1, 15, 16, 17, 63, 64, 65, 80, 1023, 1024, 1025, 1090, 4096]), blocks=st.integers(1, 8),
       special=st.lists(st.sampled_from([np.nan, np.inf, -np.inf, 0.0]), max_size=3),
       seed=st.integers(0, 2**31 - 1))
def test_one_row_core_against_the_reference(n, blocks, special, seed):
    """The one-row Q4_0 cores (``_q4_row_plain``, and ``_q4_row_lut`` where the host has AVX-512F: tiles of
    ROW_TILE outputs, a block summed in registers, the next block prefetched, across tiles too) against
    the dequantized product and the few-row core: N below, at and across the tile and the 16- and
    64-output groups (a multiple of 4096 too), K of 1-8 blocks, every byte value among the codes, NaN /
    Inf / 0 in x. The two one-row cores take the same products (``x[k] * (q - 8)``, computed or looked
    up) in the same summation tree: their results are equal bit for bit (NaN where NaN)."""
    from nnef_kv.kernels import _blockquant_jit as bj

    rng = np.random.default_rng(seed)
    k = 32 * blocks
    codes = rng.integers(0, 256, (k // 2, n), dtype=np.uint8)
    codes.reshape(-1)[: min(256, codes.size)] = np.arange(min(256, codes.size), dtype=np.uint8)
    scales = (rng.standard_normal((blocks, n)) * rng.choice([1e-3, 1.0, 1e3], (blocks, n))).astype(np.float16)
    p = bq.PackedWeights(format="Q4_0", shape=(n, k), codes=codes, scales=scales,
                         finite_scales=bool(np.isfinite(scales).all()))
    assert p.finite_scales
    x = rng.standard_normal(k).astype(np.float32)
    for val in special:
        x[rng.integers(0, k)] = val
    with np.errstate(invalid="ignore"):
        y = np.full(n, np.nan, np.float32)
        bj._q4_row_plain(codes, scales.view(np.uint16), x, y)
        _check_product(y, x, bq.dequantize_t(p))
        if bj.HAVE_PERMVAR:
            y2 = np.full(n, np.nan, np.float32)
            bj._q4_row_lut(codes, scales.view(np.uint16), x, y2)
            assert np.array_equal(y2, y, equal_nan=True)
        assert np.array_equal(bq.matvec.jit(p, x), y, equal_nan=True)  # the dispatch takes these cores
        two = np.empty((1, n), np.float32)
        bj._q4_rows(codes, scales.view(np.uint16), x[None], two)
        _check_product(two[0], x, bq.dequantize_t(p))


def test_non_finite_scales_take_the_reference_path(mode):
    """A block of huge values gets an f16 Inf scale (as in tract): factoring the scale out of a block
    would change which outputs are NaN, so such weights use the reference."""
    rng = np.random.default_rng(4)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    w[3, :32] *= 1e6
    t = BlockQuantTensor.quantize_q4_0(w)
    p = bq.repack(t)
    assert not p.finite_scales
    x = rng.standard_normal((2, 64)).astype(np.float32)
    with np.errstate(invalid="ignore"):
        assert np.array_equal(bq.matmul(p, x), bq.matmul.reference(p, x), equal_nan=True)


CASE = Path(__file__).resolve().parents[3] / "shared" / "conformance" / "tract-harness" / "q40_linear_followed_slice"


@pytest.mark.skipif(not (CASE / "io.npz").is_file(), reason=f"conformance case not found at {CASE}")
def test_orientation_on_a_tract_written_q4_0_linear(mode):
    """tract's own case (legacy nibble order, ``linear(input, W)`` then two slices multiplied): the
    kernel's ``x @ W.T`` reproduces tract's output, within what f32 rounding of the two engines allows.

    The bound is the f32 dot product's: each factor within ``n eps sum |x_i w_i|`` of the exact one (n = 96),
    on both sides. A relative tolerance is not one: output [7, 1] is the product of -17.63 (from terms whose
    magnitudes sum to 11,396) and -512.3, so tract's own f32 result is 1.5e-5 from the exact product, while the
    kernel's is 8e-7 (measured on an AMD EPYC; whether a given platform's rounding lands within 1e-5 of
    tract's is chance)."""
    from nnef_kv.tensors.dat import read_tensor

    t = read_tensor(CASE / "linear__var0_q4_0.dat")
    assert isinstance(t, BlockQuantTensor) and t.item_type == Q4_0_LEGACY
    io = np.load(CASE / "io.npz")
    x = io["input_0"]
    y = bq.matmul(bq.repack(t), x)
    w = t.dequantize().astype(np.float64)
    _check_product(y, x, t.dequantize().T)
    mag = np.abs(x.astype(np.float64)) @ np.abs(w.T)  # sum |x_i w_i| of every output
    gamma = x.shape[1] * float(np.finfo(np.float32).eps)
    a, b = y[:, :8].astype(np.float64), y[:, 8:16].astype(np.float64)
    bound = 2 * (np.abs(b) * gamma * mag[:, :8] + np.abs(a) * gamma * mag[:, 8:16]) + 4 * 2.0 ** -24 * np.abs(a * b)
    err = np.abs(a * b - io["output_0"].astype(np.float64))
    assert np.all(err <= bound), float(np.max(err / bound))
    assert float(np.max(err / np.abs(io["output_0"]))) < 1e-4  # and close in relative terms everywhere


def test_shape_errors():
    t = BlockQuantTensor.quantize_q4_0(np.ones((4, 64), np.float32))
    p = bq.repack(t)
    with pytest.raises(ValueError):
        bq.matmul(p, np.ones((2, 32), np.float32))
    with pytest.raises(ValueError):
        bq.matvec(p, np.ones((2, 64), np.float32))
    with pytest.raises(ValueError):  # blocks that span rows cannot be repacked as [N, K]
        bq.repack(BlockQuantTensor.quantize_q4_0(np.ones((4, 64), np.float32)).reshaped((16, 16)))


# ============================================================================ f32 few-row products
@HYP
@given(m=st.integers(1, gv.MAX_ROWS), n=st.integers(1, 90), k=st.integers(1, 300), f64=st.booleans(),
       special=st.lists(st.sampled_from([np.nan, np.inf, -np.inf, 0.0]), max_size=3),
       cut=st.integers(0, 90), seed=st.integers(0, 2**31 - 1))
def test_rows_by_t_matches_the_product(mode, m, n, k, f64, special, cut, seed):
    """``out[:, lo:hi] = a @ w[lo:hi].T`` within the dot-product bound (same NaN/Inf pattern); the columns
    outside lo:hi are left as they were; and with numba the split at any row gives the unsplit call's bits.
    No value near the float32 maximum among the inputs: whether a sum of such products overflows depends on
    the order it is summed in, which the kernel may choose (as the Q4_0 tests above)."""
    rng = np.random.default_rng(seed)
    dt = np.float64 if f64 else np.float32
    a = rng.standard_normal((m, k)).astype(dt)
    w = rng.standard_normal((n, k)).astype(dt)
    for val in special:
        a.reshape(-1)[rng.integers(0, a.size)] = val
    whole = np.full((m, n), 7.0, dt)
    with np.errstate(invalid="ignore", over="ignore"):
        gv.rows_by_t(a, w, whole, 0, n)
        h = min(cut, n)
        parts = np.full((m, n), 7.0, dt)
        gv.rows_by_t(a, w, parts, h, n)
        assert np.all(parts[:, :h] == 7.0)
        gv.rows_by_t(a, w, parts, 0, h)
    if mode == "numba":  # BLAS (the reference) may round a part of the product otherwise than the whole
        np.testing.assert_array_equal(parts, whole)
    if not f64:
        _check_product(whole, a, w.T)
    else:
        ref = a @ w.T
        assert np.array_equal(np.isnan(whole), np.isnan(ref))
        fin = np.isfinite(ref)
        bound = 4 * k * np.finfo(np.float64).eps * (np.abs(a) @ np.abs(w).T)
        assert np.all(np.abs(whole - ref)[fin] <= bound[fin] + 1e-300)


@requires_numba
def test_rows_by_t_bits_do_not_depend_on_the_rows_or_a_stacked_weight():
    """Each output is one dot product of its own: the same bits for a row alone or among four, and for a
    weight alone or stacked under another (a fused q/k/v projection)."""
    rng = np.random.default_rng(11)
    a = rng.standard_normal((4, 576)).astype(np.float32)
    w1, w2 = (rng.standard_normal((n, 576)).astype(np.float32) for n in (96, 40))
    stacked = np.concatenate([w1, w2])
    four, alone, fused = np.empty((4, 96), np.float32), np.empty((1, 96), np.float32), np.empty((4, 136), np.float32)
    gv.rows_by_t.jit(a, w1, four, 0, 96)
    gv.rows_by_t.jit(a[2:3], w1, alone, 0, 96)
    gv.rows_by_t.jit(a, stacked, fused, 0, 136)
    np.testing.assert_array_equal(alone[0], four[2])
    np.testing.assert_array_equal(fused[:, :96], four)
    with pytest.raises(ValueError, match="rows 0:97"):
        gv.rows_by_t.jit(a, w1, four, 0, 97)
    with pytest.raises(ValueError, match="shapes"):
        gv.rows_by_t.jit(a[:, :10], w1, four, 0, 96)


def test_gemv_usable_only_for_few_rows_by_a_transposed_contiguous_weight():
    w = np.ones((32, 16), np.float32)
    a = np.ones((2, 16), np.float32)
    assert gv.usable(a, w.T)
    assert not gv.usable(np.ones((gv.MAX_ROWS + 1, 16), np.float32), w.T)  # a prefill: BLAS
    assert not gv.usable(a, np.ascontiguousarray(w.T))  # an [in, out] array
    assert not gv.usable(a.astype(np.float16), w.T.astype(np.float16))
    assert not gv.usable(a.astype(np.float64), w.T)
    assert not gv.usable(np.ones((2, 32), np.float32)[:, ::2], w.T)  # a strided input


# ==================================================================================== KIVI
def _cache(rng, *, bits, kg, vg, d, hkv, t, sinks, residual, params, outlier=False) -> KiviSdpa:
    sd = KiviSdpa(scale=1 / np.sqrt(d), bits=bits, key_group=kg, value_group=vg, residual=residual,
                  sinks=sinks, params=params)
    k = (rng.standard_normal((1, hkv, t, d)) * rng.uniform(0.2, 3, size=(1, 1, 1, d))).astype(np.float32)
    v = rng.standard_normal((1, hkv, t, d)).astype(np.float32)
    if outlier and t:
        k[0, 0, t // 2, 0] = np.inf
    q = rng.standard_normal((1, hkv, 1, d)).astype(np.float32)
    if t:
        sd(q, k, v)
    return sd


def _attention_bound(sd: KiviSdpa, q: np.ndarray) -> float:
    """|out - ref| bound: score errors (D eps |q|.|k| relative to the softmax weights) times max|v|, plus
    the value sums' (T + D) eps max|v|, with the dequantized cache."""
    kf, vf = sd.dequantized()
    n, d = sd.b * sd.hkv, sd.d
    kf, vf = kf.reshape(n, -1, d), vf.reshape(n, -1, d)
    qs = np.abs(q.astype(np.float64)) * sd.cfg.scale
    ds = 4 * d * EPS * np.max(np.matmul(qs, np.abs(kf).swapaxes(-1, -2)))
    vmax = float(np.max(np.abs(vf))) if vf.size else 0.0
    return vmax * (4 * ds + 4 * (kf.shape[1] + d) * EPS) + 1e-30


KIVI_CASES = dict(
    bits=st.sampled_from([1, 2, 4, 8]), kg=st.sampled_from([8, 16, 32]), d=st.sampled_from([8, 16, 32, 64]),
    vg_div=st.sampled_from([1, 2, 4, 8]), hkv=st.integers(1, 3), group=st.integers(1, 4),
    t=st.integers(0, 140), sinks=st.integers(0, 3), residual=st.integers(0, 10),
    params=st.sampled_from(["f16", "f32"]), seed=st.integers(0, 2**31 - 1))


@HYP
@given(**KIVI_CASES, sq=st.integers(1, 3), q_special=st.sampled_from([None, np.nan, np.inf]))
def test_attend_matches_kivi_two_pass(mode, bits, kg, d, vg_div, hkv, group, t, sinks, residual, params, seed,
                                      sq, q_special):
    """The kernels' decode attention against ``KiviSdpa._attend_two_pass`` on the same cache: bits,
    key/value groups, GQA rows, sinks, window, f16/f32 params, causal rows (sq > 1), NaN/Inf in q."""
    rng = np.random.default_rng(seed)
    sd = _cache(rng, bits=bits, kg=kg, vg=max(1, d // vg_div), d=d, hkv=hkv, t=t + sq, sinks=sinks,
                residual=residual, params=params)
    n = hkv
    q = rng.standard_normal((n, group * sq, d)).astype(np.float32)
    if q_special is not None:
        q[rng.integers(0, n), rng.integers(0, group * sq), rng.integers(0, d)] = q_special
    assert ka.unsupported_reason(sd, q.shape[1]) is None
    with np.errstate(invalid="ignore", over="ignore"):
        ref = sd._attend_two_pass(q, sq, 0, n, 0, sd._current_view())
        got = ka.attend(sd, q, sq)
        alt = ka.decode_attention(q, **ka.cache_arrays(sd), sq=sq)
    assert got.shape == ref.shape == (n, group * sq, d) and got.dtype == np.float32
    for out in (got, alt):
        assert np.array_equal(np.isnan(out), np.isnan(ref))
        fin = np.isfinite(ref)
        assert np.array_equal(np.isfinite(out), fin)
        if q_special is None:
            assert np.all(np.abs(out[fin] - ref[fin]) <= _attention_bound(sd, q))


@HYP
@given(**KIVI_CASES)
def test_key_scores_and_value_sum_match_their_references(mode, bits, kg, d, vg_div, hkv, group, t, sinks,
                                                         residual, params, seed):
    """The two quantized halves on their own, written into a slice of a wider matrix (as in the
    attention) and on two threads."""
    rng = np.random.default_rng(seed)
    sd = _cache(rng, bits=bits, kg=kg, vg=max(1, d // vg_div), d=d, hkv=hkv, t=t + kg, sinks=sinks,
                residual=residual, params=params)
    a = ka.cache_arrays(sd)
    tq = sd.n_quant
    n, m = hkv, group
    q = rng.standard_normal((n, m, d)).astype(np.float32)
    wide = np.full((n, m, tq + 5), -7.0, np.float32)
    ks = ka.key_scores(q, a["k_codes"], a["k_min"], a["k_step"], bits, kg, out=wide[:, :, 2:2 + tq], threads=2)
    ref = ka.key_scores.reference(q, a["k_codes"], a["k_min"], a["k_step"], bits, kg)
    assert ks.base is not None and np.all(wide[:, :, :2] == -7) and np.all(wide[:, :, 2 + tq:] == -7)
    kf = sd.dequantized()[0].reshape(n, -1, d)[:, sd.n_sink:sd.n_sink + tq]
    bound = 4 * d * EPS * np.matmul(np.abs(q.astype(np.float64)), np.abs(kf).swapaxes(-1, -2)) + 1e-30
    assert np.all(np.abs(ks - ref) <= 2 * bound)
    p = rng.random((n, m, tq + 3)).astype(np.float32)[:, :, 1:1 + tq]
    vs = ka.value_sum(p, a["v_codes"], a["v_min"], a["v_step"], bits, kg, a["value_group"], threads=2)
    vref = ka.value_sum.reference(p, a["v_codes"], a["v_min"], a["v_step"], bits, kg, a["value_group"])
    vf = sd.dequantized()[1].reshape(n, -1, d)[:, sd.n_sink:sd.n_sink + tq]
    vbound = 4 * (tq + d) * EPS * np.matmul(p.astype(np.float64), np.abs(vf)) + 1e-30
    assert vs.shape == (n, m, d) and np.all(np.abs(vs - vref) <= vbound)


@requires_numba
def test_threads_and_prange_give_bit_identical_results(monkeypatch):
    """Heads are independent: splitting them over threads (pool or numba prange) changes nothing."""
    from nnef_kv.kv.kivi import _jit as kj

    monkeypatch.delenv(NO_NUMBA_ENV, raising=False)
    monkeypatch.setattr(kj, "SPLIT_WORK", 0)  # split however small the step
    rng = np.random.default_rng(7)
    sd = _cache(rng, bits=4, kg=32, vg=32, d=64, hkv=4, t=300, sinks=1, residual=8, params="f16")
    q = rng.standard_normal((4, 2, 64)).astype(np.float32)
    one = ka.attend(sd, q, 1, threads=1)
    for mode in ("pool", "prange"):
        monkeypatch.setattr(kj, "PARALLEL", mode)
        assert np.array_equal(ka.attend(sd, q, 1, threads=2), one)
        assert np.array_equal(ka.attend(sd, q, 1, threads=3), one)


@pytest.mark.parametrize("why", ["outliers", "bits3", "budget"])
def test_unsupported_caches_fall_back_to_kivi_itself(mode, why):
    """Outliers in the exact side table, the split layout (3 bits) and long chunks (score budget) are
    left to KiviSdpa's own path: the result is that path's, bit for bit."""
    rng = np.random.default_rng(8)
    sd = _cache(rng, bits=3 if why == "bits3" else 4, kg=8, vg=8, d=16, hkv=2, t=100, sinks=1, residual=4,
                params="f16", outlier=why == "outliers")
    if why == "budget":
        sd.score_budget = 16
    q = rng.standard_normal((2, 3, 16)).astype(np.float32)
    reason = ka.unsupported_reason(sd, 3)
    assert reason is not None and {"outliers": "outlier", "bits3": "layout", "budget": "budget"}[why] in reason
    with np.errstate(invalid="ignore"):
        assert np.array_equal(ka.attend(sd, q, 1), sd._attend(q, 1), equal_nan=True)


def test_kernel_argument_errors(mode):
    rng = np.random.default_rng(9)
    sd = _cache(rng, bits=4, kg=8, vg=8, d=16, hkv=2, t=40, sinks=0, residual=4, params="f16")
    a = ka.cache_arrays(sd)
    q = rng.standard_normal((2, 1, 16)).astype(np.float32)
    with pytest.raises(ValueError):  # 3-bit codes use the split layout
        ka.key_scores(q, a["k_codes"], a["k_min"], a["k_step"], 3, 8)
    if mode == "numba":
        with pytest.raises(ValueError):
            ka.key_scores(q, a["k_codes"], a["k_min"][:, :1], a["k_step"], 4, 8)


# ============================================================================== subprocess
_SCRIPT = r"""
import json, sys
import numpy as np
sys.path.insert(0, {repo!r})
from nnef_kv.tensors.blockquant import BlockQuantTensor
from nnef_kv.kernels import blockquant as bq, numba_available
from nnef_kv.kv.kivi import kernels as ka
from nnef_kv.kv.kivi import KiviSdpa
rng = np.random.default_rng(11)
p = bq.repack(BlockQuantTensor.quantize_q4_0(rng.standard_normal((48, 128)).astype(np.float32)))
x = rng.standard_normal((3, 128)).astype(np.float32)
sd = KiviSdpa(scale=0.25, bits=4, key_group=16, value_group=16, residual=8, sinks=1)
k, v = rng.standard_normal((2, 1, 2, 90, 32)).astype(np.float32)
sd(rng.standard_normal((1, 4, 1, 32)).astype(np.float32), k, v)
q = rng.standard_normal((2, 2, 32)).astype(np.float32)
print(json.dumps({{"numba": numba_available(), "mods": "numba" in sys.modules,
                  "y": bq.matmul(p, x).tolist(), "att": ka.attend(sd, q, 1).tolist()}}))
"""


@requires_numba
def test_same_results_in_a_subprocess_without_numba():
    """The same computations in two fresh processes, with numba and with NNEF_KV_NO_NUMBA=1 (which then
    never imports numba): equal up to f32 summation order."""
    res = {}
    for flag in ("0", "1"):
        env = dict(os.environ, **{NO_NUMBA_ENV: flag})
        out = subprocess.run([sys.executable, "-c", _SCRIPT.format(repo=str(REPO))], env=env, cwd=REPO,
                             capture_output=True, text=True, check=True)
        res[flag] = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["0"]["numba"] and not res["1"]["numba"] and not res["1"]["mods"]
    for key in ("y", "att"):
        a, b = np.array(res["0"][key]), np.array(res["1"][key])
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.abs(b).max()))


@requires_numba
@pytest.mark.parametrize("case", ["prefill", "inf-score", "nan-query", "masked-row"])
def test_pooled_heads_keep_the_one_thread_bits(monkeypatch, case):
    """The pool runs each head whole (scores, its softmax, values): a prefill chunk's causal mask, and rows
    whose max is not finite (then the reference's all-heads rule: recomputed on one thread), give the
    one-thread bits; so does a head with a +inf score beside a head with a NaN one."""
    from nnef_kv.kv.kivi import _jit as kj

    monkeypatch.delenv(NO_NUMBA_ENV, raising=False)
    monkeypatch.setattr(kj, "PARALLEL", "pool")
    monkeypatch.setattr(kj, "SPLIT_WORK", 0)  # split however small the step
    rng = np.random.default_rng(11)
    sd = _cache(rng, bits=4, kg=32, vg=32, d=64, hkv=4, t=300, sinks=1, residual=8, params="f16")
    sq = 3 if case == "prefill" else 1
    q = rng.standard_normal((4, 2 * sq, 64)).astype(np.float32)
    if case == "inf-score":
        q[1, 0, 3] = np.inf
        q[2, 0, 5] = np.nan
    elif case == "nan-query":
        q[0, 1, :] = np.nan
    elif case == "masked-row":
        q[3, 0, :] = -np.inf
        q[3, 0, 1] = np.inf
    one = ka.attend(sd, q, sq, threads=1)
    np.testing.assert_array_equal(ka.attend(sd, q, sq, threads=2), one)
    np.testing.assert_array_equal(ka.attend(sd, q, sq, threads=4), one)


@requires_numba
def test_exp_nonpositive_is_within_one_ulp():
    """The fused softmax's exp (numba cannot call NumPy's without the GIL): within 1 ulp of float64's exp
    on [-87, 0], exactly 1 at 0, 0 below -87 and at -Inf, NaN for NaN; a vectorised loop gives the same
    values as a scalar one."""
    from numba import njit

    from nnef_kv.kernels._numba_common import exp_nonpositive

    @njit(cache=False, error_model="numpy")
    def loop(x, out):
        for i in range(x.size):
            out[i] = exp_nonpositive(x[i])

    rng = np.random.default_rng(3)
    x = np.concatenate([np.linspace(-87, 0, 400_001, dtype=np.float32),
                        -np.abs(rng.standard_normal(200_000).astype(np.float32)) * 8,
                        -np.float32(2.0) ** -np.arange(1, 140, dtype=np.float32)]).astype(np.float32)
    got = np.empty_like(x)
    loop(x, got)
    ref = np.exp(x.astype(np.float64))
    ulp = np.abs(got - ref) / np.spacing(ref.astype(np.float32)).astype(np.float64)
    assert ulp.max() <= 1.0
    special = np.array([0.0, -0.0, -87.0001, -88, -1e4, -np.inf, np.nan], np.float32)
    out = np.empty_like(special)
    loop(special, out)
    assert out[0] == out[1] == 1 and np.all(out[2:6] == 0) and np.isnan(out[6])
    assert np.all([exp_nonpositive(np.float32(v)) == o for v, o in zip(x[::997], got[::997])])


@requires_numba
def test_fetch_add_hands_out_every_value_once_across_threads():
    """The atomic claim the decode threads share: two nogil loops drawing from one counter get every value
    below the end exactly once between them."""
    import threading

    from numba import njit

    from nnef_kv.kernels._numba_common import fetch_add

    @njit(nogil=True, cache=False)
    def draw(counter, end, seen):
        k = 0
        while True:
            v = fetch_add(counter)
            if v >= end:
                return k
            seen[v] += 1
            k += 1

    end = 400_000
    counter = np.zeros(1, np.int64)
    seen = [np.zeros(end, np.int64) for _ in range(2)]
    draw(np.zeros(1, np.int64), 0, seen[0])  # compile first
    ts = [threading.Thread(target=draw, args=(counter, end, s)) for s in seen]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert np.array_equal(seen[0] + seen[1], np.ones(end, np.int64))
    assert counter[0] == end + 2  # each loop drew one value past the end


@requires_numba
def test_fused_softmax_matches_numpy_softmax():
    """A kv head in one nogil call (scores, softmax with exp_nonpositive, outputs) against the same scores
    and outputs around NumPy's softmax. Bound: each weight within 1 + 2.4 ulp (the two exps; 8 eps
    relative, rounded up), the weights' sum within T eps (another order), so the outputs move by at most
    (2 * 8 + T) eps max|v|."""
    from nnef_kv.kv.kivi import _jit as kj

    rng = np.random.default_rng(12)
    for sq, params in ((1, "f16"), (3, "f32")):
        sd = _cache(rng, bits=4, kg=32, vg=32, d=64, hkv=3, t=400, sinks=2, residual=9, params=params)
        q = rng.standard_normal((3, 2 * sq, 64)).astype(np.float32) * 4
        a = ka.cache_arrays(sd)
        got = ka.decode_attention(q, **a, sq=sq)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(kj, "_fused_claim", lambda counter, n, *args: args[-1].fill(1))  # every head "bad"
            ref = ka.decode_attention(q, **a, sq=sq)
        vmax = float(np.abs(sd.dequantized()[1]).max())
        total = sd.n_sink + sd.n_quant + sd.n_res
        assert np.abs(got - ref).max() <= (16 + total) * EPS * vmax


@requires_numba
def test_a_helper_moves_off_the_calling_threads_cpu(monkeypatch):
    """The pool thread of a two-thread decode step keeps off the CPU its caller is on (where a woken helper
    otherwise tends to stay, leaving the caller waiting), with one affinity call per change of CPU."""
    from nnef_kv.kv.kivi import _jit as kj

    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(allowed) < 2 or kj._getcpu is None:
        pytest.skip("needs Linux and two CPUs")
    calls = []
    real = os.sched_setaffinity
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: (calls.append(set(cpus)), real(pid, cpus)))

    def in_pool(cpu):
        kj._avoid_cpu(cpu)
        kj._avoid_cpu(cpu)
        return os.sched_getaffinity(0)

    kj._pool(1).submit(lambda: setattr(kj._pinned, "avoid", None)).result()  # whatever earlier steps left
    try:
        for cpu in (allowed[0], allowed[1]):
            got = kj._pool(1).submit(in_pool, cpu).result()
            assert got == set(allowed) - {cpu}
        assert calls == [set(allowed) - {allowed[0]}, set(allowed) - {allowed[1]}]
    finally:
        kj._pool(1).submit(real, 0, set(allowed)).result()
        kj._pool(1).submit(lambda: setattr(kj._pinned, "avoid", None)).result()


@requires_numba
def test_a_small_step_stays_on_the_calling_thread(monkeypatch):
    """Below ``SPLIT_WORK`` a two-thread step wakes no helper (it would cost more than it saves), and gives
    the bits of the split step."""
    from nnef_kv.kv.kivi import _jit as kj

    monkeypatch.delenv(NO_NUMBA_ENV, raising=False)
    rng = np.random.default_rng(13)
    sd = _cache(rng, bits=4, kg=32, vg=32, d=64, hkv=4, t=300, sinks=1, residual=8, params="f16")
    q = rng.standard_normal((4, 2, 64)).astype(np.float32)
    monkeypatch.setattr(kj, "SPLIT_WORK", 0)
    split = ka.attend(sd, q, 1, threads=2)

    def no_pool(n):
        raise AssertionError("a helper was woken")

    monkeypatch.setattr(kj, "SPLIT_WORK", 4 * 2 * 64 * (sd.n_sink + sd.n_quant + sd.n_res) + 1)
    monkeypatch.setattr(kj, "_pool", no_pool)
    assert np.array_equal(ka.attend(sd, q, 1, threads=2), split)
    monkeypatch.setattr(kj, "SPLIT_WORK", 0)
    with pytest.raises(AssertionError, match="helper"):
        ka.attend(sd, q, 1, threads=2)
