"""Two-way column split of large products by constant weights, run by the caller and one helper thread.

``Session(model, threads=2)`` runs each large ``x @ W`` (pre-transposed constant weights, see
:mod:`.plan`) as two column halves: the helper thread takes the second half while the calling thread
computes the first (NumPy releases the GIL inside BLAS). The helper is *claimed*, never waited for to
start: if it has not picked its half up by the time the caller is done with its own, the caller computes
that half too. On a machine where other processes hold the cores this degrades to one thread's speed
instead of stalling on a descheduled worker (what multi-threaded BLAS does for small products). And when
the helper keeps coming late (it took no half, or the caller waited longer for it than its own half
took), splitting is paused for a while (``PAUSE`` products) and then tried again, so a loaded machine
costs little more than one thread. Use it with BLAS itself on one thread
(``threadpoolctl.threadpool_limits(1, "blas")``).

The halves are split on a multiple of 16 columns; each output element is the same dot product as in the
unsplit product (BLAS may round a column differently next to a block edge: within the float tolerance
the parity tests use).
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any

import numpy as np

#: products whose weight is smaller than this (bytes) are not split: the hand-over would cost more
MIN_SPLIT_BYTES = 256 * 1024
#: products run unsplit after the helper was late too often, before splitting is tried again
PAUSE = 64


class _Job:
    __slots__ = ("a", "b", "out", "state", "done", "error")

    def __init__(self, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        self.a, self.b, self.out = a, b, out
        self.state = 0  # 0 posted, 1 taken by the helper, 2 taken back by the caller
        self.done = threading.Event()
        self.error: BaseException | None = None


class ColumnSplitter:
    """One lazily started daemon helper thread; ``matmul(a, bt)`` = ``a @ bt`` in two column halves."""

    def __init__(self) -> None:
        self.active = False  # set for the duration of a run by the session (threads > 1)
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.split = 0  # products split so far
        self.taken_back = 0  # halves the caller computed itself (helper not there in time)
        self.paused = 0  # products run unsplit while paused
        self._late = 0.0  # moving average of "the helper was late"
        self._skip = 0

    def _start(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="nnef-kv-matmul", daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            with self._lock:
                if job.state != 0:
                    continue
                job.state = 1
            try:
                np.matmul(job.a, job.b, out=job.out)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                job.error = exc
            job.done.set()

    def matmul(self, a: np.ndarray, bt: np.ndarray) -> np.ndarray:
        """``a [m, k] @ bt [k, n]`` (2-D, same float dtype), the second column half on the helper."""
        n = bt.shape[1]
        h = (n // 2) // 16 * 16
        if h == 0 or h == n:
            return np.matmul(a, bt)
        if self._skip:
            self._skip -= 1
            self.paused += 1
            return np.matmul(a, bt)
        if self._thread is None:
            self._start()
        out = np.empty((a.shape[0], n), dtype=np.result_type(a, bt))
        job = _Job(a, bt[:, h:], out[:, h:])
        t0 = time.perf_counter()
        self._jobs.put(job)
        np.matmul(a, bt[:, :h], out=out[:, :h])
        t1 = time.perf_counter()
        with self._lock:
            mine = job.state == 0
            if mine:
                job.state = 2
        self.split += 1
        if mine:
            self.taken_back += 1
            np.matmul(a, bt[:, h:], out=out[:, h:])
            late = True
        else:
            job.done.wait()
            late = time.perf_counter() - t1 > t1 - t0
            if job.error is not None:
                raise job.error
        self._late = 0.9 * self._late + (0.1 if late else 0.0)
        if self._late > 0.3:
            self._skip = PAUSE
            self._late = 0.15  # a few more late ones after the pause pause again
        return out

    def close(self) -> None:
        """Stop the helper thread (a new one starts on the next split product)."""
        with self._lock:
            t, self._thread = self._thread, None
        if t is not None:
            self._jobs.put(None)
            t.join(timeout=5)


#: the process-wide splitter used by the planned products (see :func:`split_matmul`)
SPLITTER = ColumnSplitter()


def split_matmul(a2d: np.ndarray, bt: np.ndarray) -> Any:
    """``a2d @ bt``, split across two threads when a session with ``threads > 1`` is running and the
    weight is large enough; plain ``np.matmul`` otherwise."""
    if SPLITTER.active and bt.nbytes >= MIN_SPLIT_BYTES and a2d.ndim == 2 and a2d.dtype == bt.dtype:
        return SPLITTER.matmul(a2d, bt)
    return np.matmul(a2d, bt)


__all__ = ["ColumnSplitter", "SPLITTER", "split_matmul", "MIN_SPLIT_BYTES"]
