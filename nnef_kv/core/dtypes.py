"""Datum type names as NNEF and tract write them -> NumPy dtypes.

tract's TDim (symbolic integer) is an ``int64`` here; its quantized types (``QU8(Z:..,S:..)``) map to their
storage type. Names are case-insensitive: torch-to-nnef writes ``'f32'``, tract ``"F32"``.
"""
from __future__ import annotations

import numpy as np

from ..errors import GraphError

_NAMES: dict[str, np.dtype] = {
    "f16": np.dtype(np.float16),
    "f32": np.dtype(np.float32),
    "f64": np.dtype(np.float64),
    "i8": np.dtype(np.int8),
    "i16": np.dtype(np.int16),
    "i32": np.dtype(np.int32),
    "i64": np.dtype(np.int64),
    "u8": np.dtype(np.uint8),
    "u16": np.dtype(np.uint16),
    "u32": np.dtype(np.uint32),
    "u64": np.dtype(np.uint64),
    "bool": np.dtype(np.bool_),
    "tdim": np.dtype(np.int64),
    "qu8": np.dtype(np.uint8),
    "qi8": np.dtype(np.int8),
    "qi32": np.dtype(np.int32),
}

#: NNEF generic type names (``external<scalar>``) -> dtype.
NNEF_TYPES: dict[str, np.dtype] = {
    "scalar": np.dtype(np.float32),
    "integer": np.dtype(np.int64),
    "logical": np.dtype(np.bool_),
}


def dtype_of(name: str, where: str = "") -> np.dtype:
    """The NumPy dtype of a datum type string (``'f32'``, ``"F16"``, ``'tdim'``, ``"QU8(Z:0,S:0.1)"``)."""
    if not isinstance(name, str):
        raise GraphError(f"{where}datum_type must be a string such as \"f32\", got {repr(name)[:60]}")
    key = name.strip().lower()
    if "(" in key:
        key = key.split("(", 1)[0].strip()
    try:
        return _NAMES[key]
    except KeyError:
        raise GraphError(f"{where}unknown datum type {name!r}") from None


def name_of(dtype: np.dtype) -> str:
    """The short tract name of a dtype (``float32`` -> ``f32``)."""
    dt = np.dtype(dtype)
    for k, v in _NAMES.items():
        if v == dt and k not in ("tdim", "qu8", "qi8", "qi32"):
            return k
    return str(dt)
