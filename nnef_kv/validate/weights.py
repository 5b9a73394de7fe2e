"""One copy of the weights for an archive and its reference (issue 26): ``validate`` checks that the archive's
weights are the reference's (a converter never changes a variable's tensor), then gives the archive the
reference's very arrays, so the archive's own copy is released and both sessions plan on the same arrays
(their fused projections are then one array too: :mod:`nnef_kv.interpreter.plan.weights`)."""
from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from ..errors import InputError

__all__ = ["check_same_model", "share_weights"]


def _tensor_digest(x: Any) -> tuple:
    """What identifies a tensor's value. A memory-mapped array's pages are released once read (the kernel
    keeps them in its page cache): hashing both archives does not hold both in this process at once."""
    from ..tensors.pages import release_pages

    if isinstance(x, np.ndarray):
        a = np.ascontiguousarray(x)
        got = ("array", str(a.dtype), tuple(a.shape), hashlib.sha256(a.view(np.uint8).reshape(-1)).hexdigest())
        release_pages(x)
        return got
    blocks = getattr(x, "blocks", None)
    if blocks is not None:  # block-quantized weights
        return (
            "blocks",
            tuple(getattr(x, "shape", ())),
            hashlib.sha256(np.ascontiguousarray(blocks).tobytes()).hexdigest(),
        )
    return ("other", repr(x)[:200])


def _pairs(model: Any, reference: Any, where: str) -> dict[str, str]:
    """Each of the archive's labels -> the label of a reference tensor equal to it (its own label when
    that one is equal); InputError naming the first that has none. The same object is equal without
    reading it; the reference's other tensors are hashed only when a label is not matched by its own."""
    mine = dict(getattr(model, "tensors", {}) or {})
    theirs = dict(getattr(reference, "tensors", {}) or {})
    ref_digests: dict[tuple, str] | None = None
    out: dict[str, str] = {}
    for label, t in sorted(mine.items()):
        r = theirs.get(label)
        if r is not None and r is t:
            out[label] = label
            continue
        dg = _tensor_digest(t)
        if r is not None and dg[0] != "other" and _tensor_digest(r) == dg:
            out[label] = label
            continue
        if ref_digests is None:
            ref_digests = {}
            for lab, x in theirs.items():
                ref_digests.setdefault(_tensor_digest(x), lab)
        if dg in ref_digests:
            out[label] = ref_digests[dg]
            continue
        if label in theirs:
            detail = f"its tensor '{label}' differs from the archive's"
        else:
            detail = f"it has no tensor equal to the archive's '{label}'"
        raise InputError(f"{where}: not the same model as the archive: {detail} (a converted archive keeps "
                         f"every weight of its source; --allow-different-weights compares anyway)")
    return out


def check_same_model(model: Any, reference: Any, where: str = "--reference") -> None:
    """InputError when the archive's weights are not all in the reference (the converter never changes
    a variable's tensor: a different tensor means a different model)."""
    _pairs(model, reference, where)


def _shareable(t: Any, r: Any) -> bool:
    if type(t) is not type(r):
        return False
    if isinstance(t, np.ndarray):  # equal digests: same dtype, shape and bytes; and neither more writable
        return t.flags.writeable == r.flags.writeable
    return getattr(t, "blocks", None) is not None and getattr(t, "format", None) == getattr(r, "format", None)


def share_weights(model: Any, reference: Any, where: str = "--reference") -> int:
    """:func:`check_same_model`, then each of the archive's tensors replaced by the reference's equal one
    (the same object); the archive's own pages are released when memory-mapped. Returns the bytes of the
    archive's tensors now shared (0 when they already were). Raises before changing anything."""
    from ..tensors.pages import release_pages

    pairs = _pairs(model, reference, where)
    tensors, theirs = model.tensors, reference.tensors
    shared = 0
    for label, rl in pairs.items():
        t, r = tensors[label], theirs[rl]
        if t is r or not _shareable(t, r):
            continue
        tensors[label] = r
        shared += int(getattr(t, "nbytes", 0))
        release_pages(t if isinstance(t, np.ndarray) else getattr(t, "blocks", None))
    return shared
