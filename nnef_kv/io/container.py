"""Byte containers of NNEF models: folders, tar and gzip-compressed tar files.

Reading never extracts anything to disk. Members come back as :class:`Member` records holding a
read-only buffer: for an uncompressed tar a ``memoryview`` into a memory map of the tar file, for a
folder a memory map of the file, for a ``.tgz`` the member's decompressed bytes. Only regular files
are accepted: absolute paths, ``..``, links, devices and FIFOs raise :class:`ArchiveError` naming the
member. Like tract, ``./`` prefixes are stripped and any path with a component starting with ``.``
is ignored. :class:`Limits` bound the member count, the decompressed bytes (counted while
decompressing, so a gzip bomb stops early) and the size of each text and tensor member.

Writing is reproducible: members sorted by name, mtime 0, uid/gid 0, empty user/group names,
mode 0o644, POSIX pax format (pax records only for names that do not fit ustar), gzip with mtime 0
and no file name (ISA-L's fast compressor when ``isal`` is installed, else zlib level 1: see
:func:`gzip_writer`); files are written through :func:`nnef_kv.atomic.atomic_write` and folders
through :func:`nnef_kv.atomic.atomic_dir`.
"""
from __future__ import annotations

import gzip
import io
import mmap
import os
import stat
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator, Sequence

import numpy as np

from ..atomic import atomic_dir, atomic_write, default_mode  # noqa: F401 (default_mode: re-exported)
from ..errors import ArchiveError, LimitError, OutputError
from ..limits import Limits, current_limits
from ..targets import check_file, check_folder, kind_of, resolve
from ..tensors import hugepages
from ..tensors.pages import release_buffer
from ..tensors.dat import HEADER_SIZE

GZIP_MAGIC = b"\x1f\x8b"
TEXT_MEMBERS = ("graph.nnef", "graph.quant")

Buffer = bytes | memoryview


@dataclass(frozen=True)
class Member:
    """One regular file of a container: its normalised name and its bytes (read-only buffer)."""

    name: str
    data: Buffer

    @property
    def size(self) -> int:
        return memoryview(self.data).nbytes


# ----------------------------------------------------------------------------------------------
# names
# ----------------------------------------------------------------------------------------------
def normalize_member_name(raw: str, where: str) -> str | None:
    """The name tract would use for a member, or None when tract ignores it (hidden component).

    Refuses absolute paths and ``..`` with :class:`ArchiveError`.
    """
    if raw.startswith("/"):
        raise ArchiveError(f"{where}: member {raw!r} has an absolute path")
    parts = [p for p in raw.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ArchiveError(f"{where}: member {raw!r} escapes the archive ('..')")
    if not parts or any(p.startswith(".") for p in parts):
        return None
    return "/".join(parts)


def check_writable_name(name: str, where: str) -> str:
    """A member name that reads back unchanged (no hidden or empty component, no '..')."""
    parts = name.split("/")
    if name.startswith("/") or any(p in ("", ".", "..") or p.startswith(".") for p in parts):
        raise ArchiveError(f"{where}: cannot store member {name!r}: it would not read back under that name")
    return name


def is_tensor_name(name: str) -> bool:
    return name.endswith(".dat")


def _member_limit(name: str, size: int, limits: Limits, where: str) -> None:
    base = name.rsplit("/", 1)[-1]
    if base in TEXT_MEMBERS and size > limits.max_text_bytes:
        raise LimitError(f"{where}: {name} is {size} bytes, over max_text_bytes={limits.max_text_bytes}")
    if is_tensor_name(name) and size > limits.max_tensor_bytes + HEADER_SIZE:
        raise LimitError(f"{where}: {name} is {size} bytes, over max_tensor_bytes={limits.max_tensor_bytes}")


class _Budget:
    """Counts members and bytes against the limits."""

    def __init__(self, limits: Limits, where: str) -> None:
        self.limits, self.where = limits, where
        self.members = 0
        self.bytes = 0

    def member(self, name: str) -> None:
        self.members += 1
        if self.members > self.limits.max_members:
            raise LimitError(f"{self.where}: more than max_members={self.limits.max_members} members (at {name})")

    def add(self, n: int, name: str) -> None:
        self.bytes += n
        if self.bytes > self.limits.max_archive_bytes:
            raise LimitError(
                f"{self.where}: more than max_archive_bytes={self.limits.max_archive_bytes} bytes (at {name})"
            )


# ----------------------------------------------------------------------------------------------
# reading
# ----------------------------------------------------------------------------------------------
def container_kind(path: str | os.PathLike) -> str:
    """``"dir"``, ``"tgz"`` (gzip magic) or ``"tar"``."""
    p = Path(path)
    if p.is_dir():
        return "dir"
    with _open_archive(p, str(p)) as f:
        head = f.read(2)
    return "tgz" if head == GZIP_MAGIC else "tar"


def read_container(path: str | os.PathLike, limits: Limits | None = None) -> tuple[str, list[Member]]:
    """``(kind, members)`` of a folder, tar or tgz; members sorted by name."""
    limits = limits or current_limits()
    kind = container_kind(path)
    reader = {"dir": _read_dir, "tar": _read_tar, "tgz": _read_tgz}[kind]
    members = reader(Path(path), limits)
    seen: set[str] = set()
    for m in members:
        if m.name in seen:
            raise ArchiveError(f"{path}: duplicate member {m.name!r}")
        seen.add(m.name)
    return kind, sorted(members, key=lambda m: m.name)


def _map_file(path: Path) -> Buffer:
    # non-blocking: a link changed into a FIFO after it was checked must not hang the open; checked again here
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with open(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path}: no longer a regular file")
        if st.st_size == 0:
            return b""
        return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))


def _read_dir(root: Path, limits: Limits) -> list[Member]:
    where = str(root)
    budget = _Budget(limits, where)
    out: list[Member] = []

    def walk(folder: Path, prefix: str) -> None:
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError as e:
            raise ArchiveError(f"{folder}: cannot list ({e.strerror or e})") from None
        for entry in entries:
            if entry.name.startswith("."):
                continue  # tract ignores hidden components
            name = prefix + entry.name
            budget.member(name)
            if entry.is_symlink():  # followed to a regular file (HF hub cache: ../../blobs/*)
                st = _link_target(entry, name, where)
            elif entry.is_dir(follow_symlinks=False):
                walk(Path(entry.path), name + "/")
                continue
            else:
                st = entry.stat(follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                raise ArchiveError(f"{where}: member {name!r} is not a regular file")
            _member_limit(name, st.st_size, limits, where)
            budget.add(st.st_size, name)
            try:
                out.append(Member(name, _map_file(Path(entry.path))))
            except OSError as e:
                raise ArchiveError(f"{where}: cannot read {name!r} ({e.strerror or e})") from None

    walk(root, "")
    return out


def _link_target(entry: os.DirEntry, name: str, where: str) -> os.stat_result:
    """The status of what a folder member's symbolic link points to: followed when it is a regular file (tar
    members are never followed: :func:`_check_tarinfo`); a dangling link, a loop, a folder or a special file is
    refused."""
    try:
        st = os.stat(entry.path)
    except OSError:
        raise ArchiveError(f"{where}: member {name!r} is a symbolic link that does not resolve "
                           f"(to {os.readlink(entry.path)!r})") from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise ArchiveError(f"{where}: member {name!r} is a symbolic link to {kind} ({os.path.realpath(entry.path)}); "
                           f"only links to regular files are followed")
    return st


def _check_tarinfo(ti: tarfile.TarInfo, where: str) -> bool:
    """True for a regular file to read, False for a directory to skip; raises for anything else."""
    if ti.isdir():
        return False
    kinds = (
        (ti.issym(), "is a symbolic link"),
        (ti.islnk(), "is a hard link"),
        (ti.ischr() or ti.isblk(), "is a device"),
        (ti.isfifo(), "is a FIFO"),
        (ti.issparse(), "is a sparse file"),
    )
    for bad, what in kinds:
        if bad:
            raise ArchiveError(f"{where}: member {ti.name!r} {what}")
    if not ti.isreg():
        raise ArchiveError(f"{where}: member {ti.name!r} is not a regular file (type {ti.type!r})")
    return True


def _iter_tar(tf: tarfile.TarFile, where: str, budget: _Budget) -> Iterator[tuple[tarfile.TarInfo, str]]:
    while True:
        try:
            ti = tf.next()
        except tarfile.TarError as e:
            raise ArchiveError(f"{where}: not a valid tar archive ({e})") from None
        except GZIP_ERRORS as e:
            raise ArchiveError(f"{where}: corrupt or truncated archive ({e})") from None
        if ti is None:
            return
        budget.member(ti.name)
        name = normalize_member_name(ti.name, where)
        if name is None:  # hidden component: ignored whatever it is, as tract does
            continue
        if _check_tarinfo(ti, where):
            yield ti, name


def _open_archive(path: Path, where: str) -> BinaryIO:
    try:
        return open(path, "rb")
    except OSError as e:
        raise ArchiveError(f"{where}: cannot open ({e.strerror or e})") from None


def _read_tar(path: Path, limits: Limits) -> list[Member]:
    where = str(path)
    budget = _Budget(limits, where)
    out: list[Member] = []
    f = _open_archive(path, where)
    with f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise ArchiveError(f"{where}: empty file, not a tar archive")
        whole = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
        try:
            tf = tarfile.open(fileobj=f, mode="r:")
        except tarfile.TarError as e:
            raise ArchiveError(f"{where}: not a tar archive ({e})") from None
        for ti, name in _iter_tar(tf, where, budget):
            _member_limit(name, ti.size, limits, where)
            budget.add(ti.size, name)
            end = ti.offset_data + ti.size
            if end > size:
                raise ArchiveError(f"{where}: member {name!r} is truncated")
            out.append(Member(name, whole[ti.offset_data : end]))
    return out


def _isal_error() -> tuple[type[BaseException], ...]:
    try:
        from isal import isal_zlib
    except ImportError:
        return ()
    return (isal_zlib.error,)


#: what a corrupt or truncated gzip stream raises (zlib's reader, ISA-L's when installed)
GZIP_ERRORS: tuple[type[BaseException], ...] = (EOFError, zlib.error, gzip.BadGzipFile, *_isal_error())


def gzip_reader(raw: BinaryIO) -> BinaryIO:
    """A gzip stream reading ``raw``: ISA-L's when ``isal`` is installed (about twice zlib's inflate speed:
    60 vs 34 MiB/s on f32 weights here), else :class:`gzip.GzipFile`."""
    try:
        from isal import igzip
    except ImportError:
        return gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[return-value]
    return igzip.IGzipFile(fileobj=raw, mode="rb")  # type: ignore[return-value]


class _CountingReader(io.RawIOBase):
    """Decompressed stream that raises LimitError once more than max_archive_bytes came out."""

    def __init__(self, inner: BinaryIO, budget: _Budget) -> None:
        self.inner, self.budget = inner, budget

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:  # type: ignore[override]
        try:
            n = self.inner.readinto(b)  # type: ignore[attr-defined]
        except (*GZIP_ERRORS, OSError) as e:
            raise ArchiveError(f"{self.budget.where}: corrupt or truncated gzip data ({e})") from None
        self.budget.add(n or 0, "<gzip stream>")
        return n or 0


#: a .tgz member at least this large is inflated into huge-page memory (nnef_kv/tensors/hugepages.py), where
#: a plan reads the weights in it without copying them
HUGE_MEMBER_BYTES = 1 << 20


def _read_tgz(path: Path, limits: Limits) -> list[Member]:
    where = str(path)
    budget = _Budget(limits, where)
    out: list[Member] = []
    raw = _open_archive(path, where)
    with raw, gzip_reader(raw) as gz:
        stream = io.BufferedReader(_CountingReader(gz, budget), buffer_size=1 << 16)
        try:
            tf = tarfile.open(fileobj=stream, mode="r|")
        except tarfile.TarError as e:
            raise ArchiveError(f"{where}: not a gzip-compressed tar archive ({e})") from None
        for ti, name in _iter_tar(tf, where, budget):
            _member_limit(name, ti.size, limits, where)
            # refuse from the header, before inflating: the member ends at offset_data + size of the inflated
            # stream (read-ahead bytes already counted by the budget are part of that span, not extra)
            if ti.offset_data + ti.size > limits.max_archive_bytes:
                raise LimitError(
                    f"{where}: member {name!r} claims {ti.size} bytes, more than max_archive_bytes="
                    f"{limits.max_archive_bytes} in all"
                )
            fobj = tf.extractfile(ti)
            assert fobj is not None
            # inflated straight into one buffer of the member's size, 1 MiB at a time (``read()``, and tarfile's
            # stream for any large read, join their chunks: the largest member held two or three times)
            # a large member (a weight) into huge pages: the plan streams it from there without a copy
            buf = hugepages.empty((ti.size,), np.uint8) if ti.size >= HUGE_MEMBER_BYTES and hugepages.enabled() \
                else bytearray(ti.size)
            view = memoryview(buf)
            got = 0
            try:
                while got < ti.size:
                    n = fobj.readinto(view[got:got + (1 << 20)])
                    if not n:
                        break
                    got += n
            except tarfile.TarError as e:
                raise ArchiveError(f"{where}: member {name!r} is truncated ({e})") from None
            if got != ti.size:
                raise ArchiveError(f"{where}: member {name!r} is truncated")
            out.append(Member(name, view.toreadonly()))
    return out


# ----------------------------------------------------------------------------------------------
# writing
# ----------------------------------------------------------------------------------------------
class _PartsReader(io.RawIOBase):
    """A file object reading a sequence of buffers without joining them."""

    def __init__(self, parts: Sequence[Buffer]) -> None:
        self.parts = [memoryview(p).cast("B") for p in parts]
        self.i, self.pos = 0, 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:  # type: ignore[override]
        out = memoryview(b).cast("B")
        n = 0
        while n < len(out) and self.i < len(self.parts):
            part = self.parts[self.i]
            take = min(len(out) - n, len(part) - self.pos)
            out[n : n + take] = part[self.pos : self.pos + take]
            n += take
            self.pos += take
            if self.pos == len(part):
                self.i, self.pos = self.i + 1, 0
        return n


#: what a model may be written as, for messages
MODEL_TARGETS = ".tar, .tgz or .tar.gz file, or a folder (a name without a suffix, or an existing model folder)"


def container_kind_for_suffix(path: str | os.PathLike) -> str:
    """Format chosen from a target name: ``.tgz``/``.tar.gz`` -> tgz, ``.tar`` -> tar, a name without a
    suffix (or an existing folder) -> folder; any other suffix (``.zip``, ``.nnef``, ``.onnx``) is an
    :class:`~nnef_kv.errors.OutputError` listing the accepted ones."""
    p = Path(os.fsdecode(path) if isinstance(path, bytes) else os.fspath(path))
    name = p.name.lower()
    if name.endswith((".tgz", ".tar.gz")):
        return "tgz"
    if name.endswith(".tar"):
        return "tar"
    if kind_of(resolve(p)) == "folder" or not Path(name).suffix:
        return "dir"
    raise OutputError(f"{os.fspath(p)}: cannot write a model as {Path(name).suffix!r}: name a {MODEL_TARGETS}")


def check_model_target(path: str | os.PathLike, inputs: Iterable[str | os.PathLike] = (), *,
                       probe: bool = True) -> tuple[Path, str]:
    """``(path to write, kind)`` for a model target, after refusing what :func:`save` must not replace: an
    unknown suffix, a non-empty folder that is not a model (no ``graph.nnef``), a regular file where a folder
    goes, anything but a regular file or a new path for an archive (:func:`nnef_kv.targets.check_file`), the
    inputs, an unwritable folder (``probe``)."""
    given = os.fsdecode(path) if isinstance(path, bytes) else os.fspath(path)
    kind = container_kind_for_suffix(given)
    if kind != "dir":
        return check_file(given, "a model archive", inputs=inputs, probe=probe), kind
    real = check_folder(given, "a model folder", inputs=inputs, probe=probe)
    if kind_of(real) == "folder":
        try:
            entries = os.listdir(real)
        except OSError as e:
            raise OutputError(f"{given}: cannot list the folder ({e.strerror or e})", e.errno) from None
        if entries and not os.path.isfile(real / "graph.nnef"):
            raise OutputError(f"{given}: a folder that is not a model (no graph.nnef) and not empty: refusing to "
                              f"replace it; name a new folder or a .tar/.tgz file")
    return real, kind


def _tarinfo(name: str, size: int) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.size = size
    ti.mtime = 0
    ti.mode = 0o644
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    ti.type = tarfile.REGTYPE
    return ti


#: the zlib level a ``.tgz`` is written with when ISA-L's bindings (``isal``, a dependency) cannot be imported. On f32
#: weights every level gives about the same size and zlib is the slowest step of ``convert``: ``python
#: benchmarks/scale.py --gzip`` prints the levels' times and sizes (docs/benchmarks.md)
ZLIB_LEVEL = 1
#: the level given to ``isal.igzip`` (the ``isal`` dependency): many times zlib's speed at the
#: same size (docs/benchmarks.md)
ISAL_LEVEL = 1
#: archives whose members total less than this are written as before (zlib level 6): the same bytes on every
#: machine whatever is installed (the shipped sample, test fixtures), and speed does not matter at that size
SMALL_TGZ_BYTES = 16 << 20


def gzip_writer(fileobj: BinaryIO, level: int | None = None, size: int | None = None) -> BinaryIO:
    """A reproducible gzip stream (mtime 0, no file name) into ``fileobj`` for ``size`` bytes of tar: zlib
    level 6 under ``SMALL_TGZ_BYTES``; else ISA-L's when ``isal`` is installed (level ``ISAL_LEVEL``), zlib's
    at ``ZLIB_LEVEL`` otherwise. All are standard gzip that any reader takes; a large archive's bytes differ
    with and without ``isal`` (the same model gives the same bytes with the same compressor)."""
    if size is not None and size < SMALL_TGZ_BYTES and level is None:
        return gzip.GzipFile(filename="", mode="wb", fileobj=fileobj, mtime=0, compresslevel=6)  # type: ignore
    try:
        from isal import igzip
    except ImportError:
        return gzip.GzipFile(filename="", mode="wb", fileobj=fileobj, mtime=0,  # type: ignore[return-value]
                             compresslevel=ZLIB_LEVEL if level is None else level)
    return igzip.IGzipFile(filename="", mode="wb", fileobj=fileobj, mtime=0,  # type: ignore[return-value]
                           compresslevel=ISAL_LEVEL if level is None else level)


def write_tar_stream(fileobj: BinaryIO, members: Iterable[tuple[str, Sequence[Buffer]]]) -> None:
    """Write a reproducible tar of ``(name, buffers)`` (already sorted) to ``fileobj``. A buffer memory-mapped
    from a model file gives its pages back once written (:func:`~nnef_kv.tensors.pages.release_buffer`):
    saving a loaded model does not make the whole input resident."""
    with tarfile.open(fileobj=fileobj, mode="w", format=tarfile.PAX_FORMAT, encoding="utf-8") as tf:
        for name, parts in members:
            size = sum(memoryview(p).nbytes for p in parts)
            tf.addfile(_tarinfo(name, size), io.BufferedReader(_PartsReader(parts), buffer_size=1 << 20))
            for p in parts:
                release_buffer(p)


def write_container(path: str | os.PathLike, members: dict[str, Sequence[Buffer]], kind: str | None = None) -> str:
    """Write ``members`` (name -> buffers) as a folder, tar or tgz (from the suffix: :func:`check_model_target`,
    which also refuses what must not be replaced); returns the kind."""
    target, found = check_model_target(path, probe=False)
    kind = kind or found
    where = os.fsdecode(path) if isinstance(path, bytes) else os.fspath(path)
    names = sorted(members)
    for n in names:
        check_writable_name(n, where)
    if kind == "dir":
        with atomic_dir(target) as tmp:
            for n in names:
                out = tmp.joinpath(*n.split("/"))
                out.parent.mkdir(parents=True, exist_ok=True)
                with open(out, "wb") as f:
                    for p in members[n]:
                        f.write(p)
                        release_buffer(p)
        return kind
    if kind not in ("tgz", "tar"):
        raise ArchiveError(f"{where}: unknown container kind {kind!r}")
    with atomic_write(target) as f:
        if kind == "tgz":
            total = sum(memoryview(p).nbytes for n in names for p in members[n])
            with gzip_writer(f, size=total) as gz:
                write_tar_stream(gz, ((n, members[n]) for n in names))  # type: ignore[arg-type]
        else:
            write_tar_stream(f, ((n, members[n]) for n in names))
    return kind
