"""The ONNX front end, now :mod:`nnef_kv.converters.frontends.onnx` (this name kept for imports)."""
from __future__ import annotations

from .frontends.onnx import OnnxImport, load, nnef_name, onnx_to_nnef

__all__ = ["OnnxImport", "load", "nnef_name", "onnx_to_nnef"]
