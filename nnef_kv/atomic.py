"""Write files so that a failure never leaves a partial output: temporary file in the target
folder, fsync, then ``os.replace``. On any exception (SIGINT included) the temporary is removed and
the previous file, if any, is untouched."""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Iterator


def default_mode(base: int = 0o666) -> int:
    """``base`` minus the process umask: the mode ``open()`` would give a new file.

    Temporary files of :mod:`nnef_kv.atomic` are created 0600 (folders 0700); the outputs get
    the usual permissions instead.
    """
    mask = os.umask(0o022)
    os.umask(mask)
    return base & ~mask


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb") -> Iterator[BinaryIO]:
    """``with atomic_write(p) as f: f.write(...)`` -- ``p`` appears only complete."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, mode) as f:
            yield f  # type: ignore[misc]
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """``with atomic_dir(d) as tmp: write into tmp`` -- ``d`` is replaced only when complete."""
    import shutil

    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        yield tmp
        if target.exists():
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
