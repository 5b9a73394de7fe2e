"""Capture intermediate tensors of a session run: the output of every attention op, layer by layer.

What counts as "an attention op" is the one recognizer's rule
(:func:`nnef_kv.interpreter.plan.recognize.attention_outputs`, in graph order, so the k-th one is layer k): a
fused attention node (an op registered with role ``attention`` or ``attention+kv``: ``nnef_kv_kivi_sdpa``,
``tract_transformers_quantized_kv_sdpa``, ``tract_transformers_sdpa``, ...; its output ``[B, Hq, Sq, D]``), or a
decomposed attention's ``p . V`` product whose first operand a softmax makes (through casts), i.e.
``softmax(q k^T * scale + mask) @ v`` as exporters write it (same ``[B, Hq, Sq, D]`` tensor); when the planner
fused such a chain into one step (``plan/patterns.py``), that step (its first output is the product's).

:func:`run_capturing` is ``Session.run(inputs, capture=nodes)`` for those nodes, with copies of what
it captured.
"""
from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["fused_attention_ops", "attention_step_indices", "run_capturing"]


def fused_attention_ops() -> frozenset[str]:
    """The ops registered as attention (role ``attention`` or ``attention+kv``): the recognizer's."""
    from ..interpreter.plan.recognize import fused_attention_ops as fused

    return fused()


def attention_step_indices(plan: Any) -> list[int]:
    """Indices into ``plan.steps`` of the attention nodes, in execution order: the steps whose node (a fused
    chain: its last member) the recognizer names an attention's output."""
    from ..interpreter.plan.chains import chain_members
    from ..interpreter.plan.recognize import attention_outputs

    outputs = {n.name for n in attention_outputs(plan.graph)}
    return [i for i, node in enumerate(plan.step_nodes) if (chain_members(node) or (node,))[-1].name in outputs]


def run_capturing(session: Any, inputs: dict[str, Any], step_indices: list[int]
                  ) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
    """``session.run(inputs)`` that also returns copies of the first output of the given plan steps.

    Nodes (not names) are passed to ``Session.run(capture=...)``: a nested invocation such as
    ``o = mul(sdpa(...), 2.0)`` names its sdpa node ``o`` while the identifier ``o`` is the product.
    """
    nodes = [session.plan.step_nodes[i] for i in step_indices]
    outs, caps = session.run(inputs, capture=nodes)
    return dict(outs), [np.array(caps[n.name], copy=True) for n in nodes]
