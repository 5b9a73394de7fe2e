"""Archive round trip: read, write, read again; graph and every tensor identical; a second write gives the
same bytes (hashed as it is made: the second ``.tar`` is never put on disk)."""
from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["RoundTripResult", "check_round_trip"]


@dataclass
class RoundTripResult:
    ok: bool
    tensors: int = 0
    members: int = 0
    written_bytes: int = 0
    sha256: str = ""
    problems: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "tensors": self.tensors, "members": self.members, "written_bytes": self.written_bytes,
                "sha256": self.sha256, "problems": list(self.problems)}


def _same_tensor(a: Any, b: Any, chunk: int = 1 << 22) -> bool:
    """Bit-exact for floats (NaN payloads included), compared ``chunk`` bytes at a time (no temporary of a
    tensor's size); a memory-mapped array's pages are released once compared (the page cache keeps them)."""
    from ..tensors.pages import release_pages

    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.dtype.kind not in "fc":
            return bool(np.array_equal(a, b))
        a8 = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        b8 = np.ascontiguousarray(b).reshape(-1).view(np.uint8)
        same = all(np.array_equal(a8[i:i + chunk], b8[i:i + chunk]) for i in range(0, a8.size, chunk))
        release_pages(a)
        release_pages(b)
        return bool(same)
    return type(a) is type(b) and a == b


def _members_digests(model: Any) -> dict[str, str]:
    """Member name -> sha256 of the bytes :func:`~nnef_kv.io.archive.save` writes for it (one member at a time)."""
    from ..io.archive import model_members

    out = {}
    for name, parts in model_members(model).items():
        h = hashlib.sha256()
        for p in parts:
            m = memoryview(p)
            h.update(m.cast("B") if m.contiguous else m.tobytes())
        out[name] = h.hexdigest()
    return out


def _member_names(model: Any) -> list[str]:
    """The members a save writes, without encoding a tensor."""
    from ..io.archive import GRAPH_NNEF, GRAPH_QUANT

    names = [GRAPH_NNEF] + ([GRAPH_QUANT] if model.quantization is not None else [])
    return names + [label.lstrip("/") + ".dat" for label in model.tensors] + list(getattr(model, "resources", {}))


def check_round_trip(model: Any, workdir: str | os.PathLike | None = None) -> RoundTripResult:
    """Round trip ``model`` (as loaded) through a ``.tar`` in ``workdir`` (a temporary folder by default)."""
    from ..io.archive import load, save

    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="nnef_kv_roundtrip_", dir=workdir) as tmp:
        first = Path(tmp) / "first.nnef.tar"
        save(model, first)  # its writer gives each tensor's pages back once written (io/container.py)
        again = load(first)
        if again.document != model.document:
            problems.append("graph.nnef: the document read back differs from the one written")
        if (again.quantization is None) != (model.quantization is None) or (
                model.quantization is not None and again.quantization != model.quantization):
            problems.append("graph.quant: differs after the round trip")
        keys_a, keys_b = set(model.tensors), set(again.tensors)
        for k in sorted(keys_a - keys_b):
            problems.append(f"tensor {k!r}: missing after the round trip")
        for k in sorted(keys_b - keys_a):
            problems.append(f"tensor {k!r}: appeared after the round trip")
        for k in sorted(keys_a & keys_b):
            if not _same_tensor(model.tensors[k], again.tensors[k]):
                problems.append(f"tensor {k!r}: value, dtype or shape differs after the round trip")
        if set(getattr(model, "resources", {})) != set(getattr(again, "resources", {})) or any(
                model.resources[k] != again.resources[k] for k in model.resources if k in again.resources):
            problems.append("resources (non-tensor members) differ after the round trip")
        h1, h2 = _file_sha256(first), _tar_sha256(again)  # streamed: a model's size is never held twice
        if h1 != h2:
            m1, m2 = _members_digests(model), _members_digests(again)
            diff = sorted(n for n in set(m1) | set(m2) if m1.get(n) != m2.get(n))
            problems.append("second write differs from the first" + (f" (members {diff[:5]})" if diff else ""))
        return RoundTripResult(ok=not problems, tensors=len(model.tensors), members=len(_member_names(again)),
                               written_bytes=first.stat().st_size, sha256=h1, problems=problems)


class _HashSink:
    """A write-only file that keeps the sha256 of what is written (and its length, for ``tell``)."""

    def __init__(self) -> None:
        self.h, self.n = hashlib.sha256(), 0

    def write(self, data: Any) -> int:
        m = memoryview(data).cast("B")
        self.h.update(m)
        self.n += m.nbytes
        return m.nbytes

    def tell(self) -> int:
        return self.n

    def flush(self) -> None:
        pass


def _tar_sha256(model: Any) -> str:
    """The sha256 of the ``.tar`` :func:`~nnef_kv.io.archive.save` would write for ``model``, with nothing
    written: the same members, sorted, through the same tar writer (:func:`~nnef_kv.io.container.write_tar_stream`)."""
    from ..io.archive import model_members
    from ..io.container import write_tar_stream

    members = model_members(model)
    sink = _HashSink()
    write_tar_stream(sink, ((n, members[n]) for n in sorted(members)))  # type: ignore[arg-type]
    return sink.h.hexdigest()


def _file_sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
