"""What an attention's sink column holds, read by evaluating it (GPT-OSS's attention sinks).

GPT-OSS appends one learned logit per query head to the scores before the softmax and drops that column
after it (``concat([scores, sinks], axis = 3) -> softmax -> slice [0, -1)``): the softmax's normaliser
gains ``exp(sink)``, no value is read for it. The recognizer (:mod:`nnef_kv.interpreter.plan.recognize`)
finds the column; this module evaluates it with the interpreter on its own (its cone,
:func:`.masks.cone_document`, as masks are read) at two (S, P) bindings and with random inputs, and accepts
it only as a ``[B, Hq, S, 1]`` tensor holding one constant per query head (the same at every query, binding
and input). The per-head values become the fused op's ``sink_logits``; anything else is left as an
unsupported score transform, which the converter refuses naming the node.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import NnefKvError, clip
from .graph_edit import GraphEdit
from .masks import _evaluate, _plan, cone_document, length_symbols

#: the (S, P) bindings the column is evaluated at
BINDINGS = ((3, 5), (2, 29))


def _read(g: GraphEdit, columns: list[str], query: str | None, past: str | None
          ) -> dict[str, tuple[float, ...] | str]:
    """The per-head logits of each of ``columns`` (evaluated together, one plan), or why a column is not one
    learned logit per query head."""
    doc = cone_document(g, columns)
    if isinstance(doc, str):
        return dict.fromkeys(columns, doc)
    try:
        plan = _plan(doc, g.tensors)
        runs = [(s, p, _evaluate(plan, {query: s, past: p}, seed=seed)) for s, p in BINDINGS for seed in (None, 0)]
    except NnefKvError as exc:
        return dict.fromkeys(columns, f"it cannot be evaluated on its own ({clip(' '.join(str(exc).split()), 200)})")
    return {c: _per_head([(s, p, values[c]) for s, p, values in runs], query) for c in columns}


def _per_head(runs: list[tuple[int, int, Any]], query: str | None) -> tuple[float, ...] | str:
    """One column's values at each binding -> its logit per head, or why it is not one."""
    heads: np.ndarray | None = None
    for s, p, v in runs:
        v = np.asarray(v, np.float64)
        if v.ndim != 4 or v.shape[-1] != 1 or (query is not None and v.shape[2] != s):
            return f"it is {list(v.shape)} at S={s} P={p}, not [B, Hq, S, 1]"
        per = v[0, :, 0, 0]
        if not np.array_equal(v, np.broadcast_to(per[None, :, None, None], v.shape)):
            return f"it is not one value per head (it changes along the batch or the queries at S={s} P={p})"
        if heads is not None and not np.array_equal(per, heads):
            return f"it changes with the lengths or the inputs (at S={s} P={p}): not a learned logit per head"
        heads = per
    assert heads is not None
    if not np.isfinite(heads).all():
        return "it holds a non-finite value"
    return tuple(float(x) for x in heads.astype(np.float32))


def read_sink_logits(g: GraphEdit, blocks: list[Any]) -> None:
    """Set ``sink_logits`` on each attention block (:class:`~.attention.AttentionBlock`) with a sink column; a
    column that is not one learned logit per head joins the block's ``unsupported`` transforms."""
    todo = [b for b in blocks if b.sinks is not None and not b.sink_logits]
    if not todo:
        return
    query, past = length_symbols(g, [c for b in todo for c in (b.key, b.value)])
    read = _read(g, sorted({b.sinks for b in todo}), query, past)
    for b in todo:
        got = read[b.sinks]
        if isinstance(got, str):
            b.unsupported.append(f"'{b.sinks}' (a column joined to the scores before the softmax: {got})")
        else:
            b.sink_logits = got
