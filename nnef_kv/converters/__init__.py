"""Converters: any decoder in, a quantized-KV archive out.

    model, report = nnef_kv.converters.convert("model.nnef.tgz", scheme="kivi", bits=4)
    report = nnef_kv.converters.convert_file("in.nnef.tgz", "out.nnef.tgz", scheme="tract")
    model = nnef_kv.converters.onnx_to_nnef("decoder.onnx")   # then convert(model, ...)

The schemes are :data:`nnef_kv.converters.schemes.SCHEMES`; the passes and the position-binding choice are
described in :mod:`.passes`; what a path may be (NNEF folder / archive / graph.nnef, ONNX) is
:mod:`.frontends`.
"""
from __future__ import annotations

from .convert import ConversionReport, convert, convert_file
from .options import SCHEMES, ConvertOptions
from .passes import PassReport

__all__ = ["convert", "convert_file", "ConversionReport", "PassReport", "ConvertOptions", "SCHEMES",
           "onnx_to_nnef"]


def __getattr__(name: str):  # the ONNX front end imports onnx/nnef_tools: only on use
    if name == "onnx_to_nnef":
        from .frontends.onnx import onnx_to_nnef

        return onnx_to_nnef
    raise AttributeError(f"module 'nnef_kv.converters' has no attribute {name!r}")
