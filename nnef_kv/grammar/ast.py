"""Typed, immutable AST of NNEF documents (with tract's extensions) and of ``graph.quant`` files.

Every node is a frozen dataclass. Each node carries an optional source position ``pos`` that is
*not* part of equality, so ``parse(dump(parse(text))) == parse(text)`` compares structure only.
Sequences are tuples so that nodes are hashable.

Conventions
- Identifiers are plain ``str``; a tract extended identifier ``i"any text"`` is the same ``str``
  (the printer decides when the ``i"..."`` form is needed).
- Numbers: ``IntegerLiteral`` (no '.', no exponent) or ``ScalarLiteral`` (float, ``inf`` included);
  a negative literal (tract reads ``-1.0`` as one literal) has a negative value.
- Left-hand sides of assignments are expressions: ``Identifier``, ``TupleExpr`` or ``ArrayExpr``
  of those. ``a, b = f(x);`` and ``(a, b) = f(x);`` give the same ``TupleExpr``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any, Callable, Iterator, Union


@dataclass(frozen=True)
class Pos:
    """1-based line and column of a node's first character."""

    line: int
    column: int


def _pos() -> Pos | None:
    return field(default=None, compare=False, repr=False, kw_only=True)  # type: ignore[return-value]


# ----------------------------------------------------------------------------------------------
# Types
# ----------------------------------------------------------------------------------------------
PRIMITIVE_TYPE_NAMES = ("integer", "scalar", "logical", "string", "complex", "?")


@dataclass(frozen=True)
class PrimitiveType:
    """``integer``, ``scalar``, ``logical``, ``string``, ``complex`` or the generic ``?``."""

    name: str
    pos: Pos | None = _pos()


@dataclass(frozen=True)
class TensorType:
    """``tensor<T>``; ``item`` is None for the unbound ``tensor<>``."""

    item: PrimitiveType | None
    pos: Pos | None = _pos()


@dataclass(frozen=True)
class ArrayType:
    """``T[]``."""

    item: "TypeSpec"
    pos: Pos | None = _pos()


@dataclass(frozen=True)
class TupleType:
    """``(T, U, ...)``."""

    items: tuple["TypeSpec", ...]
    pos: Pos | None = _pos()


TypeSpec = Union[PrimitiveType, TensorType, ArrayType, TupleType]


# ----------------------------------------------------------------------------------------------
# Expressions
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class IntegerLiteral:
    value: int
    pos: Pos | None = _pos()


@dataclass(frozen=True)
class ScalarLiteral:
    value: float
    pos: Pos | None = _pos()

    def __eq__(self, other: object) -> bool:  # NaN never occurs in NNEF text; inf does
        return isinstance(other, ScalarLiteral) and (
            self.value == other.value or (self.value != self.value and other.value != other.value)
        )

    def __hash__(self) -> int:
        return hash(("scalar", self.value))


@dataclass(frozen=True)
class LogicalLiteral:
    value: bool
    pos: Pos | None = _pos()


@dataclass(frozen=True)
class StringLiteral:
    value: str
    pos: Pos | None = _pos()


@dataclass(frozen=True)
class Identifier:
    name: str
    pos: Pos | None = _pos()


@dataclass(frozen=True)
class ArrayExpr:
    items: tuple["Expr", ...]
    pos: Pos | None = _pos()


@dataclass(frozen=True)
class TupleExpr:
    items: tuple["Expr", ...]
    pos: Pos | None = _pos()


@dataclass(frozen=True)
class UnaryExpr:
    """``op`` is one of ``-``, ``+``, ``!``."""

    op: str
    operand: "Expr"
    pos: Pos | None = _pos()


@dataclass(frozen=True)
class BinaryExpr:
    """``op`` is one of ``+ - * / ^ < <= > >= == != && || in``."""

    op: str
    left: "Expr"
    right: "Expr"
    pos: Pos | None = _pos()


@dataclass(frozen=True)
class IfElseExpr:
    """``then_value if condition else else_value``."""

    condition: "Expr"
    then_value: "Expr"
    else_value: "Expr"
    pos: Pos | None = _pos()


@dataclass(frozen=True)
class ComprehensionIterator:
    """``target in iterable`` inside a comprehension (``target`` may be a tuple of names)."""

    target: "Expr"
    iterable: "Expr"
    pos: Pos | None = _pos()


@dataclass(frozen=True)
class Comprehension:
    """``[for i in a, j in b if cond yield body]``."""

    iterators: tuple[ComprehensionIterator, ...]
    condition: "Expr | None"
    body: "Expr"
    pos: Pos | None = _pos()


@dataclass(frozen=True)
class Subscript:
    """``base[index]``."""

    base: "Expr"
    index: "Expr"
    pos: Pos | None = _pos()


@dataclass(frozen=True)
class SliceExpr:
    """``base[begin:end]``; either bound may be absent."""

    base: "Expr"
    begin: "Expr | None"
    end: "Expr | None"
    pos: Pos | None = _pos()


@dataclass(frozen=True)
class Argument:
    """One argument of an invocation; ``name`` is None for a positional one."""

    name: str | None
    value: "Expr"
    pos: Pos | None = _pos()


@dataclass(frozen=True)
class Invocation:
    """``name<generic>(args)``; arguments keep the order they were written in."""

    name: str
    generic: TypeSpec | None
    args: tuple[Argument, ...]
    pos: Pos | None = _pos()

    def positional(self) -> tuple["Expr", ...]:
        return tuple(a.value for a in self.args if a.name is None)

    def named(self) -> dict[str, "Expr"]:
        return {a.name: a.value for a in self.args if a.name is not None}


Literal = Union[IntegerLiteral, ScalarLiteral, LogicalLiteral, StringLiteral]
Expr = Union[
    IntegerLiteral,
    ScalarLiteral,
    LogicalLiteral,
    StringLiteral,
    Identifier,
    ArrayExpr,
    TupleExpr,
    UnaryExpr,
    BinaryExpr,
    IfElseExpr,
    Comprehension,
    Subscript,
    SliceExpr,
    Invocation,
]


# ----------------------------------------------------------------------------------------------
# Statements and declarations
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Assignment:
    """``lhs = rhs;``"""

    lhs: Expr
    rhs: Expr
    pos: Pos | None = _pos()


@dataclass(frozen=True)
class Param:
    name: str
    type: TypeSpec
    default: Expr | None = None
    pos: Pos | None = _pos()


@dataclass(frozen=True)
class Result:
    name: str
    type: TypeSpec
    pos: Pos | None = _pos()


@dataclass(frozen=True)
class GenericDecl:
    """``<?>`` (default None) or ``<? = scalar>``."""

    default: TypeSpec | None = None
    pos: Pos | None = _pos()


@dataclass(frozen=True)
class FragmentDecl:
    """``fragment name<?>(params) -> (results)`` followed by ``{ body }`` or ``;`` (body None)."""

    name: str
    generic: GenericDecl | None
    params: tuple[Param, ...]
    results: tuple[Result, ...]
    body: tuple[Assignment, ...] | None = None
    pos: Pos | None = _pos()


@dataclass(frozen=True)
class GraphDecl:
    """``graph name(inputs) -> (outputs) { body }``."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    body: tuple[Assignment, ...]
    pos: Pos | None = _pos()


@dataclass(frozen=True)
class Extension:
    """``extension NAME rest;`` as tract reads it: the first identifier and the raw rest (stripped).

    Khronos' ``extension A, B;`` gives ``Extension("A", ", B")``; :meth:`names` splits such lists.
    tract's ``extension tract_registry tract_core;`` gives ``Extension("tract_registry", "tract_core")``.
    """

    name: str
    argument: str = ""
    pos: Pos | None = _pos()

    def names(self) -> tuple[str, ...]:
        """Every extension name of a Khronos comma list (``A, B`` -> ``("A", "B")``)."""
        if self.argument.startswith(","):
            rest = [n.strip() for n in self.argument[1:].split(",")]
            return (self.name, *[n for n in rest if n])
        return (self.name,)


@dataclass(frozen=True)
class Document:
    """A whole ``.nnef`` text. ``version`` is None in fragment-only files (stdlibs)."""

    version: str | None
    extensions: tuple[Extension, ...] = ()
    fragments: tuple[FragmentDecl, ...] = ()
    graph: GraphDecl | None = None
    pos: Pos | None = _pos()


# ----------------------------------------------------------------------------------------------
# graph.quant
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class QuantEntry:
    """``"tensor": op(name = literal, ...);``"""

    tensor: str
    op: str
    args: tuple[Argument, ...]
    pos: Pos | None = _pos()

    def named(self) -> dict[str, Expr]:
        return {a.name: a.value for a in self.args if a.name is not None}


@dataclass(frozen=True)
class QuantDocument:
    entries: tuple[QuantEntry, ...] = ()
    pos: Pos | None = _pos()

    def by_tensor(self) -> dict[str, QuantEntry]:
        return {e.tensor: e for e in self.entries}


# ----------------------------------------------------------------------------------------------
# Traversal: the one walker of the project
# ----------------------------------------------------------------------------------------------
#: the expression node types (what nests inside a right-hand side)
EXPR_TYPES = (IntegerLiteral, ScalarLiteral, LogicalLiteral, StringLiteral, Identifier, ArrayExpr, TupleExpr,
              UnaryExpr, BinaryExpr, IfElseExpr, Comprehension, Subscript, SliceExpr, Invocation)

_CHILDREN = {
    ArrayExpr: lambda e: e.items,
    TupleExpr: lambda e: e.items,
    UnaryExpr: lambda e: (e.operand,),
    BinaryExpr: lambda e: (e.left, e.right),
    IfElseExpr: lambda e: (e.condition, e.then_value, e.else_value),
    Comprehension: lambda e: tuple(x for it in e.iterators for x in (it.target, it.iterable))
    + ((e.condition,) if e.condition is not None else ()) + (e.body,),
    Subscript: lambda e: (e.base, e.index),
    SliceExpr: lambda e: tuple(x for x in (e.base, e.begin, e.end) if x is not None),
    Invocation: lambda e: tuple(a.value for a in e.args),
    Assignment: lambda a: (a.lhs, a.rhs),
    Param: lambda p: (p.default,) if p.default is not None else (),
    FragmentDecl: lambda f: tuple(f.params) + tuple(f.body or ()),
    GraphDecl: lambda g: tuple(g.body),
    Document: lambda d: tuple(d.fragments) + ((d.graph,) if d.graph is not None else ()),
    QuantEntry: lambda e: tuple(a.value for a in e.args),
    QuantDocument: lambda d: tuple(d.entries),
    tuple: lambda t: t,
    list: lambda t: tuple(t),
}


def children(node: Any) -> tuple:
    """The direct sub-nodes of an AST node, in source order: an invocation's argument values, an
    assignment's sides, a declaration's parameters and statements, a document's fragments and graph
    (literals, identifiers and types have none; a tuple or list of nodes has its items)."""
    get = _CHILDREN.get(type(node))
    return get(node) if get is not None else ()


def walk(node: Any) -> Iterator[Any]:
    """Every node under ``node`` (itself included), depth first, outermost first, in source order."""
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        ch = children(n)
        if ch:
            stack.extend(reversed(ch))


def identifiers(node: Any) -> Iterator[str]:
    """The name of every identifier under ``node`` (invocation names are not identifiers)."""
    for n in walk(node):
        if type(n) is Identifier:
            yield n.name


def invocations(node: Any) -> Iterator[Invocation]:
    """Every invocation under ``node``, outermost first."""
    for n in walk(node):
        if type(n) is Invocation:
            yield n


def map_leaves(node: Any, fn: Callable[[Any], Any], kinds: tuple[type, ...] = (Identifier,)) -> Any:
    """``node`` with every leaf ``x`` of a type in ``kinds`` (identifiers by default, or literals)
    replaced by ``fn(x)`` (an expression; ``x`` itself keeps the leaf), rebuilt only where something
    changed."""
    if type(node) in kinds:
        return fn(node)
    if isinstance(node, tuple):
        items = tuple(map_leaves(x, fn, kinds) for x in node)
        return node if all(a is b for a, b in zip(items, node)) else items
    if is_dataclass(node) and not isinstance(node, type) and type(node) not in _LEAVES:
        changes = {}
        for f in fields(node):
            if f.name == "pos":
                continue
            v = getattr(node, f.name)
            nv = map_leaves(v, fn, kinds)
            if nv is not v:
                changes[f.name] = nv
        return replace(node, **changes) if changes else node
    return node


_LEAVES = frozenset({IntegerLiteral, ScalarLiteral, LogicalLiteral, StringLiteral, Identifier, Pos})


def rename(node: Any, mapping: dict[str, str]) -> Any:
    """``node`` with identifiers renamed by ``mapping`` (invocation names untouched)."""
    if not mapping:
        return node
    return map_leaves(node, lambda x: replace(x, name=mapping[x.name]) if x.name in mapping else x)
