"""The rewriting passes: each finds a pattern, replaces it, leaves the rest of the graph as it was,
and returns a :class:`PassReport` of what it changed.

Order used by :func:`nnef_kv.converters.convert`:

1. :class:`NormalizePass` -- one definition per name (see :meth:`GraphEdit.make_ssa`), document fragments
   holding an attention inlined;
2. the scheme's rewrite (:data:`REWRITES`, keyed by :attr:`~nnef_kv.converters.schemes.Scheme.rewrite`):
   :class:`AttentionPass` (``"attention"``: schemes ``kivi``, ``tract``) -- every attention
   :func:`.attention.find_attention` recognises, over explicit caches (``concat([past_input, new], axis = 2)``:
   torch-to-nnef, nnef-tools' ONNX output; the past inputs and present outputs go, the caches move into the
   session) or ``tract_transformers_dyn_kv_cache``, becomes the scheme's fused op; or :class:`CachePass`
   (``"cache"``: scheme ``tract-cache``) -- every cache becomes the scheme's cache op, the attention left as
   exported;
3. :class:`CacheShapeToSymbolPass` -- what the graph derived from the removed cache inputs' shapes
   (past length ``P`` for positions and masks) becomes an expression of the declared symbol;
4. :class:`PositionBindingPass` -- fused schemes only: a ``[1, 1, S, 1]`` ``tract_transformers_dyn_kv_cache``
   whose ``past_sequence_shape = [1, 1, P, 1]`` keeps ``P`` bound at run time (tract binds symbols
   from stateful cache nodes; the fused ops carry no sequence shape);
5. :class:`CleanupPass` -- dead code, unused tensors, extensions.

Schemes (what an attention with its caches becomes) are :class:`nnef_kv.converters.schemes.Scheme` objects: the
passes read the op, its attributes, what it can express and its notes from the scheme, never its name:

* ``kivi``: ``nnef_kv_kivi_sdpa(q, k_new, v_new, ...)`` (nnef-kv's accurate op; causal mask built in);
* ``tract``: ``tract_transformers_quantized_kv_sdpa(q, k_new, v_new, axis = 2, scale = s)`` (tract's
  fused op; it has no causal mask: a multi-token call attends to the whole cache);
* ``tract-cache``: each cache becomes ``tract_transformers_quantized_dyn_kv_cache`` (keys per
  channel, values per token), the attention around it is left as it is.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConversionError
from ..grammar import ast as A
from ..interpreter.catalog import extensions_for, ops_with
from .schemes import SCHEMES, AttentionSite, CacheSite, Scheme
from ..interpreter.plan.recognize import SOFTMAX_OPS, recognize
from .attention import DYN_CACHE_OP, LOOKED_FOR, AttentionBlock, CacheSource, Miss, find_attention, statement, view_of
from .caches import find_caches
from .folded import rewrite as rewrite_folded
from .graph_edit import GraphEdit, Node, identifiers, int_list, invocation, static_value
from .masks import read_block_masks
from .options import ConvertOptions

POSITION_CACHE = "nnef_kv_positions"


@dataclass
class PassReport:
    """What one pass changed."""

    name: str
    nodes_removed: list[str] = field(default_factory=list)
    nodes_added: list[str] = field(default_factory=list)
    nodes_replaced: list[str] = field(default_factory=list)
    inputs_removed: list[str] = field(default_factory=list)
    outputs_removed: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: notes on what the converted model computes differently, beyond its cache's quantization (also in
    #: ``notes``; ``nnef-kv convert`` prints them on stderr)
    changes: list[str] = field(default_factory=list)

    def change(self, note: str) -> None:
        self.notes.append(note)
        self.changes.append(note)

    @property
    def changed(self) -> bool:
        return bool(self.nodes_removed or self.nodes_added or self.nodes_replaced or self.inputs_removed
                    or self.outputs_removed)

    def to_text(self) -> str:
        parts = [f"{self.name}:"]
        for label, items in (("replaced", self.nodes_replaced), ("added", self.nodes_added),
                             ("removed", self.nodes_removed), ("inputs removed", self.inputs_removed),
                             ("outputs removed", self.outputs_removed)):
            if items:
                shown = ", ".join(items[:6]) + (f", ... ({len(items)} in all)" if len(items) > 6 else "")
                parts.append(f"  {label}: {shown}")
        parts += [f"  note: {n}" for n in self.notes]
        if len(parts) == 1:
            parts.append("  nothing changed")
        return "\n".join(parts)


# ----------------------------------------------------------------------------------------------
@dataclass
class ConversionContext:
    """State shared by the passes of one conversion."""

    graph: GraphEdit
    options: ConvertOptions
    scheme: Scheme = field(init=False)  # the options' scheme
    settings: Any = field(init=False)  # its options (the scheme's options dataclass)
    blocks: list[AttentionBlock] = field(default_factory=list)  # attentions rewritten to a fused op
    found: list[AttentionBlock] = field(default_factory=list)  # attentions recognised (any scheme)
    caches: list[CacheSource] = field(default_factory=list)  # caches rewritten (tract-cache)
    misses: list[Miss] = field(default_factory=list)
    removed_inputs: dict[str, list[A.Expr]] = field(default_factory=dict)  # past input -> declared shape
    removed_full: dict[str, list[A.Expr]] = field(default_factory=dict)  # past + new (concat) -> its shape
    past_symbol: str | None = None  # the symbol of the past length (P)
    new_symbol: str | None = None  # the symbol of this call's length (S)
    initially_dead: set[str] = field(default_factory=set)  # dead before conversion: left as they were

    def __post_init__(self) -> None:
        self.scheme = self.options.scheme_object
        self.settings = self.options.scheme_options

    def dead_code(self) -> list[str]:
        """Remove what the conversion made dead (statements dead in the input graph stay)."""
        return self.graph.dead_code(keep=self.initially_dead)

    def forget_dead_readers(self, names: set[str]) -> None:
        """Statements dead in the input that read ``names`` (directly or through each other) go too."""
        bad = set(names)
        changed = True
        while changed:
            changed = False
            for n in self.graph.nodes:
                if n.name in self.initially_dead and n.name not in bad and bad & set(identifiers(n.stmt.rhs)):
                    bad.add(n.name)
                    changed = True
        self.initially_dead -= bad


def _seq_symbol(ctx: ConversionContext) -> str:
    """The symbol of the tokens of one call: ``S`` when declared, else a new declared symbol."""
    g = ctx.graph
    if ctx.new_symbol:
        return ctx.new_symbol
    syms = g.symbols()
    if "S" in syms:
        ctx.new_symbol = "S"
    else:
        name = "S" if "S" not in g.all_names() else g.fresh("S")
        g.add_extension("tract_symbol", name)
        ctx.new_symbol = name
    return ctx.new_symbol


def _datum_type(g: GraphEdit, past: str) -> str:
    n = g.node(past)
    if n is not None and n.op == "tract_core_external":
        dt = n.arg("datum_type")
        if isinstance(dt, A.StringLiteral):
            return dt.value.lower()
    if n is not None and n.op == "external" and n.inv is not None and isinstance(n.inv.generic, A.PrimitiveType):
        if n.inv.generic.name != "scalar":
            raise ConversionError(f"{g.where}: cache input '{past}' is not a float tensor")
    return "f32"


def _layers_check(ctx: ConversionContext, layers: int) -> None:
    bad = ctx.scheme.layers_problem(ctx.settings, layers)
    if bad is not None:
        raise ConversionError(f"{ctx.graph.where}: option {bad}")


def _fused_invocation(ctx: ConversionContext, block: AttentionBlock, head_dim: int | None,
                      layer: int = 0, query: str | None = None) -> A.Invocation:
    scale = block.scale
    if scale is None:
        if head_dim is None:
            raise ConversionError(f"{ctx.graph.where}: attention '{block.output}' has no scale and an unknown "
                                  "head size")
        scale = 1.0 / math.sqrt(head_dim)
    r = block.mask_reading
    causal = block.is_causal or (r is not None and r.kind in ("causal", "window"))
    site = AttentionSite(scale=float(scale), is_causal=bool(causal), softcap=float(block.softcap or 0.0), layer=layer,
                         window=int(r.window) if r is not None and r.kind == "window" else 0,
                         sink_logits=tuple(block.sink_logits))
    return invocation(ctx.scheme.op, A.Identifier(query or block.q), A.Identifier(block.key.new),
                      A.Identifier(block.value.new),
                      **ctx.scheme.attributes(ctx.settings, site))


def _static_dim(e: A.Expr | None) -> int | None:
    v = static_value(e) if e is not None else None
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None


# ----------------------------------------------------------------------------------------------
class NormalizePass:
    """One definition per name, and the calls of document fragments holding an attention (the recognizer follows
    a softmax inside their expansion) inlined, so the converter can edit it (torch-to-nnef writes some f16
    attentions as a fragment)."""

    name = "normalize"

    def run(self, ctx: ConversionContext) -> PassReport:
        rep = PassReport(self.name)
        g = ctx.graph
        before = [n.name for n in g.nodes]
        k = g.make_ssa()
        if k:
            after = [n.name for n in g.nodes]
            rep.nodes_replaced = [f"{a} -> {b}" for a, b in zip(before, after) if a != b]
            rep.notes.append(f"{k} re-assigned names given a name of their own (values unchanged)")
        frags = {f.name: f for f in g.doc.fragments if f.body is not None}
        calls: list[tuple[str, str]] = []
        for _ in range(8):  # a fragment's attention may sit in a fragment it calls: one level a round
            now = [(name, g.producer[name].op or "") for name in _attention_calls(g, frags)]
            for name, op in now:
                g.inline(name, frags[op])
                rep.nodes_replaced.append(f"{name}: {op}(...) inlined")
            calls += now
            if not now:
                break
        if calls:
            names = ', '.join(sorted({op for _, op in calls}))
            rep.notes.append(f"{len(calls)} call(s) of attention fragments ({names}) "
                             "inlined into the graph")
        probe = GraphEdit(g.document(), g.tensors, g.where)
        ctx.initially_dead = set(probe.dead_code())
        if ctx.initially_dead:
            rep.notes.append(f"{len(ctx.initially_dead)} statements unused in the input graph are kept as they are")
        return rep


def _attention_calls(g: GraphEdit, frags: dict[str, A.FragmentDecl]) -> list[str]:
    """The statements calling a document fragment inside which the recognizer follows an attention's softmax
    (found or missed), in graph order: what must be inlined for the converter to edit it."""
    w = view_of(g)
    found, misses = recognize(w)
    inside = {f.softmax.name for f in found if f.softmax is not None} | {m.around for m in misses}
    out = []
    for name in inside:
        node = w.nodes[w.index[name]] if name in w.index else None
        st = statement(name)
        if node is not None and node.op in SOFTMAX_OPS and st != name and g.op_of(st) in frags:
            out.append(st)
    return sorted(set(out), key=lambda x: g.producer[x].index)


def _check_scheme(ctx: ConversionContext, b: AttentionBlock) -> None:
    """The fused op of the scheme must express the attention: refuse in one line otherwise, naming the
    schemes that would convert it."""
    where = f"{ctx.graph.where}: attention '{b.output}'"
    s = ctx.scheme
    cache_only = [x.name for x in SCHEMES.values() if x.rewrite == "cache"]
    keep = (f"; scheme {' or '.join(cache_only)} converts the caches only and keeps the attention as exported"
            if cache_only else "")
    r = b.mask_reading
    if r is not None and r.kind == "window" and not s.sliding:
        sliding = [f"--scheme {x.name}" for x in SCHEMES.values() if x.sliding]
        also = f"; {' or '.join(sliding)} keep the window" if sliding else ""
        raise ConversionError(f"{where}: its mask '{b.mask}' is {r.describe()}; {s.op} has no sliding window, so "
                              f"the converted model would attend to every cached token{also}{keep}; nothing written")
    if r is not None and r.kind == "window" and getattr(ctx.settings, "sinks", 0):
        raise ConversionError(f"{where}: its mask '{b.mask}' is {r.describe()}: option --sinks "
                              f"{ctx.settings.sinks} keeps the first tokens, which a sliding layer never sees "
                              f"again; use --sinks 0; nothing written")
    if r is not None and r.kind == "other":
        raise ConversionError(f"{where}: its mask '{b.mask}' is not one {s.op} expresses (full causal or none): "
                              f"{r.describe()}{keep}; nothing written")
    if b.unsupported:
        raise ConversionError(f"{where}: its scores go through {', '.join(b.unsupported)} before the softmax, which "
                              f"{s.op} does not compute{keep}")
    if b.sink_logits and not s.sink_logits:
        takes = [f"--scheme {x.name}" for x in SCHEMES.values() if x.sink_logits]
        raise ConversionError(f"{where}: its softmax has a learned sink logit per head (the column '{b.sinks}', "
                              f"GPT-OSS's attention sinks) and {s.op} has none, so the converted model would "
                              f"drop them; {' or '.join(takes)} keep them (sink_logits){keep}; nothing written")
    if b.softcap and not s.softcap:
        others = [f"--scheme {x.name} (softcap attribute)" for x in SCHEMES.values() if x.rewrite == "attention"
                  and x.softcap] + [f"--scheme {n}" for n in cache_only]
        hint = f": use {' or '.join(others)}" if others else ""
        raise ConversionError(f"{where}: the scores are softcapped (tanh, cap {b.softcap:g}) and {s.op} has no "
                              f"softcap{hint}")


class AttentionPass:
    """Fused schemes (``rewrite = "attention"``: ``kivi``, ``tract``): every recognised attention over
    explicit (torch-to-nnef, ONNX) or dyn caches becomes one call of the scheme's op over this call's new
    keys/values; explicit cache inputs/outputs go (the caches move into the session), dyn cache nodes go."""

    name = "attention"
    nothing_found = f"no attention found: looked for {LOOKED_FOR}"

    @staticmethod
    def converted(ctx: ConversionContext) -> bool:
        return bool(ctx.blocks)

    def run(self, ctx: ConversionContext) -> PassReport:
        g = ctx.graph
        rep = PassReport(self.name)
        blocks, misses = find_attention(g)
        ctx.misses += misses
        ctx.found = blocks
        if not blocks:
            return rep
        for m in misses:  # converted beside others: that layer keeps its exported attention and f32 cache
            rep.change(f"softmax '{m.around}' left as exported, not converted: {m.message()}")
        op = ctx.scheme.op
        present: list[str] = []
        drop: set[str] = set()
        read_block_masks(g, blocks)  # what each mask is, by evaluating it (converters/masks.py)
        for b in blocks:
            _check_scheme(ctx, b)
        _layers_check(ctx, len(blocks))
        for layer, b in enumerate(blocks):
            ctx.blocks.append(b)
            head_dim = self._record_caches(ctx, b, present, drop)
            if b.kind == "folded":  # converters/folded.py: the query and the result in the graph's own layouts
                rewrite_folded(g, b, lambda q, b=b, layer=layer, head_dim=head_dim:
                        _fused_invocation(ctx, b, head_dim, layer, query=q))
            else:
                g.replace_rhs(b.output, _fused_invocation(ctx, b, head_dim, layer))
            rep.nodes_replaced.append(f"{b.output}: {b.kind} -> {op}")
            if b.mask is not None and b.mask_reading is not None and b.mask_reading.kind == "none":
                rep.notes.append(f"attention '{b.output}': mask '{b.mask}' read as {b.mask_reading.describe()}: "
                                 f"dropped, {op} attends to its whole cache")
            elif b.mask is not None and b.mask_reading is not None and b.mask_reading.kind == "window":
                rep.notes.append(f"attention '{b.output}': mask '{b.mask}' read as {b.mask_reading.describe()}: "
                                 f"kept as {op}'s window = {b.mask_reading.window}")
            elif b.mask is not None:
                note = ctx.scheme.mask_note.format(output=b.output, mask=b.mask, op=op)
                if ctx.scheme.causal:
                    rep.notes.append(note)
                else:
                    rep.change(note)
            if b.softcap:
                rep.notes.append(f"attention '{b.output}': tanh softcapping {b.softcap:g} kept (softcap attribute)")
            if b.sink_logits:
                rep.notes.append(f"attention '{b.output}': the sink column '{b.sinks}' read as one learned logit per "
                                 f"head ({len(b.sink_logits)}): kept as {op}'s sink_logits")
        # statements dead in the input that read an attention's inner tensors go with it (GPT-OSS's unused
        # argmax_reduce of the scores would keep the whole decomposed attention and its cache alive)
        inner = {x for b in blocks for x in b.nodes if x != b.output}
        ctx.forget_dead_readers(set(ctx.removed_inputs) | set(present) | drop | inner)
        rep.inputs_removed = [n for n in g.inputs if n in ctx.removed_inputs]
        g.inputs = [n for n in g.inputs if n not in ctx.removed_inputs]
        rep.outputs_removed = [n for n in g.outputs if n in present]
        g.outputs = [n for n in g.outputs if n not in present]
        if drop:  # f32 dyn caches nothing reads any more (stateful nodes are never dead code)
            still = {x for n in g.nodes if n.name not in drop for x in identifiers(n.stmt.rhs)}
            for name in sorted(drop - still):
                del g.body[g.producer[name].index]
                g.reindex()
                rep.nodes_removed.append(name)
        before = {n.name for n in g.nodes}
        ctx.dead_code()
        rep.nodes_removed += sorted(before - {n.name for n in g.nodes})
        return rep

    @staticmethod
    def _record_caches(ctx: ConversionContext, b: AttentionBlock, present: list[str], drop: set[str]) -> int | None:
        """Note what the block's caches take out of the graph; returns the head size when declared."""
        g = ctx.graph
        head_dim = None
        for src in (b.key, b.value):
            if src.kind == "explicit":
                assert src.past is not None
                shape = g.declared_shape(src.past)
                if shape is None or len(shape) != 4:
                    raise ConversionError(f"{g.where}: cache input '{src.past}' has no rank-4 declared shape")
                ctx.removed_inputs[src.past] = shape
                if isinstance(shape[2], A.Identifier):
                    ctx.past_symbol = ctx.past_symbol or shape[2].name
                full = list(shape)
                full[2] = A.BinaryExpr("+", shape[2], A.Identifier(_seq_symbol(ctx)))
                ctx.removed_full[src.full] = full
                present.append(src.full)
                head_dim = head_dim or _static_dim(shape[3])
            else:
                assert src.node is not None
                pss = src.node.arg("past_sequence_shape")
                if isinstance(pss, A.ArrayExpr) and len(pss.items) == 4:
                    if isinstance(pss.items[2], A.Identifier):
                        ctx.past_symbol = ctx.past_symbol or pss.items[2].name
                    head_dim = head_dim or _static_dim(pss.items[3])
                iss = src.node.arg("input_sequence_shape")
                if isinstance(iss, A.ArrayExpr) and len(iss.items) == 4 and isinstance(iss.items[2], A.Identifier):
                    ctx.new_symbol = ctx.new_symbol or iss.items[2].name
                axis = static_value(src.node.arg("axis"))
                if isinstance(pss, A.ArrayExpr) and isinstance(iss, A.ArrayExpr) and len(pss.items) == 4 \
                        and len(iss.items) == 4 and axis in (2, -2):
                    # its shape may still be read (the cached length of tract's stateful form): P + S on the axis
                    full = list(pss.items)
                    full[2] = A.BinaryExpr("+", pss.items[2], iss.items[2])
                    ctx.removed_full[src.full] = full
                drop.add(src.full)
        return head_dim


class CachePass:
    """Cache schemes (``rewrite = "cache"``: ``tract-cache``): every KV cache becomes one call of the scheme's
    op (``tract_transformers_quantized_dyn_kv_cache``: the dyn cache's attributes and the scheme's), whatever
    the attention reading it; explicit cache inputs/outputs go."""

    name = "caches"
    nothing_found = ("no KV cache found: looked for concat([cache input, new], axis = 2) with the cache a graph "
                     "input, or tract_transformers_dyn_kv_cache")

    @staticmethod
    def converted(ctx: ConversionContext) -> bool:
        return bool(ctx.caches)

    def run(self, ctx: ConversionContext) -> PassReport:
        g = ctx.graph
        rep = PassReport(self.name)
        blocks, misses = find_attention(g)
        ctx.found = blocks
        caches = find_caches(g, blocks)
        if not caches:
            ctx.misses += misses
            return rep
        present: list[str] = []
        _layers_check(ctx, max(sum(c.role == r for c in caches) for r in ("key", "value")))
        seen = {"key": 0, "value": 0}
        for src in caches:
            attrs = ctx.scheme.attributes(ctx.settings, CacheSite(src.role, seen.get(src.role, 0)))
            seen[src.role] = seen.get(src.role, 0) + 1
            if src.kind == "explicit":
                assert src.past is not None
                shape = g.declared_shape(src.past)
                if shape is None or len(shape) != 4:
                    raise ConversionError(f"{g.where}: cache input '{src.past}' has no rank-4 declared shape")
                ctx.removed_inputs[src.past] = shape
                if isinstance(shape[2], A.Identifier):
                    ctx.past_symbol = ctx.past_symbol or shape[2].name
                present.append(src.full)
                self._explicit(ctx, src, attrs)
            else:
                self._dyn(ctx, src, attrs)
            was = 'concat' if src.kind == 'explicit' else DYN_CACHE_OP
            rep.nodes_replaced.append(f"{src.full} ({src.role}s): {was} "
                                      f"-> {ctx.scheme.op}")
        ctx.caches = caches
        ctx.forget_dead_readers(set(ctx.removed_inputs))
        rep.inputs_removed = [n for n in g.inputs if n in ctx.removed_inputs]
        g.inputs = [n for n in g.inputs if n not in ctx.removed_inputs]
        rep.outputs_removed = [n for n in g.outputs if n in present]
        g.outputs = [n for n in g.outputs if n not in present]
        before = {n.name for n in g.nodes}
        ctx.dead_code()
        rep.nodes_removed = sorted(before - {n.name for n in g.nodes})
        return rep

    @staticmethod
    def _explicit(ctx: ConversionContext, src: CacheSource, attrs: dict[str, Any]) -> None:
        g = ctx.graph
        assert src.past is not None
        past_shape = ctx.removed_inputs[src.past]
        s = _seq_symbol(ctx)
        new_shape = list(past_shape)
        new_shape[2] = A.Identifier(s)
        rhs = invocation(
            ctx.scheme.op, A.Identifier(src.new), name=src.past, axis=2, **attrs, datum_type=_datum_type(g, src.past),
            past_sequence_shape=A.ArrayExpr(tuple(past_shape)), input_sequence_shape=A.ArrayExpr(tuple(new_shape)))
        g.replace_rhs(src.full, rhs)

    @staticmethod
    def _dyn(ctx: ConversionContext, src: CacheSource, attrs: dict[str, Any]) -> None:
        g = ctx.graph
        assert src.node is not None and src.node.inv is not None
        inv = src.node.inv
        args = list(inv.args)
        names = [a.name for a in args]
        at = names.index("axis") + 1 if "axis" in names else len(args)
        added = invocation(ctx.scheme.op, **attrs).args  # the scheme's attributes, as NNEF arguments
        args[at:at] = list(added)
        g.replace_rhs(src.full, A.Invocation(ctx.scheme.op, None, tuple(args)))


class CacheShapeToSymbolPass:
    """Shapes read from removed cache inputs become expressions of their declared dims (``P``)."""

    name = "cache-shape-to-symbol"

    def run(self, ctx: ConversionContext) -> PassReport:
        g = ctx.graph
        rep = PassReport(self.name)
        # a removed concatenation (past + new) may still have its shape read (sdpa exports reshape the
        # attention output with it): that shape is the past's with P + S on the sequence axis
        for full, dims in ctx.removed_full.items():
            for r in list(g.users(full)):
                if r.name in g.producer and r.op in ("tract_core_shape_of", "shape_of"):
                    self._rewrite_shape(ctx, r, dims, rep)
        ctx.dead_code()
        # a dyn cache replaced by the fused op whose shape only was read: gone now (its f32 state with it)
        for full in ctx.removed_full:
            node = g.producer.get(full)
            if node is not None and node.op == DYN_CACHE_OP and not g.users(full) and full not in g.outputs:
                del g.body[node.index]
                g.reindex()
                rep.nodes_removed.append(full)
        for past, dims in ctx.removed_inputs.items():
            for r in list(g.users(past)):
                if g.producer.get(r.name) is not None and g.producer[r.name].stmt != r.stmt:
                    continue  # rewritten meanwhile
                if r.name not in g.producer:
                    continue  # removed as dead code by an earlier rewrite
                if r.op not in ("tract_core_shape_of", "shape_of"):
                    raise ConversionError(
                        f"{g.where}: the removed cache input '{past}' is still read by '{r.name}' ({r.op}); "
                        "only its shape may be used outside the attention")
                self._rewrite_shape(ctx, r, dims, rep)
        ctx.dead_code()
        return rep

    def _rewrite_shape(self, ctx: ConversionContext, shape_node: Node, dims: list[A.Expr], rep: PassReport) -> None:
        g = ctx.graph
        for s in list(g.users(shape_node.name)):
            axes, begin, end = int_list(s.arg("axes")), int_list(s.arg("begin")), int_list(s.arg("end"))
            if s.op == "slice" and axes == [0] and begin and end and len(begin) == 1 and len(end) == 1 \
                    and end[0] == begin[0] + 1 and 0 <= begin[0] < len(dims):
                dim = dims[begin[0]]
                for q in list(g.users(s.name)):
                    if q.op == "squeeze" and int_list(q.arg("axes")) == [0]:
                        g.replace_rhs(q.name, dim)
                        rep.nodes_replaced.append(f"{q.name} = {_text(dim)}")
                if g.users(s.name):
                    g.replace_rhs(s.name, A.ArrayExpr((dim,)))
                    rep.nodes_replaced.append(f"{s.name} = [{_text(dim)}]")
        ctx.dead_code()
        if shape_node.name in g.producer and g.users(shape_node.name):
            g.replace_rhs(shape_node.name, A.ArrayExpr(tuple(dims)))
            rep.nodes_replaced.append(f"{shape_node.name} = [{', '.join(_text(d) for d in dims)}]")


def _text(e: A.Expr) -> str:
    from ..grammar import dump_expr

    return dump_expr(e)


class PositionBindingPass:
    """Fused schemes: keep the past-length symbol bound at run time.

    The fused ops carry no ``past_sequence_shape``, so nothing would tell the session (nnef-kv or
    tract) what ``P`` is once the cache inputs are gone. The pass adds a ``[1, 1, S, 1]`` slice of
    the first attention's new keys cached by ``tract_transformers_dyn_kv_cache(...,
    past_sequence_shape = [1, 1, P, 1])``: both runtimes bind ``P`` from that state before a run.

    tract 0.23.9 drops nodes whose output nothing reads (measured: an unread position cache leaves
    ``P`` undetermined, "Evaluating cachePosition Range: Undetermined symbol in expression: P"), and
    it folds ``shape_of`` of a symbolic shape to a constant, so reading the cache's shape does not
    keep it either. The cache therefore enters the data path with an exact zero:
    ``q' = q + max_reduce(f - f, axes = [2])`` with ``f = cast(c == c, f32)`` for the first attention
    (``x + 0.0 == x``). ``f`` is 1 or 0 (0 where the cached key is NaN), never Inf or NaN, so ``f - f`` is
    0 whatever the keys hold; ``c - c`` would be NaN where a key is Inf or NaN and spread it to every head.
    """

    name = "position-binding"

    def run(self, ctx: ConversionContext) -> PassReport:
        g = ctx.graph
        rep = PassReport(self.name)
        p = ctx.past_symbol
        if ctx.scheme.rewrite != "attention" or p is None or not ctx.blocks:
            return rep
        if p not in g.symbols():
            g.add_extension("tract_symbol", p)
        uses_p = any(p in set(identifiers(n.stmt.rhs)) for n in g.nodes)
        if not uses_p:
            rep.notes.append(f"the graph does not use the past length {p}: no position cache added")
            return rep
        block = ctx.blocks[0]
        s = _seq_symbol(ctx)
        src = g.fresh(f"{POSITION_CACHE}_input")
        out = g.fresh(POSITION_CACHE)
        same = g.fresh(f"{POSITION_CACHE}_same")
        finite = g.fresh(f"{POSITION_CACHE}_flag")
        diff = g.fresh(f"{POSITION_CACHE}_diff")
        zero = g.fresh(f"{POSITION_CACHE}_zero")
        qb = g.fresh(f"{block.q}_bound")
        one = A.IntegerLiteral(1)
        stmts = [
            A.Assignment(A.Identifier(src), invocation("slice", A.Identifier(block.key.new), axes=[0, 1, 3],
                                                        begin=[0, 0, 0], end=[1, 1, 1])),
            A.Assignment(A.Identifier(out), invocation(
                DYN_CACHE_OP, A.Identifier(src), name=POSITION_CACHE, axis=2, datum_type="f32",
                past_sequence_shape=A.ArrayExpr((one, one, A.Identifier(p), one)),
                input_sequence_shape=A.ArrayExpr((one, one, A.Identifier(s), one)))),
            A.Assignment(A.Identifier(same), invocation("eq", A.Identifier(out), A.Identifier(out))),
            A.Assignment(A.Identifier(finite), invocation("tract_core_cast", A.Identifier(same), to="f32")),
            A.Assignment(A.Identifier(diff), invocation("sub", A.Identifier(finite), A.Identifier(finite))),
            A.Assignment(A.Identifier(zero), invocation("max_reduce", A.Identifier(diff), axes=[2])),
            A.Assignment(A.Identifier(qb), invocation("add", A.Identifier(block.q), A.Identifier(zero))),
        ]
        g.insert_before(block.output, stmts)
        n = g.producer[block.output]
        assert n.inv is not None
        args = tuple(A.Argument(a.name, A.Identifier(qb)) if i == 0 else a for i, a in enumerate(n.inv.args))
        g.replace_rhs(block.output, A.Invocation(n.inv.name, n.inv.generic, args))
        rep.nodes_added = [src, out, same, finite, diff, zero, qb]
        rep.nodes_replaced = [f"{block.output}: q '{block.q}' -> '{qb}'"]
        rep.notes.append(f"'{out}' ([1, 1, {p}+{s}, 1] f32, 4 bytes a token) binds {p} from the session state; "
                         f"it reaches the data path as an exact zero added to '{block.q}' (tract drops unread nodes)")
        return rep


class CleanupPass:
    """Dead code, tensors no variable reads any more, registry extensions the new ops need."""

    name = "cleanup"

    def run(self, ctx: ConversionContext, model: Any) -> PassReport:
        g = ctx.graph
        rep = PassReport(self.name)
        before = {n.name for n in g.nodes}
        ctx.dead_code()
        rep.nodes_removed = sorted(before - {n.name for n in g.nodes})
        ops = {n.op for n in g.nodes}
        kv_ops = ops_with(role="kv-cache") | ops_with(role="attention+kv")  # what a scheme writes
        needed = [e for op in sorted(ops & kv_ops) for e in extensions_for(op)]
        needed.sort(key=lambda e: e[0] != "tract_registry")  # tract's registries first (stable)
        for name, argument in dict.fromkeys(needed):
            if g.add_extension(name, argument):
                rep.notes.append(f"extension {name}{' ' + argument if argument else ''} added")
        return rep


#: the passes that rewrite a graph for a scheme, by :attr:`~nnef_kv.converters.schemes.Scheme.rewrite`
REWRITES: dict[str, Any] = {"attention": AttentionPass, "cache": CachePass}
