"""The builder's nested graphs: ``tract_core_scan`` bodies and ``tract_core_submodel`` models (mixin).

Both become a :class:`~.graph.Graph` hung on their node (``Node.body``), which the planner plans (a scan's
loop is a :class:`~.ops.tract_scan.ScanLoop` state, a sub-model one stateless step); the builder never plans.
"""
from __future__ import annotations

import re
from typing import Any

from ..errors import GraphError
from ..grammar import ast as A
from ..grammar.printer import expr_text, short as _short
from .graph import Graph, InputSpec
from ..core.params import ParamInfo, bind_arguments, param_info
from ..core.registry import Primitive
from .values import Lazy, TRef, _Ctx


def _planned_by_the_planner(*args: Any, **kwargs: Any) -> Any:
    raise GraphError("internal error: a nested graph's node ran before the planner gave it its kernel")


class NestedMixin:
    """``tract_core_scan`` and ``tract_core_submodel`` for :class:`~.builder.GraphBuilder`."""

    # -- tract_core_scan -------------------------------------------------------------------------

    _SCAN_PARAMS = [ParamInfo(n, "attr", None) for n in
                    ("body", "scan", "full", "state", "output", "skip", "reset_every_turn", "external_state")]

    def _scan(self, inv: A.Invocation, ctx: _Ctx, qual: str) -> list[Any]:
        """``tract_core_scan``: the body fragment (named by a string) becomes a planned sub-graph run by
        :class:`~nnef_kv.interpreter.ops.tract_scan.ScanLoop`, a stateful kernel (its hidden state persists
        across runs, as in tract)."""
        from .ops.tract_scan import ScanSpec

        where = f"{self.loc(inv.pos)}: tract_core_scan '{qual}': "
        bound = bind_arguments(inv, self._SCAN_PARAMS)

        def items(name: str) -> list[A.Expr]:
            e = bound.get(name)
            if e is None:
                return []
            if not isinstance(e, A.ArrayExpr):
                raise GraphError(where + f"'{name}' must be an array of tuples")
            out = []
            for it in e.items:
                if not isinstance(it, A.TupleExpr):
                    raise GraphError(where + f"'{name}' must be an array of tuples")
                out.append(it.items)
            return out

        def static(e: A.Expr) -> Any:
            v = self.attr(e, ctx)
            if isinstance(v, Lazy):
                raise GraphError(where + f"{expr_text(e)} must be known when the graph is built")
            return v

        def tensor(e: A.Expr) -> int:
            return self.as_tensor(self.tensor_value(e, ctx, qual), ctx, qual).slot

        body_e = bound.get("body")
        if body_e is None:
            raise GraphError(where + "no body")
        body_name = static(body_e)
        frag = self.fragments.get(body_name)
        if frag is None or frag.body is None:
            raise GraphError(where + f"body fragment '{body_name}' is not defined in the document")
        known = {p.name for p in frag.params} | {r.name for r in frag.results}

        def ident(e: A.Expr) -> str:
            # tract writes the scan's names with dots ("Y.y_h") where the fragment has "Y_y_h"
            n = str(static(e))
            if n in known:
                return n
            alt = re.sub(r"[^A-Za-z0-9_]", "_", n)
            if alt in known:
                return alt
            raise GraphError(where + f"body fragment '{body_name}' has no parameter or result '{n}'")

        scan = [(ident(t[0]), tensor(t[1]), int(static(t[2])), int(static(t[3]))) for t in items("scan")]
        full = [(ident(t[0]), tensor(t[1])) for t in items("full")]
        state = [(ident(t[0]), tensor(t[1]), ident(t[2])) for t in items("state")]
        output = [(ident(t[0]), static(t[1]), int(static(t[2])), int(static(t[3]))) for t in items("output")]
        flags = {k: (static(bound[k]) if bound.get(k) is not None else 0)
                 for k in ("skip", "reset_every_turn", "external_state")}
        spec = ScanSpec(
            scan=tuple((n, a, c) for n, _, a, c in scan),
            full=tuple(n for n, _ in full),
            state=tuple((n, r) for n, _, r in state),
            outputs=tuple(output),
            skip=int(flags["skip"]),
            reset_every_turn=bool(flags["reset_every_turn"]),
            name=f"tract_core_scan '{qual}'",
        )
        body = self._body_graph(frag, where)
        prim = Primitive(
            signature="fragment tract_core_scan(body: string) -> (outputs: tensor<scalar>[]);",
            registry="tract_core", state_factory=_planned_by_the_planner, name="tract_core_scan",
        )
        attrs = {"body": body_name, "scan": [(n, a, c) for n, _, a, c in scan], "full": [n for n, _ in full],
                 "state": [(n, r) for n, _, r in state], "output": output, **flags}
        ins = [[s for _, s, _, _ in scan], [s for _, s in full], [s for _, s, _ in state]]
        outs = self._add_node("tract_core_scan", prim, ins, attrs, len(output), qual, inv.pos)
        self.nodes[-1].body, self.nodes[-1].extra = body, spec
        return [TRef(o) for o in outs]

    def _body_graph(self, frag: A.FragmentDecl, where: str) -> Graph:
        """A document fragment built as a stand-alone nested graph: its tensor parameters are the graph's
        inputs (by name), its results the outputs."""
        sub = type(self)(self.doc, self.tensors, None, self.filename)
        sub.quant = self.quant
        sub.limits = self.limits
        sub.items_built = self.items_built  # one budget for the whole document build
        ctx = _Ctx({}, frag.name + ".", 1)
        params, results = param_info(frag)
        inputs: list[InputSpec] = []
        for p in params:
            if p.kind != "tensor":
                raise GraphError(where + f"body parameter '{p.name}' must be a tensor")
            slot = sub.new_slot()
            inputs.append(InputSpec(p.name, slot, None, [], where))  # type: ignore[arg-type]
            ctx.scope[p.name] = TRef(slot)
        assert frag.body is not None
        for st in frag.body:
            sub.assign(st, ctx)
        self.items_built = sub.items_built
        for r in results:
            if r.name not in ctx.scope:
                raise GraphError(where + f"fragment {frag.name}: result {r.name} is never assigned")
        out_slots = [(r.name, sub.as_tensor(ctx.scope[r.name], ctx, r.name).slot) for r in results]
        return Graph(frag.name, sub.nslots, sub.constants, sub.nodes, inputs, out_slots, sub.symbols,
                     self.quant, self.filename)

    # -- tract_core_submodel ----------------------------------------------------------------------

    def _submodel(self, inv: A.Invocation, ctx: _Ctx, qual: str) -> list[Any]:
        """``tract_core_submodel(input, label = 'x')``: the model stored beside the graph as ``x.nnef.tgz``,
        ``x.nnef.tar`` or folder ``x/``, planned on its own and run as one stateless node."""
        where = f"{self.loc(inv.pos)}: tract_core_submodel '{qual}': "
        bound = bind_arguments(inv, [ParamInfo("input", "tensors", None), ParamInfo("label", "attr", None)])
        if bound["label"] is None or bound["input"] is None:
            raise GraphError(where + "needs an input and a label")
        label = self.attr(bound["label"], ctx)
        if not isinstance(label, str):
            raise GraphError(where + f"label must be a string, got {_short(repr(label), 60)}")
        if self.submodel is None:
            raise GraphError(where + "sub-models can only be resolved for a model loaded from an archive")
        try:
            sub = self.submodel(label)
        except GraphError as exc:
            raise GraphError(where + str(exc)) from exc
        except Exception as exc:  # noqa: BLE001 - any loading failure is reported with the node
            raise GraphError(where + f"cannot load sub-model '{label}': {exc}") from exc
        sub_graph = type(self)(sub.document, sub.tensors, sub.quantization,
                               f"{self.filename}: sub-model '{label}'", sub.load_submodel).build()
        value = self.tensor_value(bound["input"], ctx, qual)
        values = value if isinstance(value, list) else [value]
        if len(values) != len(sub_graph.inputs):
            raise GraphError(where + f"{len(values)} inputs for a sub-model with {len(sub_graph.inputs)}")
        prim = Primitive(signature="fragment tract_core_submodel(input: tensor<scalar>[], label: string) -> "
                         "(output: tensor<scalar>[]);", registry="tract_core", kernel=_planned_by_the_planner,
                         name="tract_core_submodel")
        slots = [self.as_tensor(x, ctx, qual).slot for x in values]
        outs = self._add_node("tract_core_submodel", prim, [slots], {"label": label}, len(sub_graph.outputs), qual,
                              inv.pos)
        self.nodes[-1].body = sub_graph
        return [TRef(o) for o in outs]
