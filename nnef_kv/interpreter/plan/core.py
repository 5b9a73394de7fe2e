"""Graph -> Plan: a flat list of step closures, built once per model by a list of passes.

Every pass has one signature, ``pass(draft: Draft) -> None``, and works on the draft's items (one per
node still to run) in graph order:

* :func:`nested` -- ``tract_core_scan`` bodies and ``tract_core_submodel`` models (``Node.body``) are planned
  here, their nodes given a kernel (a state factory for scans) that runs the planned body;
* :func:`fold` -- a stateless node whose inputs are all constants and whose attributes are static is run
  now and its outputs become constants (``unsqueeze(weight)``, casts of weights, ...);
* :func:`fuse` -- ``mul(rms_norm(x), w)`` and ``mul(silu(g), u)`` become one item multiplying the fresh
  producer result in place (:mod:`.fuse`; ``Plan.elided`` lists the values no longer materialised);
* :func:`weights` -- constant weights of products pre-transposed (:mod:`.weights`);
* :func:`specialize` -- a kernel whose attributes are all static is replaced by the closure its op
  registered, that attribute work done once (:mod:`.specialize`);
* :func:`steps` -- every item becomes one closure ``step(values, states)`` (:mod:`.steps`);
* :func:`projections` -- products of one input by several constant weights become one product;
* :func:`memo` -- steps computing only from tensor shapes, constants and symbols run once per tuple of
  those shapes (:mod:`.chains`);
* :func:`patterns` -- the chains exporters write for RMSNorm, rotate-half RoPE, the SiLU gate and attention
  (grouped-query repeat included) become one step each, as do casts to the dtype a value has
  (:mod:`.patterns`, ``Plan.elided`` again);
* :func:`cache_append` -- ``concat([in_cache, new])`` returned as a graph output grows a buffer in place
  when the input is the previous call's output (:mod:`.cache_append`);
* :func:`segments` -- a layer's query / key / value views, RoPEs and cache appends run as one step with the
  attention they feed, the checks of the views and RoPEs made once while the operands' shapes do not change
  (:mod:`.segments`);
* :func:`dense` -- runs of products by constant weights, residual adds, RMS norms and SwiGLU gates become one
  step that replays them in one kernel call while its inputs are one row of the shapes it checked
  (:mod:`.dense`);
* :func:`liveness` -- the slots each step is the last to read are dropped after it (:mod:`.liveness`).

:func:`~.execute.execute` runs the steps; a session holds only per-run values and the states of
stateful nodes.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ...errors import GraphError, NnefKvError
from ..graph import Graph, InputSpec, Node, slots_of as _slots_of
from ...core.registry import Primitive
from ..values import Lazy
from . import blockweights as B
from . import fuse as F
from . import liveness as L
from . import specialize as SP
from . import weights as W
from .steps import Step, fetch as _fetch, has_lazy as _has_lazy, make_step, store as _store

__all__ = ["Plan", "build_plan", "fingerprint", "PASSES"]


@dataclass
class Plan:
    graph: Graph
    base: list[Any]  # initial value list: constants in place, None elsewhere
    steps: list[Step]
    step_nodes: list[Node]
    stateful: list[tuple[int, Node]]  # (state index, node)
    inputs: list[InputSpec]
    outputs: list[tuple[str, int]]
    fingerprint: str
    info: dict[str, int] = field(default_factory=dict)
    #: per step: slots no later step reads (dropped once it has run); outputs and constants never are
    frees: list[tuple[int, ...]] = field(default_factory=list)
    #: per step: ``(step, frees)``, what :func:`execute` iterates over
    program: list[tuple[Step, tuple[int, ...]]] = field(default_factory=list)
    _keeping: dict[frozenset[int], list[tuple[Step, tuple[int, ...]]]] = field(default_factory=dict, repr=False)
    #: slots of producers fused into their reader (:mod:`.fuse`): never materialised by this plan
    elided: frozenset[int] = frozenset()
    _unfused: "Plan | None" = field(default=None, repr=False)
    _stepwise: dict[int, "Plan"] = field(default_factory=dict, repr=False)

    def stepwise(self, token_slot: int) -> "Plan":
        """This plan as a stepwise run executes it (:meth:`Session.run` with ``stepwise=True``), built once
        per token symbol: every stateful node calls its state's ``stepwise`` instead of the state itself,
        and a ``slice`` of a token-carrying value that keeps only the last of the run's ``C`` tokens
        (``C > 1``, the value of the symbol in slot ``token_slot``) passes every token through, so an
        output a one-token run gives for its token comes out for each of the ``C`` tokens."""
        from .stepwise import stepwise_plan

        got = self._stepwise.get(token_slot)
        if got is None:
            got = stepwise_plan(self, token_slot)
            self._stepwise[token_slot] = got
        return got

    def unfused(self) -> "Plan":
        """The same graph planned without op fusion (every slot materialised), built once: what a run
        capturing an elided slot executes. Its stateful nodes are this plan's, in the same order."""
        if not self.elided:
            return self
        if self._unfused is None:
            p = build_plan(self.graph, fuse_ops=False)
            p.fingerprint = self.fingerprint
            self._unfused = p
        return self._unfused

    @property
    def input_names(self) -> list[str]:
        return [i.name for i in self.inputs]

    def program_keeping(self, keep: frozenset[int]) -> list[tuple[Step, tuple[int, ...]]]:
        """The program with the slots in ``keep`` never dropped (values captured by name), cached."""
        if not keep:
            return self.program
        prog = self._keeping.get(keep)
        if prog is None:
            prog = [(st, tuple(s for s in dead if s not in keep)) for st, dead in self.program]
            if len(self._keeping) < 64:
                self._keeping[keep] = prog
        return prog

    def slot_of(self, name: str) -> int | None:
        """The slot of a graph-body identifier, else of a node (by name, its first output); None if neither."""
        slot = self.graph.names.get(name)
        if slot is not None:
            return slot
        for spec in self.graph.inputs:
            if spec.name == name:
                return spec.slot
        for node in self.graph.nodes:
            if node.name == name and node.outputs:
                return _slots_of(node.outputs[0])[0]
        return None

    @property
    def output_names(self) -> list[str]:
        return [n for n, _ in self.outputs]


# ------------------------------------------------------------------------------------------------
# The draft the passes transform
# ------------------------------------------------------------------------------------------------
@dataclass
class Item:
    """One node still to become a step: its kernel, argument specs and attributes as the passes leave them."""

    node: Node
    kernel: Callable[..., Any] | None
    ins: list[Any]
    attrs: dict[str, Any]
    state: int | None = None  # the state index of a stateful node
    rewritten: bool = False  # by the weights pass (then not specialised)
    fused: bool = False  # a fused producer*mul item


@dataclass
class Draft:
    graph: Graph
    flags: dict[str, bool]
    base: list[Any]
    consts: set[int]
    items: list[Item]
    stateful: list[tuple[int, Node]] = field(default_factory=list)
    elided: set[int] = field(default_factory=set)
    info: dict[str, int] = field(default_factory=dict)
    steps: list[Step] = field(default_factory=list)
    step_nodes: list[Node] = field(default_factory=list)
    #: (step index, input slot, [in, out] weight, output slot, slot of that weight in base)
    projections: list[tuple[int, int, np.ndarray, int, int]] = field(default_factory=list)
    #: base slots of the prepared weights of products (see weights.place_weights)
    weight_slots: list[int] = field(default_factory=list)
    frees: list[tuple[int, ...]] | None = None
    #: id(step node) -> its block-weight product (:mod:`.blockweights`)
    block_products: dict[int, Any] = field(default_factory=dict)


def nested(d: Draft) -> None:
    """Nodes running a nested graph get a kernel (or, for scans, a state factory) running its plan."""
    for item in d.items:
        if item.node.body is not None:
            prim = _nested_primitive(item.node)
            item.node = dataclasses.replace(item.node, prim=prim)
            item.kernel = prim.kernel


def _nested_primitive(node: Node) -> Primitive:
    body = build_plan(node.body)
    if body.stateful:
        raise GraphError(f"{node.location}: {node.op} '{node.name}': its "
                         f"{'body fragment' if node.op == 'tract_core_scan' else 'sub-model'} has stateful operations")
    if node.op == "tract_core_scan":
        from ..ops.tract_scan import ScanLoop

        run = _body_runner(body)
        spec = node.extra
        return dataclasses.replace(node.prim, state_factory=lambda **_: ScanLoop(spec, run))
    from .execute import bind_inputs, execute

    names = [i.name for i in body.inputs]

    def run_submodel(inputs: list[np.ndarray], label: str = "") -> Any:
        v = bind_inputs(body, {n: x for n, x in zip(names, inputs)})
        execute(body, v, [])
        outs = tuple(v[s] for _, s in body.outputs)
        return outs[0] if len(outs) == 1 else outs

    return dataclasses.replace(node.prim, kernel=run_submodel)


def _body_runner(body: Plan) -> Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """A planned scan body as ``feed by parameter -> results by name``."""
    from .execute import execute

    base = body.base
    in_slots = {i.name: i.slot for i in body.inputs}

    def run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        v = base.copy()
        for name, slot in in_slots.items():
            v[slot] = feed[name]
        execute(body, v, [])
        return {name: v[slot] for name, slot in body.outputs}
    return run


def fold(d: Draft) -> None:
    """Run the nodes whose inputs are all constants and whose attributes are static, now."""
    kept: list[Item] = []
    base, consts = d.base, d.consts
    for item in d.items:
        node = item.node
        in_slots = [s for spec in node.inputs for s in _slots_of(spec)]
        if (item.state is None and item.kernel is not None and not _has_lazy(node.attrs)
                and all(s in consts for s in in_slots) and all(not isinstance(o, tuple) for o in node.outputs)
                and node.op != "<lazy_constant>"):
            try:
                args = [_fetch(s, base) for s in node.inputs]
                if any(B.is_block(a) for a in args):  # a Q4_0 / Q8_1 weight: a view of its blocks, or dequantized
                    result = B.fold_block(node, item.kernel, args)
                else:
                    result = item.kernel(*args, **node.attrs)
                _store(node.outputs, result, base, node)
            except NnefKvError:
                raise
            except Exception as exc:
                raise GraphError(f"{node.location}: {node.op} '{node.name}' failed on constants: {exc}") from exc
            for o in node.outputs:
                if not B.is_block(base[o]):
                    base[o] = np.asarray(base[o])
                consts.add(o)
            d.info["folded"] = d.info.get("folded", 0) + 1
            continue
        kept.append(item)
    d.items = kept


def fuse(d: Draft) -> None:
    """``mul(producer(x), w)`` with a fresh-result producer read only there: one item (see :mod:`.fuse`)."""
    pairs = F.fusion_pairs(d.graph)
    if not pairs:
        return
    from ..catalog import lookup

    mul = lookup("mul").kernel  # type: ignore[union-attr]
    pending: dict[int, tuple[Node, Callable]] = {}
    kept: list[Item] = []
    for item in d.items:
        node = item.node
        if item.state is None and len(node.outputs) == 1 and node.outputs[0] in pairs:
            fast = SP.specialize(node.prim, node.attrs) if d.flags["specialize_kernels"] else None
            pending[node.outputs[0]] = (node, fast or functools.partial(item.kernel, **node.attrs))
            continue
        if pending and item.state is None and item.kernel is mul and any(s in pending for s in node.inputs):
            pos = 0 if node.inputs[0] in pending else 1
            out, other = node.inputs[pos], node.inputs[1 - pos]
            producer, first = pending.pop(out)
            fnode = F.fused_node(producer, node, other)
            kept.append(Item(fnode, F.fused_product(first, pos, mul), list(fnode.inputs), {}, fused=True))
            d.elided.add(out)
            continue
        kept.append(item)
    if pending:  # fusion_pairs promised a reader for each: a bug, not a model error
        raise GraphError(f"{d.graph.filename}: internal error: fused producers without their reader "
                         f"{sorted(n.name for n, _ in pending.values())}")
    d.items = kept


def weights(d: Draft) -> None:
    """Products by constant weights get their weight pre-transposed (see :mod:`.weights`). Not in a plan
    built with ``prepare_weights=False`` (:func:`unprepared_weights`)."""
    if not d.flags["prepare_weights"]:
        unprepared_weights(d)
        return
    for item in d.items:
        if item.state is not None or item.fused:
            continue
        rw = B.rewrite_block_product(item.node, d.base, d.consts)
        if rw is not None:  # the step reads the product's operands only: the block weight is in the kernel
            item.node = dataclasses.replace(item.node, inputs=list(rw[1]), attrs={})
        else:  # a block weight this product does not take (or no numba kernels): its f32 values, once
            d.info["dequantized_weights"] = d.info.get("dequantized_weights", 0) + B.materialize([item.node], d.base)
            rw = W.rewrite_weights(item.node, d.base, d.consts)
        if rw is not None:
            item.kernel, item.ins, item.attrs = rw
            item.rewritten = True


def unprepared_weights(d: Draft) -> None:
    """The plan of a check (``nnef-kv inspect``, :mod:`nnef_kv.interpreter.check`): no weight is transposed,
    joined, repacked or dequantized for the plan; products run the generic kernels on the archive's arrays
    as they are, and a step reading a block weight (Q4_0 / Q8_1) gets it dequantized for that call only."""
    for item in d.items:
        if item.state is not None:
            continue
        blocks = [i for i, spec in enumerate(item.ins) if isinstance(spec, int) and spec in d.consts
                  and B.is_block(d.base[spec])]
        if blocks and item.kernel is not None:
            item.kernel = B.dequantizing(item.kernel, blocks)
            item.rewritten = True  # the wrapper stays: not replaced by a specialised kernel
        nested = [spec for spec in item.ins if not isinstance(spec, int)]
        if any(B.is_block(d.base[s]) for spec in nested for s in _slots_of(spec) if s < len(d.base)):
            B.materialize([dataclasses.replace(item.node, inputs=nested)], d.base)  # in a list: once, as before


def specialize(d: Draft) -> None:
    """Kernels with static attributes replaced by the closure their op registered (see :mod:`.specialize`)."""
    for item in d.items:
        if item.state is not None or item.fused or item.rewritten or _has_lazy(item.attrs):
            continue
        fast = SP.specialize(item.node.prim, item.attrs)
        if fast is not None:
            item.kernel, item.attrs = fast, {}
            while item.ins and item.ins[-1] is None:  # absent optional inputs: the specialised kernel's defaults
                item.ins.pop()
            d.info["specialized"] = d.info.get("specialized", 0) + 1


def steps(d: Draft) -> None:
    """Every item becomes one step closure."""
    for item in d.items:
        node = item.node
        if item.state is None and item.kernel is None:
            raise GraphError(f"{node.location}: operation '{node.op}' has no kernel (node '{node.name}')")
        ins = item.ins
        at = len(d.base)  # where make_step puts the step's first constant (a product's weight)
        product = False  # a product by a constant weight, no bias, one output: projections and .dense take it
        if item.rewritten and item.kernel in (W._matmul_pretransposed, W._linear_pretransposed) \
                and isinstance(ins[0], int):
            # the weight, ("const", wt) after an input slot, is the step's first constant
            d.weight_slots.append(at)
            product = (item.kernel is W._matmul_pretransposed or ins[2] is None) and len(node.outputs) == 1 \
                and isinstance(node.outputs[0], int)
            if product:
                d.projections.append((len(d.steps), ins[0], ins[1][1], node.outputs[0], at))
        if isinstance(item.kernel, B.BlockLinear):
            d.block_products[id(node)] = item.kernel
            d.info["block_products"] = d.info.get("block_products", 0) + 1
        kernel = item.kernel if item.state is None else (node.prim.kernel or (lambda *a: None))
        step = make_step(node, kernel, list(item.ins), item.attrs, item.state, d.base)
        if product:
            # what a run of .dense may replay. The weight by its slot: the projections pass may move it into huge
            # pages (W.place_weights), and the step reads it there
            step.product = (ins[0], at, ((node.outputs[0], 0, ins[1][1].shape[-1]),))  # type: ignore[attr-defined]
        d.steps.append(step)
        d.step_nodes.append(node)


def projections(d: Draft) -> None:
    """Products of one input by several constant weights become one product (see :mod:`.weights` and, for
    block-quantized weights, :mod:`.blockweights`)."""
    if d.projections:
        d.steps, d.step_nodes, n = W.fuse_projections(d.steps, d.step_nodes, d.projections, d.base)
        d.info["fused_projections"] = n
    if d.weight_slots:  # the products' weights left alone (not fused): into huge pages too
        W.place_weights(d.base, d.weight_slots)
    if d.block_products:
        found = {i: d.block_products[id(nd)] for i, nd in enumerate(d.step_nodes) if id(nd) in d.block_products}
        d.steps, d.step_nodes, n = B.fuse_block_projections(d.steps, d.step_nodes, found)
        d.info["fused_projections"] = d.info.get("fused_projections", 0) + n


def patterns(d: Draft) -> None:
    """Exporters' chains of small steps -> one step each (see :mod:`.patterns`)."""
    from .patterns import fuse_patterns

    d.steps, d.step_nodes, elided, counts = fuse_patterns(d.graph, d.steps, d.step_nodes, d.base,
                                                          kernels=d.flags["prepare_weights"])
    d.info["fused_ops"] = len(d.elided)  # the producer*mul pairs of the fuse pass, counted before the chains
    d.elided |= elided
    d.info["fused_chains"] = sum(counts.values())


def memo(d: Draft) -> None:
    """Shape-only steps grouped and run once per tuple of the shapes they read (see :mod:`.chains`)."""
    from .chains import memo_groups

    d.steps, d.step_nodes, n = memo_groups(d.graph, d.steps, d.step_nodes, d.base)
    d.info["memo_steps"] = n


def cache_append(d: Draft) -> None:
    """Explicit-cache concats grow a buffer instead of copying (see :mod:`.cache_append`)."""
    from .cache_append import rewrite_cache_concats

    d.steps, n = rewrite_cache_concats(d.graph, d.steps, d.step_nodes)
    d.info["cache_appends"] = n


def segments(d: Draft) -> None:
    """A layer's q/k/v views, RoPEs and cache appends become one step with their attention (see
    :mod:`.segments`)."""
    from .segments import segments_of

    _replaying(d, segments_of, "attention_segments")


def dense(d: Draft) -> None:
    """Runs of products, residual adds, RMS norms and SwiGLU gates become one step replaying them in one
    kernel call on a decode step's row (see :mod:`.dense`)."""
    from .dense import dense_runs

    _replaying(d, dense_runs, "dense_runs")


def _replaying(d: Draft, rewrite: Callable[..., tuple], count: str) -> None:
    """Steps -> the steps ``rewrite(graph, steps, nodes, base)`` returns with the slots it no longer materialises
    and how many steps it made (``d.info[count]``); not in a check's plan, which runs no kernels."""
    if not d.flags["prepare_weights"]:
        return
    d.steps, d.step_nodes, elided, n = rewrite(d.graph, d.steps, d.step_nodes, d.base)
    d.elided |= elided
    d.info[count] = n


def liveness(d: Draft) -> None:
    # block weights no product took: dequantized, as before (a check's plan dequantizes them at each call)
    n = B.materialize(d.step_nodes, d.base) if d.flags["prepare_weights"] else 0
    n += d.info.pop("dequantized_weights", 0)
    if n:
        d.info["dequantized_weights"] = n
    d.frees = L.liveness(d.graph, d.step_nodes, d.base)


#: the passes, in order; a flag of :func:`build_plan` turns the optional ones off
PASSES: tuple[tuple[Callable[[Draft], None], str | None], ...] = (
    (nested, None), (fold, "fold_constants"), (fuse, "fuse_ops"), (weights, None),
    (specialize, "specialize_kernels"), (steps, None), (projections, "fuse_projections"), (memo, "specialize_kernels"),
    (patterns, "fuse_ops"), (cache_append, "specialize_kernels"), (segments, "fuse_ops"),
    (dense, "fuse_ops"), (liveness, None),
)


def build_plan(graph: Graph, fold_constants: bool = True, fuse_projections: bool = True,
               specialize_kernels: bool = True, fuse_ops: bool = True, prepare_weights: bool = True) -> Plan:
    """Compile a graph by running :data:`PASSES` (see the module docstring). ``prepare_weights=False``: the
    weights are left as the archive holds them (:func:`unprepared_weights`; a check's plan)."""
    base: list[Any] = [None] * graph.nslots
    for s, arr in graph.constants.items():
        base[s] = arr
    flags = {"fold_constants": fold_constants, "fuse_projections": fuse_projections,
             "specialize_kernels": specialize_kernels, "fuse_ops": fuse_ops, "prepare_weights": prepare_weights}
    items: list[Item] = []
    stateful: list[tuple[int, Node]] = []
    for node in graph.nodes:
        if node.prim.stateful and node.body is None:
            stateful.append((len(stateful), node))
            items.append(Item(node, None, list(node.inputs), node.attrs, state=len(stateful) - 1))
        else:
            items.append(Item(node, node.prim.kernel, list(node.inputs), node.attrs))
    d = Draft(graph, flags, base, set(graph.constants), items,
              info={"nodes": len(graph.nodes), "folded": 0, "specialized": 0, "fused_projections": 0})
    for run, flag in PASSES:
        if flag is None or flags[flag]:
            run(d)
        if run is nested:  # scans became stateful nodes with their factory
            d.stateful = []
            for item in d.items:
                if item.node.prim.stateful:
                    item.state = len(d.stateful)
                    item.kernel = None
                    d.stateful.append((item.state, item.node))
    for name, slot in graph.outputs:
        if base[slot] is None and slot not in {i.slot for i in graph.inputs} and not any(
            slot in _slots_of(o) for n in d.step_nodes for o in n.outputs
        ):
            raise GraphError(f"{graph.filename}: output '{name}' is not computed by the graph")
    live = d.frees is not None
    frees = d.frees if d.frees is not None else [() for _ in d.steps]
    info = dict(d.info, steps=len(d.steps), liveness=int(live))
    info.setdefault("fused_ops", len(d.elided))
    return Plan(graph, base, d.steps, d.step_nodes, d.stateful, graph.inputs, graph.outputs, fingerprint(graph),
                info, frees, list(zip(d.steps, frees)), elided=frozenset(d.elided))


def fingerprint(graph: Graph) -> str:
    """Identity of a model for saved state: graph signature + node names, ops and static attributes."""
    h = hashlib.sha256()
    head = {
        "name": graph.name,
        "inputs": [(i.name, str(i.dtype), [str(d) if not isinstance(d, Lazy) else d.text for d in i.shape])
                   for i in graph.inputs],
        "outputs": [n for n, _ in graph.outputs],
    }
    h.update(json.dumps(head, sort_keys=True, default=str).encode())
    for n in graph.nodes:
        attrs = {k: (a.text if isinstance(a, Lazy) else a) for k, a in n.attrs.items()}
        h.update(json.dumps([n.name, n.op, attrs], sort_keys=True, default=repr).encode())
    return h.hexdigest()
