"""``--threads N`` of the commands that run sessions: the sessions' threads (see
``nnef_kv/interpreter/plan/parallel.py`` for the policy), passed through ``$NNEF_KV_THREADS`` so that
worker processes inherit it."""
from __future__ import annotations

import argparse
import contextlib
import os
from typing import Any, Iterator

from .args import int_at_least

__all__ = ["THREADED_COMMANDS", "add_threads_option", "threads_of"]

#: the commands taking ``--threads``
THREADED_COMMANDS = ("run", "generate", "validate", "compare", "demo")


def add_threads_option(sub: Any) -> None:
    """``--threads N`` on each of :data:`THREADED_COMMANDS` (``sub``: the subparsers)."""
    for name in THREADED_COMMANDS:
        sub.choices[name].add_argument(
            "--threads", type=int, default=None, metavar="N",
            help="threads of each session: 1 = everything on the calling thread, 2 = large weight products split "
                 "in two column halves (BLAS itself stays on one thread either way); default: the usable CPUs, at "
                 "most 2, one while other processes hold the CPUs (also read from $NNEF_KV_THREADS; worker "
                 "processes inherit it)")


@contextlib.contextmanager
def threads_of(args: argparse.Namespace) -> Iterator[None]:
    """``--threads N``: every session of the command (and of its worker processes) runs on N threads; the
    environment is put back afterwards (``main`` called in-process)."""
    n = getattr(args, "threads", None)
    if n is None:
        yield
        return
    from ..interpreter.plan.parallel import THREADS_ENV

    int_at_least("--threads", n, 1)
    saved = os.environ.get(THREADS_ENV)
    os.environ[THREADS_ENV] = str(n)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(THREADS_ENV, None)
        else:
            os.environ[THREADS_ENV] = saved
