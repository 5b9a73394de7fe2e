"""Plan-time rewrites of runs of small steps: the dataflow index they share, fused chains, shape memos.

Exporters such as torch-to-nnef write every block of a decoder as a chain of small operations, and every
dimension they need as ``tract_core_shape_of`` -> ``slice`` -> ``squeeze`` (plus, in their ``dyn_slice``
fragments, ``select`` / ``max`` / ``min`` bound arithmetic). Each is one plan step and a few NumPy calls;
on a small decoder they take as long as the weight products. Two rewrites, both on the planned steps
(after the ``steps`` and ``projections`` passes), both leaving every value the plan computes unchanged:

* **Fused chains** (:func:`chain_step`, matched in :mod:`.patterns`): a tree of steps whose inner values are
  read by nothing else becomes one step. It runs a fast form computing the root's value from the chain's
  inputs (the same NumPy operations on the same operands, so the same bits: the tests compare fused and
  unfused plans with ``assert_array_equal``) when a guard on the run-time inputs holds, else the original
  steps one after the other. The inner values are not materialised (``Plan.elided``): a run capturing one
  runs the unfused plan.
* **Shape memos** (:func:`memo_groups`): steps that compute only from the shapes of tensors (through
  ``tract_core_shape_of``), from constants and from symbols are grouped by the tensors whose shapes they
  read; a group runs once for a given tuple of those shapes (and symbol values) and later runs with the
  same tuple set the group's values from that run. During decode the shapes of most activations do not
  change from token to token, so those groups cost one tuple comparison a token. The values kept are made
  read-only.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..catalog import ops_having
from ..graph import Graph, Node, slots_of
from ..values import Lazy
from .execute import node_error
from .steps import Step

__all__ = ["Flow", "chain_step", "chain_node", "chain_members", "ChainMembers", "memo_groups", "MEMO_OPS"]


class Flow:
    """Who produces and who reads each slot of a list of planned steps (tensor inputs and the slots read by
    run-time attributes); ``pinned``: graph outputs and symbols (never elided); ``unknown``: some
    attribute's reads are not known (then nothing may be fused)."""

    def __init__(self, graph: Graph, nodes: list[Node], base: list[Any]) -> None:
        self.graph, self.nodes, self.base = graph, nodes, base
        self.producer: dict[int, int] = {}
        self.readers: dict[int, list[int]] = {}
        self.unknown = False
        for k, node in enumerate(nodes):
            for spec in node.inputs:
                for s in slots_of(spec):
                    self.readers.setdefault(s, []).append(k)
            for a in node.attrs.values():
                if isinstance(a, Lazy):
                    if a.reads is None:
                        self.unknown = True
                        continue
                    for s in a.reads:
                        self.readers.setdefault(s, []).append(k)
            for spec in node.outputs:
                for s in slots_of(spec):
                    self.producer[s] = k
        self.pinned = {s for _, s in graph.outputs} | set(graph.symbols.values())
        self.inputs = {i.slot for i in graph.inputs}
        #: the fused forms may run the numba decode kernels (:mod:`nnef_kv.kernels.attend`, ``rowwise``); a
        #: check's plan (``inspect``: weights unprepared) does not, so that checking maps no numba
        self.kernels = True

    def const(self, slot: Any) -> Any:
        """The constant in ``slot`` (an array), or None."""
        if not isinstance(slot, int) or slot >= len(self.base):
            return None
        return self.base[slot]

    def node_of(self, slot: Any) -> tuple[int, Node] | None:
        """``(step index, node)`` producing ``slot``, None for inputs, constants and symbols."""
        if not isinstance(slot, int) or self.const(slot) is not None:
            return None
        k = self.producer.get(slot)
        return None if k is None else (k, self.nodes[k])

    def only_reader(self, slot: int, k: int) -> bool:
        """``slot`` is read by step ``k`` alone (once or several times) and is neither pinned nor read by an
        attribute of another step."""
        return slot not in self.pinned and set(self.readers.get(slot, ())) == {k}


# ------------------------------------------------------------------------------------------------
# fused chains
# ------------------------------------------------------------------------------------------------
class ChainMembers(tuple):
    """``Node.extra`` of a fused chain's (or a shape memo's) plan node: the original nodes it runs, in order.
    Tools that read a plan's structure (``validate/capture.py``) look through it."""


def chain_members(node: Node) -> tuple[Node, ...] | None:
    """The nodes a fused chain or shape memo step stands for, None for any other step."""
    return node.extra if isinstance(node.extra, ChainMembers) else None


def chain_node(op: str, members: list[Node], inputs: list[int]) -> Node:
    """The plan node of a fused chain (members in graph order, the root last): the root's name and prim, the
    chain's external inputs, every member's outputs, the root's first (what capturing the node returns;
    inner ones are dropped by liveness right away, or never written), the members' run-time attributes (for
    liveness), the first member's location, the members in ``extra``."""
    root = members[-1]
    attrs: dict[str, Any] = {}
    for i, m in enumerate(members):
        for k, a in m.attrs.items():
            if isinstance(a, Lazy):
                attrs[f"{i}.{k}"] = a
    outs = [s for spec in root.outputs for s in slots_of(spec)]
    outs += [s for m in members[:-1] for spec in m.outputs for s in slots_of(spec)]
    return Node(root.name, op, root.prim, list(inputs), attrs, outs, members[0].location, extra=ChainMembers(members))


def chain_step(members: list[tuple[Step, Node]], fast: Callable[[list], Any], out: int) -> Step:
    """One step for a chain: ``fast(v)`` returns the root's value, or ``NotImplemented`` when its guard does
    not hold (another dtype, other bounds...); then the member steps run in order, as unfused. The step's
    ``fallbacks`` attribute counts the runs that took the member steps (for tests and profiles)."""
    steps = [(st, nd) for st, nd in members]

    def step(v: list, st: list) -> None:
        y = fast(v)
        if y is not NotImplemented:
            v[out] = y
            return
        step.fallbacks += 1  # type: ignore[attr-defined]
        for s, nd in steps:
            try:
                s(v, st)
            except Exception as exc:
                raise node_error(nd, exc) from exc
    step.fallbacks = 0  # type: ignore[attr-defined]
    return step


# ------------------------------------------------------------------------------------------------
# shape memos
# ------------------------------------------------------------------------------------------------
#: ops a memo group may hold: pure functions of their operands' values, small results, never writing into
#: an operand, never returning an operand's own buffer for a fused product to overwrite (the ``memo`` fact)
MEMO_OPS = ops_having("memo")


@dataclass
class _Group:
    key_slots: tuple[int, ...]  # tensors whose shapes are read (by tract_core_shape_of)
    sym_slots: tuple[int, ...]  # symbols read
    pos: int  # step index of the first member
    members: list[int] = field(default_factory=list)


def _memo_step(members: list[tuple[Step, Node]], key_slots: tuple[int, ...], sym_slots: tuple[int, ...],
               outs: tuple[int, ...]) -> Step:
    entry: list[Any] = [None]  # (key, values): replaced whole (one assignment), so threads see either

    def step(v: list, st: list) -> None:
        try:
            key = tuple([v[s].shape for s in key_slots] + [v[s] for s in sym_slots])
        except AttributeError:  # not an array (a list, or a value liveness dropped: never reused)
            key = None
        e = entry[0]
        if key is not None and e is not None and e[0] == key:
            for s, val in zip(outs, e[1]):
                v[s] = val
            return
        for s, nd in members:
            try:
                s(v, st)
            except Exception as exc:
                raise node_error(nd, exc) from exc
        vals = []
        for s in outs:
            val = v[s]
            if isinstance(val, np.ndarray):
                val.flags.writeable = False  # a kept value: a reader writing into it would change later runs
            vals.append(val)
        if key is not None:
            entry[0] = (key, vals)
    step.shape_only = True  # type: ignore[attr-defined]  # reads only shapes: a run of .dense may defer it
    return step


_memo_lock = threading.Lock()


def memo_groups(graph: Graph, steps: list[Step], nodes: list[Node], base: list[Any]
                ) -> tuple[list[Step], list[Node], int]:
    """Group the shape-only steps (see the module docstring); returns the new steps, nodes and the number
    of steps folded into groups."""
    flow = Flow(graph, nodes, base)
    if flow.unknown:
        return steps, nodes, 0
    sym_slots = set(graph.symbols.values())
    derived: dict[int, frozenset] = {}  # member output slot -> its sources (("x", slot) shapes, ("s", slot) symbols)
    group_of: dict[int, _Group] = {}  # member output slot -> its group
    open_: dict[frozenset, _Group] = {}
    groups: list[_Group] = []
    member_at: dict[int, _Group] = {}
    for k, node in enumerate(nodes):
        if node.op not in MEMO_OPS or node.prim.stateful or node.prim.fresh_result or node.body is not None:
            continue
        outs = node.outputs
        if not outs or not all(isinstance(o, int) and o not in flow.pinned for o in outs):
            continue
        srcs: set = set()
        deps: list[int] = []
        ok = True
        if node.op == "tract_core_shape_of":
            if len(node.inputs) != 1 or not isinstance(node.inputs[0], int):
                continue
            srcs.add(("x", node.inputs[0]))
        else:
            reads = [s for spec in node.inputs for s in slots_of(spec)]
            for a in node.attrs.values():
                if isinstance(a, Lazy):
                    reads += list(a.reads or ())
            for s in reads:
                if flow.const(s) is not None:
                    continue
                if s in sym_slots:
                    srcs.add(("s", s))
                elif s in derived:
                    srcs |= derived[s]
                    deps.append(s)
                else:
                    ok = False
                    break
        if not ok or not srcs:
            continue
        key = frozenset(srcs)
        g = open_.get(key)
        if g is None or not all(group_of[d] is g or group_of[d].pos < g.pos for d in deps):
            g = _Group(tuple(sorted(s for t, s in key if t == "x")), tuple(sorted(s for t, s in key if t == "s")), k)
            open_[key] = g
            groups.append(g)
        g.members.append(k)
        member_at[k] = g
        for o in outs:
            derived[o] = key
            group_of[o] = g
    # a group of one shape_of is only worth it when its readers are grouped too: keep groups of >= 2 steps
    groups = [g for g in groups if len(g.members) >= 2]
    if not groups:
        return steps, nodes, 0
    first = {g.pos: g for g in groups}
    grouped = {k for g in groups for k in g.members}
    new_steps: list[Step] = []
    new_nodes: list[Node] = []
    folded = 0
    for k, (st, nd) in enumerate(zip(steps, nodes)):
        g = first.get(k)
        if g is not None:
            ms = [(steps[i], nodes[i]) for i in g.members]
            outs = tuple(s for i in g.members for s in nodes[i].outputs)
            # the tensors whose shapes make the key are read by the group step: liveness keeps them till then
            ins = sorted({s for i in g.members for spec in nodes[i].inputs for s in slots_of(spec)
                          if s not in outs} | set(g.key_slots))
            attrs = {f"{j}.{a}": v for j, i in enumerate(g.members) for a, v in nodes[i].attrs.items()
                     if isinstance(v, Lazy)}
            head = nodes[g.members[0]]
            node = Node(head.name, "shapes:" + "+".join(nodes[i].op for i in g.members[:3])
                        + ("+..." if len(g.members) > 3 else ""), head.prim, ins, attrs, list(outs), head.location,
                        extra=ChainMembers(nodes[i] for i in g.members))
            new_steps.append(_memo_step(ms, g.key_slots, g.sym_slots, outs))
            new_nodes.append(node)
            folded += len(g.members) - 1
        if k in grouped:
            continue
        new_steps.append(st)
        new_nodes.append(nd)
    return new_steps, new_nodes, folded
