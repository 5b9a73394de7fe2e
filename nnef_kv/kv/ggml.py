"""llama.cpp's (ggml's) 32-value block quantizers, reproduced bit-exactly in NumPy.

Types: ``q8_0``, ``q4_0``, ``q4_1``, ``q5_0``, ``q5_1`` and ``iq4_nl`` -- the KV-cache types of
llama.cpp. Values are cut into blocks of 32 along the last axis (the head dimension for a KV cache),
which must be a multiple of 32. :func:`quantize` returns :class:`GgmlBlocks`, whose ``data`` is a
``uint8`` array ``[..., nblocks, block_bytes]`` holding exactly ggml's block structs (little endian):

========  =====  ==========================================================  ===============
type      bytes  layout                                                      value
========  =====  ==========================================================  ===============
q8_0      34     f16 d, 32 x int8 q                                          d*q
q4_0      18     f16 d, 16 bytes: byte j = code j (low nibble), j+16 (high)  d*(code-8)
q4_1      20     f16 d, f16 m, 16 bytes as q4_0                              d*code + m
q5_0      22     f16 d, u32 qh (bit k = bit 4 of code k), 16 bytes low bits  d*(code-16)
q5_1      24     f16 d, f16 m, u32 qh, 16 bytes                              d*code + m
iq4_nl    18     f16 d, 16 bytes of 4-bit indices as q4_0                    d*T[code]
========  =====  ==========================================================  ===============

with ``T = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)``.

API: :func:`quantize` ``(x, type) -> GgmlBlocks``, :func:`dequantize` ``(blocks) -> float32``,
:func:`bits_per_value` / :func:`block_bytes` ``(type)``. :class:`GgmlBlocks` holds ``type`` and ``data``;
``nbytes`` counts the bytes held, and ``scales()``, ``mins()``, ``codes()``, ``levels()`` decode the fields
(``value = scale * level (+ min)``) for attention kernels that work on the codes.

What "bit-exact" means here: for every block of finite values the bytes are those written by
``quantize_row_<type>_ref`` of ``ggml/src/ggml-quants.c`` built for x86-64 without FMA contraction
(ggml-base's default flags), and :func:`dequantize` gives the floats of ``dequantize_row_<type>``.
All arithmetic is float32, operation by operation as the C code does it:

* q8_0: ``amax = max|x|``, ``d = amax/127``, ``id = d ? 1/d : 0``, ``q = roundf(x*id)`` (round half
  away from zero, computed exactly -- not ``trunc(x + 0.5)``, which misrounds 0.49999997).
* q4_0 / q5_0: ``max`` is the first value of largest magnitude, *with its sign*, or ``+0.0`` if the
  block is all zeros (so an all-zero block stores ``d = -0.0``, f16 ``0x8000``); ``d = max/-8``
  (``/-16``), ``id = d ? 1/d : 0``, ``code = min(15, (int8)(x*id + 8.5))`` (31 and 16.5 for q5_0):
  a multiply, an add, then truncation toward zero.
* q4_1 / q5_1: ``min``/``max`` are the first minimum/maximum in the block (the sign of a zero
  minimum is that of the first zero), ``d = (max-min)/15`` (``/31``), ``id = d ? 1/d : 0``,
  ``code = min(15, (int8)((x-min)*id + 0.5))`` (q5_1: ``(uint8)((x-min)*id + 0.5)``, no clamp).
* iq4_nl (``quantize_row_iq4_nl_ref``, i.e. ``quantize_row_iq4_nl_impl`` with no importance weights
  and ``ntry = -1``): blocks with ``amax < 1e-15`` store ``d = 0`` and all indices 0. Otherwise
  ``d0 = max/-127`` (``max`` as for q4_0), ``id = 1/d0``, each index is ``best_index_int8(id*x)``
  (the nearest table entry, a tie going to the upper one, decided exactly as ``2*v >= T[i-1]+T[i]``),
  and the stored scale is the weighted least-squares ``d = sumqx/sumq2`` with weights ``x*x``, the sums
  accumulated sequentially in float32 (``sumqx += (w*q)*x``, ``sumq2 += (w*q)*q``). The indices are
  *not* recomputed with the refined ``d`` (that only happens for ``ntry > 0``). Values beyond about
  1.8e19 overflow ``x*x``, making ``d`` NaN -- in C as here.
* ``d`` and ``m`` go to f16 by round-to-nearest-even (ggml's ``ggml_compute_fp32_to_fp16``: overflow
  to +-inf, subnormals kept, NaN -> sign | 0x7E00); ``id`` is computed from the float32 ``d``, not
  from its f16 rounding.

Degenerate finite blocks follow the C code too: a tiny nonzero block whose ``1/d`` overflows to
infinity, and q4_1/q5_1 blocks whose range ``max - min`` overflows float32, hand NaN or +-inf to the
float->integer conversion, which is undefined behaviour in C. Here such a conversion yields 0 before
the clamp -- what x86-64 builds do (``cvttss2si`` returns 0x80000000, whose low byte is 0) and what
NumPy's cast gives there, so those bytes match llama.cpp on x86-64 and ``gguf.quants``. (Those blocks
store ``d = 0`` in f16, or an infinite ``d``, so the codes do not change the dequantized values much
anyway: zeros, or NaN.)

**NaN / Inf policy.** A block holding any NaN or +-Inf is stored *poisoned*: ``d = m = NaN``
(f16 ``0x7E00``) and every code 0 (all code bytes zero), so all 32 values of that block dequantize to
NaN, deterministically and with no warning; other blocks are unaffected. Why not what ggml does:

* q8_0/q4_x/q5_x: every such block reaches an undefined NaN/Inf -> int conversion in C (x86-64 turns
  it into code 0, i.e. a *finite* value: a NaN reads back as ``-8*d`` in q4_0, a NaN in q8_0 can even
  reset ``amax`` because ``MAX(amax, NaN)`` is NaN and ``MAX(NaN, v)`` is ``v``). Where C is defined
  the result agrees: with an Inf in a block C reads every finite value of the block back as NaN too
  (``d`` or ``m`` is infinite and the codes multiply it by 0). ``gguf.quants`` propagates the NaN
  into ``d``, so its dequantized blocks are all-NaN as well (its code bytes come from NumPy's
  undefined NaN cast).
* iq4_nl: C has no undefined step, but its answer changed over time: before llama.cpp PR 20460
  (March 2026) ``d = sumqx/sumq2`` was NaN (a NaN block, as here); since then ``sumq2 > 0`` fails and
  the block silently becomes ``d = 0``, all zeros. A KV cache should not turn NaN into zeros, so this
  module keeps the NaN. With an Inf, ggml's ``d`` is ``inf/inf = NaN``: same values as here, the index
  bytes differ.

Caveats on "bit-exact":

* Builds of ggml that contract ``x*id + 8.5f`` (and ``(x-min)*id + 0.5f``, iq4_nl's ``sumqx += w*q*x``)
  into fused multiply-adds -- GCC on aarch64, or x86-64 with an ``-march`` that has FMA -- differ near
  rounding midpoints (about 10% of the midpoint-heavy test blocks for q4_0/q5_0, a handful for the
  others). ``gguf`` 0.10-0.17 emulated that contraction for q4_0/q5_0 in float64; 0.18 went back to
  plain float32, which is what this module and ggml's default x86-64 build (ggml-base, no ``-march``)
  do.
* iq4_nl blocks with ``amax < 1e-15``: ggml versions without the ``memset(Lb, 0, block_size)`` in that
  branch leave the previous block's (or uninitialised) indices in the bytes; the values are 0 either way.
  ggml's two versions of ``best_index_int8`` (the float ``x - val[mu-1] < val[mu] - x`` binary search and
  the later exact ``x + x >= val[j-1] + val[j]`` one) agree on every finite input; they differ for NaN,
  which never reaches them here.
* The thread must not flush subnormals (FTZ/DAZ), as with C.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import InputError, StateError

__all__ = [
    "BLOCK_BYTES",
    "GGML_TYPES",
    "IQ4_NL_VALUES",
    "QK",
    "GgmlBlocks",
    "bits_per_value",
    "block_bytes",
    "dequantize",
    "quantize",
    "attn_rot_size",
    "hadamard_blocks",
    "walsh_hadamard",
]

QK = 32
"""Values per block (all six types)."""

BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24, "iq4_nl": 18}
"""Bytes per block of 32 values."""

GGML_TYPES = tuple(BLOCK_BYTES)

IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                         dtype=np.int8)
"""iq4_nl's non-linear table (``kvalues_iq4nl``)."""

_F16_NAN = 0x7E00
_HAS_MIN = ("q4_1", "q5_1")
# byte offsets of the parts of each block
_QS_OFFSET = {"q8_0": 2, "q4_0": 2, "q4_1": 4, "q5_0": 6, "q5_1": 8, "iq4_nl": 2}
_QH_OFFSET = {"q5_0": 2, "q5_1": 4}
# twice the midpoints between consecutive table entries, as float32 (exact small integers)
_IQ4_MID2 = (IQ4_NL_VALUES[:-1].astype(np.int32) + IQ4_NL_VALUES[1:]).astype(np.float32)
_IQ4_EPS = np.float32(1e-15)  # GROUP_MAX_EPS
_INT32_LIMIT = np.float32(2.0 ** 31)


def _check_type(type_: str) -> str:
    t = str(type_).lower()
    if t not in BLOCK_BYTES:
        raise InputError(f"ggml: unknown block type {type_!r}; expected one of {', '.join(GGML_TYPES)}")
    return t


def block_bytes(type_: str) -> int:
    """Bytes of one block of 32 values of ``type_``."""
    return BLOCK_BYTES[_check_type(type_)]


def bits_per_value(type_: str) -> float:
    """Storage bits per value all-in (scale and min included): 8.5, 4.5, 5.0, 5.5, 6.0, 4.5."""
    return BLOCK_BYTES[_check_type(type_)] * 8 / QK


# ----------------------------------------------------------------------------------- float helpers
def _f32_to_f16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> f16 bits like ``ggml_compute_fp32_to_fp16``: RNE, overflow to inf, NaN -> sign|0x7E00."""
    with np.errstate(all="ignore"):
        h = a.astype(np.float16).view(np.uint16)
    nan = np.isnan(a)
    if nan.any():
        sign = ((a.view(np.uint32) >> np.uint32(16)) & np.uint32(0x8000)).astype(np.uint16)
        h = np.where(nan, sign | np.uint16(_F16_NAN), h)
    return h


def _f16_bytes(bits: np.ndarray) -> np.ndarray:
    """uint16 [...] -> little-endian uint8 [..., 2]."""
    return bits.astype("<u2").view(np.uint8).reshape(bits.shape + (2,))


def _to_int_c(v: np.ndarray) -> np.ndarray:
    """C's float -> int conversion (truncation) as int32; NaN, +-inf and out-of-range give 0x80000000.

    That is x86-64's ``cvttss2si``; converting further to int8/uint8 keeps the low byte (0).
    """
    ok = np.abs(v) < _INT32_LIMIT  # False for NaN and +-inf
    t = np.trunc(np.where(ok, v, np.float32(0)))
    return np.where(ok, t.astype(np.int32), np.int32(-(2 ** 31)))


def _low_byte(i: np.ndarray) -> np.ndarray:
    """int32 -> its low byte as int32 in -128..127 (the C conversion to int8_t)."""
    return i.astype(np.int8).astype(np.int32)


def _roundf(v: np.ndarray) -> np.ndarray:
    """C ``roundf`` in float32: round half away from zero, exactly (NaN/inf pass through)."""
    a = np.abs(v)
    fl = np.floor(a)
    with np.errstate(invalid="ignore"):
        up = (a - fl) >= np.float32(0.5)  # a - fl is exact for float32
    r = fl + up.astype(np.float32)
    return np.copysign(r, v)


def _first_signed_absmax(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``amax`` and ``max`` of ggml's ``if (amax < fabsf(v)) { amax = fabsf(v); max = v; }`` loop."""
    ax = np.abs(x)
    i = np.argmax(ax, axis=-1)
    mx = np.take_along_axis(x, i[:, None], axis=-1)[:, 0]
    amax = np.take_along_axis(ax, i[:, None], axis=-1)[:, 0]
    return amax, np.where(amax > 0, mx, np.float32(0.0))  # never updated: max stays +0.0


def _first_min_max(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's ``if (v < min) min = v; if (v > max) max = v;``: the first minimum / maximum (sign of zeros kept)."""
    mn = np.take_along_axis(x, np.argmin(x, axis=-1)[:, None], axis=-1)[:, 0]
    mx = np.take_along_axis(x, np.argmax(x, axis=-1)[:, None], axis=-1)[:, 0]
    return mn, mx


def _inv(d: np.ndarray) -> np.ndarray:
    """``d ? 1.0f/d : 0.0f`` in float32 (may be +-inf for subnormal ``d``, as in C)."""
    nz = d != 0
    return np.where(nz, np.float32(1) / np.where(nz, d, np.float32(1)), np.float32(0))


def _pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """[n, 32] int32 codes -> [n, 16] bytes ``c[j] | c[j+16] << 4`` truncated to 8 bits."""
    return ((codes[:, :16] | (codes[:, 16:] << 4)) & 0xFF).astype(np.uint8)


def _pack_q5(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[n, 32] codes -> (qh [n, 4] bytes of the little-endian u32 of bit 4s, qs [n, 16])."""
    qs = ((codes[:, :16] & 0x0F) | ((codes[:, 16:] & 0x0F) << 4)).astype(np.uint8)
    qh = np.packbits(((codes >> 4) & 1).astype(np.uint8), axis=-1, bitorder="little")
    return qh, qs


def _best_index_iq4(v: np.ndarray) -> np.ndarray:
    """``best_index_int8(16, kvalues_iq4nl, v)``: nearest entry, ties upward, NaN -> 0."""
    v2 = v + v  # float32, may overflow to +-inf: still compares right
    idx = np.zeros(v.shape, np.int32)
    for m in _IQ4_MID2:
        idx += v2 >= m
    return idx


# ----------------------------------------------------------------------------- per-type quantizers
def _quant_q8_0(x: np.ndarray, out: np.ndarray) -> None:
    amax = np.max(np.abs(x), axis=-1)
    d = amax / np.float32(127)
    q = _low_byte(_to_int_c(_roundf(x * _inv(d)[:, None])))
    out[:, 0:2] = _f16_bytes(_f32_to_f16_bits(d))
    out[:, 2:] = q.astype(np.int8).view(np.uint8)


def _quant_sym(x: np.ndarray, out: np.ndarray, nmax: int) -> None:
    """q4_0 (nmax 8) and q5_0 (nmax 16)."""
    _, mx = _first_signed_absmax(x)
    d = mx / np.float32(-nmax)
    v = x * _inv(d)[:, None] + np.float32(nmax + 0.5)
    codes = np.minimum(2 * nmax - 1, _low_byte(_to_int_c(v))) & 0xFF  # MIN(..., (int8_t)...) -> uint8_t
    out[:, 0:2] = _f16_bytes(_f32_to_f16_bits(d))
    if nmax == 8:
        out[:, 2:] = _pack_nibbles(codes)
    else:
        out[:, 2:6], out[:, 6:] = _pack_q5(codes)


def _quant_affine(x: np.ndarray, out: np.ndarray, nmax: int) -> None:
    """q4_1 (nmax 15) and q5_1 (nmax 31)."""
    mn, mx = _first_min_max(x)
    d = (mx - mn) / np.float32(nmax)
    v = (x - mn[:, None]) * _inv(d)[:, None] + np.float32(0.5)
    c = _to_int_c(v)
    out[:, 0:2] = _f16_bytes(_f32_to_f16_bits(d))
    out[:, 2:4] = _f16_bytes(_f32_to_f16_bits(mn))
    if nmax == 15:
        out[:, 4:] = _pack_nibbles(np.minimum(15, _low_byte(c)) & 0xFF)
    else:
        out[:, 4:8], out[:, 8:] = _pack_q5(c & 0xFF)  # (uint8_t)(...), no clamp


def _quant_iq4_nl(x: np.ndarray, out: np.ndarray) -> None:
    amax, mx = _first_signed_absmax(x)
    live = amax >= _IQ4_EPS
    d0 = np.where(live, mx, np.float32(1)) / np.float32(IQ4_NL_VALUES[0])
    idx = _best_index_iq4((np.float32(1) / d0)[:, None] * x)
    q = IQ4_NL_VALUES[idx].astype(np.float32)
    w = x * x
    wq = w * q
    sumqx = np.zeros(x.shape[0], np.float32)
    sumq2 = np.zeros(x.shape[0], np.float32)
    for j in range(QK):  # sequential float32 sums, as the C loop (not NumPy's pairwise sum)
        sumqx += wq[:, j] * x[:, j]
        sumq2 += wq[:, j] * q[:, j]
    pos = sumq2 > 0
    d = np.where(pos, sumqx / np.where(pos, sumq2, np.float32(1)), np.float32(0))
    d = np.where(live, d, np.float32(0))
    idx[~live] = 0
    out[:, 0:2] = _f16_bytes(_f32_to_f16_bits(d))
    out[:, 2:] = _pack_nibbles(idx)


def _poison(out: np.ndarray, type_: str) -> None:
    out[:] = 0
    out[:, 0:2] = _f16_bytes(np.full(out.shape[0], _F16_NAN, np.uint16))
    if type_ in _HAS_MIN:
        out[:, 2:4] = out[:, 0:2]


# ---------------------------------------------------------------------------------------- public API
@dataclass(frozen=True, eq=False)
class GgmlBlocks:
    """Values quantized to ggml blocks: ``data`` is uint8 ``[..., nblocks, block_bytes]``, ggml's bytes.

    ``data.reshape(*lead, -1)`` (see :meth:`to_ggml_bytes`) is the byte image of a ggml tensor with
    rows along the last axis. The accessors decode the fields without dequantizing:
    ``dequantize() == levels() * scales()[..., None] (+ mins()[..., None])`` in float32.
    """

    type: str
    data: np.ndarray

    def __post_init__(self) -> None:
        t = _check_type(self.type)
        object.__setattr__(self, "type", t)
        data = self.data
        if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim < 2 \
                or data.shape[-1] != BLOCK_BYTES[t]:
            shape = getattr(data, "shape", None)
            dtype = getattr(data, "dtype", type(data).__name__)
            raise StateError(f"ggml {t}: blocks must be uint8 [..., nblocks, {BLOCK_BYTES[t]}], "
                             f"got {dtype} {shape}")

    # ---- sizes
    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the values (``[..., nblocks * 32]``)."""
        return self.data.shape[:-2] + (self.data.shape[-2] * QK,)

    @property
    def nblocks(self) -> int:
        """Total number of blocks."""
        return int(np.prod(self.data.shape[:-1]))

    @property
    def nbytes(self) -> int:
        """Bytes actually held (blocks only)."""
        return int(self.data.nbytes)

    @property
    def bits_per_value(self) -> float:
        return bits_per_value(self.type)

    # ---- raw byte image
    def to_ggml_bytes(self) -> np.ndarray:
        """``[..., nblocks * block_bytes]`` uint8: the rows as ggml (and ``gguf.quants``) store them."""
        return self.data.reshape(self.data.shape[:-2] + (-1,))

    @classmethod
    def from_ggml_bytes(cls, type_: str, raw: np.ndarray) -> GgmlBlocks:
        """Inverse of :meth:`to_ggml_bytes` (rows of whole blocks; copies nothing if contiguous)."""
        t = _check_type(type_)
        raw = np.asarray(raw)
        if raw.dtype != np.uint8 or raw.ndim < 1 or raw.shape[-1] % BLOCK_BYTES[t]:
            raise StateError(f"ggml {t}: rows of {BLOCK_BYTES[t]}-byte blocks expected, "
                             f"got {raw.dtype} {raw.shape}")
        return cls(t, raw.reshape(raw.shape[:-1] + (raw.shape[-1] // BLOCK_BYTES[t], BLOCK_BYTES[t])))

    # ---- decoded fields
    def scale_bits(self) -> np.ndarray:
        """f16 bits of ``d``, uint16 ``[..., nblocks]``."""
        return self.data[..., 0:2].copy().view("<u2")[..., 0].astype(np.uint16)

    def scales(self) -> np.ndarray:
        """``d`` as float32 ``[..., nblocks]``."""
        return self.scale_bits().view(np.float16).astype(np.float32)

    def mins(self) -> np.ndarray:
        """``m`` as float32 ``[..., nblocks]`` (q4_1 and q5_1 only)."""
        if self.type not in _HAS_MIN:
            raise InputError(f"ggml {self.type}: blocks have no min (only q4_1 and q5_1 do)")
        return self.data[..., 2:4].copy().view("<u2")[..., 0].view(np.float16).astype(np.float32)

    def codes(self) -> np.ndarray:
        """The stored code of each value, uint8 ``[..., nblocks, 32]``.

        q4_0/q4_1/iq4_nl 0..15, q5_0/q5_1 0..31 (the fifth bit taken from ``qh``), q8_0 the int8's byte.
        """
        t, b = self.type, self.data
        qs = b[..., _QS_OFFSET[t]:]
        if t == "q8_0":
            return qs.copy()
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
        if t in _QH_OFFSET:
            o = _QH_OFFSET[t]
            hi = np.unpackbits(b[..., o:o + 4], axis=-1, bitorder="little")
            codes |= hi << 4
        return codes

    def levels(self) -> np.ndarray:
        """The integer each value's code stands for, int8 ``[..., nblocks, 32]`` (value = d*level (+ m)).

        q8_0 the int8 itself, q4_0 ``code-8``, q5_0 ``code-16``, q4_1/q5_1 ``code``, iq4_nl ``T[code]``.
        """
        c = self.codes()
        if self.type == "q8_0":
            return c.view(np.int8)
        if self.type == "iq4_nl":
            return IQ4_NL_VALUES[c]
        off = {"q4_0": 8, "q5_0": 16}.get(self.type, 0)
        return (c.astype(np.int8) - np.int8(off)).astype(np.int8)

    def dequantize(self) -> np.ndarray:
        """float32 values ``[..., nblocks*32]``, as ggml's ``dequantize_row_<type>``."""
        with np.errstate(invalid="ignore", over="ignore"):  # inf*0 in non-finite blocks, as in C
            v = self.levels().astype(np.float32) * self.scales()[..., None]
            if self.type in _HAS_MIN:
                v += self.mins()[..., None]
        return v.reshape(self.shape)


def quantize(x: np.ndarray, type_: str) -> GgmlBlocks:
    """Quantize ``x`` (cast to float32) to ggml blocks of 32 along the last axis.

    ``x.shape[-1]`` must be a multiple of 32. See the module docstring for the exact rules and the
    NaN/Inf policy (a block with a non-finite value is stored as an all-NaN block).
    """
    t = _check_type(type_)
    x = np.asarray(x)
    if x.ndim < 1 or x.shape[-1] % QK != 0:
        raise InputError(f"ggml {t}: the last axis must be a multiple of {QK} (one block = {QK} values), "
                         f"got shape {tuple(x.shape)}")
    if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)
            or x.dtype == np.bool_):
        raise InputError(f"ggml {t}: cannot quantize dtype {x.dtype}")
    lead = x.shape[:-1]
    nb = x.shape[-1] // QK
    with np.errstate(over="ignore"):  # float64 beyond float32 range -> +-inf -> poisoned block
        rows = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, QK)
    out = np.empty((rows.shape[0], BLOCK_BYTES[t]), np.uint8)
    if rows.shape[0]:
        bad = ~np.isfinite(rows).all(axis=-1)
        if bad.any():
            rows = np.where(bad[:, None], np.float32(0), rows)
        with np.errstate(all="ignore"):  # over/underflow and invalid steps are part of the C semantics
            if t == "q8_0":
                _quant_q8_0(rows, out)
            elif t == "q4_0":
                _quant_sym(rows, out, 8)
            elif t == "q5_0":
                _quant_sym(rows, out, 16)
            elif t == "q4_1":
                _quant_affine(rows, out, 15)
            elif t == "q5_1":
                _quant_affine(rows, out, 31)
            else:
                _quant_iq4_nl(rows, out)
        if bad.any():
            sub = out[bad]
            _poison(sub, t)
            out[bad] = sub
    return GgmlBlocks(t, out.reshape(lead + (nb, BLOCK_BYTES[t])))


def dequantize(blocks: GgmlBlocks) -> np.ndarray:
    """float32 values of ``blocks`` (``[..., nblocks*32]``); same as :meth:`GgmlBlocks.dequantize`."""
    if not isinstance(blocks, GgmlBlocks):
        raise InputError(f"ggml: dequantize needs GgmlBlocks, got {type(blocks).__name__}")
    return blocks.dequantize()


# ---------------------------------------------------------------------------------------------- rotation
def walsh_hadamard(n: int) -> np.ndarray:
    """llama.cpp's KV rotation matrix of size ``n`` (a power of two): the Sylvester (natural-order)
    Walsh-Hadamard matrix scaled by ``1 / sqrt(n)``, no random signs; symmetric and its own inverse. f32."""
    if n < 1 or n & (n - 1):
        raise InputError(f"ggml: a Walsh-Hadamard matrix needs a power-of-two size, got {n}")
    h = np.ones((1, 1), np.float64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


def attn_rot_size(head_dim: int, role: str) -> int:
    """The size of llama.cpp's rotation blocks (src/llama-kv-cache.cpp, since 2026-04; 0 = no rotation):
    head_dim must be a multiple of 64; keys use the largest power of two >= 64 dividing head_dim, values
    always 64. (llama.cpp further requires a quantized cache type; the caller checks that.)"""
    if head_dim <= 0 or head_dim % 64:
        return 0
    if role == "value":
        return 64
    n = 64
    while head_dim % (2 * n) == 0:
        n *= 2
    return n


def hadamard_blocks(x: np.ndarray, h: np.ndarray) -> np.ndarray:
    """``x [..., D]`` f32 with each contiguous block of ``len(h)`` values along the last axis multiplied by
    ``h`` (llama.cpp's reshape to ``[n, D/n]`` rows and ``mul_mat`` with the rotation). Each output is a
    fixed-order sum of products, so a row's result does not depend on how many rows are rotated with it."""
    n = h.shape[0]
    d = x.shape[-1]
    xb = np.asarray(x, np.float32).reshape(x.shape[:-1] + (d // n, n))
    out = xb[..., 0:1] * h[0]
    for j in range(1, n):
        out += xb[..., j:j + 1] * h[j]
    return out.reshape(x.shape)
