"""The stepwise variant of a plan (``Session.run(..., stepwise=True)``): stateful nodes call their state's
``stepwise``, and a slice keeping only the last of a run's tokens passes every token through."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from ..graph import Node, slots_of as _slots_of
from ..values import Lazy
from .steps import Step, fetch as _fetch, static_attrs as _static_attrs, store as _store

__all__ = ["token_carrying", "stepwise_plan"]


#: ops whose output says nothing about the tokens themselves (a shape is not a token-carrying value)
_SHAPE_OPS = frozenset({"tract_core_shape_of", "shape_of"})


def token_carrying(plan: Any) -> set[int]:
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


def stepwise_plan(plan: Any, token_slot: int) -> Any:
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
