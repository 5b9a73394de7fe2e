"""Running a plan: the inputs checked and bound (symbols, ``tract_assert``), the steps run in order, errors
naming the node and its source location."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ...errors import GraphError, InputError, NnefKvError, NnefSyntaxError, clip, describe, names
from ..graph import Graph, InputSpec, Node, slots_of as _slots_of
from ..values import Lazy
from .parallel import SPLITTER, refresh
from .steps import Step

if TYPE_CHECKING:
    from .core import Plan

__all__ = ["execute", "node_error", "run_members", "bind_inputs", "check_assertions"]


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


def run_members(members: list[tuple[Step, Node]], v: list, st: list) -> None:
    """Run ``(step, node)`` pairs in order (a fused step's members), an error named by the member's node."""
    for s, nd in members:
        try:
            s(v, st)
        except Exception as exc:
            raise node_error(nd, exc) from exc


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
    refresh()
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


def bind_inputs(plan: Plan, inputs: dict[str, Any],
                state_symbols: dict[str, tuple[int, str]] | None = None) -> list[Any]:
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
        raise InputError(f"unknown input {clip(repr(extra[0]), 80)} (the graph's inputs are {names(sorted(known))})")
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
                raise InputError(f"input '{spec.name}': cannot convert {describe(x)} to {spec.dtype}: "
                                 f"{clip(exc, 100)}") from None
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
