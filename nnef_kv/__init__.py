"""nnef-kv: NNEF model archives with a quantized KV cache, in pure Python.

The pipeline, one subpackage a stage::

    text --grammar--> AST --io--> Model (AST + tensors) --interpreter--> Session (runs, KV state)
                                     |                                      |
                                converters (rewrite graphs)            kv (quantized caches)

Public API::

    doc = nnef_kv.parse(text, filename="graph.nnef"); text = nnef_kv.dump(doc)
    quant = nnef_kv.parse_quant(text); text = nnef_kv.dump_quant(quant)
    model = nnef_kv.load(path); nnef_kv.save(model, path)
    array = nnef_kv.read_tensor(path_or_file); nnef_kv.write_tensor(path_or_file, array)
    session = model.session(); outputs = session.run({"input": x})
    report = nnef_kv.validate("k4.nnef.tgz", "f32.nnef.tgz", text="notes.txt", tokenizer="tokenizer.json")
"""
from __future__ import annotations

from typing import Any

from .errors import (
    ArchiveError,
    ArgumentError,
    ConversionError,
    GraphError,
    InputError,
    LimitError,
    NnefKvError,
    NnefSyntaxError,
    OutputError,
    StateError,
    TensorFileError,
    UnknownOpError,
)
from .limits import Limits

from ._version import __version__  # noqa: F401

_LAZY = {
    "parse": "nnef_kv.grammar",
    "dump": "nnef_kv.grammar",
    "parse_quant": "nnef_kv.grammar",
    "dump_quant": "nnef_kv.grammar",
    "read_tensor": "nnef_kv.tensors.dat",
    "write_tensor": "nnef_kv.tensors.dat",
    "load": "nnef_kv.io.archive",
    "save": "nnef_kv.io.archive",
    "Model": "nnef_kv.io.archive",
}
_MODULES = {"validate": "nnef_kv.validate"}  # a callable package: nnef_kv.validate(archive, reference, ...)

__all__ = [
    *_LAZY,
    "validate",
    "Limits",
    "NnefKvError",
    "NnefSyntaxError",
    "OutputError",
    "ArgumentError",
    "TensorFileError",
    "ArchiveError",
    "LimitError",
    "GraphError",
    "UnknownOpError",
    "InputError",
    "StateError",
    "ConversionError",
]


def __getattr__(name: str) -> Any:  # lazy imports keep `import nnef_kv` cheap
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _MODULES:
        import importlib

        return importlib.import_module(_MODULES[name])
    raise AttributeError(f"module 'nnef_kv' has no attribute {name!r}")
