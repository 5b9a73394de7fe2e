"""Lexical helpers shared by the Lark transformer, the fast path and the printer.

One place decides how a number literal's text becomes a value, how string escapes are read
(tract's rule: a backslash escapes any character, ``\\c`` is ``c``) and which identifiers can be
written without the ``i"..."`` form.
"""
from __future__ import annotations

import re

from ..errors import NnefSyntaxError
from .ast import IntegerLiteral, Pos, ScalarLiteral

PLAIN_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_ESCAPE = re.compile(r"\\([\s\S])")
#: Identifiers that a bare rvalue would read as a literal (``true``/``false``/``inf``), or that tract's
#: parser reads as the start of one (its keyword-prefix trap): written as ``i"..."`` in rvalues.
RVALUE_TRAP_PREFIXES = ("true", "false", "inf")


def unescape(body: str) -> str:
    """The value of a quoted string's body: ``\\c`` -> ``c`` for any character ``c`` (tract)."""
    if "\\" not in body:
        return body
    return _ESCAPE.sub(r"\1", body)


def number_literal(text: str, filename: str, pos: Pos) -> IntegerLiteral | ScalarLiteral:
    """``IntegerLiteral`` when the text has no '.', no exponent and is not ``inf``; else ``ScalarLiteral``."""
    try:
        if "." in text or "e" in text or "E" in text or "inf" in text:
            return ScalarLiteral(float(text), pos=pos)
        return IntegerLiteral(int(text), pos=pos)
    except ValueError as err:  # e.g. more digits than int() accepts
        raise NnefSyntaxError(
            f"invalid number literal '{text[:40]}': {err}",
            filename=filename,
            line=pos.line,
            column=pos.column,
            token=text[:40],
        ) from None


def is_plain(name: str) -> bool:
    return PLAIN_IDENT.match(name) is not None


def quote(value: str) -> str:
    """A double-quoted NNEF string that tract reads back as ``value`` (escapes ``\\``, ``"`` and ``'``)."""
    if "\\" in value or '"' in value or "'" in value:
        value = value.replace("\\", "\\\\").replace('"', '\\"').replace("'", "\\'")
    return f'"{value}"'
