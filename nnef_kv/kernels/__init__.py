"""numba kernels for the few operations NumPy cannot run at memory speed, each beside a NumPy reference.

Every kernel is a :class:`Kernel`: a plain NumPy **reference** function and a **numba** function with the
same signature (a Python wrapper that checks and allocates, around ``@njit(cache=True, nogil=True)``
cores). Calling the kernel runs the numba function when :func:`numba_available` says so, else the
reference. ``kernel.reference`` / ``kernel.jit`` call one side explicitly (the differential tests do).

Nothing here imports numba at ``import nnef_kv`` time: the numba side lives in modules named
``_*_jit.py`` that are imported on the first call of a kernel (that import, and the first call of each
core, compiles or loads the on-disk cache of the numba functions, ``cache=True``).

``NNEF_KV_NO_NUMBA=1`` in the environment forces the NumPy references (the "forced fallback" of tests
and CI); it is read at every call, so a test can flip it. A kernel numba cannot build on a platform (its
``_*_jit`` module fails to import, numba or LLVM raise while compiling) falls back to its reference for
the rest of the process, with one RuntimeWarning (``Kernel.broken`` says why).

Kernels:

* :mod:`nnef_kv.kernels.blockquant`: Q4_0 / Q8_1 weight products kept as blocks (``repack``,
  ``matvec``, ``matmul``; ``y = x @ W.T`` with ``W`` ``[N, K]`` as stored by tract).
* :mod:`nnef_kv.kernels.gemv`: products of a few rows by an f32 weight (a decode step's).
* :mod:`nnef_kv.kernels.attend`: a decode step's exact f32 attention in one call; a prefill block's softmax.
* :mod:`nnef_kv.kernels.gate`: SwiGLU's gate ``g * sigmoid(g) * u`` in one pass.
* :mod:`nnef_kv.kernels.rowwise`: RMS norm and rotate-half RoPE rows, bit for bit NumPy's.
* :mod:`nnef_kv.kv.kivi.kernels`: the KIVI decode-step attention on packed codes
  (``key_scores``, ``value_sum``, ``decode_attention``, ``attend``).
"""
from __future__ import annotations

import importlib
import os
import warnings
from typing import Any, Callable

__all__ = ["numba_available", "numba_installed", "Kernel", "kernel", "NO_NUMBA_ENV", "compile_seconds"]

NO_NUMBA_ENV = "NNEF_KV_NO_NUMBA"

#: called once a process, with "compiling kernels, once per machine", before the first call of a kernel whose
#: numba module has no on-disk cache newer than its source (the command line prints it on stderr)
on_compile: Callable[[str], None] | None = None
_compile_time = [0.0]  # seconds spent in first calls that compiled (the command line leaves them out of tok/s)


def compile_seconds() -> float:
    """Seconds this process spent in the first calls of kernels that had no usable on-disk cache."""
    return _compile_time[0]


_cold: dict[str, bool] = {}  # module -> its cache was cold when this process first looked


def _cache_cold(jit_path: str) -> bool:
    """No numba cache index (``*.nbi``) of the kernel's module newer than its source when the process first
    looked (the module's first kernel call writes some): its kernels' first calls compile."""
    mod = jit_path.partition(":")[0]
    if mod not in _cold:
        _cold[mod] = _no_fresh_index(mod)
    return _cold[mod]


def _no_fresh_index(mod: str) -> bool:
    import importlib.util
    from pathlib import Path

    try:
        spec = importlib.util.find_spec(mod)
        src = Path(spec.origin) if spec is not None and spec.origin else None
        if src is None:
            return False
        stamp = src.stat().st_mtime
        found = list((src.parent / "__pycache__").glob(f"{src.stem}.*.nbi"))
        if os.environ.get("NUMBA_CACHE_DIR"):
            found += list(Path(os.environ["NUMBA_CACHE_DIR"]).rglob(f"{src.stem}.*.nbi"))
        return not any(p.stat().st_mtime >= stamp for p in found)
    except (OSError, ImportError, ValueError):
        return False


_numba_ok: bool | None = None  # None: not tried yet

try:  # os.environ's own mapping of encoded names to encoded values (CPython's os._Environ)
    _ENV_DATA: Any = os.environ._data  # type: ignore[attr-defined]
    _ENV_KEY = os.environ.encodekey(NO_NUMBA_ENV)  # type: ignore[attr-defined]
    _ENV_DECODE = os.environ.decodevalue  # type: ignore[attr-defined]
except AttributeError:  # pragma: no cover - another os.environ
    _ENV_DATA = None


def _numba_off() -> bool:
    """``NNEF_KV_NO_NUMBA=1`` in the environment now. Read from os.environ's own dict: ``os.environ.get`` encodes
    the name and decodes the value on every call (1.4 us here), and a decode step asks about 180 times
    (:meth:`Kernel.hot`); ``os.environ[...] = `` and ``del`` (and pytest's monkeypatch) update that dict."""
    if _ENV_DATA is not None:
        raw = _ENV_DATA.get(_ENV_KEY)
        return raw is not None and _ENV_DECODE(raw).strip() == "1"
    return os.environ.get(NO_NUMBA_ENV, "").strip() == "1"


def numba_available() -> bool:
    """True when the numba kernels are used: numba imports and ``NNEF_KV_NO_NUMBA`` is not ``1``.

    numba is imported on the first call (not at import of nnef_kv); the result of that import is
    remembered, the environment variable is read every time."""
    global _numba_ok
    if _numba_off():
        return False
    if _numba_ok is None:
        try:
            import numba  # noqa: F401
        except Exception:  # absent, or broken (e.g. built against another NumPy)
            _numba_ok = False
        else:
            _numba_ok = True
    return _numba_ok


def numba_installed() -> bool:
    """What :func:`numba_available` will say, without importing numba when it has not been tried yet (the
    package is found on the path): for decisions taken at plan time, so that loading a model does not map
    numba and LLVM (64 MiB of the process's memory, measured) before a kernel runs. A numba that is found
    but fails to import is found out at the first kernel call, which then runs the NumPy reference (the
    same results, its speed)."""
    if _numba_off():
        return False
    if _numba_ok is not None:
        return _numba_ok
    import importlib.util

    try:
        return importlib.util.find_spec("numba") is not None
    except (ImportError, ValueError):  # pragma: no cover - a broken entry on the path
        return False


class Kernel:
    """A NumPy reference and a numba implementation of one operation, with the same signature.

    ``jit_path`` is ``"module:function"``; the module is imported on first use. ``core``: the name, in that
    module, of the compiled core the numba function calls after its checks (see :meth:`hot`)."""

    def __init__(self, reference: Callable[..., Any], jit_path: str, core: str | None = None) -> None:
        self.reference = reference
        self.jit_path = jit_path
        self.core_name = core
        self._jit: Callable[..., Any] | None = None
        self._core: Callable[..., Any] | None = None
        self._called = False  # the first call of the numba side (in this process) is timed when it compiles
        #: why the numba side is not used any more in this process (it failed to import or compile), or None
        self.broken: str | None = None
        self.__name__ = reference.__name__
        self.__qualname__ = getattr(reference, "__qualname__", reference.__name__)
        self.__doc__ = reference.__doc__
        self.__module__ = reference.__module__
        self.__wrapped__ = reference

    @property
    def jit(self) -> Callable[..., Any]:
        """The numba implementation (imports numba and the kernel's ``_*_jit`` module)."""
        if self._jit is None:
            mod, _, attr = self.jit_path.partition(":")
            self._jit = getattr(importlib.import_module(mod), attr)
        return self._jit

    def hot(self) -> Any:
        """What a caller making many small calls (a plan's decode step) runs this time: None when the numba side
        is not used (numba absent or off, or it failed here: the caller runs its own NumPy form); the kernel
        itself until its first call ran (that call imports numba, compiles or loads numba's cache, and falls
        back to the reference if it cannot: asking imports nothing, :func:`numba_installed`); then the compiled
        core named ``core`` (no wrapper, no checks: the caller checked the arguments, in the core's own
        signature)."""
        if self.broken is not None or not numba_installed():
            return None
        if not self._called:
            return self
        if self._core is None:
            mod = self.jit_path.partition(":")[0]
            self._core = getattr(importlib.import_module(mod), self.core_name or "")
        return self._core

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if numba_available() and self.broken is None:
            try:
                if not self._called:
                    return self._first_call(*args, **kwargs)
                return self.jit(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - sorted below: compilation failures fall back
                if not _compile_failure(exc):
                    raise
                self.broken = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                warnings.warn(f"nnef_kv.kernels: {self.__name__}: numba could not compile it here "
                              f"({self.broken[:200]}); the NumPy reference runs instead", RuntimeWarning,
                              stacklevel=2)
        return self.reference(*args, **kwargs)

    def _first_call(self, *args: Any, **kwargs: Any) -> Any:
        import time

        global on_compile
        cold = _cache_cold(self.jit_path)
        if cold and on_compile is not None:
            say, on_compile = on_compile, None  # once a process
            say("compiling kernels, once per machine")
        t0 = time.perf_counter()
        try:
            return self.jit(*args, **kwargs)
        finally:
            self._called = True
            if cold:
                _compile_time[0] += time.perf_counter() - t0

    def __repr__(self) -> str:
        return f"<kernel {self.__module__}.{self.__name__} (numba: {self.jit_path})>"


def _compile_failure(exc: BaseException) -> bool:
    """``exc`` says numba (or LLVM through llvmlite) could not build the kernel on this platform, as opposed
    to an error of the arguments, which the reference would raise too: numba's own errors, an import
    failure of the ``_*_jit`` module, llvmlite's errors."""
    if isinstance(exc, ImportError):
        return True
    mod = type(exc).__module__ or ""
    return mod.startswith(("numba", "llvmlite"))


def kernel(jit_path: str, core: str | None = None) -> Callable[[Callable[..., Any]], Kernel]:
    """Decorator: the decorated NumPy function becomes the reference of a :class:`Kernel` whose numba
    side is ``jit_path`` (``"module:function"``, same signature); ``core``: see :class:`Kernel`."""
    def wrap(reference: Callable[..., Any]) -> Kernel:
        return Kernel(reference, jit_path, core)
    return wrap
