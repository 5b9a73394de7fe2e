"""What an attention's mask means, read by evaluating it rather than by where it sits in the graph.

A fused KV op (KIVI, ggml, HF, tract's) masks by itself: full causal, or nothing. Before the converter
replaces an attention, the tensor the exported graph adds to its scores (or passes as sdpa's mask) is
computed by the interpreter on its own: the statements it depends on are cut out of the graph (its
*cone*: the symbols and the graph inputs it reads, never the weights of the model), then run at a ladder
of bindings of the query length ``S`` and of the cached length ``P`` (``S`` = 4 at ``P`` = 0, 3 at 5,
then 2 at ``P`` = 29 ... 17,000, within the graph's ``tract_assert`` bound), inputs as zeros (an input
named like ``*mask*`` as ones: nothing padded), and once more at the first binding with random inputs: a mask
that changes with them depends on data, not lengths (``other``). Each value is read as ``allowed[query, key]`` over the
scores' ``[S, P + S]`` (a float mask allows where it is 0 and blocks where it is <= -1e4; a bool mask
allows where true) and named:

* ``causal``: a query at position ``p`` sees the keys ``0 .. p`` (at every binding);
* ``window``: causal with a sliding window of ``W`` tokens, HF's rule: a query at ``p`` sees ``(p - W, p]``;
* ``none``: every query sees every key (an encoder's attention, or a mask of zeros);
* ``other``: anything else, with what was found (a bias such as ALiBi, a per-head mask, a query that
  sees a later key or none at all, a shape that is not the scores', a mask depending on a session state).

A window longer than the longest binding reads as causal: :attr:`MaskReading.checked` says how far the
reading went. The converter refuses what its scheme's op cannot express (``converters/passes.py``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from ..errors import NnefKvError, clip
from ..grammar import ast as A
from ..interpreter.catalog import ops_with
from .graph_edit import GraphEdit, identifiers, int_list, invocation, stateful_ops

#: a float mask entry at or below this blocks its key (``exp`` of it is 0 in f32)
BLOCKED = -1e4
#: the (S, P) bindings a mask is evaluated at, shortest first
LADDER = ((4, 0), (3, 5), (2, 29), (2, 250), (2, 1500), (2, 4500), (2, 9000), (2, 17000))

_BOUND = re.compile(r"^\s*[A-Za-z_]\w*\s*\+\s*[A-Za-z_]\w*\s*(<=?)\s*([0-9]+)\s*$")


def positions_bound(doc: Any) -> tuple[int, str] | None:
    """``(most positions, the assertion)`` of a ``tract_assert S+P < N`` (or ``<= N``) line, else None."""
    for ext in getattr(doc, "extensions", ()):
        m = _BOUND.match(ext.argument) if ext.name == "tract_assert" else None
        if m:
            n = int(m.group(2))
            return (n - 1 if m.group(1) == "<" else n), f"tract_assert {ext.argument.strip()}"
    return None


@dataclass(frozen=True)
class MaskReading:
    """What one mask is (see the module doc)."""

    kind: str  # "causal", "window", "none" or "other"
    window: int = 0  # the sliding window (kind "window")
    detail: str = ""  # kind "other": what was found, at which binding
    checked: str = ""  # the bindings evaluated, e.g. "S=4 P=0 ... S=2 P=17000 (17002 positions)"

    def describe(self) -> str:
        what = {"causal": "full causal", "none": "no mask (every query sees every key)",
                "window": f"causal with a sliding window of {self.window} tokens (a query at position p sees the "
                          f"keys in (p - {self.window}, p])"}.get(self.kind, self.detail)
        return f"{what}, read by evaluating it at {self.checked}" if self.checked else what


# ----------------------------------------------------------------------------------------------
# one evaluation
# ----------------------------------------------------------------------------------------------
def pattern(value: Any, s: int, p: int, causal_too: bool = False) -> tuple[str, int, str]:
    """Read one evaluation of a mask for ``s`` queries at positions ``p .. p+s-1`` over ``p + s`` keys:
    ``(kind, window, detail)`` with kind ``causal``, ``window``, ``full`` (every key seen), or ``other``.
    ``causal_too``: the attention also masks causally by itself (sdpa's ``is_causal``)."""
    v = np.asarray(value)
    t = p + s
    at = f"at S={s}, P={p}"
    if v.dtype == np.bool_:
        allowed = v
    elif np.issubdtype(v.dtype, np.floating) or np.issubdtype(v.dtype, np.integer):
        f = v.astype(np.float64)
        allowed = f > BLOCKED
        odd = f[allowed & (f != 0)]
        if odd.size:
            return ("other", 0, f"{at} it adds values other than 0 and a large negative to the scores it lets "
                                f"through ({odd.min():g} .. {odd.max():g}): a bias of the scores (ALiBi, relative "
                                f"positions), not a mask")
        if np.isnan(f).any():
            return "other", 0, f"{at} it holds NaN"
    else:
        return "other", 0, f"{at} it is {v.dtype}, neither a float nor a bool mask"
    if allowed.ndim < 2:
        allowed = allowed.reshape((1,) * (2 - allowed.ndim) + allowed.shape)
    try:
        full = np.broadcast_to(allowed, allowed.shape[:-2] + (s, t))
    except ValueError:
        return ("other", 0, f"{at} its shape {list(v.shape)} does not broadcast to the scores' [.., {s}, {t}] "
                            f"(S queries over P + S keys)")
    rows = full.reshape(-1, s, t)
    if any(not np.array_equal(rows[0], r) for r in rows[1:]):
        return "other", 0, f"{at} it differs between batch entries or heads (shape {list(v.shape)})"
    a = rows[0]
    qpos = p + np.arange(s)[:, None]
    key = np.arange(t)[None, :]
    causal = key <= qpos
    if causal_too:
        a = a & causal
    if a.all():
        return "full", 0, ""
    empty = np.flatnonzero(~a.any(axis=1))
    if empty.size:
        return "other", 0, f"{at} query {empty[0]} (position {p + empty[0]}) sees no key at all"
    future = np.argwhere(a & ~causal)
    if future.size:
        i, j = future[0]
        return ("other", 0, f"{at} query {i} (position {p + i}) sees the later key {j}, yet some keys are "
                            f"blocked: neither causal nor unmasked")
    if np.array_equal(a, causal):
        return "causal", 0, ""
    w = int(a.sum(axis=1).min())
    if np.array_equal(a, causal & (key > qpos - w)):
        return "window", w, ""
    seen = [int(j) for j in np.flatnonzero(a[-1])]
    shown = ", ".join(map(str, seen[:6])) + (", ..." if len(seen) > 6 else "")
    return ("other", 0, f"{at} query {s - 1} (position {p + s - 1}) sees the keys {shown}: causal, but neither "
                        f"the full prefix nor one sliding window")


def combine(readings: Iterable[tuple[int, int, tuple[str, int, str]]], checked: str) -> MaskReading:
    """One :class:`MaskReading` from the per-binding readings ``(s, p, pattern(...))``."""
    got = list(readings)
    for _, _, (kind, _, detail) in got:
        if kind == "other":
            return MaskReading("other", detail=detail, checked=checked)
    windows = {w for _, _, (kind, w, _) in got if kind == "window"}
    if len(windows) > 1:
        return MaskReading("other", detail=f"a sliding window of {sorted(windows)} tokens at different lengths",
                           checked=checked)
    if windows:
        w = windows.pop()
        for s, p, (kind, _, _) in got:
            if kind != "window" and p + s > w and not (kind == "full" and s == 1 and p + 1 <= w):
                return MaskReading("other", detail=f"a sliding window of {w} tokens at one length, {kind} at S={s}, "
                                                   f"P={p}", checked=checked)
        return MaskReading("window", window=w, checked=checked)
    many = [(s, p, kind) for s, p, (kind, _, _) in got if s > 1]
    if many and all(kind == "full" for _, _, kind in many):
        return MaskReading("none", checked=checked)
    for s, p, kind in many:
        if kind == "full":
            return MaskReading("other", detail=f"causal at some lengths, unmasked at S={s}, P={p}", checked=checked)
    return MaskReading("causal", checked=checked)


# ----------------------------------------------------------------------------------------------
# evaluating masks on their own
# ----------------------------------------------------------------------------------------------
def _cone(g: GraphEdit, names: list[str], stand_ins: set[str]) -> list[int]:
    """Indices of the statements ``names`` depend on; the inputs of a node in ``stand_ins`` are not followed."""
    need = list(names)
    seen: set[str] = set()
    idx: set[int] = set()
    while need:
        name = need.pop()
        if name in seen:
            continue
        seen.add(name)
        n = g.node(name)
        if n is None or n.index in idx:
            continue
        idx.add(n.index)
        if n.name not in stand_ins:
            need.extend(identifiers(n.stmt.rhs))
    return sorted(idx)


def _stand_in(n: Any) -> A.Assignment | None:
    """A KV cache node of the session (``tract_transformers_dyn_kv_cache``) as a graph input of the shape it
    holds after the call (``past_sequence_shape`` with ``past + input`` along its axis), for a cone that reads
    the cache's length; None for any other node."""
    if n.op not in ops_with(role="kv-cache"):
        return None
    past, new, axis = n.arg("past_sequence_shape"), n.arg("input_sequence_shape"), int_list(n.arg("axis"))
    if not (isinstance(past, A.ArrayExpr) and isinstance(new, A.ArrayExpr) and axis and len(past.items) ==
            len(new.items) and 0 <= axis[0] < len(past.items)):
        return None
    dims = list(past.items)
    dims[axis[0]] = A.BinaryExpr("+", past.items[axis[0]], new.items[axis[0]])
    dt = n.arg("datum_type")
    dtype = dt.value if isinstance(dt, A.StringLiteral) else "f32"
    return A.Assignment(A.Identifier(n.name), invocation("tract_core_external", shape=A.ArrayExpr(tuple(dims)),
                                                           datum_type=dtype.lower()))


def _symbol_at(shape: Any, axis: int) -> str | None:
    items = list(shape.items) if isinstance(shape, A.ArrayExpr) else list(shape or ())
    return items[axis].name if len(items) > axis and isinstance(items[axis], A.Identifier) else None


def length_symbols(g: GraphEdit, caches: Iterable[Any]) -> tuple[str | None, str | None]:
    """``(query symbol, past symbol)``: the symbol of the cached length (axis 2 of an explicit cache input's
    declared shape, or of a dyn cache's ``past_sequence_shape``), and the one symbol the other graph inputs
    declare (``input_ids [1, S]``); None where there is none (a one-token graph: ``input_0 [1, 1]``)."""
    past = None
    cache_inputs = set()
    for src in caches:
        if src.kind == "explicit" and src.past is not None:
            cache_inputs.add(src.past)
            past = past or _symbol_at(g.declared_shape(src.past), 2)
        elif src.node is not None:
            past = past or _symbol_at(src.node.arg("past_sequence_shape"), 2)
    found: list[str] = []
    for name in g.inputs:
        if name in cache_inputs:
            continue
        for d in g.declared_shape(name) or ():
            if isinstance(d, A.Identifier) and d.name != past and d.name not in found:
                found.append(d.name)
    return (found[0] if len(found) == 1 else None), past


@dataclass
class MaskSite:
    """A mask to read: its name, and whether its attention also masks causally by itself."""

    mask: str
    causal_too: bool = False


def read_masks(g: GraphEdit, sites: list[MaskSite], query_symbol: str | None, past_symbol: str | None
               ) -> dict[str, MaskReading]:
    """Read every site's mask (see the module doc); keyed by mask name. ``query_symbol`` / ``past_symbol``:
    the symbols counting this call's tokens and the cached ones (None: fixed at 1 / at 0)."""
    if not sites:
        return {}
    masks = sorted({x.mask for x in sites})
    doc = cone_document(g, masks)
    if isinstance(doc, str):
        return {m: MaskReading("other", detail=f"{doc}, so it cannot be evaluated on its own") for m in masks}
    bound = positions_bound(g.doc)
    ladder = [(s if query_symbol else 1, p if past_symbol else 0) for s, p in LADDER]
    ladder = list(dict.fromkeys(b for b in ladder if bound is None or b[0] + b[1] <= bound[0]))
    per: dict[str, list[tuple[int, int, tuple[str, int, str]]]] = {m: [] for m in masks}
    errors: list[str] = []
    try:
        plan = _plan(doc, g.tensors)
    except NnefKvError as exc:
        why = f"it cannot be evaluated on its own ({clip(' '.join(str(exc).split()), 300)})"
        return {m: MaskReading("other", detail=why) for m in masks}
    done: list[tuple[int, int]] = []
    moved: dict[str, str] = {}
    for s, p in ladder:
        try:
            values = _evaluate(plan, {query_symbol: s, past_symbol: p})
            if not done:  # a mask is a function of lengths: the same with other input values
                other = _evaluate(plan, {query_symbol: s, past_symbol: p}, seed=0)
                for m in masks:
                    if not np.array_equal(values[m], other[m], equal_nan=True):
                        moved[m] = (f"it depends on the values of the graph's inputs, not only on their lengths (at "
                                    f"S={s}, P={p}): a data-dependent bias or padding mask")
        except NnefKvError as exc:
            errors.append(f"at S={s}, P={p}: {clip(' '.join(str(exc).split()), 300)}")
            continue
        done.append((s, p))
        if len(moved) == len(masks):  # every mask depends on data: nothing more to read
            break
        for x in sites:
            per[x.mask].append((s, p, pattern(values[x.mask], s, p, x.causal_too)))
    if not done:
        why = f"it cannot be evaluated on its own ({errors[0] if errors else 'no binding to evaluate'})"
        return {m: MaskReading("other", detail=why) for m in masks}
    s_last, p_last = done[-1]
    checked = (f"{len(done)} bindings, S={done[0][0]} P={done[0][1]} .. S={s_last} P={p_last} "
               f"({p_last + s_last} positions)")
    return {m: MaskReading("other", detail=moved[m], checked=checked) if m in moved else combine(per[m], checked)
            for m in masks}


def cone_document(g: GraphEdit, names: list[str]) -> A.Document | str:
    """A graph computing ``names`` alone: the statements they depend on (their cone; a KV cache op stands in as
    an input of the length it holds), the graph inputs those read; or why not (a session state it depends on)."""
    stateful = stateful_ops()
    stand_ins = {n.name: st for n in g.nodes if n.op in stateful and (st := _stand_in(n)) is not None}
    cone = [g.nodes[i] for i in _cone(g, names, set(stand_ins))]
    holder = next((n for n in cone if n.op in stateful and n.name not in stand_ins), None)
    if holder is not None:
        return f"it depends on the session state of '{holder.name}' ({holder.op})"
    used = [n.name for n in cone if n.name in stand_ins]
    inputs = [x for x in g.inputs if any(x in n.names for n in cone)] + used
    body = tuple(stand_ins.get(n.name, n.stmt) for n in cone)
    return A.Document(g.doc.version, g.doc.extensions, g.doc.fragments,
                      A.GraphDecl(g.graph_name, tuple(inputs), tuple(names), body))


def _plan(doc: A.Document, tensors: dict[str, Any]) -> Any:
    from ..io.archive import Model

    return Model(document=doc, tensors=tensors).session(threads=1).plan


def input_feed(plan: Any, symbols: dict[str | None, int], rng: Any = None) -> tuple[dict[str, int], dict[str, Any]]:
    """The symbol values (those given, every other 1) and an array for each declared input of ``plan`` at
    them: an input named like ``*mask*`` ones (nothing padded); the others zeros, or with ``rng`` random
    values (floats N(0, 1), integers in [0, 8), bools true). Zeros and ones are broadcast views (no memory)."""
    from ..interpreter.values import Lazy

    g = plan.graph
    value = {name: 1 for name in g.symbols}
    value.update({k: v for k, v in symbols.items() if k is not None and k in g.symbols})
    v = list(plan.base)
    for name, slot in g.symbols.items():
        v[slot] = value[name]
    feed: dict[str, Any] = {}
    for spec in plan.inputs:
        dims = [value[d] if isinstance(d, str) else int(d.fn(v)) if isinstance(d, Lazy) else int(d)
                for d in spec.shape]
        dt = np.dtype(spec.dtype)
        if "mask" in spec.name.lower() or (rng is not None and dt == np.bool_):
            feed[spec.name] = np.broadcast_to(np.array(1, dt), dims)
        elif rng is None:
            feed[spec.name] = np.broadcast_to(np.array(0, dt), dims)
        elif np.issubdtype(dt, np.floating):
            feed[spec.name] = rng.standard_normal(dims).astype(dt)
        else:
            feed[spec.name] = rng.integers(0, 8, dims).astype(dt)
    return value, feed


def _evaluate(plan: Any, symbols: dict[str | None, int], seed: int | None = None) -> dict[str, np.ndarray]:
    """The plan's outputs at the symbol values given, on :func:`input_feed`'s inputs (random with ``seed``)."""
    from ..interpreter.plan.execute import bind_inputs, execute

    value, feed = input_feed(plan, symbols, np.random.default_rng(seed) if seed is not None else None)
    vals = bind_inputs(plan, feed, {k: (n, "the mask reading") for k, n in value.items()})
    execute(plan, vals, [])
    return {name: np.asarray(vals[slot]) for name, slot in plan.outputs}


def read_block_masks(g: GraphEdit, blocks: list[Any]) -> None:
    """Set ``mask_reading`` on each attention block (:class:`~.attention.AttentionBlock`) holding a mask not
    read yet."""
    todo = [b for b in blocks if b.mask is not None and b.mask_reading is None]
    if not todo:
        return
    query, past = length_symbols(g, [c for b in blocks for c in (b.key, b.value)])
    readings = read_masks(g, [MaskSite(b.mask, b.is_causal) for b in todo], query, past)
    for b in todo:
        b.mask_reading = readings[b.mask]
