"""Front ends: what ``convert`` and ``nnef-kv convert`` read, recognised from the path.

    fe = detect(path)      # a FrontEnd, or None when nothing recognises the path
    model = load(path)     # the model, or one line naming the file and the accepted kinds

:data:`FRONTENDS` (name -> :class:`~.base.FrontEnd`), in the order they are asked: a folder goes to
the first front end that reads folders, then a file to the first that claims its name (suffix or
exact name), then to the first whose ``sniff`` accepts its first bytes. Today: ``nnef``
(:mod:`.nnef`: folder, .tar, .tgz, graph.nnef), ``onnx`` (:mod:`.onnx`: nnef-tools with the
sequence lengths kept symbolic) and ``gguf`` (:mod:`.gguf`: llama.cpp's files, with their tokenizer).
A new front end is one module defining ``FRONTEND`` and one entry
here.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ...errors import ArchiveError, ConversionError
from . import gguf as _gguf
from . import nnef as _nnef
from . import onnx as _onnx
from .base import FrontEnd

__all__ = ["FrontEnd", "FRONTENDS", "detect", "load", "accepted"]

FRONTENDS: dict[str, FrontEnd] = {"nnef": _nnef.FRONTEND, "onnx": _onnx.FRONTEND, "gguf": _gguf.FRONTEND}

SNIFF_BYTES = 512


def accepted() -> str:
    """The kinds of input the front ends read, for messages."""
    return "; ".join(fe.kinds for fe in FRONTENDS.values())


def detect(path: str | os.PathLike) -> FrontEnd | None:
    """The front end that reads ``path``, or None."""
    p = Path(path)
    if p.is_dir():
        return next((fe for fe in FRONTENDS.values() if fe.folder), None)
    named = next((fe for fe in FRONTENDS.values() if fe.claims_name(p)), None)
    if named is not None or not p.is_file():
        return named
    try:
        with open(p, "rb") as f:
            head = f.read(SNIFF_BYTES)
    except OSError:
        return None
    return next((fe for fe in FRONTENDS.values() if fe.sniff is not None and fe.sniff(head)), None)


def load(path: str | os.PathLike, **options: Any) -> Any:
    """Read ``path`` with its front end. Raises one line naming the file: no such file, not a kind any
    front end reads (listing the accepted kinds), or the front end's own error. ``options`` (None values
    ignored) go to front ends that take them (:attr:`FrontEnd.options`); another front end refuses them."""
    from ...targets import path_arg

    where = path_arg(path, "convert", "the path of a model")
    fe = detect(where)
    if fe is None:
        if not os.path.exists(where):
            raise ArchiveError(f"{where}: no such file or folder")
        from ...io.sniff import describe_file

        what = describe_file(where) if os.path.isfile(where) else None
        raise ConversionError(f"{where}: {what + '; ' if what else ''}not a model nnef-kv reads (accepted: "
                              f"{accepted()})")
    given = {k: v for k, v in options.items() if v is not None}
    wrong = [k for k in given if k not in fe.options]
    if wrong:
        raise ConversionError(f"{where}: {fe.kinds}; --{wrong[0].replace('_', '-')} applies to "
                              + " or ".join(f.kinds for f in FRONTENDS.values() if wrong[0] in f.options) + " only")
    return fe.load(Path(where), **given)
