"""Decode attention segments: a layer's query / key / value views, RoPE and cache appends run as one step with
the attention they feed.

After :mod:`.patterns` and :mod:`.cache_append`, a decoder layer runs up to nine steps between its q/k/v
product and its output product: a view of each product's output, RoPE of the query and of the key, the
appends of the key and the value to their caches, the attention. Each fused step checks its operands on every
call (types, dtypes, ranks, broadcasts, the views' targets, the RoPE slices' bounds): on a decode token that
is most of their cost (about 20 of a layer's 40 us here), and almost none of it changes from token to token.

:func:`segments_of` finds, for each attention chain, the views and RoPE chains feeding it through values nothing
else reads, and the cache appends between them (:func:`.cache_append.rewrite_cache_concats`' steps), and
makes them one step placed at the attention's (the steps in between, which read none of the members'
values, run before it as they did). The step runs the members as they ran, except the views and the
RoPEs: it remembers the shapes of the segment's inputs (the products' outputs, cos and sin) and the objects
the members' run-time attributes read the last time every view resolved and every RoPE took its kernel
path; while those are unchanged, the same views and the same kernel calls on the same operands follow
(those checks depend on nothing else: the same values as the member steps, bit for bit), and only the
appends and the attention, whose operands grow every token, check theirs. Anything else (another shape,
dtype or type, a RoPE on NumPy's path, numba off) runs the member steps one by one.

A run capturing an inner value (a view's, a RoPE's) runs the unfused plan, as for any chain.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ...kernels import rowwise
from ..graph import Node, slots_of
from .chains import Flow, chain_node, chain_members
from .attention import apply_view
from .execute import run_members
from .matching import lazy_reads, same_objects
from .steps import Step

__all__ = ["segments_of", "Segment", "REPLAY"]

#: ``[False]``: every segment runs its member steps one by one (the tests compare the two; a debugging switch)
REPLAY = [True]

_F32 = np.dtype(np.float32)


class Segment:
    """The step of one segment (see the module docstring). ``member_runs`` counts the calls that ran the
    member steps one by one; ``fallbacks`` is the members' own count (their fast forms' guards failing)."""

    def __init__(self, members: list[tuple[Step, Node]], views: list[tuple[int, int, Any]],
                 ropes: list[tuple[int, int, int, int, Any, int]], order: list[int], reads: tuple[int, ...],
                 inputs: tuple[int, ...], attention: dict[str, Any]) -> None:
        self.members = members  # the attention's step last
        self.attention = attention  # its match's parts: the query, key and value slots, checks, decode
        self.views = views  # (input slot, output slot, the view chain's _ViewPlan)
        self.ropes = ropes  # (x slot, cos slot, sin slot, output slot, the RoPE chain's fits, index of its view)
        self.order = order  # the cache appends, as indices into members, in step order
        self.reads = reads  # slots the views' and RoPEs' run-time attributes read
        self.inputs = inputs  # the views' inputs, cos and sin
        #: (their types / shapes / dtypes, the objects read, the views' ops or None when the segment cannot
        #: replay these values, the RoPE core): replaced whole, so two threads see one entry or the other
        self.entry: tuple | None = None
        self.member_runs = 0

    @property
    def fallbacks(self) -> int:
        return sum(getattr(st, "fallbacks", 0) for st, _ in self.members)

    def _ops(self, v: list) -> tuple | None:
        """Every view's NumPy calls, when every view resolves and every RoPE takes its kernel path on these
        values; else None."""
        ops, made = [], []
        for x, _, plan in self.views:
            got = plan.apply(v, v[x])
            if got is None:
                return None
            ops.append(got[0])
            made.append(got[1])
        for _, cos, sin, _, fits, vi in self.ropes:
            xv = made[vi]
            if not (fits(v, xv, v[cos], v[sin]) and xv.ndim == 4):
                return None
        return tuple(ops)

    def __call__(self, v: list, st: list) -> None:
        core = rowwise.rope_half.hot() if REPLAY[0] else None
        if core is not None and core is not rowwise.rope_half:  # (the kernel itself: its first call not made)
            key = tuple([(x.shape, x.dtype) if type(x) is np.ndarray else type(x) for x in map(v.__getitem__,
                                                                                           self.inputs)])
            objs = tuple([v[s] for s in self.reads])
            e = self.entry
            if e is None or e[3] is not core or e[0] != key or not same_objects(objs, e[1]):
                e = self.entry = (key, objs, self._ops(v), core)
            if e[2] is not None:
                self._replay(v, st, e[2], core)
                return
        self.member_runs += 1
        run_members(self.members, v, st)

    def _replay(self, v: list, st: list, ops: tuple, core: Any) -> None:
        made = []
        for (x, out, _), got in zip(self.views, ops):
            v[out] = y = apply_view(v[x], got)
            made.append(y)
        for _, cos, sin, out, _, vi in self.ropes:
            xv = made[vi]
            r = np.empty_like(xv)  # what the RoPE chain's kernel path makes (the input's order)
            core(xv, v[cos], v[sin], r)
            v[out] = r
        run_members([self.members[i] for i in self.order], v, st)
        a = self.attention
        q, kv, vv = v[a["q"]], v[a["k"]], v[a["v"]]
        got = a["checks"](v, q, kv, vv)
        out = a["decode"](q, kv, vv, got[1], got[0]) if got is not None else None
        if out is None:  # another path of the attention (its own checks again): its step
            run_members(self.members[-1:], v, st)
            return
        v[self.members[-1][1].outputs[0]] = out


def _match(step: Any) -> Any:
    return getattr(step, "match", None)


def segments_of(graph: Any, steps: list[Step], nodes: list[Node], base: list[Any]
                ) -> tuple[list[Step], list[Node], set[int], int]:
    """The steps with each attention segment made one step (see the module docstring); returns the steps,
    the nodes, the slots no longer materialised on their own and the number of segments."""
    flow = Flow(graph, nodes, base)
    if flow.unknown:
        return steps, nodes, set(), 0
    found: dict[int, tuple[list[int], list, list, set[int]]] = {}
    taken: set[int] = set()
    for a, node in enumerate(nodes):
        m = _match(steps[a])
        if m is None or m.op != "attention" or m.parts is None:
            continue
        got = _segment(flow, steps, nodes, a, taken)
        if got is not None:
            found[a] = got
            taken.update(got[0])
    if not found:
        return steps, nodes, set(), 0
    elided: set[int] = set()
    new_steps: list[Step] = []
    new_nodes: list[Node] = []
    for k, (st, nd) in enumerate(zip(steps, nodes)):
        if k in found:
            idx, views, ropes, inner = found[k]
            members = [(steps[i], nodes[i]) for i in idx]
            pos = {i: j for j, i in enumerate(idx)}
            order = [pos[i] for i in idx if _match(steps[i]) is None]  # the appends
            originals = [n for i in idx for n in (chain_members(nodes[i]) or (nodes[i],))]
            produced = {s for i in idx for spec in nodes[i].outputs for s in slots_of(spec)}
            ins = sorted({s for i in idx for spec in nodes[i].inputs for s in slots_of(spec)} - produced)
            seg = chain_node("attention", originals, ins)
            reads = tuple(sorted({s for _, _, plan in views for s in plan.reads}
                                 | {s for *_, r in ropes for s in r}))
            inputs = tuple(dict.fromkeys([x for x, _, _ in views] + [c for r in ropes for c in r[1:3]]))
            new_steps.append(Segment(members, views, [r[:6] for r in ropes], order, reads, inputs,
                                     _match(steps[k]).parts))
            new_nodes.append(seg)
            elided |= inner
            continue
        if k in taken:
            continue
        new_steps.append(st)
        new_nodes.append(nd)
    return new_steps, new_nodes, elided, len(found)


def _segment(flow: Flow, steps: list[Step], nodes: list[Node], a: int, taken: set[int]) -> tuple | None:
    """The members of the segment ending at the attention step ``a``: ``(step indices in order, views, ropes,
    inner slots)``, or None when the attention's query, key and value do not come that way."""
    parts = _match(steps[a]).parts
    q, k, vv = parts["q"], parts["k"], parts["v"]
    members: set[int] = {a}
    views: list[tuple[int, int, Any]] = []
    ropes: list[tuple] = []
    inner: set[int] = set()

    def producer(slot: Any, reader: int, op: str) -> tuple[int, Any] | None:
        got = flow.node_of(slot)
        if got is None or got[0] in taken or got[0] in members:
            return None
        i = got[0]
        m = _match(steps[i])
        if m is None or m.op != op or m.parts is None or not flow.only_reader(slot, reader):
            return None
        return i, m

    def view_of(slot: Any, reader: int) -> int | None:
        got = producer(slot, reader, "view")
        if got is None:
            return None
        i, m = got
        members.add(i)
        inner.add(slot)
        views.append((m.parts["x"], slot, m.parts["plan"]))
        return len(views) - 1

    def rope_of(slot: Any, reader: int) -> bool:
        got = producer(slot, reader, "rope")
        if got is None or not got[1].parts["kernel"]:
            return False
        i, m = got
        members.add(i)
        vi = view_of(m.parts["x"], i)
        if vi is None:
            return False
        inner.add(slot)
        p = m.parts
        ropes.append((p["x"], p["cosine"], p["sine"], slot, p["fits"], vi, p["reads"]))
        return True

    def append_of(slot: Any) -> tuple[int, int] | None:
        got = flow.node_of(slot)
        if got is None or got[0] in taken:
            return None
        grow = getattr(steps[got[0]], "grow", None)
        if grow is None or grow[2] != slot:
            return None
        members.add(got[0])
        return got[0], grow[1]

    if not rope_of(q, a):
        return None
    ka = append_of(k)
    if ka is None or not rope_of(ka[1], ka[0]):
        return None
    va = append_of(vv)
    if va is None or view_of(va[1], va[0]) is None:
        return None
    idx = sorted(members)
    # the steps between the members run before the segment: none may read a member's value
    outs = {s for i in idx[:-1] for spec in nodes[i].outputs for s in slots_of(spec)}
    for j in range(idx[0], a):
        if j not in members:
            reads = {s for spec in nodes[j].inputs for s in slots_of(spec)} | set(lazy_reads(nodes[j]))
            if reads & outs:
                return None
    return idx, views, ropes, inner
