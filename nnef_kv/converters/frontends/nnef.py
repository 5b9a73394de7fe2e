"""The NNEF front end: a model folder, a ``.tar`` / ``.tgz`` archive (any name, recognised by its
bytes), or a ``graph.nnef`` file (its folder is read, tensors included): :func:`nnef_kv.io.archive.load`."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .base import FrontEnd

GZIP_MAGIC = b"\x1f\x8b"


def _is_tar_or_gzip(head: bytes) -> bool:
    return head[:2] == GZIP_MAGIC or head[257:262] == b"ustar"


def load(path: Path) -> Any:
    from ...io.archive import GRAPH_NNEF, load as load_archive

    p = Path(path)
    if p.name == GRAPH_NNEF and p.is_file():
        return load_archive(p.parent)
    return load_archive(p)


FRONTEND = FrontEnd(name="nnef", kinds="an NNEF folder, .tar, .tgz or graph.nnef file", load=load,
                    suffixes=(".tar", ".tgz", ".tar.gz"), names=("graph.nnef",), folder=True, sniff=_is_tar_or_gzip)
