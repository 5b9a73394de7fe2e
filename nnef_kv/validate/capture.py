"""Capture intermediate tensors of a session run: the output of every attention op, layer by layer.

What counts as "an attention op" (in graph order, so the k-th one is layer k):

* a fused attention node: ``nnef_kv_kivi_sdpa``, ``tract_transformers_quantized_kv_sdpa``,
  ``tract_transformers_sdpa``, ``tract_transformers_window_kv_sdpa`` (its output ``[B, Hq, Sq, D]``);
* a decomposed attention: a ``matmul`` whose first operand is a ``softmax`` (directly or through casts),
  i.e. ``softmax(q k^T * scale + mask) @ v`` as exporters write it (same ``[B, Hq, Sq, D]`` tensor); when the
  planner fused such a chain into one step (``plan/patterns.py``), that step (its first output is the
  product's).

:func:`run_capturing` is ``Session.run(inputs, capture=nodes)`` for those nodes, with copies of what
it captured.
"""
from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["fused_attention_ops", "attention_step_indices", "run_capturing"]

def fused_attention_ops() -> frozenset[str]:
    """The ops registered as attention (role ``attention`` or ``attention+kv``)."""
    from ..interpreter.catalog import ops_with

    return ops_with(role="attention") | ops_with(role="attention+kv")


def _facts(name: str) -> frozenset[str]:
    from ..interpreter.catalog import ops_having

    return ops_having(name)


def _out_slots(node: Any) -> list[int]:
    slots: list[int] = []
    for spec in node.outputs:
        if isinstance(spec, int):
            slots.append(spec)
        elif isinstance(spec, tuple) and len(spec) == 2:
            inner = spec[1]
            slots.extend(inner if isinstance(inner, (list, tuple)) else [inner])
        elif isinstance(spec, list):
            slots.extend(spec)
    return slots


def attention_step_indices(plan: Any) -> list[int]:
    """Indices into ``plan.steps`` of the attention nodes, in execution order."""
    producer: dict[int, Any] = {}
    found: list[int] = []
    fused = fused_attention_ops()
    from ..interpreter.plan.chains import chain_members

    for i, node in enumerate(plan.step_nodes):
        members = chain_members(node) or (node,)
        for m in members:
            if m is members[-1] and _is_attention(m, fused, producer):
                found.append(i)
            for s in _out_slots(m):
                producer[s] = m
    return found


def _is_attention(node: Any, fused: frozenset[str], producer: dict[int, Any]) -> bool:
    if node.op in fused:
        return True
    if node.op == "matmul" and node.inputs and isinstance(node.inputs[0], int):
        src = producer.get(node.inputs[0])
        while src is not None and src.op in _facts("passthrough") and src.inputs and isinstance(src.inputs[0], int):
            src = producer.get(src.inputs[0])
        return src is not None and src.op in _facts("softmax")
    return False


def run_capturing(session: Any, inputs: dict[str, Any], step_indices: list[int]
                  ) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
    """``session.run(inputs)`` that also returns copies of the first output of the given plan steps.

    Nodes (not names) are passed to ``Session.run(capture=...)``: a nested invocation such as
    ``o = mul(sdpa(...), 2.0)`` names its sdpa node ``o`` while the identifier ``o`` is the product.
    """
    nodes = [session.plan.step_nodes[i] for i in step_indices]
    outs, caps = session.run(inputs, capture=nodes)
    return dict(outs), [np.array(caps[n.name], copy=True) for n in nodes]
