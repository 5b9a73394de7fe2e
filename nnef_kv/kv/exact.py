"""Exact attention and tract's full-precision KV states, on the buffers of :mod:`.common`.

* :func:`sdpa_array` -- scaled dot-product attention with grouped KV heads, computed in f32 (f64 for
  f64 accumulation), as tract's ``tract_transformers_sdpa`` (``FlashSdpaOp``) does;
* :class:`DynKvCache` -- ``tract_transformers_dyn_kv_cache``: each run appends its input to the cache and
  returns the whole cache;
* :class:`WindowKvSdpa` -- ``tract_transformers_window_kv_sdpa``: a cache of the last ``window`` K/V
  entries fused with attention.

Both states keep their entries in :class:`~.common.GrowBuffer` s (the one buffer implementation of every
KV state) and take O(1) checkpoints with :class:`~.common.BufferCheckpoint`. They are registered with the
interpreter in :mod:`nnef_kv.interpreter.ops.tract_transformers` (their op family).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from ..errors import GraphError, StateError
from ..core.coerce import as_float, norm_axis, parse_datum_type
from ..core.registry import stateful
from . import blocked
from .common import BufferCheckpoint, GrowBuffer, stepwise_loop

__all__ = ["causal_mask", "sdpa_array", "DynKvCache", "WindowKvSdpa"]


def causal_mask(q_len: int, kv_len: int) -> np.ndarray:
    """Boolean ``[q_len, kv_len]``, True where attention is allowed.

    Bottom-right aligned, as tract's ``wire_attention_mask``: query row ``i`` sits at absolute position
    ``P + i`` with ``P = kv_len - q_len`` and sees keys ``0..=P+i``."""
    past = kv_len - q_len
    rows = np.arange(q_len)[:, None]
    cols = np.arange(kv_len)[None, :]
    return cols <= rows + past


def _sdpa_rows(qr: np.ndarray, kf: np.ndarray, vf: np.ndarray, m5: np.ndarray | None, g: int, i0: int, i1: int,
               past: int, s: float, is_causal: bool, work: np.dtype) -> np.ndarray:
    """Attention of the query rows ``i0:i1`` of every group, ``qr [B, Hkv, g*(i1-i0), D]`` (group-major),
    over ``kf, vf [B, Hkv, T, D]`` (``past``: the absolute position of query 0 minus the keys before key 0;
    ``m5``: the additive mask's rows of this block, ``[B|1, Hkv|1, g|1, rows|1, T|1]``). Returns
    ``[B, Hkv, g*(i1-i0), Dv]``."""
    m = i1 - i0
    t = kf.shape[2]
    scores = np.matmul(qr, np.swapaxes(kf, -1, -2))  # a fresh array: updated in place
    scores *= work.type(s)
    if is_causal:
        if past < 0 or i1 - i0 > 1 or i0 > 0:  # one query row at the end sees every key: nothing to mask
            rows = np.arange(g * m) % m + i0
            hidden = np.arange(t)[None, :] > (rows + past)[:, None]
            np.copyto(scores, work.type(-np.inf), where=hidden)
    elif m5 is not None:
        s5 = scores.reshape(scores.shape[0], scores.shape[1], g, m, t)
        if np.broadcast_shapes(s5.shape, m5.shape) == s5.shape:
            s5 += m5
        else:
            scores = (s5 + m5).reshape(-1, scores.shape[1], g * m, t)
    if masked := (m5 is not None or (is_causal and past < 0)):
        err = np.seterr(invalid="ignore")  # a fully masked row gives NaN, as in tract 0.23.9
    try:  # ufunc reductions called directly: np.max / np.sum add a Python layer per call
        scores -= np.maximum.reduce(scores, axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= np.add.reduce(scores, axis=-1, keepdims=True)
    finally:
        if masked:
            np.seterr(**err)
    return np.matmul(scores, vf)


def sdpa_array(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    mask: np.ndarray | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    acc_dtype: np.dtype | None = None,
    where: str = "tract_transformers_sdpa",
) -> np.ndarray:
    """Scaled dot-product attention with grouped KV heads.

    q ``[B, Hq, Sq, D]`` (or ``[B, Sq, D]``), k ``[B, Hkv, Skv, D]``, v ``[B, Hkv, Skv, Dv]``; query
    head ``h`` reads KV head ``h // (Hq / Hkv)``. ``mask`` is additive and must be a float tensor (tract refuses
    others), broadcast against ``[B, Hq, Sq, Skv]``; a mask of lower rank
    gets leading unit axes. Result ``[B, Hq, Sq, Dv]`` in q's dtype."""
    if type(q) is not np.ndarray or type(k) is not np.ndarray or type(v) is not np.ndarray:
        q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
    rank = q.ndim
    if rank not in (3, 4) or k.ndim != rank or v.ndim != rank:
        raise GraphError(f"{where}: q, k, v must all be rank 3 or 4, got {q.shape}, {k.shape}, {v.shape}")
    if is_causal and mask is not None:
        raise GraphError(f"{where}: a mask cannot be given when is_causal is true")
    work = np.dtype(np.float32)
    if acc_dtype is not None and np.dtype(acc_dtype) == np.float64:
        work = np.dtype(np.float64)
    out_dtype = q.dtype
    if rank == 3:
        q, k, v = q[:, None], k[:, None], v[:, None]
        if mask is not None:
            m = np.asarray(mask)
            mask = m.reshape((1,) * (3 - m.ndim) + m.shape)[:, None]
    b, hq, sq, d = q.shape
    bk, hkv, skv, dk = k.shape
    if bk != b or v.shape[0] != b or v.shape[1] != hkv or v.shape[2] != skv or dk != d:
        raise GraphError(f"{where}: incompatible q {q.shape}, k {k.shape}, v {v.shape}")
    if hkv == 0 or hq % hkv:
        raise GraphError(f"{where}: q heads ({hq}) must be a multiple of k/v heads ({hkv})")
    g = hq // hkv
    s = (1.0 / math.sqrt(d)) if scale is None else float(scale)
    dv = v.shape[-1]
    kf = k if k.dtype == work else k.astype(work)
    vf = v if v.dtype == work else v.astype(work)
    m5 = None
    if mask is not None and not is_causal:
        m = np.asarray(mask)
        if m.dtype.kind != "f":
            # tract 0.23.9 refuses it too (FlashSDPA: "Mask must be floating point")
            raise GraphError(f"{where}: the mask must be a float tensor (additive), got {m.dtype}")
        if m.ndim > 4:
            raise GraphError(f"{where}: mask of rank {m.ndim} for rank-4 attention")
        m = m.reshape((1,) * (4 - m.ndim) + m.shape).astype(work, copy=False)
        if m.shape[1] == 1:
            m5 = m[:, :, None]
        elif m.shape[1] == hq:
            m5 = m.reshape(m.shape[0], hkv, g, m.shape[2], m.shape[3])
        else:
            raise GraphError(f"{where}: mask heads ({m.shape[1]}) must be 1 or {hq}")
    qw = q if q.dtype == work else q.astype(work)
    bq = blocked.row_block(b * hq * skv * work.itemsize, sq)
    smax = None  # a mask over every row and key of a prefill: blocks may leave out keys it hides (f32 only)
    if (m5 is not None and m5.shape[3] == sq and m5.shape[4] == skv and work == np.float32
            and sq >= 2 * blocked.CAUSAL_ROWS and 2 * sq > skv):
        smax = blocked.score_bound(qw, kf, vf, s)
    if (is_causal or smax is not None) and sq >= 2 * blocked.CAUSAL_ROWS and 2 * sq > skv:
        bq = min(bq, max(blocked.CAUSAL_ROWS, -(-sq // blocked.CAUSAL_BLOCKS)))  # blocks that skip unseen keys
    if bq >= sq:  # one block: query groups folded into rows, [B, Hkv, g*Sq, D] @ [B, Hkv, D, Skv]
        out = _sdpa_rows(qw.reshape(b, hkv, g * sq, d), kf, vf, m5, g, 0, sq, skv - sq, s, is_causal, work)
        out = out.reshape(out.shape[0], hq, sq, dv)
    else:  # blocks of query rows: the scores of one block at a time (a long prefill)
        past = skv - sq
        # a causal block leaves out the keys none of its rows sees (exact zeros in one call), unless a value
        # there is not finite (one call multiplies it by zero: NaN); the keys stay as they are
        cut = is_causal and bool(np.isfinite(vf).all())
        q5 = qw.reshape(b, hkv, g, sq, d)
        out5 = None
        for i0, i1 in blocked.row_ranges(sq, bq):
            t = min(skv, max(1, past + i1)) if cut else skv
            mb = None if m5 is None else (m5 if m5.shape[3] == 1 else m5[:, :, :, i0:i1])
            if smax is not None:
                t = blocked.unseen_from(mb, smax)
                mb = mb[..., :t]
            qb = q5[:, :, :, i0:i1].reshape(b, hkv, g * (i1 - i0), d)
            ob = _sdpa_rows(qb, kf[:, :, :t], vf[:, :, :t], mb, g, i0, i1, past, s, is_causal, work)
            if out5 is None:
                out5 = np.empty((ob.shape[0], hkv, g, sq, dv), ob.dtype)
            out5[:, :, :, i0:i1] = ob.reshape(ob.shape[0], hkv, g, i1 - i0, dv)
        out = out5.reshape(out5.shape[0], hq, sq, dv)
    if rank == 3:
        out = out[:, 0]
    return out if out.dtype == out_dtype else out.astype(out_dtype)


@stateful(
    "fragment tract_transformers_dyn_kv_cache(input: tensor<scalar>, name: string, axis: integer,"
    " datum_type: string, past_sequence_shape: integer[], input_sequence_shape: integer[])"
    " -> (output: tensor<scalar>);",
    "tract_transformers", role="kv-cache", describe="f32/f16 cache, concatenated each run",
)
class DynKvCache(BufferCheckpoint):
    """tract's ``DynKeyValueCache``: each run concatenates its input onto the cache along ``axis`` and
    returns the whole cache. The cache starts empty (the first run returns its input). Entries live in a
    :class:`GrowBuffer` with geometric spare capacity, so a decode step copies only its new entries.

    ``past_sequence_shape`` may name a symbol (``P``) on ``axis``; :meth:`symbol_bindings` gives its
    current value (the cached length, 0 when empty), as tract resolves it from the cache."""

    #: capacity grows to ``max(needed, GROWTH * capacity, needed + MIN_HEADROOM)`` entries along ``axis``
    GROWTH = 1.5
    MIN_HEADROOM = 32
    _CHECKPOINT_ATTRS = ("_buf", "_ax")

    def __init__(
        self,
        *,
        name: str,
        axis: int,
        datum_type: str = "f32",
        past_sequence_shape: Sequence[Any] = (),
        input_sequence_shape: Sequence[Any] = (),
    ) -> None:
        self.name = str(name)
        self.axis = int(axis)
        self.dtype = parse_datum_type(datum_type, where=f"tract_transformers_dyn_kv_cache {self.name!r}")
        self.past_sequence_shape = tuple(past_sequence_shape)
        self.input_sequence_shape = tuple(input_sequence_shape)
        self._buf: GrowBuffer | None = None  # entries [0, len) along the axis are the cache
        self._ax = 0
        self._symbols = [(i, d) for i, d in enumerate(self.past_sequence_shape) if isinstance(d, str)]

    def _new_buffer(self, shape: Sequence[int], dtype: np.dtype) -> GrowBuffer:
        ax = self._ax
        return GrowBuffer(tuple(shape[:ax]), tuple(shape[ax + 1:]), dtype, growth=self.GROWTH, min_chunk=1,
                          headroom=self.MIN_HEADROOM, zeroed=False)

    def _buffers(self) -> list[GrowBuffer]:
        return [] if self._buf is None else [self._buf]

    def __call__(self, input: np.ndarray) -> np.ndarray:  # noqa: A002 - NNEF parameter name
        """Append ``input`` along the axis; returns the whole cache as a read-only view of the buffer.

        Appends write only past the entries already handed out and a reset or a restore drops the buffer,
        so a view returned by an earlier run never changes. O(new entries) per run, amortised."""
        x = np.asarray(input)
        g = self._buf
        if g is None:
            self._ax = norm_axis(self.axis, x.ndim, what=f"dyn_kv_cache {self.name!r} axis")
            g = self._buf = self._new_buffer(x.shape, x.dtype)
        else:
            ax, xs = self._ax, x.shape
            if len(xs) != len(g.lead) + 1 + len(g.tail) or xs[:ax] != g.lead or xs[ax + 1:] != g.tail:
                raise GraphError(
                    f"tract_transformers_dyn_kv_cache {self.name!r}: input {x.shape} does not extend cache "
                    f"{g.lead + (g.len,) + g.tail} along axis {ax}"
                )
        g.append(x)
        out = g.view()
        out.flags.writeable = False
        return out

    #: a multi-token run already answers as one-token runs would: every entry is stored exactly, and the
    #: attention reading the cache masks causally (``Session.run(stepwise=True)`` calls this unchanged)
    stepwise = __call__

    def census(self) -> dict[str, int]:
        """Entries held (all in full precision); ``f32_bytes``: what they take as f32."""
        c = self.cache
        return {"tokens": int(self.n), "quantized": 0, "full_precision": int(self.n),
                "f32_bytes": 0 if c is None else 4 * int(c.size)}

    @property
    def buf(self) -> np.ndarray | None:
        """The buffer's array (capacity along the axis >= :attr:`n`), None when empty."""
        return None if self._buf is None else self._buf.data

    @buf.setter
    def buf(self, array: np.ndarray) -> None:
        """Replace the buffer's array (same capacity; what a test injecting values needs)."""
        assert self._buf is not None and array.shape == self._buf.data.shape
        self._buf.data = array

    @property
    def n(self) -> int:
        """Entries cached along ``axis``."""
        return 0 if self._buf is None else self._buf.len

    length = n

    @property
    def cache(self) -> np.ndarray | None:
        """The cached entries (a view), None when empty."""
        return None if self._buf is None else self._buf.view()

    @property
    def capacity(self) -> int:
        """Entries the buffer can hold along ``axis`` before it grows."""
        return 0 if self._buf is None else self._buf.capacity

    def symbol_bindings(self) -> dict[str, int]:
        """Symbols of ``past_sequence_shape`` given as names (str), bound to the cache's current dims."""
        g = self._buf
        if g is None:
            return {dim: 0 for _, dim in self._symbols}
        ax, shape = self._ax, g.data.shape
        return {dim: g.len if i == ax else int(shape[i]) for i, dim in self._symbols}

    def reset(self) -> None:
        self._buf = None  # not reused: views handed out earlier keep their values

    def state_tensors(self) -> dict[str, np.ndarray]:
        c = self.cache
        return {} if c is None else {"cache": np.ascontiguousarray(c).copy()}

    def load_state_tensors(self, tensors: dict[str, np.ndarray]) -> None:
        if not tensors:
            self.reset()
            return
        if set(tensors) != {"cache"}:
            raise StateError(f"dyn_kv_cache {self.name!r}: expected state 'cache', got {sorted(tensors)}")
        arr = np.asarray(tensors["cache"])
        if len(self.past_sequence_shape) and arr.ndim != len(self.past_sequence_shape):
            raise StateError(
                f"dyn_kv_cache {self.name!r}: saved cache of rank {arr.ndim}, expected {len(self.past_sequence_shape)}"
            )
        for i, dim in enumerate(self.past_sequence_shape):
            if isinstance(dim, (int, np.integer)) and i != self.axis and int(dim) != arr.shape[i]:
                raise StateError(f"dyn_kv_cache {self.name!r}: saved cache shape {arr.shape} does not fit")
        try:
            ax = norm_axis(self.axis, arr.ndim, what=f"dyn_kv_cache {self.name!r} axis")
        except GraphError as exc:
            raise StateError(str(exc)) from None
        self.reset()
        self._ax = ax
        self._buf = self._new_buffer(arr.shape, arr.dtype)
        self._buf.append(arr)

    def nbytes(self) -> dict[str, int]:
        """Bytes held: the whole buffer, its unused capacity included."""
        return {"codes": 0, "params": 0, "full_precision": 0 if self._buf is None else self._buf.nbytes}


@stateful(
    "fragment tract_transformers_window_kv_sdpa(q: tensor<scalar>, k: tensor<scalar>, v: tensor<scalar>,"
    " axis: integer, window: integer, scale: scalar = 0.0) -> (output: tensor<scalar>);",
    "tract_transformers", role="attention+kv", describe="f32 cache of the last `window` K/V entries + attention",
)
class WindowKvSdpa(BufferCheckpoint):
    """tract's ``WindowKvSdpa``: K and V of each run are appended to bounded caches that keep the last
    ``window`` entries along ``axis``; q then attends (non-causally, GQA-aware) over every cached entry.

    tract keeps a ring buffer in physical order; attention is invariant to the key order, so keeping
    the logical order here gives the same result up to summation order. ``scale`` is optional in
    tract (declared default 0.0 = absent = 1/sqrt(D)). Cached in f32, result in q's type."""

    _CHECKPOINT_ATTRS = ("_k", "_v")

    def __init__(self, *, axis: int, window: int, scale: float | None = 0.0) -> None:
        self.axis = int(axis)
        self.window = int(window)
        if self.window <= 0:
            raise GraphError("tract_transformers_window_kv_sdpa: window must be > 0")
        sc = None if scale is None else as_float(scale)
        self.scale = None if not sc else sc
        self._k: GrowBuffer | None = None
        self._v: GrowBuffer | None = None

    def _buffers(self) -> list[GrowBuffer]:
        return [] if self._k is None else [self._k, self._v]  # type: ignore[list-item]

    def _push(self, buf: GrowBuffer | None, new: np.ndarray, what: str) -> GrowBuffer:
        ax = norm_axis(self.axis, new.ndim, what="window_kv_sdpa axis")
        if buf is None:
            buf = GrowBuffer(new.shape[:ax], new.shape[ax + 1:], np.float32, growth=1.5, min_chunk=1)
        elif new.shape[:ax] != buf.lead or new.shape[ax + 1:] != buf.tail:
            raise GraphError(f"tract_transformers_window_kv_sdpa: {what} {new.shape} does not extend the cache "
                             f"{buf.lead + (buf.len,) + buf.tail} along axis {ax}")
        buf.append(new.astype(np.float32, copy=False))
        if buf.len > self.window:
            buf.drop_front(buf.len - self.window)
        return buf

    def __call__(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
        kb = self._push(self._k, k, "k")
        vb = self._push(self._v, v, "v")
        self._k, self._v = kb, vb
        return sdpa_array(q, kb.view(), vb.view(), None, scale=self.scale, where="tract_transformers_window_kv_sdpa")

    def stepwise(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """One-token runs, one per new token (a multi-token run attends non-causally over the window)."""
        return stepwise_loop(self, q, k, v, axis=self.axis)

    @property
    def k(self) -> np.ndarray | None:
        """The cached keys (f32, a view), None when empty."""
        return None if self._k is None else self._k.view()

    @property
    def v(self) -> np.ndarray | None:
        return None if self._v is None else self._v.view()

    def census(self) -> dict[str, int]:
        n = 0 if self._k is None else self._k.len
        return {"tokens": n, "quantized": 0, "full_precision": n,
                "f32_bytes": 0 if self._k is None else 4 * int(self.k.size + self.v.size)}

    def reset(self) -> None:
        self._k = self._v = None

    def state_tensors(self) -> dict[str, np.ndarray]:
        return {} if self._k is None else {"k": self.k.copy(), "v": self.v.copy()}

    def load_state_tensors(self, tensors: dict[str, np.ndarray]) -> None:
        if not tensors:
            self.reset()
            return
        if set(tensors) != {"k", "v"}:
            raise StateError(f"window_kv_sdpa: expected states 'k' and 'v', got {sorted(tensors)}")
        k, v = (np.asarray(tensors[n], dtype=np.float32) for n in ("k", "v"))
        if k.shape != v.shape or k.ndim == 0:
            raise StateError(f"window_kv_sdpa: saved k {k.shape} and v {v.shape} do not fit")
        try:
            self._k = self._v = None
            self._k, self._v = self._push(None, k, "k"), self._push(None, v, "v")
        except GraphError as exc:
            self.reset()
            raise StateError(str(exc)) from None

    def nbytes(self) -> dict[str, int]:
        """Bytes held: both buffers, spare capacity included."""
        held = 0 if self._k is None else self._k.nbytes + self._v.nbytes  # type: ignore[union-attr]
        return {"codes": 0, "params": 0, "full_precision": held}
