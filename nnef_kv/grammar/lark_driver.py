"""The Lark side of the parser: grammar loading, the transformers building the AST, syntax errors
with positions and expected tokens, and the nesting limit. :mod:`.parser` (the entry points) and
:mod:`.fastpath` both drive it."""
from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any, Iterable

from lark import Lark, Token, Transformer
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from ..errors import NnefSyntaxError
from ..limits import Limits
from . import ast as A
from ._lexical import number_literal, unescape

_HERE = Path(__file__).resolve().parent
_CTX = threading.local()  # per-thread parse context: filename, position offsets, bracket depth
_BUILD_LOCK = threading.Lock()
_PARSERS: dict[str, Lark] = {}

# ------------------------------------------------------------------------------------------------
# human names of terminals, for messages
# ------------------------------------------------------------------------------------------------
_HUMAN = {
    "$END": "end of file",
    "IDENT": "identifier",
    "EXT_IDENT": "identifier",
    "NUMBER": "number",
    "STRING": "string",
    "TYPE_NAME": "type name",
    "EXT_ARG": "extension argument",
    "GENERIC": "'<'",
    "CMP_OP": "comparison operator",
    "LPAR": "'('",
    "RPAR": "')'",
    "LSQB": "'['",
    "RSQB": "']'",
    "LBRACE": "'{'",
    "RBRACE": "'}'",
    "LT": "'<'",
    "MORETHAN": "'>'",
    "COMMA": "','",
    "SEMICOLON": "';'",
    "COLON": "':'",
    "EQUAL": "'='",
    "QMARK": "'?'",
    "AND": "'&&'",
    "OR": "'||'",
    "PLUS": "'+'",
    "MINUS": "'-'",
    "STAR": "'*'",
    "SLASH": "'/'",
    "CARET": "'^'",
    "BANG": "'!'",
}
_KEYWORDS = {"VERSION", "EXTENSION", "FRAGMENT", "GRAPH", "TENSOR", "FOR", "IN", "IF", "ELSE", "YIELD"}
_WORD = re.compile(r"[A-Za-z0-9_]+|\S")


def _human(name: str, parser: Lark | None) -> str:
    if name in _HUMAN:
        return _HUMAN[name]
    if name in _KEYWORDS:
        return f"'{name.lower()}'"
    if parser is not None:
        for term in parser.terminals:
            if term.name == name and term.pattern.type == "str":
                return f"'{term.pattern.value}'"
    return name.lower()


def _join(words: Iterable[str]) -> str:
    items = sorted(set(words))
    if not items:
        return "nothing"
    if len(items) == 1:
        return items[0]
    return ", ".join(items[:-1]) + " or " + items[-1]


def syntax_error(
    err: UnexpectedInput, text: str, filename: str, parser: Lark | None, line_off: int = 0, col_off: int = 0
) -> NnefSyntaxError:
    """Translate a Lark exception into ``file:line:col: expected X or Y but found 'tok'``."""
    line = getattr(err, "line", 0) or 0
    column = getattr(err, "column", 0) or 0
    expected: set[str] = set()
    found: str
    if isinstance(err, UnexpectedToken):
        accepts = getattr(err, "accepts", None)  # terminals accepted after the pending reductions
        expected = set(accepts) if accepts else set(err.expected)
        tok = err.token
        if tok.type == "$END":
            found = "end of file"
            line, column = _end_position(text)
        elif tok.type in ("EXT_ARG", "GENERIC") and err.pos_in_stream is not None:
            m = _WORD.match(text, err.pos_in_stream)
            found = _show(m.group(0) if m else str(tok))
        else:
            found = _show(str(tok)[:40])
    elif isinstance(err, UnexpectedCharacters):
        expected = set(err.allowed or ())
        m = _WORD.match(text, err.pos_in_stream)
        found = _show(m.group(0)[:40] if m else text[err.pos_in_stream : err.pos_in_stream + 1])
    elif isinstance(err, UnexpectedEOF):
        expected = set(err.expected)
        found = "end of file"
        line, column = _end_position(text)
    else:  # pragma: no cover - Lark has no other UnexpectedInput subclasses
        found = "?"
    human = tuple(sorted({_human(e, parser) for e in expected}))
    if line == 1:
        column += col_off
    line += line_off
    return NnefSyntaxError(
        f"expected {_join(human)} but found {found}",
        filename=filename,
        line=line,
        column=column,
        token=found,
        expected=human,
    )


def _show(word: str) -> str:
    """Quote a found token; control and other non-printable characters as escapes."""
    if word.isprintable():
        return f"'{word}'"
    return repr(word)


def _end_position(text: str) -> tuple[int, int]:
    line = text.count("\n") + 1
    return line, len(text) - (text.rfind("\n") + 1) + 1


# ------------------------------------------------------------------------------------------------
# AST building, inline with LALR (no parse tree)
# ------------------------------------------------------------------------------------------------
def _pos(tok: Token) -> A.Pos:
    ctx = _CTX
    line = tok.line
    if line == 1:
        return A.Pos(ctx.line_off + 1, tok.column + ctx.col_off)
    return A.Pos(line + ctx.line_off, tok.column)


def _name(tok: Token) -> tuple[str, A.Pos]:
    """(name, pos) of an IDENT or EXT_IDENT token."""
    if tok.type == "EXT_IDENT":
        return unescape(tok.value[2:-1]), _pos(tok)
    return tok.value, _pos(tok)


def _generic_type(tok: Token) -> A.PrimitiveType:
    """The PrimitiveType inside a GENERIC token such as ``<scalar>`` (whitespace/comments allowed)."""
    value = tok.value
    m = re.search(r"(integer|scalar|logical|string|complex)(?:[ \t\n\r\f\v]|#[^\n\r]*)*>\Z", value)
    assert m is not None
    offset = m.start(1)
    before = value[:offset]
    newlines = before.count("\n")
    if newlines:
        line = tok.line + newlines
        column = offset - before.rfind("\n")
        ctx = _CTX
        return A.PrimitiveType(m.group(1), pos=A.Pos(line + ctx.line_off, column))
    base = _pos(tok)
    return A.PrimitiveType(m.group(1), pos=A.Pos(base.line, base.column + offset))


_LITERAL_NODES = (A.IntegerLiteral, A.ScalarLiteral, A.LogicalLiteral, A.StringLiteral)


def _is_literal_expr(e: Any) -> bool:
    if isinstance(e, _LITERAL_NODES):
        return True
    if isinstance(e, (A.ArrayExpr, A.TupleExpr)):
        return all(_is_literal_expr(i) for i in e.items)
    if isinstance(e, A.UnaryExpr):
        return _is_literal_expr(e.operand)
    return False


class _Builder(Transformer):
    """Callbacks named after grammar rules/aliases; children are tokens and already-built nodes."""

    # -- document ------------------------------------------------------------------------------
    def document(self, c: list) -> A.Document:
        version = None
        exts: list[A.Extension] = []
        frags: list[A.FragmentDecl] = []
        graph = None
        for x in c:
            if isinstance(x, tuple) and x and x[0] == "version":
                version = x[1]
            elif isinstance(x, A.Extension):
                exts.append(x)
            elif isinstance(x, A.FragmentDecl):
                frags.append(x)
            elif isinstance(x, A.GraphDecl):
                graph = x
        return A.Document(version, tuple(exts), tuple(frags), graph, pos=A.Pos(1, 1))

    fragment_document = document

    def version(self, c: list) -> tuple:
        return ("version", c[1].value)

    def extension(self, c: list) -> A.Extension:
        kw, name_tok = c[0], c[1]
        name, _ = _name(name_tok)
        raw = c[2].value if len(c) > 2 else ""
        raw = re.sub(r"\A(?:[ \t\n\r\f\v]|#[^\n\r]*)*", "", raw).strip(" \t\n\r\f\v")
        return A.Extension(name, raw, pos=_pos(kw))

    # -- fragments -----------------------------------------------------------------------------
    def fragment(self, c: list) -> A.FragmentDecl:
        kw, (name, _), rest = c[0], c[1], c[2:]
        generic = None
        if rest and isinstance(rest[0], A.GenericDecl):
            generic, rest = rest[0], rest[1:]
        params, results = rest[0], rest[1]
        body = rest[2] if len(rest) > 2 else None
        return A.FragmentDecl(name, generic, params, results, body, pos=_pos(kw))

    def generic_decl(self, c: list) -> A.GenericDecl:
        default = A.PrimitiveType(c[1].value, pos=_pos(c[1])) if len(c) > 1 else None
        return A.GenericDecl(default, pos=_pos(c[0]))

    def params(self, c: list) -> tuple:
        return tuple(c)

    results = params

    def param(self, c: list) -> A.Param:
        (name, pos), type_ = c[0], c[1]
        default = c[2] if len(c) > 2 else None
        if default is not None and not _is_literal_expr(default):
            p = default.pos or pos
            raise NnefSyntaxError(
                f"default value of parameter '{name}' must be a literal expression",
                filename=_CTX.filename,
                line=p.line,
                column=p.column,
            )
        return A.Param(name, type_, default, pos=pos)

    def result(self, c: list) -> A.Result:
        (name, pos), type_ = c
        return A.Result(name, type_, pos=pos)

    def primitive_type(self, c: list) -> A.PrimitiveType:
        return A.PrimitiveType(c[0].value, pos=_pos(c[0]))

    def tensor_type(self, c: list) -> A.TensorType:
        item = A.PrimitiveType(c[1].value, pos=_pos(c[1])) if len(c) > 1 else None
        return A.TensorType(item, pos=_pos(c[0]))

    def array_type(self, c: list) -> A.ArrayType:
        return A.ArrayType(c[0], pos=c[0].pos)

    def tuple_type(self, c: list) -> A.TupleType:
        return A.TupleType(tuple(c[1:]), pos=_pos(c[0]))

    # -- graph ---------------------------------------------------------------------------------
    def graph(self, c: list) -> A.GraphDecl:
        kw, (name, _), inputs, outputs, body = c
        return A.GraphDecl(name, inputs, outputs, body, pos=_pos(kw))

    def ident_list(self, c: list) -> tuple:
        return tuple(n for n, _ in c)

    def body(self, c: list) -> tuple:
        return tuple(c[1:])

    def assignment(self, c: list) -> A.Assignment:
        lhs, rhs = c
        return A.Assignment(lhs, rhs, pos=lhs.pos if lhs.pos is not None else rhs.pos)

    def lvalue(self, c: list) -> Any:
        if len(c) == 1:
            return c[0]
        return A.TupleExpr(tuple(c), pos=c[0].pos if c else None)

    def lv_ident(self, c: list) -> A.Identifier:
        name, pos = c[0]
        return A.Identifier(name, pos=pos)

    def lv_array(self, c: list) -> A.ArrayExpr:
        return A.ArrayExpr(tuple(c[1:]), pos=_pos(c[0]))

    def lv_tuple(self, c: list) -> A.TupleExpr:
        return A.TupleExpr(tuple(c[1:]), pos=_pos(c[0]))

    def ident(self, c: list) -> tuple:
        return _name(c[0])

    # -- expressions ---------------------------------------------------------------------------
    def ifelse(self, c: list) -> A.IfElseExpr:
        then, _if, cond, _else, other = c
        return A.IfElseExpr(cond, then, other, pos=then.pos)

    def binop(self, c: list) -> A.BinaryExpr:
        left, op, right = c
        return A.BinaryExpr(op.value, left, right, pos=left.pos)

    def subscript(self, c: list) -> A.Subscript:
        return A.Subscript(c[0], c[1], pos=c[0].pos)

    def slice(self, c: list) -> A.SliceExpr:
        base = c[0]
        i = next(k for k, x in enumerate(c) if isinstance(x, Token) and x.type == "COLON")
        begin = c[1] if i == 2 else None
        end = c[i + 1] if len(c) > i + 1 else None
        return A.SliceExpr(base, begin, end, pos=base.pos)

    def number(self, c: list) -> Any:
        return number_literal(c[0].value, _CTX.filename, _pos(c[0]))

    def string(self, c: list) -> A.StringLiteral:
        return A.StringLiteral(unescape(c[0].value[1:-1]), pos=_pos(c[0]))

    def plain_name(self, c: list) -> Any:
        tok = c[0]
        v = tok.value
        if v == "true":
            return A.LogicalLiteral(True, pos=_pos(tok))
        if v == "false":
            return A.LogicalLiteral(False, pos=_pos(tok))
        if v == "inf":
            return A.ScalarLiteral(float("inf"), pos=_pos(tok))
        return A.Identifier(v, pos=_pos(tok))

    def ext_name(self, c: list) -> A.Identifier:
        name, pos = _name(c[0])
        return A.Identifier(name, pos=pos)

    def empty_tuple(self, c: list) -> A.TupleExpr:
        return A.TupleExpr((), pos=_pos(c[0]))

    def tuple(self, c: list) -> A.TupleExpr:
        return A.TupleExpr(tuple(c[1:]), pos=_pos(c[0]))

    def array(self, c: list) -> A.ArrayExpr:
        return A.ArrayExpr(tuple(c[1:]), pos=_pos(c[0]))

    def comprehension(self, c: list) -> A.Comprehension:
        lsqb, iters = c[0], c[2]
        if len(c) == 7:
            cond, body = c[4], c[6]
        else:
            cond, body = None, c[4]
        return A.Comprehension(iters, cond, body, pos=_pos(lsqb))

    def iterators(self, c: list) -> tuple:
        return tuple(c)

    def iterator(self, c: list) -> A.ComprehensionIterator:
        target, _in, iterable = c
        return A.ComprehensionIterator(target, iterable, pos=target.pos)

    def unary(self, c: list) -> A.UnaryExpr:
        return A.UnaryExpr(c[0].value, c[1], pos=_pos(c[0]))

    def invocation(self, c: list) -> A.Invocation:
        name, pos = c[0]
        generic = None
        args = c[1:]
        if args and isinstance(args[0], Token):
            generic = _generic_type(args[0])
            args = args[1:]
        return A.Invocation(name, generic, tuple(args), pos=pos)

    def positional(self, c: list) -> A.Argument:
        return A.Argument(None, c[0], pos=c[0].pos)

    def named(self, c: list) -> A.Argument:
        (name, pos), value = c
        return A.Argument(name, value, pos=pos)


class _QuantBuilder(Transformer):
    def start(self, c: list) -> A.QuantDocument:
        return A.QuantDocument(tuple(c), pos=A.Pos(1, 1))

    def entry(self, c: list) -> A.QuantEntry:
        key, op, args = c[0], c[1], c[2:]
        tensor = unescape(key.value[2:-1] if key.type == "EXT_IDENT" else key.value[1:-1])
        return A.QuantEntry(tensor, op.value, tuple(args), pos=_pos(key))

    def qarg(self, c: list) -> A.Argument:
        return A.Argument(c[0].value, c[1], pos=_pos(c[0]))

    def number(self, c: list) -> Any:
        return number_literal(c[0].value, _CTX.filename, _pos(c[0]))

    def string(self, c: list) -> A.StringLiteral:
        return A.StringLiteral(unescape(c[0].value[1:-1]), pos=_pos(c[0]))

    def name(self, c: list) -> Any:
        return _Builder.plain_name(self, c)  # type: ignore[arg-type]

    def ext_name(self, c: list) -> A.Identifier:
        name, pos = _name(c[0])
        return A.Identifier(name, pos=pos)

    def array(self, c: list) -> A.ArrayExpr:
        return A.ArrayExpr(tuple(c[1:]), pos=_pos(c[0]))

    def tuple(self, c: list) -> A.TupleExpr:
        return A.TupleExpr(tuple(c[1:]), pos=_pos(c[0]))


# ------------------------------------------------------------------------------------------------
# Lark instances (built once per process, tables cached on disk by Lark)
# ------------------------------------------------------------------------------------------------
def _bracket_open(tok: Token) -> Token:
    ctx = _CTX
    ctx.depth += 1
    if ctx.depth > ctx.max_nesting:
        raise _TooDeep(tok)
    return tok


def _bracket_close(tok: Token) -> Token:
    _CTX.depth -= 1
    return tok


_BLANK_CHARS = " \t\n\r\f\v"


def _prefix_op(tok: Token) -> Token:
    """Count runs of operators such as ``- - - x`` (each one nests): fail early on very long runs.

    A run continues when the previous non-blank character (within 64) is an operator character;
    anything else restarts it. Runs broken by comments are still caught by :func:`check_depth`.
    """
    ctx = _CTX
    text = ctx.text
    i = (tok.start_pos or 0) - ctx.text_base - 1
    stop = max(i - 64, -1)
    while i > stop and text[i] in _BLANK_CHARS:
        i -= 1
    if i > stop and text[i] in "-+!":
        ctx.run += 1
        if ctx.run + ctx.depth > ctx.max_nesting:
            raise _TooDeep(tok)
    else:
        ctx.run = 1
    return tok


class _TooDeep(Exception):
    def __init__(self, tok: Token | None, pos: A.Pos | None = None) -> None:
        super().__init__("nesting too deep")
        self.tok = tok
        self.pos = pos


def _lark(kind: str) -> Lark:
    parser = _PARSERS.get(kind)
    if parser is not None:
        return parser
    with _BUILD_LOCK:
        parser = _PARSERS.get(kind)
        if parser is None:
            callbacks = {name: _bracket_open for name in ("LPAR", "LSQB")}
            callbacks.update({name: _bracket_close for name in ("RPAR", "RSQB")})
            callbacks.update({name: _prefix_op for name in ("MINUS", "PLUS", "BANG")})
            if kind == "nnef":
                grammar, start, transformer = "nnef.lark", ["start", "assignment"], _Builder()
            else:
                grammar, start, transformer = "quant.lark", ["start"], _QuantBuilder()
            parser = Lark(
                (_HERE / grammar).read_text(encoding="utf-8"),
                parser="lalr",
                lexer="contextual",
                start=start,
                transformer=transformer,
                maybe_placeholders=False,
                propagate_positions=False,
                cache=True,
                lexer_callbacks=callbacks,
            )
            _PARSERS[kind] = parser
    return parser


def _set_ctx(filename: str, limits: Limits, line_off: int = 0, col_off: int = 0, text: str = "", base: int = 0) -> None:
    """Per-thread context read by the transformer and the lexer callbacks.

    ``text`` is the string Lark is lexing and ``base`` the offset its token positions start from.
    """
    ctx = _CTX
    ctx.text = text
    ctx.text_base = base
    ctx.run = 0
    ctx.filename = filename
    ctx.max_nesting = limits.max_nesting
    ctx.depth = 0
    ctx.line_off = line_off
    ctx.col_off = col_off


def _too_deep(err: _TooDeep, filename: str) -> NnefSyntaxError:
    if err.pos is not None:
        line, column = err.pos.line, err.pos.column
    elif err.tok is not None:
        p = _pos(err.tok)
        line, column = p.line, p.column
    else:
        line = column = 0
    return NnefSyntaxError("nesting too deep", filename=filename, line=line, column=column)


def run_lark(
    kind: str, text: str, start: str, filename: str, limits: Limits, line_off: int = 0, col_off: int = 0
) -> Any:
    """Parse ``text`` with Lark from rule ``start``; positions shifted by the offsets (line 1 also by col_off)."""
    parser = _lark(kind)
    _set_ctx(filename, limits, line_off, col_off, text)
    try:
        result = parser.parse(text, start=start)
    except _TooDeep as err:
        raise _too_deep(err, filename) from None
    except UnexpectedInput as err:
        raise syntax_error(err, text, filename, parser, line_off, col_off) from None
    except NnefSyntaxError:
        raise
    except RecursionError:  # pragma: no cover - the nesting limits keep us far from it
        raise NnefSyntaxError("nesting too deep", filename=filename) from None
    finally:
        _CTX.line_off = _CTX.col_off = 0
    check_depth(result, limits.max_nesting, filename)
    return result


# ------------------------------------------------------------------------------------------------
# nesting limit on the built tree (operator chains and unary runs nest without brackets)
# ------------------------------------------------------------------------------------------------
def check_depth(node: Any, max_nesting: int, filename: str) -> None:
    """Raise ``nesting too deep`` if an expression tree is deeper than ``max_nesting`` (iterative; only
    expression nodes count, from each statement's sides and each parameter default)."""
    expr = A.EXPR_TYPES
    stack = [(node, 0)]
    while stack:
        e, d = stack.pop()
        if isinstance(e, expr):
            d += 1
            if d > max_nesting:
                p = e.pos or A.Pos(0, 0)
                raise NnefSyntaxError("nesting too deep", filename=filename, line=p.line, column=p.column)
        for ch in A.children(e):
            stack.append((ch, d))
