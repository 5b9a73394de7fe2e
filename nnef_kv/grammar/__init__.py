"""NNEF text <-> AST: Lark grammar (``nnef.lark``, ``quant.lark``), regex fast path, printer.

    doc = parse(text, filename="graph.nnef")      # -> ast.Document; equality ignores positions
    text = dump(doc)                              # canonical NNEF text
    quant = parse_quant(text, filename="graph.quant"); text = dump_quant(quant)

Choices where tract and the Khronos parser differ are listed in the README, section "Format notes".
"""
from __future__ import annotations

from . import ast
from .parser import parse, parse_quant
from .printer import dump, dump_expr, dump_quant, dump_type

__all__ = ["ast", "parse", "parse_quant", "dump", "dump_quant", "dump_expr", "dump_type"]
