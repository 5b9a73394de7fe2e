"""The pages of a tensor memory-mapped from a model file: what a plan gives back once it holds its own copy."""
from __future__ import annotations

import mmap

__all__ = ["release_pages", "release_buffer", "trim_heap"]


def _mapping_of(obj: object) -> mmap.mmap | None:
    """The memory map a buffer (an array's base chain, memoryviews) ends in, or None."""
    for _ in range(64):
        if isinstance(obj, mmap.mmap):
            return obj
        nxt = getattr(obj, "base", None) if not isinstance(obj, memoryview) else obj.obj
        if nxt is None or nxt is obj:
            return None
        obj = nxt
    return None


def release_pages(array: object) -> int:
    """Drop this process's resident pages of a contiguous array memory-mapped read-only from a model file
    (``madvise(MADV_DONTNEED)`` on the whole pages inside it): they no longer count in its RSS and are
    read from the file again if the array is used. Returns the bytes released (0 for an array that is
    not a file mapping, on a system without ``madvise``)."""
    import numpy as np

    if not isinstance(array, np.ndarray) or array.nbytes == 0 or not (array.flags.c_contiguous
                                                                       or array.flags.f_contiguous):
        return 0
    mm = _mapping_of(array.base)
    if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED") or len(mm) == 0:
        return 0
    start = int(np.frombuffer(mm, np.uint8, count=1).ctypes.data)
    lo = int(array.ctypes.data) - start
    hi = lo + array.nbytes
    if lo < 0 or hi > len(mm):
        return 0
    page = mmap.PAGESIZE
    lo = -(-lo // page) * page
    hi = hi // page * page
    if hi <= lo:
        return 0
    mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
    return hi - lo


def release_buffer(buf: object) -> int:
    """:func:`release_pages` of any buffer a writer is handed (an array, a memoryview of a file mapping): its
    resident pages of a read-only model file given back once written; 0 for anything else (bytes, memory
    of the process's own)."""
    import numpy as np

    if isinstance(buf, np.ndarray):
        return release_pages(buf)
    if _mapping_of(buf) is None:
        return 0
    try:
        return release_pages(np.frombuffer(buf, np.uint8))  # type: ignore[call-overload]
    except (TypeError, ValueError, BufferError):
        return 0


_TRIM: list = []


def trim_heap() -> bool:
    """Give the C heap's freed memory back to the system (glibc's ``malloc_trim(0)``; elsewhere nothing).
    Planning a model makes and drops large temporaries (weights repacked one by one, then side by side):
    glibc keeps such freed blocks in its heap, counted in the process's memory, until trimmed. Returns
    whether a trim ran."""
    if not _TRIM:
        fn = None
        try:
            import ctypes
            import sys

            if sys.platform.startswith("linux"):
                fn = getattr(ctypes.CDLL("libc.so.6"), "malloc_trim", None)
        except (OSError, AttributeError):
            fn = None
        _TRIM.append(fn)
    fn = _TRIM[0]
    if fn is None:
        return False
    fn(0)
    return True
