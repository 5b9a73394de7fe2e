"""Memory for the weights a plan reads at every step: anonymous, 2 MiB-aligned, in transparent huge pages.

A decode step reads every weight once, so it runs at the speed the core streams memory, and with the
4 KiB pages of a file mapping (or of ``malloc``'s blocks) the core also walks the page tables every 4 KiB.
On the SmolLM2-135M-shaped f32 decoder, two sessions of the same archive decoding interleaved in one
process (docs/benchmarks.md, "At real size"; three runs): 26.9-29.1 ms a token with the weights in huge
pages, 29.9-33.5 ms read from the archive's mapping, tract 26.4-28.5 ms beside them.

:func:`empty` hands out arrays cut from chunks of :data:`CHUNK` bytes (an array over half of that gets a
chunk of its own), each an anonymous private mapping aligned on :data:`HUGE` and advised ``MADV_HUGEPAGE``: on Linux
with transparent huge pages in ``madvise`` or ``always`` mode the kernel backs them with 2 MiB pages as
they are first written. A chunk lives as long as an array in it does (the arrays hold the mapping); pages
of a chunk nobody wrote are never resident. After a ``fork`` (compare's workers) the chunks are shared by
the processes until one writes (nothing writes weights).

``NNEF_KV_HUGE_PAGES=0`` in the environment turns it off (:func:`enabled`): plans then read the archive's
own memory-mapped arrays, holding no copy (a device that cannot afford the weights in anonymous memory).
Where ``madvise`` or huge pages do not exist the arrays are still aligned anonymous memory.
"""
from __future__ import annotations

import mmap
import os
import threading
import weakref

import numpy as np

from .pages import _mapping_of

__all__ = ["empty", "enabled", "holds", "ENV", "HUGE", "CHUNK", "ALIGN"]

#: the environment variable that turns the copies off ("0")
ENV = "NNEF_KV_HUGE_PAGES"
#: a huge page (x86-64, arm64 with 4 KiB base pages)
HUGE = 2 << 20
#: bytes a chunk maps (an array larger than this gets a chunk of its own size, rounded up to HUGE)
CHUNK = 64 << 20
#: every array starts on this many bytes (a cache line, an AVX-512 vector)
ALIGN = 64

_lock = threading.Lock()
#: the chunk small arrays are cut from: a weak reference to its mapping (alive while an array in it is), the
#: offset of its aligned start, its size, the bytes used
_current: list = [None, 0, 0, 0]


#: the mappings this module made (an array in one of them is in huge-page memory already)
_ours: "weakref.WeakSet[mmap.mmap]" = weakref.WeakSet()


def holds(array: object) -> bool:
    """Whether ``array`` (an array, a memoryview) lies in memory this module handed out."""
    mm = _mapping_of(array if isinstance(array, memoryview) else getattr(array, "base", None))
    return mm is not None and mm in _ours


def enabled() -> bool:
    """Whether plans copy the weights they stream into huge pages (``NNEF_KV_HUGE_PAGES`` is not ``0``)."""
    return os.environ.get(ENV, "").strip() != "0"


def _chunk(size: int) -> tuple[mmap.mmap, int]:
    """A new mapping holding ``size`` bytes (a multiple of HUGE) from a HUGE-aligned offset, advised
    MADV_HUGEPAGE there; returns it and that offset."""
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    # private: a shared anonymous mapping is shmem, whose huge pages are a separate setting (usually off)
    mm = mmap.mmap(-1, size + HUGE, flags=flags) if flags else mmap.mmap(-1, size + HUGE)
    start = (-int(np.frombuffer(mm, np.uint8, count=1).ctypes.data)) % HUGE
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if advise is not None and hasattr(mm, "madvise"):
        try:
            mm.madvise(advise, start, size)
        except OSError:  # a kernel without transparent huge pages: aligned anonymous memory all the same
            pass
    _ours.add(mm)
    return mm, start


def _view(mm: mmap.mmap, at: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    count = int(np.prod(shape, dtype=np.int64))
    return np.frombuffer(mm, dtype, count=count, offset=at).reshape(shape)


def empty(shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """An uninitialised C-contiguous array of ``shape`` and ``dtype`` in huge-page memory (see the module); an
    ordinary NumPy array where the system refuses the mapping (the same values, without the huge pages)."""
    dtype = np.dtype(dtype)
    shape = tuple(int(d) for d in shape)
    try:
        return _cut(shape, dtype)
    except OSError:  # no anonymous mapping of that size here (address space, a sandbox): ordinary memory
        return np.empty(shape, dtype)


def _cut(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    need = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
    with _lock:
        mm = _current[0]() if _current[0] is not None else None
        start, size, used = _current[1], _current[2], _current[3]
        if mm is None or used + need > size:
            if need > CHUNK // 2:  # a large array: a chunk of its own, the current one kept for the small
                own, at = _chunk(-(-need // HUGE) * HUGE)
                return _view(own, at, shape, dtype)
            mm, start = _chunk(CHUNK)
            size, used = CHUNK, 0
            _current[0], _current[1], _current[2] = weakref.ref(mm), start, size
        _current[3] = used + need
    return _view(mm, start + used, shape, dtype)


def _after_fork_in_child() -> None:
    """A forked child (compare's workers) gets a fresh lock: the parent's may have been held by another thread."""
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
