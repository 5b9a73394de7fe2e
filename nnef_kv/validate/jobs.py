"""Running independent measuring jobs (one per KV scheme, one per auto-bits candidate): a local process
pool (``--jobs N``, default the cores) or a Ray cluster (``--ray ADDRESS`` / ``auto``; ``ray`` is the
optional extra ``pip install -e ".[ray]"``). The shared input (the f32 model, the token ids, the
reference runs) goes to each worker once: the pool's initializer, or Ray's object store (``ray.put``).
Both run every job in a worker with one BLAS/OpenMP thread, so both give the same numbers; results come
back in the order of the jobs. Progress (on a terminal): one bar per job and an overall bar with its ETA.

The pool's workers are *forked* where the system can (Linux, macOS) and nothing makes it unsafe (numba's
threading layer not started here): each worker inherits the shared input as it is in this process, the
model's weights (memory-mapped from a ``.tar`` or a folder, or read from a ``.tgz``) and the fused
projections the reference's plan made, page for page, copy-on-write and never written, so ``--jobs N``
holds one copy of the weights, not N + 1 (issue 26, ``compare --jobs 2`` on SmolLM2-135M f32, 514 MiB: the
processes' PSS summed 800-815 MiB at its peak, 1.17-1.18x the largest process's RSS; before, spawned workers
each unpickling their own copy, 3189 MiB; docs/benchmarks.md). ``preload`` (``scipy.stats``) is imported before the
fork for the same reason. The threads a worker does not inherit (the session's splitter, the kernels' pools)
start anew in it (``os.register_at_fork`` in :mod:`nnef_kv.interpreter.plan.parallel` and
:mod:`nnef_kv.kv.kivi._jit`), and BLAS is held at one thread there. Elsewhere the workers are
*spawned* (a fresh interpreter each, the shared input pickled to it), so a script calling
:func:`~.compare.compare_model` or :func:`~.autobits.auto_bits` needs the usual
``if __name__ == "__main__":`` guard (the workers import the main module). ``$NNEF_KV_START_METHOD=spawn``
spawns them anywhere.
"""
from __future__ import annotations

import os
import queue as _queue
import threading
import time
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

from ..errors import InputError
from ..progress import progress_enabled

__all__ = ["run_tasks", "connect_ray", "shutdown_ray", "default_jobs", "start_method", "THREAD_ENV", "START_ENV",
           "Interrupted"]


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during :func:`run_tasks`: ``results`` holds the jobs finished before it (None for the others),
    ``where`` the runner's description; the jobs not finished are cancelled."""

    def __init__(self, results: list[Any], where: str) -> None:
        super().__init__("interrupted")
        self.results, self.where = results, where

#: the environment of every worker: one thread per BLAS / OpenMP / numba pool (the job is the unit of parallelism)
THREAD_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}

_SHARED: Any = None  # a pool worker's copy of the shared input
_QUEUE: Any = None


def default_jobs() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


@contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _init_worker(shared: Any, q: Any, forked: bool = False) -> None:
    global _SHARED, _QUEUE
    _SHARED, _QUEUE = shared, q
    if forked:  # BLAS was loaded before the fork: THREAD_ENV came too late for it
        try:
            from threadpoolctl import threadpool_limits
        except ImportError:  # pragma: no cover - a dependency of the package
            return
        threadpool_limits(1)


#: the environment variable choosing how the local pool starts its workers ("fork" or "spawn")
START_ENV = "NNEF_KV_START_METHOD"


def start_method() -> str:
    """``fork`` (the workers share this process's pages: the model's weights are one copy) where the system has
    it and numba's threading layer has not been started in this process (forking it is not safe), else
    ``spawn``; ``$NNEF_KV_START_METHOD`` chooses."""
    import multiprocessing as mp
    import sys

    given = os.environ.get(START_ENV, "").strip().lower()
    methods = mp.get_all_start_methods()
    if given:
        if given not in ("fork", "spawn") or given not in methods:
            raise InputError(f"{START_ENV}={given!r}: one of {', '.join(m for m in ('fork', 'spawn') if m in methods)}")
        return given
    par = sys.modules.get("numba.np.ufunc.parallel")
    if "fork" not in methods or getattr(par, "_is_initialized", False):
        return "spawn"
    return "fork"


def _pool_task(fn: Callable[..., Any], index: int, item: Any) -> Any:
    q = _QUEUE
    tick = (lambda: q.put((index, 1))) if q is not None else None
    return fn(_SHARED, item, tick)


def _ray_task(fn: Callable[..., Any], shared: Any, index: int, item: Any, q: Any) -> Any:
    tick = (lambda: q.put((index, 1))) if q is not None else None
    return fn(shared, item, tick)


class _Bars:
    """One rich bar per job and an overall bar (ETA), fed by ``(job, steps)`` messages from a queue."""

    def __init__(self, labels: list[str], steps: int, q: Any, title: str) -> None:
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)
        import sys

        self.q, self.steps = q, steps
        self.prog = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                             TextColumn("ETA"), TimeRemainingColumn(), console=Console(file=sys.stderr), transient=True)
        self.total = self.prog.add_task(f"{title}: all {len(labels)} jobs", total=steps * len(labels))
        self.tasks = [self.prog.add_task(f"  {lab}", total=steps) for lab in labels]
        self.done = [0] * len(labels)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                i, n = self.q.get(timeout=0.2)
            except (_queue.Empty, EOFError, OSError):
                continue
            except Exception:  # ray's queue raises its own Empty
                continue
            n = min(n, self.steps - self.done[i])
            if n > 0:
                self.done[i] += n
                self.prog.advance(self.tasks[i], n)
                self.prog.advance(self.total, n)

    def finish(self, i: int) -> None:
        """Job ``i`` returned: its bar to the end (a failed job stops early)."""
        self.q.put((i, self.steps))

    def __enter__(self) -> "_Bars":
        self.prog.__enter__()
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        time.sleep(0.3)
        self.stop.set()
        self.thread.join()
        self.prog.__exit__(*exc)


def _ray_module() -> Any:
    try:
        import ray
    except ImportError:
        raise InputError("--ray: the ray package is not installed (pip install -e \".[ray]\")") from None
    return ray


def run_tasks(fn: Callable[[Any, Any, Callable[[], None] | None], Any], shared: Any, items: Sequence[Any],
              labels: Sequence[str], *, jobs: int | None = None, ray: str | None = None, steps: int = 1,
              show_progress: bool | None = None, title: str = "jobs",
              on_error: Callable[[Any, BaseException], Any] | None = None,
              keep_ray: bool = False, preload: Callable[[], None] | None = None) -> tuple[list[Any], str]:
    """``[fn(shared, item, tick) for item in items]``, run in parallel; returns the results (in order) and a
    description of where they ran. ``fn`` must be a module-level function (pickled by reference); it
    turns its own failures into results, and ``on_error(item, exc)`` gives the result of a job whose
    worker died (a crashed process, a lost Ray node) -- without it that error is raised. ``preload()`` runs here
    before the local pool's workers are forked (what every job would otherwise import on its own)."""
    items = list(items)
    show = progress_enabled() if show_progress is None else show_progress
    if ray is not None:
        return _run_ray(fn, shared, items, list(labels), ray, steps, show, title, on_error, keep_ray)
    n = max(1, min(jobs or default_jobs(), len(items) or 1))
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    method = start_method()
    if method == "fork" and preload is not None:
        preload()
    ctx = mp.get_context(method)
    q = ctx.Queue() if show else None
    results: list[Any] = [None] * len(items)
    with _env(THREAD_ENV), ProcessPoolExecutor(n, mp_context=ctx, initializer=_init_worker,
                                               initargs=(shared, q, method == "fork")) as ex:
        with warnings.catch_warnings():  # Python >= 3.12 warns of any fork of a threaded process (see the module doc)
            warnings.filterwarnings("ignore", message=".*multi-threaded.*fork", category=DeprecationWarning)
            futs = {ex.submit(_pool_task, fn, i, it): i for i, it in enumerate(items)}
        bars = _Bars(list(labels), steps, q, title) if show else None
        from concurrent.futures import as_completed

        if bars:
            bars.__enter__()
        where = f"local process pool ({n} {method}ed worker{'s' if n > 1 else ''}, one BLAS thread each)"
        try:
            for f in as_completed(futs):
                i = futs[f]
                try:
                    results[i] = f.result()
                except Exception as exc:  # the worker died (BrokenProcessPool ...): the job's result says so
                    if on_error is None:
                        raise
                    results[i] = on_error(items[i], exc)
                if bars:
                    bars.finish(i)
        except KeyboardInterrupt:  # Ctrl-C (in this process, or a worker's task): keep what is finished
            for f, i in futs.items():
                if results[i] is None and f.done() and not f.cancelled() and f.exception() is None:
                    results[i] = f.result()
            procs = list(getattr(ex, "_processes", {}).values())  # the pool's own workers
            ex.shutdown(wait=False, cancel_futures=True)
            for p in procs:
                p.terminate()
            raise Interrupted(results, where) from None
        finally:
            if bars:
                bars.__exit__(None, None, None)
    return results, where


_STARTED: set[str] = set()  # Ray runtimes this module started ("local" ones are shut down after the jobs)


def connect_ray(address: str) -> None:
    """Connect to (or, ``local``, start) Ray now, so that a cluster that cannot be reached is refused
    before any work; a runtime already initialised (``ray.init(...)`` by the caller) is used as it is."""
    ray = _ray_module()
    if ray.is_initialized():
        return
    try:
        ray.init(address=None if address == "local" else address, include_dashboard=False,
                 log_to_driver=False, ignore_reinit_error=True)
    except Exception as exc:  # a cluster that cannot be reached
        raise InputError(f"--ray {address}: cannot connect: {str(exc).splitlines()[0] if str(exc) else exc}") \
            from None
    _STARTED.add(address)


def _run_ray(fn: Callable[..., Any], shared: Any, items: list[Any], labels: list[str], address: str, steps: int,
             show: bool, title: str, on_error: Callable[[Any, BaseException], Any] | None,
             keep_ray: bool = False) -> tuple[list[Any], str]:
    ray = _ray_module()
    connect_ray(address)
    started = address in _STARTED
    q = None
    if show:
        from ray.util.queue import Queue

        q = Queue()
    try:
        ref = ray.put(shared)
        task = ray.remote(num_cpus=1)(_ray_task).options(runtime_env={"env_vars": dict(THREAD_ENV)})
        futs = [task.remote(fn, ref, i, it, q) for i, it in enumerate(items)]
        index = {f: i for i, f in enumerate(futs)}
        results: list[Any] = [None] * len(items)
        bars = _Bars(labels, steps, q, title) if show else None
        if bars:
            bars.__enter__()
        try:
            pending = list(futs)
            while pending:
                ready, pending = ray.wait(pending, num_returns=1)
                for f in ready:
                    try:
                        results[index[f]] = ray.get(f)
                    except Exception as exc:  # a crashed worker, a lost node
                        if on_error is None:
                            raise
                        results[index[f]] = on_error(items[index[f]], exc)
                    if bars:
                        bars.finish(index[f])
        finally:
            if bars:
                bars.__exit__(None, None, None)
        cpus = int(ray.cluster_resources().get("CPU", 0))
        where = "local" if address == "local" else address
        return results, f"ray ({where}, {cpus} CPUs in the cluster, one BLAS thread a task)"
    finally:
        if started and address == "local" and not keep_ray:
            ray.shutdown()
            _STARTED.discard(address)


def shutdown_ray(address: str | None) -> None:
    """Stop a ``local`` Ray runtime this module started (several runs kept it with ``keep_ray``)."""
    if address == "local" and address in _STARTED:
        _ray_module().shutdown()
        _STARTED.discard(address)
