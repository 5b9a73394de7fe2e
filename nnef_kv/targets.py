"""Where nnef-kv writes: the checks made before a write (and by the command line before any work), and
the names of the temporaries writers leave while they work.

A target is written when it is

* absent: its folder is created; the nearest existing folder must be a folder nnef-kv can write in;
* a regular file (replaced whole, see :mod:`nnef_kv.atomic`);
* for a folder target (a model folder, a report folder): a folder (a model folder is replaced only when it
  is empty or holds ``graph.nnef``: :func:`nnef_kv.io.container.check_model_target`);
* a symbolic link: followed, and what it points to must be one of the above (the link stays a link).

Anything else (a FIFO, a character or block device, a socket, a folder where a file is expected and the
other way round, the input of the same command, this command's own standard input or output) is refused
with :class:`~nnef_kv.errors.OutputError` naming the path the user gave; nothing is touched.

Temporaries are ``.NAME.nnef-kv-HOST-PID-XXXXXXXX.tmp`` beside the target ``NAME`` (``HOST``: 8 hex digits
of a hash of the host name; ``PID``: the writer's process id; files and folders alike). Before writing
``NAME``, a writer removes the temporaries of ``NAME`` whose writer ran on this host and is gone
(:func:`sweep`): what a killed writer (SIGKILL, power loss) left is removed by the next write of the same
target. A temporary whose process id is alive (or was reused) is left alone.
"""
from __future__ import annotations

import errno as _errno
import hashlib
import os
import re
import shutil
import socket
import stat
import tempfile
from pathlib import Path
from typing import Iterable

from .errors import OutputError

TAG = "nnef-kv"
HOST = hashlib.sha1(socket.gethostname().encode("utf-8", "replace")).hexdigest()[:8]
#: characters of the target's name kept in a temporary's name (file names are limited to 255 bytes)
NAME_CHARS = 100
_TEMP = re.compile(rf"^\.(?P<name>.*)\.{TAG}-(?P<host>[0-9a-f]{{8}})-(?P<pid>[0-9]+)-[^/]*\.tmp$", re.S)

__all__ = ["temp_prefix", "sweep", "pid_alive", "resolve", "kind_of", "check_file", "check_folder",
           "check_parent", "check_not_input"]


# ---------------------------------------------------------------------------------------------- temporaries
def temp_prefix(name: str) -> str:
    """``.NAME.nnef-kv-HOST-PID-``: the start of the name of a temporary for target ``name``."""
    return f".{name[:NAME_CHARS]}.{TAG}-{HOST}-{os.getpid()}-"


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (a process of another user counts)."""
    if pid <= 0:
        return True  # never sweep on a name we cannot read
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True
    return True


def sweep(folder: str | os.PathLike, name: str) -> list[Path]:
    """Remove the temporaries of target ``name`` in ``folder`` left by dead writers of this host; returns them."""
    stem = name[:NAME_CHARS]
    prefix = f".{stem}.{TAG}-{HOST}-"
    removed: list[Path] = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for e in entries:
        if not e.name.startswith(prefix):
            continue
        m = _TEMP.match(e.name)
        if m is None or m["name"] != stem or m["host"] != HOST:
            continue
        pid = int(m["pid"])
        if pid == os.getpid() or pid_alive(pid):
            continue
        try:
            if e.is_dir(follow_symlinks=False):
                shutil.rmtree(e.path)
            else:
                os.unlink(e.path)
        except OSError:
            continue
        removed.append(Path(e.path))
    return removed


# ---------------------------------------------------------------------------------------------- kinds
_KINDS = ((stat.S_ISREG, "file"), (stat.S_ISDIR, "folder"), (stat.S_ISLNK, "symbolic link"),
          (stat.S_ISFIFO, "FIFO (named pipe)"), (stat.S_ISCHR, "character device"),
          (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"))


def kind_of(path: str | os.PathLike) -> str:
    """``"absent"``, ``"file"``, ``"folder"``, ``"symbolic link"``, ``"FIFO (named pipe)"``, ``"character
    device"``, ``"block device"``, ``"socket"`` (links not followed)."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, ValueError):  # ValueError: a NUL in the path, which cannot exist
        return "absent"
    except OSError as e:
        if e.errno in (_errno.ENOTDIR, _errno.ENAMETOOLONG, _errno.ELOOP):
            return "absent"
        raise OutputError(f"{os.fspath(path)}: cannot examine ({e.strerror or e})", e.errno) from None
    return next((k for test, k in _KINDS if test(mode)), "special file")


def _article(kind: str) -> str:
    return "an " if kind[0] in "aeiouAEIOU" else "a "


def resolve(path: str | os.PathLike) -> Path:
    """The path a write of ``path`` changes: symbolic links followed (a link to a link too); refuses a
    link loop."""
    given = os.fspath(path)
    p = Path(given)
    if kind_of(p) != "symbolic link":
        return p
    real = Path(os.path.realpath(p))
    if kind_of(real) == "symbolic link":
        raise OutputError(f"{given}: a symbolic link that does not resolve (a loop?); nothing written")
    return real


def _given(path: str | os.PathLike) -> str:
    given = os.fsdecode(path) if isinstance(path, bytes) else os.fspath(path)
    if "\0" in given:
        raise OutputError(f"{given[:80]!r}: a path cannot hold a NUL character; nothing written")
    return given


def _std_stream(real: Path) -> str | None:
    """``"standard output"`` (...) when ``real`` is the file one of this process's standard streams is."""
    try:
        st = os.stat(real)
    except OSError:
        return None
    for fd, what in ((1, "standard output"), (2, "standard error"), (0, "standard input")):
        try:
            if os.path.samestat(st, os.fstat(fd)):
                return what
        except (OSError, ValueError):
            continue
    return None


def check_not_input(real: Path, given: str, inputs: Iterable[str | os.PathLike]) -> None:
    """Refuse a target that is one of ``inputs`` or a folder holding one of them."""
    for i in inputs:
        try:
            ip = Path(os.path.realpath(i))
            rp = Path(os.path.realpath(real))
            hit = (ip.exists() or ip.is_symlink()) and (rp == ip or (rp.is_dir() and rp in ip.parents))
        except OSError:
            continue
        if hit:
            raise OutputError(f"{given}: the output would overwrite the input {os.fspath(i)}; write elsewhere")


def check_parent(real: Path, given: str, *, probe: bool = True) -> None:
    """The nearest existing folder above ``real`` is a folder; with ``probe``, one nnef-kv can create a file
    in (tried: a temporary is created and removed), so a write refused for permissions or a read-only
    file system is refused before any work, naming ``given``."""
    folder = real.parent
    while kind_of(folder) == "absent" and folder != folder.parent:
        folder = folder.parent
    k = kind_of(folder)
    if k == "symbolic link":
        folder = resolve(folder)
        k = kind_of(folder)
    if k != "folder":
        raise OutputError(f"{given}: {folder} is {_article(k)}{k}, not a folder; nothing written")
    if not probe:
        return
    try:
        fd, tmp = tempfile.mkstemp(prefix=temp_prefix("probe"), suffix=".tmp", dir=folder)
    except OSError as e:
        raise OutputError(f"{given}: cannot write in {folder} ({e.strerror or e}); nothing written", e.errno) from None
    os.close(fd)
    try:
        os.unlink(tmp)
    except OSError:
        pass


def check_file(path: str | os.PathLike, what: str = "the output", *, inputs: Iterable[str | os.PathLike] = (),
               probe: bool = True) -> Path:
    """The path to write for file target ``path`` (links followed), after refusing what is not absent or a
    regular file, the inputs, this process's standard streams and an unwritable folder (``probe``)."""
    given = _given(path)
    real = resolve(given)
    k = kind_of(real)
    via = f" (the symbolic link points to {real})" if os.fspath(real) != given else ""
    if k == "folder":
        raise OutputError(f"{given}: is a folder{via}; {what} is a file: name a file")
    if k not in ("absent", "file"):
        raise OutputError(f"{given}: is {_article(k)}{k}{via}; nnef-kv writes {what} only to a regular file or a "
                          f"new path; nothing written")
    stream = _std_stream(real) if k == "file" else None
    if stream is not None:
        raise OutputError(f"{given}: is this command's {stream}; nnef-kv writes {what} to a file, not a stream")
    check_not_input(real, given, inputs)
    check_parent(real, given, probe=probe)
    return real


def check_folder(path: str | os.PathLike, what: str = "the output folder", *,
                 inputs: Iterable[str | os.PathLike] = (), probe: bool = True) -> Path:
    """The folder to write into for folder target ``path`` (absent or a folder; links followed), after
    refusing anything else, the inputs, and an unwritable folder (``probe``: tried in the folder itself
    when it exists)."""
    given = _given(path)
    real = resolve(given)
    k = kind_of(real)
    if k not in ("absent", "folder"):
        raise OutputError(f"{given}: is {_article(k)}{k}; {what} must be a folder or a new path; nothing written")
    check_not_input(real, given, inputs)
    if k == "folder":
        check_parent(real / "x", given, probe=probe)
    else:
        check_parent(real, given, probe=probe)
    return real


# ---------------------------------------------------------------------------------------------- API paths
def path_arg(value: object, func: str, what: str = "a path") -> str:
    """``value`` as a path string for API function ``func``: a ``str``, an ``os.PathLike`` or a short
    ``bytes`` path; anything else (archive bytes, a file object, None) is an
    :class:`~nnef_kv.errors.ArgumentError` saying what was expected and what came."""
    from .errors import ArgumentError, describe

    if isinstance(value, (bytes, bytearray)):
        raw = bytes(value)
        content = raw.startswith((b"\x1f\x8b", b"PK", b"\x93NUMPY", b"\x4e\xef"))
        if len(raw) <= 4096 and b"\0" not in raw and not content:
            return os.fsdecode(raw)
        raise ArgumentError(f"{func}: expected {what} (str, bytes or os.PathLike), got {describe(value)} that look "
                            f"like file contents; write them to a file and pass its path")
    if isinstance(value, (str, os.PathLike)):
        got = os.fspath(value)
        if isinstance(got, bytes):
            return os.fsdecode(got)
        if "\0" in got:
            raise ArgumentError(f"{func}: a path cannot hold a NUL character: {got[:80]!r}")
        return got
    hint = "; pass its path (f.name)" if isinstance(getattr(value, "name", None), str) else ""
    raise ArgumentError(f"{func}: expected {what} (str, bytes or os.PathLike), got {describe(value)}{hint}")
