"""Kernels of tract's ``tract_transformers_*`` operations (registry ``tract_transformers``).

Semantics follow ``sonos/tract`` ``transformers/src/ops/*.rs`` and are checked against tract 0.23.9 in
``tests/test_tract_ops.py`` and ``tests/test_tract_decode.py``. The quantized KV ops
(``tract_transformers_quantized_dyn_kv_cache``, ``tract_transformers_quantized_kv_sdpa``) live in
``nnef_kv.kv.ops``, not here.

Precision: ``sdpa`` computes scores, softmax and the weighted sum in f32 whenever ``acc_datum_type`` is
f16 or f32 (tract's optimized CPU kernel, FlashSdpaOp, accumulates in f32 whatever the float input
type), and casts the result to the type of ``q``.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from ...errors import GraphError, StateError
from ..registry import primitive, stateful
from ...kv.common import stepwise_loop
from .tract_common import as_float, float_compute_dtype, norm_axis, parse_datum_type

REG = "tract_transformers"


# ----------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------
def causal_mask(q_len: int, kv_len: int) -> np.ndarray:
    """Boolean ``[q_len, kv_len]``, True where attention is allowed.

    Bottom-right aligned, as tract's ``wire_attention_mask``: query row ``i`` sits at absolute position
    ``P + i`` with ``P = kv_len - q_len`` and sees keys ``0..=P+i``."""
    past = kv_len - q_len
    rows = np.arange(q_len)[:, None]
    cols = np.arange(kv_len)[None, :]
    return cols <= rows + past


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
    # query groups folded into rows: [B, Hkv, g*Sq, D] @ [B, Hkv, D, Skv], one batched product per KV head
    qf = (q if q.dtype == work else q.astype(work)).reshape(b, hkv, g * sq, d)
    kf = k if k.dtype == work else k.astype(work)
    vf = v if v.dtype == work else v.astype(work)
    scores = np.matmul(qf, np.swapaxes(kf, -1, -2))  # [B, Hkv, g*Sq, Skv], a fresh array: updated in place
    scores *= work.type(s)
    if is_causal:
        past = skv - sq
        if past < 0 or sq > 1:  # one query row at the end sees every key: nothing to mask
            rows = np.arange(g * sq) % sq
            blocked = np.arange(skv)[None, :] > (rows + past)[:, None]
            np.copyto(scores, work.type(-np.inf), where=blocked)
    elif mask is not None:
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
        s5 = scores.reshape(b, hkv, g, sq, skv)
        if np.broadcast_shapes(s5.shape, m5.shape) == s5.shape:
            s5 += m5
        else:
            scores = (s5 + m5).reshape(-1, hkv, g * sq, skv)
    if masked := (mask is not None or (is_causal and skv < sq)):
        err = np.seterr(invalid="ignore")  # a fully masked row gives NaN, as in tract 0.23.9
    try:  # ufunc reductions called directly: np.max / np.sum add a Python layer per call
        scores -= np.maximum.reduce(scores, axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= np.add.reduce(scores, axis=-1, keepdims=True)
    finally:
        if masked:
            np.seterr(**err)
    out = np.matmul(scores, vf).reshape(scores.shape[0], hq, sq, dv)
    if rank == 3:
        out = out[:, 0]
    return out if out.dtype == out_dtype else out.astype(out_dtype)


@primitive(
    "fragment tract_transformers_sdpa(q: tensor<scalar>, k: tensor<scalar>, v: tensor<scalar>,"
    " mask: tensor<scalar> = false, scale: scalar = 0.0, datum_type: string = \"f32\","
    ' acc_datum_type: string = "f32", is_causal: logical = false) -> (output: tensor<scalar>);',
    REG,
)
def tract_transformers_sdpa(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    mask: np.ndarray | None = None,
    *,
    scale: float | None = None,
    datum_type: str = "f32",
    acc_datum_type: str = "f32",
    is_causal: bool = False,
) -> np.ndarray:
    """tract's SDPA. ``mask`` and ``scale`` are optional in tract (read with ``get_named_arg_as``);
    the declaration spells "absent" as ``mask = false`` and ``scale = 0.0`` (a zero scale is
    meaningless, so 0.0 / None mean 1/sqrt(D))."""
    acc = parse_datum_type(acc_datum_type, where="tract_transformers_sdpa acc_datum_type")
    parse_datum_type(datum_type, where="tract_transformers_sdpa datum_type")
    if mask is not None and np.ndim(mask) == 0 and np.asarray(mask).dtype == np.bool_ and not bool(mask):
        mask = None  # the declared default `false`: no mask
    sc = None if scale is None or as_float(scale) == 0.0 else as_float(scale)
    return sdpa_array(q, k, v, mask, scale=sc, is_causal=bool(is_causal), acc_dtype=acc)


@primitive(
    "fragment tract_transformers_scaled_masked_softmax(input: tensor<scalar>, mask: tensor<scalar>,"
    " scale: scalar, post_softmax_mask: logical = false) -> (output: tensor<scalar>);",
    REG,
)
def tract_transformers_scaled_masked_softmax(
    input: np.ndarray, mask: np.ndarray, *, scale: float, post_softmax_mask: bool = False
) -> np.ndarray:
    """Softmax over the last axis of ``input * scale + mask`` (float mask), or of
    ``where(mask, input * scale, -inf)`` (bool mask; ``post_softmax_mask`` then zeroes masked-out
    outputs). Computed in f32 for f16/f32 input; result in the input type."""
    x = np.asarray(input)
    m = np.asarray(mask)
    work = float_compute_dtype(x.dtype)
    scaled = x.astype(work) * work.type(as_float(scale))
    if m.dtype == np.bool_:
        pre = np.where(m, scaled, work.type(-np.inf))
    else:
        pre = scaled + m.astype(work)
    mx = np.max(pre, axis=-1, keepdims=True)
    e = np.exp(pre - mx)
    out = e / np.sum(e, axis=-1, keepdims=True)
    if post_softmax_mask and m.dtype == np.bool_:
        out = np.where(m, out, work.type(0))
    return out.astype(x.dtype)


@primitive(
    "fragment tract_transformers_apply_rope(input: tensor<scalar>, cos: tensor<scalar>, sin: tensor<scalar>)"
    " -> (output: tensor<scalar>);",
    REG,
)
def tract_transformers_apply_rope(input: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = concat(-x[..., D/2:], x[..., :D/2])``,
    each product and the sum rounded to the input type (tract evaluates them as separate ops)."""
    x = np.asarray(input)
    dt = x.dtype
    d = x.shape[-1]
    if d % 2:
        raise GraphError(f"tract_transformers_apply_rope: last axis ({d}) must be even")
    half = d // 2
    rot = np.empty_like(x)
    np.negative(x[..., half:], out=rot[..., :half])
    rot[..., half:] = x[..., :half]
    c, s = np.asarray(cos).astype(dt, copy=False), np.asarray(sin).astype(dt, copy=False)
    out = np.multiply(x, c)
    try:
        rot *= s  # all three in dt: the product np.multiply(rot, s) would make, written over rot
    except ValueError:  # sin broadcasts to a larger shape than x
        rot = np.multiply(rot, s)
    out += rot
    return out


# ----------------------------------------------------------------------------------------------
# Stateful KV cache
# ----------------------------------------------------------------------------------------------
@stateful(
    "fragment tract_transformers_dyn_kv_cache(input: tensor<scalar>, name: string, axis: integer,"
    " datum_type: string, past_sequence_shape: integer[], input_sequence_shape: integer[])"
    " -> (output: tensor<scalar>);",
    REG,
)
class DynKvCache:
    """tract's ``DynKeyValueCache``: each run concatenates its input onto the cache along ``axis`` and
    returns the whole cache. The cache starts empty (the first run returns its input). Entries live in a
    buffer with geometric spare capacity, so a decode step copies only its new entries.

    ``past_sequence_shape`` may name a symbol (``P``) on ``axis``; :meth:`symbol_bindings` gives its
    current value (the cached length, 0 when empty), as tract resolves it from the cache."""

    #: capacity grows to ``max(needed, GROWTH * capacity, needed + MIN_HEADROOM)`` entries along ``axis``
    GROWTH = 1.5
    MIN_HEADROOM = 32

    def __init__(
        self,
        *,
        name: str,
        axis: int,
        datum_type: str,
        past_sequence_shape: Sequence[Any] = (),
        input_sequence_shape: Sequence[Any] = (),
    ) -> None:
        self.name = str(name)
        self.axis = int(axis)
        self.dtype = parse_datum_type(datum_type, where=f"tract_transformers_dyn_kv_cache {self.name!r}")
        self.past_sequence_shape = tuple(past_sequence_shape)
        self.input_sequence_shape = tuple(input_sequence_shape)
        self.buf: np.ndarray | None = None  # capacity along the axis >= self.n; entries [0, n) are the cache
        self.n = 0
        self._ax = 0
        self._symbols = [(i, d) for i, d in enumerate(self.past_sequence_shape) if isinstance(d, str)]

    def __call__(self, input: np.ndarray) -> np.ndarray:  # noqa: A002 - NNEF parameter name
        """Append ``input`` along the axis; returns the whole cache as a read-only view of the buffer.

        Appends write only past the entries already handed out and a reset or a restore drops the buffer,
        so a view returned by an earlier run never changes. O(new entries) per run, amortised."""
        x = np.asarray(input)
        buf = self.buf
        if buf is None:
            ax = norm_axis(self.axis, x.ndim, what=f"dyn_kv_cache {self.name!r} axis")
            self._ax = ax
            self._alloc(x.shape, x.dtype, x.shape[ax])
            buf = self.buf
            assert buf is not None
        else:
            ax = self._ax
            bs, xs = buf.shape, x.shape
            if len(bs) != len(xs) or bs[:ax] != xs[:ax] or bs[ax + 1:] != xs[ax + 1:]:
                shape = list(buf.shape)
                shape[ax] = self.n
                raise GraphError(
                    f"tract_transformers_dyn_kv_cache {self.name!r}: input {x.shape} does not extend cache "
                    f"{tuple(shape)} along axis {ax}"
                )
        n0, k = self.n, x.shape[ax]
        if n0 + k > buf.shape[ax]:
            self._alloc(buf.shape, buf.dtype, n0 + k)
            buf = self.buf
            assert buf is not None
        lead = (slice(None),) * ax
        buf[lead + (slice(n0, n0 + k),)] = x
        self.n = n0 + k
        out = buf[lead + (slice(0, self.n),)]
        out.flags.writeable = False
        return out

    #: a multi-token run already answers as one-token runs would: every entry is stored exactly, and the
    #: attention reading the cache masks causally (``Session.run(stepwise=True)`` calls this unchanged)
    stepwise = __call__
    QUANTIZED = False

    def reads_quantized(self, n: int, stepwise: bool = True) -> np.ndarray:
        return np.zeros(n, np.int64)

    def used_nbytes(self) -> int:
        """Bytes of the entries held (the buffer's spare capacity left out)."""
        c = self.cache
        return 0 if c is None else int(c.nbytes)

    def census(self) -> dict[str, int]:
        """Entries held (all in full precision); ``f32_bytes``: what they take as f32."""
        c = self.cache
        return {"tokens": int(self.n), "quantized": 0, "full_precision": int(self.n),
                "f32_bytes": 0 if c is None else 4 * int(c.size)}

    def _alloc(self, shape: Sequence[int], dtype: np.dtype, needed: int) -> None:
        """A new buffer holding at least ``needed`` entries (with headroom), the current ones copied."""
        ax = self._ax
        old = self.buf
        cap = 0 if old is None else old.shape[ax]
        new_cap = max(needed, int(math.ceil(cap * self.GROWTH)), needed + self.MIN_HEADROOM)
        full = list(shape)
        full[ax] = new_cap
        new = np.empty(full, dtype=dtype)
        if old is not None and self.n:
            lead = (slice(None),) * ax
            new[lead + (slice(0, self.n),)] = old[lead + (slice(0, self.n),)]
        self.buf = new

    @property
    def cache(self) -> np.ndarray | None:
        """The cached entries (a view), None when empty."""
        if self.buf is None:
            return None
        return self.buf[(slice(None),) * self._ax + (slice(0, self.n),)]

    @property
    def capacity(self) -> int:
        """Entries the buffer can hold along ``axis`` before it grows."""
        return 0 if self.buf is None else int(self.buf.shape[self._ax])

    @property
    def length(self) -> int:
        """Entries cached along ``axis``."""
        return self.n

    def symbol_bindings(self) -> dict[str, int]:
        """Symbols of ``past_sequence_shape`` given as names (str), bound to the cache's current dims."""
        buf = self.buf
        if buf is None:
            return {dim: 0 for _, dim in self._symbols}
        ax = self._ax
        return {dim: self.n if i == ax else int(buf.shape[i]) for i, dim in self._symbols}

    def reset(self) -> None:
        self.buf = None  # not reused: views handed out earlier keep their values
        self.n = 0

    def checkpoint(self) -> tuple[Any, int, int]:
        """O(1) token for :meth:`rollback` (the session takes one before each run): appends only write past
        ``n`` (into this buffer or a grown copy of it), so the buffer and the length restore the cache."""
        return self.buf, self.n, self._ax

    def rollback(self, token: tuple[Any, int, int]) -> None:
        """Undo every append since :meth:`checkpoint` returned ``token`` (a failed run)."""
        self.buf, self.n, self._ax = token

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
        self._alloc(arr.shape, arr.dtype, arr.shape[ax])
        assert self.buf is not None
        self.buf[(slice(None),) * ax + (slice(0, arr.shape[ax]),)] = arr
        self.n = int(arr.shape[ax])

    def nbytes(self) -> dict[str, int]:
        """Bytes held: the whole buffer, its unused capacity included."""
        return {"codes": 0, "params": 0, "full_precision": 0 if self.buf is None else int(self.buf.nbytes)}


# ----------------------------------------------------------------------------------------------
# Recurrent decoder blocks (Qwen3.5)
# ----------------------------------------------------------------------------------------------
def _causal_conv1d_update(input: np.ndarray, weight: np.ndarray, initial_state: np.ndarray):
    x, w, st = np.asarray(input), np.asarray(weight), np.asarray(initial_state)
    kw = w.shape[-1]
    ch = x.size
    if w.size != ch * kw or st.size != ch * kw:
        raise GraphError(
            f"causal_conv1d_update: weight {w.shape} / state {st.shape} do not fit {ch} channels of width {kw}"
        )
    xf = x.reshape(ch).astype(np.float32)
    wf = w.reshape(ch, kw).astype(np.float32)
    sf = st.reshape(ch, kw)
    new_state = np.concatenate([sf[:, 1:], x.reshape(ch, 1).astype(st.dtype)], axis=1)
    acc = np.zeros(ch, dtype=np.float32)
    for tap in range(kw - 1):  # same order of f32 additions as tract
        acc = acc + sf[:, tap + 1].astype(np.float32) * wf[:, tap]
    acc = acc + xf * wf[:, kw - 1]
    out = acc / (np.float32(1.0) + np.exp(-acc))
    return out.astype(x.dtype).reshape(x.shape), new_state.reshape(st.shape)


@primitive(
    "fragment tract_transformers_causal_conv1d_update(input: tensor<scalar>, weight: tensor<scalar>,"
    " initial_state: tensor<scalar>) -> (output: tensor<scalar>, final_state: tensor<scalar>);",
    REG,
    "tract_qwen35_causal_conv1d_update",
)
def tract_transformers_causal_conv1d_update(input: np.ndarray, weight: np.ndarray, initial_state: np.ndarray):
    """One step of a depthwise causal conv1d with SiLU: the state (last ``width`` inputs per channel)
    shifts left by one, takes ``input``; ``output = silu(sum(state * weight))`` accumulated in f32."""
    return _causal_conv1d_update(input, weight, initial_state)


@primitive(
    "fragment tract_transformers_gdn_recurrent(query: tensor<scalar>, key: tensor<scalar>, value: tensor<scalar>,"
    " log_decay: tensor<scalar>, beta: tensor<scalar>, initial_state: tensor<scalar>)"
    " -> (output: tensor<scalar>, final_state: tensor<scalar>);",
    REG,
    "tract_qwen35_gdn_recurrent",
)
def tract_transformers_gdn_recurrent(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    log_decay: np.ndarray,
    beta: np.ndarray,
    initial_state: np.ndarray,
):
    """The gated delta rule, step by step over the sequence axis.

    tract 0.23.9 layout: query/key/value ``[B, S, H, W]``, log_decay/beta ``[B, S, H]``, state
    ``[B, H, W, W]`` (f32). Per step and head, q and k are L2-normalised (eps 1e-6 inside the sqrt),
    ``S' = S * exp(g) + k (beta (v - k^T S exp(g)))`` and ``out = q^T S' / sqrt(W)``, all in f32;
    output in the query's type, state in the state's type."""
    q, k, v = (np.asarray(a) for a in (query, key, value))
    st = np.asarray(initial_state)
    if q.ndim != 4 or k.shape != q.shape or v.shape != q.shape:
        raise GraphError(f"gdn_recurrent: query/key/value must be [B, S, H, W], got {q.shape}, {k.shape}, {v.shape}")
    bsz, seq, heads, width = q.shape
    if st.shape != (bsz, heads, width, width):
        raise GraphError(f"gdn_recurrent: state {st.shape} does not fit query {q.shape}")
    g = np.asarray(log_decay).astype(np.float32).reshape(bsz, seq, heads)
    bt = np.asarray(beta).astype(np.float32).reshape(bsz, seq, heads)
    S = st.astype(np.float32).copy()  # [B, H, row, col]
    out = np.empty(q.shape, dtype=np.float32)
    eps = np.float32(1e-6)
    for t in range(seq):
        qf, kf, vf = (a[:, t].astype(np.float32) for a in (q, k, v))  # [B, H, W]
        qn = qf / np.sqrt(np.sum(qf * qf, axis=-1, keepdims=True) + eps)
        kn = kf / np.sqrt(np.sum(kf * kf, axis=-1, keepdims=True) + eps)
        decay = np.exp(g[:, t])[:, :, None, None]
        decayed = S * decay
        predicted = np.einsum("bhr,bhrc->bhc", kn, decayed)
        residual = (vf - predicted) * bt[:, t][:, :, None]
        S = decayed + kn[:, :, :, None] * residual[:, :, None, :]
        out[:, t] = np.einsum("bhr,bhrc->bhc", qn, S) / np.float32(math.sqrt(width))
    return out.astype(q.dtype), S.astype(st.dtype)



# ----------------------------------------------------------------------------------------------
# Sliding-window KV cache fused with attention
# ----------------------------------------------------------------------------------------------
@stateful(
    "fragment tract_transformers_window_kv_sdpa(q: tensor<scalar>, k: tensor<scalar>, v: tensor<scalar>,"
    " axis: integer, window: integer, scale: scalar = 0.0) -> (output: tensor<scalar>);",
    REG,
)
class WindowKvSdpa:
    """tract's ``WindowKvSdpa``: K and V of each run are appended to bounded caches that keep the last
    ``window`` entries along ``axis``; q then attends (non-causally, GQA-aware) over every cached entry.

    tract keeps a ring buffer in physical order; attention is invariant to the key order, so keeping
    the logical order here gives the same result up to summation order. ``scale`` is optional in
    tract (declared default 0.0 = absent = 1/sqrt(D)). Computed in f32, result in q's type."""

    def __init__(self, *, axis: int, window: int, scale: float | None = 0.0) -> None:
        self.axis = int(axis)
        self.window = int(window)
        if self.window <= 0:
            raise GraphError("tract_transformers_window_kv_sdpa: window must be > 0")
        sc = None if scale is None else as_float(scale)
        self.scale = None if not sc else sc
        self.k: np.ndarray | None = None
        self.v: np.ndarray | None = None

    def _push(self, cache: np.ndarray | None, new: np.ndarray) -> np.ndarray:
        ax = norm_axis(self.axis, new.ndim, what="window_kv_sdpa axis")
        joined = new.astype(np.float32) if cache is None else np.concatenate([cache, new.astype(np.float32)], axis=ax)
        n = joined.shape[ax]
        if n > self.window:
            joined = np.take(joined, np.arange(n - self.window, n), axis=ax)
        return joined

    def __call__(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
        self.k = self._push(self.k, k)
        self.v = self._push(self.v, v)
        return sdpa_array(q, self.k, self.v, None, scale=self.scale, where="tract_transformers_window_kv_sdpa")

    QUANTIZED = False

    def stepwise(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """One-token runs, one per new token (a multi-token run attends non-causally over the window)."""
        return stepwise_loop(self, q, k, v, axis=self.axis)

    def reads_quantized(self, n: int, stepwise: bool = True) -> np.ndarray:
        return np.zeros(n, np.int64)

    def census(self) -> dict[str, int]:
        n = 0 if self.k is None else int(self.k.shape[norm_axis(self.axis, self.k.ndim)])
        return {"tokens": n, "quantized": 0, "full_precision": n,
                "f32_bytes": 0 if self.k is None else 4 * int(self.k.size + self.v.size)}

    def reset(self) -> None:
        self.k = self.v = None

    def checkpoint(self) -> tuple[Any, Any]:
        """O(1) token for :meth:`rollback`: each run replaces the caches by new arrays, never writes into them."""
        return self.k, self.v

    def rollback(self, token: tuple[Any, Any]) -> None:
        self.k, self.v = token

    def state_tensors(self) -> dict[str, np.ndarray]:
        return {} if self.k is None else {"k": self.k.copy(), "v": self.v.copy()}

    def load_state_tensors(self, tensors: dict[str, np.ndarray]) -> None:
        if not tensors:
            self.reset()
            return
        if set(tensors) != {"k", "v"}:
            raise StateError(f"window_kv_sdpa: expected states 'k' and 'v', got {sorted(tensors)}")
        self.k = np.asarray(tensors["k"], dtype=np.float32).copy()
        self.v = np.asarray(tensors["v"], dtype=np.float32).copy()

    def nbytes(self) -> dict[str, int]:
        held = 0 if self.k is None else int(self.k.nbytes + self.v.nbytes)
        return {"codes": 0, "params": 0, "full_precision": held}
