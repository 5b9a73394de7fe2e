"""Every operation nnef-kv knows, loaded: the op families register themselves when imported (one module
a family, each op's signature its registration, see :mod:`.registry`), and this module imports them all.

    prim = lookup("matmul")              # a Primitive, or None
    ops_with(role="kv-cache")            # names of the ops whose registration says so
"""
from __future__ import annotations

import importlib
from typing import Any

from ..core.registry import PRIMITIVES, Primitive

__all__ = ["lookup", "PRIMITIVES", "ops_with", "ops_having", "extensions_for", "FAMILIES"]

#: the modules that register operations: the interpreter's op families, then each KV state's own module
#: (a stateful op is registered on its state class, ``@stateful(SIGNATURE, ...)``)
FAMILIES = (
    "nnef_kv.interpreter.ops.nnef_std",
    "nnef_kv.interpreter.ops.tract_core",
    "nnef_kv.interpreter.ops.tract_core_signal",
    "nnef_kv.interpreter.ops.tract_transformers",
    "nnef_kv.interpreter.ops.tract_moe",
    "nnef_kv.kv.exact",
    "nnef_kv.kv.tract_fused",
    "nnef_kv.kv.tract_dyn_cache",
    "nnef_kv.kv.kivi.sdpa",
    "nnef_kv.kv.ggml_sdpa",
    "nnef_kv.kv.hf_quantized",
    "nnef_kv.kv.rotated.sdpa",
)
_loaded = False


def _load() -> None:
    global _loaded
    if not _loaded:
        for m in FAMILIES:
            importlib.import_module(m)
        _loaded = True


def lookup(name: str) -> Primitive | None:
    """The primitive registered under ``name``."""
    _load()
    return PRIMITIVES.get(name)


def ops_with(**query: Any) -> frozenset[str]:
    """Names of the registered ops whose registration has every ``attribute = value`` of ``query``
    (``ops_with(stateful=True)``, ``ops_with(role="kv-cache")``, ``ops_with(positional=True)``)."""
    _load()
    return frozenset(name for name, p in PRIMITIVES.items() if all(getattr(p, k) == v for k, v in query.items()))


def ops_having(fact: str) -> frozenset[str]:
    """Names of the registered ops declaring ``fact`` (a name of :data:`.registry.FACTS`)."""
    from ..core.registry import FACTS

    if fact not in FACTS:
        raise KeyError(f"{fact!r} is not a fact an op can declare ({', '.join(FACTS)})")
    _load()
    return frozenset(name for name, p in PRIMITIVES.items() if fact in p.facts)


def extensions_for(op: str) -> tuple[tuple[str, str], ...]:
    """The ``extension`` lines (name, argument) an archive using ``op`` declares, from its registration's
    ``registry``: none for the standard ops; ``nnef_kv`` for nnef-kv's own; ``tract_registry tract_core``
    then the op's registry for tract's (tract writes tract_core first: the graphs around a tract op use it)."""
    prim = lookup(op)
    if prim is None or prim.registry == "nnef":
        return ()
    if prim.registry == "nnef_kv":
        return (("nnef_kv", ""),)
    core = ("tract_registry", "tract_core")
    return (core,) if prim.registry == "tract_core" else (core, ("tract_registry", prim.registry))

