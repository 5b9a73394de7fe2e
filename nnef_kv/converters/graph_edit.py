"""A small editable view of an NNEF graph body, for the converter passes.

The AST is immutable; :class:`GraphEdit` keeps the graph body as a Python list of
:class:`~nnef_kv.grammar.ast.Assignment` and offers what the passes need: who defines a name,
who reads it, argument lookup by parameter name or position, dead-code elimination, inlining a
document fragment's call (operators written as the interpreter's builder reads them), and building new
invocations. What the statements compute (an attention, a constant) is the interpreter's to say: the
converter builds the document (:func:`nnef_kv.converters.attention.view_of`) and asks the one recognizer.
:meth:`GraphEdit.document` gives the edited document.

Names must be defined once for the passes to reason about them; torch-to-nnef exports re-assign
some names (``x_shape = tract_core_shape_of(x);`` written again further down), which tract
accepts. :meth:`GraphEdit.make_ssa` renames the earlier definitions (``x_shape`` -> ``x_shape__1``)
and their readers, which changes no value.
"""
from __future__ import annotations

from dataclasses import dataclass, is_dataclass, replace
from typing import Any, Iterable

import numpy as np

from ..errors import ConversionError
from ..grammar import ast as A
from ..grammar.ast import identifiers, rename
from ..interpreter.attrs import BINARY_OPS, UNARY_OPS
from ..interpreter.catalog import lookup, ops_having, ops_with
from ..core.params import bind_arguments, param_info

#: NNEF's ``shape_of`` is an attribute builtin (no registered op): its one parameter, for :meth:`Node.arg`
_BUILTIN_PARAMS: dict[str, tuple[str, ...]] = {"shape_of": ("x",)}


def params_of(op: str) -> tuple[str, ...]:
    """Parameter order of ``op`` (how positional arguments bind): its registered signature's."""
    prim = lookup(op)
    return prim.params if prim is not None else _BUILTIN_PARAMS.get(op, ())


def stateful_ops() -> frozenset[str]:
    """Ops whose nodes hold session state (never removed as dead code): every op registered stateful."""
    return ops_with(stateful=True)


#: the sources that declare graph inputs (the ``input`` fact)
SOURCE_OPS = ops_having("input")


# ----------------------------------------------------------------------------------------------
# expression helpers
# ----------------------------------------------------------------------------------------------
def ident(name: str) -> A.Identifier:
    return A.Identifier(name)


def lit(value: Any) -> A.Expr:
    """A literal expression for a Python value (bool, int, float, str, lists)."""
    if is_dataclass(value) and not isinstance(value, type):  # already an expression
        return value
    if isinstance(value, bool):
        return A.LogicalLiteral(value)
    if isinstance(value, (int, np.integer)):
        return A.IntegerLiteral(int(value))
    if isinstance(value, (float, np.floating)):
        return A.ScalarLiteral(float(value))
    if isinstance(value, str):
        return A.StringLiteral(value)
    if isinstance(value, (list, tuple)):
        return A.ArrayExpr(tuple(lit(v) for v in value))
    raise TypeError(f"no NNEF literal for {value!r}")


def invocation(op: str, *positional: Any, generic: A.TypeSpec | None = None, **named: Any) -> A.Invocation:
    args = [A.Argument(None, lit(v)) for v in positional]
    args += [A.Argument(k, lit(v)) for k, v in named.items()]
    return A.Invocation(op, generic, tuple(args))


def lhs_names(lhs: A.Expr) -> list[str]:
    if isinstance(lhs, A.Identifier):
        return [lhs.name]
    if isinstance(lhs, (A.TupleExpr, A.ArrayExpr)):
        return [n for item in lhs.items for n in lhs_names(item)]
    return []


def static_value(e: A.Expr) -> Any:
    """The Python value of a literal expression (arrays of literals, negation), else None."""
    if isinstance(e, (A.IntegerLiteral, A.ScalarLiteral, A.LogicalLiteral, A.StringLiteral)):
        return e.value
    if isinstance(e, A.ArrayExpr):
        items = [static_value(i) for i in e.items]
        return None if any(i is None for i in items) else items
    if isinstance(e, A.UnaryExpr) and e.op == "-":
        v = static_value(e.operand)
        return -v if isinstance(v, (int, float)) else None
    return None


def int_list(e: A.Expr | None) -> list[int] | None:
    """An integer or a list of integers as a list (``3`` -> ``[3]``), else None."""
    if e is None:
        return None
    v = static_value(e)
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return [v]
    if isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in v):
        return v
    return None


# ----------------------------------------------------------------------------------------------
# nodes
# ----------------------------------------------------------------------------------------------
@dataclass
class Node:
    """One statement ``lhs = op(args);`` of the graph body (``inv`` None for non-invocations)."""

    index: int
    names: list[str]
    stmt: A.Assignment

    @property
    def inv(self) -> A.Invocation | None:
        return self.stmt.rhs if isinstance(self.stmt.rhs, A.Invocation) else None

    @property
    def op(self) -> str | None:
        inv = self.inv
        return inv.name if inv is not None else None

    @property
    def name(self) -> str:
        return self.names[0] if self.names else "?"

    def arg(self, param: str) -> A.Expr | None:
        """The argument bound to ``param``: by name, else by position (tract's rule), else None."""
        inv = self.inv
        if inv is None:
            return None
        named = inv.named()
        if param in named:
            return named[param]
        order = params_of(inv.name)
        if param not in order:
            return None
        i = order.index(param)
        pos = inv.args
        if i < len(pos) and all(a.name is None for a in pos[: i + 1]):
            return pos[i].value
        return None

    def arg_name(self, param: str) -> str | None:
        """The identifier passed as ``param``, or None if it is not a plain identifier."""
        v = self.arg(param)
        return v.name if isinstance(v, A.Identifier) else None

    def text(self) -> str:
        from ..grammar import dump_expr

        return f"{', '.join(self.names)} = {dump_expr(self.stmt.rhs)}"


class GraphEdit:
    """Mutable view of ``document.graph`` (see the module docstring)."""

    def __init__(self, document: A.Document, tensors: dict[str, Any] | None = None, where: str = "<model>") -> None:
        if document.graph is None:
            raise ConversionError(f"{where}: the document has no graph")
        self.doc = document
        self.where = where
        self.tensors = tensors if tensors is not None else {}
        g = document.graph
        self.graph_name = g.name
        self.inputs: list[str] = list(g.inputs)
        self.outputs: list[str] = list(g.outputs)
        self.body: list[A.Assignment] = list(g.body)
        self.extensions: list[A.Extension] = list(document.extensions)
        self._index()

    # -- indexing ------------------------------------------------------------------------------
    def _index(self) -> None:
        self.nodes: list[Node] = [Node(i, lhs_names(st.lhs), st) for i, st in enumerate(self.body)]
        self.producer: dict[str, Node] = {}
        self.readers: dict[str, list[Node]] = {}
        for n in self.nodes:
            for name in set(identifiers(n.stmt.rhs)):
                self.readers.setdefault(name, []).append(n)
            for name in n.names:
                self.producer[name] = n

    def reindex(self) -> None:
        self._index()

    def node(self, name: str | None) -> Node | None:
        return self.producer.get(name) if name is not None else None

    def op_of(self, name: str | None) -> str | None:
        n = self.node(name)
        return n.op if n is not None else None

    def users(self, name: str) -> list[Node]:
        return self.readers.get(name, [])

    def all_names(self) -> set[str]:
        names = set(self.producer) | set(self.inputs)
        for n in self.nodes:
            names.update(identifiers(n.stmt.rhs))
        return names

    def fresh(self, base: str) -> str:
        """A name not used anywhere in the graph, starting from ``base``."""
        taken = self.all_names() | self.symbols()
        if base not in taken:
            return base
        i = 1
        while f"{base}_{i}" in taken:
            i += 1
        return f"{base}_{i}"

    # -- SSA normalization ---------------------------------------------------------------------
    def make_ssa(self) -> int:
        """Rename earlier definitions of names defined more than once; returns how many were renamed."""
        counts: dict[str, int] = {}
        for st in self.body:
            for n in lhs_names(st.lhs):
                counts[n] = counts.get(n, 0) + 1
        multi = {n for n, c in counts.items() if c > 1}
        if not multi:
            return 0
        seen: dict[str, int] = {}
        current: dict[str, str] = {}
        taken = {n for st in self.body for n in lhs_names(st.lhs)} | set(self.inputs)
        renamed = 0
        new_body = []
        for st in self.body:
            rhs = rename(st.rhs, current)
            lhs = st.lhs
            mapping: dict[str, str] = {}
            for n in lhs_names(st.lhs):
                if n not in multi:
                    continue
                seen[n] = seen.get(n, 0) + 1
                if seen[n] < counts[n]:
                    k = seen[n]
                    new = f"{n}__{k}"
                    while new in taken:
                        k += 1
                        new = f"{n}__{k}"
                    taken.add(new)
                    mapping[n] = new
                    current[n] = new
                    renamed += 1
                else:
                    current.pop(n, None)
            if mapping:
                lhs = rename(lhs, mapping)
            new_body.append(replace(st, lhs=lhs, rhs=rhs))
        self.body = new_body
        self._index()
        return renamed

    # -- fragment inlining ---------------------------------------------------------------------
    def inline(self, name: str, fragment: A.FragmentDecl) -> list[str]:
        """Replace the statement defining ``name`` (``out = fragment(args...)``) by the fragment's body,
        its locals renamed ``{out}__{local}``, parameters bound to the arguments as the interpreter's builder
        binds them (``params.bind_arguments``, defaults filled) and operator expressions turned into
        invocations one statement each (the builder's ``BINARY_OPS`` / ``UNARY_OPS``); returns the new names."""
        n = self.producer[name]
        inv = n.inv
        assert inv is not None and fragment.body is not None
        bound = bind_arguments(inv, param_info(fragment)[0])  # the builder's rule (tract's)
        for p in fragment.params:
            if bound.get(p.name) is None:
                raise ConversionError(f"{self.where}: '{name}' calls {fragment.name} without '{p.name}'")
        outs = lhs_names(n.stmt.lhs)
        if len(outs) != len(fragment.results):
            raise ConversionError(f"{self.where}: '{name}' binds {len(outs)} results of {fragment.name}, which has "
                                  f"{len(fragment.results)}")
        results = {r.name: o for r, o in zip(fragment.results, outs)}
        taken = self.all_names() | self.symbols()
        local = {}
        for st in fragment.body:
            for nm in lhs_names(st.lhs):
                if nm in results or nm in local:
                    continue
                new = self._fresh_in(f"{outs[0]}__{nm}", taken)
                local[nm] = new
        mapping = {**local, **results}
        stmts: list[A.Assignment] = []
        for st in fragment.body:
            rhs = _substitute(st.rhs, bound, mapping)
            lhs = rename(st.lhs, mapping)
            stmts.extend(_flatten(lhs, rhs, taken, self._fresh_in))
        i = n.index
        self.body[i:i + 1] = stmts
        self._index()
        return [nm for st in stmts for nm in lhs_names(st.lhs)]

    @staticmethod
    def _fresh_in(base: str, taken: set[str]) -> str:
        new, k = base, 1
        while new in taken:
            new = f"{base}_{k}"
            k += 1
        taken.add(new)
        return new

    # -- edits ---------------------------------------------------------------------------------
    def replace_rhs(self, name: str, rhs: A.Expr) -> None:
        n = self.producer[name]
        self.body[n.index] = A.Assignment(n.stmt.lhs, rhs)
        self._index()

    def insert_before(self, name: str, stmts: Iterable[A.Assignment]) -> None:
        i = self.producer[name].index
        self.body[i:i] = list(stmts)
        self._index()

    def insert_after(self, name: str, stmts: Iterable[A.Assignment]) -> None:
        i = self.producer[name].index + 1
        self.body[i:i] = list(stmts)
        self._index()

    def symbols(self) -> set[str]:
        return {e.argument.strip() for e in self.extensions if e.name == "tract_symbol"}

    def add_extension(self, name: str, argument: str = "") -> bool:
        ext = A.Extension(name, argument)
        if any(e.name == name and e.argument.strip() == argument for e in self.extensions):
            return False
        self.extensions.append(ext)
        return True

    def dead_code(self, keep: set[str] | frozenset[str] = frozenset()) -> list[str]:
        """Remove statements nothing needs (outputs, declared inputs, stateful ops and the names in
        ``keep`` are roots). Returns the names of the removed statements (first name of each)."""
        roots = keep
        stateful = stateful_ops()
        live: set[str] = set(self.outputs)
        keep = [False] * len(self.body)
        for n in reversed(self.nodes):
            root = (n.op in stateful) or (n.op in SOURCE_OPS and any(x in self.inputs for x in n.names)) \
                or any(x in roots for x in n.names)
            if root or any(x in live for x in n.names):
                keep[n.index] = True
                live.update(identifiers(n.stmt.rhs))
        removed = [n.name for n in self.nodes if not keep[n.index]]
        self.body = [st for st, k in zip(self.body, keep) if k]
        self._index()
        return removed

    def document(self) -> A.Document:
        g = A.GraphDecl(self.graph_name, tuple(self.inputs), tuple(self.outputs), tuple(self.body))
        return replace(self.doc, extensions=tuple(self.extensions), graph=g)

    # -- declarations --------------------------------------------------------------------------
    def declared_shape(self, name: str) -> list[A.Expr] | None:
        """The ``shape`` of an ``external``/``tract_core_external`` declaration, as expressions."""
        n = self.producer.get(name)
        if n is None or n.op not in SOURCE_OPS:
            return None
        s = n.arg("shape")
        return list(s.items) if isinstance(s, A.ArrayExpr) else None



def _substitute(e: Any, bound: dict[str, A.Expr], mapping: dict[str, str]) -> Any:
    """``e`` with fragment parameters replaced by their arguments and locals renamed."""
    return A.map_leaves(e, lambda x: bound[x.name] if x.name in bound else
                        (replace(x, name=mapping[x.name]) if x.name in mapping else x))


def _flatten(lhs: A.Expr, rhs: A.Expr, taken: set[str], fresh) -> list[A.Assignment]:
    """``lhs = rhs`` as statements whose tensor arguments are identifiers or literals: nested invocations
    and operator expressions among the arguments become statements of their own (attribute arguments and
    array items stay as written)."""
    out: list[A.Assignment] = []
    base = lhs_names(lhs)[0] if lhs_names(lhs) else "t"

    def hoist(e: A.Expr) -> A.Expr:
        if isinstance(e, (A.Invocation, A.BinaryExpr, A.UnaryExpr)):
            name = fresh(f"{base}__t", taken)
            out.extend(_flatten(A.Identifier(name), e, taken, fresh))
            return A.Identifier(name)
        if isinstance(e, A.ArrayExpr) and any(isinstance(x, (A.Invocation, A.BinaryExpr)) for x in e.items):
            return A.ArrayExpr(tuple(hoist(x) for x in e.items))
        return e

    if isinstance(rhs, A.BinaryExpr) and rhs.op in BINARY_OPS:
        rhs = A.Invocation(
            BINARY_OPS[rhs.op], None, (A.Argument(None, hoist(rhs.left)), A.Argument(None, hoist(rhs.right)))
        )
    elif isinstance(rhs, A.UnaryExpr) and rhs.op in UNARY_OPS:
        rhs = A.Invocation(UNARY_OPS[rhs.op], None, (A.Argument(None, hoist(rhs.operand)),))
    elif isinstance(rhs, A.Invocation):
        args = tuple(A.Argument(a.name, hoist(a.value) if a.name is None or a.name == "inputs" else a.value)
                     for a in rhs.args)
        rhs = A.Invocation(rhs.name, rhs.generic, args)
    out.append(A.Assignment(lhs, rhs))
    return out

