"""Q4_0 / Q8_1 weights kept as blocks: the products run on them, nothing is dequantized at session creation.

A block-quantized ``variable`` is a :class:`~nnef_kv.tensors.blockquant.BlockQuantTensor` constant in the graph
(4.5 / 8.5 bits a weight, as in the file). The planner then:

* **folds** shape-only ops on it (``unsqueeze`` / ``reshape`` / ``squeeze`` keeping the blocked last axis,
  what torch-to-nnef writes before every ``linear``) into another view of the same blocks; any other op
  folded on constants sees the dequantized values, as it always did;
* **rewrites** ``linear(x, W, b)`` and ``matmul(x, W, transposeB = true)`` by such a weight into
  :func:`nnef_kv.kernels.blockquant.matmul` on the weight repacked once (exact: same codes, same scales;
  numba cores; when numba is absent or forced off with ``NNEF_KV_NO_NUMBA=1`` the weight is dequantized
  once instead, as below: the reference ``x @ dequantize(W).T`` would dequantize it at every call);
  products of one input by several such weights (q/k/v, gate/up) become one product by the repacked
  weights side by side (the numba cores compute every output column on its own: the same bits as
  separate products);
* **materialises** what is left: a step still reading a block weight (a gather from a Q4 embedding, a
  product the rewrite does not cover) gets the dequantized f32 array, as before this module existed.

The numba product sums in another order than BLAS on the dequantized weights: results differ by f32
rounding (``tests/properties/test_kernels.py`` bounds it against the reference); with numba off they are the
reference's bits, which are those of the old dequantize-at-load path (the same BLAS call on the same
``[K, N]`` array).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from ...tensors import hugepages
from ...tensors.blockquant import BLOCK_LEN, BlockQuantTensor
from ...tensors.pages import release_pages
from ..catalog import ops_having
from ..graph import Node, slots_of
from ..values import Lazy
from .steps import replace_steps
from .weights import MIN_HUGE_BYTES, add_bias

__all__ = ["is_block", "fold_block", "rewrite_block_product", "fuse_block_projections", "materialize",
           "dequantizing", "BlockLinear"]

#: ops whose fold on a block weight is a view of the same blocks when they keep its last axis
_VIEW_OPS = ops_having("view")


def is_block(w: Any) -> bool:
    return isinstance(w, BlockQuantTensor)


def fold_block(node: Node, kernel: Callable, args: list[Any]) -> Any:
    """Run ``kernel`` on constant ``args`` of which some are block weights: a shape-only op keeping the
    blocked axis gives a view of the blocks; anything else runs on the dequantized values."""
    if node.op in _VIEW_OPS and len(args) == 1 and is_block(args[0]):
        t = args[0]
        probe = np.broadcast_to(np.float32(0), t.shape)  # no memory: the kernel only moves axes around
        got = kernel(probe, **node.attrs)
        shape = tuple(int(d) for d in np.shape(got))
        if shape and shape[-1] == t.shape[-1] and int(np.prod(shape)) == t.size:
            return t.reshaped(shape)
    return kernel(*[np.asarray(a) if is_block(a) else a for a in args], **node.attrs)


class BlockLinear:
    """``x @ W.T (+ bias)`` by a repacked block weight (one ``kernels.blockquant.matmul`` call); inputs other
    than f32 get the generic kernels' answer on the dequantized weight."""

    def __init__(self, packed: Any, fallback: Callable[[np.ndarray, np.ndarray | None], np.ndarray]) -> None:
        self.packed = packed
        self.fallback = fallback

    def __call__(self, x: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
        from ...kernels import blockquant as bq

        if type(x) is not np.ndarray or x.dtype != np.float32 or not x.ndim or x.shape[-1] != self.packed.k:
            return self.fallback(x, bias)
        return add_bias(bq.matmul(self.packed, x), bias)


def _leading_units(t: BlockQuantTensor) -> bool:
    return t.ndim >= 2 and all(d == 1 for d in t.shape[:-2]) and t.shape[-1] % BLOCK_LEN == 0


def rewrite_block_product(node: Node, base: list[Any], consts: set[int]) -> tuple[Callable, list[Any], dict] | None:
    """``linear`` / ``matmul(transposeB)`` by a constant block weight -> a :class:`BlockLinear` step. Not
    without the numba kernels: their NumPy reference dequantizes the weight at every call (several times
    slower than tract, docs/benchmarks.md); the weight is then dequantized once (:func:`materialize`, the
    reference's bits, the f32 weights' memory). numba is looked for, not
    imported (:func:`~nnef_kv.kernels.numba_installed`): it loads with the first product."""
    from ...kernels import numba_installed

    if not numba_installed():
        return None
    if len(node.inputs) < 2 or not isinstance(node.inputs[1], int) or node.inputs[1] not in consts:
        return None
    t = base[node.inputs[1]]
    if not is_block(t) or t.format not in ("Q4_0", "Q8_1") or not _leading_units(t):
        return None
    if node.op == "linear" and not node.attrs:
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        b = base[bias] if isinstance(bias, int) and bias in consts else None
        if isinstance(b, np.ndarray) and b.size == 1 and b.reshape(()).item() == 0:
            bias = None
    elif node.op == "matmul":
        a = node.attrs
        if any(isinstance(v, Lazy) for v in a.values()) or a.get("transposeA", False) or not a.get("transposeB", False):
            return None
        bias = None
    else:
        return None
    from ...kernels.blockquant import repack
    from ..catalog import lookup

    n, k = t.size // t.shape[-1], t.shape[-1]
    packed = repack(t.reshaped((n, k)))
    release_pages(t.blocks)  # a memory-mapped original, read once to repack: given back
    generic = lookup(node.op).kernel
    op, shape = node.op, t.shape

    def fallback(x: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
        w = np.asarray(t).reshape(shape)
        return generic(x, w, bias) if op == "linear" else generic(x, w, transposeB=True)

    kernel = BlockLinear(packed, fallback)
    return kernel, [node.inputs[0]] + ([bias] if bias is not None else []), {}


def fuse_block_projections(steps: list[Any], nodes: list[Node], kernels: dict[int, BlockLinear]
                           ) -> tuple[list[Any], list[Node], int]:
    """Several bias-free :class:`BlockLinear` products of one input (q/k/v, gate/up) -> one product by the
    repacked weights side by side (same format), run where the first was; outputs are column views."""
    from ...kernels.blockquant import PackedWeights

    groups: dict[tuple[int, str, int], list[int]] = {}
    for i, kern in kernels.items():
        node = nodes[i]
        if len(node.inputs) != 1 or not isinstance(node.inputs[0], int) or len(node.outputs) != 1:
            continue
        groups.setdefault((node.inputs[0], kern.packed.format, kern.packed.k), []).append(i)
    replace: dict[int, tuple[Any, Node]] = {}
    drop: set[int] = set()
    fused: set[int] = set()
    for (x, fmt, k), members in groups.items():
        if len(members) < 2:
            continue
        ps = [kernels[i].packed for i in members]
        huge = hugepages.enabled() and sum(p.codes.nbytes for p in ps) >= MIN_HUGE_BYTES
        codes = _side_by_side([p.codes for p in ps], huge)
        scales = _side_by_side([p.scales for p in ps], huge)
        both = PackedWeights(format=fmt, shape=(codes.shape[1], k), codes=codes, scales=scales,
                             finite_scales=all(p.finite_scales for p in ps))
        # the parts' fallbacks (each dequantizes its original weight), not the parts' kernels: those hold
        # the separately repacked arrays, which the joint copy replaces (kept, they doubled q/k/v and gate/up)
        fallbacks = [kernels[i].fallback for i in members]

        def fb(xv: np.ndarray, bias: Any, fallbacks: list = fallbacks) -> np.ndarray:
            return np.concatenate([f(xv, None) for f in fallbacks], axis=-1)

        joint = BlockLinear(both, fb)
        parts, at = [], 0
        for p, i in zip(ps, members):
            parts.append((nodes[i].outputs[0], at, at + p.n))
            at += p.n
        first = nodes[members[0]]
        node = Node(first.name, first.op, first.prim, [x], {}, [nodes[i].outputs[0] for i in members], first.location)

        def step(v: list, st: list, x: int = x, joint: BlockLinear = joint, parts: tuple = tuple(parts)) -> None:
            y = joint(v[x])
            for o, a, b in parts:
                v[o] = y[..., a:b]

        replace[members[0]] = (step, node)
        drop.update(members[1:])
        fused.update(members)
    for i, kern in kernels.items():  # the products left alone: their repacked arrays into huge pages too
        if i not in fused:
            kern.packed = _in_huge_pages(kern.packed)
    if not replace:
        return steps, nodes, 0
    return replace_steps(steps, nodes, replace, drop)


def _side_by_side(parts: list[np.ndarray], huge: bool) -> np.ndarray:
    """``parts`` (2-D, one dtype) concatenated along their columns into one C-contiguous array, in huge pages
    if ``huge`` (:mod:`nnef_kv.tensors.hugepages`; a decode step streams it: the one-row Q4_0 core took 6.40
    instead of 7.11 ms a SmolLM2-135M step with its codes there, docs/benchmarks.md)."""
    shape = (parts[0].shape[0], sum(p.shape[1] for p in parts))
    if huge:
        out = hugepages.empty(shape, parts[0].dtype)
        np.concatenate(parts, axis=1, out=out)
        return out
    return np.ascontiguousarray(np.concatenate(parts, axis=1))


def _in_huge_pages(packed: Any) -> Any:
    """A repacked weight with its codes and scales copied into huge pages when its codes are large enough (the
    originals, the plan's own repacked arrays, are dropped with it)."""
    if not hugepages.enabled() or packed.codes.nbytes < MIN_HUGE_BYTES or hugepages.holds(packed.codes):
        return packed
    return dataclasses.replace(packed, codes=_side_by_side([packed.codes], True),
                               scales=_side_by_side([packed.scales], True))


def dequantizing(kernel: Callable, positions: list[int]) -> Callable:
    """``kernel`` given the dequantized values of its block-weight arguments at ``positions``, for that call
    only (a check's plan: nothing dequantized is kept)."""
    at = frozenset(positions)

    def run(*args: Any, **attrs: Any) -> Any:
        return kernel(*[np.asarray(a) if i in at and is_block(a) else a for i, a in enumerate(args)], **attrs)

    return run


def materialize(nodes: list[Node], base: list[Any]) -> int:
    """Block weights still read by a step: the dequantized f32 array in their slot (how many)."""
    n = 0
    for node in nodes:
        for spec in node.inputs:
            for s in slots_of(spec):
                if s < len(base) and is_block(base[s]):
                    base[s] = np.asarray(base[s])
                    n += 1
    return n
