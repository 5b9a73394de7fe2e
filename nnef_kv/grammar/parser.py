"""NNEF and graph.quant text -> AST, with Lark (LALR) as the definition of the language.

``parse`` reads a whole ``.nnef`` document (or a fragment-only file such as a stdlib, or a single
fragment declaration). With ``fast=True`` (default) the graph body's statements go through
:mod:`nnef_kv.grammar.fastpath`, a regex scanner that builds the very same nodes for the common
statement shapes and hands every other statement to Lark (see that module).

Every failure is an :class:`nnef_kv.errors.NnefSyntaxError` (``file:line:col: expected X or Y but
found 'tok'``); over-deep nesting is ``NnefSyntaxError("nesting too deep")``; oversized text is a
:class:`nnef_kv.errors.LimitError`.
"""
from __future__ import annotations

import contextlib
import gc
from typing import Any, Iterator

from ..errors import LimitError
from ..limits import DEFAULT_LIMITS, Limits
from . import ast as A
from .fastpath import parse_fast
from .lark_driver import run_lark

# ------------------------------------------------------------------------------------------------
# public entry points
# ------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while the (acyclic, long-lived) AST is built.

    With it running, generation-2 passes over the hundreds of thousands of new nodes of a large
    graph cost more than the parse itself (docs/benchmarks.md, "Where the code's thresholds come from"). On
    exit the objects allocated meanwhile are moved to the oldest generation with
    ``gc.freeze(); gc.unfreeze()`` (two O(1) list merges) instead of being traversed by the first
    young-generation collection after ``gc.enable()``: as if one collection had run
    and everything had survived; garbage cycles, if any, wait for the next full collection.
    """
    enabled = gc.isenabled()
    if enabled:
        gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.freeze()
            gc.unfreeze()
            gc.enable()


def _check_text(text: Any, filename: str, limits: Limits) -> None:
    if not isinstance(text, str):
        raise TypeError(f"parse() takes str (decode UTF-8 first), not {type(text).__name__}")
    if len(text) > limits.max_text_bytes:
        raise LimitError(f"{filename}: {len(text)} characters of NNEF text, over the limit of {limits.max_text_bytes}")


def parse(text: str, filename: str = "graph.nnef", *, limits: Limits | None = None, fast: bool = True) -> A.Document:
    """Parse NNEF text into an :class:`ast.Document`.

    Accepts a full document, a fragment-only file (no ``version``, no graph) or a single fragment
    declaration. ``fast=False`` parses everything with Lark (the reference the fast path is tested against).
    """
    limits = limits or DEFAULT_LIMITS
    _check_text(text, filename, limits)
    with _gc_paused():
        if fast:
            return parse_fast(text, filename, limits)
        return run_lark("nnef", text, "start", filename, limits)


def parse_quant(text: str, filename: str = "graph.quant", *, limits: Limits | None = None) -> A.QuantDocument:
    """Parse a ``graph.quant`` text into an :class:`ast.QuantDocument`."""
    limits = limits or DEFAULT_LIMITS
    _check_text(text, filename, limits)
    with _gc_paused():
        return run_lark("quant", text, "start", filename, limits)
