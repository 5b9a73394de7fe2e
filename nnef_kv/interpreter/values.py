"""The values a graph is built from (see :mod:`.builder`): run-time tensors, lists of tensors, attributes
needing run-time values, and literals used as tensors.

* :class:`TRef` -- a tensor computed at run time, living in slot ``slot`` of the run's value list;
* :class:`LRef` -- a slot holding a Python list of tensors (an array result of unknown length);
* a plain Python value (int, float, bool, str, list, tuple) known at build time (an attribute);
* :class:`Lazy` -- an attribute value that needs run-time values (symbols, tensors read as numbers);
* a ``list`` of values for ``tensor<>[]`` arguments.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..errors import GraphError
from ..grammar.printer import one_line as _one_line, short as _short

__all__ = ["TRef", "LRef", "Lazy", "DYN", "to_py", "literal_array"]



@dataclass(frozen=True)
class TRef:
    """A run-time tensor: index of its slot."""

    slot: int


@dataclass(frozen=True)
class LRef:
    """A slot holding a list of tensors (array result of unknown arity)."""

    slot: int


@dataclass(frozen=True)
class Lazy:
    """An attribute value computed per run: ``fn(values) -> python value``; ``text`` renders it.

    ``reads`` are the slots ``fn`` may read (for liveness: a value stays alive while a later attribute
    needs it); None means unknown, which keeps every value of the run alive."""

    fn: Callable[[list], Any]
    text: str
    reads: tuple[int, ...] | None = None


class _Dyn:
    """Sentinel: this attribute needs run-time values."""

    def __repr__(self) -> str:
        return "<dynamic>"


DYN = _Dyn()


def to_py(value: Any) -> Any:
    """A tensor read as an attribute: 0-d -> Python scalar, else nested lists."""
    if isinstance(value, np.ndarray):
        return value.item() if value.ndim == 0 else value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def literal_array(value: Any, where: str = "") -> np.ndarray:
    """A Python literal used where a tensor is expected: ints -> int64 (tract TDim), floats -> f32.
    ``where`` prefixes error messages (``file:line:col: node 'x': ``)."""
    if isinstance(value, np.ndarray):
        return value
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError, OverflowError) as exc:  # ragged nesting, mixed items, huge integers
        raise GraphError(f"{where}cannot use the array {_short(repr(value))} as a tensor (ragged or mixed "
                         f"items?): {_one_line(exc)}") from None
    if arr.dtype == object:
        raise GraphError(f"{where}cannot use the array {_short(repr(value))} as a tensor (ragged or mixed items?)")
    if arr.dtype == np.float64:
        arr = arr.astype(np.float32)
    elif arr.dtype.kind in "iu":
        arr = arr.astype(np.int64)
    elif arr.dtype.kind not in "b":
        if arr.size == 0:
            arr = arr.astype(np.float32)
        else:
            raise GraphError(f"{where}cannot use {_short(repr(value))} as a tensor")
    return arr


# ------------------------------------------------------------------------------------------------
# Graph


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


class _Ctx:
    """One expansion scope: a graph body or one fragment invocation."""

    def __init__(self, scope: dict[str, Any], prefix: str, depth: int) -> None:
        self.scope = scope
        self.prefix = prefix
        self.memo: dict[int, Any] = {}
        self.depth = depth
