"""The ``nnef-kv`` command line (also ``python -m nnef_kv``).

Commands: ``inspect``, ``convert``, ``run``, ``generate``, ``validate``, ``demo``, ``compare`` (``nnef-kv COMMAND -h``),
one module each in this package (its subparser, ``add_parser``, and its ``cmd_*`` function); the shared helpers
are :mod:`~nnef_kv.cli.args` (paths, output targets, option values, the exit codes), :mod:`~nnef_kv.cli.measure`
(the options of the commands measuring on a text), :mod:`~nnef_kv.cli.threads` (``--threads``) and
:mod:`~nnef_kv.cli.words` (what the commands print).

Errors are one readable line on stderr and exit code 2 (no traceback unless ``--debug``, accepted
anywhere on the line). Option values are checked before any work, so a refused command writes nothing.
``validate`` exits 1 when a check or a threshold given on the command line is not met.

``run`` input convention (``--inputs io.npz``): a key ``NAME`` is fed to graph input ``NAME`` at every
step; ``NAME@K`` is fed at step ``K`` only (0-based) and wins over ``NAME``. The number of steps is
``--steps`` or else ``1 + the largest K``. An explicit cache input (``in_cache_*``...) missing at a step is
fed from the previous step's matching output (``out_cache_*``), empty at step 0. Keys named like a
graph *output* are taken as expected values: the max |difference| is printed next to the stats; with
``--assert [TOL]`` (as tract's ``--assert-output-bundle``) a difference over TOL (default 1e-4) exits 1.
With ``-o out.npz`` the outputs are saved under the same convention (``NAME`` for one step, else
``NAME@K``).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from typing import Callable, Sequence

from ..errors import NnefKvError, clip
from ..limits import Limits, current_limits, using_limits
from . import compare, convert, demo, generate, inspect, run, validate
from .args import (EXIT_CHECK_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_PIPE_CLOSED, EXIT_USAGE, CliError,
                   int_at_least)
from .compare import cmd_compare
from .convert import cmd_auto_bits, cmd_convert
from .demo import cmd_demo
from .generate import _chat_prompt, cmd_generate
from .inspect import cmd_inspect
from .run import ASSERT_TOLERANCE, cmd_run
from .threads import THREADED_COMMANDS, add_threads_option, threads_of
from .validate import cmd_validate
from .words import note_compiling, scheme_phrase as _scheme_phrase

__all__ = ["main", "build_parser", "COMMANDS", "CliError", "EXIT_OK", "EXIT_CHECK_FAILED", "EXIT_USAGE",
           "EXIT_INTERRUPTED", "EXIT_PIPE_CLOSED", "ASSERT_TOLERANCE", "THREADED_COMMANDS", "cmd_inspect",
           "cmd_convert", "cmd_auto_bits", "cmd_run", "cmd_generate", "cmd_validate", "cmd_demo", "cmd_compare",
           "_chat_prompt", "_scheme_phrase"]

#: the command modules, in the order ``nnef-kv --help`` lists them
_COMMAND_MODULES = (inspect, convert, run, generate, validate, demo, compare)

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "inspect": cmd_inspect,
    "convert": cmd_convert,
    "run": cmd_run,
    "generate": cmd_generate,
    "validate": cmd_validate,
    "demo": cmd_demo,
    "compare": cmd_compare,
}


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit code 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {clip(' '.join(message.split()), 240)}\n")


def _version() -> str:
    from .._version import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="nnef-kv", description="NNEF archives with a quantized KV cache.")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors (accepted anywhere)")
    p.add_argument("--version", action="version", version=f"nnef-kv {_version()}")
    lim = p.add_argument_group("resource limits for untrusted archives")
    d = Limits()
    lim.add_argument("--max-archive-bytes", type=int, metavar="N",
                     help=f"decompressed bytes read from one archive (default {d.max_archive_bytes})")
    lim.add_argument("--max-tensor-bytes", type=int, metavar="N",
                     help=f"payload bytes of one .dat tensor (default {d.max_tensor_bytes})")
    lim.add_argument("--max-members", type=int, metavar="N",
                     help=f"members (files) in one archive or folder (default {d.max_members})")
    lim.add_argument("--max-nesting", type=int, metavar="N",
                     help=f"nesting depth of expressions in NNEF text (default {d.max_nesting})")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    for module in _COMMAND_MODULES:
        module.add_parser(sub)
    add_threads_option(sub)  # --threads on the commands running sessions (nnef_kv/cli/threads.py)
    return p


_LIMIT_FLAGS = ("max_archive_bytes", "max_tensor_bytes", "max_members", "max_nesting")


def _limits_from(args: argparse.Namespace) -> Limits:
    """The defaults, with every ``--max-*`` flag given on the command line applied (each must be >= 1)."""
    given = {k: getattr(args, k) for k in _LIMIT_FLAGS if getattr(args, k, None) is not None}
    for k, v in given.items():
        int_at_least("--" + k.replace("_", "-"), v, 1)
    return dataclasses.replace(current_limits(), **given)


def _say(command: str, kind: str, exc: BaseException) -> None:
    """The one error line: ``nnef-kv COMMAND: error: message`` (newlines folded, very long details clipped)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    print(f"nnef-kv {command}: {kind}: {clip(text, 1000)}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit code (0 ok, 1 a check failed, 2 an error, 130 interrupted, 141 the
    standard output was closed). ``--debug`` prints the traceback of an error (still exit 2)."""
    import traceback

    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed its message (or the help)
        return EXIT_OK if exc.code in (0, None) else EXIT_USAGE
    args.debug = debug
    try:
        limits = _limits_from(args)
        from .. import kernels

        kernels.on_compile = note_compiling  # the first KIVI run on a machine says why it waits
        with using_limits(limits), threads_of(args):
            return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print("nnef-kv: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `nnef-kv run ... | head`: stop quietly
        with contextlib.suppress(OSError, ValueError):
            sys.stdout = open(os.devnull, "w")
        return EXIT_PIPE_CLOSED
    except (NnefKvError, OSError, MemoryError) as exc:
        if debug:
            traceback.print_exc()
        _say(args.command, "error", exc if not isinstance(exc, MemoryError) else MemoryError("out of memory"))
        return EXIT_USAGE
    except Exception as exc:  # a bug: still one line; --debug shows the traceback
        if debug:
            traceback.print_exc()
        _say(args.command, "internal error", RuntimeError(f"{type(exc).__name__}: {exc} (rerun with --debug)"))
        return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
