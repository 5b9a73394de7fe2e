"""Fast path for graph bodies: the common statement shapes recognised by compiled regexes.

Why: Lark's LALR loop costs several microseconds per token, too slow for graphs of tens of thousands of
operations (the figures: docs/benchmarks.md, "Where the code's thresholds come from").
Almost every statement of a real graph body has the shape ``lhs = op[<type>](args);`` with
arguments that are identifiers, numbers, simple strings, flat arrays, named arguments or nested
plain invocations, all on one line. Those are built here directly into the same AST nodes, with the same
positions, as the Lark transformer would build.

How it stays equivalent to the grammar (the grammar remains the definition of the language):

1. The document up to and including the graph body's ``{`` is parsed by Lark's interactive parser
   (version, extensions, fragments, graph header), then closed with a synthetic ``}``.
2. Each body statement is first tried against the statement *shapes* seen recently: a shape is the
   statement's skeleton (punctuation kept, each leaf replaced by its kind: identifier, integer,
   float, string, true/false/inf), compiled once into one regex over the whole statement plus a
   generated function that builds the nodes from the match groups.
   Unknown skeletons are compiled on first sight (cached); skeletons outside the subset have no shape.
3. Without a shape, a per-argument scanner (``_statement``) tries the same subset.
4. Anything else (tuple lhs, operators, comments or newlines inside the statement, escapes in
   strings, ``-inf``, ...) is parsed by Lark alone from the rule ``assignment``, with positions shifted
   to the statement's place.
5. On a syntax error the document is re-parsed by Lark with the statements already read blanked out
   (same line/column for everything after), so the error message is the one the plain Lark parse gives.

``tests/unit/test_grammar.py`` parses every conformance file with ``fast=True`` and ``fast=False`` and
compares the ASTs including positions; a hypothesis test does the same on generated statements.
"""
from __future__ import annotations

import re
from dataclasses import fields, replace
from typing import Any

from lark import Token
from lark.exceptions import UnexpectedInput

from ..errors import NnefSyntaxError
from ..limits import Limits
from .ast import (
    Argument,
    ArrayExpr,
    Assignment,
    Document,
    Identifier,
    IntegerLiteral,
    Invocation,
    LogicalLiteral,
    Pos,
    PrimitiveType,
    ScalarLiteral,
    StringLiteral,
)
from .lark_driver import _TooDeep, _lark, _set_ctx, _too_deep, check_depth, run_lark, syntax_error

_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_NUM = r"-?[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?"
_STR = r""""[^"\\\n]*"|'[^'\\\n]*'"""
_TYPE = r"integer|scalar|logical|string|complex"

# lhs = op[<type>](       -> groups: lhs, op, generic type
_HEAD = re.compile(rf"({_IDENT})[ \t]*=[ \t]*({_IDENT})[ \t]*(?:<[ \t]*({_TYPE})[ \t]*>[ \t]*)?\(")
# one argument: name, then number | string | identifier followed by the next character among ",)(<"
# (blanks skipped), or '['
_ARG = re.compile(rf"[ \t]*(?:({_IDENT})[ \t]*=(?!=)[ \t]*)?(?:(?:({_NUM})|({_STR})|({_IDENT}))[ \t]*([,)(<]?)|(\[))")
_GENERIC = re.compile(rf"<[ \t]*({_TYPE})[ \t]*>[ \t]*\(")
# one array item and the next character among ",]"
_ITEM = re.compile(rf"[ \t]*(?:({_NUM})|({_IDENT})|({_STR}))[ \t]*([,\]]?)")
_BLANKS = re.compile(r"[ \t]*")
_EMPTY = re.compile(r"[ \t]*[\])]")
_END = re.compile(r"\)[ \t]*;")
_SKIP = re.compile(r"(?:[ \t\n\r\f\v]++|#[^\n\r]*+)*+")
_STMT_END = re.compile(r"""(?:[^;'"#]++|"(?:[^"\\]|\\[\s\S])*+"|'(?:[^'\\]|\\[\s\S])*+'|#[^\n\r]*+)*+;""")
_NOT_NL = re.compile(r"[^\n]+")

_CONSTANTS = {"true": True, "false": False}


def _factory(cls: type) -> Any:
    """A positional constructor equivalent to ``cls(*fields)`` without the dataclass ``__init__``.

    Same object (fields, equality, hash, repr); it skips the generated ``__init__``'s keyword
    handling and defaults, which is measurable at hundreds of thousands of nodes per document.
    """
    names = [f.name for f in fields(cls)]
    params = ", ".join(names)
    body = "".join(f"    setattr_(o, {n!r}, {n})\n" for n in names)
    src = f"def make({params}):\n    o = new(cls)\n{body}    return o\n"
    scope: dict[str, Any] = {"new": object.__new__, "cls": cls, "setattr_": object.__setattr__}
    exec(src, scope)  # noqa: S102 - generated from the dataclass field names only
    return scope["make"]


_P = _factory(Pos)
_Id = _factory(Identifier)
_Int = _factory(IntegerLiteral)
_Sca = _factory(ScalarLiteral)
_Log = _factory(LogicalLiteral)
_Str = _factory(StringLiteral)
_Arr = _factory(ArrayExpr)
_Arg = _factory(Argument)
_Inv = _factory(Invocation)
_Asg = _factory(Assignment)
_Prim = _factory(PrimitiveType)


class _Fallback(Exception):
    """The scanner does not handle this statement; Lark will."""


def _blank(segment: str) -> str:
    return _NOT_NL.sub(lambda m: " " * len(m.group(0)), segment)


# ------------------------------------------------------------------------------------------------
# statement shapes: one compiled regex + one generated builder per skeleton
# ------------------------------------------------------------------------------------------------
# Skeleton of a statement: every leaf replaced by a one-character placeholder naming its kind,
# blanks removed. Kinds: string, float, integer, identifier, literal name (true/false/inf).
_K_STR, _K_FLOAT, _K_INT, _K_ID, _K_KW = "\x01", "\x02", "\x03", "\x04", "\x05"
_NOT_AFTER = r"(?<![A-Za-z0-9_])"
_END_WORD = r"(?![A-Za-z0-9_])"
_FLOAT = r"-?[0-9]+(?:\.[0-9]*(?:[eE][+-]?[0-9]+)?|[eE][+-]?[0-9]+)"
_INT = r"-?[0-9]+(?![.eE0-9])"
_KW = rf"(?:true|false|inf){_END_WORD}"
_SK_SUBS = (
    (re.compile(_STR), _K_STR),
    (re.compile(_NOT_AFTER + _FLOAT), _K_FLOAT),
    (re.compile(_NOT_AFTER + r"-?[0-9]+"), _K_INT),
    (re.compile(_NOT_AFTER + _KW), _K_KW),
    (re.compile(_IDENT), _K_ID),
    (re.compile(r"[ \t]+"), ""),
)
#: regex and builder expression of a value leaf, by kind ({g}: group text, {p}: position expression)
_VALUE_LEAVES = {
    _K_STR: (_STR, "_Str({g}[1:-1], {p})"),
    _K_FLOAT: (_FLOAT, "_Sca(float({g}), {p})"),
    _K_INT: (_INT, "_Int(int({g}), {p})"),
    _K_ID: (rf"(?!{_KW}){_IDENT}", "_Id({g}, {p})"),
    _K_KW: (_KW, "_kw({g}, {p})"),
}
_SHAPES: dict[str, "_Shape | None"] = {}
_MAX_SHAPES = 4096


def skeleton_of(line: str) -> str:
    for regex, repl in _SK_SUBS:
        line = regex.sub(repl, line)
    return line


def _kw(s: str, pos: Pos) -> Any:
    if s == "inf":
        return _Sca(float("inf"), pos)
    return _Log(s == "true", pos)


class _Shape:
    """A statement skeleton such as ``\x04=\x04<\x04>(\x04=[\x03,\x03],\x04=\x01);`` compiled to a
    regex and a builder.

    Only the scanner's subset is compiled (``lhs = call;`` where a call's arguments are leaves, flat
    arrays of leaves, named arguments or calls); anything else has no shape. Leaves keep their kind in
    the skeleton, so the builder creates each node directly (no per-leaf dispatch).
    """

    __slots__ = ("regex", "build", "depth", "_sk", "_i", "_groups", "_tmp")

    def __init__(self, skeleton: str) -> None:
        self._sk = skeleton
        self._i = 0
        self._groups = 0
        self._tmp = 0
        pat: list[str] = []
        lhs = self._name(pat)
        self._expect(pat, "=")
        rhs, depth = self._call(pat, 1)
        self._expect(pat, ";")
        if self._i != len(skeleton):
            raise ValueError("trailing skeleton")
        self.depth = depth
        self.regex = re.compile(r"[ \t]*".join(pat))
        src = (
            "def build(m, line, base):\n"
            "    g = m.groups()\n"
            "    st = m.start\n"
            f"    lpos = _P(line, st({lhs}) + base)\n"
            f"    return _Asg(_Id(g[{lhs - 1}], lpos), {rhs}, lpos)\n"
        )
        scope = {
            "_P": _P, "_Asg": _Asg, "_Id": _Id, "_Inv": _Inv, "_Arg": _Arg, "_Arr": _Arr, "_Prim": _Prim,
            "_Str": _Str, "_Sca": _Sca, "_Int": _Int, "_kw": _kw,
        }
        exec(src, scope)  # noqa: S102 - generated from the skeleton grammar below only
        self.build = scope["build"]

    def _peek(self, k: int = 0) -> str:
        return self._sk[self._i + k : self._i + k + 1]

    def _expect(self, pat: list[str], c: str) -> None:
        if self._peek() != c:
            raise ValueError(f"expected {c!r}")
        self._i += 1
        pat.append(re.escape(c))

    def _leaf(self, pat: list[str], regex: str) -> int:
        self._i += 1
        self._groups += 1
        pat.append(f"({regex})")
        return self._groups

    def _name(self, pat: list[str]) -> int:
        """An identifier position (lhs, operation or argument name): any identifier."""
        if self._peek() not in (_K_ID, _K_KW):
            raise ValueError("expected a name")
        return self._leaf(pat, _IDENT)

    def _call(self, pat: list[str], depth: int) -> tuple[str, int]:
        """``name[<type>](args)`` -> (builder expression, depth of the deepest node)."""
        name = self._name(pat)
        generic = "None"
        if self._peek() == "<":
            self._expect(pat, "<")
            if self._peek() != _K_ID:
                raise ValueError("expected a type name")
            t = self._leaf(pat, _TYPE)
            self._expect(pat, ">")
            generic = f"_Prim(g[{t - 1}], _P(line, st({t}) + base))"
        self._expect(pat, "(")
        args: list[str] = []
        deepest = depth
        if self._peek() != ")":
            while True:
                expr, d = self._argument(pat, depth + 1)
                args.append(expr)
                deepest = max(deepest, d)
                if self._peek() != ",":
                    break
                self._expect(pat, ",")
        self._expect(pat, ")")
        tup = "(" + "".join(a + ", " for a in args) + ")"
        return f"_Inv(g[{name - 1}], {generic}, {tup}, _P(line, st({name}) + base))", deepest

    def _argument(self, pat: list[str], depth: int) -> tuple[str, int]:
        if self._peek(1) == "=" and self._peek() in (_K_ID, _K_KW):
            name = self._name(pat)
            self._expect(pat, "=")
            value, d = self._value(pat, depth)
            return f"_Arg(g[{name - 1}], {value}, _P(line, st({name}) + base))", d
        value, d = self._value(pat, depth)
        self._tmp += 1
        v = f"v{self._tmp}"
        return f"_Arg(None, ({v} := {value}), {v}.pos)", d

    def _value_leaf(self, pat: list[str], first_in_array: bool = False) -> str:
        kind = self._peek()
        if kind not in _VALUE_LEAVES:
            raise ValueError("expected a value")
        regex, expr = _VALUE_LEAVES[kind]
        if first_in_array and kind == _K_ID:
            regex = rf"(?!for{_END_WORD}){regex}"  # '[for' opens a comprehension in the grammar
        k = self._leaf(pat, regex)
        return expr.format(g=f"g[{k - 1}]", p=f"_P(line, st({k}) + base)")

    def _value(self, pat: list[str], depth: int) -> tuple[str, int]:
        if self._peek() == "[":
            self._groups += 1
            bracket = self._groups
            pat.append("()")
            self._expect(pat, "[")
            items: list[str] = []
            if self._peek() != "]":
                while True:
                    items.append(self._value_leaf(pat, first_in_array=not items))
                    if self._peek() != ",":
                        break
                    self._expect(pat, ",")
            self._expect(pat, "]")
            tup = "(" + "".join(x + ", " for x in items) + ")"
            return f"_Arr({tup}, _P(line, st({bracket}) + base))", depth + (1 if items else 0)
        if self._peek() in (_K_ID, _K_KW) and self._peek(1) in ("(", "<"):
            return self._call(pat, depth)
        return self._value_leaf(pat), depth


def _shape_of(skeleton: str) -> "_Shape | None":
    shape = _SHAPES.get(skeleton, False)
    if shape is False:
        try:
            shape = _Shape(skeleton)
        except (ValueError, IndexError, re.error, RecursionError):
            shape = None
        if len(_SHAPES) < _MAX_SHAPES:
            _SHAPES[skeleton] = shape
    return shape  # type: ignore[return-value]


class _BodyScanner:
    """Scans one graph body; ``line``/``ls`` are the current line number and its start offset."""

    def __init__(self, text: str, filename: str, limits: Limits, body_start: int, line: int, ls: int) -> None:
        self.text = text
        self.filename = filename
        self.limits = limits
        self.max_depth = limits.max_nesting
        self.body_start = body_start
        self.line = line
        self.ls = ls

    # -- values -----------------------------------------------------------------------------------
    @staticmethod
    def _number(s: str, pos: Pos) -> Any:
        if "." in s or "e" in s or "E" in s:
            return _Sca(float(s), pos)
        if len(s) > 4000:
            raise _Fallback
        return _Int(int(s), pos)

    def _args(self, p: int, depth: int) -> tuple[tuple[Argument, ...], int]:
        """Arguments after '(' at ``p``; returns them and the offset of the closing ')'."""
        text, line = self.text, self.line
        base = 1 - self.ls
        arg_m = _ARG.match
        args: list[Argument] = []
        append = args.append
        if depth > self.max_depth:
            raise _Fallback
        c = text[p : p + 1]
        if c == ")":
            return (), p
        if c == " " or c == "\t":
            m = _EMPTY.match(text, p)
            if m is not None:
                if text[m.end() - 1] != ")":
                    raise _Fallback
                return (), m.end() - 1
        while True:
            m = arg_m(text, p)
            if m is None:
                raise _Fallback
            name, num, string, ident, nxt, lsqb = m.groups()
            e = m.end()
            if ident is not None:
                if nxt == "(" or nxt == "<":
                    if nxt == "<":
                        g = _GENERIC.match(text, e - 1)
                        if g is None:
                            raise _Fallback
                        generic = _Prim(g.group(1), _P(line, g.start(1) + base))
                        e = g.end()
                    else:
                        generic = None
                    inner, close = self._args(e, depth + 1)
                    value = _Inv(ident, generic, inner, _P(line, m.start(4) + base))
                    e = close + 1
                    nxt = text[e : e + 1]
                    if nxt == " " or nxt == "\t":
                        e = _BLANKS.match(text, e).end()
                        nxt = text[e : e + 1]
                    e += 1
                elif ident in _CONSTANTS:
                    value = _Log(_CONSTANTS[ident], _P(line, m.start(4) + base))
                elif ident == "inf":
                    value = _Sca(float("inf"), _P(line, m.start(4) + base))
                else:
                    value = _Id(ident, _P(line, m.start(4) + base))
            elif num is not None:
                value = self._number(num, _P(line, m.start(2) + base))
            elif string is not None:
                value = _Str(string[1:-1], _P(line, m.start(3) + base))
            else:
                value, e = self._array(e, _P(line, m.start(6) + base), depth)
                nxt = text[e : e + 1]
                e += 1
            if name is not None:
                append(_Arg(name, value, _P(line, m.start(1) + base)))
            else:
                append(_Arg(None, value, value.pos))
            if nxt == ",":
                p = e
                continue
            if nxt == ")":
                return tuple(args), e - 1
            raise _Fallback

    def _array(self, p: int, pos: Pos, depth: int) -> tuple[ArrayExpr, int]:
        """A flat array whose '[' ends just before ``p``; returns it and the offset after its blanks."""
        text, line = self.text, self.line
        base = 1 - self.ls
        m = _EMPTY.match(text, p)
        if m is not None:
            if text[m.end() - 1] != "]":
                raise _Fallback
            return _Arr((), pos), _BLANKS.match(text, m.end()).end()
        if depth + 1 > self.max_depth:
            raise _Fallback
        items: list[Any] = []
        append = items.append
        item_m = _ITEM.match
        number = self._number
        first = True
        while True:
            m = item_m(text, p)
            if m is None:
                raise _Fallback
            num, ident, string, nxt = m.groups()
            if num is not None:
                append(number(num, _P(line, m.start(1) + base)))
            elif ident is not None:
                ip = _P(line, m.start(2) + base)
                if ident in _CONSTANTS:
                    append(_Log(_CONSTANTS[ident], ip))
                elif ident == "inf":
                    append(_Sca(float("inf"), ip))
                elif first and ident == "for":
                    raise _Fallback
                else:
                    append(_Id(ident, ip))
            else:
                append(_Str(string[1:-1], _P(line, m.start(3) + base)))
            first = False
            if nxt == ",":
                p = m.end()
                continue
            if nxt == "]":
                e = m.end()
                c = text[e : e + 1]
                if c == " " or c == "\t":
                    e = _BLANKS.match(text, e).end()
                return _Arr(tuple(items), pos), e
            raise _Fallback

    def _statement(self, p: int) -> tuple[Assignment, int]:
        text, line, ls = self.text, self.line, self.ls
        m = _HEAD.match(text, p)
        if m is None:
            raise _Fallback
        lhs, op, gen = m.groups()
        lpos = _P(line, p - ls + 1)
        generic = _Prim(gen, _P(line, m.start(3) - ls + 1)) if gen is not None else None
        if 2 > self.max_depth:
            raise _Fallback
        args, close = self._args(m.end(), 2)
        if text[close + 1 : close + 2] == ";":
            end = close + 2
        else:
            em = _END.match(text, close)
            if em is None:
                raise _Fallback
            end = em.end()
        rhs = _Inv(op, generic, args, _P(line, m.start(2) - ls + 1))
        return _Asg(_Id(lhs, lpos), rhs, lpos), end

    # -- errors and fallbacks ---------------------------------------------------------------------
    def doc_error(self, at: int) -> NnefSyntaxError:
        """The error plain Lark reports for the document, statements before ``at`` blanked out."""
        text = self.text
        synthetic = text[: self.body_start] + _blank(text[self.body_start : at]) + text[at:]
        parser = _lark("nnef")
        _set_ctx(self.filename, self.limits, text=synthetic)
        try:
            parser.parse(synthetic, start="start")
        except _TooDeep as err:
            return _too_deep(err, self.filename)
        except UnexpectedInput as err:
            return syntax_error(err, synthetic, self.filename, parser)
        except NnefSyntaxError as err:
            return err
        return NnefSyntaxError("syntax error", filename=self.filename, line=self.line, column=at - self.ls + 1)

    def _lark_statement(self, p: int) -> tuple[Any, int]:
        text = self.text
        m = _STMT_END.match(text, p)
        if m is None:
            raise self.doc_error(p)
        end = m.end()
        parser = _lark("nnef")
        _set_ctx(self.filename, self.limits, self.line - 1, p - self.ls, text[p:end])
        try:
            stmt = parser.parse(text[p:end], start="assignment")
        except _TooDeep as err:
            raise _too_deep(err, self.filename) from None
        except UnexpectedInput:
            raise self.doc_error(p) from None
        finally:
            _set_ctx(self.filename, self.limits)
        check_depth(stmt, self.limits.max_nesting, self.filename)
        # the statement may span lines: move the line counter to its end
        n = text.count("\n", p, end)
        if n:
            self.line += n
            self.ls = text.rfind("\n", p, end) + 1
        return stmt, end

    # -- the loop ---------------------------------------------------------------------------------
    def run(self) -> tuple[list, int]:
        text = self.text
        size = len(text)
        skip = _SKIP.match
        count = text.count
        find = text.find
        max_depth = self.max_depth
        recent: list[_Shape] = []  # most recently used shapes, tried first
        out: list = []
        append = out.append
        p = self.body_start
        while True:
            q = skip(text, p).end()
            n = count("\n", p, q)
            if n:
                self.line += n
                self.ls = text.rfind("\n", p, q) + 1
            p = q
            if p >= size:
                raise self.doc_error(p)
            if text[p] == "}":
                return out, p
            try:
                for k, shape in enumerate(recent):
                    m = shape.regex.match(text, p)
                    if m is not None:
                        if k:
                            recent.insert(0, recent.pop(k))
                        break
                else:
                    m = None
                    nl = find("\n", p)
                    skeleton = skeleton_of(text[p : nl if nl >= 0 else size])
                    semi = skeleton.find(";")
                    shape = _shape_of(skeleton[: semi + 1]) if semi > 0 else None
                    if shape is not None and shape.depth <= max_depth:
                        m = shape.regex.match(text, p)
                        if m is not None:
                            recent.insert(0, shape)
                            del recent[6:]
                if m is not None:
                    stmt = shape.build(m, self.line, 1 - self.ls)
                    p = m.end()
                else:
                    stmt, p = self._statement(p)
            except _Fallback:
                stmt, p = self._lark_statement(p)
            except (ValueError, OverflowError):
                stmt, p = self._lark_statement(p)
            append(stmt)


_TRAILER = re.compile(r"(?:[ \t\n\r\f\v]++|#[^\n\r]*+)*+\Z")


def parse_fast(text: str, filename: str, limits: Limits) -> Document:
    """Header by Lark's interactive parser, graph body by :class:`_BodyScanner`, same AST as Lark."""
    parser = _lark("nnef")
    _set_ctx(filename, limits, text=text)
    ip = parser.parse_interactive(text, start="start")
    brace: Token | None = None
    try:
        saw_graph = False
        for tok in ip.iter_parse():
            if tok.type == "GRAPH":
                saw_graph = True
            elif saw_graph and tok.type == "LBRACE":
                brace = tok
                break
        if brace is None:  # no graph body: small (fragment-only) text, plain Lark
            return run_lark("nnef", text, "start", filename, limits)
        ip.feed_token(brace)
        ip.feed_token(Token("RBRACE", "}", brace.end_pos, brace.line, brace.end_column))
        header: Document = ip.feed_eof()
    except (_TooDeep, UnexpectedInput):
        # an error in the header: the plain Lark parse reports it (and stops there, so it is cheap)
        return run_lark("nnef", text, "start", filename, limits)
    check_depth(header, limits.max_nesting, filename)
    body_start = brace.end_pos
    assert body_start is not None and brace.end_line is not None
    ls = text.rfind("\n", 0, body_start) + 1
    scanner = _BodyScanner(text, filename, limits, body_start, brace.end_line, ls)
    body, close = scanner.run()
    if _TRAILER.match(text, close + 1) is None:
        raise scanner.doc_error(close)
    assert header.graph is not None
    graph = replace(header.graph, body=tuple(body))
    return replace(header, graph=graph)
