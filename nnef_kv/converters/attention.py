"""The attentions and KV caches of a document, as the converter edits them: found by the one recognizer on the
interpreter's built graph (:mod:`nnef_kv.interpreter.plan.recognize`, which says what an attention is), and
named back in the document's statements.

The document (one definition per name: :meth:`.graph_edit.GraphEdit.make_ssa`) is built by the interpreter's
builder; each slot the recognizer reports is named by the graph-body identifier holding it
(``Graph.names``), each node by its statement (a node of a nested expression ``x#1`` or of a fragment's body
``x.local`` belongs to the statement ``x``). A tensor the converter must edit that no identifier holds stops
recognition (a :class:`Miss`). A folded attention (the form tract's declutter writes) is proved by one run
(:mod:`.folded`); each mask is read by evaluating it (:mod:`.masks`), each sink column too (:mod:`.sinks`).
The caches alone (scheme ``tract-cache``) and the exports that cannot run are :mod:`.caches`'.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..interpreter.plan import recognize as R
from ..interpreter.plan.recognize import DYN_CACHE_OP, Miss
from . import folded
from .graph_edit import GraphEdit, Node
from .masks import read_block_masks
from .sinks import read_sink_logits

__all__ = ["CacheSource", "AttentionBlock", "Miss", "find_attention", "view_of", "cache_names", "DYN_CACHE_OP",
           "LOOKED_FOR"]

#: what :func:`find_attention` looks for, in the "no attention found" message
LOOKED_FOR = (
    "attention: q . K^T (matmul or tract_core_einsum, through casts), then casts / constant scales / tanh "
    "softcapping / an additive mask, softmax, then p . V (matmul or einsum); or tract_transformers_sdpa; with K/V "
    "from concat([cache input, new], axis = 2) or tract_transformers_dyn_kv_cache"
)


@dataclass
class CacheSource:
    """Where the full K (or V) of an attention comes from."""

    kind: str  # "explicit" or "dyn"
    full: str  # the name holding past + new (concat output / dyn cache output)
    new: str  # this call's new tokens
    past: str | None = None  # explicit: the graph input holding the past
    node: Node | None = None  # the concat / dyn cache node
    repeat: list[str] = field(default_factory=list)  # names of the GQA repeat chain (full -> attention)
    role: str = ""  # "key" or "value" when known


@dataclass
class AttentionBlock:
    """One attention found in the graph."""

    kind: str  # "plain" (matmul scores), "einsum" or "sdpa"
    q: str
    key: CacheSource
    value: CacheSource
    output: str  # the name holding the attention result [B, Hq, S, D]
    scale: float | None  # None: absent (the op's default 1/sqrt(D))
    mask: str | None  # the additive mask or sdpa mask input dropped by the conversion
    is_causal: bool = False  # sdpa's own is_causal flag
    nodes: list[str] = field(default_factory=list)  # the attention's own statements (q.k to output)
    softcap: float | None = None  # tanh softcapping of the scores (Gemma 2), None: none
    unsupported: list[str] = field(default_factory=list)  # score transforms no fused op expresses
    mask_reading: Any = None  # what the mask is (converters/masks.py MaskReading), once read
    layout: tuple = ()  # kind "folded": the layout ops from the fused op's [B, Hq, S, D] result to ``output``
    query_layout: tuple = ()  # kind "folded": the layout ops from ``q`` to the [B, Hq, S, D] query
    sinks: str | None = None  # GPT-OSS: the tensor concatenated to the scores as the softmax's last column
    sink_logits: tuple = ()  # its value, one logit per query head (read by evaluating it: .sinks)

    def describe(self) -> str:
        extra = f", softcap {self.softcap:g}" if self.softcap else ""
        return (f"{self.kind} attention -> '{self.output}' (q '{self.q}', K {self.key.kind} '{self.key.full}', "
                f"V {self.value.kind} '{self.value.full}', scale {self.scale}{extra}, mask {self.mask!r})")


@dataclass
class Folded:
    """A softmax whose attention was followed through layout ops, before the proof (:mod:`.folded`)."""

    softmax: str
    product: str  # q . K^T (A operand: the query in its folded layout)
    query_side: list[str]  # A, then its layout ancestors (nearest first)
    pv: str  # P . V
    key: Any  # CacheSource
    value: Any  # CacheSource
    after: list[str] = field(default_factory=list)  # P . V's layout descendants (nearest first)


# ----------------------------------------------------------------------------------------------
def view_of(g: GraphEdit) -> R.View:
    """The recognizer's view of ``g``'s document as the interpreter builds it (built once per state of the body)."""
    from ..interpreter.builder import build_graph

    key = tuple(map(id, g.body))
    got = getattr(g, "_built", None)
    if got is not None and got[0] == key:
        return got[2]
    graph = build_graph(g.document(), g.tensors, filename=g.where, opaque=True)  # an op it cannot run: read around
    view = R.View(graph, g.where)
    g._built = (key, list(g.body), view)  # type: ignore[attr-defined]
    return view


class _Unnamed(Exception):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def _name(w: R.View, slot: int) -> str:
    """The identifier of the document holding ``slot`` (raises :class:`_Unnamed` when none does)."""
    name = w.name(slot)
    if w.graph.names.get(name) != slot:
        raise _Unnamed(name)
    return name


def statement(node_name: str) -> str:
    """The statement a built node belongs to (``x#1`` and ``x.local`` are ``x``'s)."""
    return node_name.split("#", 1)[0].split(".", 1)[0]


def cache_names(g: GraphEdit, w: R.View, c: R.Cache, role: str = "") -> CacheSource:
    full = _name(w, c.full)
    return CacheSource(c.kind, full, _name(w, c.new), past=_name(w, c.past) if c.past is not None else None,
                       node=g.node(full), repeat=[w.name(s) for s in c.repeat], role=role or c.role)


def _block(g: GraphEdit, w: R.View, f: R.Found) -> AttentionBlock:
    output = _name(w, w.out(f.output))
    nodes = list(dict.fromkeys(statement(n.name) for n in f.nodes))
    return AttentionBlock(f.kind, _name(w, f.q), cache_names(g, w, f.key), cache_names(g, w, f.value), output,
                          f.scale, _name(w, f.mask) if f.mask is not None else None, is_causal=f.is_causal,
                          nodes=nodes, softcap=f.softcap, unsupported=list(f.unsupported),
                          sinks=_name(w, f.sinks) if f.sinks is not None else None)


def find_attention(g: GraphEdit) -> tuple[list[AttentionBlock], list[Miss]]:
    """Every attention of the graph with its caches, and a :class:`Miss` for each softmax or sdpa that looks
    like an attention but could not be followed (or has no KV cache)."""
    w = view_of(g)
    found, misses = R.recognize(w)
    blocks: list[AttentionBlock] = []
    todo: list[tuple[Folded, AttentionBlock, Miss | None]] = []
    for f in found:
        around = (f.softmax or f.output).name
        try:
            b = _block(g, w, f)
            if f.kind == "folded":
                c = Folded(f.softmax.name, _name(w, w.out(f.product)), [w.name(s) for s in f.query_side],  # type: ignore[union-attr]
                           b.output, b.key, b.value, [w.name(s) for s in f.after])
        except _Unnamed as u:
            misses.append(f.miss if f.kind == "folded" and f.miss is not None else
                          Miss(u.name, None, "a tensor the graph body names (an identifier): the converter edits "
                                             "statements", around))
            continue
        if f.kind == "folded":
            todo.append((c, b, f.miss))
        else:
            blocks.append(b)
    if todo:
        found_folded, left = _prove(g, todo)
        blocks += found_folded
        misses += left
    read_sink_logits(g, blocks)
    return blocks, misses


def _prove(g: GraphEdit, todo: list[tuple[Folded, AttentionBlock, Miss | None]]
           ) -> tuple[list[AttentionBlock], list[Miss]]:
    """The folded candidates proved by one run (:mod:`.folded`); the others keep their miss (None: a softmax over
    another axis, not an attention)."""
    read_block_masks(g, [b for _, b, _ in todo])
    proofs = folded.prove(g, [(c, b) for c, b, _ in todo])
    out, misses = [], []
    for c, b, miss in todo:
        p = proofs[c.softmax]
        if isinstance(p, str):
            miss = miss or Miss(c.softmax, "softmax", "a softmax over the last axis of the scores", c.softmax)
            misses.append(Miss(miss.node, miss.op, f"{miss.expected} (followed through layout ops: {p})", miss.around))
            continue
        b.q, b.query_layout, b.output, b.layout = p.query, p.query_layout, p.output, p.layout
        out.append(b)
    return out, misses
