"""The rotated-codebook KV cache + attention of ``nnef_kv_rotated_sdpa`` (NumPy, no graph needed).

Storage, per (batch, kv head), in sequence order::

    [ sinks (f32/f16, forever) | coded tokens (packed codes + one f16 norm a vector) | window (f32/f16) ]

* Every key and every value vector ``x`` (``D`` values of one head and token) is rotated by the op's fixed
  orthogonal matrix ``R`` (:func:`nnef_kv.kv.rotated.codebooks.rotation`: a random-sign Hadamard for a power-of-two
  ``D``, else a random orthogonal matrix, both from ``seed``; the same ``R`` for every head of the op),
  normalised, and each coordinate of ``u = x R / |x|`` is coded against the Lloyd-Max codebook of the
  exact coordinate marginal of a unit vector in ``D`` dimensions (:func:`nnef_kv.kv.rotated.codebooks.codebook`:
  ``key_bits`` for keys, ``value_bits`` for values, 1..4 each, 0 = ``bits``; ``value_bits = 32``: values kept
  exactly in f32, the keys alone coded, as published keys-only figures measure). The norm ``|x|`` is stored
  in f16 (nearest), the codes packed with :class:`~nnef_kv.kv.packing.RowCodec` (planar for 1, 2 and 4
  bits, a bitstream for 3). A vector reads back as ``norm * c[code]`` in the rotated basis.
* ``residual`` (default 0): the newest ``residual`` tokens stay in full precision, each coded when it
  leaves the window (exactly ``min(T - sinks, residual)`` are held); ``sinks``: the first tokens are never
  coded. What a call reads follows the KIVI op: the tokens coded before the call through their codes,
  the sinks, the window *and the call's own tokens* in full precision (a prompt attends exactly). In a
  :meth:`~RotatedSdpa.stepwise` run row ``i`` (position ``p``) reads as its one-token call would: the tokens
  ``sinks <= j < p - residual`` through their codes, the others exactly.
* **Non-finite values.** Rotation mixes the ``D`` coordinates, so one NaN or Inf would spoil every code of
  its vector: a vector holding a non-finite value, or whose norm f16 cannot hold (``> 65504``), is kept
  exactly in a side table (head, position, the ``D`` values in f32; counted in ``nbytes()['full_precision']``
  and on their own in ``['outliers']``), coded 0 with norm 0, and attention uses its exact values: a NaN key
  makes that token's score NaN (every output row seeing it NaN, as exact attention), a NaN value makes the
  outputs of the rows that see it NaN; a row that does not see the token is unaffected.

**Attention straight from the codes** (:mod:`nnef_kv.kv.rotated.kernels`): the queries are rotated
once per call, ``q~ = q R``; the score of a coded token is ``scale * norm_t * sum_j q~_j c[code_tj]`` (a
table lookup); the coded values are accumulated in the rotated basis, ``sum_t p_t norm_t c[code_t]``, and
rotated back once (``@ R.T``); sinks and window are read exactly in the original basis; one softmax over all
of them (exact f32, GQA, causal bottom-right aligned as the KIVI op). The two loops over the codes are numba
kernels beside their NumPy references (``NNEF_KV_NO_NUMBA=1`` runs the references).

The class works without a graph: ``op = RotatedSdpa(scale=0.125, bits=3); y = op(q, k, v)``; it is
registered as ``nnef_kv_rotated_sdpa`` (:data:`SIGNATURE`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import GraphError, InputError, StateError
from ...core.registry import stateful
from . import kernels as RA
from .codebooks import MAX_BITS, boundaries, codebook, rotation
from ..common import BufferCheckpoint, GrowBuffer, expect_config_and_shape, expect_state, f16_to_f32, start_call
from ..kivi.parts import rotate
from ..packing import RowCodec
from ..settings import IntSetting, Problem, first_problem

__all__ = ["RotatedConfig", "RotatedSdpa", "ROTATED_SETTINGS", "rotated_problem"]

F16_MAX = 65504.0
#: the numba loops serve calls of at most this many query rows a kv head (decode steps, GQA); more rows
#: (a stepwise chunk, a prefill) decode the codes once and use BLAS (the kernels' references), faster there
KERNEL_ROWS = 32
STATE_LAYOUT = 1
SINK_CHUNK = 256
#: ``value_bits`` of values kept exactly (f32 rows, original basis): the keys alone are coded
EXACT_BITS = 32

#: the integer settings of the op; scheme ``rotated`` checks its options with :func:`rotated_problem` too
ROTATED_SETTINGS = {"bits": IntSetting(1, MAX_BITS, reason=f"scheme rotated takes 1..{MAX_BITS} bits"),
                    "key_bits": IntSetting(0, MAX_BITS, reason=f"0 (= bits) or 1..{MAX_BITS}"),
                    "value_bits": IntSetting(0, EXACT_BITS, allowed=(*range(MAX_BITS + 1), EXACT_BITS),
                                             reason=f"0 (= bits), 1..{MAX_BITS}, or {EXACT_BITS} (values kept "
                                                    f"exactly in f32: keys-only quantization)"),
                    "residual": IntSetting(0), "sinks": IntSetting(0), "seed": IntSetting(0)}


def rotated_problem(**values: object) -> Problem | None:
    """The first bad rotated setting among ``values`` (names of :data:`ROTATED_SETTINGS`), or None."""
    return first_problem(values, ROTATED_SETTINGS)


@dataclass(frozen=True)
class RotatedConfig:
    """The op's attributes (names as in the NNEF declaration)."""

    scale: float = 0.125
    bits: int = 4
    key_bits: int = 0
    value_bits: int = 0
    residual: int = 0
    sinks: int = 0
    is_causal: bool = True
    seed: int = 0

    kbits = property(lambda self: self.key_bits or self.bits)
    vbits = property(lambda self: self.value_bits or self.bits)

    def validate(self, who: str) -> None:
        bad = rotated_problem(bits=self.bits, key_bits=self.key_bits, value_bits=self.value_bits,
                              residual=self.residual, sinks=self.sinks, seed=self.seed)
        if bad is not None:
            raise GraphError(f"{who}: {bad}")
        if not np.isfinite(self.scale):
            raise GraphError(f"{who}: scale must be finite, got {self.scale}")

    def as_array(self) -> np.ndarray:
        return np.array([self.kbits, self.vbits, self.residual, self.sinks, self.seed, STATE_LAYOUT], np.int64)


class _F32Rows:
    """The "codec" of values kept exactly (``value_bits = 32``): a vector's ``D`` f32 values as ``4 D`` bytes."""

    def __init__(self, d: int) -> None:
        self.row_bytes = 4 * d

    @staticmethod
    def pack(x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x, np.float32).view(np.uint8)

    @staticmethod
    def unpack(codes: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(codes).view(np.float32)


def _codec(bits: int, d: int) -> RowCodec | _F32Rows:
    return _F32Rows(d) if bits == EXACT_BITS else RowCodec(bits, d)


class _Coded:
    """The coded vectors of K or V: packed codes ``[n, T, row_bytes]``, f16 norms ``[n, T]`` and the exact
    side table (``idx`` ``[m, 2]`` = head, coded index; ``val`` ``[m, D]`` f32). With ``bits = 32``
    (:data:`EXACT_BITS`, values only) the "codes" are the vectors' f32 values themselves in the original basis,
    the norms 1 and no side table (a non-finite value is held as it is)."""

    def __init__(self, bits: int, n: int, d: int) -> None:
        self.bits, self.d = bits, d
        self.exact = bits == EXACT_BITS
        self.codec = _codec(bits, d)
        self.cb = None if self.exact else codebook(bits, d)
        self.bnd = None if self.exact else boundaries(self.cb)
        g = 1.03125
        self.codes = GrowBuffer((n,), (self.codec.row_bytes,), np.uint8, growth=g, min_chunk=64)
        self.norms = GrowBuffer((n,), (), np.float16, growth=g, min_chunk=64)
        self.idx = GrowBuffer((), (2,), np.int64, min_chunk=8)
        self.val = GrowBuffer((), (d,), np.float32, min_chunk=8)

    def buffers(self) -> list[GrowBuffer]:
        return [self.codes, self.norms, self.idx, self.val]

    def encode(self, x: np.ndarray, rot: np.ndarray):
        """``x [n, S, D]`` f32 (original basis) -> (packed codes, f16 norms, outlier (head, token) pairs,
        their exact rows)."""
        if self.exact:
            none = np.zeros(0, np.int64)
            return (self.codec.pack(x), np.ones(x.shape[:2], np.float16), none, none,
                    np.zeros((0, self.d), np.float32))
        with np.errstate(over="ignore", invalid="ignore"):
            norm = np.sqrt(np.einsum("nsd,nsd->ns", x.astype(np.float64), x.astype(np.float64)))
            bad = ~np.isfinite(norm) | (norm > F16_MAX)
            ok_norm = np.where(bad, 0.0, norm)
            n16 = ok_norm.astype(np.float16)
            xr = rotate(np.where(bad[..., None], np.float32(0), x), rot)
            u = xr / np.where(ok_norm > 0, ok_norm, 1.0)[..., None].astype(np.float32)
        codes = np.searchsorted(self.bnd, u).astype(np.uint8)
        h, t = np.nonzero(bad)
        return self.codec.pack(codes), n16, h, t, x[h, t].astype(np.float32)

    def append(self, enc, start: int) -> None:
        packed, n16, h, t, rows = enc
        self.codes.append(packed)
        self.norms.append(n16)
        if h.size:
            self.idx.append(np.stack([h, t + start], axis=1).astype(np.int64))
            self.val.append(rows)

    @property
    def nbytes(self) -> tuple[int, int, int]:
        """(codes, params, outlier) bytes held."""
        return self.codes.nbytes, self.norms.nbytes, self.idx.nbytes + self.val.nbytes


def _add_exact(out: np.ndarray, p: np.ndarray, values: np.ndarray) -> None:
    """``out += p @ values`` (``[n, m, F] @ [n, F, D]``, f32), a non-finite value reaching only the rows that
    see its token (no ``0 * NaN``)."""
    bad = ~np.isfinite(values)
    if not bad.any():
        out += np.matmul(p, values)
        return
    out += np.matmul(p, np.where(bad, np.float32(0), values))
    hh, tt = np.nonzero(bad.any(axis=2))
    for h, t in zip(hh, tt):
        pe = p[h, :, t]
        out[h] += np.where((pe > 0)[:, None], pe[:, None] * values[h, t][None, :], np.float32(0))


#: the op's NNEF declaration: its registration (below), and what tools read of its parameters
SIGNATURE = (
    'fragment nnef_kv_rotated_sdpa(q: tensor<scalar>, k: tensor<scalar>, v: tensor<scalar>, '
    'axis: integer = 2, scale: scalar = 0.125, bits: integer = 4, key_bits: integer = 0, '
    'value_bits: integer = 0, residual: integer = 0, sinks: integer = 0, is_causal: logical = true, '
    'seed: integer = 0) -> (output: tensor<scalar>);'
)


@stateful(SIGNATURE, "nnef_kv", role="attention+kv",
          describe="nnef-kv rotated-codebook cache (Hadamard + Lloyd-Max, 1..4 bits, f16 norms) + attention")
class RotatedSdpa(BufferCheckpoint):
    """State of one ``nnef_kv_rotated_sdpa`` node (see the module docstring)."""

    WHO = "nnef_kv_rotated_sdpa"
    QUANTIZED = True

    def __init__(self, axis: int = 2, scale: float = 0.125, bits: int = 4, key_bits: int = 0, value_bits: int = 0,
                 residual: int = 0, sinks: int = 0, is_causal: bool = True, seed: int = 0, threads: int = 1) -> None:
        if int(axis) != 2:
            raise GraphError(f"{self.WHO}: only axis 2 of [B, H, S, D] is supported, got {axis}")
        self.axis = 2
        self.cfg = RotatedConfig(scale=float(scale), bits=int(bits), key_bits=int(key_bits),
                                 value_bits=int(value_bits), residual=int(residual), sinks=int(sinks),
                                 is_causal=bool(is_causal), seed=int(seed))
        self.cfg.validate(self.WHO)
        self.threads = max(1, int(threads))  # threads of the numba loops over the codes (not an NNEF attribute)
        self.reset()

    # ================================================================================== state
    def reset(self) -> None:
        self.b = self.hkv = self.d = 0
        self.fp_dtype = np.dtype(np.float32)
        self.len = 0
        self._ready = False

    def _init(self, b: int, hkv: int, d: int, fp_dtype: np.dtype) -> None:
        c = self.cfg
        n = b * hkv
        self.b, self.hkv, self.d = b, hkv, d
        self.fp_dtype = np.dtype(fp_dtype)
        self.rot = rotation(d, c.seed)
        self.kc = _Coded(c.kbits, n, d)
        self.vc = _Coded(c.vbits, n, d)
        sink_chunk, cap = max(1, min(c.sinks, SINK_CHUNK)), max(1, min(c.residual, SINK_CHUNK))
        self.sink_k = GrowBuffer((n,), (d,), self.fp_dtype, min_chunk=sink_chunk)
        self.sink_v = GrowBuffer((n,), (d,), self.fp_dtype, min_chunk=sink_chunk)
        self.res_k = GrowBuffer((n,), (d,), self.fp_dtype, min_chunk=cap)
        self.res_v = GrowBuffer((n,), (d,), self.fp_dtype, min_chunk=cap)
        self._ready = True

    @property
    def n_quant(self) -> int:
        return self.kc.codes.len if self._ready else 0

    @property
    def n_sink(self) -> int:
        return self.sink_k.len if self._ready else 0

    @property
    def n_res(self) -> int:
        return self.res_k.len if self._ready else 0

    # ============================================================================== entry points
    def __call__(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """One call: ``q`` attends to the tokens coded before the call through their codes and to sinks,
        window and the call's own tokens exactly; then the call's tokens are stored."""
        return self._run(q, k, v, stepwise=False)

    def stepwise(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """``S`` new tokens with one query row each, answered as ``S`` one-token calls would have been
        (causal whatever ``is_causal`` says), leaving the same state. Vectorised."""
        return self._run(q, k, v, stepwise=True)

    def _run(self, q, k, v, stepwise: bool) -> np.ndarray:
        fresh = not self._ready
        try:
            return self._call(q, k, v, stepwise)
        except BaseException:
            if fresh:
                self.reset()
            raise

    def _check_call(self, dims, q, k, v) -> None:
        for nm, t in (("q", q), ("k", k), ("v", v)):
            if t.dtype.kind not in "fiub":
                raise InputError(f"{self.WHO}: {nm} has dtype {t.dtype}, expected a float tensor")

    def _call(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, stepwise: bool) -> np.ndarray:
        q, k, v, (b, hq, sq, hkv, snew, d), out_dtype = start_call(self, q, k, v, self._check_call)
        if stepwise and sq != snew:
            raise InputError(f"{self.WHO}: a stepwise call needs one query row per new token, got {sq} "
                             f"queries for {snew} tokens")
        c = self.cfg
        n, g = b * hkv, hq // hkv
        with np.errstate(over="ignore"):
            ks = k.reshape(n, snew, d).astype(self.fp_dtype)
            vs = v.reshape(n, snew, d).astype(self.fp_dtype)
        total = self.len + snew
        ns_new = min(max(c.sinks - self.n_sink, 0), snew)
        sk = np.concatenate([self.sink_k.view(), ks[:, :ns_new]], axis=1)
        sv = np.concatenate([self.sink_v.view(), vs[:, :ns_new]], axis=1)
        wk = np.concatenate([self.res_k.view(), ks[:, ns_new:]], axis=1)
        wv = np.concatenate([self.res_v.view(), vs[:, ns_new:]], axis=1)
        nq = max(0, wk.shape[1] - c.residual)  # tokens leaving the window: coded
        tq0 = self.n_quant
        enc_k = self.kc.encode(wk[:, :nq].astype(np.float32), self.rot) if nq else None
        enc_v = self.vc.encode(wv[:, :nq].astype(np.float32), self.rot) if nq else None
        out = np.zeros(q.shape, out_dtype)
        if total and sq:
            qn = q.astype(np.float32, copy=False).reshape(n, g, sq, d)
            pos = total - sq + np.arange(sq)  # absolute position of each query row
            # the full-precision tokens a call reads: sinks, then window + its tokens (after the coded ones)
            w0 = sk.shape[1] + tq0
            fk = np.concatenate([sk, wk], axis=1)
            fv = np.concatenate([sv, wv], axis=1)
            fpos = np.concatenate([np.arange(sk.shape[1]), w0 + np.arange(wk.shape[1])])
            if stepwise:  # row i reads coded j in [sinks, p - r): the codes of this call's leavers too
                qcount = np.clip(pos - c.residual - sk.shape[1], 0, tq0 + nq)
                fkeep = (fpos[None, :] <= pos[:, None]) & ((fpos[None, :] < sk.shape[1])
                                                            | (fpos[None, :] >= pos[:, None] - c.residual))
                coded = self._coded_view(enc_k, enc_v, tq0 + nq)
            else:
                qcount = np.full(sq, tq0)
                fkeep = (fpos[None, :] <= pos[:, None]) if c.is_causal and sq > 1 else None
                coded = self._coded_view(None, None, tq0)
            with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
                res = self._attend(qn, coded, qcount, fk, fv, fkeep)
            out = res.reshape(q.shape).astype(out_dtype)
        # commit (nothing above wrote into the state)
        if ns_new:
            self.sink_k.append(ks[:, :ns_new])
            self.sink_v.append(vs[:, :ns_new])
        if nq:
            self.kc.append(enc_k, tq0)
            self.vc.append(enc_v, tq0)
            self.res_k.set_exact(wk[:, nq:])
            self.res_v.set_exact(wv[:, nq:])
        elif wk.shape[1] != self.n_res:
            self.res_k.adopt(np.ascontiguousarray(wk))
            self.res_v.adopt(np.ascontiguousarray(wv))
        self.len = total
        return out

    def _coded_view(self, enc_k, enc_v, count: int) -> dict:
        """The coded part a call reads: the stored codes (plus ``enc_k / enc_v``, this call's leavers)."""
        views = {}
        for name, part, enc in (("k", self.kc, enc_k), ("v", self.vc, enc_v)):
            codes, norms = part.codes.view(), part.norms.view()
            idx, val = part.idx.view(), part.val.view()
            if enc is not None:
                t0 = codes.shape[1]
                codes = np.concatenate([codes, enc[0]], axis=1)
                norms = np.concatenate([norms, enc[1]], axis=1)
                if enc[2].size:
                    idx = np.concatenate([idx, np.stack([enc[2], enc[3] + t0], axis=1)])
                    val = np.concatenate([val, enc[4]])
            views[name] = (codes[:, :count], norms[:, :count], idx, val, part)
        return views

    # =============================================================================== attention
    def _attend(self, q: np.ndarray, coded: dict, qcount: np.ndarray, fk: np.ndarray, fv: np.ndarray,
                fkeep: np.ndarray | None) -> np.ndarray:
        """q ``[n, g, Sq, D]`` f32; coded tokens ``0 .. qcount[i]`` for row ``i``; full-precision ``fk, fv``
        ``[n, F, D]`` seen where ``fkeep [Sq, F]`` (None: all). Returns ``[n, g, Sq, D]`` f32."""
        n, g, sq, d = q.shape
        scale = np.float32(self.cfg.scale)
        kcodes, knorm, kidx, kval, kpart = coded["k"]
        vcodes, vnorm, vidx, vval, vpart = coded["v"]
        tq = kcodes.shape[1]
        m = g * sq
        q2 = q.reshape(n, m, d)
        parts_s = []
        if tq:
            qr = np.matmul(q2, self.rot)  # the query rotated once (BLAS: it is not stored)
            kn = f16_to_f32(knorm)
            scores_fn = RA.code_scores if m <= KERNEL_ROWS else RA.code_scores.reference
            s_q = scores_fn(qr, kcodes, kn, kpart.cb, kpart.bits, d, self.threads)
            s_q *= scale
            if kidx.shape[0]:  # exact scores of the vectors kept exactly
                h, t = kidx[:, 0], kidx[:, 1]
                sel = t < tq
                h, t, rows = h[sel], t[sel], kval[sel]
                s_q[h, :, t] = np.einsum("emd,ed->em", q2[h], rows) * scale
            qc = np.repeat(qcount[None, :], g, axis=0).reshape(m)  # row r = (head i, query r % sq)
            if (qc < tq).any():
                s_q[:, np.arange(tq)[None, :] >= qc[:, None]] = -np.inf
            parts_s.append(s_q)
        fkf = fk.astype(np.float32)
        s_f = np.matmul(q2, fkf.swapaxes(1, 2)) * scale if fk.shape[1] else np.zeros((n, m, 0), np.float32)
        keep_f = None
        if fkeep is not None and fk.shape[1]:
            keep_f = np.tile(fkeep, (g, 1))
            s_f[:, ~keep_f] = -np.inf
        s = np.concatenate(parts_s + [s_f], axis=2) if fk.shape[1] or not parts_s else parts_s[0]
        mx = s.max(axis=2, keepdims=True) if s.shape[2] else np.zeros((n, m, 1), np.float32)
        mx = np.where(np.isneginf(mx), np.float32(0), mx)
        p = np.exp(np.subtract(s, mx, out=s), out=s)  # s is this call's own array
        den = p.sum(axis=2, keepdims=True)
        out = np.zeros((n, m, d), np.float32)
        if tq and vpart.exact:  # keys-only quantization: the values as they came
            _add_exact(out, p[:, :, :tq], vpart.codec.unpack(vcodes))
        elif tq:
            p_q = p[:, :, :tq]
            w = p_q * f16_to_f32(vnorm)[:, None, :]
            values_fn = RA.code_values if m <= KERNEL_ROWS else RA.code_values.reference
            out_rot = values_fn(w, vcodes, vpart.cb, vpart.bits, d, self.threads)
            out += np.matmul(out_rot, self.rot.T)
            if vidx.shape[0]:
                h, t = vidx[:, 0], vidx[:, 1]
                sel = t < tq
                h, t, rows = h[sel], t[sel], vval[sel]
                pe = p_q[h, :, t]  # [e, m]
                seen = pe > 0
                contrib = np.where(seen[:, :, None], pe[:, :, None] * rows[:, None, :], np.float32(0))
                np.add.at(out, h, contrib)
        if fk.shape[1]:
            _add_exact(out, p[:, :, tq:], fv.astype(np.float32))
        return (out / den).reshape(n, g, sq, d)

    def attend_cache(self, q: np.ndarray) -> np.ndarray:
        """The attention of ``q [B, Hq, Sq, D]`` over the cache as it is (no token stored, nothing changed): the
        attention part of a decode step (``benchmarks/kv_speed.py`` times it), causal rows bottom-right
        aligned on the tokens held."""
        q = np.asarray(q)
        if not self._ready or q.ndim != 4 or q.shape[0] != self.b or q.shape[3] != self.d or q.shape[1] % self.hkv:
            raise InputError(f"{self.WHO}: attend_cache needs q [B={self.b}, a multiple of {self.hkv}, S, "
                             f"D={self.d}] on a cache holding tokens, got {q.shape}")
        n, g, sq = self.b * self.hkv, q.shape[1] // self.hkv, q.shape[2]
        fk = np.concatenate([self.sink_k.view(), self.res_k.view()], axis=1)
        fv = np.concatenate([self.sink_v.view(), self.res_v.view()], axis=1)
        fpos = np.concatenate([np.arange(self.n_sink), self.n_sink + self.n_quant + np.arange(self.n_res)])
        pos = self.len - sq + np.arange(sq)
        fkeep = (fpos[None, :] <= pos[:, None]) if self.cfg.is_causal and sq > 1 else None
        qcount = np.clip(pos + 1 - self.n_sink, 0, self.n_quant) if fkeep is not None else np.full(sq, self.n_quant)
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            out = self._attend(q.astype(np.float32, copy=False).reshape(n, g, sq, self.d),
                               self._coded_view(None, None, self.n_quant), qcount, fk, fv, fkeep)
        return out.reshape(q.shape).astype(q.dtype if q.dtype in (np.float16, np.float32) else np.float32)

    # ================================================================================ protocol
    def _buffers(self) -> list[GrowBuffer]:
        if not self._ready:
            return []
        return [self.sink_k, self.sink_v, self.res_k, self.res_v] + self.kc.buffers() + self.vc.buffers()

    def state_tensors(self) -> dict[str, np.ndarray]:
        cfg = self.cfg.as_array()
        if not self._ready:
            return {"config": cfg, "shape": np.zeros(5, np.int64)}
        st = {"config": cfg,
              "shape": np.array([self.b, self.hkv, self.d, self.len, int(self.fp_dtype == np.float16)], np.int64),
              "sink_k": self.sink_k.view().copy(), "sink_v": self.sink_v.view().copy(),
              "res_k": self.res_k.view().copy(), "res_v": self.res_v.view().copy()}
        for nm, part in (("k", self.kc), ("v", self.vc)):
            st[f"{nm}_codes"] = part.codes.view().copy()
            st[f"{nm}_norm"] = part.norms.view().copy()
            st[f"{nm}_out_idx"] = part.idx.view().copy()
            st[f"{nm}_out_val"] = part.val.view().copy()
        return st

    def load_state_tensors(self, tensors: dict[str, np.ndarray]) -> None:
        who = self.WHO
        shape = expect_config_and_shape(tensors, who, self.cfg.as_array(),
                                        "key bits, value bits, residual, sinks, seed, state layout")
        b, hkv, d, t, f16 = (int(x) for x in shape)
        if min(b, hkv, d, t) < 0 or f16 not in (0, 1) or (b == 0) != (hkv == 0 or d == 0) or (b == 0 and t):
            raise StateError(f"{who}: state tensor 'shape' holds an invalid [B, Hkv, D, T, f16] {shape.tolist()}")
        if b == 0:
            self.reset()
            return
        c = self.cfg
        n = b * hkv
        ns = min(t, c.sinks)
        nr = min(t - ns, c.residual)
        tq = t - ns - nr
        fp = np.dtype(np.float16 if f16 else np.float32)
        arrays = {nm: expect_state(tensors, nm, (n, cnt, d), fp, who)
                  for nm, cnt in (("sink_k", ns), ("sink_v", ns), ("res_k", nr), ("res_v", nr))}
        for nm, bits in (("k", c.kbits), ("v", c.vbits)):
            codec = _codec(bits, d)
            codes = expect_state(tensors, f"{nm}_codes", (n, tq, codec.row_bytes), np.uint8, who)
            if tq and not np.array_equal(codec.pack(codec.unpack(codes[:, :1])), codes[:, :1]):
                raise StateError(f"{who}: {nm}_codes are not valid {bits}-bit packed codes")
            norms = expect_state(tensors, f"{nm}_norm", (n, tq), np.float16, who)
            if not np.all(np.isfinite(norms)) or np.any(norms < 0):
                raise StateError(f"{who}: state tensor '{nm}_norm' holds non-finite or negative norms")
            idx = expect_state(tensors, f"{nm}_out_idx", None, np.int64, who)
            if idx.ndim != 2 or idx.shape[1] != 2 or (idx.size and (idx[:, 0].min() < 0 or idx[:, 0].max() >= n
                                                                   or idx[:, 1].min() < 0 or idx[:, 1].max() >= tq)):
                raise StateError(f"{who}: state tensor '{nm}_out_idx' must be [m, 2] (head < {n}, token < {tq})")
            val = expect_state(tensors, f"{nm}_out_val", (idx.shape[0], d), np.float32, who)
            arrays.update({f"{nm}_codes": codes, f"{nm}_norm": norms, f"{nm}_out_idx": idx, f"{nm}_out_val": val})
        self.reset()
        self._init(b, hkv, d, fp)
        for nm in ("sink_k", "sink_v", "res_k", "res_v"):
            getattr(self, nm).set_exact(arrays[nm])
        for nm, part in (("k", self.kc), ("v", self.vc)):
            for buf, key in ((part.codes, "codes"), (part.norms, "norm"), (part.idx, "out_idx"),
                             (part.val, "out_val")):
                arr = arrays[f"{nm}_{key}"]
                buf.reserve(arr.shape[buf.axis])
                buf.append(arr)
        self.len = t

    @property
    def fp_window(self) -> int:
        """The most tokens a query reads in full precision between calls (sinks + residual)."""
        return self.cfg.sinks + self.cfg.residual

    @property
    def window_text(self) -> str:
        c = self.cfg
        if not (c.residual or c.sinks):
            return "no full-precision window (every earlier token read through its codes)"
        return f"residual {c.residual}" + (f" + sinks {c.sinks}" if c.sinks else "")

    def reads_quantized(self, n: int, stepwise: bool = True) -> np.ndarray:
        """Coded tokens the query of each of the next ``n`` tokens reads: in one call those coded before
        it; stepwise, row ``i`` those at ``sinks <= j < len + i - residual``."""
        c = self.cfg
        if not stepwise:
            return np.full(n, self.n_quant, np.int64)
        return np.maximum(0, self.len + np.arange(n, dtype=np.int64) - c.residual - c.sinks)

    def census(self) -> dict[str, int]:
        return {"tokens": int(self.len), "quantized": int(self.n_quant),
                "full_precision": int(self.n_sink + self.n_res), "f32_bytes": 8 * self.b * self.hkv * self.len * self.d}

    def nbytes(self) -> dict[str, int]:
        """Bytes of the arrays held (allocated capacity included): ``codes`` the packed codes, ``params`` the
        f16 norms, ``full_precision`` sinks + window + the exact side table (``outliers`` repeats its share)."""
        if not self._ready:
            return {"codes": 0, "params": 0, "full_precision": 0, "outliers": 0,
                    "f32_equivalent": 0, "f16_equivalent": 0}
        kc, kp, ko = self.kc.nbytes
        vc, vp, vo = self.vc.nbytes
        n_values = 2 * self.b * self.hkv * self.len * self.d
        fp = self.sink_k.nbytes + self.sink_v.nbytes + self.res_k.nbytes + self.res_v.nbytes
        if self.vc.exact:  # values kept exactly (value_bits 32): full precision, their unit norms with them
            fp, vc, vp = fp + vc + vp, 0, 0
        return {"codes": kc + vc, "params": kp + vp, "full_precision": fp + ko + vo, "outliers": ko + vo,
                "f32_equivalent": 4 * n_values, "f16_equivalent": 2 * n_values}

    # ================================================================================ helpers
    def dequantized(self) -> tuple[np.ndarray, np.ndarray]:
        """K and V ``[B, Hkv, T, D]`` f32 in the *original* basis as the attention reads them now (coded tokens
        decoded and rotated back, outliers exact); for tests and measurements."""
        if not self._ready:
            z = np.zeros((0, 0, 0, 0), np.float32)
            return z, z
        outs = []
        for part, sink, res in ((self.kc, self.sink_k, self.res_k), (self.vc, self.sink_v, self.res_v)):
            codes = part.codec.unpack(part.codes.view())
            x = codes.copy() if part.exact else (part.cb[codes] * f16_to_f32(part.norms.view())[..., None]) @ self.rot.T
            idx = part.idx.view()
            if idx.shape[0]:
                x[idx[:, 0], idx[:, 1]] = part.val.view()
            outs.append(np.concatenate([sink.view().astype(np.float32), x, res.view().astype(np.float32)], axis=1)
                        .reshape(self.b, self.hkv, self.len, self.d))
        return outs[0], outs[1]
