"""A progress bar for long work (conversion, decodes, validation): rich on a terminal, silent otherwise.

    with progress_bar("decoding", total=64) as advance:
        for ...:
            advance()            # or advance(n)
        advance.set_total(80)    # once the work is known (the bar shows N/total, not N/?)

The bar is drawn on stderr only when stderr is a terminal (and ``NNEF_KV_PROGRESS`` is not ``0``);
``NNEF_KV_PROGRESS=1`` forces it. Otherwise ``advance`` does nothing, so pipes, logs and tests see no
control characters.
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Callable, Iterator

__all__ = ["progress_enabled", "progress_bar"]

Advance = Callable[..., None]


def progress_enabled() -> bool:
    env = os.environ.get("NNEF_KV_PROGRESS", "")
    if env == "0":
        return False
    if env == "1":
        return True
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


class _Noop:
    def __call__(self, n: int = 1) -> None:
        return None

    def set_total(self, total: int | None) -> None:
        return None


_noop = _Noop()


class _Advance:
    """``advance(n=1)``; ``advance.set_total(total)`` when the amount of work is known late."""

    def __init__(self, prog: object, task: object) -> None:
        self.prog, self.task = prog, task

    def __call__(self, n: int = 1) -> None:
        self.prog.advance(self.task, n)  # type: ignore[attr-defined]

    def set_total(self, total: int | None) -> None:
        self.prog.update(self.task, total=total)  # type: ignore[attr-defined]


@contextlib.contextmanager
def progress_bar(description: str, total: int | None = None) -> Iterator[Advance]:
    """A context giving an ``advance(n=1)`` callable (with ``set_total``); a rich bar on a terminal, a no-op
    elsewhere."""
    if not progress_enabled():
        yield _noop
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(file=sys.stderr)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as prog:
        yield _Advance(prog, prog.add_task(description, total=total))
