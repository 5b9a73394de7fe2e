"""Small pieces of the KIVI cache (:mod:`.kivi`): the view one attention call reads, the exact side
table of values kept out of the quantized groups, and the array helpers both use."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import StateError
from ..common import GrowBuffer, expect_state

__all__ = ["as32", "rotate", "finite_part", "View", "Outliers"]


def as32(a: np.ndarray) -> np.ndarray:
    """f32 view (no copy) or copy of a full-precision array."""
    return np.asarray(a, dtype=np.float32)


def rotate(x: np.ndarray, rot: np.ndarray) -> np.ndarray:
    """``x @ rot`` over the last axis, each output a fixed-order sum of products: a row's result does
    not depend on how many rows are rotated with it (BLAS's does), so a chunk stores the same bits as
    one-token calls."""
    out = x[..., 0:1] * rot[0]
    for j in range(1, rot.shape[0]):
        out += x[..., j:j + 1] * rot[j]
    return out


def finite_part(x: np.ndarray, offset: int):
    """``x [n, T, D]`` with its non-finite values set to 0, and ``(head, column, channel, value)`` of
    those values (column = ``offset`` + token), or None when all are finite."""
    bad = ~np.isfinite(x)
    if not bad.any():
        return x, None
    h, t, c = np.nonzero(bad)
    return np.where(bad, np.float32(0), x), (h, t + offset, c, x[h, t, c])


@dataclass(frozen=True)
class View:
    """What one attention call reads: the full-precision sinks and window (storage dtype,
    ``[n, tokens, D]``), the first ``tq`` quantized tokens of the buffers, and ``total`` positions in
    all (``sinks + tq + window``; the last ``Sq`` are the call's queries)."""

    sink_k: np.ndarray
    sink_v: np.ndarray
    res_k: np.ndarray
    res_v: np.ndarray
    tq: int
    total: int

    @property
    def ns(self) -> int:
        return int(self.sink_k.shape[1])

    @property
    def nr(self) -> int:
        return int(self.res_k.shape[1])


class Outliers:
    """Exact side table of values kept out of the quantized groups: (head, position, channel, value)."""

    def __init__(self) -> None:
        self.head = GrowBuffer((), (), np.int32, min_chunk=16)
        self.pos = GrowBuffer((), (), np.int64, min_chunk=16)
        self.chan = GrowBuffer((), (), np.int32, min_chunk=16)
        self.val = GrowBuffer((), (), np.float32, min_chunk=16)

    def add(self, head: np.ndarray, pos: np.ndarray, chan: np.ndarray, val: np.ndarray) -> None:
        if head.size:
            self.head.append(head.astype(np.int32))
            self.pos.append(pos.astype(np.int64))
            self.chan.append(chan.astype(np.int32))
            self.val.append(val.astype(np.float32))

    def __len__(self) -> int:
        return self.head.len

    def drop_front(self, count: int) -> None:
        """The first ``count`` positions left the cache (a sliding window): their entries go, the others'
        positions move down by ``count`` (new arrays: a checkpoint's marks stay valid)."""
        if not len(self):
            return
        pos = self.pos.view()
        keep = pos >= count
        self.head.set_exact(self.head.view()[keep])
        self.pos.set_exact(pos[keep] - count)
        self.chan.set_exact(self.chan.view()[keep])
        self.val.set_exact(self.val.view()[keep])

    def in_range(self, p0: int, p1: int):
        pos = self.pos.view()
        sel = np.nonzero((pos >= p0) & (pos < p1))[0]
        return self.head.view()[sel], pos[sel], self.chan.view()[sel], self.val.view()[sel]

    @property
    def nbytes(self) -> int:
        return self.head.nbytes + self.pos.nbytes + self.chan.nbytes + self.val.nbytes

    def arrays(self, prefix: str) -> dict[str, np.ndarray]:
        return {f"{prefix}_head": self.head.view().copy(), f"{prefix}_pos": self.pos.view().copy(),
                f"{prefix}_chan": self.chan.view().copy(), f"{prefix}_val": self.val.view().copy()}

    def load(self, tensors: dict[str, np.ndarray], prefix: str, who: str, n: int, tq: int, d: int) -> None:
        h = expect_state(tensors, f"{prefix}_head", None, np.int32, who)
        cnt = h.shape[0] if h.ndim == 1 else -1
        p = expect_state(tensors, f"{prefix}_pos", (cnt,), np.int64, who)
        c = expect_state(tensors, f"{prefix}_chan", (cnt,), np.int32, who)
        v = expect_state(tensors, f"{prefix}_val", (cnt,), np.float32, who)
        if h.ndim != 1 or (cnt and (h.min() < 0 or h.max() >= n or p.min() < 0 or p.max() >= tq
                                   or c.min() < 0 or c.max() >= d)):
            raise StateError(f"{who}: side table {prefix} holds entries outside the cache")
        self.head.set_exact(h)
        self.pos.set_exact(p)
        self.chan.set_exact(c)
        self.val.set_exact(v)
