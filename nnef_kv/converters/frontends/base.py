"""What a front end is: how its inputs are recognised, and how one is read into an NNEF model."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


@dataclass(frozen=True)
class FrontEnd:
    """One kind of input ``convert`` and the CLI accept.

    Recognised (:func:`nnef_kv.converters.frontends.detect`) as a folder (``folder``), by its file name
    (``names``, exact; ``suffixes``, lower case), or by its first bytes (``sniff``); ``load(path)``
    returns a :class:`~nnef_kv.Model` (f32 graph, KV caches as the exporter wrote them) or raises a
    one-line :class:`~nnef_kv.errors.NnefKvError` naming the file."""

    name: str
    kinds: str  # what it reads, for messages ("an .onnx file")
    load: Callable[[Path], Any]
    suffixes: tuple[str, ...] = ()
    names: tuple[str, ...] = ()
    folder: bool = False
    sniff: Callable[[bytes], bool] | None = None
    #: keyword options ``load`` takes (``convert --weights`` for GGUF); others are refused by name
    options: tuple[str, ...] = ()

    def claims_name(self, path: Path) -> bool:
        low = path.name.lower()
        return path.name in self.names or any(low.endswith(s) for s in self.suffixes)
