"""Small shared pieces of the KV caches: rounding, growable buffers, state validation."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import GraphError, InputError, StateError
from ..core.registry import KvState

__all__ = ["round_half_away", "GrowBuffer", "BufferCheckpoint", "KvState", "as_f32", "f16_to_f32", "expect_state",
           "check_qkv", "stepwise_loop", "causal_keep", "evict_page", "evicted_tokens"]


def round_half_away(x: np.ndarray) -> np.ndarray:
    """Round half away from zero (Rust ``f32::round``), exactly, keeping the dtype.

    ``np.round`` rounds half to even; ``floor(x + 0.5)`` is wrong for 0.49999997. ``x - trunc(x)`` is
    exact in binary floating point, so comparing it with 0.5 is exact too.
    """
    t = np.trunc(x)
    frac = x - t
    return t + np.where(np.abs(frac) >= 0.5, np.sign(x), 0).astype(x.dtype)


def as_f32(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


_F16_MASK = np.int32(-0x70000001)  # 0x8FFFFFFF: keeps the sign bit, clears bits 28..30
_F16_SCALE = np.float32(2.0 ** 112)  # 2 ** (127 - 15): f16 exponent bias -> f32 exponent bias


def _subnormals_kept() -> bool:
    """False when the thread flushes f32 subnormal inputs/results to zero (DAZ/FTZ set by some library)."""
    return bool(np.float32(1e-45) * np.float32(2.0) != 0)


def f16_to_f32(a: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Exact f32 values of *finite* f16 ``a`` (any strides), faster than NumPy's f16 cast.

    NumPy's ``float16 -> float32`` cast is a scalar loop; this is four
    vectorised integer/float passes: the int16 bits sign-extended and shifted by 13 put the f16
    exponent and mantissa in the f32 fields (bits 28..30 cleared, the sign kept in bit 31), which reads
    as ``x * 2**-112`` -- exactly, subnormals included -- and one multiplication by ``2**112`` (exact)
    gives ``x``. Inf/NaN would come out finite: callers only pass finite params. Falls back to the plain
    cast when the thread flushes subnormals (the trick relies on them).
    """
    a = np.asarray(a)
    if a.dtype != np.float16:
        raise TypeError(f"f16_to_f32 needs float16, got {a.dtype}")
    if out is None:
        out = np.empty(a.shape, np.float32)
    if not _subnormals_kept():
        np.copyto(out, a, casting="same_kind")
        return out
    bits = out.view(np.int32)
    np.copyto(bits, a.view(np.int16))  # sign-extending widening
    np.multiply(bits, np.int32(1 << 13), out=bits)  # |h| * 2**13 <= 2**28: no overflow
    np.bitwise_and(bits, _F16_MASK, out=bits)
    np.multiply(out, _F16_SCALE, out=out)
    return out


class GrowBuffer:
    """An array that grows along ``axis``; ``nbytes`` counts the whole allocated capacity.

    The new capacity is ``max(needed rounded up to min_chunk, ceil(capacity * growth), needed + headroom)``:
    with ``growth > 1`` appends are amortised O(1) and unused capacity is at most a ``growth - 1`` fraction;
    with ``growth = 1`` the buffer grows by whole chunks (pages) and wastes less than one chunk. ``zeroed``:
    new capacity is zero-filled (else left uninitialised: nothing reads past ``len``).

    No operation writes below ``len`` in the array it holds: appends write past it (or into a new,
    larger array), ``drop_front`` and ``set_exact`` move to a new array. So :meth:`mark` (the array and
    the length, O(1)) and :meth:`restore` undo any sequence of operations: the O(1) checkpoint of the
    quantized KV caches.
    """

    def __init__(self, lead: tuple[int, ...], tail: tuple[int, ...], dtype: np.dtype | type,
                 *, growth: float = 1.25, min_chunk: int = 64, headroom: int = 0, zeroed: bool = True) -> None:
        self.lead = tuple(lead)
        self.tail = tuple(tail)
        self.dtype = np.dtype(dtype)
        self.growth = growth
        self.min_chunk = min_chunk
        self.headroom = headroom
        self._new = np.zeros if zeroed else np.empty
        self._lead = (slice(None),) * len(self.lead)  # index prefix reaching the growing axis
        self.len = 0
        self.data = np.zeros(self.lead + (0,) + self.tail, dtype=self.dtype)

    @property
    def axis(self) -> int:
        return len(self.lead)

    @property
    def capacity(self) -> int:
        return self.data.shape[self.axis]

    def reserve(self, total: int) -> None:
        if total <= self.capacity:
            return
        chunked = -(-total // self.min_chunk) * self.min_chunk
        new_cap = max(chunked, int(np.ceil(self.capacity * self.growth)), total + self.headroom)
        new = self._new(self.lead + (new_cap,) + self.tail, dtype=self.dtype)
        if self.len:
            new[self._sl(0, self.len)] = self.data[self._sl(0, self.len)]
        self.data = new

    def _sl(self, a: int, b: int) -> tuple:
        return self._lead + (slice(a, b),)

    def append(self, items: np.ndarray) -> None:
        n = self.len
        k = items.shape[len(self._lead)]
        if n + k > self.data.shape[len(self._lead)]:
            self.reserve(n + k)
        self.data[self._lead + (slice(n, n + k),)] = items
        self.len = n + k

    def view(self, a: int = 0, b: int | None = None) -> np.ndarray:
        return self.data[self._lead + (slice(a, self.len if b is None else b),)]

    def drop_front(self, k: int) -> None:
        """Remove the first ``k`` items (into a new array of the same capacity: a mark stays valid)."""
        if k == 0:
            return
        rest = self.len - k
        new = self._new(self.data.shape, dtype=self.dtype)
        new[self._sl(0, rest)] = self.data[self._sl(k, self.len)]
        self.data = new
        self.len = rest

    def mark(self) -> tuple[np.ndarray, int]:
        """O(1): what :meth:`restore` needs to put the buffer back as it is now."""
        return self.data, self.len

    def restore(self, mark: tuple[np.ndarray, int]) -> None:
        self.data, self.len = mark

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def used_nbytes(self) -> int:
        """Bytes of the ``len`` items written (the rest of :attr:`nbytes` is spare capacity)."""
        cap = self.capacity
        return int(self.data.nbytes // cap * self.len) if cap else 0

    def adopt(self, arr: np.ndarray) -> None:
        """Hold ``arr`` itself as the contents (capacity = its length): a fresh array of the buffer's dtype
        and shape that nothing else writes into (what :meth:`set_exact` copies, without the copy)."""
        if (type(arr) is not np.ndarray or arr.dtype != self.dtype or not arr.flags.c_contiguous
                or arr.shape[:self.axis] != self.lead or arr.shape[self.axis + 1:] != self.tail):
            self.set_exact(arr)
            return
        self.data = arr
        self.len = arr.shape[self.axis]

    def set_exact(self, arr: np.ndarray) -> None:
        """Replace contents by ``arr`` (capacity = its length), used when loading state."""
        arr = np.ascontiguousarray(arr, dtype=self.dtype)
        self.data = arr.copy()
        self.len = arr.shape[self.axis]


class BufferCheckpoint(KvState):
    """O(1) ``checkpoint()`` / ``rollback()`` for a KV state whose tensors live in :class:`GrowBuffer` s
    (listed by ``_buffers()``, empty while the state holds nothing) and in the attributes named by
    ``_CHECKPOINT_ATTRS`` (replaced by new objects, never written into). The session takes a checkpoint
    before each run and rolls back when the run fails; rolling back to an empty state is ``reset()``."""

    _CHECKPOINT_ATTRS: tuple[str, ...] = ("len",)

    def _buffers(self) -> list[GrowBuffer]:
        raise NotImplementedError

    def used_nbytes(self) -> int:
        """Bytes actually written: what :meth:`nbytes` counts (codes + params + full precision), less the
        spare capacity of the grow-only buffers (short caches hold pages they have not filled yet)."""
        nb = self.nbytes()  # type: ignore[attr-defined]
        held = int(nb.get("codes", 0) + nb.get("params", 0) + nb.get("full_precision", 0))
        return held - sum(b.nbytes - b.used_nbytes for b in self._buffers())

    def checkpoint(self) -> Any:
        bufs = self._buffers()
        if not bufs:
            return None
        return [getattr(self, a) for a in self._CHECKPOINT_ATTRS], [(b, b.data, b.len) for b in bufs]

    def rollback(self, token: Any) -> None:
        """Undo every token taken since :meth:`checkpoint` returned ``token``."""
        if token is None:
            self.reset()  # type: ignore[attr-defined]
            return
        values, marks = token
        for name, value in zip(self._CHECKPOINT_ATTRS, values):
            setattr(self, name, value)
        for buf, data, n in marks:
            buf.restore((data, n))


def expect_state(tensors: dict[str, np.ndarray], name: str, shape: tuple[int, ...] | None,
                 dtype: np.dtype | type, who: str) -> np.ndarray:
    """Fetch ``tensors[name]`` and check its dtype and (if given) shape, raising StateError."""
    if name not in tensors:
        raise StateError(f"{who}: state tensor {name!r} is missing")
    arr = np.asarray(tensors[name])
    if arr.dtype != np.dtype(dtype):
        raise StateError(f"{who}: state tensor {name!r} has dtype {arr.dtype}, expected {np.dtype(dtype)}")
    if shape is not None and tuple(arr.shape) != tuple(shape):
        raise StateError(f"{who}: state tensor {name!r} has shape {tuple(arr.shape)}, expected {tuple(shape)}")
    return arr


def check_qkv(who: str, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[int, int, int, int, int, int]:
    """Validate ``q [B,Hq,Sq,D]``, ``k, v [B,Hkv,Snew,D]``; return ``(B, Hq, Sq, Hkv, Snew, D)``."""
    for nm, t in (("q", q), ("k", k), ("v", v)):
        if t is None or np.ndim(t) != 4:
            raise InputError(f"{who}: {nm} must be a rank-4 [B, H, S, D] tensor, got shape {np.shape(t)}")
    b, hq, sq, d = q.shape
    bk, hkv, snew, dk = k.shape
    if v.shape != k.shape:
        raise InputError(f"{who}: k {k.shape} and v {v.shape} shapes differ")
    if bk != b or dk != d:
        raise InputError(f"{who}: q {q.shape} and k {k.shape} disagree on batch or head_dim")
    if hkv == 0 or hq % hkv:
        raise InputError(f"{who}: {hq} query heads is not a multiple of {hkv} kv heads")
    return b, hq, sq, hkv, snew, d


def expect_config_and_shape(tensors: dict[str, np.ndarray], who: str, config: np.ndarray, fields: str
                            ) -> np.ndarray:
    """A saved state's ``config`` (equal to this node's ``config``, else a StateError naming ``fields``, what
    its entries are) and its ``shape`` (5 int64: B, Hkv, D, tokens, f16 flag), which is returned."""
    cfg = expect_state(tensors, "config", None, np.int64, who)
    if not np.array_equal(cfg, config):
        raise StateError(f"{who}: saved state was made with config {cfg.tolist()} ({fields}), this node has "
                         f"{config.tolist()}")
    return expect_state(tensors, "shape", (5,), np.int64, who)


def start_call(state: Any, q: Any, k: Any, v: Any, check: Any = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[int, int, int, int, int, int], np.dtype]:
    """What every quantized-cache op does first on a call: ``q, k, v`` as arrays checked by :func:`check_qkv`
    (then ``check(dims, q, k, v)``, the op's own checks), the output dtype (f16 or f32 as ``q``, else f32),
    the state initialised on its first call (``state._init(B, Hkv, D, fp)``, fp = f16 when k and v both are,
    else f32) or checked against the cache it holds. Returns ``(q, k, v, dims, out dtype)``."""
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    dims = check_qkv(state.WHO, q, k, v)
    if check is not None:
        check(dims, q, k, v)
    b, hq, _, hkv, _, d = dims
    sinks = getattr(getattr(state, "cfg", None), "sink_logits", ())
    if sinks and len(sinks) != hq:
        raise GraphError(f"{state.WHO}: sink_logits holds {len(sinks)} logits, q has {hq} heads (one a query head)")
    out_dtype = q.dtype if q.dtype in (np.float16, np.float32) else np.dtype(np.float32)
    fp = np.dtype(np.float16) if k.dtype == np.float16 and v.dtype == np.float16 else np.dtype(np.float32)
    if not state._ready:
        state._init(b, hkv, d, fp)
    elif (b, hkv, d) != (state.b, state.hkv, state.d):
        raise InputError(f"{state.WHO}: k {k.shape} does not match the cache built for "
                         f"B={state.b}, Hkv={state.hkv}, D={state.d}")
    return q, k, v, dims, out_dtype


def sink_rows(sink_logits: tuple, hkv: int, heads: np.ndarray, group_of_row: np.ndarray) -> np.ndarray | None:
    """``[len(heads), len(group_of_row), 1]`` f32: the learned sink logit (GPT-OSS; one a query head, a softmax
    column no value reads) of each row of the kv heads ``heads`` (indices ``b * hkv + h``), row ``r`` being a
    query of query head ``h * group + group_of_row[r]``; None without sink logits."""
    if not sink_logits:
        return None
    per = np.asarray(sink_logits, np.float32).reshape(hkv, -1)  # [kv head, group]
    return per[np.asarray(heads) % hkv][:, np.asarray(group_of_row), None]


def check_sink_logits(who: str, sink_logits: tuple) -> None:
    if not all(np.isfinite(x) for x in sink_logits):
        raise GraphError(f"{who}: sink_logits must be finite, got {list(sink_logits)}")


def causal_keep(total: int, m: int, sq: int, is_causal: bool, window: int = 0) -> np.ndarray | None:
    """``[M, T]`` bools: the positions each of the ``m`` query rows sees when the call's ``sq`` queries are the
    last of ``total`` positions (row ``r`` is query ``r % sq``); None when nothing is masked (not causal, or
    a single query: the last position sees everything). ``window`` > 0: a sliding window too, the query at
    position ``p`` sees the positions in ``(p - window, p]`` (only relative positions matter: the columns
    may start anywhere after the tokens a window evicted)."""
    masked_below = window > 0 and total - sq + 1 > window  # the first query misses some position
    if not (is_causal and sq > 1) and not masked_below:
        return None
    qpos = (total - sq) + (np.arange(m) % sq)
    j = np.arange(total)[None, :]
    keep = j <= qpos[:, None] if (is_causal or window > 0) else np.ones((m, total), bool)
    if window > 0:
        keep &= j > qpos[:, None] - window
    return keep


def evict_page(window: int, unit: int = 1) -> int:
    """Tokens a sliding-window cache lets die before it drops them (a multiple of ``unit``, its group): dropping
    copies what is held into a new array (an O(1) checkpoint's mark stays valid), so it is done a page at a
    time, every ``max(64, window / 16)`` tokens, not at every token; what is held stays below
    ``window + page`` tokens (plus the state's full-precision part)."""
    want = max(64, window // 16)
    return unit * max(1, -(-want // unit))


def evicted_tokens(dead: int, stored: int, page: int) -> int:
    """How many of its first tokens a sliding-window store has dropped after a call: of the ``stored`` tokens
    that have reached the store (from the first position on), the ``dead`` first ones no future query sees;
    whole pages of them. A function of the two counts only, so the state after a run does not depend on how
    its tokens were split into calls."""
    return page * (max(0, min(dead, stored)) // page)
def softmax_numerators(s: np.ndarray, keep: np.ndarray | None) -> np.ndarray:
    """In place on the scores ``s [n, M, T]``: the positions outside ``keep`` (:func:`causal_keep`) masked,
    each row's max subtracted (the maxima replaced by 0 where not finite when some row's max is -inf or NaN:
    a row with every position masked gives zeros, not NaN), then exp. Returns ``s``, now the softmax
    numerators."""
    if keep is not None:
        s[..., ~keep] = -np.inf
    mx = s.max(axis=-1, keepdims=True)
    if not mx.min() > -np.inf:  # rows with every position masked
        mx = np.where(np.isfinite(mx), mx, np.float32(0))
    return np.exp(np.subtract(s, mx, out=s), out=s)


def stepwise_loop(state: Any, q: np.ndarray, k: np.ndarray, v: np.ndarray, axis: int = 2) -> np.ndarray:
    """``state(q, k, v)`` token by token along ``axis`` (one query row per new token), outputs
    concatenated: a fused attention op's stepwise run when its multi-token semantics differ."""
    q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    ax = axis % q.ndim
    n = k.shape[ax]
    if q.shape[ax] != n:
        raise InputError(f"a stepwise call needs one query row per new token, got {q.shape[ax]} queries for "
                         f"{n} tokens")
    if n <= 1:
        return state(q, k, v)
    lead = (slice(None),) * ax
    outs = [state(q[lead + (slice(i, i + 1),)], k[lead + (slice(i, i + 1),)], v[lead + (slice(i, i + 1),)])
            for i in range(n)]
    return np.concatenate(outs, axis=ax)
