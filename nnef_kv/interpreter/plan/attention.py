"""The attention chain (grouped-query repeat included) and reshape/transpose view chains: matchers for
:mod:`.patterns` (see there for what the fused forms guarantee). What an attention is, is the one
recognizer's (:func:`.recognize.attention_core`); :func:`match_attention` keeps the attentions whose form the
fast step runs bit for bit, with every inner value read inside the chain alone."""
from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from ...kernels import attend
from ...kv import blocked
from ..catalog import ops_having
from ..graph import Node
from ..values import Lazy
from .chains import Flow
from .matching import Match, Walk, attr_fn, frozen, is_f32, lazy_reads, pair, reshaped, same_objects, scalarish
from .kv_caches import repeat_nodes
from .recognize import attention_core
from .view import View

__all__ = ["match_attention", "match_views", "apply_view", "DECODE_KERNEL"]

#: ``[True]``: a call of at most :data:`nnef_kv.kernels.attend.MAX_ROWS` query rows (a decode step) runs on the
#: numba kernel :func:`nnef_kv.kernels.attend.attend_rows` when numba is there: the same arithmetic in one call
#: instead of a dozen NumPy calls, its sums in another order (within the kernel's error bound, not the unfused
#: plan's bits); a prefill taken in blocks of query rows turns each block's scores into probabilities with
#: :func:`nnef_kv.kernels.attend.softmax_rows` (within its bound). ``[False]``: every call runs the NumPy calls
#: the unfused chain makes (the bit-for-bit comparisons of fused and unfused plans in
#: tests/unit/test_patterns.py set it).
DECODE_KERNEL = [True]


# ------------------------------------------------------------------------------------------------
# attention
# ------------------------------------------------------------------------------------------------
def _repeat_chain(w_: Walk, slot: int, reader: int) -> tuple[int, bool, Node, list[Node]] | None:
    """The grouped-query repeat the recognizer follows K/V through (:func:`.kv_caches.repeat_nodes`) when it is
    ``reshape+(tile(unsqueeze(kv, [2])))`` read only by ``reader``: (the slot the chain reads, whether that is
    the unsqueezed ``[B, Hkv, 1, T, D]`` value, the tile, the reshapes in order). The unsqueeze joins the chain
    when nothing else reads its value; torch-to-nnef also takes its shape (``tract_core_shape_of``) for the
    tile's repeats: then it stays a step of its own (a view) and the chain reads its output."""
    nodes = repeat_nodes(_view(w_.flow), slot)
    at = next((i for i, n in enumerate(nodes) if n.op == "unsqueeze"), None)
    if at is None or at < 2 or nodes[at - 1].op != "tile" or any(n.op != "reshape" for n in nodes[:at - 1]):
        return None
    if nodes[at].attrs.get("axes") != [2] or nodes[at].prim.stateful or not isinstance(nodes[at].inputs[0], int):
        return None
    mark = set(w_.members)
    cur, rd = slot, reader
    for n in nodes[:at]:  # the reshapes and the tile, each read by the one before alone
        got = _claim(w_, cur, rd, n)
        if not got or not isinstance(n.inputs[0], int):
            w_.members = mark
            return None
        cur, rd = n.inputs[0], got[0]
    tile, reshapes = nodes[at - 1], nodes[:at - 1][::-1]
    un = _claim(w_, cur, rd, nodes[at])
    if un:
        return nodes[at].inputs[0], False, tile, reshapes
    return cur, True, tile, reshapes


def _repeats(kv: np.ndarray, tile: Node, reshapes: list[Node], v: list) -> int | None:
    """``g`` when the repeat chain makes ``[B, Hkv*g, T, D]`` of ``kv [B, Hkv, T, D]`` by adjacent copies."""
    reps = attr_fn(tile, "repeats", ())(v)
    try:
        reps = [int(r) for r in reps]
    except (TypeError, ValueError):
        return None
    if len(reps) != 5 or reps[:2] != [1, 1] or reps[3:] != [1, 1] or reps[2] < 1:
        return None
    b, h, t, d = kv.shape
    g = reps[2]
    dims: list[int] | None = [b, h, g, t, d]
    for r in reshapes:
        dims = reshaped(dims, r, v) if dims is not None else None
    return g if dims == [b, h * g, t, d] else None


#: ``(text, slots read) of a reshape target -> (the objects it read, its value)``: every layer of a decode step
#: evaluates the same target (``[1, 9, total_len, 64]``) on the same values (a shape memo's), so it is
#: evaluated once a step instead of twice a layer; kept only when those objects cannot change (:func:`frozen`)
_TARGETS: dict = {}


class _RepeatCheck:
    """:func:`_repeats` of one repeat chain, with a shortcut for the form exporters write: static repeats
    ``[1, 1, g, 1, 1]`` and one reshape of the whole shape (``axis_start 0``, ``axis_count -1``) whose target
    (a run-time attribute: it holds the cache length) evaluates to four positive integers: then the chain
    repeats in place exactly when that target is ``[B, Hkv * g, T, D]`` (one attribute evaluation a step instead
    of the general reshape rule's, shared by the layers, :data:`_TARGETS`). Anything else takes
    :func:`_repeats`."""

    def __init__(self, tile: Node, reshapes: list[Node]) -> None:
        self.tile, self.reshapes = tile, reshapes
        reps = tile.attrs.get("repeats")
        self.g = 0
        if len(reshapes) == 1 and isinstance(reps, list) and len(reps) == 5 and all(type(r) is int for r in reps) \
                and reps[:2] == [1, 1] and reps[3:] == [1, 1] and reps[2] >= 1 \
                and reshapes[0].attrs.get("axis_start", 0) == 0 and reshapes[0].attrs.get("axis_count", -1) == -1:
            self.g = reps[2]
            self.shape = attr_fn(reshapes[0], "shape", ())
            lz = reshapes[0].attrs.get("shape")
            self.lazy = lz if isinstance(lz, Lazy) and lz.reads is not None else None
            self.key = (lz.text, tuple(lz.reads)) if self.lazy is not None else None

    def _target(self, v: list) -> Any:
        lz = self.lazy
        if lz is None:
            return self.shape(v)
        objs = tuple([v[s] for s in lz.reads])
        e = _TARGETS.get(self.key)
        if e is not None and same_objects(objs, e[0]):
            return e[1]
        got = lz.fn(v)
        if all(map(frozen, objs)):
            if len(_TARGETS) > 1024:  # targets of plans long gone (a process planning many models)
                _TARGETS.clear()
            _TARGETS[self.key] = (objs, got)  # one assignment: a thread reads the old pair or the new one
        return got

    def __call__(self, kv: np.ndarray, v: list) -> int | None:
        if self.g:
            try:
                target = self._target(v)
                if len(target) == 4 and all(type(x) is int and x > 0 for x in target):
                    b, h, t, d = kv.shape
                    return self.g if target == [b, h * self.g, t, d] or tuple(target) == (b, h * self.g, t, d) \
                        else None
            except TypeError:
                pass
        return _repeats(kv, self.tile, self.reshapes, v)


def _rows_contiguous(x: np.ndarray) -> np.ndarray:
    """``x`` when each of its ``[T, D]`` matrices has contiguous rows (what a product by the tiled copy
    sees: BLAS may sum in another order for other strides), else a C-contiguous copy (of the kv heads,
    not of the repeats)."""
    if x.strides[-1] == x.itemsize and x.strides[-2] == x.itemsize * x.shape[-1]:
        return x
    return np.ascontiguousarray(x)


def _attend_rows(q: np.ndarray, kv: np.ndarray, vv: np.ndarray, mv: np.ndarray | None, g: int, scale: Any,
                 spos: int, mpos: int, kt: np.ndarray | None = None, softmax: Any = None) -> np.ndarray:
    """The unfused chain's operations for the query rows of ``q [B, Hq, m, D]`` over ``kv, vv [B, Hkv, T, D]``
    (query head ``h`` reads kv head ``h // g``): scores, ``* scale``, ``+ mv`` (its rows of these queries),
    softmax over the keys, the weighted sum (``[B, Hq, m, Dv]``). ``kt``: the keys as ``[B, Hkv, D, T]`` with
    contiguous rows (a block of a prefill: its scores are then products of untransposed operands, which
    BLAS runs about twice as fast at ``D = 64`` as the transposed view's; the same sums in another order).
    ``softmax``: what :meth:`~nnef_kv.kernels.Kernel.hot` gave for :func:`nnef_kv.kernels.attend.softmax_rows`
    (a block of a prefill), which then turns the scores into probabilities in one call."""
    b, hq, sq, d = q.shape
    hkv, t = kv.shape[1], kv.shape[2]
    kT = np.swapaxes(kv, -1, -2) if kt is None else kt
    if g == 1:
        s = np.matmul(q, kT)
        sv = s
    else:
        s = np.matmul(q.reshape(b, hkv, g, sq, d), kT[:, :, None])
        sv = s.reshape(b, hq, sq, t)
    if softmax is not None and (mv is None or attend.mask_readable(mv)):
        if softmax is attend.softmax_rows:
            softmax(sv, mv, None if scale is None else np.float32(scale.reshape(())))
        else:
            softmax(sv, attend.NO_MASK if mv is None else mv, np.float32(1 if scale is None else scale.reshape(())),
                    scale is not None)
    else:
        _softmax(sv, mv, scale, spos, mpos)
    if g == 1:
        return np.matmul(s, vv)
    return np.matmul(s, vv[:, :, None]).reshape(b, hq, sq, vv.shape[3])


#: ``(weak reference to a mask, {(first row, end row): blocked.mask_cut of its rows})``: every layer of a prefill
#: reads the same mask (one value of the run), so the blocks' cuts are read off it once, not once a layer
_CUTS: list = [None]


def _mask_cuts(mv: np.ndarray) -> dict | None:
    """The cuts remembered for ``mv`` (a new empty dict when it is not the mask remembered), or None when its
    values could change while it lives (not :func:`frozen`: a mask fed by the caller usually is not, and is then
    read each time)."""
    if not frozen(mv):
        return None
    e = _CUTS[0]
    if e is not None and e[0]() is mv:
        return e[1]
    cuts: dict = {}
    _CUTS[0] = (weakref.ref(mv), cuts)  # one assignment: a thread reads the old pair or the new one
    return cuts


def _softmax(sv: np.ndarray, mv: np.ndarray | None, scale: Any, spos: int, mpos: int) -> None:
    """The unfused chain's calls from the scores to the probabilities, in place."""
    if scale is not None:
        if spos == 1:
            np.multiply(sv, scale, out=sv)
        else:
            np.multiply(scale, sv, out=sv)
    if mv is not None:
        if mpos == 0:
            np.add(sv, mv, out=sv)
        else:
            np.add(mv, sv, out=sv)
    mx = np.max(sv, axis=3, keepdims=True)
    np.subtract(sv, mx, out=sv)
    np.exp(sv, out=sv)
    np.divide(sv, np.sum(sv, axis=3, keepdims=True), out=sv)


def _view(flow: Flow) -> View:
    """The recognizer's view of the planned steps (built once per pass)."""
    got = getattr(flow, "view", None)
    if got is None:
        got = View(flow.graph, nodes=flow.nodes, constants={s: x for s, x in enumerate(flow.base) if x is not None})
        flow.view = got  # type: ignore[attr-defined]
    return got


def _claim(w_: Walk, slot: Any, reader: int, node: Node | str) -> tuple[int, Node] | None:
    """``node`` (or the node of that name), the producer of ``slot``, as a member read by ``reader`` alone (see
    :meth:`.matching.Walk.inner`)."""
    got = w_.flow.node_of(slot)
    if got is None or not (got[1] is node or got[1].name == node):
        return None
    return w_.inner(slot, reader, got[1].op)


def match_attention(flow: Flow, k: int, taken: set[int]) -> Match | None:
    """The decomposed attention the recognizer (:func:`.recognize.attention_core`) finds at the ``p . V`` product
    ``k``, in the form the fast step runs: ``matmul(q, K^T)`` (``transposeB`` or a ``transpose(K, [0, 1, 3, 2])``),
    then at most a constant scale and then an additive mask, a softmax over one axis, at most a cast to f32,
    each read by the next alone."""
    root = flow.nodes[k]
    if root.op != "matmul" or pair(root) is None or root.attrs.get("transposeA") or root.attrs.get("transposeB"):
        return None
    core = attention_core(_view(flow), root)
    if core is None or len(core.forward) > 1 or core.product.op != "matmul" \
            or [o[0] for o in core.ops] not in ([], ["mul"], ["mask"], ["mul", "mask"]):
        return None
    w_ = Walk(flow, taken)
    p_slot, v_slot = pair(root)
    p_slot, cast = w_.castis_f32(p_slot, k)
    if (cast is None) != (not core.forward):
        return None
    sm = _claim(w_, p_slot, cast if cast is not None else k, core.softmax)
    axes = sm and sm[1].attrs.get("axes")
    if not (sm and isinstance(axes, list) and len(axes) == 1 and type(axes[0]) is int):
        return None
    z, zr = sm[1].inputs[0], sm[0]
    mask, mpos, scale, spos = None, 0, None, 0
    for kind, val, name in reversed(core.ops):
        got = _claim(w_, z, zr, name)
        if not got or pair(got[1]) is None:
            return None
        a0, a1 = pair(got[1])
        if kind == "mask":
            mask, mpos = val, (0 if a1 == val else 1)
            z = a0 if mpos == 0 else a1
        else:
            spos = 1 if flow.const(a1) is not None else 0 if flow.const(a0) is not None else -1
            if spos < 0:
                return None
            scale = flow.const(a1 if spos == 1 else a0)
            z = a0 if spos == 1 else a1
        zr = got[0]
    qk = _claim(w_, z, zr, core.product)
    if not qk or pair(qk[1]) is None:
        return None
    q_slot, kt_slot = pair(qk[1])
    if qk[1].attrs.get("transposeB"):
        if core.key_path:
            return None
        k_slot, kt_reader = kt_slot, qk[0]
    elif len(core.key_path) == 1 and (tr := _claim(w_, kt_slot, qk[0], core.key_path[0])) is not None:
        k_slot, kt_reader = tr[1].inputs[0], tr[0]
    else:
        return None
    krep = _repeat_chain(w_, k_slot, kt_reader)
    vrep = _repeat_chain(w_, v_slot, k)
    if (krep is None) != (vrep is None):
        return None
    kk = krep[0] if krep else k_slot
    vv = vrep[0] if vrep else v_slot
    if not all(isinstance(s, int) for s in (q_slot, kk, vv)) or (mask is not None and not isinstance(mask, int)):
        return None
    ax = axes[0]
    members = sorted(w_.members | {k})
    inputs = [q_slot, kk, vv] + ([mask] if mask is not None else [])
    sc = np.float32(scale.reshape(())) if scalarish(scale, 4) else np.float32(1)
    kernel = flow.kernels
    kcheck = _RepeatCheck(krep[2], krep[3]) if krep else None
    vcheck = _RepeatCheck(vrep[2], vrep[3]) if vrep else None

    def checks(v: list, q: np.ndarray, kv: Any, vv_: Any, krep=krep, kcheck=kcheck, vcheck=vcheck,
               mask=mask) -> tuple[int, Any] | None:
        """``(g, mask value)`` when the chain's fast form takes these 4-D f32 queries with these keys and
        values (f32, 4-D, the grouped-query repeat in place, the mask broadcasting), else None."""
        if not (is_f32(kv) and is_f32(vv_) and kv.ndim == 4 and vv_.ndim == 4):
            return None
        b, hq, sq, d = q.shape
        b2, hkv, t, d2 = kv.shape
        if krep is not None:
            g = kcheck(kv, v)
            if g is None or vcheck(vv_, v) != g:
                return None
        else:
            g = 1
        if (b2, d2) != (b, d) or vv_.shape[:3] != (b, hkv, t) or hkv * g != hq:
            return None
        mv = None
        if mask is not None:
            mv = v[mask]
            if not (is_f32(mv) and mv.ndim == 4):
                return None
            m0, m1, m2, m3 = mv.shape  # broadcasting to [b, hq, sq, t]
            if not ((m0 == b or m0 == 1) and (m1 == hq or m1 == 1) and (m2 == sq or m2 == 1) and (m3 == t or m3 == 1)):
                return None
        return g, mv

    def decode(q: np.ndarray, kv: np.ndarray, vv_: np.ndarray, mv: Any, g: int, scale=scale, sc=sc,
               kernel=kernel) -> np.ndarray | None:
        """The decode kernel's result for checked operands (:func:`checks`) when it takes them, else None."""
        sq, t = q.shape[2], kv.shape[2]
        if sq <= attend.MAX_ROWS and 0 < t <= attend.MAX_KEYS and attend.readable(kv) and attend.readable(vv_):
            core = attend.attend_rows.hot() if DECODE_KERNEL[0] and kernel else None
            if core is not None:
                out = np.empty(q.shape[:3] + vv_.shape[3:], np.float32)
                if core is attend.attend_rows:
                    core(q, kv, vv_, mv, g, None if scale is None else sc, out)
                else:
                    core(q, kv, vv_, attend.NO_MASK if mv is None else mv, g, sc, scale is not None, out)
                return out
        return None

    static = ax in (-1, 3) and (scale is None or scalarish(scale, 4))

    def fast(v: list, q_=q_slot, k_=kk, v_=vv, scale=scale, spos=spos, mpos=mpos, krep=krep, vrep=vrep,
             checks=checks, decode=decode, static=static) -> Any:
        q, kv, vv_ = v[q_], v[k_], v[v_]
        if krep is not None and krep[1]:  # the chains read the unsqueezed [B, Hkv, 1, T, D] values
            if not (type(kv) is np.ndarray and kv.ndim == 5 and kv.shape[2] == 1 and type(vv_) is np.ndarray
                    and vv_.ndim == 5 and vv_.shape[2] == 1 and vrep[1]):
                return NotImplemented
            kv, vv_ = kv[:, :, 0], vv_[:, :, 0]
        elif vrep is not None and vrep[1]:
            return NotImplemented
        if not (static and is_f32(q) and q.ndim == 4):
            return NotImplemented
        got = checks(v, q, kv, vv_)
        if got is None:
            return NotImplemented
        g, mv = got
        out = decode(q, kv, vv_, mv, g)
        if out is not None:
            return out
        b, hq, sq, d = q.shape
        t = kv.shape[2]
        if krep is not None:  # the unfused products read the tile's copies: [T, D] rows, contiguous
            kv, vv_ = _rows_contiguous(kv), _rows_contiguous(vv_)
        bq = blocked.row_block(b * hq * t * 4, sq)
        smax = None
        if mv is not None and mv.shape[2] == sq and mv.shape[3] == t and sq >= 2 * blocked.CAUSAL_ROWS and 2 * sq > t:
            smax = blocked.score_bound(q, kv, vv_, scale)  # a causal-looking prefill: blocks may leave keys out
            if smax is not None:
                bq = min(bq, max(blocked.CAUSAL_ROWS, -(-sq // blocked.CAUSAL_BLOCKS)))
        if bq >= sq:
            return _attend_rows(q, kv, vv_, mv, g, scale, spos, mpos)
        out = np.empty((b, hq, sq, vv_.shape[3]), np.float32)
        kt = np.ascontiguousarray(np.swapaxes(kv, -1, -2))  # one copy of the keys, read by every block
        sm = attend.softmax_rows.hot() if DECODE_KERNEL[0] and kernel else None
        cuts = _mask_cuts(mv) if smax is not None else None
        for i0, i1 in blocked.row_ranges(sq, bq):  # a long prefill: the scores of a block of queries at a time
            mb = mv if mv is None or mv.shape[2] == 1 else mv[:, :, i0:i1]
            c = t
            if smax is not None:
                cut_gap = cuts.get((i0, i1)) if cuts is not None else None
                if cut_gap is None:
                    cut_gap = blocked.mask_cut(mb)
                    if cuts is not None:
                        cuts[(i0, i1)] = cut_gap
                c = blocked.unseen_given(cut_gap, smax, t)
            if c < t:
                out[:, :, i0:i1] = _attend_rows(q[:, :, i0:i1], kv[:, :, :c], vv_[:, :, :c], mb[..., :c], g, scale,
                                                spos, mpos, kt[..., :c], sm)
            else:
                out[:, :, i0:i1] = _attend_rows(q[:, :, i0:i1], kv, vv_, mb, g, scale, spos, mpos, kt, sm)
        return out

    # what a segment (:mod:`.segments`) calls with the queries it made: the checks and the decode kernel, when
    # the chains read the caches themselves (not unsqueezed) and the static attributes suit the fast form
    plain = static and not (krep is not None and krep[1]) and not (vrep is not None and vrep[1])
    parts = {"q": q_slot, "k": kk, "v": vv, "checks": checks, "decode": decode} if plain else None
    return Match("attention", members, inputs, fast, root.outputs[0], parts)


# ------------------------------------------------------------------------------------------------
# views: reshape / transpose chains
# ------------------------------------------------------------------------------------------------
class _ViewPlan:
    """The NumPy calls a chain of reshapes and transposes makes, resolved once per input shape and per
    set of objects its run-time attributes read (a shape memo hands out the same objects while shapes do
    not change): ``("reshape", shape)`` / ``("transpose", perm)``."""

    def __init__(self, members: list[Node]) -> None:
        self.members = members
        self.reads = tuple(s for n in members for s in lazy_reads(n))
        self.entry: tuple | None = None

    def resolve(self, v: list, shape: tuple[int, ...]) -> list[tuple[str, Any]] | None:
        objs = tuple([v[s] for s in self.reads])
        e = self.entry
        if e is not None and e[0] == shape and same_objects(objs, e[1]):
            return e[2]
        dims: list[int] | None = list(shape)
        ops: list[tuple[str, Any]] | None = []
        for n in self.members:
            if n.op == "reshape":
                dims = reshaped(dims, n, v)
                if dims is None:
                    ops = None
                    break
                ops.append(("reshape", tuple(dims)))
            else:
                axes = n.attrs.get("axes")
                if not isinstance(axes, list) or sorted(axes) != list(range(len(axes))) or len(axes) > len(dims):
                    ops = None
                    break
                perm = list(axes) + list(range(len(axes), len(dims)))
                ops.append(("transpose", tuple(perm)))
                dims = [dims[i] for i in perm]
        self.entry = (shape, objs, ops)
        return ops

    def apply(self, v: list, y: Any) -> tuple[list[tuple[str, Any]], np.ndarray] | None:
        """``(ops, y through them)`` for an array ``y`` whose shape the chain resolves (:meth:`resolve`), else
        None."""
        if type(y) is not np.ndarray:
            return None
        ops = self.resolve(v, y.shape)
        return None if ops is None else (ops, apply_view(y, ops))


def apply_view(y: np.ndarray, ops: list[tuple[str, Any]]) -> np.ndarray:
    """``y`` through the NumPy views :meth:`_ViewPlan.resolve` gave."""
    for kind, arg in ops:
        y = y.reshape(arg) if kind == "reshape" else y.transpose(arg)
    return y


def match_views(flow: Flow, k: int, taken: set[int]) -> Match | None:
    """``reshape`` / ``transpose`` steps chained through values read by the next one alone (two at least,
    or one reshape with run-time attributes): one step applying the same NumPy views."""
    root = flow.nodes[k]
    if root.op not in ops_having("numpy_view") or not root.inputs or not isinstance(root.inputs[0], int):
        return None
    w_ = Walk(flow, taken)
    chain = [root]
    cur, rd = root.inputs[0], k
    while True:
        got = w_.inner(cur, rd, *sorted(ops_having("numpy_view")))
        if not got or not got[1].inputs or not isinstance(got[1].inputs[0], int):
            break
        chain.insert(0, got[1])
        cur, rd = got[1].inputs[0], got[0]
    if len(chain) == 1 and not lazy_reads(root):
        return None
    if any(n.op == "transpose" and (isinstance(n.attrs.get("axes"), Lazy) or len(n.inputs) != 1) for n in chain):
        return None
    x = chain[0].inputs[0]
    plan = _ViewPlan(chain)
    members = sorted(w_.members | {k})

    def fast(v: list, x=x, plan=plan) -> Any:
        got = plan.apply(v, v[x])
        return NotImplemented if got is None else got[1]

    return Match("view", members, [x], fast, root.outputs[0], {"x": x, "plan": plan})
