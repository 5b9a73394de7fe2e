"""Archive round trip: read, write, read again; graph and every tensor identical; a second write gives the
same bytes."""
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


def _same_tensor(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.dtype.kind in "fc":
            return bool(
                np.array_equal(
                    np.ascontiguousarray(a).reshape(-1).view(np.uint8),
                    np.ascontiguousarray(b).reshape(-1).view(np.uint8),
                )
            )  # bit-exact, NaN payloads included
        return bool(np.array_equal(a, b))
    return type(a) is type(b) and a == b


def _members_bytes(model: Any) -> dict[str, bytes]:
    from ..io.archive import model_members

    return {name: b"".join(bytes(memoryview(p)) for p in parts) for name, parts in model_members(model).items()}


def check_round_trip(model: Any, workdir: str | os.PathLike | None = None) -> RoundTripResult:
    """Round trip ``model`` (as loaded) through a ``.tar`` in ``workdir`` (a temporary folder by default)."""
    from ..io.archive import load, save

    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="nnef_kv_roundtrip_", dir=workdir) as tmp:
        first = Path(tmp) / "first.nnef.tar"
        second = Path(tmp) / "second.nnef.tar"
        save(model, first)
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
        save(again, second)
        b1, b2 = first.read_bytes(), second.read_bytes()
        if b1 != b2:
            m1, m2 = _members_bytes(model), _members_bytes(again)
            diff = sorted(n for n in set(m1) | set(m2) if m1.get(n) != m2.get(n))
            problems.append("second write differs from the first" + (f" (members {diff[:5]})" if diff else ""))
        return RoundTripResult(ok=not problems, tensors=len(model.tensors), members=len(_members_bytes(again)),
                               written_bytes=len(b1), sha256=hashlib.sha256(b1).hexdigest(), problems=problems)
