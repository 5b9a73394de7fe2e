"""AST -> canonical NNEF / graph.quant text.

Guarantees (tested): ``parse(dump(doc)) == doc`` for documents built by ``parse`` and for generated
ASTs within the rules below, and a document that tract loads still loads after ``dump``.

Conventions (close to tract's own writer, ``nnef/src/ast/dump.rs``):
- ``version`` line, extensions in their original order, fragments, then the graph; two-space indent.
- Every binary, unary and if-else expression is parenthesised, so re-parsing never depends on
  precedence or on how far a prefix operator reaches.
- Scalars always contain '.' or 'e' (or are ``inf``/``-inf``): tract decides f32 vs integer on that.
- Strings in double quotes; ``\\``, ``"`` and ``'`` escaped with a backslash (tract's reading).
- Identifiers that are not ``[A-Za-z_][A-Za-z0-9_]*`` are written ``i"..."``; so are rvalue
  identifiers that would read as literals or fall in tract's keyword-prefix trap (``true*``,
  ``false*``, ``inf*``); a first array item that starts with ``for`` is parenthesised (``[(for)]``).
Not printable (ValueError): NaN scalars, a 1-item TupleExpr outside a left-hand side, an
extension argument containing ';', a generic that is not a primitive type.
"""
from __future__ import annotations

import math
import re
from typing import Any

from . import ast as A
from ._lexical import RVALUE_TRAP_PREFIXES, is_plain, quote


_FOR = re.compile(r"for(?![A-Za-z0-9_])")


def _ident(name: str) -> str:
    """A declaration-position identifier (lhs, graph params, fragment/param names, arg names)."""
    return name if is_plain(name) else "i" + quote(name)


def _rvalue_ident(name: str) -> str:
    if is_plain(name) and not name.startswith(RVALUE_TRAP_PREFIXES):
        return name
    return "i" + quote(name)


def _scalar(value: float) -> str:
    if math.isnan(value):
        raise ValueError("NaN has no NNEF spelling")
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    text = repr(float(value))
    if "." not in text and "e" not in text:  # pragma: no cover - repr(float) always has one
        text += ".0"
    return text


def dump_type(t: A.TypeSpec) -> str:
    if isinstance(t, A.PrimitiveType):
        return t.name
    if isinstance(t, A.TensorType):
        return f"tensor<{t.item.name if t.item is not None else ''}>"
    if isinstance(t, A.ArrayType):
        return f"{dump_type(t.item)}[]"
    if isinstance(t, A.TupleType):
        return "(" + ", ".join(dump_type(i) for i in t.items) + ")"
    raise ValueError(f"not a type: {t!r}")


def dump_expr(e: Any) -> str:
    """One rvalue expression."""
    if isinstance(e, A.Identifier):
        return _rvalue_ident(e.name)
    if isinstance(e, A.LogicalLiteral):
        return "true" if e.value else "false"
    if isinstance(e, A.IntegerLiteral):
        return str(int(e.value))
    if isinstance(e, A.ScalarLiteral):
        return _scalar(e.value)
    if isinstance(e, A.StringLiteral):
        return quote(e.value)
    if isinstance(e, A.ArrayExpr):
        items = [dump_expr(x) for x in e.items]
        if items and _FOR.match(items[0]):  # '[for' starts a comprehension
            items[0] = f"({items[0]})"
        return "[" + ", ".join(items) + "]"
    if isinstance(e, A.TupleExpr):
        if len(e.items) == 1:
            raise ValueError("a 1-item tuple has no NNEF spelling outside a left-hand side")
        return "(" + ", ".join(dump_expr(x) for x in e.items) + ")"
    if isinstance(e, A.UnaryExpr):
        return f"({e.op}({dump_expr(e.operand)}))"
    if isinstance(e, A.BinaryExpr):
        return f"({dump_expr(e.left)} {e.op} {dump_expr(e.right)})"
    if isinstance(e, A.IfElseExpr):
        return f"({dump_expr(e.then_value)} if {dump_expr(e.condition)} else {dump_expr(e.else_value)})"
    if isinstance(e, A.Comprehension):
        iters = ", ".join(f"{_lhs(it.target, top=False)} in {_operand(it.iterable)}" for it in e.iterators)
        cond = f" if {dump_expr(e.condition)}" if e.condition is not None else ""
        return f"[for {iters}{cond} yield {dump_expr(e.body)}]"
    if isinstance(e, A.Subscript):
        return f"{_base(e.base)}[{dump_expr(e.index)}]"
    if isinstance(e, A.SliceExpr):
        begin = dump_expr(e.begin) if e.begin is not None else ""
        end = dump_expr(e.end) if e.end is not None else ""
        return f"{_base(e.base)}[{begin}:{end}]"
    if isinstance(e, A.Invocation):
        return _invocation(e)
    raise ValueError(f"not an expression: {e!r}")


def _operand(e: Any) -> str:
    """An iterable of a comprehension: no top-level if-else (already parenthesised)."""
    return dump_expr(e)


def _base(e: Any) -> str:
    """The subscripted expression: parenthesised unless it is a name, an invocation or an array."""
    if isinstance(e, (A.Identifier, A.Invocation, A.ArrayExpr, A.Comprehension)):
        return dump_expr(e)
    text = dump_expr(e)
    if text.startswith("(") and isinstance(e, (A.BinaryExpr, A.UnaryExpr, A.IfElseExpr)):
        return text
    return f"({text})"


def _invocation(e: A.Invocation) -> str:
    generic = ""
    if e.generic is not None:
        if not isinstance(e.generic, A.PrimitiveType):
            raise ValueError("an invocation's generic must be a primitive type")
        generic = f"<{e.generic.name}>"
    args = ", ".join(
        dump_expr(a.value) if a.name is None else f"{_ident(a.name)} = {dump_expr(a.value)}" for a in e.args
    )
    return f"{_ident(e.name)}{generic}({args})"


def _lhs(e: Any, *, top: bool = True) -> str:
    if isinstance(e, A.Identifier):
        return _ident(e.name)
    if isinstance(e, A.ArrayExpr):
        return "[" + ", ".join(_lhs(x, top=False) for x in e.items) + "]"
    if isinstance(e, A.TupleExpr):
        if top and len(e.items) != 1:
            return ", ".join(_lhs(x, top=False) for x in e.items) if e.items else "()"
        return "(" + ", ".join(_lhs(x, top=False) for x in e.items) + ")"
    raise ValueError(f"not a left-hand side: {e!r}")


def dump_assignment(a: A.Assignment, indent: str = "  ") -> str:
    return f"{indent}{_lhs(a.lhs)} = {dump_expr(a.rhs)};"


def _fragment(f: A.FragmentDecl) -> str:
    generic = ""
    if f.generic is not None:
        generic = "<?>" if f.generic.default is None else f"<? = {dump_type(f.generic.default)}>"
    params = []
    for p in f.params:
        text = f"{_ident(p.name)}: {dump_type(p.type)}"
        if p.default is not None:
            text += f" = {dump_expr(p.default)}"
        params.append(text)
    results = ", ".join(f"{_ident(r.name)}: {dump_type(r.type)}" for r in f.results)
    if params:
        head = f"fragment {_ident(f.name)}{generic}(\n    " + ",\n    ".join(params) + f"\n) -> ({results})"
    else:
        head = f"fragment {_ident(f.name)}{generic}() -> ({results})"
    if f.body is None:
        return head + ";"
    lines = [head, "{"]
    lines.extend(dump_assignment(a) for a in f.body)
    lines.append("}")
    return "\n".join(lines)


def _extension(x: A.Extension) -> str:
    if ";" in x.argument or x.argument.startswith("#") or x.argument != x.argument.strip(" \t\n\r\f\v"):
        raise ValueError(f"extension argument {x.argument!r} cannot be written back")
    arg = x.argument
    if not arg:
        return f"extension {_ident(x.name)};"
    if arg.startswith(","):
        return f"extension {_ident(x.name)}{arg};"
    return f"extension {_ident(x.name)} {arg};"


def dump(doc: A.Document) -> str:
    """Canonical NNEF text of a document (ends with a newline)."""
    out: list[str] = []
    if doc.version is not None:
        out.append(f"version {doc.version};")
    out.extend(_extension(x) for x in doc.extensions)
    if out:
        out.append("")
    for f in doc.fragments:
        out.append(_fragment(f))
        out.append("")
    if doc.graph is not None:
        g = doc.graph
        if doc.version is None:
            raise ValueError("a graph needs a version line")
        ins = ", ".join(_ident(n) for n in g.inputs)
        outs = ", ".join(_ident(n) for n in g.outputs)
        out.append(f"graph {_ident(g.name)}({ins}) -> ({outs})")
        out.append("{")
        out.extend(dump_assignment(a) for a in g.body)
        out.append("}")
    return "\n".join(out).rstrip("\n") + "\n"


def _quant_value(e: Any) -> str:
    return dump_expr(e)


def dump_quant(doc: A.QuantDocument) -> str:
    """graph.quant text: one ``"tensor": op(name = value, ...);`` line per entry."""
    lines = []
    for e in doc.entries:
        key = quote(e.tensor) if is_plain(e.tensor) else "i" + quote(e.tensor)
        args = ", ".join(f"{a.name} = {_quant_value(a.value)}" for a in e.args)
        lines.append(f"{key}: {e.op}({args});")
    return "\n".join(lines) + ("\n" if lines else "")


# ----------------------------------------------------------------------------------------------
# Short renderings for messages (not NNEF to parse back: ``dump_expr`` is)
# ----------------------------------------------------------------------------------------------
def one_line(x: Any) -> str:
    """``str(x)`` with every run of white space one space."""
    return " ".join(str(x).split())


def short(text: Any, limit: int = 120) -> str:
    """``text`` on one line, cut to ``limit`` characters with ``...`` (messages quoting user values)."""
    text = one_line(text)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def expr_text(e: Any) -> str:
    """Compact NNEF-like rendering of an expression (messages, symbolic attributes for state factories)."""
    if isinstance(e, (A.IntegerLiteral, A.ScalarLiteral)):
        return repr(e.value)
    if isinstance(e, A.LogicalLiteral):
        return "true" if e.value else "false"
    if isinstance(e, A.StringLiteral):
        return repr(e.value)
    if isinstance(e, A.Identifier):
        return e.name
    if isinstance(e, A.ArrayExpr):
        return "[" + ", ".join(expr_text(i) for i in e.items) + "]"
    if isinstance(e, A.TupleExpr):
        return "(" + ", ".join(expr_text(i) for i in e.items) + ")"
    if isinstance(e, A.UnaryExpr):
        return f"{e.op}{expr_text(e.operand)}"
    if isinstance(e, A.BinaryExpr):
        return f"{expr_text(e.left)} {e.op} {expr_text(e.right)}"
    if isinstance(e, A.Invocation):
        return f"{e.name}(" + ", ".join(
            (f"{a.name} = " if a.name else "") + expr_text(a.value) for a in e.args) + ")"
    return type(e).__name__


def message_text(e: Any) -> str:
    """``expr_text`` for messages: also renders subscripts, slices, conditionals and comprehensions; one
    line, cut to a readable length."""
    def t(x: Any) -> str:
        if x is None:
            return ""
        if isinstance(x, A.Subscript):
            return f"{t(x.base)}[{t(x.index)}]"
        if isinstance(x, A.SliceExpr):
            return f"{t(x.base)}[{t(x.begin)}:{t(x.end)}]"
        if isinstance(x, A.IfElseExpr):
            return f"{t(x.then_value)} if {t(x.condition)} else {t(x.else_value)}"
        if isinstance(x, A.Comprehension):
            its = ", ".join(f"{t(i.target)} in {t(i.iterable)}" for i in x.iterators)
            cond = f" if {t(x.condition)}" if x.condition is not None else ""
            return f"[for {its}{cond} yield {t(x.body)}]"
        if isinstance(x, A.UnaryExpr):
            return f"{x.op}{t(x.operand)}"
        if isinstance(x, A.BinaryExpr):
            return f"{t(x.left)} {x.op} {t(x.right)}"
        if isinstance(x, (A.ArrayExpr, A.TupleExpr)):
            inner = ", ".join(t(i) for i in x.items)
            return f"[{inner}]" if isinstance(x, A.ArrayExpr) else f"({inner})"
        return expr_text(x)

    return short(t(e), 200)
