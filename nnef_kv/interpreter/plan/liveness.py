"""Liveness pass: after each step, the slots whose last reader it was are dropped from the run's value
list, so a run holds only the values still needed (outputs, constants and symbols are never dropped)."""
from __future__ import annotations

from typing import Any

from ..graph import Graph, Node, slots_of as _slots_of
from ..values import Lazy

__all__ = ["liveness"]


def liveness(graph: Graph, step_nodes: list[Node], base: list[Any]) -> list[tuple[int, ...]] | None:
    """Per step, the slots it is the last to read (or produces for no reader): safe to drop after it.

    Readers are the node's tensor inputs and the slots its run-time attributes read (``Lazy.reads``);
    None when an attribute's reads are unknown (then nothing is dropped)."""
    never = {s for _, s in graph.outputs} | set(graph.symbols.values())
    never |= {i for i, b in enumerate(base) if b is not None}  # constants (and folded values)
    last: dict[int, int] = {}
    for k, node in enumerate(step_nodes):
        for spec in node.inputs:
            for s in _slots_of(spec):
                last[s] = k
        for a in node.attrs.values():
            if isinstance(a, Lazy):
                if a.reads is None:
                    return None
                for s in a.reads:
                    last[s] = k
        for spec in node.outputs:
            for s in _slots_of(spec):
                last.setdefault(s, k)  # produced and never read: dropped at once
    frees: list[list[int]] = [[] for _ in step_nodes]
    for s, k in last.items():
        if s not in never:
            frees[k].append(s)
    return [tuple(sorted(f)) for f in frees]
