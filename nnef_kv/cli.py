"""The ``nnef-kv`` command line (also ``python -m nnef_kv``).

Errors are one readable line on stderr and exit code 2 (no traceback unless ``--debug``).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable, Sequence

from .errors import NnefKvError

EXIT_USAGE = 2


class CliError(NnefKvError):
    """A bad command line (missing file, bad option value)."""


def _existing_path(value: str) -> Path:
    p = Path(value)
    if not p.exists():
        raise CliError(f"{value}: no such file or folder")
    return p


def cmd_inspect(args: argparse.Namespace) -> int:
    from .io.archive import load
    from .summary import summarize

    model = load(_existing_path(args.archive))
    print(summarize(model).to_text())
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {"inspect": cmd_inspect}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nnef-kv", description="NNEF archives with a quantized KV cache.")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sp = sub.add_parser("inspect", help="graph summary: inputs, outputs, op counts, parameter bytes, KV layout")
    sp.add_argument("archive", help="NNEF folder, .tar or .tgz")
    return p




def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed its message
        return int(exc.code or 0) and EXIT_USAGE
    try:
        return COMMANDS[args.command](args)
    except NnefKvError as exc:
        if args.debug:
            raise
        print(f"nnef-kv {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("nnef-kv: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
