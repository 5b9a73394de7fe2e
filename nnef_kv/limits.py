"""Resource limits applied to untrusted input (archives downloaded from anywhere)."""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class Limits:
    """Defaults suit models that fit a small device; raise them for bigger ones.

    max_archive_bytes: decompressed bytes read from one archive (tar members, gzip output) in all.
    max_tensor_bytes: payload bytes of one ``.dat`` tensor.
    max_members: members (files) in one archive or folder.
    max_text_bytes: size of ``graph.nnef`` / ``graph.quant``.
    max_nesting: depth of nested expressions/brackets in NNEF text.
    max_comprehension_items: items one comprehension or range may produce.
    """

    max_archive_bytes: int = 16 * GiB
    max_tensor_bytes: int = 8 * GiB
    max_members: int = 100_000
    max_text_bytes: int = 256 * MiB
    max_nesting: int = 200
    max_comprehension_items: int = 10_000_000


DEFAULT_LIMITS = Limits()


_CURRENT = ContextVar("nnef_kv_limits", default=DEFAULT_LIMITS)


def current_limits() -> Limits:
    """The limits in force where none are passed explicitly (``DEFAULT_LIMITS`` unless overridden)."""
    return _CURRENT.get()


@contextmanager
def using_limits(limits: Limits) -> Iterator[Limits]:
    """``with using_limits(Limits(max_members=10)): nnef_kv.load(p)`` -- used by the CLI's limit flags."""
    token = _CURRENT.set(limits)
    try:
        yield limits
    finally:
        _CURRENT.reset(token)
