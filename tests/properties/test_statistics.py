"""nnef_kv.validate.statistics: the block-bootstrap intervals cover the truth on synthetic correlated data
whose mean is known; blocks never cross a window; paired differences; which percentiles are supported."""
from __future__ import annotations

import math

import numpy as np
import pytest

from nnef_kv.validate.statistics import (block_labels, mean_interval, paired_interval, percentile_supported,
                                         t_quantile)


def _ar1(rng: np.random.Generator, windows: int, n: int, phi: float) -> np.ndarray:
    """``windows`` independent stationary AR(1) series of ``n`` values (unit innovations), one a row."""
    e = rng.standard_normal((windows, n))
    x = np.empty((windows, n))
    x[:, 0] = e[:, 0] / math.sqrt(1 - phi * phi)
    for i in range(1, n):
        x[:, i] = phi * x[:, i - 1] + e[:, i]
    return x


@pytest.mark.parametrize("phi,windows,n", [(0.0, 4, 512), (0.6, 4, 512), (0.8, 2, 512)])
def test_the_95_interval_covers_a_known_mean_of_skewed_correlated_values(phi, windows, n):
    """KL-like values: exp(x / 2) of a stationary AR(1) x (skewed, positive, neighbours correlated), so the
    mean is known: E exp(x / 2) = exp(var / 8) with var = 1 / (1 - phi^2). Over 300 draws the 95% interval
    covers it at least 90% of the time (an i.i.d. standard error covers it far less when phi = 0.8)."""
    rng = np.random.default_rng(7)
    truth = math.exp(1 / (1 - phi * phi) / 8)
    groups = np.repeat(np.arange(windows), n)
    hits = iid_hits = 0
    draws = 300
    for _ in range(draws):
        v = np.exp(_ar1(rng, windows, n, phi) / 2).reshape(-1)
        iv = mean_interval(v, groups, lower=0.0)
        assert iv is not None and iv.n == windows * n and iv.low <= iv.mean <= iv.high
        hits += iv.low <= truth <= iv.high
        se = v.std(ddof=1) / math.sqrt(v.size)
        iid_hits += abs(v.mean() - truth) <= 1.96 * se
    assert hits / draws >= 0.90, (hits, draws)
    if phi >= 0.8:
        assert iid_hits / draws < 0.8  # what the correlation does to an i.i.d. interval: why blocks are needed


def test_a_paired_difference_cancels_what_both_rows_share():
    """Two schemes on the same tokens: the text's difficulty (shared) is large, their difference small; the
    paired interval excludes zero where the two separate intervals overlap."""
    rng = np.random.default_rng(3)
    shared = np.exp(_ar1(rng, 4, 512, 0.7).reshape(-1))
    a = shared * 1.00 + 0.01 * rng.standard_normal(shared.size)
    b = shared * 1.02 + 0.01 * rng.standard_normal(shared.size)
    groups = np.repeat(np.arange(4), 512)
    ia, ib = mean_interval(a, groups), mean_interval(b, groups)
    assert ia.high > ib.low and ib.high > ia.low  # apart, the intervals overlap
    d = paired_interval(b, a, groups)
    assert d.low > 0 and d.excludes_zero()  # paired, b is worse beyond the noise
    same = paired_interval(a, a, groups)
    assert same.mean == 0 and same.low == 0 and same.high == 0 and not same.excludes_zero()
    nan = a.copy()
    nan[5] = np.nan
    assert paired_interval(nan, a, groups).n == a.size - 1  # a pair with a NaN side is left out


def test_blocks_never_cross_a_window_and_short_windows_give_four():
    g = np.repeat([0, 1, 2], [200, 64, 3])
    lab = block_labels(g, 32)
    for w in range(3):
        assert not set(lab[g == w]) & set(lab[g != w])
    assert len(set(lab[g == 0])) == 7  # 200 values in blocks of 32
    assert len(set(lab[g == 1])) == 4  # 64 < 4 x 32: four blocks of 16
    assert len(set(lab[g == 2])) == 3  # three values: one a block
    assert list(lab) == sorted(lab)


def test_one_block_gives_an_unbounded_interval_and_nothing_gives_none():
    iv = mean_interval([1.0, 2.0], [0, 0], block=32)
    assert iv.blocks == 2  # a short window is cut into single values
    one = mean_interval([1.0], [0])
    assert one.blocks == 1 and one.low == -math.inf and one.high == math.inf and math.isnan(one.se)
    assert mean_interval([0.5], [0], lower=0.0, upper=1.0).pair == [0.0, 1.0]
    assert mean_interval([], []) is None


def test_percentiles_need_values_beyond_them():
    assert not percentile_supported(99.0, 64) and not percentile_supported(99.9, 2048)
    assert percentile_supported(99.0, 500) and percentile_supported(90.0, 64) and percentile_supported(50.0, 10)
    assert not percentile_supported(99.0, 499)


def test_t_quantile():
    assert t_quantile(1) == pytest.approx(12.706, rel=1e-3)
    assert t_quantile(10) == pytest.approx(2.228, rel=1e-3)
    assert t_quantile(1000) == pytest.approx(1.962, rel=1e-3)
    assert t_quantile(0) == math.inf
