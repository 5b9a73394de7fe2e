"""How many query rows one block of an attention takes, so that a long prefill's scores stay bounded.

Every exact attention path (``kv/exact.py`` ``sdpa_array``, the plan's fused attention chain in
``interpreter/plan/attention.py``, HF's quantized cache in ``kv/hf_quantized.py``, KIVI's online softmax in
``kv/kivi/attend.py``) computes scores for all query rows at once while they fit in :data:`SCORE_BYTES`
(the unchanged one-call arithmetic, bit for bit), and above it takes the queries in blocks of rows: each
query row's scores, softmax and weighted sum are the same operations on the same operands, so a blocked
call differs from the one-call result only by the summation order BLAS picks for a block (and, on a causal
attention, by the keys a block cannot see being left out instead of weighted by an exact zero).

On a prefill the blocks also skip work: a causal attention's block (``sdpa_array`` ``is_causal``, HF) reads
only the keys its rows see, when every value is finite (one call multiplies a hidden value by an exact
zero: a non-finite one gives NaN there); a block under an additive mask (the plan's chain, ``sdpa_array``
with a mask) leaves out its trailing keys when :func:`unseen_from` proves their softmax weight is exactly
0 in f32 in one call too: the mask puts them more than ``2 * score_bound + 110`` below every row's other
keys, :func:`score_bound` bounding ``|scale q.k|`` by the rows' norms (none when a query, key or value is
not finite). A causal-looking prefill is taken in about :data:`CAUSAL_BLOCKS` blocks for that.

Without blocks a one-call prefill holds ``heads x L x L`` f32 scores per attention (2.4 GB at L = 8192 on
SmolLM2-135M's 9 heads); with them a block holds at most :data:`SCORE_BYTES` (plus the softmax's
reductions, a few rows per head).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["SCORE_BYTES", "CAUSAL_BLOCKS", "CAUSAL_ROWS", "row_block", "row_ranges", "score_bound", "unseen_from",
           "mask_cut", "unseen_given"]

#: the most bytes of f32 scores (every head of one call) an attention computes at once; above it the
#: queries are taken in blocks of rows (read at call time: tests and users may change it)
SCORE_BYTES = 32 << 20

#: a causal prefill (where the keys of an exact causal attention are mostly the new tokens) is taken in
#: about this many blocks of at least :data:`CAUSAL_ROWS` rows, each over the keys its rows see: about
#: (n + 1) / 2n of the score work instead of all of it
CAUSAL_BLOCKS = 16
CAUSAL_ROWS = 32


def row_block(row_bytes: int, rows: int, budget: int | None = None) -> int:
    """Query rows a block takes: ``rows`` (one block) when ``rows * row_bytes`` fits ``budget``
    (default :data:`SCORE_BYTES`), else the most rows that fit, at least one."""
    cap = SCORE_BYTES if budget is None else int(budget)
    if row_bytes <= 0 or rows * row_bytes <= cap:
        return max(1, rows)
    return max(1, min(rows, cap // row_bytes))


def row_ranges(rows: int, block: int) -> list[tuple[int, int]]:
    """``[(i0, i1), ...]`` covering ``0..rows`` in blocks of ``block`` rows (one range when it covers all)."""
    block = max(1, int(block))
    return [(i0, min(rows, i0 + block)) for i0 in range(0, max(rows, 1), block)]


#: below this, ``exp(x)`` is exactly 0 in f32 (the smallest subnormal is ``exp(-103.3)``)
_EXP_ZERO = -110.0


def score_bound(q: np.ndarray, kv: np.ndarray, vv: np.ndarray, scale: Any) -> float | None:
    """A bound on ``|scale * q.k|`` over every query row and key (Cauchy-Schwarz on the row norms), None
    when some query, key or value is not finite (then no key may be left out: one call would give NaN)."""
    with np.errstate(over="ignore", invalid="ignore"):
        qn = float(np.max(np.einsum("...d,...d->...", q, q)))
        kn = float(np.max(np.einsum("...d,...d->...", kv, kv)))
    sc = 1.0 if scale is None else abs(float(np.asarray(scale).reshape(-1)[0]))
    # the squared norms summed in the inputs' dtype (float32 or wider: a relative error under (D + 1) 2**-24
    # each, the squares' roundings included; an overflow gives Inf and no bound), widened by 2 (D + 2) 2**-24,
    # plus a term for squares that underflowed
    d = q.shape[-1] if q.ndim else 1
    bound = sc * (math.sqrt(qn * kn) * (1.0 + 2.0 * (d + 2) * 2.0 ** -24) + 1e-30) if qn >= 0 and kn >= 0 \
        else math.nan
    if not (np.isfinite(bound) and np.isfinite(vv).all()):
        return None
    return bound


def unseen_from(mb: np.ndarray, smax: float) -> int:
    """The first key of the trailing keys no query row of this block sees: where every mask value is the
    block's lowest column maximum and that is so far below every row's highest mask value on the other keys
    (more than ``2 * smax`` + 110) that its softmax weight is exactly 0 in one call too. ``T`` when none."""
    return unseen_given(mask_cut(mb), smax, mb.shape[-1])


def mask_cut(mb: np.ndarray) -> tuple[int, float]:
    """What :func:`unseen_from` reads of the mask: ``(cut, gap)``, the first of the trailing keys whose mask
    values are all the block's lowest column maximum (``T`` when there are none, or no other key) and how far
    that value is below every row's highest mask value on the keys before ``cut``."""
    t = mb.shape[-1]
    colmax = np.max(mb.reshape(-1, t), axis=0)
    low = float(colmax.min())
    above = np.flatnonzero(colmax > low)
    cut = int(above[-1]) + 1 if above.size else 0
    if cut == 0 or cut == t:
        return t, 0.0
    vis = float(np.min(np.max(mb[..., :cut], axis=-1)))
    return cut, vis - low


def unseen_given(cut_gap: tuple[int, float], smax: float, t: int) -> int:
    """:func:`unseen_from` of a mask block whose :func:`mask_cut` is ``cut_gap``."""
    cut, gap = cut_gap
    return cut if cut < t and gap > 2.0 * smax - _EXP_ZERO else t
