"""The decoder-block kernels beside their NumPy references: the exact f32 attention of a few query rows and a
prefill block's softmax (nnef_kv/kernels/attend.py: within their error bounds of float64, as the references
are), SwiGLU's gate (nnef_kv/kernels/gate.py: likewise), the RMS norm and rotate-half RoPE rows
(nnef_kv/kernels/rowwise.py: NumPy's bits), with the numba side and the forced fallback (the ``mode`` fixture
of tests/conftest.py); argument errors; what :meth:`Kernel.hot` hands a plan's step."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import HAVE_NUMBA, requires_numba
from nnef_kv.kernels import NO_NUMBA_ENV
from nnef_kv.kernels import attend as at
from nnef_kv.kernels import gate as gt
from nnef_kv.kernels import rowwise as rw

HYP = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


# ====================================================================================== attention
def _within_bound(out, q, k, v, mask, g, scale):
    ex = at.exact(q, k, v, mask, g, scale)
    bound = at.error_bound(q, k, v, mask, g, scale)
    fin = np.isfinite(ex)
    assert np.all(np.abs(out - ex)[fin] <= bound[fin]), np.max((np.abs(out - ex) / bound)[fin])
    return ex


MASKS = st.sampled_from(["none", "row", "full", "head", "causal-ish"])


@HYP
@given(b=st.integers(1, 2), hkv=st.integers(1, 3), g=st.integers(1, 4), m=st.integers(1, at.MAX_ROWS),
       t=st.sampled_from([1, 2, 7, 16, 33, 70, 300]), d=st.sampled_from([1, 8, 17, 64]), dv=st.sampled_from([0, 5]),
       mask=MASKS, scaled=st.booleans(), strided=st.booleans(), big=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_attend_rows_is_within_its_bound_of_the_exact_attention(mode, b, hkv, g, m, t, d, dv, mask, scaled, strided,
                                                                big, seed):
    """Either side, within :func:`error_bound` of the float64 attention; K/V read in place from a larger cache
    buffer (the plan's growing caches), masks of every broadcast shape with -inf entries, large scores."""
    rng = np.random.default_rng(seed)
    dv = dv or d
    q = rng.standard_normal((b, hkv * g, m, d)).astype(np.float32) * (30 if big else 1)
    kb = rng.standard_normal((b, hkv, t + (5 if strided else 0), d)).astype(np.float32)
    vb = rng.standard_normal((b, hkv, t + (5 if strided else 0), dv)).astype(np.float32)
    k, v = kb[:, :, :t], vb[:, :, :t]
    shape = {"none": None, "row": (1, 1, 1, t), "full": (b, hkv * g, m, t), "head": (1, hkv * g, 1, t),
             "causal-ish": (1, 1, m, t)}[mask]
    mk = None
    if shape is not None:
        mk = np.where(rng.random(shape) < 0.3, -np.inf, rng.standard_normal(shape)).astype(np.float32)
        mk[..., 0] = 0.0  # every row keeps a key
    scale = np.float32(1 / np.sqrt(d)) if scaled else None
    out = np.full((b, hkv * g, m, dv), 7.0, np.float32)
    at.attend_rows(q, k, v, mk, g, scale, out)
    ex = _within_bound(out, q, k, v, mk, g, scale)
    assert np.all(np.isfinite(ex))
    ref = np.empty_like(out)
    at.attend_rows.reference(q, k, v, mk, g, scale, ref)
    _within_bound(ref, q, k, v, mk, g, scale)


@pytest.mark.parametrize("case", ["masked-row", "nan-query", "inf-key", "nan-value"])
def test_attend_rows_non_finite_rows_match_the_reference(mode, case):
    """A fully masked row, a NaN query, an infinite key, a NaN value: the NaN pattern of the NumPy calls."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 4, 2, 8)).astype(np.float32)
    k = rng.standard_normal((1, 2, 6, 8)).astype(np.float32)
    v = rng.standard_normal((1, 2, 6, 8)).astype(np.float32)
    mk = np.zeros((1, 1, 2, 6), np.float32)
    if case == "masked-row":
        mk[0, 0, 1] = -np.inf
    elif case == "nan-query":
        q[0, 1, 0, 3] = np.nan
    elif case == "inf-key":
        k[0, 1, 2, 0] = np.inf
    else:
        v[0, 0, 4, 5] = np.nan
    out, ref = np.empty((1, 4, 2, 8), np.float32), np.empty((1, 4, 2, 8), np.float32)
    at.attend_rows(q, k, v, mk, 2, np.float32(0.5), out)
    at.attend_rows.reference(q, k, v, mk, 2, np.float32(0.5), ref)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    assert np.isnan(ref).any()
    fin = np.isfinite(ref)
    np.testing.assert_allclose(out[fin], ref[fin], rtol=1e-5, atol=1e-6)


def test_attend_rows_argument_errors(mode):
    q = np.zeros((1, 4, 1, 8), np.float32)
    k = np.zeros((1, 2, 5, 8), np.float32)
    out = np.zeros((1, 4, 1, 8), np.float32)
    with pytest.raises(ValueError, match="query heads a kv head"):
        at.attend_rows(q, k, k, None, 3, None, out)
    with pytest.raises(ValueError, match="4-D float32"):
        at.attend_rows(q.astype(np.float64), k, k, None, 2, None, out)
    with pytest.raises(ValueError, match="out must be"):
        at.attend_rows(q, k, k, None, 2, None, out[:, :2])
    with pytest.raises(ValueError, match="does not broadcast"):
        at.attend_rows(q, k, k, np.zeros((1, 1, 1, 4), np.float32), 2, None, out)
    with pytest.raises(ValueError, match="scale"):
        at.attend_rows(q, k, k, None, 2, 0.5, out)


@requires_numba
def test_attend_rows_copies_a_cache_with_a_strided_last_axis(monkeypatch):
    monkeypatch.delenv(NO_NUMBA_ENV, raising=False)
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 2, 1, 8)).astype(np.float32)
    kv = rng.standard_normal((1, 2, 9, 16)).astype(np.float32)[..., ::2]  # last axis of stride 2
    out = np.empty((1, 2, 1, 8), np.float32)
    at.attend_rows.jit(q, kv, kv, None, 1, None, out)
    _within_bound(out, q, kv, kv, None, 1, None)


# ====================================================================================== a prefill block's softmax
def _shifted(s, mask, scale):
    """The scores both sides exponentiate: ``s * scale + mask - rowmax`` in float32, as NumPy's calls round them."""
    x = s.copy()
    if scale is not None:
        x = x * scale
    if mask is not None:
        x = x + mask
    with np.errstate(invalid="ignore"):
        return x - np.max(x, axis=3, keepdims=True)


@HYP
@given(b=st.integers(1, 2), h=st.integers(1, 4), m=st.integers(1, 40), t=st.sampled_from([1, 2, 15, 16, 17, 33, 300]),
       mask=st.sampled_from(["none", "row", "full", "head", "causal", "strided", "key-broadcast"]),
       scaled=st.booleans(), big=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_softmax_rows_is_within_its_bound(mode, b, h, m, t, mask, scaled, big, seed):
    """Either side, within :func:`softmax_bound` of the float64 softmax of the same shifted scores: masks of every
    broadcast shape (a view of a larger mask, the way a prefill's blocks read the graph's mask, included), -inf
    and -3.4e38 entries, large scores."""
    rng = np.random.default_rng(seed)
    s0 = (rng.standard_normal((b, h, m, t)) * (40 if big else 3)).astype(np.float32)
    mk = None
    if mask == "causal" or mask == "strided":
        hide = np.arange(t)[None, :] > np.arange(m)[:, None] + (t - m)
        full = np.where(hide, np.float32(-3.4e38 if mask == "causal" else -np.inf), np.float32(0))
        if mask == "strided":
            big_mask = np.zeros((m + 3, t + 7), np.float32)
            big_mask[1:m + 1, 2:t + 2] = full
            full = big_mask[1:m + 1, 2:t + 2]
        mk = full[None, None]
    elif mask != "none":
        shape = {"row": (1, 1, 1, t), "full": (b, h, m, t), "head": (1, h, 1, t), "key-broadcast": (b, 1, m, 1)}[mask]
        mk = np.where(rng.random(shape) < 0.3, -np.inf, rng.standard_normal(shape)).astype(np.float32)
        mk[..., 0] = 0.0
    scale = np.float32(0.125) if scaled else None
    for side in (at.softmax_rows, at.softmax_rows.reference):
        s = s0.copy()
        side(s, mk, scale)
        p, bound = at.softmax_bound(_shifted(s0, mk, scale))
        fin = np.isfinite(p)
        assert np.all(np.abs(s - p)[fin] <= bound[fin]), np.max((np.abs(s - p) / bound)[fin])
        np.testing.assert_array_equal(np.isnan(s), np.isnan(p))


@pytest.mark.parametrize("case", ["masked-row", "nan-score", "inf-score", "all-nan"])
def test_softmax_rows_non_finite_rows_match_the_reference(mode, case):
    """A fully masked row, a NaN score, an infinite score, a row of NaN: the NaN pattern of NumPy's calls."""
    s0 = np.random.default_rng(4).standard_normal((1, 2, 3, 20)).astype(np.float32)
    mk = np.zeros((1, 1, 3, 20), np.float32)
    if case == "masked-row":
        mk[0, 0, 1] = -np.inf
    elif case == "nan-score":
        s0[0, 1, 0, 7] = np.nan
    elif case == "inf-score":
        s0[0, 0, 2, 19] = np.inf
    else:
        s0[0, 1, 1] = np.nan
    got, ref = s0.copy(), s0.copy()
    with np.errstate(invalid="ignore"):
        at.softmax_rows(got, mk, np.float32(0.5))
        at.softmax_rows.reference(ref, mk, np.float32(0.5))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    assert np.isnan(ref).any()
    fin = np.isfinite(ref)
    np.testing.assert_allclose(got[fin], ref[fin], rtol=1e-5, atol=1e-7)


def test_softmax_rows_argument_errors(mode):
    s = np.zeros((1, 2, 3, 4), np.float32)
    with pytest.raises(ValueError, match="C-contiguous 4-D float32"):
        at.softmax_rows(s[..., ::2], None, None)
    with pytest.raises(ValueError, match="C-contiguous 4-D float32"):
        at.softmax_rows(s.astype(np.float64), None, None)
    with pytest.raises(ValueError, match="broadcasting"):
        at.softmax_rows(s, np.zeros((1, 1, 2, 4), np.float32), None)
    with pytest.raises(ValueError, match="scale"):
        at.softmax_rows(s, None, 0.5)


# ====================================================================================== SwiGLU's gate
@HYP
@given(r=st.integers(1, 6), n=st.sampled_from([1, 2, 15, 16, 17, 64, 300]), strided=st.booleans(),
       spread=st.sampled_from([1.0, 8.0, 60.0]), seed=st.integers(0, 2**31 - 1))
def test_silu_gate_is_within_its_bound(mode, r, n, strided, spread, seed):
    """Either side, within :func:`error_bound` of the float64 gate; ``g`` and ``u`` as the two halves of one
    stacked product (rows of stride ``2N``) or contiguous; values up to where ``exp(-g)`` overflows."""
    rng = np.random.default_rng(seed)
    gu = (rng.standard_normal((r, 2 * n)) * spread).astype(np.float32)
    g, u = (gu[:, :n], gu[:, n:]) if strided else (np.ascontiguousarray(gu[:, :n]), np.ascontiguousarray(gu[:, n:]))
    ex, bound = gt.exact(g, u), gt.error_bound(g, u)
    for side in (gt.silu_gate, gt.silu_gate.reference):
        out = np.full((r, n), 7.0, np.float32)
        with np.errstate(over="ignore"):
            side(g, u, out)
        assert np.all(np.abs(out - ex) <= bound), np.max(np.abs(out - ex) / bound)


def test_silu_gate_special_values(mode):
    """NaN, +-Inf, +-0, values where ``exp(-g)`` overflows or the sigmoid is subnormal, the float32 extremes: NaN
    where the reference gives NaN, Inf where it gives Inf, within the bound elsewhere."""
    g = np.array([[np.nan, np.inf, -np.inf, 0.0, -0.0, 100, -100, -88, -87.5, -86.9, 88, 1e-30, -1e-30, 3.4e38,
                   -3.4e38, 1, -1, 20, -20]], np.float32)
    u = np.array([[1.5, 2.0, 2.0, 3.0, 3.0, -1.0, 1.0, 1.5, 1.5, 1.5, 1.0, 1.0, 1.0, 1.5, 1.5, 0.5, 0.5, 2.0, 2.0]],
                 np.float32)
    got, ref = np.empty_like(g), np.empty_like(g)
    with np.errstate(over="ignore", invalid="ignore"):
        gt.silu_gate(g, u, got)
        gt.silu_gate.reference(g, u, ref)
        ex, bound = gt.exact(g, u), gt.error_bound(g, u)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(ref))
    fin = np.abs(ex) <= np.finfo(np.float32).max  # 3.4e38 * 1.5 overflows float32 on both sides
    assert np.all(np.abs(got - ex)[fin] <= bound[fin]) and np.all(np.abs(ref - ex)[fin] <= bound[fin])


def test_silu_gate_argument_errors(mode):
    g = np.zeros((2, 4), np.float32)
    with pytest.raises(ValueError, match="2-D float32"):
        gt.silu_gate(g.astype(np.float64), g, g.copy())
    with pytest.raises(ValueError, match="one shape"):
        gt.silu_gate(g, g[:1], g.copy())
    with pytest.raises(ValueError, match="one shape"):
        gt.silu_gate(g, g, np.zeros((4, 2), np.float32).T)


@requires_numba
def test_silu_gate_copies_rows_it_cannot_read_in_place(monkeypatch):
    monkeypatch.delenv(NO_NUMBA_ENV, raising=False)
    rng = np.random.default_rng(6)
    g = rng.standard_normal((3, 16)).astype(np.float32)[:, ::2]  # last axis of stride 2
    u = rng.standard_normal((3, 8)).astype(np.float32)
    out = np.empty((3, 8), np.float32)
    gt.silu_gate.jit(g, u, out)
    assert np.all(np.abs(out - gt.exact(g, u)) <= gt.error_bound(g, u))


def test_hot_hands_out_none_the_kernel_then_its_core(monkeypatch):
    monkeypatch.setenv(NO_NUMBA_ENV, "1")
    assert at.attend_rows.hot() is None and rw.rms_rows.hot() is None
    if not HAVE_NUMBA:
        return
    monkeypatch.delenv(NO_NUMBA_ENV)
    x = np.ones((1, 8), np.float32)
    if not rw.rms_rows._called:
        assert rw.rms_rows.hot() is rw.rms_rows
        rw.rms_rows(x, np.float32(1e-6), None, np.empty_like(x))
    core = rw.rms_rows.hot()
    from nnef_kv.kernels import _rowwise_jit

    assert core is _rowwise_jit.rms_core


# ====================================================================================== rowwise
# lengths around NumPy's pairwise-sum boundaries: < 8, blocks of 8, 128, halves rounded to multiples of 8
LENGTHS = [1, 2, 7, 8, 9, 15, 16, 17, 63, 64, 127, 128, 129, 130, 136, 255, 256, 257, 264, 576, 960, 1000, 2048,
           2049, 4097]


@pytest.mark.parametrize("n", LENGTHS)
def test_rms_rows_gives_numpys_bits(mode, n):
    rng = np.random.default_rng(n)
    for rows in (1, 3):
        for scale in (1.0, 1e-3, 1e3, 1e19, 1e-30):
            x = (rng.standard_normal((rows, n)) * scale).astype(np.float32)
            w = rng.standard_normal(n).astype(np.float32)
            for weight, eps in ((w, np.float32(1e-5)), (None, np.float32(1e-6)), (w, np.float32(0))):
                got, ref = np.empty_like(x), np.empty_like(x)
                with np.errstate(all="ignore"):
                    rw.rms_rows(x, eps, weight, got)
                    rw.rms_rows.reference(x, eps, weight, ref)
                np.testing.assert_array_equal(got, ref, err_msg=f"n={n} rows={rows} scale={scale}")


@requires_numba
@HYP
@given(n=st.sampled_from(LENGTHS), special=st.lists(st.tuples(st.integers(0, 10**6),
                                                              st.sampled_from([np.nan, np.inf, -np.inf, 0.0, 3e38])),
                                                    max_size=3), seed=st.integers(0, 2**31 - 1))
def test_rms_rows_special_values(n, special, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, n)).astype(np.float32)
    for i, val in special:
        x.reshape(-1)[i % x.size] = val
    got, ref = np.empty_like(x), np.empty_like(x)
    with np.errstate(all="ignore"):
        rw.rms_rows.jit(x, np.float32(1e-6), None, got)
        rw.rms_rows.reference(x, np.float32(1e-6), None, ref)
    np.testing.assert_array_equal(got, ref)


@HYP
@given(shape=st.sampled_from([(1, 9, 1, 64), (2, 3, 5, 8), (1, 4, 7, 2), (1, 2, 3, 130)]),
       cs=st.sampled_from(["row", "full", "one", "heads"]), transposed=st.booleans(),
       special=st.lists(st.sampled_from([np.nan, np.inf, -np.inf, 3e38]), max_size=2), seed=st.integers(0, 2**31 - 1))
def test_rope_half_gives_numpys_bits(mode, shape, cs, transposed, special, seed):
    """Broadcast cos/sin, a transposed view as input (what a ``[B, S, H, D] -> [B, H, S, D]`` transpose gives),
    large and non-finite values: the NumPy calls' bits."""
    rng = np.random.default_rng(seed)
    b, h, s, d = shape
    x = (rng.standard_normal((b, s, h, d)) * 100).astype(np.float32).transpose(0, 2, 1, 3) if transposed else \
        (rng.standard_normal(shape) * 100).astype(np.float32)
    for i, val in enumerate(special):
        x[0, 0, 0, i] = val
    cshape = {"row": (1, 1, s, d), "full": shape, "one": (1, 1, 1, 1), "heads": (1, h, 1, d)}[cs]
    cos = rng.standard_normal(cshape).astype(np.float32)
    sin = rng.standard_normal(cshape).astype(np.float32)
    got, ref = np.empty_like(x), np.empty_like(x)
    with np.errstate(all="ignore"):
        rw.rope_half(x, cos, sin, got)
        rw.rope_half.reference(x, cos, sin, ref)
    np.testing.assert_array_equal(got, ref)


def test_rowwise_argument_errors(mode):
    x = np.zeros((2, 8), np.float32)
    with pytest.raises(ValueError, match="rms_rows: x"):
        rw.rms_rows(x[None], np.float32(0), None, x)
    with pytest.raises(ValueError, match="eps"):
        rw.rms_rows(x, 1e-6, None, x)
    with pytest.raises(ValueError, match="weight"):
        rw.rms_rows(x, np.float32(0), np.ones(7, np.float32), x)
    y = np.zeros((1, 2, 3, 4), np.float32)
    with pytest.raises(ValueError, match="does not broadcast"):
        rw.rope_half(y, np.zeros((1, 1, 2, 4), np.float32), y, y)
    with pytest.raises(ValueError, match="even last axis"):
        rw.rope_half(y[..., :3], y[..., :3], y[..., :3], np.zeros((1, 2, 3, 3), np.float32))


def test_a_check_runs_no_decode_kernel_and_maps_no_numba():
    """``inspect``'s check (a plan with unprepared weights) runs a one-token call through the fused attention,
    RMS norm and RoPE: it takes their NumPy forms, so checking a model does not import numba (and LLVM)."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys; from nnef_kv.models import DecoderConfig, build_decoder; "
            "from nnef_kv.interpreter.check import check_model; "
            "m = build_decoder(DecoderConfig(cache='explicit', vocab=32, hidden=32, heads=4, kv_heads=2, head_dim=8, "
            "mlp=64)); r = check_model(m); print(r.ok if hasattr(r, 'ok') else True, 'numba' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                         text=True, check=True)
    assert out.stdout.split()[-1] == "False", out.stdout
