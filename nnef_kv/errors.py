"""One exception hierarchy for everything nnef-kv refuses.

Every error that reaches a user is an :class:`NnefKvError`; the CLI prints ``str(err)`` as one line.
Messages name the file, node or tensor at fault.
"""
from __future__ import annotations

from typing import Any, Iterable

#: the longest message nnef-kv means to print (paths and names aside): longer details are clipped
MESSAGE_CHARS = 300


class NnefKvError(Exception):
    """Base class of every error raised on purpose by nnef-kv."""


class NnefSyntaxError(NnefKvError):
    """Text that is not NNEF (or not graph.quant syntax).

    ``str(err)`` is ``file:line:col: expected X or Y but found 'tok'`` (or a free message).
    """

    def __init__(
        self,
        message: str,
        *,
        filename: str = "<string>",
        line: int = 0,
        column: int = 0,
        token: str | None = None,
        expected: tuple[str, ...] = (),
    ) -> None:
        self.message = message
        self.filename = filename
        self.line = line
        self.column = column
        self.token = token
        self.expected = tuple(expected)
        super().__init__(f"{filename}:{line}:{column}: {message}")


class TensorFileError(NnefKvError):
    """A malformed or unsupported ``.dat`` tensor file."""


class ArchiveError(NnefKvError):
    """A malformed, unsafe or incomplete model archive (folder, .tar, .tgz)."""


class LimitError(NnefKvError):
    """Input over a resource limit (see :class:`nnef_kv.limits.Limits`)."""


class GraphError(NnefKvError):
    """A document that parses but cannot be turned into a runnable graph."""


class UnknownOpError(GraphError):
    """An invocation of an operation that nnef-kv does not know."""


class InputError(NnefKvError):
    """Run-time inputs that do not match the graph (missing, wrong shape or dtype)."""


class StateError(NnefKvError):
    """Saved session state that does not fit the model or is damaged."""


class ConversionError(NnefKvError):
    """A converter found nothing to convert or refused the input."""


class OutputError(NnefKvError, OSError):
    """A write target nnef-kv refuses (not a regular file or model folder, a suffix it cannot write, a
    folder it cannot write in), or a write that failed; the message names the target the user gave.
    Also an :class:`OSError` (``errno`` is kept when the cause had one)."""

    def __init__(self, message: str, errno: int | None = None) -> None:
        OSError.__init__(self, message)
        self.errno = errno

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ArgumentError(NnefKvError, TypeError):
    """A Python API argument of the wrong kind (a list where a dict of inputs is expected, archive bytes
    where a path is): also a :class:`TypeError`."""


def clip(text: Any, n: int = 120) -> str:
    """``str(text)`` cut to ``n`` characters (``...`` marks a cut): for values and foreign messages quoted
    in an error line."""
    s = str(text).replace("\n", " ")
    return s if len(s) <= n else s[: max(n - 3, 1)] + "..."


def names(items: Iterable[Any], n: int = 8) -> str:
    """``a, b, c, ... (52 in all)``: a list of names for a message, the first ``n`` of them."""
    items = [str(i) for i in items]
    head = ", ".join(clip(i, 60) for i in items[:n])
    return head if len(items) <= n else f"{head}, ... ({len(items)} in all)"


def describe(value: Any) -> str:
    """What ``value`` is, in a few words (never its repr when that could be long): ``bytes (4,718,592 bytes)``,
    ``list of 3 items``, ``None``, ``BufferedReader 'm.tgz'``."""
    if value is None:
        return "None"
    t = type(value).__name__
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f"{t} ({memoryview(value).nbytes:,} bytes)"
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return f"{t} of {len(value)} items"
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if isinstance(shape, tuple) and dtype is not None:
        return f"{t} {clip(dtype, 20)} {list(shape)}"
    name = getattr(value, "name", None)
    if hasattr(value, "read") or hasattr(value, "write"):
        return f"a file object ({t}{' ' + clip(repr(name), 80) if name is not None else ''})"
    if isinstance(value, str):
        return f"str {clip(repr(value), 80)}"
    return f"{t} {clip(repr(value), 60)}"
