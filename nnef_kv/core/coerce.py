"""Helpers shared by the kernels (tract op families, KV states): tract datum-type names, scalar coercion, axes.

tract passes many "integer" parameters as graph wires (``tract_core_range(P, P + 1, 1)``), so a
kernel may receive a Python int, a NumPy scalar or a one-element array for them: :func:`as_int`
accepts all three.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import GraphError


def parse_datum_type(name: str, *, where: str = "") -> np.dtype:
    """The NumPy dtype of a tract datum-type name (``"f32"``, ``"F32"``, ``"I64"``, ``"TDim"``, ...).

    Delegates to :func:`nnef_kv.core.dtypes.dtype_of` (one table for the whole package)."""
    hit = _DTYPES.get(name) if isinstance(name, str) else None
    if hit is not None:
        return hit
    from .dtypes import dtype_of

    dt = dtype_of(str(name), f"{where}: " if where else "")
    if isinstance(name, str) and len(_DTYPES) < 256:
        _DTYPES[name] = dt
    return dt


_DTYPES: dict[str, np.dtype] = {}


def as_int(value: Any, *, what: str = "value") -> int:
    """An integer from a Python int, a NumPy scalar or a one-element array (a tract wire)."""
    if type(value) is int:
        return value
    if isinstance(value, (bool, np.bool_)):
        return int(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    arr = np.asarray(value)
    if arr.size != 1:
        raise GraphError(f"{what} must be a single integer, got an array of shape {arr.shape}")
    item = arr.reshape(()).item()
    if isinstance(item, float) and not float(item).is_integer():
        raise GraphError(f"{what} must be an integer, got {item}")
    return int(item)


def as_float(value: Any, *, what: str = "value") -> float:
    """A float from a Python number, a NumPy scalar or a one-element array."""
    if type(value) is float:
        return value
    arr = np.asarray(value)
    if arr.size != 1:
        raise GraphError(f"{what} must be a single number, got an array of shape {arr.shape}")
    return float(arr.reshape(()).item())


def as_int_list(value: Any, *, what: str = "value") -> list[int]:
    """A list of integers from a list/tuple of ints (or wires) or a 1-D array."""
    if isinstance(value, (list, tuple)):
        return [as_int(v, what=what) for v in value]
    arr = np.asarray(value)
    return [int(v) for v in arr.reshape(-1)]


def norm_axis(axis: int, rank: int, *, what: str = "axis") -> int:
    """``axis`` in ``[0, rank)`` (negative axes count from the end)."""
    a = int(axis)
    if a < 0:
        a += rank
    if not 0 <= a < max(rank, 1):
        raise GraphError(f"{what} {axis} out of range for a tensor of rank {rank}")
    return a


def float_compute_dtype(dtype: np.dtype) -> np.dtype:
    """Where tract computes a float op: f16 and f32 inputs in f32, f64 in f64."""
    return _F64 if dtype == _F64 else _F32


_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)
