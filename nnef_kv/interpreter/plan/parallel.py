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
unsplit product, but BLAS may round a whole product and its halves differently (it picks its kernel by
size): :func:`split_matmul` therefore computes every product large enough to split as the same two
halves on every path (two threads, one thread, paused), so a session's results are the same bits whatever
its ``threads`` and the machine's load.

**Few-row products** (a decode step: at most :data:`nnef_kv.kernels.gemv.MAX_ROWS` rows) by the transposed
view of a C-contiguous float weight run on the numba kernel :func:`nnef_kv.kernels.gemv.rows_by_t` when
numba is there (:func:`refresh`, once a run): each output one dot product along a row of the weight, at
about twice the bandwidth of BLAS's gemv on this VM, and the same bits whatever rows of the weight a
thread takes, so such a product needs no halves. One core streams a layer's weight about as fast as two
(the hand-over costs the rest), so only weights of :data:`MIN_ROWS_SPLIT_BYTES` or more (an LM head) are
split for them.

**The thread policy** (issue 26): while a session runs, BLAS itself is held at one thread
(:data:`BLAS`, through threadpoolctl) whatever the session's ``threads``, and the session's own
threads are the only second thread: a product is split only when it is large enough
(:func:`split_worth`: weight >= ``MIN_SPLIT_BYTES`` and rows x inputs x outputs >= ``MIN_SPLIT_WORK``),
else it runs on the calling thread. The reason (``python benchmarks/scale.py`` prints the rows; the
figures in docs/benchmarks.md, "At real size"): OpenBLAS on two threads hands half of each product to
a worker and *waits* for it; with another process on the other core that worker is descheduled for a
time slice, and a small product takes a time slice instead of a tenth of a millisecond. The claimed
helper here never waits on a worker that is not running. :func:`default_threads` (what ``Session(threads=None)`` and the
CLI's default use) is the usable CPUs, capped at the two halves this splitter makes; a session left at
that default also runs on one thread while other processes hold the second CPU (:class:`LoadWatch`:
the load average less its own use), since the claimed helper then mostly comes late (measured under load by ``python
benchmarks/scale.py``; docs/benchmarks.md, "Where the code's thresholds come from").
"""
from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any, Callable

import numpy as np

from ...kernels import gemv, numba_available
from ...kernels.gemv import rows_by_t

#: products whose weight is smaller than this (bytes) are not split: the hand-over would cost more
MIN_SPLIT_BYTES = 256 * 1024
#: products doing fewer multiply-adds than this (rows x inputs x outputs) are not split either: below it the
#: hand-over to the helper (a queue put, an event) costs about what the second half saves
MIN_SPLIT_WORK = 1 << 18
#: products run unsplit after the helper was late too often, before splitting is tried again
PAUSE = 64


class _Job:
    __slots__ = ("fn", "lo", "hi", "state", "done", "error")

    def __init__(self, fn: Callable[[int, int], Any], lo: int, hi: int) -> None:
        self.fn, self.lo, self.hi = fn, lo, hi  # fn(lo, hi) writes output columns lo:hi
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
                job.fn(job.lo, job.hi)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                job.error = exc
            job.done.set()

    def matmul(self, a: np.ndarray, bt: np.ndarray) -> np.ndarray:
        """``a [m, k] @ bt [k, n]`` (2-D, same float dtype) by BLAS, the second column half on the helper."""
        n = bt.shape[1]
        h = (n // 2) // 16 * 16
        if h == 0 or h == n:
            return np.matmul(a, bt)
        if self._skip:
            self._skip -= 1
            self.paused += 1
            return halves(a, bt)
        out = np.empty((a.shape[0], n), dtype=np.result_type(a, bt))

        def columns(lo: int, hi: int) -> None:
            np.matmul(a, bt[:, lo:hi], out=out[:, lo:hi])
        self._split(columns, h, n)
        return out

    def rows_by_t(self, a: np.ndarray, w: np.ndarray) -> np.ndarray:
        """``a @ w.T`` on :func:`nnef_kv.kernels.gemv.rows_by_t` (``a`` few rows, ``w [n, k]`` C-contiguous),
        the outputs from the middle on on the helper. Every output is the same dot product however the
        outputs are split, so there are no halves to keep: a paused splitter runs it whole."""
        n = w.shape[0]
        out = np.empty((a.shape[0], n), dtype=a.dtype)
        h = (n // 2) // 16 * 16
        if self._skip or h == 0:
            if self._skip:
                self._skip -= 1
                self.paused += 1
            rows_by_t(a, w, out, 0, n)
            return out
        self._split(lambda lo, hi: rows_by_t(a, w, out, lo, hi), h, n)
        return out

    def _split(self, fn: Callable[[int, int], Any], h: int, n: int) -> None:
        """``fn(0, h)`` here and ``fn(h, n)`` on the helper if it picks it up before this thread is done with
        its own part, else here too; keeps the helper's lateness and pauses splitting when it is often late."""
        if self._thread is None:
            self._start()
        job = _Job(fn, h, n)
        t0 = time.perf_counter()
        self._jobs.put(job)
        fn(0, h)
        t1 = time.perf_counter()
        with self._lock:
            mine = job.state == 0
            if mine:
                job.state = 2
        self.split += 1
        if mine:
            self.taken_back += 1
            fn(h, n)
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

    def close(self) -> None:
        """Stop the helper thread (a new one starts on the next split product)."""
        with self._lock:
            t, self._thread = self._thread, None
        if t is not None:
            self._jobs.put(None)
            t.join(timeout=5)


#: the process-wide splitter used by the planned products (see :func:`split_matmul`)
SPLITTER = ColumnSplitter()


def split_worth(m: int, k: int, n: int, itemsize: int = 4) -> bool:
    """The thread policy for one product ``[m, k] @ [k, n]``: split across two threads only when the weight
    holds at least ``MIN_SPLIT_BYTES`` and the product does at least ``MIN_SPLIT_WORK`` multiply-adds."""
    return k * n * itemsize >= MIN_SPLIT_BYTES and m * k * n >= MIN_SPLIT_WORK and n >= 32


def halves(a: np.ndarray, bt: np.ndarray) -> np.ndarray:
    """``a @ bt`` computed as the two column halves :meth:`ColumnSplitter.matmul` makes, on this thread: the
    same BLAS calls, so the same bits, whether a product was split across threads or not."""
    n = bt.shape[1]
    h = (n // 2) // 16 * 16
    if h == 0 or h == n:
        return np.matmul(a, bt)
    out = np.empty((a.shape[0], n), dtype=np.result_type(a, bt))
    np.matmul(a, bt[:, :h], out=out[:, :h])
    np.matmul(a, bt[:, h:], out=out[:, h:])
    return out


def few_rows(a: np.ndarray, bt: np.ndarray) -> np.ndarray | None:
    """``a [..., K] @ bt [K, N]`` (``a`` C-contiguous, of rank 2 or more) on the few-row kernel when
    :func:`nnef_kv.kernels.gemv.usable` takes its rows (a decode step's product), the leading axes kept: the
    kernel call :func:`split_matmul` makes, without its other checks (a decode step makes ~120 products).
    None when it does not apply."""
    core = _FEW_ROWS[0]
    if core is None or a.ndim < 2 or not a.flags.c_contiguous or not a.shape[-1]:
        return None
    a2 = a.reshape(-1, a.shape[-1])
    if not gemv.usable(a2, bt):
        return None
    w = bt.T
    if SPLITTER.active and w.nbytes >= MIN_ROWS_SPLIT_BYTES:
        out = SPLITTER.rows_by_t(a2, w)
    else:
        out = np.empty((a2.shape[0], w.shape[0]), dtype=a.dtype)
        core(a2, w, out, 0, w.shape[0])
    return out.reshape(a.shape[:-1] + (w.shape[0],))


def split_matmul(a2d: np.ndarray, bt: np.ndarray) -> Any:
    """``a2d @ bt``. A product of a few rows (a decode step) by the transposed view of a C-contiguous float32
    or float64 weight runs on :func:`nnef_kv.kernels.gemv.rows_by_t` when numba is there (see
    :func:`refresh`; about twice the bandwidth of BLAS's gemv here, and its outputs do not depend on how
    they are split across the threads: split only from ``MIN_ROWS_SPLIT_BYTES``). Otherwise a product
    large enough to split (:func:`split_worth`) is always computed as its two column halves, across two
    threads when a session with ``threads > 1`` is running, else one after the other: BLAS may round a
    whole product and its halves differently (another kernel for another width: up to 6e-5 on 1-2 rows x
    576 x 1536 measured), and a result must not depend on the threads or the machine's load. A plain
    ``np.matmul`` for the others."""
    if a2d.ndim == 2 and bt.ndim == 2 and a2d.dtype == bt.dtype:
        if _FEW_ROWS[0] is not None and a2d.shape[0] <= gemv.MAX_ROWS:
            got = few_rows(a2d if a2d.flags.c_contiguous else np.ascontiguousarray(a2d), bt)
            if got is not None:
                return got
        if split_worth(a2d.shape[0], bt.shape[0], bt.shape[1], bt.itemsize):
            return SPLITTER.matmul(a2d, bt) if SPLITTER.active else halves(a2d, bt)
    return np.matmul(a2d, bt)


#: a few-row product by a weight at least this large is split across the threads: on this VM one core
#: streams a 1 x 576 x 1536 product's weight at about what two do (the hand-over eats the rest), an LM head's
#: (1 x 576 x 49152, 113 MB) 10% faster on two (docs/benchmarks.md, "Where the code's thresholds come from")
MIN_ROWS_SPLIT_BYTES = 16 << 20
#: what :func:`split_matmul` runs few-row products on during a run (set by :func:`refresh`): the numba core, or
#: None (BLAS)
_FEW_ROWS: list = [None]


def gemv_on() -> bool:
    """The few-row products run on the numba kernel: numba is there (not ``NNEF_KV_NO_NUMBA=1``) and it
    compiled. Without it they are BLAS's, in halves as above."""
    return numba_available() and rows_by_t.broken is None


def refresh() -> None:
    """Called at the start of every run (:func:`~.execute.execute`): whether this run's few-row products take
    the numba kernel (the environment read once a run, not once a product): :meth:`Kernel.hot
    <nnef_kv.kernels.Kernel.hot>`. Until the kernel first ran they go through its wrapper, which imports numba
    then (a run with no such product, an ``inspect`` check's, does not map numba and LLVM: about 56 MiB) and
    falls back to the reference if it cannot compile; later runs call the compiled core directly."""
    _FEW_ROWS[0] = rows_by_t.hot()


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity set where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


#: the environment variable naming the sessions' default ``threads`` (set by the CLI's ``--threads``, so that
#: worker processes inherit it)
THREADS_ENV = "NNEF_KV_THREADS"


def default_threads() -> int:
    """The session's default ``threads``: ``$NNEF_KV_THREADS`` when set (``nnef-kv --threads N``), else the
    usable CPUs, at most 2 (the splitter makes two halves)."""
    given = os.environ.get(THREADS_ENV)
    if given:
        from ...errors import InputError

        try:
            n = int(given)
        except ValueError:
            n = 0
        if n < 1:
            raise InputError(f"{THREADS_ENV}={given!r}: must be an integer >= 1")
        return n
    return min(2, usable_cpus())


def check_threads(threads: Any, what: str = "threads") -> int:
    """``threads`` as a positive int (None: :func:`default_threads`); one line naming ``what`` otherwise."""
    from ...errors import InputError

    if threads is None:
        return default_threads()
    if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or int(threads) < 1:
        raise InputError(f"{what} must be an integer >= 1, got {threads!r}")
    return int(threads)


class BlasThreads:
    """Holds BLAS's own thread pools at one thread while at least one run is inside (re-entrant, shared by
    threads: the first to enter saves the pools' counts, the last to leave puts them back). Uses
    threadpoolctl's controllers of the BLAS libraries already loaded (found once); without threadpoolctl
    it does nothing (``available`` is False)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._saved: list[tuple[Any, int]] = []
        self._libs: list[Any] | None = None

    def libraries(self) -> list[Any]:
        if self._libs is None:
            try:
                from threadpoolctl import ThreadpoolController
            except ImportError:
                self._libs = []
            else:
                self._libs = [c for c in ThreadpoolController().lib_controllers if c.user_api == "blas"]
        return self._libs

    @property
    def available(self) -> bool:
        return bool(self.libraries())

    def counts(self) -> list[int]:
        """The current thread count of each BLAS library found."""
        return [int(c.get_num_threads()) for c in self.libraries()]

    def __enter__(self) -> "BlasThreads":
        with self._lock:
            self._depth += 1
            if self._depth == 1:
                self._saved = []
                for c in self.libraries():
                    n = int(c.get_num_threads())
                    if n != 1:
                        c.set_num_threads(1)
                        self._saved.append((c, n))
        return self

    def __exit__(self, *exc: Any) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                for c, n in self._saved:
                    c.set_num_threads(n)
                self._saved = []


#: the process-wide BLAS hold the session takes around every run
BLAS = BlasThreads()


class LoadWatch:
    """Whether the CPUs a second thread needs are free of other processes: the 1-minute load average less
    this process's own busy threads (its CPU time over wall time, averaged over about the same minute), looked
    at most every ``interval`` seconds. Two threads are worth it only when, beside this process, fewer than
    ``cpus - 2 + 0.5`` CPUs' worth of other work is running (on 2 CPUs: the other core mostly idle). A fresh
    process's own use is first taken as its average since the watch was made (the module's import)."""

    def __init__(self, interval: float = 1.0) -> None:
        self.interval = interval
        self._lock = threading.Lock()
        self._t = time.monotonic()
        self._cpu = time.process_time()
        self._own: float | None = None
        self._free = False
        self._next = 0.0
        self.others = 0.0  # the last estimate of other processes' running threads

    def free(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return self._free
        with self._lock:
            cpu = time.process_time()
            span = max(now - self._t, 1e-6)
            use = min((cpu - self._cpu) / span, float(usable_cpus()))
            a = 1.0 if self._own is None else min(1.0, span / 60.0)
            own = (1 - a) * (self._own or 0.0) + a * use
            self._own = own
            self._t, self._cpu = now, cpu
            try:
                load = os.getloadavg()[0]
            except (AttributeError, OSError):  # no load average: trust the claimed helper's own back-off
                self._free, self._next = True, now + self.interval
                return True
            self.others = max(0.0, load - own)
            self._free = self.others < usable_cpus() - 2 + 0.5
            self._next = now + self.interval
        return self._free


#: the process-wide load watch of sessions left at the default ``threads`` (see :func:`run_threads`)
LOAD = LoadWatch()


def run_threads(threads: int, auto: bool) -> int:
    """The threads one run uses: ``threads``, except that a session left at the default (``auto``) runs on one
    thread while other processes hold the CPUs its second thread needs (:data:`LOAD`)."""
    if auto and threads > 1 and not LOAD.free():
        return 1
    return threads


__all__ = ["ColumnSplitter", "SPLITTER", "split_matmul", "gemv_on", "refresh", "MIN_ROWS_SPLIT_BYTES", "split_worth",
           "halves", "MIN_SPLIT_BYTES", "MIN_SPLIT_WORK",
           "BLAS", "BlasThreads", "default_threads", "check_threads", "usable_cpus",
           "THREADS_ENV", "LOAD", "LoadWatch", "run_threads"]


def _after_fork_in_child() -> None:
    """A forked child (compare's workers, :mod:`nnef_kv.validate.jobs`) has none of its parent's threads: the
    splitter's helper starts anew when first needed, and every lock here is a fresh one."""
    SPLITTER.__init__()  # type: ignore[misc]
    BLAS._lock, BLAS._depth, BLAS._saved = threading.Lock(), 0, []
    LOAD._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
