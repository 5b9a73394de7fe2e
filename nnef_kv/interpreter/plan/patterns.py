"""The chains torch-to-nnef writes for a decoder's blocks, recognised at plan time and run as one step.

Each matcher starts from a chain's last step (its root) and walks back through steps whose value nothing
else reads (:class:`.chains.Flow`); the chain's fast form (:func:`.chains.chain_step`) makes the same NumPy
calls as the unfused steps on the same operands, in the same operand order, only without the plan steps,
the generic kernels' dtype/rank dispatch and the temporaries between them (``out=`` into values of its
own); when a guard on the run-time inputs does not hold (another dtype, a rank NNEF's alignment would pad,
bounds other than a rotate-half split...) the original steps run. ``tests/unit/test_patterns.py`` compares the
fused and unfused plans bit for bit on every torch-to-nnef export of the fixtures and on the built-in ones.
Two fused forms call numba kernels that are not the NumPy calls' bits (the attention's decode step and prefill
blocks, :data:`.attention.DECODE_KERNEL`; the SwiGLU gate, :data:`GATE_KERNEL`): those comparisons turn them
off, and the same file checks each of their calls against the kernels' error bounds.

* ``rms_norm``: ``mul(w, cast(mul(x, rsqrt(add(mean_reduce(sqr(x), [last]), eps)))))`` (``sqr(x)`` or
  ``mul(x, x)``; the cast to f32 and the weight optional; operands of each binary op in either order).
* ``rope``: ``add(mul(x, cos), mul(concat([neg(slice(x, h:D)), slice(x, 0:h)], last), sin))``: rotate-half
  RoPE, the slices plain ``slice`` or torch-to-nnef's ``dyn_slice`` (whose bounds arithmetic the shape
  memos of :mod:`.chains` make cheap).
* ``silu_gate``: ``mul(mul(g, sigmoid(g)), u)`` (SwiGLU, torch-to-nnef's ``silu`` fragment).
* ``attention``: ``matmul(cast(softmax(add(mul(matmul(q, transpose(K, [0,1,3,2])), scale), mask), [last])),
  V)``, where K and V may come through the grouped-query repeat ``unsqueeze([2])`` -> ``tile([1,1,g,1,1])``
  -> ``reshape``s to ``[B, Hkv*g, T, D]``: the products then read each kv head in place for its ``g`` query
  heads (the same 2-D products, on the same strides) instead of a tiled copy.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ...kernels import gate, rowwise
from ..catalog import ops_having
from ..graph import Graph, Node, slots_of
from ..ops.nnef_std import _slice_bounds as _bounds
from .attention import match_attention, match_views
from .chains import Flow, chain_node, chain_step
from .matching import Match, Walk, attr_fn, is_f32, lazy_reads, pair, same_objects, same_rank_broadcast, scalarish
from .steps import Step

_F32 = np.dtype(np.float32)

__all__ = ["fuse_patterns", "MATCHERS", "GATE_KERNEL"]


# ------------------------------------------------------------------------------------------------
# rms_norm
# ------------------------------------------------------------------------------------------------
def _norm_core(flow: Flow, w_: Walk, k: int) -> tuple | None:
    """``mul(x, rsqrt(add(mean_reduce(sqr(x), [axis]), eps)))`` at step ``k`` (operands in either order):
    ``(x, axis, eps, eps position, x position)``."""
    pr = pair(flow.nodes[k])
    if pr is None:
        return None
    for xpos, (x, r) in enumerate((pr, pr[::-1])):
        mark = set(w_.members)
        rs = w_.inner(r, k, "rsqrt")
        ad = rs and w_.inner(rs[1].inputs[0], rs[0], "add")
        if ad and pair(ad[1]):
            p0, p1 = pair(ad[1])
            epos = 1 if flow.const(p1) is not None else 0 if flow.const(p0) is not None else -1
            mr = epos >= 0 and w_.inner(p0 if epos == 1 else p1, ad[0], "mean_reduce")
            sq = mr and w_.inner(mr[1].inputs[0], mr[0], "sqr", "mul")
            axes = mr and mr[1].attrs.get("axes")
            if sq and ((sq[1].op == "sqr" and sq[1].inputs == [x]) or (sq[1].op == "mul" and sq[1].inputs == [x, x])) \
                    and isinstance(axes, list) and len(axes) == 1 and type(axes[0]) is int:
                return x, axes[0], flow.const(p1 if epos == 1 else p0), epos, xpos
        w_.members = mark
    return None


def match_rms_norm(flow: Flow, k: int, taken: set[int]) -> Match | None:
    root = flow.nodes[k]
    if root.op != "mul" or pair(root) is None:
        return None
    found = None
    for wpos, (c, other) in enumerate((pair(root), pair(root)[::-1])):
        weight = flow.const(c)
        if isinstance(weight, np.ndarray) and flow.node_of(other) is not None:
            w_ = Walk(flow, taken)
            y, cast = w_.castis_f32(other, k)
            got = w_.inner(y, cast if cast is not None else k, "mul")
            core = got and _norm_core(flow, w_, got[0])
            if core:
                found = (w_, core, weight, wpos)
                break
    if found is None:  # no weight: the root is the product by the reciprocal root
        w_ = Walk(flow, taken)
        core = _norm_core(flow, w_, k)
        if not core:
            return None
        found = (w_, core, None, 0)
    w_, (x, ax, eps, epos, xpos), weight, wpos = found
    members = sorted(w_.members | {k})
    eps32 = np.float32(eps.reshape(())) if isinstance(eps, np.ndarray) and eps.size == 1 else None
    wvec = (rowwise.NO_WEIGHT if weight is None else _weight_row(weight)) if flow.kernels else None

    def fits(xv: Any, ax=ax, eps=eps, weight=weight) -> bool:
        """The fast form runs (else the member steps): f32 ``x``, the norm over its last axis, one eps, the
        weight broadcasting into ``x``."""
        if not is_f32(xv) or not xv.ndim or ax not in (-1, xv.ndim - 1) or not scalarish(eps, xv.ndim):
            return False
        return weight is None or same_rank_broadcast(xv, weight)

    def fast(v: list, x=x, eps=eps, epos=epos, xpos=xpos, weight=weight, wpos=wpos, eps32=eps32, wvec=wvec,
             fits=fits) -> Any:
        xv = v[x]
        if not fits(xv):
            return NotImplemented
        n = xv.shape[-1]
        if wvec is not None and wvec.size in (0, n) and n and xv.flags.c_contiguous:
            core = rowwise.rms_rows.hot()
            if core is not None:  # the kernel: the same operations in one call (see nnef_kv.kernels.rowwise)
                y = np.empty_like(xv)
                if core is rowwise.rms_rows:
                    core(xv.reshape(-1, n), eps32, wvec if wvec.size else None, y.reshape(-1, n))
                else:
                    core(xv.reshape(-1, n), eps32, wvec, y.reshape(-1, n))
                return y
        m = np.add.reduce(np.multiply(xv, xv), axis=-1, keepdims=True)
        n = np.intp(xv.shape[-1])
        if m.size == 1 and n:  # one vector (a decode step): the same roundings on NumPy scalars
            # mean: f32 / intp computes in f64 and rounds to f32, as np.mean's true_divide does
            r = np.float32(np.float64(m.reshape(())) / np.float64(n))
            e = eps.reshape(())
            r = r + e if epos == 1 else e + r
            if r > 0:  # (1 / sqrt(0), sqrt(-x), NaN: the array path, whose errstate keeps them quiet)
                r = np.float32(1) / np.sqrt(r)
                return _times_weight(np.multiply(xv, r) if xpos == 0 else np.multiply(r, xv), weight, wpos)
        np.true_divide(m, n, out=m, casting="unsafe")  # what np.mean does
        if epos == 1:
            np.add(m, eps, out=m)
        else:
            np.add(eps, m, out=m)
        with np.errstate(divide="ignore", invalid="ignore"):
            np.sqrt(m, out=m)
            np.divide(np.float32(1), m, out=m)
        return _times_weight(np.multiply(xv, m) if xpos == 0 else np.multiply(m, xv), weight, wpos)

    # the kernel path (fits, wvec of size 0 or n, n > 0, a C-contiguous x, the core hot): what a run of
    # :mod:`.dense` replays
    parts = {"x": x, "fits": fits, "eps32": eps32, "wvec": wvec}
    return Match("rms_norm", members, [x], fast, root.outputs[0], parts)


def _weight_row(weight: np.ndarray) -> np.ndarray | None:
    """An f32 norm weight of shape ``[1, ..., 1, N]`` as its ``[N]`` row (what the kernel takes), else None."""
    if weight.dtype != _F32 or not weight.ndim or any(d != 1 for d in weight.shape[:-1]):
        return None
    return np.ascontiguousarray(weight.reshape(-1))


def _times_weight(y: np.ndarray, weight: Any, wpos: int) -> np.ndarray:
    if weight is not None:
        if wpos == 0:
            np.multiply(weight, y, out=y)
        else:
            np.multiply(y, weight, out=y)
    return y



# ------------------------------------------------------------------------------------------------
# rope (rotate half)
# ------------------------------------------------------------------------------------------------
def _slice_bounds(node: Node, v: list, x: np.ndarray) -> tuple[int, int, int] | None:
    """``(axis, begin, end)`` of a one-axis, stride-1 slice of ``x`` as the slice kernel resolves them."""
    axes, begin, end = attr_fn(node, "axes", ())(v), attr_fn(node, "begin", ())(v), attr_fn(node, "end", ())(v)
    stride = attr_fn(node, "stride", ())(v)
    try:
        if len(axes) != 1 or len(begin) != 1 or len(end) != 1 or any(int(s) != 1 for s in stride):
            return None
        a = int(axes[0]) + x.ndim if int(axes[0]) < 0 else int(axes[0])
        if not 0 <= a < x.ndim:
            return None
        b, e = _bounds(int(begin[0]), int(end[0]), 1, x.shape[a])
    except (TypeError, ValueError):
        return None
    return a, b, e


class _BoundsCache:
    """The bounds of two slices, re-resolved only when the values their run-time attributes read are other
    objects than last time (a shape memo hands out the same objects while shapes do not change) or the
    input's shape changed."""

    def __init__(self, n1: Node, n2: Node) -> None:
        self.n1, self.n2 = n1, n2
        self.reads = lazy_reads(n1) + lazy_reads(n2)
        self.entry: tuple | None = None

    def __call__(self, v: list, x: np.ndarray) -> tuple:
        objs = tuple([v[s] for s in self.reads])
        e = self.entry
        if e is not None and e[0] == x.shape and same_objects(objs, e[1]):
            return e[2]
        got = (_slice_bounds(self.n1, v, x), _slice_bounds(self.n2, v, x))
        self.entry = (x.shape, objs, got)
        return got


def match_rope(flow: Flow, k: int, taken: set[int]) -> Match | None:
    root = flow.nodes[k]
    if root.op != "add" or pair(root) is None:
        return None
    for apos, (p, q) in enumerate((pair(root), pair(root)[::-1])):
        w_ = Walk(flow, taken)
        mc, ms = w_.inner(p, k, "mul"), w_.inner(q, k, "mul")
        if not (mc and ms and pair(mc[1]) and pair(ms[1])):
            continue
        for spos, (rot, sin) in enumerate((pair(ms[1]), pair(ms[1])[::-1])):
            mark = set(w_.members)
            cc = w_.inner(rot, ms[0], "concat")
            if cc and len(cc[1].inputs) == 1 and isinstance(cc[1].inputs[0], list) and len(cc[1].inputs[0]) == 2:
                n_slot, x1_slot = cc[1].inputs[0]
                ng = w_.inner(n_slot, cc[0], "neg")
                s2 = ng and w_.inner(ng[1].inputs[0], ng[0], "slice")
                s1 = s2 and w_.inner(x1_slot, cc[0], "slice")
                if s1 and s2 and s1[1].inputs[0] == s2[1].inputs[0] and isinstance(s1[1].inputs[0], int):
                    x = s1[1].inputs[0]
                    cpair = pair(mc[1])
                    if x in cpair and cpair.count(x) == 1:
                        cpos = cpair.index(x)
                        cos = cpair[1 - cpos]
                        axis = cc[1].attrs.get("axis")
                        if type(axis) is int and sin != x and cos != x:
                            break
            w_.members = mark
        else:
            continue
        break
    else:
        return None
    bounds = _BoundsCache(s1[1], s2[1])
    members = sorted(w_.members | {k})
    kernel = flow.kernels

    def fits(v: list, xv: Any, cv: Any, sv: Any, axis=axis, bounds=bounds) -> bool:
        """The fast form runs (else the member steps): f32 operands of one rank, cos and sin broadcasting into
        ``x``, the slices splitting the last axis in halves."""
        if not (is_f32(xv) and xv.ndim and same_rank_broadcast(xv, cv) and same_rank_broadcast(xv, sv)):
            return False
        d = xv.shape[-1]
        if axis not in (-1, xv.ndim - 1) or d % 2:
            return False
        h = d // 2
        return bounds(v, xv) == ((xv.ndim - 1, 0, h), (xv.ndim - 1, h, d))

    def fast(v: list, x=x, cos=cos, sin=sin, cpos=cpos, spos=spos, apos=apos, fits=fits, kernel=kernel) -> Any:
        xv, cv, sv = v[x], v[cos], v[sin]
        if not fits(v, xv, cv, sv):
            return NotImplemented
        h = xv.shape[-1] // 2
        if kernel and xv.ndim == 4:
            core = rowwise.rope_half.hot()
            if core is not None:  # the kernel: the same operations in one call (see nnef_kv.kernels.rowwise)
                out = np.empty_like(xv)  # the layout NumPy's calls give (the input's order)
                core(xv, cv, sv, out)
                return out
        c = np.multiply(xv, cv) if cpos == 0 else np.multiply(cv, xv)
        r = np.empty_like(xv)
        np.negative(xv[..., h:], out=r[..., :h])
        r[..., h:] = xv[..., :h]
        if spos == 0:
            np.multiply(r, sv, out=r)
        else:
            np.multiply(sv, r, out=r)
        return np.add(c, r, out=c) if apos == 0 else np.add(r, c, out=c)

    # the kernel path (fits, the kernel and a 4-D x, the core hot): what a segment replays (:mod:`.segments`)
    parts = {"x": x, "cosine": cos, "sine": sin, "fits": fits, "reads": bounds.reads, "kernel": kernel}
    return Match("rope", members, [x, cos, sin], fast, root.outputs[0], parts)


# ------------------------------------------------------------------------------------------------
# silu gate
# ------------------------------------------------------------------------------------------------
#: ``[True]``: the fused SwiGLU gate runs on the numba kernel :func:`nnef_kv.kernels.gate.silu_gate` when numba is
#: there (one pass instead of six NumPy calls; its exp is not NumPy's, so its results are within the kernel's
#: error bound, not the unfused plan's bits). ``[False]``: the unfused chain's NumPy calls (the bit-for-bit
#: comparisons of fused and unfused plans in tests/unit/test_patterns.py set it).
GATE_KERNEL = [True]


def match_silu_gate(flow: Flow, k: int, taken: set[int]) -> Match | None:
    root = flow.nodes[k]
    if root.op != "mul" or pair(root) is None:
        return None
    for upos, (a, u) in enumerate((pair(root), pair(root)[::-1])):
        w_ = Walk(flow, taken)
        ma = w_.inner(a, k, "mul")
        if not ma or pair(ma[1]) is None:
            continue
        for gpos, (g, s) in enumerate((pair(ma[1]), pair(ma[1])[::-1])):
            mark = set(w_.members)
            sg = w_.inner(s, ma[0], "sigmoid")
            if sg and sg[1].inputs == [g] and u != g:
                break
            w_.members = mark
        else:
            continue
        break
    else:
        return None
    members = sorted(w_.members | {k})
    kernel = flow.kernels

    def fast(v: list, g=g, u=u, gpos=gpos, upos=upos, kernel=kernel) -> Any:
        gv, uv = v[g], v[u]
        if not (is_f32(gv) and is_f32(uv) and gv.shape == uv.shape):
            return NotImplemented
        if kernel and GATE_KERNEL[0] and gv.ndim and gv.size:
            core = gate.silu_gate.hot()
            if core is not None:  # the kernel: one pass (see nnef_kv.kernels.gate), within its error bound
                n = gv.shape[-1]
                g2, u2 = gv.reshape(-1, n), uv.reshape(-1, n)
                out = np.empty(gv.shape, np.float32)
                if core is not gate.silu_gate:
                    g2 = g2 if gate.readable(g2) else np.ascontiguousarray(g2)
                    u2 = u2 if gate.readable(u2) else np.ascontiguousarray(u2)
                core(g2, u2, out.reshape(-1, n))
                return out
        t = np.negative(gv)
        with np.errstate(over="ignore"):
            np.exp(t, out=t)
        np.add(1, t, out=t)
        np.divide(1, t, out=t)  # sigmoid: 1 / (1 + exp(-g))
        if gpos == 0:
            np.multiply(gv, t, out=t)
        else:
            np.multiply(t, gv, out=t)
        return np.multiply(t, uv, out=t) if upos == 0 else np.multiply(uv, t, out=t)

    # the kernel path (f32 g and u of one shape, not empty, GATE_KERNEL, the core hot): what :mod:`.dense` replays
    return Match("silu_gate", members, [g, u], fast, root.outputs[0], {"g": g, "u": u, "kernel": kernel})


# ------------------------------------------------------------------------------------------------
# casts to the dtype a value already has
# ------------------------------------------------------------------------------------------------
#: ops whose kernel returns a new array every time (no view of an operand): their value, read by nothing
#: but a cast, may become the cast's value when no conversion is needed
_FRESH = tuple(sorted(ops_having("fresh")))


def match_same_dtype_cast(flow: Flow, k: int, taken: set[int]) -> Match | None:
    """``tract_core_cast(y, to = 'f32')`` of a fresh f32 value ``y`` read by the cast alone: the cast's value
    is ``y`` itself (the copy the cast makes is the only difference, and nothing else holds ``y``)."""
    root = flow.nodes[k]
    if root.op != "tract_core_cast" or root.attrs.get("to") != "f32" or len(root.inputs) != 1:
        return None
    w_ = Walk(flow, taken)
    got = w_.inner(root.inputs[0], k, *_FRESH)
    if not got or root.outputs[0] in flow.pinned:
        return None
    prod_k, prod = got
    y = prod.outputs[0]
    # an add's result cast to its own dtype (a residual add of torch-to-nnef's exports): a run of .dense adds it
    plain_add = prod.op == "add" and not prod.attrs and len(prod.inputs) == 2 and all(isinstance(i, int)
                                                                                      for i in prod.inputs)
    return Match("cast", [prod_k, k], [s for spec in prod.inputs for s in slots_of(spec)], ("alias", prod_k, y),
                 root.outputs[0], {"add": tuple(prod.inputs)} if plain_add else None)


MATCHERS = (match_rms_norm, match_rope, match_silu_gate, match_attention, match_views, match_same_dtype_cast)


def _aliasing(producer: Step, pnode: Node, cast: Step, y: int, out: int) -> Any:
    """Fast form of a same-dtype cast chain: run the producer; its f32 array is the value, anything else
    goes through the cast step as before."""
    from .execute import node_error

    def fast(v: list) -> Any:
        try:
            producer(v, [])
        except Exception as exc:
            raise node_error(pnode, exc) from exc
        yv = v[y]
        if type(yv) is np.ndarray and yv.dtype == _F32:
            v[y] = None
            return yv
        cast(v, [])
        return v[out]
    return fast


def fuse_patterns(graph: Graph, steps: list[Step], nodes: list[Node], base: list[Any], kernels: bool = True
                  ) -> tuple[list[Step], list[Node], set[int], dict[str, int]]:
    """Every chain of :data:`MATCHERS` in the steps -> one step; returns the new steps and nodes, the slots
    no longer materialised, and the count by pattern. ``kernels``: the fused forms may run the numba decode
    kernels (see :class:`.chains.Flow`)."""
    flow = Flow(graph, nodes, base)
    flow.kernels = kernels
    if flow.unknown:
        return steps, nodes, set(), {}
    taken: set[int] = set()
    matches: dict[int, Match] = {}
    for k in reversed(range(len(nodes))):  # roots first: a chain's own inner steps are never roots
        if k in taken:
            continue
        for matcher in MATCHERS:
            m = matcher(flow, k, taken)
            if m is not None and not taken.intersection(m.members):
                matches[k] = m
                taken.update(m.members)
                break
    if not matches:
        return steps, nodes, set(), {}
    counts: dict[str, int] = {}
    elided: set[int] = set()
    new_steps: list[Step] = []
    new_nodes: list[Node] = []
    for k, (st, nd) in enumerate(zip(steps, nodes)):
        m = matches.get(k)
        if m is not None and isinstance(m.fast, tuple):  # a same-dtype cast: the producer's value itself
            _, pk, y = m.fast
            m.fast = _aliasing(steps[pk], nodes[pk], steps[k], y, m.out)
        if m is not None:
            ms = [(steps[i], nodes[i]) for i in m.members]
            node = chain_node(m.op, [nodes[i] for i in m.members], m.inputs)
            step = chain_step(ms, m.fast, m.out)
            step.match = m  # type: ignore[attr-defined]  # read by the dense pass
            new_steps.append(step)
            new_nodes.append(node)
            counts[m.op] = counts.get(m.op, 0) + 1
            elided.update(s for i in m.members[:-1] for s in nodes[i].outputs)
            continue
        if k in taken:
            continue
        new_steps.append(st)
        new_nodes.append(nd)
    return new_steps, new_nodes, elided, counts
