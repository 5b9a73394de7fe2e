"""AST -> :class:`~.graph.Graph`: the builder walks the graph body once, expanding document fragments
(which win over registered primitives, as in tract) and resolving every invocation to a registered
:class:`Primitive` (values: :mod:`.values`; attributes: :mod:`.attrs`; graph.quant: :mod:`.quant`).

Attribute expressions are evaluated at build time when they can be; otherwise the whole expression is
kept and re-evaluated per run against the run's values (``Lazy``). Nested invocations inside an attribute
(``begin = [within_bound_index(b, n)]``) become nodes at build time; the run-time evaluation reads their slot.
``tract_core_scan`` bodies and ``tract_core_submodel`` models become nested graphs (``Node.body``)
that the planner plans.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..errors import GraphError, UnknownOpError
from ..grammar import ast as A
from ..grammar.printer import expr_text
from ..limits import Limits, current_limits
from .attrs import BINARY_OPS, BUILTINS, UNARY_OPS, AttributeEvaluator
from .graph import Graph, InputSpec, Node
from ..core.params import ParamInfo, _is_tensor_array, bind_arguments, param_info
from .nested import NestedMixin
from .quant import QuantMixin
from .sources import SOURCE_OPS, SourceMixin
from .catalog import lookup
from ..core.registry import Primitive
from .values import LRef, Lazy, TRef, _Ctx, literal_array, to_py

BUILDER_OPS = SOURCE_OPS + ("tract_core_scan", "tract_core_submodel")


class GraphBuilder(AttributeEvaluator, QuantMixin, NestedMixin, SourceMixin):
    """Builds a :class:`Graph` from a document, its tensors and its quantization."""

    MAX_DEPTH = 64
    def __init__(self, document: A.Document, tensors: dict[str, Any] | None = None,
                 quantization: Any = None, filename: str = "graph.nnef",
                 submodel: Callable[[str], Any] | None = None, opaque: bool = False) -> None:
        if document.graph is None:
            raise GraphError(f"{filename}: the document has no graph")
        self.doc = document
        self.tensors = tensors or {}
        self.filename = filename
        self.fragments = {f.name: f for f in document.fragments}
        self.nslots = 0
        self.constants: dict[int, np.ndarray] = {}
        self.nodes: list[Node] = []
        self.inputs: list[InputSpec] = []
        self.symbols: dict[str, int] = {}
        self.declared_symbols = {e.argument.strip() for e in document.extensions if e.name == "tract_symbol"}
        #: the limits in force when the builder is made (session.get_plan builds under the model's limits);
        #: run-time (Lazy) evaluations apply them too
        self.limits: Limits = current_limits()
        #: items produced by attribute expressions (comprehensions, ranges, list repetition/concatenation)
        #: in the whole build, bounded in total by ``max_comprehension_items``
        self.items_built = 0
        #: the top-level statement being built (messages)
        self.statement: A.Assignment | None = None
        self.quant: dict[str, tuple[str, dict[str, Any]]] = {}
        if quantization is not None:
            for entry in getattr(quantization, "entries", ()):
                args = {}
                for k, v in entry.named().items():
                    args[k] = self._static_literal(v)
                self.quant[entry.tensor] = (entry.op, args)
        self.names_used: dict[str, int] = {}
        self.tensor_names: dict[str, int] = {}
        self.submodel = submodel  # label -> Model, for tract_core_submodel
        #: an unknown op becomes a node that cannot run (reading its tensor arguments, one result a name) instead
        #: of an error: a graph built to be read, not run (the converter's recognizer)
        self.opaque = opaque
        self.slot_quant: dict[int, dict[str, Any]] = {}  # slots holding graph.quant values -> their params
        #: the limits in force when the builder was made (session.get_plan builds under the model's limits);
        #: run-time (Lazy) evaluations apply them too

    # -- slots -------------------------------------------------------------------------------

    def new_slot(self) -> int:
        self.nslots += 1
        return self.nslots - 1

    def const(self, arr: np.ndarray) -> TRef:
        s = self.new_slot()
        self.constants[s] = arr
        return TRef(s)

    def loc(self, pos: A.Pos | None) -> str:
        return f"{self.filename}:{pos.line}:{pos.column}" if pos else self.filename

    def _here(self) -> str:
        """Where the builder is: the top-level statement being built (or the file)."""
        st = self.statement
        return self.loc(st.pos) if st is not None else self.filename

    def unique(self, name: str) -> str:
        n = self.names_used.get(name, 0)
        self.names_used[name] = n + 1
        return name if n == 0 else f"{name}#{n}"

    def symbol(self, name: str) -> Lazy:
        if name not in self.symbols:
            self.symbols[name] = self.new_slot()
        slot = self.symbols[name]
        return Lazy(lambda v, s=slot: v[s], name, (slot,))

    # -- entry ---------------------------------------------------------------------------------

    def build(self) -> Graph:
        g = self.doc.graph
        assert g is not None
        ctx = _Ctx({}, "", 0)
        self.graph_inputs = set(g.inputs)
        for st in g.body:
            self.statement = st
            self.assign(st, ctx)
        self.statement = None
        outputs: list[tuple[str, int]] = []
        for name in g.outputs:
            if name not in ctx.scope:
                raise GraphError(f"{self.loc(g.pos)}: graph output '{name}' is never assigned")
            val = ctx.scope[name]
            ref = self.as_tensor(val, ctx, name)
            outputs.append((name, ref.slot))
        by_name = {i.name: i for i in self.inputs}
        ordered = [by_name[n] for n in g.inputs if n in by_name]
        missing = [n for n in g.inputs if n not in by_name]
        if missing:
            raise GraphError(f"{self.loc(g.pos)}: graph input '{missing[0]}' is not defined by an external")
        ordered += [i for i in self.inputs if i.name not in g.inputs]
        return Graph(g.name, self.nslots, self.constants, self.nodes, ordered, outputs, self.symbols,
                     self.quant, self.filename, self.tensor_names, self._assertions())

    def _assertions(self) -> list[Any]:
        """The document's ``extension tract_assert`` lines, compiled (see :mod:`.assertions`)."""
        from .assertions import parse_assertion

        return [parse_assertion(e.argument, self.loc(e.pos)) for e in self.doc.extensions
                if e.name == "tract_assert"]

    # -- statements ----------------------------------------------------------------------------

    def _lhs_names(self, lhs: A.Expr) -> list[str]:
        if isinstance(lhs, A.Identifier):
            return [lhs.name]
        if isinstance(lhs, (A.TupleExpr, A.ArrayExpr)):
            out: list[str] = []
            for i in lhs.items:
                out += self._lhs_names(i)
            return out
        raise GraphError(f"{self.loc(getattr(lhs, 'pos', None))}: cannot assign to {expr_text(lhs)}")

    def assign(self, st: A.Assignment, ctx: _Ctx) -> None:
        names = self._lhs_names(st.lhs)
        if isinstance(st.rhs, A.Invocation) and not (
            st.rhs.name in BUILTINS and st.rhs.name not in self.fragments and lookup(st.rhs.name) is None
        ):
            results = self.invoke(st.rhs, ctx, names[0] if names else "_", st.lhs)
        else:
            results = [self.tensor_value(st.rhs, ctx, names[0] if names else "_")]
        if self.quant and ctx.depth == 0 and isinstance(st.lhs, A.Identifier) and len(results) == 1:
            results = [self._fake_quant(st.lhs.name, results[0], st.rhs, ctx)]
        self._bind_lhs(st.lhs, results, ctx, st)

    def _bind_lhs(self, lhs: A.Expr, results: list[Any], ctx: _Ctx, st: A.Assignment) -> None:
        if isinstance(lhs, A.Identifier):
            ctx.scope[lhs.name] = results[0] if len(results) == 1 else list(results)
            if ctx.depth == 0 and isinstance(ctx.scope[lhs.name], TRef):
                # the first assignment names the tensor (as it names the node); later ones are reached by
                # node name ("x#1")
                self.tensor_names.setdefault(lhs.name, ctx.scope[lhs.name].slot)
            return
        assert isinstance(lhs, (A.TupleExpr, A.ArrayExpr))
        vals: list[Any]
        if len(results) == 1 and isinstance(results[0], LRef):  # [a, b, c] = split(...)
            k = len(lhs.items)
            outs = self._add_node("<unpack>", _UNPACK_PRIM, [("list", results[0].slot)], {"count": k}, k,
                                  self._lhs_names(lhs)[0] + ".unpack", st.pos)
            vals = [TRef(o) for o in outs]
        elif len(results) == 1 and len(lhs.items) != 1:
            only = results[0]
            if isinstance(only, (list, tuple)):
                vals = list(only)
            else:
                raise GraphError(f"{self.loc(st.pos)}: cannot unpack one value into {len(lhs.items)} names")
        else:
            vals = results
        if len(vals) != len(lhs.items):
            raise GraphError(
                f"{self.loc(st.pos)}: {len(lhs.items)} names on the left but {len(vals)} results")
        for item, v in zip(lhs.items, vals):
            self._bind_lhs(item, [v], ctx, st)

    # -- tensor context --------------------------------------------------------------------------

    def _tensorish(self, e: A.Expr, ctx: _Ctx) -> bool:
        """Does the expression involve run-time tensors (so operators become nodes)?"""
        if isinstance(e, A.Identifier):
            v = ctx.scope.get(e.name)
            return isinstance(v, (TRef, LRef)) or (isinstance(v, list) and any(isinstance(x, TRef) for x in v))
        if isinstance(e, A.Invocation):
            return not (e.name in BUILTINS and e.name not in self.fragments and lookup(e.name) is None)
        if isinstance(e, A.BinaryExpr):
            return self._tensorish(e.left, ctx) or self._tensorish(e.right, ctx)
        if isinstance(e, A.UnaryExpr):
            return self._tensorish(e.operand, ctx)
        if isinstance(e, (A.ArrayExpr, A.TupleExpr)):
            return any(self._tensorish(i, ctx) for i in e.items)
        if isinstance(e, A.IfElseExpr):
            return self._tensorish(e.then_value, ctx) or self._tensorish(e.else_value, ctx)
        return False

    def tensor_value(self, e: A.Expr, ctx: _Ctx, name: str) -> Any:
        """Evaluate an expression where a tensor may be meant: returns a TRef, a static value, a Lazy or a list."""
        if isinstance(e, A.Invocation) and id(e) in ctx.memo:
            return ctx.memo[id(e)]
        if isinstance(e, A.Identifier):
            if e.name in ctx.scope:
                return ctx.scope[e.name]
            return self.attr(e, ctx)
        if isinstance(e, A.Invocation) and self._tensorish(e, ctx):
            res = self.invoke(e, ctx, name, None)
            return res[0] if len(res) == 1 else list(res)
        if isinstance(e, A.BinaryExpr) and self._tensorish(e, ctx):
            op = BINARY_OPS.get(e.op)
            if op is None:
                raise GraphError(f"{self.loc(e.pos)}: operator '{e.op}' cannot apply to tensors")
            return self.call_primitive(op, [self.tensor_value(e.left, ctx, name),
                                            self.tensor_value(e.right, ctx, name)], {}, ctx, name, e.pos)[0]
        if isinstance(e, A.UnaryExpr) and self._tensorish(e, ctx):
            if e.op == "+":
                return self.tensor_value(e.operand, ctx, name)
            return self.call_primitive(UNARY_OPS[e.op], [self.tensor_value(e.operand, ctx, name)], {}, ctx,
                                       name, e.pos)[0]
        if isinstance(e, (A.ArrayExpr, A.TupleExpr)) and self._tensorish(e, ctx):
            return [self.tensor_value(i, ctx, name) for i in e.items]
        if isinstance(e, A.IfElseExpr):
            cond = self.attr(e.condition, ctx)
            if isinstance(cond, Lazy):
                raise GraphError(f"{self.loc(e.pos)}: condition must be known when the graph is built")
            return self.tensor_value(e.then_value if cond else e.else_value, ctx, name)
        return self.attr(e, ctx)

    def as_tensor(self, v: Any, ctx: _Ctx, name: str) -> TRef:
        """A value forced to a tensor slot (literals become constants, Lazy values a per-run node)."""
        if isinstance(v, TRef):
            return v
        if isinstance(v, Lazy):
            return TRef(self._add_node("<lazy_constant>", _LAZY_PRIM, [], {"value": v}, 1, name, None)[0])
        if isinstance(v, LRef):
            raise GraphError(f"'{name}': a list of tensors where one tensor is expected")
        if isinstance(v, list) and any(isinstance(x, (TRef, Lazy)) for x in v):
            raise GraphError(f"'{name}': an array of tensors where one tensor is expected")
        return self.const(literal_array(v, f"{self._here()}: node '{name}': "))

    # -- invocations ---------------------------------------------------------------------------

    def invoke(self, inv: A.Invocation, ctx: _Ctx, name: str, lhs: A.Expr | None) -> list[Any]:
        """Build an invocation; returns one value per declared result."""
        qual = ctx.prefix + name
        frag = self.fragments.get(inv.name)
        if frag is not None and frag.body is not None:
            return self._expand(frag, inv, ctx, qual)
        if inv.name in SOURCE_OPS and (frag is None or frag.body is None):
            return [self._source(inv, ctx, qual)]
        if inv.name == "tract_core_scan" and frag is None:
            return self._scan(inv, ctx, qual)
        if inv.name == "tract_core_submodel" and frag is None:
            return self._submodel(inv, ctx, qual)
        if inv.name == "tract_core_cast" and "to" not in inv.named() and len(inv.args) < 2 and qual in self.quant:
            # cast to the type graph.quant gives: the fake-quantize node added after it does the work
            inv = A.Invocation("copy", None, inv.args[:1], pos=inv.pos)
        prim = lookup(inv.name)
        if prim is None and self.opaque:
            return self._opaque(inv, ctx, qual, lhs)
        if prim is None:
            raise UnknownOpError(
                f"{self.loc(inv.pos)}: unknown operation '{inv.name}' (node '{qual}')")
        params, results = param_info(prim.decl)
        if prim.positional:
            # tract reads the operands of its binary and unit element-wise ops by position, names ignored
            # (``add(x = a, 1.0)`` is ``a + 1.0``; tract ``nnef/src/registry.rs`` ``deserialize``)
            bound = {p.name: (inv.args[i].value if i < len(inv.args) else p.default) for i, p in enumerate(params)}
        else:
            bound = bind_arguments(inv, params)
        tensors: list[Any] = []
        attrs: dict[str, Any] = {}
        for p in params:
            e = bound[p.name]
            if p.kind == "attr":
                if e is not None:
                    a = self.attr(e, ctx)
                    if p.is_array:  # tract accepts a single item where an array is declared
                        if isinstance(a, Lazy):
                            a = Lazy(lambda v, f=a.fn: _as_list(f(v)), a.text, a.reads)
                        else:
                            a = _as_list(a)
                    attrs[p.name] = a
                continue
            if e is None or (isinstance(e, A.LogicalLiteral) and e.value is False and p.kind == "tensor"
                             and p.default is e):
                tensors.append(None)
                continue
            v = self.tensor_value(e, ctx, qual)
            tensors.append(v)
        return self.call_primitive(inv.name, tensors, attrs, ctx, qual, inv.pos, prim, params, results)

    def call_primitive(self, op: str, tensors: list[Any], attrs: dict[str, Any], ctx: _Ctx, name: str,
                       pos: A.Pos | None, prim: Primitive | None = None,
                       params: list[ParamInfo] | None = None, results: list[A.Result] | None = None) -> list[Any]:
        if prim is None:
            frag = self.fragments.get(op)
            if frag is not None and frag.body is not None:  # document fragment named like an operator op
                inv = A.Invocation(op, None, tuple(A.Argument(None, A.Identifier(f"__arg{i}"))
                                                   for i in range(len(tensors))), pos=pos)
                inner = _Ctx({**ctx.scope, **{f"__arg{i}": t for i, t in enumerate(tensors)}}, ctx.prefix, ctx.depth)
                return self._expand(frag, inv, inner, name)
            prim = lookup(op)
            if prim is None:
                raise UnknownOpError(f"{self.loc(pos)}: unknown operation '{op}' (node '{name}')")
            params, results = param_info(prim.decl)
        assert params is not None and results is not None
        ins: list[Any] = []
        tparams = [p for p in params if p.kind != "attr"]
        for p, v in zip(tparams, tensors):
            if v is None:
                ins.append(None)
            elif p.kind == "tensors":
                if isinstance(v, LRef):
                    ins.append(("list", v.slot))
                else:
                    seq = v if isinstance(v, (list, tuple)) else [v]
                    ins.append([self.as_tensor(x, ctx, name).slot for x in seq])
            else:
                ins.append(self.as_tensor(v, ctx, name).slot)
        for p in tparams[len(tensors):]:
            ins.append(None)
        if self.slot_quant:
            ins = self._quantized_bias(op, ins)
        array_result = [_is_tensor_array(r.type) for r in results]
        outs = self._add_node(op, prim, ins, attrs, len(results), name, pos, array_result)
        return [LRef(s) if arr else TRef(s) for s, arr in zip(outs, array_result)]

    def _add_node(self, op: str, prim: Primitive, ins: list[Any], attrs: dict[str, Any], nres: int, name: str,
                  pos: A.Pos | None, array_result: list[bool] | None = None) -> list[int]:
        outs = [self.new_slot() for _ in range(nres)]
        spec: list[Any] = []
        for s, arr in zip(outs, array_result or [False] * nres):
            spec.append(("list", s) if arr else s)
        self.nodes.append(Node(self.unique(name), op, prim, ins, attrs, spec, self.loc(pos)))
        return outs

    def _opaque(self, inv: A.Invocation, ctx: _Ctx, qual: str, lhs: A.Expr | None) -> list[Any]:
        """An unknown op as a node reading its tensor arguments (``opaque`` builds only)."""
        ins: list[int] = []
        for a in inv.args:
            if self._tensorish(a.value, ctx):
                v = self.tensor_value(a.value, ctx, qual)
                ins += [x.slot for x in (v if isinstance(v, list) else [v]) if isinstance(x, TRef)]
        n = len(self._lhs_names(lhs)) if lhs is not None else 1
        return [TRef(s) for s in self._add_node(inv.name, _OPAQUE_PRIM, [ins], {}, n, qual, inv.pos)]

    def _expand(self, frag: A.FragmentDecl, inv: A.Invocation, ctx: _Ctx, qual: str) -> list[Any]:
        if ctx.depth >= self.MAX_DEPTH:
            raise GraphError(f"{self.loc(inv.pos)}: fragment '{frag.name}' nests too deep (recursive?)")
        params, results = param_info(frag)
        bound = bind_arguments(inv, params)
        inner = _Ctx({}, qual + ".", ctx.depth + 1)
        for p in params:
            e = bound[p.name]
            if e is None:
                raise GraphError(f"{self.loc(inv.pos)}: missing argument '{p.name}' of fragment '{frag.name}'")
            if p.kind == "attr":
                v = self.attr(e, ctx) if p.default is not e else self._static_literal(e)
            else:
                v = self.tensor_value(e, ctx, qual) if p.default is not e else self._static_literal(e)
            inner.scope[p.name] = v
        assert frag.body is not None
        for st in frag.body:
            self.assign(st, inner)
        out = []
        for r in results:
            if r.name not in inner.scope:
                raise GraphError(f"{self.loc(frag.pos)}: fragment '{frag.name}' never assigns result '{r.name}'")
            out.append(inner.scope[r.name])
        return out

def _unpack(values: list[np.ndarray], count: int) -> Any:
    if len(values) != count:
        raise GraphError(f"{len(values)} tensors cannot be unpacked into {count} names")
    return values[0] if count == 1 else tuple(values)


_UNPACK_PRIM = Primitive(
    signature="fragment unpack(values: tensor<?>[], count: integer) -> (items: tensor<?>[]);",
    registry="nnef_kv",
    kernel=_unpack,
    name="<unpack>",
)


def _opaque_kernel(*_: Any, **__: Any) -> Any:
    raise UnknownOpError("an operation nnef-kv does not know cannot run")


_OPAQUE_PRIM = Primitive(
    signature="fragment opaque(inputs: tensor<?>[]) -> (outputs: tensor<?>[]);",
    registry="nnef_kv",
    kernel=_opaque_kernel,
    name="<opaque>",
)


def _as_list(a: Any) -> Any:
    return a if isinstance(a, (list, tuple)) else [a]


def _lazy_constant(value: Any) -> np.ndarray:
    return literal_array(value)


_LAZY_PRIM = Primitive(
    signature="fragment lazy_constant(value: ?) -> (output: tensor<?>);",
    registry="nnef_kv",
    kernel=_lazy_constant,
    name="<lazy_constant>",
)


def build_graph(document: A.Document, tensors: dict[str, Any] | None = None, quantization: Any = None,
                filename: str = "graph.nnef", submodel: Callable[[str], Any] | None = None,
                opaque: bool = False) -> Graph:
    """Build the :class:`Graph` of a document (see module docstring; ``opaque``: see :class:`GraphBuilder`)."""
    return GraphBuilder(document, tensors, quantization, filename, submodel, opaque).build()


__all__ = ["Graph", "Node", "InputSpec", "TRef", "LRef", "Lazy", "build_graph", "bind_arguments", "to_py",
           "literal_array", "expr_text", "BUILDER_OPS"]
