"""Attentions whose heads tract's declutter folded into layout ops, found by following them and proved by
evaluating them.

A torch-to-nnef export loaded by tract, put through ``transform("detect_kv_cache")`` and written back (what
a tract user's pipeline produces) computes the same attention in another layout: the query
``[1, Hq, S, D]`` is reshaped to ``[Hkv, 1, G*S, D]`` (``reshape``, ``reshape``, ``transpose``), the cache
``[1, Hkv, T, D]`` transposed to ``[Hkv, 1, T, D]``, the scores squeezed to ``[Hkv, G*S, T]`` and reshaped to
``[Hq, S, T]`` before the mask and a softmax over axis 2, and the product reshaped back through
``[Hkv, G, S, D]`` and ``[Hq, S, D]`` to ``[S, Hq, D]``. Which layout a writer picks is its own business, so
no layout is written down here: from a softmax the walk goes back to a product ``A . B`` and forward to
``P . V`` through any layout op (``reshape``, ``squeeze``, ``unsqueeze``, ``transpose``) and cast, with the
score transforms of :mod:`.attention` (scale, softcap, mask) on the way, and from ``B`` and ``V`` through
layout ops to a KV cache. Then the graph is run once by the interpreter (``S`` = 3 new tokens after 2 cached,
random inputs) and the candidate is accepted only when

* a layout ancestor of ``A`` is the query in the standard ``[1, Hq, S, D]`` layout (``Hq`` a multiple of the
  cache's ``Hkv``), and
* a layout descendant of the product equals, within f32 rounding, exact attention of that query over the
  cache (kv head ``h // (Hq / Hkv)``, the scale, softcap and mask read from the graph) in one of the layouts
  of :data:`LAYOUTS`.

The furthest such descendant becomes the fused op's result followed by that layout's ops; anything else is
left to :class:`~.attention.Miss` (the attention is reported as not followed).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..errors import NnefKvError
from ..grammar import ast as A
from .graph_edit import GraphEdit, invocation

#: the layouts of the attention result ``x`` [1, Hq, S, D] a folded graph may continue from: (name, the
#: array, the ops that make it from the fused op's result as (op, attributes))
LAYOUTS: tuple[tuple[str, Callable[[np.ndarray], np.ndarray], tuple[tuple[str, dict[str, Any]], ...]], ...] = (
    ("[1, Hq, S, D]", lambda x: x, ()),
    ("[Hq, S, D]", lambda x: x[0], (("squeeze", {"axes": [0]}),)),
    ("[1, S, Hq, D]", lambda x: x.transpose(0, 2, 1, 3), (("transpose", {"axes": [0, 2, 1, 3]}),)),
    ("[S, Hq, D]", lambda x: x[0].transpose(1, 0, 2), (("squeeze", {"axes": [0]}), ("transpose", {"axes": [1, 0, 2]}))),
    ("[1, S, Hq*D]", lambda x: x.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1),
     (("transpose", {"axes": [0, 2, 1, 3]}), ("reshape", {"shape": "HD", "axis_start": 2, "axis_count": 2}))),
)
#: the run the candidates are proved on: new tokens and cached tokens
NEW, PAST = 3, 2


# ----------------------------------------------------------------------------------------------
def _feed_and_run(g: GraphEdit, names: list[str], caches: list[Any]) -> dict[str, np.ndarray]:
    """One run of the graph (2 cached tokens, then 3 new ones; random inputs), capturing ``names``."""
    from ..io.archive import Model
    from .masks import input_feed, length_symbols

    query, past = length_symbols(g, caches)
    session = Model(document=g.document(), tensors=g.tensors).session(threads=1)
    rng = np.random.default_rng(0)

    def feed(s: int, p: int) -> dict[str, np.ndarray]:
        return input_feed(session.plan, {query: s, past: p}, rng)[1]

    if session.states:  # the cache lives in the session: fill it first
        session.run(feed(PAST if query else 1, 0))
        if not query:
            session.run(feed(1, 1))
    _, caps = session.run(feed(NEW if query else 1, PAST), capture=names)
    return {k: np.array(v, copy=True) for k, v in caps.items()}


def _reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, softcap: float | None,
               allowed: np.ndarray) -> np.ndarray:
    """Exact attention ``[1, Hq, S, D]`` of ``q`` over ``k``/``v`` ``[1, Hkv, T, D]`` (float64)."""
    g = q.shape[1] // k.shape[1]
    kk = np.repeat(k.astype(np.float64), g, axis=1)
    vv = np.repeat(v.astype(np.float64), g, axis=1)
    s = np.einsum("bhsd,bhtd->bhst", q.astype(np.float64), kk) * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    s = np.where(allowed, s, -np.inf)
    s = np.exp(s - s.max(axis=-1, keepdims=True))
    return np.einsum("bhst,bhtd->bhsd", s / s.sum(axis=-1, keepdims=True), vv)


def _allowed(reading: Any, s: int, t: int) -> np.ndarray | None:
    qpos = (t - s) + np.arange(s)[:, None]
    key = np.arange(t)[None, :]
    kind = "none" if reading is None else reading.kind
    if kind == "causal":
        return key <= qpos
    if kind == "window":
        return (key <= qpos) & (key > qpos - reading.window)
    if kind == "none":
        return np.ones((s, t), bool)
    return None


#: the layouts the query may be found in before its product, as (name, the [1, Hq, S, D] query from the
#: array or None where the shape does not fit, the ops that make it)
_Ops = tuple[tuple[str, dict[str, Any]], ...]
QUERY_LAYOUTS: tuple[tuple[str, Callable[[np.ndarray], np.ndarray | None], _Ops], ...] = (
    ("[1, Hq, S, D]", lambda v: v if v.ndim == 4 and v.shape[0] == 1 else None, ()),
    ("[Hq, S, D]", lambda v: v[None] if v.ndim == 3 else None, (("unsqueeze", {"axes": [0]}),)),
    ("[Hq, 1, S, D]", lambda v: v.transpose(1, 0, 2, 3) if v.ndim == 4 and v.shape[1] == 1 else None,
     (("transpose", {"axes": [1, 0, 2, 3]}),)),
    ("[1, S, Hq, D]", lambda v: v.transpose(0, 2, 1, 3) if v.ndim == 4 and v.shape[0] == 1 else None,
     (("transpose", {"axes": [0, 2, 1, 3]}),)),
    ("[S, Hq, D]", lambda v: v.transpose(1, 0, 2)[None] if v.ndim == 3 else None,
     (("transpose", {"axes": [1, 0, 2]}), ("unsqueeze", {"axes": [0]}))),
)


@dataclass
class Proof:
    """What the run established for one candidate."""

    query: str  # the query as the graph has it
    query_layout: tuple[tuple[str, dict[str, Any]], ...]  # the ops making [1, Hq, S, D] of it
    output: str  # the name the fused op's result (after ``layout``) replaces
    layout: tuple[tuple[str, Any], ...]  # the ops from the fused op's [1, Hq, S, D] result to ``output``


def _match(got: dict[str, np.ndarray], names: list[str], ref: np.ndarray, s_symbol: str | None
           ) -> tuple[str, tuple] | None:
    """The furthest of ``names`` holding ``ref`` (or its last query only) in one of :data:`LAYOUTS`."""
    tol = 1e-4 * max(1.0, float(np.abs(ref).max()))
    rows = [(ref, ())]
    if ref.shape[2] > 1 and s_symbol is not None:  # tract computes only the last query of the last layer
        last = A.BinaryExpr("+", A.Identifier(s_symbol), A.IntegerLiteral(-1))
        rows.append((ref[:, :, -1:, :], (("slice", {"axes": [2], "begin": [last], "end": [A.Identifier(s_symbol)]}),)))
    for name in reversed(names):
        val = got[name]
        for r, cut in rows:
            for _, fn, ops in LAYOUTS:
                want = fn(r)
                if val.shape == want.shape and np.allclose(val, want, rtol=1e-3, atol=tol):
                    hd = r.shape[1] * r.shape[3]
                    return name, cut + tuple((op, {**kw, "shape": [hd]} if kw.get("shape") == "HD" else kw)
                                             for op, kw in ops)
    return None


def prove(g: GraphEdit, found: list[tuple[Any, Any]]) -> dict[str, Proof | str]:
    """Run the graph once and prove each ``(candidate, block)`` (see the module doc; the candidate: an
    :class:`~.attention.Folded` the walk of :mod:`.attention` found): by softmax name, a
    :class:`Proof` or the reason it failed. ``block``: the :class:`~.attention.AttentionBlock` the candidate
    makes (its scale, softcap and mask reading are used)."""
    from .masks import length_symbols

    caches = [x for c, _ in found for x in (c.key, c.value)]
    names = sorted({n for c, _ in found for n in [*c.query_side, c.pv, *c.after, c.key.full, c.value.full]})
    try:
        got = _feed_and_run(g, names, caches)
    except NnefKvError as exc:
        return {c.softmax: f"the graph could not be run to check it ({' '.join(str(exc).split())[:200]})"
                for c, _ in found}
    s_symbol = length_symbols(g, caches)[0]
    new = NEW if s_symbol else 1
    out: dict[str, Proof | str] = {}
    for c, block in found:
        k, v = got[c.key.full], got[c.value.full]
        if k.ndim != 4 or v.ndim != 4 or k.shape[0] != 1:
            out[c.softmax] = f"its cache '{c.key.full}' is {list(k.shape)}, not [1, Hkv, T, D]"
            continue
        hkv, t, d = k.shape[1], k.shape[2], k.shape[3]
        allowed = _allowed(block.mask_reading if block.mask is not None else None, new, t)
        if allowed is None:
            out[c.softmax] = "its mask is not causal, windowed or none"
            continue
        scale = block.scale if block.scale is not None else 1.0 / np.sqrt(d)
        proof = None
        for name in reversed(c.query_side):  # the furthest back first: the fewest layout ops kept
            for _, qfn, qops in QUERY_LAYOUTS:
                q = qfn(got[name])
                if q is None or q.shape[2] != new or q.shape[3] != d or q.shape[1] % hkv:
                    continue
                m = _match(got, [c.pv, *c.after], _reference(q, k, v, scale, block.softcap, allowed), s_symbol)
                if m is not None:
                    proof = Proof(name, qops, m[0], m[1])
                    break
            if proof is not None:
                break
        out[c.softmax] = proof or (
            f"no layout of the query before '{c.product}' ({', '.join(x[0] for x in QUERY_LAYOUTS)}) gives, by exact "
            f"attention over its cache, what '{c.pv}' or the layout ops after it hold "
            f"({', '.join(x[0] for x in LAYOUTS)})")
    return out


def _chain(g: GraphEdit, base: str, src: str, ops: tuple, taken: set[str]) -> tuple[list[A.Assignment], str]:
    """Statements applying ``ops`` to ``src`` one by one under fresh names; returns them and the last name."""
    stmts: list[A.Assignment] = []
    cur = src
    for op, kw in ops:
        nxt = g.fresh(f"{base}_{op}")
        while nxt in taken:
            nxt = g.fresh(nxt + "_")
        taken.add(nxt)
        stmts.append(A.Assignment(A.Identifier(nxt), invocation(op, A.Identifier(cur), **kw)))
        cur = nxt
    return stmts, cur


def rewrite(g: GraphEdit, block: Any, fused_for: Callable[[str], A.Invocation]) -> None:
    """Replace ``block.output`` (a folded attention) by the fused op ``fused_for(query name)`` on the query in the
    [1, Hq, S, D] layout, followed by the layout ops the graph continues from. Afterwards the block reads as a
    standard one: ``q`` the [1, Hq, S, D] query, ``output`` the fused op's statement (its first argument ``q``)."""
    taken: set[str] = set()
    stmts, q = _chain(g, f"{block.output}_query", block.q, block.query_layout, taken)
    fused = fused_for(q)
    target = block.output
    if block.layout:
        name = g.fresh(f"{block.output}_fused")
        taken.add(name)
        stmts.append(A.Assignment(A.Identifier(name), fused))
        more, last = _chain(g, block.output, name, block.layout[:-1], taken)
        stmts += more
        op, kw = block.layout[-1]
        fused = invocation(op, A.Identifier(last), **kw)
        block.output = name
    if stmts:
        g.insert_before(target, stmts)
    g.replace_rhs(target, fused)
    block.q, block.query_layout, block.layout = q, (), ()
