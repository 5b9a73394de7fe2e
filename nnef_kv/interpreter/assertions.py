"""tract's ``extension tract_assert EXPR;``: relations between symbols, checked once they are bound.

tract reads the argument with its TDim parser: ``a == b``, ``a <= b``, ``a >= b``, ``a < b`` or ``a > b``
where each side is an integer expression of symbols and numbers with ``+ - *``, ``/`` by a number
(integer division), unary minus, parentheses, ``min(..)``, ``max(..)`` and tract's broadcast ``a # b``.
An argument with a colon (``tg: S==1``) is a scenario hint for tract's optimiser (the assertion holds in
scenario ``tg``), not a constraint on every run: it is kept but never enforced here.

:func:`parse_assertion` compiles one argument; :meth:`Assertion.check` evaluates it once every symbol it
names is bound (an assertion naming a symbol the run never binds is skipped).
"""
from __future__ import annotations

import operator
import re
from dataclasses import dataclass
from typing import Callable

from ..errors import GraphError

Env = dict[str, int]
Fn = Callable[[Env], int]

_TOKEN = re.compile(r"\s*(?:(\d+)|([A-Za-z_][A-Za-z0-9_]*)|(==|<=|>=|!=|[<>+\-*/(),#]))")
_RELATIONS: dict[str, Callable[[int, int], bool]] = {
    "==": operator.eq, "<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt,
    "!=": operator.ne,
}


@dataclass(frozen=True)
class Assertion:
    """One compiled ``tract_assert``: ``text`` as written, the symbols it names, a predicate on them."""

    text: str
    symbols: tuple[str, ...]
    predicate: Callable[[Env], bool]
    location: str = ""
    scenario: str | None = None

    def check(self, env: Env) -> bool | None:
        """True / False when every symbol is in ``env``; None when one is unbound (nothing to check)."""
        if self.scenario is not None or any(s not in env for s in self.symbols):
            return None
        return bool(self.predicate(env))


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.toks: list[str] = []
        self.kinds: list[str] = []
        pos = 0
        stripped = text.rstrip()
        while pos < len(stripped):
            m = _TOKEN.match(stripped, pos)
            if m is None or m.end() == pos:
                raise GraphError(f"cannot read tract_assert {text!r} at column {pos + 1}")
            num, ident, op = m.groups()
            self.toks.append(num or ident or op)
            self.kinds.append("num" if num else "id" if ident else "op")
            pos = m.end()
        self.i = 0
        self.symbols: list[str] = []

    def peek(self) -> str | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, expected: str | None = None) -> str:
        tok = self.peek()
        if tok is None or (expected is not None and tok != expected):
            want = f"'{expected}'" if expected else "more"
            raise GraphError(f"cannot read tract_assert {self.text!r}: expected {want}, found {tok!r}")
        self.i += 1
        return tok

    # expr := add ('#' add)? ; add := mul (('+'|'-') mul)* ; mul := div ('*' div)* ; div := atom ('/' num)?
    def expr(self) -> Fn:
        a = self.add()
        if self.peek() == "#":
            self.take()
            b = self.add()
            return lambda env: _broadcast(a(env), b(env))
        return a

    def add(self) -> Fn:
        f = self.mul()
        while self.peek() in ("+", "-"):
            op = operator.add if self.take() == "+" else operator.sub
            g = self.mul()
            f = (lambda x, y, o: lambda env: o(x(env), y(env)))(f, g, op)
        return f

    def mul(self) -> Fn:
        f = self.div()
        while self.peek() == "*":
            self.take()
            g = self.div()
            f = (lambda x, y: lambda env: x(env) * y(env))(f, g)
        return f

    def div(self) -> Fn:
        f = self.atom()
        if self.peek() == "/":
            self.take()
            if self.i >= len(self.kinds) or self.kinds[self.i] != "num":
                raise GraphError(f"cannot read tract_assert {self.text!r}: '/' must be followed by a number")
            n = int(self.take())
            if n == 0:
                raise GraphError(f"tract_assert {self.text!r} divides by zero")
            return lambda env: f(env) // n
        return f

    def atom(self) -> Fn:
        tok = self.peek()
        if tok is None:
            raise GraphError(f"cannot read tract_assert {self.text!r}: it ends too early")
        kind = self.kinds[self.i]
        if kind == "num":
            n = int(self.take())
            return lambda env: n
        if tok == "-":
            self.take()
            f = self.atom()
            return lambda env: -f(env)
        if tok == "(":
            self.take()
            f = self.expr()
            self.take(")")
            return f
        if kind == "id":
            name = self.take()
            if name in ("min", "max") and self.peek() == "(":  # not op names
                self.take("(")
                args = [self.expr()]
                while self.peek() == ",":
                    self.take()
                    args.append(self.expr())
                self.take(")")
                red = min if name == "min" else max
                return lambda env: red(a(env) for a in args)
            if name not in self.symbols:
                self.symbols.append(name)
            return lambda env: env[name]
        raise GraphError(f"cannot read tract_assert {self.text!r}: unexpected {tok!r}")


def _broadcast(a: int, b: int) -> int:
    if a == 1:
        return b
    if b == 1 or a == b:
        return a
    raise ValueError(f"cannot broadcast {a} and {b}")


def parse_assertion(text: str, location: str = "") -> Assertion:
    """Compile the argument of one ``extension tract_assert`` (GraphError if tract could not read it)."""
    raw = text.strip()
    scenario: str | None = None
    if ":" in raw:  # tract: "scenario: assertion", a hint for that scenario only
        scenario, raw = (x.strip() for x in raw.split(":", 1))
    where = f"{location}: " if location else ""
    try:
        p = _Parser(raw)
        left = p.expr()
        rel = p.peek()
        if rel not in _RELATIONS:
            raise GraphError(f"cannot read tract_assert {raw!r}: expected ==, <=, >=, < or >, found {rel!r}")
        p.take()
        right = p.expr()
        if p.peek() is not None:
            raise GraphError(f"cannot read tract_assert {raw!r}: unexpected {p.peek()!r}")
    except GraphError as exc:
        raise GraphError(where + str(exc)) from None
    cmp = _RELATIONS[rel]
    return Assertion(raw, tuple(p.symbols), lambda env: cmp(left(env), right(env)), location, scenario)


__all__ = ["Assertion", "parse_assertion"]
