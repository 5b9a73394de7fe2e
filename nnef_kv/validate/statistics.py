"""Uncertainty of validation figures: intervals that respect the correlation of neighbouring tokens.

Every figure validation reports is a mean over predictions (KL, same top-1, the log ppl ratio, attention
deviation). Neighbouring predictions are not independent (the same text, the same cache contents), so an
i.i.d. standard error is too small. The predictions are cut into **blocks** of consecutive tokens that never
cross a window of text (:data:`BLOCK` tokens, fewer in short windows so that each window gives several);
a **block bootstrap** (whole blocks drawn with replacement, :data:`REPLICATES` times, a fixed seed: the same
figures give the same interval) estimates the standard error of the mean, and the interval is
``mean +- t(blocks - 1, 0.975) x se`` (a Student-t quantile: with few blocks the interval widens instead of
covering less). ``tests/properties/test_statistics.py`` checks the coverage on synthetic correlated data whose mean is
known. A *paired* difference (two schemes on the same tokens) is the same interval on the per-token
difference: the text's difficulty, shared by both, cancels.

Percentiles of the per-token KL are reported only when enough predictions lie beyond them
(:func:`percentile_supported`: at least :data:`TAIL_COUNT` values above the percentile: p99 needs 500)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np

__all__ = ["BLOCK", "REPLICATES", "TAIL_COUNT", "Interval", "block_labels", "mean_interval", "paired_interval",
           "percentile_supported", "t_quantile"]

BLOCK = 32  # tokens per bootstrap block (fewer when a window holds fewer than 4 x this)
REPLICATES = 2000
TAIL_COUNT = 5  # values beyond a percentile needed to report it
SEED = 20260422


@dataclass(frozen=True)
class Interval:
    """A mean over ``n`` values in ``blocks`` blocks, its block-bootstrap standard error and 95% interval."""

    mean: float
    low: float
    high: float
    se: float
    n: int
    blocks: int

    @property
    def pair(self) -> list[float]:
        return [self.low, self.high]

    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0


def preload() -> None:
    """Import what :func:`t_quantile` uses (``scipy.stats``, when installed; about 20 MiB of modules) now: the
    workers :mod:`.jobs` forks afterwards share it instead of each importing its own."""
    try:
        import scipy.stats  # noqa: F401
    except ImportError:  # pragma: no cover - scipy is a dependency of the dev extra only
        pass


@lru_cache(maxsize=512)
def t_quantile(df: int, conf: float = 0.95) -> float:
    """The two-sided Student-t quantile ``t(df, (1 + conf) / 2)`` (scipy when installed, else a series
    accurate to ~1e-4 for df >= 1)."""
    if df < 1:
        return math.inf
    try:
        from scipy.stats import t as student

        return float(student.ppf(0.5 + conf / 2, df))
    except ImportError:  # pragma: no cover - scipy is a dependency of the dev extra only
        from statistics import NormalDist

        z = NormalDist().inv_cdf(0.5 + conf / 2)
        if df == 1:
            return math.tan(math.pi * conf / 2)
        if df == 2:
            a = 1 - conf
            return math.sqrt(2 / (a * (2 - a)) - 2)
        g1 = (z ** 3 + z) / 4
        g2 = (5 * z ** 5 + 16 * z ** 3 + 3 * z) / 96
        g3 = (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / 384
        g4 = (79 * z ** 9 + 776 * z ** 7 + 1482 * z ** 5 - 1920 * z ** 3 - 945 * z) / 92160
        return z + g1 / df + g2 / df ** 2 + g3 / df ** 3 + g4 / df ** 4


def block_labels(groups: Sequence[int], block: int = BLOCK) -> np.ndarray:
    """A block number per value: consecutive runs of ``block`` values within each group (a window of text);
    a group shorter than ``4 x block`` is cut into 4 blocks (at least one value each)."""
    g = np.asarray(groups, np.int64)
    out = np.zeros(len(g), np.int64)
    nxt = 0
    start = 0
    while start < len(g):
        end = start
        while end < len(g) and g[end] == g[start]:
            end += 1
        size = end - start
        b = block if size >= 4 * block else max(1, math.ceil(size / 4))
        out[start:end] = nxt + np.arange(size) // b
        nxt = int(out[end - 1]) + 1
        start = end
    return out


def mean_interval(values: Sequence[float], groups: Sequence[int] | None = None, block: int = BLOCK,
                  conf: float = 0.95, replicates: int = REPLICATES, lower: float | None = None,
                  upper: float | None = None) -> Interval | None:
    """The mean of ``values`` with its block-bootstrap interval (``groups``: the window of each value;
    None: one window). Non-finite values must be left out by the caller. ``lower``/``upper``: the range
    the quantity lives in (KL >= 0, a fraction in [0, 1]); the interval is clipped to it. None when empty."""
    v = np.asarray(values, np.float64)
    n = v.size
    if n == 0:
        return None
    m = float(v.mean())
    labels = block_labels(np.zeros(n, np.int64) if groups is None else groups, block)
    nb = int(labels[-1]) + 1
    if nb < 2:
        return Interval(m, -math.inf if lower is None else lower, math.inf if upper is None else upper,
                        math.nan, n, nb)
    sums = np.bincount(labels, weights=v, minlength=nb)
    counts = np.bincount(labels, minlength=nb).astype(np.float64)
    rng = np.random.default_rng(SEED)
    draws = rng.integers(0, nb, (replicates, nb))
    reps = sums[draws].sum(axis=1) / counts[draws].sum(axis=1)
    se = float(reps.std(ddof=1))
    half = t_quantile(nb - 1, conf) * se
    lo, hi = m - half, m + half
    if lower is not None:
        lo = max(lo, lower)
    if upper is not None:
        hi = min(hi, upper)
    return Interval(m, float(lo), float(hi), se, n, nb)


def paired_interval(a: Sequence[float], b: Sequence[float], groups: Sequence[int] | None = None,
                    block: int = BLOCK) -> Interval | None:
    """The mean of ``a - b`` (the same predictions measured twice) with its interval; NaN pairs left out."""
    x = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    ok = np.isfinite(x)
    g = np.zeros(len(x), np.int64) if groups is None else np.asarray(groups, np.int64)
    return mean_interval(x[ok], g[ok], block)


def percentile_supported(p: float, n: int, tail: int = TAIL_COUNT) -> bool:
    """Whether ``n`` values support the ``p``-th percentile: at least ``tail`` of them on its far side."""
    return n * min(p, 100.0 - p) / 100.0 >= tail
