"""One exception hierarchy for everything nnef-kv refuses.

Every error that reaches a user is an :class:`NnefKvError`; the CLI prints ``str(err)`` as one line.
Messages name the file, node or tensor at fault.
"""
from __future__ import annotations


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
