"""Capture intermediate tensors of a session run: the output of every attention op, layer by layer.

What counts as "an attention op" (in graph order, so the k-th one is layer k):

* a fused attention node: ``nnef_kv_kivi_sdpa``, ``tract_transformers_quantized_kv_sdpa``,
  ``tract_transformers_sdpa``, ``tract_transformers_window_kv_sdpa`` (its output ``[B, Hq, Sq, D]``);
* a decomposed attention: a ``matmul`` whose first operand is a ``softmax`` (directly or through casts),
  i.e. ``softmax(q k^T * scale + mask) @ v`` as exporters write it (same ``[B, Hq, Sq, D]`` tensor).

:func:`run_capturing` runs the session's plan step by step exactly as ``Session.run`` does (same inputs
check, same states, same outputs) and copies the output of the chosen nodes as they are computed.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import GraphError, NnefKvError

__all__ = ["FUSED_ATTENTION_OPS", "attention_step_indices", "run_capturing"]

FUSED_ATTENTION_OPS = frozenset({
    "nnef_kv_kivi_sdpa",
    "tract_transformers_quantized_kv_sdpa",
    "tract_transformers_sdpa",
    "tract_transformers_window_kv_sdpa",
})
_PASS_THROUGH = frozenset({"tract_core_cast", "cast", "copy"})
_SOFTMAX = frozenset({"softmax", "tract_core_softmax"})


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
    for i, node in enumerate(plan.step_nodes):
        if node.op in FUSED_ATTENTION_OPS:
            found.append(i)
        elif node.op == "matmul" and node.inputs and isinstance(node.inputs[0], int):
            src = producer.get(node.inputs[0])
            while src is not None and src.op in _PASS_THROUGH and src.inputs and isinstance(src.inputs[0], int):
                src = producer.get(src.inputs[0])
            if src is not None and src.op in _SOFTMAX:
                found.append(i)
        for s in _out_slots(node):
            producer[s] = node
    return found


def run_capturing(session: Any, inputs: dict[str, Any], step_indices: list[int]
                  ) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
    """``session.run(inputs)`` that also returns copies of the first output of the given plan steps."""
    import inspect

    from ..interpreter.plan import bind_inputs

    plan = session.plan
    if "capture" in inspect.signature(session.run).parameters:  # the interpreter's own hook, when it has one
        names = [plan.step_nodes[i].name for i in step_indices]
        got = session.run(inputs, capture=names)
        if isinstance(got, tuple) and len(got) == 2:
            outs, caps = got
        elif isinstance(got, dict):
            outs, caps = {n: got[n] for n in plan.output_names}, got
        else:
            raise GraphError(f"session.run(capture=...) returned {type(got).__name__}: not understood")
        caps = [caps[n] for n in names] if isinstance(caps, dict) else list(caps)
        return dict(outs), [np.array(c, copy=True) for c in caps]
    want = {k: j for j, k in enumerate(step_indices)}
    captured: list[Any] = [None] * len(step_indices)
    symbols = session._state_symbols() if getattr(session, "states", None) and hasattr(session, "_state_symbols") \
        else None
    v = bind_inputs(plan, inputs, symbols) if symbols is not None else bind_inputs(plan, inputs)
    st = session.states
    i = 0
    try:
        for i, step in enumerate(plan.steps):
            step(v, st)
            j = want.get(i)
            if j is not None:
                slots = _out_slots(plan.step_nodes[i])
                captured[j] = np.array(v[slots[0]], copy=True)
    except NnefKvError:
        raise
    except Exception as exc:
        node = plan.step_nodes[i]
        raise GraphError(f"{node.location}: {node.op} '{node.name}' failed: {type(exc).__name__}: {exc}") from exc
    return {name: v[slot] for name, slot in plan.outputs}, captured
