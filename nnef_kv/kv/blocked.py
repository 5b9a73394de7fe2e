"""How many query rows one block of an attention takes, so that a long prefill's scores stay bounded.

Every exact attention path (``kv/exact.py`` ``sdpa_array``, the plan's fused attention chain in
``interpreter/plan/attention.py``, HF's quantized cache in ``kv/hf_quantized.py``, KIVI's online softmax in
``kv/kivi_attend.py``) computes scores for all query rows at once while they fit in :data:`SCORE_BYTES`
(the unchanged one-call arithmetic, bit for bit), and above it takes the queries in blocks of rows: each
query row's scores, softmax and weighted sum are the same operations on the same operands, so a blocked
call differs from the one-call result only by the summation order BLAS picks for a block (and, on a causal
attention, by the keys a block cannot see being left out instead of weighted by an exact zero).

Without blocks a one-call prefill holds ``heads x L x L`` f32 scores per attention (2.4 GB at L = 8192 on
SmolLM2-135M's 9 heads); with them a block holds at most :data:`SCORE_BYTES` (plus the softmax's
reductions, a few rows per head).
"""
from __future__ import annotations

__all__ = ["SCORE_BYTES", "CAUSAL_BLOCKS", "CAUSAL_ROWS", "row_block", "row_ranges"]

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
