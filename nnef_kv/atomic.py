"""Write files so that a failure never leaves a partial output: temporary file in the target folder, fsync,
then ``os.replace``. On any exception (SIGINT included) the temporary is removed and the previous file, if
any, is untouched.

What may be written is checked first (:mod:`nnef_kv.targets`: a regular file, a new path or, through a
symbolic link, what it points to; never a FIFO, a device, a folder where a file goes); the temporaries are
named after the target and the writer's process id, and a write removes those of dead writers of the same
target first (:func:`nnef_kv.targets.sweep`). Outputs get the mode ``open()`` would give a new file
(``0o666`` less the umask; folders ``0o777`` less the umask). A failed write raises
:class:`~nnef_kv.errors.OutputError` (an ``OSError``) naming the target, never the temporary."""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Iterator

from .errors import NnefKvError, OutputError, clip
from .targets import check_file, check_parent, kind_of, resolve, sweep, temp_prefix


def default_mode(base: int = 0o666) -> int:
    """``base`` minus the process umask: the mode ``open()`` would give a new file.

    Temporaries are created 0600 (folders 0700) and get this mode before they replace the target."""
    mask = os.umask(0o022)
    os.umask(mask)
    return base & ~mask


def _failed(given: str, exc: BaseException) -> BaseException:
    """The error to raise for ``exc`` met while writing ``given``: an OSError becomes an OutputError naming
    ``given`` (errno kept); anything else (nnef-kv's own errors, KeyboardInterrupt) is raised as it is."""
    if isinstance(exc, OSError) and not isinstance(exc, NnefKvError):
        return OutputError(f"{given}: not written: {clip(exc, 160)}", exc.errno)
    return exc


def _mkparent(target: Path, given: str) -> None:
    check_parent(target, given, probe=False)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"{given}: cannot create the folder {target.parent} ({e.strerror or e})", e.errno) from None


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb") -> Iterator[BinaryIO]:
    """``with atomic_write(p) as f: f.write(...)`` -- ``p`` appears only complete (see the module doc)."""
    given = os.fsdecode(path) if isinstance(path, bytes) else os.fspath(path)
    target = check_file(given, probe=False)
    _mkparent(target, given)
    sweep(target.parent, target.name)
    try:
        fd, tmp = tempfile.mkstemp(prefix=temp_prefix(target.name), suffix=".tmp", dir=target.parent)
    except OSError as e:
        raise OutputError(f"{given}: cannot write in {target.parent} ({e.strerror or e})", e.errno) from None
    try:
        with os.fdopen(fd, mode) as f:
            os.chmod(tmp, default_mode())
            yield f  # type: ignore[misc]
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        err = _failed(given, exc)
        if err is exc:
            raise
        raise err from exc


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """``with atomic_dir(d) as tmp: write into tmp`` -- ``d`` is replaced only when complete.

    ``d`` must be absent or a folder (links followed); what may replace which folder is the caller's
    check (a model folder: :func:`nnef_kv.io.container.check_model_target`)."""
    import shutil

    given = os.fsdecode(path) if isinstance(path, bytes) else os.fspath(path)
    target = resolve(given)
    k = kind_of(target)
    if k not in ("absent", "folder"):
        raise OutputError(f"{given}: is a {k}, not a folder; nothing written")
    _mkparent(target, given)
    sweep(target.parent, target.name)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(target.name), suffix=".tmp", dir=target.parent))
    except OSError as e:
        raise OutputError(f"{given}: cannot write in {target.parent} ({e.strerror or e})", e.errno) from None
    try:
        os.chmod(tmp, default_mode(0o777))
        yield tmp
        if kind_of(target) == "folder":
            old = target.with_name(temp_prefix(target.name) + "old.tmp")
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        err = _failed(given, exc)
        if err is exc:
            raise
        raise err from exc
