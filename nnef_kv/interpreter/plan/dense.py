"""Runs of a decode step's dense operations replayed in one kernel call.

Between two attentions a LLaMA-style decoder's plan runs products by constant weights, residual adds, RMS
norms and SwiGLU gates: nine steps a layer, each a Python call checking its operands (about 30 us a layer on
a decode token here, and more in a real run, where every product has just streamed megabytes through the
caches). :func:`dense_runs` makes each run of at least :data:`MIN_STEPS` consecutive such steps, with a
product among them, one :class:`Run` step. The members are:

* a product by a constant f32 weight without bias (``linear`` / ``matmul`` rewritten by :mod:`.weights`, a
  fused projection with its parts), smaller than :data:`.parallel.MIN_ROWS_SPLIT_BYTES` (a larger one is
  split across the threads when there are two: it stays a step, so that a run is the same with one thread
  or two);
* ``add`` of two values (no attributes);
* the ``rms_norm`` and ``silu_gate`` chains of :mod:`.patterns`.

A run replays its members through :func:`nnef_kv.kernels.dense.run_ops` when its inputs (the values it reads
from outside) are f32, C-contiguous, **one row** (a decode step of one sequence) and of shapes it has checked:
the first time it sees a tuple of input shapes it works out every member's value shape and checks that each
member takes its kernel path on them (the product the few-row kernel, the RMS norm and the gate their
kernels: the same compiled cores :func:`~nnef_kv.kernels.dense.run_ops` calls, so the same bits); while the
shapes do not change, each call costs those checks on the inputs only. Anything else (a prefill's rows, other
dtypes, a kernel not compiled yet or switched off, a member falling back) runs the member steps one by one.

The values read only inside a run are not materialised (``Plan.elided``: a run capturing one runs the
unfused plan); the others are written to the run's values as the members would.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ...kernels import dense as K
from ...kernels import gate, rowwise
from ..graph import Node, slots_of
from ..values import Lazy
from .chains import Flow, chain_members, chain_node
from .execute import run_members
from .parallel import MIN_ROWS_SPLIT_BYTES, _FEW_ROWS
from .patterns import GATE_KERNEL
from .steps import Step

__all__ = ["dense_runs", "Run", "MIN_STEPS", "REPLAY"]

#: the fewest steps a run replaces (a shorter one saves less than its checks cost)
MIN_STEPS = 3
#: ``[False]``: every run runs its member steps one by one (the tests compare the two; a debugging switch)
REPLAY = [True]
_F32 = np.dtype(np.float32)


class _Member:
    """One step of a run: ``kind`` (product, add, rms, gate), the slots it reads and writes, its parameters."""

    def __init__(self, kind: str, ins: list[int], outs: list[int], **kw: Any) -> None:
        self.kind, self.ins, self.outs = kind, ins, outs
        self.__dict__.update(kw)


def _member(step: Step, node: Node, base: list[Any]) -> _Member | None:
    """The step as a run member, or None."""
    p = getattr(step, "product", None)
    if p is not None:
        x, wt, parts = p
        if isinstance(wt, int):  # the weight's slot: the array the step reads (in huge pages when moved there)
            wt = base[wt]
        if (isinstance(x, int) and isinstance(wt, np.ndarray) and wt.dtype == _F32 and wt.ndim == 2
                and wt.flags.f_contiguous and 0 < wt.nbytes < MIN_ROWS_SPLIT_BYTES and wt.shape[0] > 0):
            return _Member("product", [x], [o for o, _, _ in parts], w=wt.T, parts=parts)
        return None
    m = getattr(step, "match", None)
    if m is not None and m.parts is not None and not any(isinstance(a, Lazy) for a in node.attrs.values()):
        if m.op == "rms_norm" and m.parts["wvec"] is not None:
            return _Member("rms", [m.parts["x"]], [m.out], fits=m.parts["fits"], eps=m.parts["eps32"],
                           wvec=m.parts["wvec"])
        if m.op == "silu_gate" and m.parts["kernel"]:
            return _Member("gate", [m.parts["g"], m.parts["u"]], [m.out])
        if m.op == "cast" and "add" in m.parts:  # an add cast to its own dtype: for f32 operands, the add
            return _Member("add", list(m.parts["add"]), [m.out])
        return None
    if (node.op == "add" and chain_members(node) is None and not node.attrs and not node.prim.stateful
            and len(node.inputs) == 2 and all(isinstance(i, int) for i in node.inputs)
            and len(node.outputs) == 1 and isinstance(node.outputs[0], int)):
        return _Member("add", list(node.inputs), [node.outputs[0]])
    return None


class Run:
    """The step of one run (see the module docstring). ``member_runs`` counts the calls that ran the member
    steps one by one; ``fallbacks`` is the members' own count (their fast forms' guards failing)."""

    def __init__(self, members: list[tuple[Step, Node]], ops: list[_Member], exported: set[int],
                 deferred: list[int]) -> None:
        self.members = members  # every step of the run, in order (the shape-only ones among them too)
        self.deferred = deferred  # indices into members of the shape-only steps: run after a replay
        self.ops = ops
        produced = [s for op in ops for s in op.outs]
        ext: list[int] = []
        for op in ops:
            for s in op.ins:
                if s not in produced and s not in ext:
                    ext.append(s)
        self.ext = tuple(ext)  # the run's inputs, in the order the program numbers them
        self.exported = exported
        self.has_gate = any(op.kind == "gate" for op in ops)
        self.has_rms = any(op.kind == "rms" for op in ops)
        #: input shapes -> the program for them (None: the members run); a prefill's and a decode step's both kept
        self.programs: dict[tuple, tuple | None] = {}
        self.member_runs = 0

    @property
    def fallbacks(self) -> int:
        return sum(getattr(st, "fallbacks", 0) for st, _ in self.members)

    # -- the program for one tuple of input shapes ----------------------------------------------------------
    def _program(self, shapes: tuple) -> tuple | None:
        """``(code, eps, widths of the outputs, exports, weights, [their typed list])`` for inputs of these
        shapes, or None when a member would not take its kernel path on them."""
        if any(len(s) < 1 or int(np.prod(s[:-1], dtype=np.int64)) != 1 for s in shapes):
            return None  # not one row
        index = {s: i for i, s in enumerate(self.ext)}
        shape = dict(zip(self.ext, shapes))
        weights: list[np.ndarray] = []
        widx: dict[int, int] = {}

        def weight(w: np.ndarray) -> int:
            if id(w) not in widx:
                widx[id(w)] = len(weights)
                weights.append(w)
            return widx[id(w)]

        code: list[list[int]] = []
        eps: list[float] = []
        outs: list[int] = []
        exports: list[tuple[int, int, tuple, int, int]] = []  # (slot, output, full shape, lo, hi)
        count = len(self.ext)

        def emit(row: list[int], e: float = 0.0) -> int:
            nonlocal count
            code.append(row)
            eps.append(e)
            count += 1
            return count - 1

        def export(width: int) -> int:
            outs.append(width)
            return len(outs) - 1

        for op in self.ops:
            if op.kind == "product":
                xs = shape[op.ins[0]]
                n, k = op.w.shape
                if len(xs) < 2 or xs[-1] != k:
                    return None
                full = xs[:-1] + (n,)
                out_ix = export(n) if any(o in self.exported for o in op.outs) else -1
                y = emit([K.PRODUCT, index[op.ins[0]], weight(op.w), 0, out_ix])
                for o, lo, hi in op.parts:
                    shape[o] = xs[:-1] + (hi - lo,)
                    if o in self.exported:
                        exports.append((o, out_ix, full, lo, hi))
                    if (lo, hi) == (0, n):
                        index[o] = y
                    else:  # a part read inside the run: its columns, a view
                        index[o] = emit([K.SLICE, y, lo, hi, -1])
                continue
            if op.kind in ("add", "gate"):
                sa, sb = shape[op.ins[0]], shape[op.ins[1]]
                if sa != sb or (op.kind == "gate" and not sa[-1]):
                    return None
                out_shape = sa
                row = [K.ADD if op.kind == "add" else K.GATE, index[op.ins[0]], index[op.ins[1]], 0]
                e = 0.0
            else:  # rms
                xs = shape[op.ins[0]]
                n = xs[-1]
                if not (n and op.wvec.size in (0, n) and op.fits(np.empty(xs, np.float32))):
                    return None
                out_shape = xs
                row = [K.RMS, index[op.ins[0]], weight(op.wvec.reshape(1, n)) if op.wvec.size else -1, 0]
                e = float(op.eps)
            o = op.outs[0]
            out_ix = export(out_shape[-1]) if o in self.exported else -1
            index[o] = emit(row + [out_ix], e)
            shape[o] = out_shape
            if o in self.exported:
                exports.append((o, out_ix, out_shape, 0, out_shape[-1]))
        return (np.array(code, np.int64), np.array(eps, np.float32), tuple(outs), tuple(exports), weights, [None])

    def _ready(self) -> Any:
        """The kernel to call (its compiled core, or the kernel itself before its first call) when every
        member's kernel is compiled and on, so that the members would call the cores the program calls;
        else None."""
        core = K.run_ops.hot()
        few = _FEW_ROWS[0]
        if core is None or few is None:
            return None
        jit = _JIT[0] or _jit()
        if few is not jit._rows_by_t:
            return None
        if self.has_rms and rowwise.rms_rows.hot() is not jit.rms_core:
            return None
        if self.has_gate and (not GATE_KERNEL[0] or gate.silu_gate.hot() is not jit.silu_core):
            return None
        return core

    def __call__(self, v: list, st: list) -> None:
        core = self._ready() if REPLAY[0] else None
        if core is not None:
            xs = [v[s] for s in self.ext]
            if all(type(x) is np.ndarray and x.dtype == _F32 and x.flags.c_contiguous for x in xs):
                shapes = tuple([x.shape for x in xs])
                try:
                    prog = self.programs[shapes]
                except KeyError:
                    if len(self.programs) >= 8:  # shapes of past calls (prompts of other lengths)
                        self.programs.clear()
                    prog = self.programs[shapes] = self._program(shapes)
                if prog is not None and self._replay(v, st, xs, prog, core):
                    return
        self.member_runs += 1
        run_members(self.members, v, st)

    def _replay(self, v: list, st: list, xs: list, prog: tuple, core: Any) -> bool:
        """Run the program; False (nothing written) when the kernel's first call found numba unable to compile
        it here: its NumPy reference ran, whose products are not the members' bits."""
        code, eps, widths, exports, weights, typed = prog
        ins = tuple([x.reshape(1, x.shape[-1]) for x in xs])
        outs = tuple([np.empty((1, n), np.float32) for n in widths])
        if core is K.run_ops:  # the first call: compiles (or loads numba's cache)
            core(code, eps, weights, ins, outs)
            if K.run_ops.broken is not None:
                return False
        else:
            if typed[0] is None:
                typed[0] = (_JIT[0] or _jit()).weight_list(weights)
            core(code, eps, typed[0], ins, outs)
        for slot, j, full, lo, hi in exports:
            y = outs[j].reshape(full)
            v[slot] = y if (lo, hi) == (0, full[-1]) else y[..., lo:hi]
        # shape-only steps among the members: they read the values just written
        run_members([self.members[i] for i in self.deferred], v, st)
        return True


#: the numba module of the kernel, once imported (:func:`nnef_kv.kernels.dense.numba_side`)
_JIT: list = [None]


def _jit() -> Any:
    _JIT[0] = K.numba_side()
    return _JIT[0]


def dense_runs(graph: Any, steps: list[Step], nodes: list[Node], base: list[Any]
               ) -> tuple[list[Step], list[Node], set[int], int]:
    """The steps with each run made one :class:`Run` step; returns the steps, the nodes, the slots no longer
    materialised and the number of runs."""
    flow = Flow(graph, nodes, base)
    if flow.unknown:
        return steps, nodes, set(), 0
    runs: list[tuple[int, int, list[_Member], set[int]]] = []
    i = 0
    while i < len(steps):
        ops: list[_Member] = []
        at: list[int] = []  # the members' step indices
        later: set[int] = set()  # outputs of the shape-only steps among them (run after a replay)
        j = i
        while j < len(steps):
            m = _member(steps[j], nodes[j], base)
            if m is not None and not later.intersection(m.ins):
                ops.append(m)
                at.append(j)
            elif ops and m is None and getattr(steps[j], "shape_only", False):
                later.update(s for spec in nodes[j].outputs for s in slots_of(spec))
            else:
                break
            j += 1
        if len(ops) >= MIN_STEPS and any(op.kind == "product" for op in ops):
            runs.append((i, at[-1] + 1, ops, set(at)))
            i = at[-1] + 1
        else:
            i = max(j, i + 1) if not ops else at[0] + 1
    if not runs:
        return steps, nodes, set(), 0
    start = {i: (j, ops, at) for i, j, ops, at in runs}
    elided: set[int] = set()
    new_steps: list[Step] = []
    new_nodes: list[Node] = []
    k = 0
    while k < len(steps):
        if k not in start:
            new_steps.append(steps[k])
            new_nodes.append(nodes[k])
            k += 1
            continue
        j, ops, at = start[k]
        produced = {s for op in ops for s in op.outs}
        # read by a step outside the members (a deferred shape-only step too) or a graph output: written
        exported = {s for s in produced if s in flow.pinned or any(r not in at for r in flow.readers.get(s, ()))}
        originals = [n for i in range(k, j) for n in (chain_members(nodes[i]) or (nodes[i],))]
        made = {s for i in range(k, j) for spec in nodes[i].outputs for s in slots_of(spec)}
        ins = sorted({s for i in range(k, j) for spec in nodes[i].inputs for s in slots_of(spec)} - made)
        node = chain_node("dense", originals, ins)
        new_steps.append(Run([(steps[i], nodes[i]) for i in range(k, j)], ops, exported,
                             [i - k for i in range(k, j) if i not in at]))
        new_nodes.append(node)
        elided |= {s for i in at for spec in nodes[i].outputs for s in slots_of(spec)} - exported
        k = j
    return new_steps, new_nodes, elided, len(runs)
