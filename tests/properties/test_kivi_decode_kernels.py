"""KiviSdpa's calls on the numba decode kernels (kv/kivi/attend.py ``_attend``): used when the cache is
long enough and the kernels apply, within the kernels' rounding bound of the NumPy path, the same state
left behind, bit-identical on one and two threads; the NumPy path otherwise (outliers, softcap, short
caches, numba off), and stepwise runs unchanged."""
from __future__ import annotations

import numpy as np
import pytest

from nnef_kv.kernels import NO_NUMBA_ENV, numba_available
from nnef_kv.kv import KiviSdpa
from test_kernels import _attention_bound

pytestmark = pytest.mark.skipif(not numba_available(), reason="numba is not installed")

HKV, D = 8, 64


def _qkv(rng, s: int, hq: int = HKV):
    q = rng.standard_normal((1, hq, s, D)).astype(np.float32)
    k = (rng.standard_normal((1, HKV, s, D)) * rng.uniform(0.3, 3, size=(1, 1, 1, D))).astype(np.float32)
    v = rng.standard_normal((1, HKV, s, D)).astype(np.float32)
    return q, k, v


def _call(op, monkeypatch, numba: bool, *x):
    if numba:
        monkeypatch.delenv(NO_NUMBA_ENV, raising=False)
    else:
        monkeypatch.setenv(NO_NUMBA_ENV, "1")
    return op(*x)


@pytest.mark.parametrize("bits,value_group", [(4, 32), (2, 64), (8, 32), (1, 16)])
@pytest.mark.parametrize("group", [1, 4])
def test_decode_calls_on_the_kernels_match_the_numpy_path(monkeypatch, bits: int, value_group: int, group: int) -> None:
    rng = np.random.default_rng(bits * 10 + group)
    kw = dict(scale=D ** -0.5, bits=bits, key_group=32, value_group=value_group, residual=32)
    a, b = KiviSdpa(**kw), KiviSdpa(**kw)
    x = _qkv(rng, 400, HKV * group)
    for op in (a, b):
        op(*x)
    assert a._on_kernels(group, a._current_view())
    for _ in range(40):
        x = _qkv(rng, 1, HKV * group)
        got = _call(a, monkeypatch, True, *x)
        want = _call(b, monkeypatch, False, *x)
        bound = _attention_bound(a, x[0].reshape(HKV, group, D))
        assert np.all(np.abs(got - want) <= bound), float(np.abs(got - want).max())
    sa, sb = a.state_tensors(), b.state_tensors()
    for name in sa:
        np.testing.assert_array_equal(sa[name], sb[name], err_msg=name)


def test_prefill_chunk_over_a_long_cache_on_the_kernels(monkeypatch) -> None:
    """A multi-token call (causal rows) over a long quantized cache: within the bound of the NumPy path."""
    rng = np.random.default_rng(3)
    kw = dict(scale=D ** -0.5, bits=4, key_group=32, value_group=32, residual=32)
    a, b = KiviSdpa(**kw), KiviSdpa(**kw)
    x = _qkv(rng, 600)
    for op in (a, b):
        op(*x)
    x = _qkv(rng, 5)
    got, want = _call(a, monkeypatch, True, *x), _call(b, monkeypatch, False, *x)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_two_threads_give_the_one_thread_bits_on_the_kernels(monkeypatch) -> None:
    rng = np.random.default_rng(4)
    kw = dict(scale=D ** -0.5, bits=4, key_group=32, value_group=32, residual=32)
    a, b = KiviSdpa(threads=1, **kw), KiviSdpa(threads=2, **kw)
    x = _qkv(rng, 700)
    for op in (a, b):
        op(*x)
    monkeypatch.delenv(NO_NUMBA_ENV, raising=False)
    from nnef_kv.kv.kivi import _jit as kj

    monkeypatch.setattr(kj, "SPLIT_WORK", 0)  # split however small the step
    for _ in range(5):
        x = _qkv(rng, 1)
        np.testing.assert_array_equal(a(*x), b(*x))


@pytest.mark.parametrize("why", ["outlier", "softcap", "short"])
def test_numpy_path_where_the_kernels_do_not_apply(monkeypatch, why: str) -> None:
    """Outliers in the side table, a softcap, a short cache: the call is the NumPy path's, bit for bit."""
    rng = np.random.default_rng(5)
    kw = dict(scale=D ** -0.5, bits=4, key_group=32, value_group=32, residual=32,
              softcap=30.0 if why == "softcap" else 0.0)
    a, b = KiviSdpa(**kw), KiviSdpa(**kw)
    x = _qkv(rng, 60 if why == "short" else 400)
    if why == "outlier":
        x[1][0, 2, 7, 5] = np.nan
        x[2][0, 1, 9, 0] = np.inf
    for op in (a, b):
        op(*x)
    assert not a._on_kernels(1, a._current_view())
    for _ in range(3):
        x = _qkv(rng, 1)
        with np.errstate(invalid="ignore"):
            np.testing.assert_array_equal(_call(a, monkeypatch, True, *x), _call(b, monkeypatch, False, *x))


def test_stepwise_chunks_are_unchanged_by_the_kernels(monkeypatch) -> None:
    rng = np.random.default_rng(6)
    kw = dict(scale=D ** -0.5, bits=4, key_group=32, value_group=32, residual=32)
    a, b = KiviSdpa(**kw), KiviSdpa(**kw)
    x = _qkv(rng, 500)
    for op in (a, b):
        op(*x)
    x = _qkv(rng, 40)
    monkeypatch.delenv(NO_NUMBA_ENV, raising=False)
    got = a.stepwise(*x)
    monkeypatch.setenv(NO_NUMBA_ENV, "1")
    np.testing.assert_array_equal(got, b.stepwise(*x))


def test_equal_key_and_value_bits_are_that_width_on_the_kernels() -> None:
    """``bits=8, key_bits=value_bits=4`` is not a variant (same widths, per-channel keys): the kernels must
    read its codes as 4-bit ones, bit for bit what ``bits=4`` gives."""
    rng = np.random.default_rng(7)
    kw = dict(scale=D ** -0.5, key_group=32, value_group=32, residual=32)
    a, b = KiviSdpa(bits=4, **kw), KiviSdpa(bits=8, key_bits=4, value_bits=4, **kw)
    assert not b.cfg.variant
    q, k, v = _qkv(rng, 300)
    np.testing.assert_array_equal(a(q, k, v), b(q, k, v))
    for t in range(40):
        q, k, v = _qkv(rng, 1)
        np.testing.assert_array_equal(a(q, k, v), b(q, k, v))
    assert a.nbytes() == b.nbytes()
