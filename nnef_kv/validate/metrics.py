"""Numeric measures used by validation: relative L2, KL divergence of next-token distributions, summaries."""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

__all__ = ["rel_l2", "log_softmax", "kl_divergence", "summary_stats", "KL_PERCENTILES", "mean_stderr", "token_measures",
           "nll_of"]

#: Percentiles of the per-token KL reported, as llama.cpp's ``perplexity --kl-divergence`` does (1, 5, 10 %,
#: median, 90, 95, 99, 99.9 %), with mean, min and max.
KL_PERCENTILES = (1.0, 5.0, 10.0, 50.0, 90.0, 95.0, 99.0, 99.9)


def rel_l2(got: np.ndarray, ref: np.ndarray) -> float:
    """``||got - ref|| / ||ref||`` in float64 (``inf`` when ``ref`` is all zero and ``got`` is not; NaN
    propagates so a NaN output is never reported as accurate)."""
    g = np.asarray(got, np.float64).reshape(-1)
    r = np.asarray(ref, np.float64).reshape(-1)
    if g.shape != r.shape:
        raise ValueError(f"rel_l2: {g.size} values vs {r.size} in the reference")
    num = float(np.linalg.norm(g - r))
    den = float(np.linalg.norm(r))
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    m = np.max(x, axis=-1, keepdims=True)
    z = x - m
    return z - np.log(np.sum(np.exp(z), axis=-1, keepdims=True))


def kl_divergence(ref_logits: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """``KL(p_ref || p)`` in nats per row (last axis = vocabulary), float64, >= 0."""
    lp_ref = log_softmax(ref_logits)
    lp = log_softmax(logits)
    kl = np.sum(np.exp(lp_ref) * (lp_ref - lp), axis=-1)
    return np.maximum(kl, 0.0)


def summary_stats(values: Iterable[float], percentiles: Sequence[float] = KL_PERCENTILES) -> dict[str, float]:
    """mean, min, max and the given percentiles of ``values`` (NaN-aware: NaN if any value is NaN)."""
    a = np.asarray(list(values), np.float64)
    if a.size == 0:
        return {}
    out = {"mean": float(np.mean(a)), "min": float(np.min(a)), "max": float(np.max(a))}  # not op names
    for p in percentiles:
        out[f"p{p:g}"] = float(np.percentile(a, p))
    return out


def mean_stderr(values: Sequence[float]) -> tuple[float, float]:
    """Mean and its standard error ``sqrt(var / (n - 1))``, as llama.cpp's ``perplexity`` reports them
    (stderr NaN for fewer than two values)."""
    a = np.asarray(values, np.float64)
    if a.size == 0:
        return float("nan"), float("nan")
    m = float(a.mean())
    if a.size < 2:
        return m, float("nan")
    return m, float(np.sqrt(max(float(np.mean(a * a)) - m * m, 0.0) / (a.size - 1)))


def token_measures(ref_logits: np.ndarray, logits: np.ndarray, targets: Sequence[int]) -> dict[str, np.ndarray]:
    """Per evaluated token (rows): ``kl`` = KL(p_ref || p) (nats), ``top1`` (argmaxes equal), ``nll_reference``
    and ``nll`` (-log p of the true next token), ``dp`` = p(true) - p_ref(true)."""
    lp_ref = log_softmax(ref_logits)
    lp = log_softmax(logits)
    t = np.asarray(targets, np.int64)
    rows = np.arange(len(t))
    kl = np.maximum(np.sum(np.exp(lp_ref) * (lp_ref - lp), axis=-1), 0.0)
    return {"kl": kl, "top1": np.argmax(ref_logits, -1) == np.argmax(logits, -1),
            "nll_reference": -lp_ref[rows, t], "nll": -lp[rows, t],
            "dp": np.exp(lp[rows, t]) - np.exp(lp_ref[rows, t])}


def nll_of(logits: np.ndarray, targets: Sequence[int]) -> np.ndarray:
    """-log p of each row's true next token."""
    lp = log_softmax(logits)
    t = np.asarray(targets, np.int64)
    return -lp[np.arange(len(t)), t]
