"""``tract_transformers_quantized_dyn_kv_cache`` exactly as tract 0.23.9 stores it (NumPy).

A storage-only cache (``transformers/src/ops/quant_dyn_kv_cache.rs``): each run appends its input
along the sequence axis (2, rank-4 ``[B, H, S, D]`` only) and returns the whole cache dequantized to
the input's dtype. Per (batch, head):

* the first ``SINK_TOKENS = 4`` tokens are kept in f32;
* ``per_channel = 1`` (keys): blocks of ``KEY_BLOCK = 32`` tokens; when a block is full, one
  ``(lo, step)`` f32 pair per channel is computed over it and frozen; the partial block stays f32;
* ``per_channel = 0`` (values): every token gets one ``(lo, step)`` f32 pair over its D channels;
* ``step = (hi - lo) / (2**bits - 1)`` (1.0 when flat), codes ``round((x - lo) / step)`` half away
  from zero, clamped; 4-bit codes packed two a byte, even index in the low nibble.

Bit for bit tract's codes, params and output on the same input (``tests/oracle/test_kv_tract_ops.py``, and
``tests/oracle/test_tract_parity.py`` on the K/V tract computes in a real decoder). ``flip_margin`` (0: off) is
validation's probe of how much tract parity can move (``nnef_kv/validate/parity.py``): every code that an
input noise of ``flip_margin`` could carry over its rounding boundary is stored as the other neighbour.
"""
from __future__ import annotations

import numpy as np

from ..errors import GraphError, InputError, StateError
from ..core.registry import stateful
from .common import BufferCheckpoint, GrowBuffer, expect_state, round_half_away
from .packing import pack_bits, packed_len, unpack_bits

__all__ = ["TractQuantizedDynKvCache", "SINK_TOKENS", "KEY_BLOCK", "flip_at_boundary"]

SINK_TOKENS = 4
KEY_BLOCK = 32


def flip_at_boundary(r: np.ndarray, q: np.ndarray, step: np.ndarray, margin: float) -> tuple[np.ndarray, int]:
    """``(codes, how many moved)``: ``q = round(r)`` with every code an input noise of ``margin`` could
    flip moved to its other neighbour.

    With ``x``, ``lo`` (and ``hi``) each off by at most ``margin``, ``r = (x - lo) / step`` (``r <= levels``,
    ``step = (hi - lo) / levels``) moves by at most ``2 margin / step + r * (2 margin / levels) / step <=
    4 margin / step`` code units: the codes whose ``r`` lies that close to a half-integer are the ones
    another f32 accumulation order of the same K/V may store one step away."""
    if not margin:
        return q, 0
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        near = np.abs(r - np.floor(r) - np.float32(0.5)) < np.float32(4.0 * margin) / step
    return np.where(near, 2 * np.floor(r) + 1 - q, q), int(np.count_nonzero(near))


def _quantize(x: np.ndarray, lo: np.ndarray, step: np.ndarray, levels: np.float32,
              margin: float = 0.0) -> tuple[np.ndarray, int]:
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        r = (x - lo) / step
        q, moved = flip_at_boundary(r, round_half_away(r), step, margin)
        r = np.clip(q, 0, levels)
    return np.nan_to_num(r, nan=0.0).astype(np.uint8), moved


def _range_params(lo: np.ndarray, hi: np.ndarray, levels: np.float32) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        return np.where(hi > lo, (hi - lo) / levels, np.float32(1.0)).astype(np.float32)


def _shape_attr(shape) -> tuple:
    """A shape attribute as given by the session: a list of ints and symbol names (strings); a
    single string (unparsed text) becomes one entry; ``None`` or ``()`` an empty shape."""
    if shape is None:
        return ()
    if isinstance(shape, str):
        return (shape.strip(),)
    return tuple(x.strip() if isinstance(x, str) else x for x in shape)


#: the op's NNEF declaration: its registration (below), and what tools read of its parameters
SIGNATURE = (
    'fragment tract_transformers_quantized_dyn_kv_cache(input: tensor<scalar>, name: string, '
    'axis: integer, bits: integer, per_channel: integer, datum_type: string, '
    'past_sequence_shape: integer[], input_sequence_shape: integer[]) -> (output: tensor<scalar>);'
)


@stateful(SIGNATURE, "tract_transformers", role="kv-cache",
          describe="tract quantized cache (4/8 bits), dequantized on read")
class TractQuantizedDynKvCache(BufferCheckpoint):
    """State of one ``tract_transformers_quantized_dyn_kv_cache`` node."""

    WHO = "tract_transformers_quantized_dyn_kv_cache"

    def __init__(self, name: str = "", axis: int = 2, bits: int = 8, per_channel: int = 0,
                 datum_type: str = "f32", past_sequence_shape=(), input_sequence_shape=()) -> None:
        if int(bits) not in (4, 8):
            raise GraphError(f"{self.WHO} {name!r}: bits must be 4 or 8, got {bits}")
        if int(axis) != 2:
            raise GraphError(f"{self.WHO} {name!r}: only axis 2 of [B, H, S, D] is supported, got {axis}")
        self.name = str(name)
        self.axis = int(axis)
        self.bits = int(bits)
        self.per_channel = bool(per_channel)
        self.datum_type = str(datum_type)
        self.levels = np.float32((1 << self.bits) - 1)
        self.past_sequence_shape = _shape_attr(past_sequence_shape)
        self.input_sequence_shape = _shape_attr(input_sequence_shape)
        #: validation's boundary-flip probe (see the module docstring); 0 reproduces tract
        self.flip_margin = 0.0
        self.flips = 0  # codes the probe moved
        self.reset()

    def symbol_bindings(self) -> dict[str, int]:
        """Symbols this state binds before a run: when ``past_sequence_shape[axis]`` is a plain symbol
        (``[1, H, "P", D]``; the session hands symbols over as strings), ``{"P": tokens already held}``.
        Integers, expressions (``"P + 1"``) and an absent attribute bind nothing."""
        shape = self.past_sequence_shape
        if not 0 <= self.axis < len(shape):
            return {}
        sym = shape[self.axis]
        return {sym: int(self.len)} if isinstance(sym, str) and sym.isidentifier() else {}

    @property
    def who(self) -> str:
        return f"{self.WHO} {self.name!r}"

    def reset(self) -> None:
        self.b = self.h = self.d = 0
        self.len = 0
        self.sink: GrowBuffer | None = None  # [n, <=4, D] f32
        self.packed: GrowBuffer | None = None  # [n, T_q, row_bytes] u8
        self.params: GrowBuffer | None = None  # keys: [n, blocks, 2, D]; values: [n, T_q, 2]
        self.residual: GrowBuffer | None = None  # keys: [n, <32, D] f32

    @property
    def row_bytes(self) -> int:
        return packed_len(self.d, self.bits)

    def _init(self, b: int, h: int, d: int) -> None:
        n = b * h
        self.b, self.h, self.d = b, h, d
        self.sink = GrowBuffer((n,), (d,), np.float32, min_chunk=SINK_TOKENS)
        self.packed = GrowBuffer((n,), (self.row_bytes,), np.uint8, growth=1.0, min_chunk=256)
        if self.per_channel:
            self.params = GrowBuffer((n,), (2, d), np.float32, growth=1.0, min_chunk=8)
            self.residual = GrowBuffer((n,), (d,), np.float32, min_chunk=KEY_BLOCK)
        else:
            self.params = GrowBuffer((n,), (2,), np.float32, growth=1.0, min_chunk=256)
            self.residual = None

    @property
    def initialized(self) -> bool:
        return self.sink is not None

    # ----------------------------------------------------------------------------- ingest
    def _ingest(self, x: np.ndarray) -> None:
        """x: [n, S, D] f32."""
        s = x.shape[1]
        n_sink = min(max(SINK_TOKENS - self.sink.len, 0), s)
        if n_sink:
            self.sink.append(x[:, :n_sink])
        rest = x[:, n_sink:]
        if rest.shape[1] == 0:
            return
        if self.per_channel:
            self.residual.append(rest)
            while self.residual.len >= KEY_BLOCK:
                blk = self.residual.view(0, KEY_BLOCK)
                lo = np.fmin.reduce(blk, axis=1, initial=np.inf).astype(np.float32)  # [n, D]
                hi = np.fmax.reduce(blk, axis=1, initial=-np.inf).astype(np.float32)
                step = _range_params(lo, hi, self.levels)
                codes, moved = _quantize(blk, lo[:, None, :], step[:, None, :], self.levels, self.flip_margin)
                self.flips += moved
                self.packed.append(pack_bits(codes, self.bits))
                self.params.append(np.stack([lo, step], axis=1)[:, None])
                self.residual.drop_front(KEY_BLOCK)
            if self.residual.capacity > KEY_BLOCK:  # after a long chunk, back to its exact size
                self.residual.set_exact(self.residual.view())
        else:
            lo = np.fmin.reduce(rest, axis=-1, initial=np.inf).astype(np.float32)  # [n, S]
            hi = np.fmax.reduce(rest, axis=-1, initial=-np.inf).astype(np.float32)
            step = _range_params(lo, hi, self.levels)
            codes, moved = _quantize(rest, lo[..., None], step[..., None], self.levels, self.flip_margin)
            self.flips += moved
            self.packed.append(pack_bits(codes, self.bits))
            self.params.append(np.stack([lo, step], axis=-1))

    def dequantized(self) -> np.ndarray:
        """The whole cache ``[B, H, T, D]`` f32, as tract reads it back."""
        n, d = self.b * self.h, self.d
        parts = [self.sink.view()]
        codes = unpack_bits(self.packed.view(), self.bits, d).astype(np.float32)
        if self.per_channel:
            nb = self.params.len
            p = self.params.view()  # [n, nb, 2, D]
            c = codes.reshape(n, nb, KEY_BLOCK, d)
            deq = p[:, :, 0:1, :] + c * p[:, :, 1:2, :]
            parts.append(deq.reshape(n, nb * KEY_BLOCK, d))
            parts.append(self.residual.view())
        else:
            p = self.params.view()  # [n, T_q, 2]
            parts.append(p[..., 0:1] + codes * p[..., 1:2])
        full = np.concatenate(parts, axis=1)
        return full.reshape(self.b, self.h, self.len, d)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x)
        if x.ndim != 4:
            raise InputError(f"{self.who}: input must be rank-4 [B, H, S, D], got shape {x.shape}")
        out_dtype = x.dtype
        x32 = x.astype(np.float32)
        b, h, s, d = x32.shape
        if not self.initialized:
            self._init(b, h, d)
        elif (b, h, d) != (self.b, self.h, self.d):
            raise InputError(f"{self.who}: cache shape changed between steps "
                             f"({x.shape} vs B={self.b}, H={self.h}, D={self.d})")
        self._ingest(x32.reshape(b * h, s, d))
        self.len += s
        return self.dequantized().astype(out_dtype)

    QUANTIZED = True
    #: a multi-token run stores its tokens as one-token runs would; only the keys of a block completed
    #: inside the run read differently (quantized) for the run's earlier rows: see :meth:`stepwise_splits`
    stepwise = __call__

    def stepwise_splits(self, n: int) -> list[int]:
        """Where a stepwise run of ``n`` new tokens must start a new chunk so that every chunk, run as one
        call, answers each of its rows as one-token runs would: at each token that completes a key block
        (its block is then quantized before any row of the chunk reads it). Values (per token) need none."""
        if not self.per_channel or n <= 1:
            return []
        pos = self.len + np.arange(n)
        before = pos - SINK_TOKENS  # non-sink tokens before each token
        done = (pos >= SINK_TOKENS) & ((before + 1) % KEY_BLOCK == 0)
        return [int(i) for i in np.nonzero(done)[0] if i > 0]

    @property
    def fp_window(self) -> int:
        """The most tokens held in f32: the sinks, plus a partial key block for keys."""
        return SINK_TOKENS + (KEY_BLOCK - 1 if self.per_channel else 0)

    @property
    def window_text(self) -> str:
        partial = f" + a partial key block of up to {KEY_BLOCK - 1}" if self.per_channel else ""
        return f"{SINK_TOKENS} sink tokens" + partial

    def reads_quantized(self, n: int, stepwise: bool = True) -> np.ndarray:
        """Quantized entries in the cache the attention after this op reads, for each of the next ``n``
        tokens (in one call, every row reads the cache as it is after the whole call)."""
        after = self.len + (np.arange(1, n + 1) if stepwise else np.full(n, n))
        rest = np.maximum(after - SINK_TOKENS, 0)
        return rest // KEY_BLOCK * KEY_BLOCK if self.per_channel else rest

    def census(self) -> dict[str, int]:
        if not self.initialized:
            return {"tokens": 0, "quantized": 0, "full_precision": 0, "f32_bytes": 0}
        fp = self.sink.len + (self.residual.len if self.residual is not None else 0)
        return {"tokens": int(self.len), "quantized": int(self.packed.len), "full_precision": int(fp),
                "f32_bytes": 4 * self.b * self.h * self.len * self.d}

    # ----------------------------------------------------------------------------- protocol
    def _buffers(self) -> list[GrowBuffer]:  # checkpoint / rollback: BufferCheckpoint
        if not self.initialized:
            return []
        return [b for b in (self.sink, self.packed, self.params, self.residual) if b is not None]

    def state_tensors(self) -> dict[str, np.ndarray]:
        if not self.initialized:
            return {"shape": np.zeros(4, np.int64)}
        out = {
            "shape": np.array([self.b, self.h, self.d, self.len], np.int64),
            "sink": self.sink.view().copy(),
            "codes": self.packed.view().copy(),
            "params": self.params.view().copy(),
        }
        if self.per_channel:
            out["residual"] = self.residual.view().copy()
        return out

    def load_state_tensors(self, tensors: dict[str, np.ndarray]) -> None:
        shape = expect_state(tensors, "shape", (4,), np.int64, self.who)
        b, h, d, t = (int(x) for x in shape)
        if min(b, h, d, t) < 0:
            raise StateError(f"{self.who}: negative sizes in state shape {shape.tolist()}")
        self.reset()
        if b == 0:
            return
        self._init(b, h, d)
        n = b * h
        ns = min(t, SINK_TOKENS)
        rest = t - ns
        sink = expect_state(tensors, "sink", (n, ns, d), np.float32, self.who)
        if self.per_channel:
            nb, nr = divmod(rest, KEY_BLOCK)
            codes = expect_state(tensors, "codes", (n, nb * KEY_BLOCK, self.row_bytes), np.uint8, self.who)
            params = expect_state(tensors, "params", (n, nb, 2, d), np.float32, self.who)
            res = expect_state(tensors, "residual", (n, nr, d), np.float32, self.who)
            self.residual.set_exact(res)
        else:
            codes = expect_state(tensors, "codes", (n, rest, self.row_bytes), np.uint8, self.who)
            params = expect_state(tensors, "params", (n, rest, 2), np.float32, self.who)
        if self.bits == 4 and d % 2 and codes.size and np.any(codes[..., -1] >> 4):
            raise StateError(f"{self.who}: padding nibble set in 4-bit codes")
        self.sink.set_exact(sink)
        self.packed.set_exact(codes)
        self.params.set_exact(params)
        self.len = t

    def nbytes(self) -> dict[str, int]:
        if not self.initialized:
            return {"codes": 0, "params": 0, "full_precision": 0, "f32_equivalent": 0, "f16_equivalent": 0}
        n_values = self.b * self.h * self.len * self.d
        fp = self.sink.nbytes + (self.residual.nbytes if self.residual is not None else 0)
        return {
            "codes": self.packed.nbytes,
            "params": self.params.nbytes,
            "full_precision": fp,
            "f32_equivalent": 4 * n_values,
            "f16_equivalent": 2 * n_values,
        }
