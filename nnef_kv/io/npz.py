"""``.npz`` files as untrusted input (``nnef-kv run --inputs``) and as a streamed output (``run -o``).

:class:`NpzReader` reads the zip directory and every member's ``.npy`` header first and refuses, naming the
file and the key, before any array is read: a file that is not an ``.npz`` (empty, a FIFO or device, a
``.npy``, text, a truncated or damaged zip), a member that is not a ``.npy``, Python objects (nnef-kv never
unpickles), a non-numeric dtype (strings, records, dates), a header that disagrees with the member's size,
and sizes over the limits (:class:`~nnef_kv.limits.Limits`: ``max_tensor_bytes`` per array from its header,
``max_archive_bytes`` for all of them, ``max_members``). Arrays are then read one at a time, when asked for
(:meth:`NpzReader.load`), never more bytes than the zip directory declares.

:class:`NpzWriter` appends arrays to an ``.npz`` as they come (``np.savez``'s layout: stored ``KEY.npy``
members, zip64), so a long run does not keep its outputs in memory.
"""
from __future__ import annotations

import os
import zipfile
import zlib
from dataclasses import dataclass
from typing import Any, BinaryIO, Iterator

import numpy as np

from ..errors import InputError, LimitError, clip
from ..limits import Limits, current_limits
from ..targets import kind_of, resolve

NUMERIC_KINDS = "biufc"  # bool, signed, unsigned, float, complex
_KIND_WORDS = {"U": "strings", "S": "bytes", "O": "Python objects", "V": "records (structured or void)",
               "M": "dates", "m": "time deltas"}


@dataclass(frozen=True)
class NpzEntry:
    """One array of an ``.npz``, from its header: key, shape, dtype, order, offset of the data in the member."""

    key: str
    info: zipfile.ZipInfo
    shape: tuple[int, ...]
    dtype: np.dtype
    fortran: bool
    data_offset: int

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n * self.dtype.itemsize


def _read_header(f: BinaryIO) -> tuple[tuple[int, ...], bool, np.dtype]:
    fmt = np.lib.format
    version = fmt.read_magic(f)
    if version == (1, 0):
        return fmt.read_array_header_1_0(f)
    if version in ((2, 0), (3, 0)):
        return fmt.read_array_header_2_0(f)
    raise ValueError(f"unsupported .npy format version {version}")


class NpzReader:
    """The arrays of an untrusted ``.npz``: ``keys``, :meth:`entry` (header facts), :meth:`load` (the array).

    ``what`` names the file in messages (``--inputs io.npz: key 'x' ...``). Use as a context manager."""

    def __init__(self, path: str | os.PathLike, limits: Limits | None = None, what: str = "") -> None:
        self.path = os.fspath(path)
        self.where = f"{what} {self.path}".strip()
        self.limits = limits or current_limits()
        self._zip: zipfile.ZipFile | None = None
        self.entries: dict[str, NpzEntry] = {}
        self._open()

    # -- opening: everything is checked here -----------------------------------------------------
    def _fail(self, message: str) -> InputError:
        return InputError(f"{self.where}: {message}")

    def _open(self) -> None:
        real = resolve(self.path)
        k = kind_of(real)
        if k == "absent":
            raise self._fail("no such file")
        if k != "file":
            raise self._fail(f"is a {k}, not an .npz file")
        try:
            with open(real, "rb") as f:
                head = f.read(8)
        except OSError as e:
            raise self._fail(f"cannot read ({e.strerror or e})") from None
        if not head:
            raise self._fail("an empty file, not an .npz archive")
        if head.startswith(b"\x93NUMPY"):
            raise self._fail("a .npy array, not an .npz archive (save the inputs with np.savez(path, NAME=array))")
        if not head.startswith((b"PK\x03\x04", b"PK\x05\x06")):
            raise self._fail("not an .npz archive (no zip signature: an .npz is written by np.savez)")
        try:
            self._zip = zipfile.ZipFile(real)
            infos = self._zip.infolist()
        except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError, OSError) as e:
            raise self._fail(f"a truncated or damaged .npz archive ({clip(e, 100)})") from None
        if len(infos) > self.limits.max_members:
            raise LimitError(f"{self.where}: {len(infos)} members, over max_members={self.limits.max_members}")
        total = 0
        for info in infos:
            entry = self._entry(info)
            if entry.key in self.entries:
                raise self._fail(f"key {entry.key!r} appears twice")
            total += entry.nbytes
            if total > self.limits.max_archive_bytes:
                raise LimitError(f"{self.where}: the arrays take more than max_archive_bytes="
                                 f"{self.limits.max_archive_bytes} bytes in all (at key {entry.key!r})")
            self.entries[entry.key] = entry

    def _entry(self, info: zipfile.ZipInfo) -> NpzEntry:
        name = info.filename
        if not name.endswith(".npy") or info.is_dir():
            raise self._fail(f"member {clip(name, 80)!r} is not a .npy array (an .npz holds KEY.npy members)")
        key = name[:-4]
        if info.flag_bits & 0x1:
            raise self._fail(f"key {clip(key, 80)!r} is encrypted")
        assert self._zip is not None
        try:
            with self._zip.open(info) as f:
                shape, fortran, dtype = _read_header(f)
                offset = f.tell()
        except (ValueError, SyntaxError, TypeError, zipfile.BadZipFile, EOFError, zlib.error, OSError,
                NotImplementedError) as e:
            raise self._fail(f"key {clip(key, 80)!r}: not a readable .npy header ({clip(e, 100)})") from None
        if dtype.hasobject or dtype.kind not in NUMERIC_KINDS:
            words = _KIND_WORDS.get(dtype.kind, "not numbers")
            extra = " (pickled data: nnef-kv never unpickles a file)" if dtype.hasobject else ""
            raise self._fail(f"key {clip(key, 80)!r} holds {words}{extra}, dtype {clip(dtype.str, 40)}: "
                             f"nnef-kv reads numeric arrays only")
        entry = NpzEntry(key, info, tuple(int(d) for d in shape), dtype, bool(fortran), offset)
        if entry.nbytes > self.limits.max_tensor_bytes:
            raise LimitError(f"{self.where}: key {clip(key, 80)!r} declares {dtype} {list(entry.shape)}, "
                             f"{entry.nbytes} bytes, over max_tensor_bytes={self.limits.max_tensor_bytes}")
        if offset + entry.nbytes != info.file_size:
            raise self._fail(f"key {clip(key, 80)!r}: its header declares {dtype} {list(entry.shape)} "
                             f"({entry.nbytes} bytes) but the member holds {info.file_size - offset} data bytes "
                             f"(truncated or damaged)")
        return entry

    # -- reading -----------------------------------------------------------------------------------
    @property
    def keys(self) -> list[str]:
        return list(self.entries)

    def entry(self, key: str) -> NpzEntry:
        return self.entries[key]

    def load(self, key: str) -> np.ndarray:
        """The array under ``key`` (read now; at most the bytes its header declares)."""
        e = self.entries[key]
        assert self._zip is not None
        try:
            with self._zip.open(e.info) as f:
                f.seek(e.data_offset) if f.seekable() else f.read(e.data_offset)
                data = f.read(e.nbytes)
        except (zipfile.BadZipFile, EOFError, zlib.error, OSError, ValueError) as exc:
            raise self._fail(f"key {clip(key, 80)!r}: damaged data ({clip(exc, 100)})") from None
        if len(data) != e.nbytes:
            raise self._fail(f"key {clip(key, 80)!r}: truncated data ({len(data)} of {e.nbytes} bytes)")
        order = "F" if e.fortran else "C"
        return np.frombuffer(data, dtype=e.dtype).reshape(e.shape, order=order)

    def close(self) -> None:
        if self._zip is not None:
            self._zip.close()
            self._zip = None

    def __enter__(self) -> "NpzReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)


class NpzWriter:
    """``w = NpzWriter(f); w.add("x", array); ...; w.close()``: an ``.npz`` written array by array into the
    binary file ``f`` (seekable), as ``np.savez`` lays it out (one array's bytes in memory at a time). After a
    failed write call :meth:`discard` (the file is the caller's to drop): nothing is left to finalise later."""

    def __init__(self, fileobj: BinaryIO) -> None:
        self._zip = zipfile.ZipFile(fileobj, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True)
        self.count = 0

    def add(self, key: str, array: Any) -> None:
        import io

        a = np.asanyarray(array)
        buf = io.BytesIO()
        np.lib.format.write_array(buf, a, allow_pickle=False)
        info = zipfile.ZipInfo(key + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
        info.compress_type = zipfile.ZIP_STORED
        try:
            with self._zip.open(info, mode="w", force_zip64=True) as f:
                f.write(buf.getbuffer())
        except BaseException:
            self.discard()
            raise
        self.count += 1

    def discard(self) -> None:
        """Forget the archive without writing its directory (after a failure)."""
        self._zip.fp = None  # ZipFile.close (and its finaliser) then do nothing

    def close(self) -> None:
        try:
            self._zip.close()
        except BaseException:
            self.discard()
            raise

    def __enter__(self) -> "NpzWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.close()
        else:
            self.discard()
