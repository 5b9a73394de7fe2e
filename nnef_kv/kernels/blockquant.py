"""Products with tract's Q4_0 / Q8_1 weights kept as blocks (numba), beside a NumPy reference.

**Orientation.** A block-quantized weight is stored as ``W`` ``[N, K]`` (tract writes the tensor as
``[prod(shape[:-1]), shape[-1]]``), its 32-value blocks along the last axis ``K``. That is the layout of
a torch ``Linear`` weight ``[out, in]``, which torch-to-nnef / tract use as ``linear(x, W, b)`` or
``matmul(x, W, transposeB = true)``: the product is **y = x @ W.T** (``x`` ``[..., K]`` -> ``y``
``[..., N]``), each output a dot product along the blocks (checked against tract's own output on the
``tract-harness/q40_linear_followed_slice`` conformance case, legacy nibble order). The interpreter keeps
such a variable as its blocks and runs ``linear`` / ``matmul(..., transposeB = true)`` by it on
:func:`matmul` with the weight repacked once at plan time (``nnef_kv/interpreter/plan/blockweights.py``:
4.5 bits a weight held instead of 32); any other use reads the dequantized values.

**Repacked layout** (:func:`repack`, done once, exact: the same codes, the same f16 scales):

* Q4_0: ``codes`` uint8 ``[K/2, N]``, **column-major** in the sense of the doc
  ``shared/docs/numba-kernels.md``: byte ``(r, n)`` holds input ``k = 2r`` (low nibble) and ``k = 2r + 1``
  (high nibble) of output ``n``, code ``q`` in 0..15 (value ``(q - 8) * d``). Both tract nibble orders
  (GGML ``0x3040``, legacy ``0x2040``) repack to this one layout.
* Q8_1: ``codes`` int8 ``[K, N]`` (value ``q * d``; the block sums of the file are not used, as in
  :meth:`BlockQuantTensor.dequantize`).
* ``scales``: the blocks' f16 ``d``, ``[K/32, N]`` (float16, widened exactly inside the kernel).

So Q4_0 holds 4.5 bits a weight, Q8_1 8.5, like the file.

**Loop shape** (numba side): for an output tile, for each block of 32 inputs: ``tmp[n] += x[k] * (q[k, n]
- 8)`` over the block's inputs (the inner loop runs over contiguous outputs with ``x[k]`` broadcast: it
vectorises without fastmath), then ``acc[n] += d[b, n] * tmp[n]``. Up to summation order that is the
product with the dequantized weights, ``sum_k x[k] * ((q - 8) * d)``: ``(q - 8) * d`` is exact in f32 (a
4-bit or 8-bit integer times an f16), and factoring ``d`` out of a block only regroups the terms. The
same holds for NaN/Inf in ``x`` (``Inf * 0`` is NaN both ways, the signs of infinities are those of the
terms). One row of Q4_0 (a decode step) has its own core: a block's 32 products summed as a tree in
registers, the next block prefetched; on AVX-512F hosts the products ``x[k] * (q - 8)`` are looked up in
a table of 16 an input (``vpermps``), the same f32 values in the same tree (``_blockquant_jit._q4_row_lut``
/ ``_q4_row_plain``). With **non-finite scales** (a block of huge values quantized by tract gives an f16
``Inf`` scale) factoring would change which results are NaN, so such weights (``finite_scales`` False)
take the reference path. Rows ``M > BLAS_ROWS[format]`` (short and long prefill) dequantize
``[256, 512]`` blocks of ``W.T`` (numba, 512 KiB of f32: L2-resident) and multiply each with BLAS,
which is faster there (see ``benchmarks/kernels.py``); the dequantized values are exactly the
reference's, only the summation is blocked.

The NumPy reference is ``x @ dequantize_t(packed)`` (``dequantize_t`` = ``W.T`` as f32, bit-identical to
``BlockQuantTensor.dequantize().reshape(N, K).T``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..tensors.blockquant import BLOCK_LEN, BlockQuantTensor
from . import kernel

__all__ = ["PackedWeights", "repack", "dequantize_t", "matvec", "matmul", "BLAS_ROWS"]

#: above this many rows (per format) the numba side dequantizes blocks of W.T and calls BLAS on them: the
#: measured crossover (benchmarks/kernels.py; the figures in docs/benchmarks.md, "Where the code's
#: thresholds come from")
BLAS_ROWS = {"Q4_0": 8, "Q8_1": 2}


@dataclass(frozen=True, eq=False)
class PackedWeights:
    """A block-quantized weight ``W`` ``[N, K]`` repacked for ``y = x @ W.T`` (see the module docstring).

    ``codes``: Q4_0 uint8 ``[K/2, N]`` (low nibble input ``2r``, high nibble ``2r + 1``), Q8_1 int8
    ``[K, N]``; ``scales``: float16 ``[K/32, N]``; ``shape``: the tensor's shape (``prod(shape[:-1]) == N``,
    ``shape[-1] == K``); ``finite_scales``: every scale is finite (else the numba side uses the reference).
    """

    format: str
    shape: tuple[int, ...]
    codes: np.ndarray
    scales: np.ndarray
    finite_scales: bool

    @property
    def n(self) -> int:
        """Outputs (rows of ``W``)."""
        return int(self.codes.shape[1])

    @property
    def k(self) -> int:
        """Inputs (the blocked axis)."""
        return int(self.scales.shape[0]) * BLOCK_LEN

    @property
    def nbytes(self) -> int:
        return int(self.codes.nbytes + self.scales.nbytes)

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.nbytes / (self.n * self.k)

    def __repr__(self) -> str:
        return f"PackedWeights({self.format}, N={self.n}, K={self.k}, {self.bits_per_weight:.2f} bits a weight)"


def repack(t: BlockQuantTensor) -> PackedWeights:
    """Repack a Q4_0 / Q8_1 tensor (either tract nibble order) for :func:`matmul`; exact.

    The tensor's last axis ``K`` must hold whole blocks (a multiple of 32): it is the blocked input axis,
    all the other axes together are the outputs ``N``."""
    if not isinstance(t, BlockQuantTensor):
        raise TypeError(f"repack needs a BlockQuantTensor, got {type(t).__name__}")
    k = int(t.shape[-1])
    if k % BLOCK_LEN or k == 0:
        raise ValueError(f"{t!r}: the last axis ({k}) must be a non-zero multiple of {BLOCK_LEN} to repack")
    n = t.size // k
    codes = t.codes().reshape(n, k)  # logical order, 0..15 (Q4_0) or int8 (Q8_1)
    scales = np.ascontiguousarray(t.scales().reshape(n, k // BLOCK_LEN).T)  # f16 [K/32, N]
    if t.format == "Q4_0":
        packed = np.ascontiguousarray((codes[:, 0::2] | (codes[:, 1::2] << np.uint8(4))).T)
    else:
        packed = np.ascontiguousarray(codes.view(np.int8).T)
    return PackedWeights(format=t.format, shape=tuple(int(d) for d in t.shape), codes=packed, scales=scales,
                         finite_scales=bool(np.isfinite(scales).all()))


def dequantize_t(p: PackedWeights) -> np.ndarray:
    """``W.T`` ``[K, N]`` float32, the values :meth:`BlockQuantTensor.dequantize` gives (bit for bit)."""
    if p.format == "Q4_0":
        q = np.empty((p.k, p.n), np.uint8)
        q[0::2] = p.codes & np.uint8(15)
        q[1::2] = p.codes >> np.uint8(4)
        vals = (q.astype(np.int8) - np.int8(8)).astype(np.float32)
    else:
        vals = p.codes.astype(np.float32)
    d = np.repeat(p.scales.astype(np.float32), BLOCK_LEN, axis=0)
    return vals * d


def _check_x(p: PackedWeights, x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    if x.ndim < 1 or x.shape[-1] != p.k:
        raise ValueError(f"x of shape {x.shape} does not end with K = {p.k} for {p!r}")
    return x


@kernel("nnef_kv.kernels._blockquant_jit:matmul")
def matmul(p: PackedWeights, x: np.ndarray) -> np.ndarray:
    """``x @ W.T``: ``x`` ``[..., K]`` (cast to float32) -> float32 ``[..., N]``.

    Reference: the product with the dequantized weights (:func:`dequantize_t`)."""
    x = _check_x(p, x)
    return np.matmul(x, dequantize_t(p))


@kernel("nnef_kv.kernels._blockquant_jit:matvec")
def matvec(p: PackedWeights, x: np.ndarray) -> np.ndarray:
    """``x @ W.T`` for one vector ``x`` ``[K]`` -> float32 ``[N]`` (:func:`matmul` of one row)."""
    x = _check_x(p, x)
    if x.ndim != 1:
        raise ValueError(f"matvec needs a vector, got shape {x.shape}")
    return np.matmul(x, dequantize_t(p))
