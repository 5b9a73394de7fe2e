"""The command line's checks of its arguments, made before any work: input paths, output targets (what
``-o``, ``--report-dir`` and ``--save-dir`` may be, :mod:`nnef_kv.targets`) and option values.

Every refusal is a :class:`CliError` (or the :class:`~nnef_kv.errors.OutputError` of a target) whose one line
names the option, the path or the value."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterable, Sequence

from ..errors import NnefKvError, clip
from ..targets import check_file, check_folder, kind_of, resolve

#: the largest integer an option takes (64-bit signed, what the ops and tract hold)
INT_MAX = (1 << 63) - 1

#: the exit codes (:func:`nnef_kv.cli.main`): ok, a check failed, an error, interrupted, the standard output closed
EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_PIPE_CLOSED = 141


class CliError(NnefKvError):
    """A bad command line (missing file, bad option value)."""


# ---------------------------------------------------------------------------------------------- inputs
def existing_path(value: str, option: str = "", *, file_only: bool = False) -> Path:
    """An input path that exists and is a regular file or a folder (links followed); a FIFO, a device or a
    socket is refused (nnef-kv would block on it or read garbage)."""
    p = Path(value)
    where = f"{option} {value}".strip()
    k = kind_of(resolve(p)) if kind_of(p) == "symbolic link" else kind_of(p)
    if k == "absent":
        raise CliError(f"{where}: no such file or folder")
    if k == "folder" and file_only:
        raise CliError(f"{where}: is a folder; a file is expected")
    if k not in ("file", "folder"):
        raise CliError(f"{where}: is a {k}; nnef-kv reads regular files and folders only")
    return p


# ---------------------------------------------------------------------------------------------- outputs
def output_file(value: str, option: str, *, suffixes: Sequence[str] = (), inputs: Iterable[Any] = (),
                what: str = "the output") -> Path:
    """The file an option writes (``run -o out.npz``): checked before any work (:func:`nnef_kv.targets.check_file`)."""
    real = check_file(value, what, inputs=list(inputs))
    if suffixes and not value.lower().endswith(tuple(s.lower() for s in suffixes)):
        raise CliError(f"{option} {value}: {what} is written as {' or '.join(suffixes)}: name a file ending in "
                       f"{suffixes[0]}")
    return real


def output_model(value: str, option: str, inputs: Iterable[Any] = ()) -> tuple[Path, str]:
    """The model target of ``convert -o`` (:func:`nnef_kv.io.container.check_model_target`)."""
    from ..io.container import check_model_target

    return check_model_target(value, inputs=list(inputs))


def output_folder(value: str, option: str, files: Iterable[str] = (), inputs: Iterable[Any] = ()) -> Path:
    """A folder an option writes into (``--report-dir``): absent or a folder nnef-kv can write in, and each of
    ``files`` inside it absent or a regular file."""
    folder = check_folder(value, f"{option}", inputs=list(inputs))
    for name in files:
        check_file(folder / name, f"{option} {name}", probe=False)
    return folder


# ---------------------------------------------------------------------------------------------- values
def int_at_least(name: str, value: Any, low: int, high: int = INT_MAX) -> int:
    """An integer option in ``low .. high`` (``high``: 2^63 - 1 unless the option says less)."""
    if value is None or isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise CliError(f"{name} {clip(value, 40)}: must be an integer >= {low}")
    if value > high:
        raise CliError(f"{name} {clip(value, 40)}: too large (at most {high})")
    return value


def fraction(name: str, value: float | None, low: float = 0.0, high: float = math.inf) -> float | None:
    if value is None:
        return None
    if math.isnan(value):
        raise CliError(f"{name} {value}: not a number")
    if not low <= value <= high:
        bound = f"in [{low:g}, {high:g}]" if math.isfinite(high) else f">= {low:g}"
        raise CliError(f"{name} {value}: must be {bound}")
    return value


def parse_ids(text: str | None, what: str = "--prompt-ids") -> list[int] | None:
    if text is None:
        return None
    parts = [t for t in text.replace(" ", ",").split(",") if t]
    if not parts:
        raise CliError(f"{what}: no token ids given")
    ids = []
    for t in parts:
        if not (t.isascii() and t.lstrip("-+").isdigit()):
            raise CliError(f"{what}: {clip(t, 40)!r} is not an integer token id")
        v = int(t)
        if v < 0:
            raise CliError(f"{what}: token id {clip(t, 40)} is negative")
        if v > INT_MAX:
            raise CliError(f"{what}: token id {clip(t, 30)} is too large")
        ids.append(v)
    return ids


def parse_contexts(text: str | None) -> list[int] | None:
    if text is None:
        return None
    out = []
    for part in [t for t in text.replace(" ", ",").split(",") if t]:
        if not (part.isascii() and part.lstrip("-+").isdigit()):
            raise CliError(f"--context {clip(part, 40)!r}: a context is a number of tokens")
        v = int(part)
        if v > INT_MAX:
            raise CliError(f"--context {clip(part, 30)}: too large (a context is a number of tokens)")
        out.append(v)
    if not out:
        raise CliError("--context: no context length given")
    return out
