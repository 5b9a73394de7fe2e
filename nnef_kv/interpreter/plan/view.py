"""A built graph seen by a recognizer: who produces and who reads each slot, the document's name of each slot,
an operand by its parameter name, and the values that follow from the graph's constants alone, computed by
the op kernels (the interpreter's own evaluation: no second constant folder); and what a batched matrix
product node is (``matmul``, a two-operand ``tract_core_einsum``). Read by :mod:`.recognize` and
:mod:`.kv_caches`."""
from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import NnefKvError
from ..catalog import ops_having
from ..graph import Graph, Node, slots_of
from ...core.params import param_info
from ..values import Lazy

__all__ = ["View", "NotConstant", "product", "through_casts", "PASSTHROUGH"]

#: what a recognizer walks through: casts and copies (the ``passthrough`` fact)
PASSTHROUGH = ops_having("passthrough")

#: a constant is computed from at most this many nodes, on operands of at most this many elements
_CONST_NODES, _CONST_SIZE = 32, 4096


class View:
    """Who produces and who reads each slot of a built graph, its slots' names, and its constants."""

    def __init__(self, graph: Graph, where: str = "", nodes: list[Node] | None = None,
                 constants: dict[int, Any] | None = None) -> None:
        """``nodes`` / ``constants``: a plan's steps and values (the graph's nodes and constants by default)."""
        self.graph, self.where = graph, where or graph.filename
        self.nodes = graph.nodes if nodes is None else nodes
        self.constants = graph.constants if constants is None else constants
        self.producer: dict[int, Node] = {}
        self.readers: dict[int, list[Node]] = {}
        self.index: dict[str, int] = {}
        for i, n in enumerate(self.nodes):
            self.index[n.name] = i
            for spec in n.inputs:
                for s in slots_of(spec):
                    lst = self.readers.setdefault(s, [])
                    if not lst or lst[-1] is not n:
                        lst.append(n)
            for spec in n.outputs:
                for s in slots_of(spec):
                    self.producer[s] = n
        self.inputs = {i.slot: i.name for i in graph.inputs}
        self.input_ops = {i.slot: i.op for i in graph.inputs}
        self.names: dict[int, str] = {}
        for name, slot in graph.names.items():
            n = self.producer.get(slot)
            if slot not in self.names or (n is not None and n.name == name):
                self.names[slot] = name
        self._consts: dict[int, Any] = {}

    # -- slots and operands --------------------------------------------------------------------------
    def node(self, slot: Any) -> Node | None:
        return self.producer.get(slot) if isinstance(slot, int) else None

    def name(self, slot: Any) -> str:
        """The identifier of the document holding ``slot`` (else its node's name, else its input's)."""
        if not isinstance(slot, int):
            return "?"
        if slot in self.names:
            return self.names[slot]
        n = self.producer.get(slot)
        return n.name if n is not None else self.inputs.get(slot, f"<slot {slot}>")

    def op(self, slot: Any) -> str | None:
        """The op making ``slot``: its node's, or the source op of a graph input."""
        n = self.node(slot)
        return n.op if n is not None else self.input_ops.get(slot)

    def users(self, slot: int) -> list[Node]:
        """The nodes reading ``slot``'s value (a node reading its shape only, ``tract_core_shape_of``, is not one)."""
        return [n for n in self.readers.get(slot, []) if n.op != "tract_core_shape_of"]

    @staticmethod
    def out(n: Node) -> int:
        return slots_of(n.outputs[0])[0]

    @staticmethod
    def arg(n: Node, param: str) -> Any:
        """The input of ``n`` bound to tensor parameter ``param`` (a slot, a list of slots, None)."""
        tensors = [p.name for p in param_info(n.prim.decl)[0] if p.kind != "attr"]
        if param not in tensors:
            return None
        i = tensors.index(param)
        return n.inputs[i] if i < len(n.inputs) else None

    @staticmethod
    def first(n: Node) -> int | None:
        x = n.inputs[0] if n.inputs else None
        return x if isinstance(x, int) else None

    @staticmethod
    def attr(n: Node, name: str) -> Any:
        """A static attribute (None when absent or computed per run)."""
        v = n.attrs.get(name)
        return None if isinstance(v, Lazy) else v

    def axis(self, n: Node, name: str) -> int | None:
        """A one-axis attribute (``3``, ``[3]``), else None."""
        v = self.attr(n, name)
        if isinstance(v, (list, tuple)) and len(v) == 1:
            v = v[0]
        return int(v) if isinstance(v, (int, np.integer)) and not isinstance(v, bool) else None

    # -- values ---------------------------------------------------------------------------------------
    def const(self, slot: Any) -> np.ndarray | None:
        """The value of ``slot`` when it follows from the graph's constants alone (run by the op kernels, a
        few small nodes at most), else None."""
        if not isinstance(slot, int):
            return None
        if slot in self.constants:
            return np.asarray(self.constants[slot])
        if slot not in self._consts:
            self._consts[slot] = None
            try:
                self._consts[slot] = self.evaluate([slot], {})[slot]
            except (NotConstant, NnefKvError, ArithmeticError, ValueError, TypeError, IndexError):
                pass
        return self._consts[slot]

    def scalar(self, slot: Any) -> float | None:
        v = self.const(slot)
        if v is None or v.size != 1 or v.dtype == np.bool_ or not np.issubdtype(v.dtype, np.number):
            return None
        return float(v.ravel()[0])

    def evaluate(self, slots: list[int], given: dict[int, np.ndarray]) -> dict[int, Any]:
        """``slots`` computed by the op kernels from the graph's constants and the ``given`` values (raises
        :class:`NotConstant` when they depend on anything else, or on too much)."""
        need: set[int] = set()
        todo = list(slots)
        while todo:
            s = todo.pop()
            if s in given or s in self.constants:
                continue
            n = self.producer.get(s)
            if n is None or n.prim.stateful or n.body is not None or n.prim.kernel is None:
                raise NotConstant(s)
            if self.index[n.name] in need:
                continue
            need.add(self.index[n.name])
            if len(need) > _CONST_NODES:
                raise NotConstant(s)
            todo += [x for spec in n.inputs for x in slots_of(spec)]
            todo += [x for a in n.attrs.values() if isinstance(a, Lazy) for x in (a.reads or ())]
        v: list[Any] = [None] * self.graph.nslots
        for s, arr in self.constants.items():
            v[s] = arr
        for s, arr in given.items():
            v[s] = arr
        for i in sorted(need):
            n = self.nodes[i]
            args = [_fetch(spec, v) for spec in n.inputs]
            if any(isinstance(a, np.ndarray) and a.size > _CONST_SIZE for a in args):
                raise NotConstant(self.out(n))
            attrs = {k: (a.fn(v) if isinstance(a, Lazy) else a) for k, a in n.attrs.items()}
            res = n.prim.kernel(*args, **attrs)
            outs = [spec for spec in n.outputs]
            results = (res,) if len(outs) == 1 else tuple(res)
            for spec, r in zip(outs, results):
                v[slots_of(spec)[0]] = list(r) if isinstance(spec, tuple) else np.asarray(r)
        return {s: v[s] for s in slots}


class NotConstant(Exception):
    pass


def _fetch(spec: Any, v: list) -> Any:
    if spec is None:
        return None
    if isinstance(spec, int):
        return v[spec]
    if isinstance(spec, tuple):
        return list(v[spec[1]])
    return [v[s] for s in spec]


def einsum_operands(w: View, n: Node) -> tuple[int, int, str] | None:
    """``(a, b, layout of b)`` of a two-operand einsum computing a batched ``[.., i, j] x [.., j, k]`` product:
    layout ``"jk"`` (b is ``[.., j, k]``) or ``"kj"`` (b is ``[.., k, j]``)."""
    inputs, expr = w.arg(n, "inputs"), w.attr(n, "expr")
    if not isinstance(inputs, list) or len(inputs) != 2 or not isinstance(expr, str):
        return None
    try:
        lhs, out = expr.replace(" ", "").split("->")
        x, y = lhs.split(",")
    except ValueError:
        return None
    if len(x) != 4 or len(y) != 4 or len(out) != 4 or x[:2] != y[:2] or x[:2] != out[:2]:
        return None
    i, j = x[2], x[3]
    if out[2] != i:
        return None
    if y[2] == j and out[3] == y[3] != j:
        return inputs[0], inputs[1], "jk"
    if y[3] == j and out[3] == y[2] != j:
        return inputs[0], inputs[1], "kj"
    return None


def product(w: View, n: Node | None) -> tuple[int, int, bool] | None:
    """``(A, B, B given transposed)`` of a batched matrix product node (matmul or einsum), else None."""
    if n is None:
        return None
    if n.op == "matmul":
        a, b = w.arg(n, "A"), w.arg(n, "B")
        if not isinstance(a, int) or not isinstance(b, int) or w.attr(n, "transposeA"):
            return None
        return a, b, bool(w.attr(n, "transposeB"))
    if n.op == "tract_core_einsum":
        got = einsum_operands(w, n)
        return None if got is None else (got[0], got[1], got[2] == "kj")
    return None


def through_casts(w: View, slot: int | None) -> int | None:
    cur = slot
    for _ in range(16):
        n = w.node(cur)
        if n is None or n.op not in PASSTHROUGH:
            return cur
        cur = w.first(n)
    return cur
