"""``tract_transformers_quantized_kv_sdpa`` exactly as tract 0.23.9 computes it (NumPy).

What tract does (``transformers/src/ops/kv_quant.rs``, checked against the tract Python package):

* one key store and one value store per (batch, kv head), created at the first run;
* values per token: ``lo = min(x)``, ``step = (max(x) - lo) / 255`` (``1.0`` when the row is flat),
  u8 codes ``round((x - lo) / step)`` clamped to 0..255;
* keys per channel with a *running* range: ``lo`` only decreases, ``step`` starts at 1.0 and only
  grows; each token is coded under the range current at its push, and every code is read back
  under the *latest* ``lo``/``step`` (tract's drift, reproduced on purpose);
* f32 arithmetic, rounding half away from zero; NaN codes become 0 (Rust's saturating cast);
* attention over the whole dequantized cache, new tokens included, **no causal mask**, GQA
  ``kv = h // (Hq / Hkv)``, ``scale`` default ``sqrt(1 / D)``; output cast back to q's dtype.

Codes and params are tract's bit for bit on the same K/V; the output differs by f32 rounding only (tract's
flash softmax in blocks of 32, its own dot products and ``exp``: within 1e-5, ``tests/oracle/test_kv_tract_ops.py``).
``flip_margin = (keys, values)`` (0: off) is validation's boundary-flip probe, as in ``tract_dyn_cache``.

The class is usable without a graph: ``state = TractQuantizedKvSdpa(scale=0.125); y = state(q, k, v)``.
"""
from __future__ import annotations

import numpy as np

from ..errors import InputError, StateError
from ..core.registry import stateful
from . import blocked
from .common import BufferCheckpoint, GrowBuffer, check_qkv, expect_state, round_half_away, stepwise_loop
from .tract_dyn_cache import flip_at_boundary

__all__ = ["TractQuantizedKvSdpa", "softmax_attention"]

_LEVELS = np.float32(255.0)


def softmax_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float,
                      mask: np.ndarray | None = None) -> np.ndarray:
    """Exact f32 attention with GQA: q ``[B,Hq,Sq,D]``, k/v ``[B,Hkv,T,D]``; ``mask`` bool ``[Sq,T]`` (True = keep)."""
    b, hq, sq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    bq = blocked.row_block(b * hq * k.shape[2] * 4, sq)
    if bq < sq:  # a long prefill: the scores of a block of query rows at a time (issue 26.3)
        return np.concatenate([softmax_attention(q[:, :, i0:i1], k, v, scale, None if mask is None else mask[i0:i1])
                               for i0, i1 in blocked.row_ranges(sq, bq)], axis=2)
    qg = q.reshape(b, hkv, g * sq, d)
    s = np.matmul(qg, np.swapaxes(k, -1, -2))  # [B,Hkv,g*Sq,T]
    s *= np.float32(scale)
    if mask is not None:
        m = np.broadcast_to(mask[None, :, :], (g, sq, mask.shape[-1])).reshape(g * sq, -1)
        s = np.where(m, s, np.float32(-np.inf))
    mx = np.max(s, axis=-1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, np.float32(0))
    p = np.exp(np.subtract(s, mx, out=s), out=s)  # in place: one score array alive
    p /= np.sum(p, axis=-1, keepdims=True)
    o = np.matmul(p, v)
    return o.reshape(b, hq, sq, d)


#: the op's NNEF declaration: its registration (below), and what tools read of its parameters
SIGNATURE = (
    'fragment tract_transformers_quantized_kv_sdpa(q: tensor<scalar>, k: tensor<scalar>, '
    'v: tensor<scalar>, axis: integer = 2, scale: scalar = 0.0) -> (output: tensor<scalar>);'
)


@stateful(SIGNATURE, "tract_transformers", role="attention+kv", describe="tract fused u8 cache + attention")
class TractQuantizedKvSdpa(BufferCheckpoint):
    """State of one ``tract_transformers_quantized_kv_sdpa`` node (see module docstring)."""

    WHO = "tract_transformers_quantized_kv_sdpa"

    def __init__(self, axis: int = 2, scale: float | None = None) -> None:
        self.axis = int(axis)
        # a scale of 0 (the NNEF declaration's default) stands for "absent" like in tract
        self.scale = None if scale is None or float(scale) == 0.0 else float(scale)
        #: validation's boundary-flip probe, (keys, values) input noise; 0 reproduces tract
        self.flip_margin = (0.0, 0.0)
        self.flips = 0  # codes the probe moved
        self.reset()

    # ----------------------------------------------------------------------------- state
    def reset(self) -> None:
        self.b = 0
        self.hkv = 0
        self.d = 0
        self.len = 0
        self.k_codes: GrowBuffer | None = None
        self.v_codes: GrowBuffer | None = None
        self.v_params: GrowBuffer | None = None  # [n, T, 2] (lo, step) f32
        self.ch_lo = np.zeros((0, 0), np.float32)
        self.ch_step = np.zeros((0, 0), np.float32)

    def _init(self, b: int, hkv: int, d: int) -> None:
        n = b * hkv
        self.b, self.hkv, self.d = b, hkv, d
        self.k_codes = GrowBuffer((n,), (d,), np.uint8, growth=1.0, min_chunk=256)
        self.v_codes = GrowBuffer((n,), (d,), np.uint8, growth=1.0, min_chunk=256)
        self.v_params = GrowBuffer((n,), (2,), np.float32, growth=1.0, min_chunk=256)
        self.ch_lo = np.full((n, d), np.inf, np.float32)
        self.ch_step = np.ones((n, d), np.float32)

    @property
    def initialized(self) -> bool:
        return self.k_codes is not None

    # ----------------------------------------------------------------------------- pushes
    def _codes(self, x: np.ndarray, lo: np.ndarray, step: np.ndarray, margin: float = 0.0) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            r = (x - lo) / step
            q, moved = flip_at_boundary(r, round_half_away(r), step, margin)
            self.flips += moved
            r = np.clip(q, 0, 255)
        return np.nan_to_num(r, nan=0.0).astype(np.uint8)

    def _push_value(self, x: np.ndarray) -> None:
        """x: [n, D] f32, one token for every head."""
        lo = np.fmin.reduce(x, axis=-1, initial=np.inf).astype(np.float32)
        hi = np.fmax.reduce(x, axis=-1, initial=-np.inf).astype(np.float32)
        with np.errstate(invalid="ignore", over="ignore"):
            step = np.where(hi > lo, (hi - lo) / _LEVELS, np.float32(1.0)).astype(np.float32)
        codes = self._codes(x, lo[:, None], step[:, None], self.flip_margin[1])
        self.v_codes.append(codes[:, None, :])
        self.v_params.append(np.stack([lo, step], axis=-1)[:, None, :])

    def _push_key(self, x: np.ndarray) -> None:
        lo = np.where(x < self.ch_lo, x, self.ch_lo)
        with np.errstate(invalid="ignore", over="ignore"):
            rng = x - lo
            new_step = rng / _LEVELS
            grow = (rng > 0) & (new_step > self.ch_step)
        self.ch_step = np.where(grow, new_step, self.ch_step).astype(np.float32)
        self.ch_lo = lo.astype(np.float32)
        codes = self._codes(x, self.ch_lo, self.ch_step, self.flip_margin[0])
        self.k_codes.append(codes[:, None, :])

    # ----------------------------------------------------------------------------- reads
    def dequantized(self) -> tuple[np.ndarray, np.ndarray]:
        """The whole cache as tract reads it: K, V ``[B, Hkv, T, D]`` f32."""
        t, d = self.len, self.d
        kc = self.k_codes.view().astype(np.float32)
        k = self.ch_lo[:, None, :] + kc * self.ch_step[:, None, :]
        vp = self.v_params.view()
        v = vp[:, :, 0:1] + self.v_codes.view().astype(np.float32) * vp[:, :, 1:2]
        return k.reshape(self.b, self.hkv, t, d), v.reshape(self.b, self.hkv, t, d)

    def __call__(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        out_dtype = np.asarray(q).dtype
        q32, k32, v32 = (np.asarray(a, dtype=np.float32) for a in (q, k, v))
        b, hq, sq, hkv, snew, d = check_qkv(self.WHO, q32, k32, v32)
        if not self.initialized:
            self._init(b, hkv, d)
        elif (b, hkv, d) != (self.b, self.hkv, self.d):
            raise InputError(
                f"{self.WHO}: k {k32.shape} does not match the cache built for B={self.b}, "
                f"Hkv={self.hkv}, D={self.d}"
            )
        kn = k32.reshape(b * hkv, snew, d)
        vn = v32.reshape(b * hkv, snew, d)
        for t in range(snew):  # tract pushes token by token (the key range is running)
            self._push_key(kn[:, t, :])
            self._push_value(vn[:, t, :])
        self.len += snew
        if self.len == 0:
            return np.zeros(q32.shape, dtype=out_dtype)
        kf, vf = self.dequantized()
        scale = self.scale if self.scale is not None else float(np.sqrt(np.float32(1.0) / np.float32(d)))
        out = softmax_attention(q32, kf, vf, scale)
        return out.astype(out_dtype)

    QUANTIZED = True
    #: every token is quantized as it arrives: no full-precision window
    fp_window = 0

    def stepwise(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """One-token calls, one per new token (tract's multi-token call has no causal mask and codes
        every key under the running range, so only a loop gives one-token semantics)."""
        return stepwise_loop(self, q, k, v, axis=2)

    window_text = "no full-precision window"

    def reads_quantized(self, n: int, stepwise: bool = True) -> np.ndarray:
        """Every cached token is read quantized, the call's own included."""
        return self.len + (np.arange(1, n + 1) if stepwise else np.full(n, n))

    def census(self) -> dict[str, int]:
        return {"tokens": int(self.len), "quantized": int(self.len), "full_precision": 0,
                "f32_bytes": 8 * self.b * self.hkv * self.len * self.d}

    # ----------------------------------------------------------------------------- protocol
    # checkpoint / rollback (BufferCheckpoint): pushes replace ch_lo / ch_step, never write into them
    _CHECKPOINT_ATTRS = ("len", "ch_lo", "ch_step")

    def _buffers(self) -> list[GrowBuffer]:
        return [self.k_codes, self.v_codes, self.v_params] if self.initialized else []  # type: ignore[list-item]

    def state_tensors(self) -> dict[str, np.ndarray]:
        if not self.initialized:
            return {"shape": np.zeros(4, np.int64)}
        return {
            "shape": np.array([self.b, self.hkv, self.d, self.len], np.int64),
            "k_codes": self.k_codes.view().copy(),
            "k_lo": self.ch_lo.copy(),
            "k_step": self.ch_step.copy(),
            "v_codes": self.v_codes.view().copy(),
            "v_params": self.v_params.view().copy(),
        }

    def load_state_tensors(self, tensors: dict[str, np.ndarray]) -> None:
        shape = expect_state(tensors, "shape", (4,), np.int64, self.WHO)
        b, hkv, d, t = (int(x) for x in shape)
        if min(b, hkv, d, t) < 0:
            raise StateError(f"{self.WHO}: negative sizes in state shape {shape.tolist()}")
        self.reset()
        if b == 0:
            return
        n = b * hkv
        kc = expect_state(tensors, "k_codes", (n, t, d), np.uint8, self.WHO)
        lo = expect_state(tensors, "k_lo", (n, d), np.float32, self.WHO)
        st = expect_state(tensors, "k_step", (n, d), np.float32, self.WHO)
        vc = expect_state(tensors, "v_codes", (n, t, d), np.uint8, self.WHO)
        vp = expect_state(tensors, "v_params", (n, t, 2), np.float32, self.WHO)
        self._init(b, hkv, d)
        self.k_codes.set_exact(kc)
        self.v_codes.set_exact(vc)
        self.v_params.set_exact(vp)
        self.ch_lo = lo.copy()
        self.ch_step = st.copy()
        self.len = t

    def nbytes(self) -> dict[str, int]:
        n_values = 2 * self.b * self.hkv * self.len * self.d
        if not self.initialized:
            return {"codes": 0, "params": 0, "full_precision": 0, "f32_equivalent": 0, "f16_equivalent": 0}
        return {
            "codes": self.k_codes.nbytes + self.v_codes.nbytes,
            "params": self.v_params.nbytes + self.ch_lo.nbytes + self.ch_step.nbytes,
            "full_precision": 0,
            "f32_equivalent": 4 * n_values,
            "f16_equivalent": 2 * n_values,
        }
