"""Kernels, one module per family. Importing this package registers every operation."""
from __future__ import annotations

import importlib

_MODULES = (
    "nnef_kv.interpreter.ops.nnef_std",
    "nnef_kv.interpreter.ops.tract_core",
    "nnef_kv.interpreter.ops.tract_core_signal",
    "nnef_kv.interpreter.ops.tract_transformers",
    "nnef_kv.kv.ops",
)

for _m in _MODULES:
    try:
        importlib.import_module(_m)
    except ModuleNotFoundError as exc:  # a family not written yet
        if exc.name != _m:
            raise
