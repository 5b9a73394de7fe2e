"""Graph -> Plan: a flat list of step closures, built once per model.

What happens here, once:
* constant folding: a stateless node whose inputs are all constants and whose attributes are static is
  run now and its outputs become constants (``unsqueeze(weight)``, casts of weights, ...);
* weight layout: ``linear(x, W)`` and ``matmul(x, W, transposeB = true)`` with a constant ``W`` get ``W``
  pre-transposed to a contiguous ``[in, out]`` array, so the run does a plain ``x @ Wt``;
* dispatch: every node becomes one closure ``step(values, states)`` with its argument slots and static
  attributes already resolved; attributes that need run-time values are evaluated inside the step.

A session holds only per-run values and the states of stateful nodes.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..errors import GraphError, InputError, NnefKvError
from .graph import Graph, InputSpec, Lazy, Node

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

    @property
    def input_names(self) -> list[str]:
        return [i.name for i in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [n for n, _ in self.outputs]


def _has_lazy(attrs: dict[str, Any]) -> bool:
    return any(isinstance(v, Lazy) for v in attrs.values())


def _slots_of(spec: Any) -> list[int]:
    if spec is None:
        return []
    if isinstance(spec, int):
        return [spec]
    if isinstance(spec, tuple):
        return [spec[1]]
    return list(spec)


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
    """``a @ bt`` with the leading axes of ``a`` folded into rows: one 2-D BLAS call."""
    if a.ndim > 2 and bt.ndim == 2 and a.flags.c_contiguous and a.dtype == bt.dtype:
        return np.matmul(a.reshape(-1, a.shape[-1]), bt).reshape(a.shape[:-1] + (bt.shape[1],))
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


def build_plan(graph: Graph, fold_constants: bool = True) -> Plan:
    """Compile a graph: fold constants, pre-transpose weights, make one closure per remaining node."""
    base: list[Any] = [None] * graph.nslots
    for s, arr in graph.constants.items():
        base[s] = arr
    consts = set(graph.constants)
    steps: list[Step] = []
    step_nodes: list[Node] = []
    stateful: list[tuple[int, Node]] = []
    folded = 0
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
        rw = _rewrite_weights(node, base, consts)
        if rw is not None:
            kernel, ins, attrs = rw
        else:
            kernel, ins, attrs = prim.kernel, list(node.inputs), node.attrs
        steps.append(_make_step(node, kernel, ins, attrs, None, base))
        step_nodes.append(node)
    for name, slot in graph.outputs:
        if base[slot] is None and slot not in {i.slot for i in graph.inputs} and not any(
            slot in _slots_of(o) for n in step_nodes for o in n.outputs
        ):
            raise GraphError(f"{graph.filename}: output '{name}' is not computed by the graph")
    return Plan(graph, base, steps, step_nodes, stateful, graph.inputs, graph.outputs, fingerprint(graph),
                {"nodes": len(graph.nodes), "folded": folded, "steps": len(steps)})


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
    return v


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
