"""A built graph: primitive nodes over numbered tensor slots, its inputs and outputs (data only; built by
:mod:`.builder`, compiled by :mod:`.plan`).

A node's ``body`` holds a nested :class:`Graph` for the operations that run one (``tract_core_scan``'s body
fragment, ``tract_core_submodel``'s model): the planner plans it, the builder never does."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core.registry import Primitive

__all__ = ["Node", "InputSpec", "Graph", "slots_of"]


@dataclass
class Node:
    """One primitive invocation. ``inputs`` items: slot int, list of slot ints, or None (absent)."""

    name: str
    op: str
    prim: Primitive
    inputs: list[Any]
    attrs: dict[str, Any]
    outputs: list[Any]  # per result: slot int, ("unpack", [slots]) or ("list", slot)
    location: str
    body: "Graph | None" = None  # a nested graph this node runs (scan body, sub-model), planned by the planner
    extra: Any = None  # what the planner needs besides (a scan's ScanSpec)

    @property
    def stateful(self) -> bool:
        return self.prim.stateful


def slots_of(spec: Any) -> list[int]:
    """The slots of one item of ``Node.inputs`` / ``Node.outputs`` (int, ``(kind, slot)``, list, None)."""
    if spec is None:
        return []
    if isinstance(spec, int):
        return [spec]
    if isinstance(spec, tuple):
        return [spec[1]]
    return list(spec)


@dataclass
class InputSpec:
    """A graph input: shape items are int, a symbol name (str) or a Lazy expression."""

    name: str
    slot: int
    dtype: np.dtype
    shape: list[Any]
    location: str
    op: str = "external"  # the source op declaring it (``external``, ``tract_core_external``)


@dataclass
class Graph:
    name: str
    nslots: int
    constants: dict[int, np.ndarray]
    nodes: list[Node]
    inputs: list[InputSpec]
    outputs: list[tuple[str, int]]
    symbols: dict[str, int]  # symbol name -> slot holding its int value at run time
    quant: dict[str, tuple[str, dict[str, Any]]] = field(default_factory=dict)
    filename: str = "graph.nnef"
    #: identifiers of the graph body bound to a tensor -> its slot (the first assignment, as for node names)
    names: dict[str, int] = field(default_factory=dict)
    #: ``extension tract_assert`` relations between symbols, checked when the inputs are bound
    assertions: list[Any] = field(default_factory=list)
