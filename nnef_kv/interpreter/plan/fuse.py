"""Plan-time fusion of an element-wise producer into the product that is its only reader.

A LLaMA-style block writes ``mul(rms_norm(h), weight)`` and ``mul(silu(gate), up)``: the normalised (or
activated) tensor is made, read once by ``mul``, then dropped. :func:`fusion_pairs` finds such pairs and
:func:`fused_product` makes one kernel of each: the producer's kernel runs as before, then its result,
an array no one else holds, is multiplied in place. Same ufuncs, same operands, same roundings: the
values are those of the two nodes run apart, with one allocation and one plan step fewer.

The producer's output is then never materialised on its own (``Plan.elided``); a run that captures it
by name runs the model's unfused plan instead (:meth:`Plan.unfused`).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..graph import Graph, Node, slots_of
from ..values import Lazy

Kernel = Callable[..., Any]


def _mul_kernel() -> Kernel:
    from ..catalog import lookup

    prim = lookup("mul")
    assert prim is not None and prim.kernel is not None
    return prim.kernel


def fusion_pairs(graph: Graph) -> dict[int, int]:
    """``{producer output slot: index in graph.nodes of its only reader}`` for each producer (an op
    registered ``fresh_result=True``, e.g. rms_norm, silu; static attributes, one output) read by exactly one
    two-input ``mul`` and by nothing else (no
    other node, no run-time attribute, not a graph output). Empty if some attribute's reads are unknown."""
    mul = _mul_kernel()
    readers: dict[int, list[int]] = {}
    for k, node in enumerate(graph.nodes):
        for spec in node.inputs:
            for s in slots_of(spec):
                readers.setdefault(s, []).append(k)
        for a in node.attrs.values():
            if isinstance(a, Lazy):
                if a.reads is None:
                    return {}
                for s in a.reads:
                    readers.setdefault(s, []).extend((k, k))  # never "exactly one reader"
    pinned = {s for _, s in graph.outputs} | set(graph.symbols.values())
    pairs: dict[int, int] = {}
    claimed: set[int] = set()
    for node in graph.nodes:
        prim = node.prim
        if prim.stateful or not prim.fresh_result or len(node.outputs) != 1:
            continue
        out = node.outputs[0]
        if not isinstance(out, int) or out in pinned or any(isinstance(a, Lazy) for a in node.attrs.values()):
            continue
        if len(node.inputs) != 1 or not isinstance(node.inputs[0], int):
            continue
        rd = readers.get(out, [])
        if len(rd) != 1:
            continue
        consumer = graph.nodes[rd[0]]
        if rd[0] in claimed:  # mul(silu(a), silu(b)): one producer fuses, the other runs as a step
            continue
        if (consumer.prim.kernel is mul and not consumer.prim.stateful and len(consumer.inputs) == 2
                and all(isinstance(i, int) for i in consumer.inputs) and consumer.inputs.count(out) == 1
                and len(consumer.outputs) == 1 and isinstance(consumer.outputs[0], int)):
            pairs[out] = rd[0]
            claimed.add(rd[0])
    return pairs


def fused_product(first: Kernel, position: int, mul: Kernel) -> Kernel:
    """``mul(first(x), w)`` (``position`` 0) or ``mul(w, first(x))`` (1) as ``kernel(x, w)``.

    ``first(x)`` is a fresh array; when ``w`` is an array of its dtype and rank broadcasting into it, the
    product is written over it (what ``mul`` computes: NNEF's rank alignment and dtype adoption are
    no-ops then). Otherwise, or if NumPy refuses the in-place form, the generic ``mul`` runs."""

    def kernel(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        y = first(x)
        if type(y) is np.ndarray and type(w) is np.ndarray and w.dtype == y.dtype and w.ndim == y.ndim:
            try:
                return np.multiply(y, w, out=y)
            except ValueError:  # w broadcasts to a larger shape than y
                pass
        return mul(y, w) if position == 0 else mul(w, y)
    return kernel


def fused_node(producer: Node, consumer: Node, other: Any) -> Node:
    """The plan node of a fused pair: the consumer's name and output, the producer's location (where an
    error in either is reported), ``op`` naming both."""
    return Node(consumer.name, f"{producer.op}*{consumer.op}", consumer.prim, [producer.inputs[0], other], {},
                list(consumer.outputs), producer.location)


__all__ = ["fusion_pairs", "fused_product", "fused_node"]
