"""Graph -> Plan: a flat list of step closures, built once per model.

What happens here, once:
* constant folding: a stateless node whose inputs are all constants and whose attributes are static is
  run now and its outputs become constants (``unsqueeze(weight)``, casts of weights, ...);
* weight layout: ``linear(x, W)`` and ``matmul(x, W, transposeB = true)`` with a constant ``W`` get ``W``
  pre-transposed to a contiguous ``[in, out]`` array, so the run does a plain ``x @ Wt``;
* projection fusion: several such products of one input (q/k/v, gate/up) become one product by the weights
  side by side (``Plan.info["fused_projections"]`` counts the products absorbed);
* specialisation: a kernel whose attributes are all static (reshape, transpose, unsqueeze, rms_norm, sdpa)
  is replaced by a closure with that attribute work done once (:mod:`.specialize`);
* op fusion: ``mul(rms_norm(x), w)`` and ``mul(silu(g), u)`` become one step multiplying the fresh
  producer result in place (:mod:`.fuse`; ``Plan.elided`` lists the values no longer materialised, and a
  run capturing one of them runs :meth:`Plan.unfused`);
* dispatch: every node becomes one closure ``step(values, states)`` with its argument slots and static
  attributes already resolved; attributes that need run-time values are evaluated inside the step
  (integer arithmetic on symbols such as ``P + S`` through a compiled closure, see ``graph.py``);
* liveness: after each step, the slots whose last reader it was are dropped from the run's value list
  (``Plan.frees``), so a run holds only the values still needed, not one per node.

:func:`execute` runs the steps (errors name the node and its source location); a session holds only
per-run values and the states of stateful nodes.
"""
from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..errors import GraphError, InputError, NnefKvError, NnefSyntaxError
from .graph import Graph, InputSpec, Node
from .values import Lazy
from .graph import slots_of as _slots_of
from .parallel import SPLITTER, split_matmul
from .fuse import fused_node, fused_product, fusion_pairs
from .registry import lookup
from .specialize import specialize

Step = Callable[[list, list], None]


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
        got = self._stepwise.get(token_slot)
        if got is None:
            got = _stepwise_plan(self, token_slot)
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


def _has_lazy(attrs: dict[str, Any]) -> bool:
    return any(isinstance(v, Lazy) for v in attrs.values())


def _fetch(spec: Any, v: list) -> Any:
    if spec is None:
        return None
    if isinstance(spec, int):
        return v[spec]
    if isinstance(spec, tuple):  # ("list", slot)
        return list(v[spec[1]])
    return [v[s] for s in spec]


def _store(outs: list[Any], result: Any, v: list, node: Node) -> None:
    if len(outs) == 1:
        if isinstance(result, tuple) and len(result) == 1 and isinstance(outs[0], int):
            result = result[0]  # a one-output multi-result kernel (tract_core_scan)
        results = (result,)
    else:
        if not isinstance(result, (tuple, list)) or len(result) != len(outs):
            raise GraphError(f"{node.location}: {node.op} '{node.name}' returned the wrong number of results")
        results = tuple(result)
    for spec, r in zip(outs, results):
        if isinstance(spec, tuple):
            v[spec[1]] = list(r)
        else:
            v[spec] = r


def _static_attrs(attrs: dict[str, Any]) -> dict[str, Any]:
    return {k: a for k, a in attrs.items() if not isinstance(a, Lazy)}


def _symbolic_attrs(attrs: dict[str, Any]) -> dict[str, Any]:
    """Attributes for a state factory: a Lazy one becomes its text (``"P"``, ``[1, 8, "P", 64]``)."""
    out = {}
    for k, a in attrs.items():
        out[k] = _lazy_text(a) if isinstance(a, Lazy) else a
    return out


def _lazy_text(a: Lazy) -> Any:
    t = a.text
    if t.startswith("[") and t.endswith("]"):
        items = [x.strip() for x in t[1:-1].split(",")] if t[1:-1].strip() else []
        res: list[Any] = []
        for it in items:
            try:
                res.append(int(it))
            except ValueError:
                res.append(it)
        return res
    return t


# ------------------------------------------------------------------------------------------------
# Plan-time rewrites
# ------------------------------------------------------------------------------------------------


def _matmul_pretransposed(a: np.ndarray, bt: np.ndarray) -> np.ndarray:
    """``a @ bt`` with the leading axes of ``a`` folded into rows: one 2-D BLAS call (split in two column
    halves across two threads when the session runs with ``threads = 2``, see :mod:`.parallel`)."""
    if a.ndim > 2 and bt.ndim == 2 and a.flags.c_contiguous and a.dtype == bt.dtype:
        return split_matmul(a.reshape(-1, a.shape[-1]), bt).reshape(a.shape[:-1] + (bt.shape[1],))
    if a.ndim == 2 and bt.ndim == 2:
        return split_matmul(a, bt)
    return np.matmul(a, bt)


def _linear_pretransposed(x: np.ndarray, wt: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    y = _matmul_pretransposed(x, wt)
    if bias is not None:
        if bias.ndim == 0 or bias.size == 1:
            if bias.reshape(()).item() != 0:
                y = y + bias.reshape(()).astype(y.dtype)
        else:
            y = y + bias.astype(y.dtype, copy=False)
    return y


def _prepare_weight(w: np.ndarray) -> np.ndarray:
    """``W [.., out, in]`` -> contiguous ``[in, out]`` (leading unit axes dropped)."""
    while w.ndim > 2 and w.shape[0] == 1:
        w = w[0]
    return np.ascontiguousarray(np.swapaxes(w, -1, -2))


def _rewrite_weights(node: Node, base: list[Any], consts: set[int]) -> tuple[Callable, list[Any], dict] | None:
    """linear / matmul(transposeB) with a constant weight -> a kernel on a pre-transposed weight."""
    if node.op == "linear" and isinstance(node.inputs[1], int) and node.inputs[1] in consts and not node.attrs:
        w = base[node.inputs[1]]
        x_rank_ok = w.ndim >= 2 and all(d == 1 for d in w.shape[:-2])
        if not x_rank_ok or w.dtype.kind != "f":
            return None
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        wt = _prepare_weight(w)
        return _linear_pretransposed, [node.inputs[0], ("const", wt), bias], {}
    if node.op == "matmul" and isinstance(node.inputs[1], int) and node.inputs[1] in consts:
        attrs = node.attrs
        if _has_lazy(attrs) or attrs.get("transposeA", False) or not attrs.get("transposeB", False):
            return None
        w = base[node.inputs[1]]
        if w.ndim < 2 or w.dtype.kind != "f" or any(d != 1 for d in w.shape[:-2]):
            return None
        return _matmul_pretransposed, [node.inputs[0], ("const", _prepare_weight(w))], {}
    return None


# ------------------------------------------------------------------------------------------------
# Step construction
# ------------------------------------------------------------------------------------------------


def _make_step(node: Node, kernel: Callable, ins: list[Any], attrs: dict[str, Any], state_index: int | None,
               base: list[Any]) -> Step:
    outs = node.outputs
    lazy = [(k, a.fn) for k, a in attrs.items() if isinstance(a, Lazy)]
    static = _static_attrs(attrs)
    # inline constants that are only needed by this step
    resolved: list[Any] = []
    for spec in ins:
        if isinstance(spec, tuple) and spec[0] == "const":
            s = len(base)
            base.append(spec[1])
            resolved.append(s)
        else:
            resolved.append(spec)
    ins = resolved
    simple = all(isinstance(s, int) for s in ins) and len(outs) == 1 and isinstance(outs[0], int)
    if state_index is not None:
        k = state_index
        if simple:
            o = outs[0]
            idx = tuple(ins)

            def step(v: list, st: list) -> None:
                v[o] = st[k](*[v[i] for i in idx])
        else:
            def step(v: list, st: list) -> None:
                _store(outs, st[k](*[_fetch(s, v) for s in ins]), v, node)
        return step
    if simple and not lazy:
        o = outs[0]
        if len(ins) == 1:
            (i0,) = ins
            if static:
                def step(v: list, st: list) -> None:
                    v[o] = kernel(v[i0], **static)
            else:
                def step(v: list, st: list) -> None:
                    v[o] = kernel(v[i0])
            return step
        if len(ins) == 2:
            i0, i1 = ins
            if static:
                def step(v: list, st: list) -> None:
                    v[o] = kernel(v[i0], v[i1], **static)
            else:
                def step(v: list, st: list) -> None:
                    v[o] = kernel(v[i0], v[i1])
            return step
        idx = tuple(ins)

        def step(v: list, st: list) -> None:
            v[o] = kernel(*[v[i] for i in idx], **static)
        return step

    def step(v: list, st: list) -> None:
        kw = dict(static)
        for name, fn in lazy:
            kw[name] = fn(v)
        _store(outs, kernel(*[_fetch(s, v) for s in ins], **kw), v, node)
    return step


def _liveness(graph: Graph, step_nodes: list[Node], base: list[Any]) -> list[tuple[int, ...]] | None:
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


def node_error(node: Node, exc: BaseException) -> NnefKvError:
    """An error raised inside a node's kernel, as ``file:line:col: node 'name' (op): message``.

    An nnef-kv error keeps its type (an InputError stays one); any other exception becomes a GraphError
    (its type name is kept in the message). The original is chained as ``__cause__``."""
    if isinstance(exc, NnefKvError) and getattr(exc, "node", None) is not None:
        return exc  # already placed (a nested plan: scan body, sub-model)
    prefix = f"{node.location}: node '{node.name}' ({node.op}): "
    if isinstance(exc, NnefKvError) and not isinstance(exc, NnefSyntaxError):
        msg = str(exc)
        cls: type[NnefKvError] = type(exc)
    else:
        msg = f"{type(exc).__name__}: {exc}"
        cls = GraphError
    try:
        err = cls(prefix + msg)
    except TypeError:  # an error type with another constructor
        err = GraphError(prefix + msg)
    err.node = node.name  # type: ignore[attr-defined]
    err.location = node.location  # type: ignore[attr-defined]
    return err


def execute(plan: Plan, v: list, st: list, keep: frozenset[int] = frozenset(), threads: int = 1,
            taps: dict[int, Callable[[Any], None]] | None = None) -> None:
    """Run every step of ``plan`` on the value list ``v`` (from :func:`bind_inputs`) and states ``st``,
    dropping values after their last reader unless their slot is in ``keep``. ``threads = 2`` splits large
    products by constant weights across the caller and a helper thread (:mod:`.parallel`).

    ``taps``: ``slot -> fn``, each called with the slot's value right after the step producing it (or
    before the first step for a value already bound: an input, a constant), before liveness may drop it."""
    program = plan.program_keeping(keep) if keep else plan.program
    if taps:
        program = _tapped(plan, program, v, taps)
    i = 0
    split = threads > 1 and not SPLITTER.active
    if split:
        SPLITTER.active = True
    try:
        for step, dead in program:
            step(v, st)
            if dead:
                for s in dead:
                    v[s] = None
            i += 1
    except Exception as exc:
        raise node_error(plan.step_nodes[i], exc) from exc
    finally:
        if split:
            SPLITTER.active = False


def _tapped(plan: Plan, program: list, v: list, taps: dict[int, Callable[[Any], None]]) -> list:
    pending = dict(taps)
    for slot in list(pending):
        if v[slot] is not None:  # bound before the run
            pending.pop(slot)(v[slot])
    if not pending:
        return program
    out = list(program)
    for i, node in enumerate(plan.step_nodes):
        here = [s for spec in node.outputs for s in _slots_of(spec) if s in pending]
        if not here:
            continue
        fns = [(s, pending.pop(s)) for s in here]
        step, dead = out[i]

        def tapped(vv: list, st: list, step: Step = step, fns: list = fns) -> None:
            step(vv, st)
            for s, fn in fns:
                fn(vv[s])
        out[i] = (tapped, dead)
    return out


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


def _fuse_projections(steps: list[Step], step_nodes: list[Node],
                      projections: list[tuple[int, int, np.ndarray, int, int]], base: list[Any]
                      ) -> tuple[list[Step], list[Node], int]:
    """Products of one input by several constant weights (q/k/v, gate/up) -> one product by the weights
    side by side, run where the first of them was; each output is a column slice of the result. The
    others' inputs are that same input and constants, so running them earlier changes nothing."""
    groups: dict[int, list[tuple[int, int, np.ndarray, int, int]]] = {}
    for p in projections:
        groups.setdefault(p[1], []).append(p)
    replace: dict[int, tuple[Step, Node]] = {}
    drop: set[int] = set()
    for x, members in groups.items():
        if len(members) < 2:
            continue
        w0 = members[0][2]
        members = [m for m in members if m[2].shape[0] == w0.shape[0] and m[2].dtype == w0.dtype]
        if len(members) < 2:
            continue
        wt = np.ascontiguousarray(np.concatenate([m[2] for m in members], axis=1))
        parts: list[tuple[int, int, int]] = []
        at = 0
        for m in members:
            parts.append((m[3], at, at + m[2].shape[1]))
            at += m[2].shape[1]
        first = step_nodes[members[0][0]]
        node = Node(first.name, first.op, first.prim, [x] + [n for m in members for n in step_nodes[m[0]].inputs[1:]],
                    {}, [m[3] for m in members], first.location)

        def step(v: list, st: list, x: int = x, wt: np.ndarray = wt, parts: tuple = tuple(parts)) -> None:
            y = _matmul_pretransposed(v[x], wt)
            for o, a, b in parts:
                v[o] = y[..., a:b]

        replace[members[0][0]] = (step, node)
        drop.update(m[0] for m in members[1:])
        for m in members:  # the separate transposed weights are not used any more
            base[m[4]] = None
    if not replace:
        return steps, step_nodes, 0
    new_steps: list[Step] = []
    new_nodes: list[Node] = []
    for i, (st, nd) in enumerate(zip(steps, step_nodes)):
        if i in drop:
            continue
        if i in replace:
            st, nd = replace[i]
        new_steps.append(st)
        new_nodes.append(nd)
    return new_steps, new_nodes, len(drop)


def build_plan(graph: Graph, fold_constants: bool = True, fuse_projections: bool = True,
               specialize_kernels: bool = True, fuse_ops: bool = True) -> Plan:
    """Compile a graph: fold constants, pre-transpose weights, fuse products of one input by several
    constant weights, specialise kernels whose attributes are static (:mod:`.specialize`), fuse
    ``mul(rms_norm(x), w)`` and ``mul(silu(g), u)`` (:mod:`.fuse`), make one closure per remaining node."""
    base: list[Any] = [None] * graph.nslots
    for s, arr in graph.constants.items():
        base[s] = arr
    consts = set(graph.constants)
    steps: list[Step] = []
    step_nodes: list[Node] = []
    stateful: list[tuple[int, Node]] = []
    folded = specialized = 0
    pairs = fusion_pairs(graph) if fuse_ops else {}
    pending: dict[int, tuple[Node, Callable]] = {}  # deferred producers, by output slot
    elided: set[int] = set()
    mul = lookup("mul").kernel if pairs else None  # type: ignore[union-attr]
    # (step, input slot, [in, out] weight, output slot, slot of that weight in base)
    projections: list[tuple[int, int, np.ndarray, int, int]] = []
    for node in graph.nodes:
        prim = node.prim
        if prim.stateful:
            k = len(stateful)
            stateful.append((k, node))
            steps.append(_make_step(node, prim.kernel or (lambda *a: None), list(node.inputs), node.attrs, k, base))
            step_nodes.append(node)
            continue
        if prim.kernel is None:
            raise GraphError(f"{node.location}: operation '{node.op}' has no kernel (node '{node.name}')")
        in_slots = [s for spec in node.inputs for s in _slots_of(spec)]
        if (fold_constants and not _has_lazy(node.attrs) and all(s in consts for s in in_slots)
                and all(not isinstance(o, tuple) for o in node.outputs) and node.op != "<lazy_constant>"):
            v = base
            try:
                result = prim.kernel(*[_fetch(s, v) for s in node.inputs], **node.attrs)
                _store(node.outputs, result, base, node)
            except NnefKvError:
                raise
            except Exception as exc:
                raise GraphError(f"{node.location}: {node.op} '{node.name}' failed on constants: {exc}") from exc
            for o in node.outputs:
                base[o] = np.asarray(base[o])
                consts.add(o)
            folded += 1
            continue
        if pairs and len(node.outputs) == 1 and node.outputs[0] in pairs:  # run later, fused into its reader
            fast = specialize(prim.kernel, node.attrs) if specialize_kernels else None
            pending[node.outputs[0]] = (node, fast or functools.partial(prim.kernel, **node.attrs))
            continue
        if pending and prim.kernel is mul and any(s in pending for s in node.inputs):
            pos = 0 if node.inputs[0] in pending else 1
            out, other = node.inputs[pos], node.inputs[1 - pos]
            producer, first = pending.pop(out)
            fnode = fused_node(producer, node, other)
            steps.append(_make_step(fnode, fused_product(first, pos, mul), list(fnode.inputs), {}, None, base))
            step_nodes.append(fnode)
            elided.add(out)
            continue
        rw = _rewrite_weights(node, base, consts)
        if rw is not None:
            kernel, ins, attrs = rw
            if (kernel is _matmul_pretransposed or (kernel is _linear_pretransposed and ins[2] is None)) \
                    and isinstance(ins[0], int) and len(node.outputs) == 1 and isinstance(node.outputs[0], int):
                projections.append((len(steps), ins[0], ins[1][1], node.outputs[0], len(base)))
        else:
            kernel, ins, attrs = prim.kernel, list(node.inputs), node.attrs
            fast = specialize(kernel, attrs) if specialize_kernels and not _has_lazy(attrs) else None
            if fast is not None:
                kernel, attrs = fast, {}
                while ins and ins[-1] is None:  # absent optional inputs: the specialised kernel's defaults
                    ins.pop()
                specialized += 1
        steps.append(_make_step(node, kernel, ins, attrs, None, base))
        step_nodes.append(node)
    if pending:  # fusion_pairs promised a reader for each: a bug, not a model error
        raise GraphError(f"{graph.filename}: internal error: fused producers without their reader "
                         f"{sorted(n.name for n, _ in pending.values())}")
    if fuse_projections and projections:
        steps, step_nodes, fused = _fuse_projections(steps, step_nodes, projections, base)
    else:
        fused = 0
    for name, slot in graph.outputs:
        if base[slot] is None and slot not in {i.slot for i in graph.inputs} and not any(
            slot in _slots_of(o) for n in step_nodes for o in n.outputs
        ):
            raise GraphError(f"{graph.filename}: output '{name}' is not computed by the graph")
    frees = _liveness(graph, step_nodes, base)
    live = frees is not None
    if frees is None:
        frees = [() for _ in steps]
    return Plan(graph, base, steps, step_nodes, stateful, graph.inputs, graph.outputs, fingerprint(graph),
                {"nodes": len(graph.nodes), "folded": folded, "steps": len(steps), "liveness": int(live),
                 "fused_projections": fused, "specialized": specialized, "fused_ops": len(elided)},
                frees, list(zip(steps, frees)), elided=frozenset(elided))


# ------------------------------------------------------------------------------------------------
# Stepwise runs
# ------------------------------------------------------------------------------------------------

#: ops whose output says nothing about the tokens themselves (a shape is not a token-carrying value)
_SHAPE_OPS = frozenset({"tract_core_shape_of", "shape_of"})


def token_carrying(plan: Plan) -> set[int]:
    """Slots whose value is computed from the graph inputs or the stateful nodes' outputs through data
    (not through a shape): the values a run carries per token."""
    tainted = {spec.slot for spec in plan.inputs}
    for node in plan.step_nodes:
        ins = {s for spec in node.inputs for s in _slots_of(spec)}
        if node.prim.stateful or (node.op not in _SHAPE_OPS and ins & tainted):
            tainted.update(s for spec in node.outputs for s in _slots_of(spec))
    return tainted


def _lifting_slice(node: Node, kernel: Callable, token_slot: int) -> Step:
    """A ``slice`` step that, on a run of ``C > 1`` tokens, passes its input through when it would keep
    only the last of ``C`` entries along a single axis (the bounds are resolved by the slice itself,
    applied to the indices of that axis)."""
    (x_slot,) = node.inputs[:1]
    (out,) = node.outputs
    lazy = [(k, a.fn) for k, a in node.attrs.items() if isinstance(a, Lazy)]
    static = _static_attrs(node.attrs)

    def step(v: list, st: list) -> None:
        kw = dict(static)
        for name, fn in lazy:
            kw[name] = fn(v)
        x = v[x_slot]
        c = v[token_slot]
        axes = list(kw.get("axes", ()))
        if c is not None and int(c) > 1 and len(axes) == 1 and isinstance(x, np.ndarray) and x.ndim:
            a = int(axes[0]) % x.ndim
            n = x.shape[a]
            if n == int(c):
                probe = np.arange(n).reshape([n if i == a else 1 for i in range(x.ndim)])
                kept = np.asarray(kernel(probe, **kw)).ravel()
                if kept.size == 1 and int(kept[0]) == n - 1:
                    v[out] = x
                    return
        v[out] = kernel(x, **kw)
    return step


def _stepwise_plan(plan: Plan, token_slot: int) -> Plan:
    import dataclasses

    tainted = token_carrying(plan)
    state_of = {id(node): k for k, node in plan.stateful}
    program = list(plan.program)
    for i, node in enumerate(plan.step_nodes):
        if node.prim.stateful:
            k = state_of[id(node)]

            def step(v: list, st: list, k: int = k, node: Node = node) -> None:
                _store(node.outputs, st[k].stepwise(*[_fetch(s, v) for s in node.inputs]), v, node)
            program[i] = (step, program[i][1])
        elif (node.op == "slice" and node.inputs and isinstance(node.inputs[0], int) and node.inputs[0] in tainted
              and len(node.outputs) == 1 and isinstance(node.outputs[0], int)):
            program[i] = (_lifting_slice(node, node.prim.kernel, token_slot), program[i][1])
    return dataclasses.replace(plan, steps=[st for st, _ in program], program=program, _keeping={},
                               _unfused=None, _stepwise={})


# ------------------------------------------------------------------------------------------------
# Input binding
# ------------------------------------------------------------------------------------------------


def bind_inputs(plan: Plan, inputs: dict[str, Any], state_symbols: dict[str, tuple[int, str]] | None = None) -> list[Any]:
    """Check the inputs against the declared shapes/dtypes, bind the symbols; return the run's value list.

    ``state_symbols`` are symbols the session's states bind (``P`` = tokens already in a KV cache), with the
    name of the node that binds each. Everything is checked before anything is returned, so a refused run
    touches no state.
    """
    g = plan.graph
    v = plan.base.copy()
    bound: dict[str, tuple[int, str]] = {}
    for sym, (n, who) in (state_symbols or {}).items():
        if sym in g.symbols:
            v[g.symbols[sym]] = n
            bound[sym] = (n, who)
    known = {i.name for i in plan.inputs}
    extra = [k for k in inputs if k not in known]
    if extra:
        raise InputError(f"unknown input '{extra[0]}' (the graph's inputs are {sorted(known)})")
    later: list[tuple[InputSpec, int, Any, int]] = []
    arrays: list[tuple[InputSpec, np.ndarray]] = []
    for spec in plan.inputs:
        if spec.name not in inputs:
            raise InputError(f"missing input '{spec.name}' ({spec.location})")
        x = inputs[spec.name]
        if not isinstance(x, np.ndarray):
            try:
                x = np.asarray(x, dtype=spec.dtype)
            except (TypeError, ValueError) as exc:
                raise InputError(f"input '{spec.name}': cannot convert to {spec.dtype}: {exc}") from None
        if x.dtype != spec.dtype:
            raise InputError(f"input '{spec.name}' has dtype {x.dtype}, the graph declares {spec.dtype}")
        if x.ndim != len(spec.shape):
            raise InputError(
                f"input '{spec.name}' has rank {x.ndim} (shape {list(x.shape)}), the graph declares rank "
                f"{len(spec.shape)}")
        for axis, (d, n) in enumerate(zip(spec.shape, x.shape)):
            if isinstance(d, str):
                slot = g.symbols[d]
                if d in bound and bound[d][0] != n:
                    raise InputError(
                        f"symbol {d} is {bound[d][0]} from input '{bound[d][1]}' but {n} from input "
                        f"'{spec.name}' (axis {axis})")
                bound.setdefault(d, (n, spec.name))
                v[slot] = n
            elif isinstance(d, Lazy):
                later.append((spec, axis, d, n))
            elif int(d) != n:
                raise InputError(
                    f"input '{spec.name}' has shape {list(x.shape)}, the graph declares {d} at axis {axis}")
        arrays.append((spec, x))
    for spec, axis, d, n in later:
        try:
            got = d.fn(v)
        except TypeError:  # an unbound symbol: solve a*s + b = n for the one unknown
            got = _solve(g, d, v, n)
        if got != n:
            raise InputError(
                f"input '{spec.name}' has {n} at axis {axis}, the graph declares {d.text} = {got}")
    for spec, x in arrays:
        v[spec.slot] = x
    if g.assertions:
        check_assertions(g, v)
    return v


def check_assertions(g: Graph, v: list) -> None:
    """InputError naming the first ``tract_assert`` the bound symbols violate (scenario hints and
    assertions on symbols this run does not bind are not checked)."""
    env = {name: int(v[slot]) for name, slot in g.symbols.items() if v[slot] is not None}
    for a in g.assertions:
        try:
            ok = a.check(env)
        except (ValueError, ZeroDivisionError) as exc:
            raise InputError(f"{a.location}: tract_assert {a.text} cannot be evaluated: {exc}") from None
        if ok is False:
            vals = ", ".join(f"{s} = {env[s]}" for s in a.symbols)
            raise InputError(f"{a.location}: tract_assert {a.text} does not hold ({vals})")


def _solve(g: Graph, d: Lazy, v: list, n: int) -> Any:
    unbound = [s for s in g.symbols.values() if v[s] is None]
    if len(unbound) != 1:
        return None
    s = unbound[0]
    v[s] = 0
    f0 = d.fn(v)
    v[s] = 1
    f1 = d.fn(v)
    a = f1 - f0
    if a != 0 and (n - f0) % a == 0:
        v[s] = (n - f0) // a
        return d.fn(v)
    v[s] = None
    return None
