"""How a planned node becomes one step closure ``step(values, states)``: argument slots and static
attributes resolved once, run-time attributes evaluated inside the step."""
from __future__ import annotations

from typing import Any, Callable

from ...errors import GraphError
from ..graph import Node
from ..values import Lazy

Step = Callable[[list, list], None]

__all__ = ["Step", "make_step", "fetch", "store", "static_attrs", "symbolic_attrs", "has_lazy", "replace_steps"]


def replace_steps(steps: list[Any], nodes: list[Node], replace: dict[int, tuple[Any, Node]], drop: set[int]
                  ) -> tuple[list[Any], list[Node], int]:
    """``steps`` / ``nodes`` with step ``i`` replaced by ``replace[i]`` (a (step, node) pair) and the steps in
    ``drop`` left out (a fusion's other members); returns them and how many were dropped."""
    out_s, out_n = [], []
    for i, (st, nd) in enumerate(zip(steps, nodes)):
        if i in drop:
            continue
        if i in replace:
            st, nd = replace[i]
        out_s.append(st)
        out_n.append(nd)
    return out_s, out_n, len(drop)


def has_lazy(attrs: dict[str, Any]) -> bool:
    return any(isinstance(v, Lazy) for v in attrs.values())


def fetch(spec: Any, v: list) -> Any:
    if spec is None:
        return None
    if isinstance(spec, int):
        return v[spec]
    if isinstance(spec, tuple):  # ("list", slot)
        return list(v[spec[1]])
    return [v[s] for s in spec]


def store(outs: list[Any], result: Any, v: list, node: Node) -> None:
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


def static_attrs(attrs: dict[str, Any]) -> dict[str, Any]:
    return {k: a for k, a in attrs.items() if not isinstance(a, Lazy)}


def symbolic_attrs(attrs: dict[str, Any]) -> dict[str, Any]:
    """Attributes for a state factory: a Lazy one becomes its text (``"P"``, ``[1, 8, "P", 64]``)."""
    out = {}
    for k, a in attrs.items():
        out[k] = lazy_text(a) if isinstance(a, Lazy) else a
    return out


def lazy_text(a: Lazy) -> Any:
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


def make_step(node: Node, kernel: Callable, ins: list[Any], attrs: dict[str, Any], state_index: int | None,
               base: list[Any]) -> Step:
    outs = node.outputs
    lazy = [(k, a.fn) for k, a in attrs.items() if isinstance(a, Lazy)]
    static = static_attrs(attrs)
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
                store(outs, st[k](*[fetch(s, v) for s in ins]), v, node)
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
        store(outs, kernel(*[fetch(s, v) for s in ins], **kw), v, node)
    return step
