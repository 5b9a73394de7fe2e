"""The builder's sources: graph inputs (``external``, ``tract_core_external``), stored tensors
(``variable``) and literal tensors (``constant``) (mixin). The registry holds their signatures (role
``source``), which say how their arguments bind; the values are made here.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import GraphError, LimitError
from ..grammar import ast as A
from ..grammar.printer import short as _short
from ..tensors.blockquant import BlockQuantTensor
from .catalog import lookup, ops_having, ops_with
from ..core.dtypes import NNEF_TYPES, dtype_of
from .graph import InputSpec
from .quant import _quant_params
from .values import TRef, _Ctx, _is_int

#: the ops whose value the builder makes itself (graph inputs, stored tensors, literals)
SOURCE_OPS = tuple(sorted(ops_with(role="source")))


#: the sources that declare graph inputs (the ``input`` fact)
INPUT_OPS = ops_having("input")


def _source_params(op: str) -> tuple[str, ...]:
    prim = lookup(op)
    assert prim is not None and prim.role == "source", op
    return prim.params


class SourceMixin:
    """Sources for :class:`~.builder.GraphBuilder`."""

    def _source(self, inv: A.Invocation, ctx: _Ctx, qual: str) -> Any:
        named = inv.named()
        pos_args = inv.positional()
        op = inv.name
        where = f"{self.loc(inv.pos)}: {op} '{qual}': "
        generic = inv.generic.name if isinstance(inv.generic, A.PrimitiveType) else "scalar"

        order = _source_params(op)

        def arg(name: str) -> A.Expr | None:
            if name in named:
                return named[name]
            index = order.index(name)
            if index < len(inv.args) and all(a.name is None for a in inv.args[: index + 1]):
                return pos_args[index]
            return None

        shape_e = arg("shape")
        if op in INPUT_OPS:
            if shape_e is None:
                raise GraphError(where + "no shape")
            if op == "tract_core_external":
                dt_e = arg("datum_type")
                dt = dtype_of(self._static_literal(dt_e), where) if dt_e is not None else NNEF_TYPES["scalar"]
            else:
                dt = NNEF_TYPES.get(generic, NNEF_TYPES["scalar"])
            shape: list[Any] = []
            items = shape_e.items if isinstance(shape_e, A.ArrayExpr) else None
            if items is None:
                raise GraphError(where + "shape must be an array")
            for it in items:
                if isinstance(it, A.Identifier) and it.name not in ctx.scope:
                    self.symbol(it.name)
                    shape.append(it.name)
                else:
                    self._declare_symbols(it, ctx)
                    v = self.attr(it, ctx)
                    shape.append(v)
            slot = self.new_slot()
            self.inputs.append(InputSpec(qual, slot, dt, shape, self.loc(inv.pos), op))
            return TRef(slot)
        if op == "variable":
            label_e = arg("label")
            if label_e is None:
                raise GraphError(where + "no label")
            label = self._static_literal(label_e)
            shape = self._shape(self._static_literal(shape_e), where) if shape_e is not None else None
            arr = self._variable(label, where)
            qp = _quant_params(self.quant[qual], self._quant_where(qual)) if qual in self.quant else None
            if qp is not None and arr.dtype.kind in "iu":  # stored codes -> real values
                arr = ((arr.astype(np.float32) - qp["zero_point"]) * np.float32(qp["scale"])).astype(np.float32)
            if shape is not None and list(arr.shape) != list(shape):
                raise GraphError(where + f"tensor '{label}' has shape {list(arr.shape)}, declared {list(shape)}")
            return self.const(arr)
        # constant
        value_e = arg("value")
        if shape_e is None or value_e is None:
            raise GraphError(where + "needs shape and value")
        shape = self._shape(self._static_literal(shape_e), where)
        value = self._static_literal(value_e)
        dt = NNEF_TYPES.get(generic, NNEF_TYPES["scalar"])
        n = 1
        for d in shape:
            n *= d
        limit = self.limits.max_tensor_bytes
        if n * dt.itemsize > limit:
            raise LimitError(where + f"a constant of shape {shape} takes {n * dt.itemsize} bytes, over "
                                     f"max_tensor_bytes={limit}")
        try:
            flat = np.asarray(value, dtype=dt).reshape(-1)
        except (TypeError, ValueError, OverflowError) as exc:
            raise GraphError(where + f"value {_short(repr(value), 60)} is not {generic} numbers: "
                                     f"{_short(str(exc), 100)}") from None
        if flat.size == 1:
            arr = np.full(shape, flat[0], dtype=dt)
        elif flat.size == n:
            arr = flat.reshape(shape)
        else:
            raise GraphError(where + f"{flat.size} values for shape {shape}")
        return self.const(arr)

    @staticmethod

    def _shape(value: Any, where: str) -> list[int]:
        """A static ``shape`` attribute: a list of non-negative integers."""
        if not isinstance(value, (list, tuple)) or not all(_is_int(d) and d >= 0 for d in value):
            raise GraphError(where + f"shape must be a list of non-negative integers, got {_short(repr(value), 60)}")
        return [int(d) for d in value]

    def _declare_symbols(self, e: A.Expr, ctx: _Ctx) -> None:
        if isinstance(e, A.Identifier):
            if e.name not in ctx.scope:
                self.symbol(e.name)
        elif isinstance(e, A.BinaryExpr):
            self._declare_symbols(e.left, ctx)
            self._declare_symbols(e.right, ctx)
        elif isinstance(e, A.UnaryExpr):
            self._declare_symbols(e.operand, ctx)

    def _variable(self, label: Any, where: str) -> Any:
        if not isinstance(label, str):
            raise GraphError(where + f"label must be a string, got {_short(repr(label), 60)}")
        for key in (label, label.lstrip("/")):
            if key in self.tensors:
                t = self.tensors[key]
                if isinstance(t, BlockQuantTensor):
                    return t  # kept as blocks: the planner runs the products on them (plan/blockweights.py)
                if hasattr(t, "dequantize") and not isinstance(t, np.ndarray):
                    t = t.dequantize()
                return np.asarray(t)
        raise GraphError(where + f"no tensor '{label}' in the model")
