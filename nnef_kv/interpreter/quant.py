"""``graph.quant``: tensors that tract gives a quantized type (QU8/QI8) keep float values snapped to
their grid here, so arithmetic on them matches tract's requantization; integer constants are codes.

:class:`QuantMixin` is a mixin of :class:`~.builder.GraphBuilder`."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import GraphError
from ..grammar import ast as A
from ..grammar.printer import short as _short
from ..core.registry import Primitive
from .values import Lazy, TRef, _Ctx, literal_array

__all__ = ["QuantMixin"]


def _quant_params(q: tuple[str, dict[str, Any]], where: str = "graph.quant: ") -> dict[str, Any] | None:
    """scale / zero point / integer range of a graph.quant entry (8-bit only, as tract). ``where`` names
    the entry in messages (``graph.quant: tensor 'x': ``)."""
    op, args = q

    def number(key: str, default: Any = None, integer: bool = False) -> Any:
        v = args.get(key, default)
        if v is None:
            raise GraphError(where + f"{op} has no '{key}'")
        ok = isinstance(v, (int, float, np.number)) and not isinstance(v, (bool, np.bool_)) and np.isfinite(float(v))
        if ok and integer:
            ok = float(v).is_integer()
        if not ok:
            kind = "an integer" if integer else "a finite number"
            raise GraphError(where + f"{op}: '{key}' must be {kind}, got {_short(repr(v), 40)}")
        return int(v) if integer else float(v)

    bits = number("bits", 8, integer=True)
    if bits != 8:
        return None
    if op == "zero_point_linear_quantize":
        signed = bool(args.get("signed", False))
        scale, zp = number("scale"), number("zero_point", 0, integer=True)
        if scale <= 0:
            raise GraphError(where + f"{op}: 'scale' must be > 0, got {scale}")
    elif op == "linear_quantize":
        signed = True
        lo, hi = number("min"), number("max")
        scale = (hi - lo) / 255.0 if hi > lo else 1.0
        zp = int(round(-128 - lo / scale))
    else:
        return None
    qmin, qmax = (-128, 127) if signed else (0, 255)
    return {"scale": scale, "zero_point": zp, "qmin": qmin, "qmax": qmax}


def _fake_quantize(x: np.ndarray, scale: float, zero_point: int, qmin: int, qmax: int) -> np.ndarray:
    xf = x.astype(np.float64) / scale
    q = np.clip(np.sign(xf) * np.floor(np.abs(xf) + 0.5) + zero_point, qmin, qmax)
    return ((q - zero_point) * scale).astype(x.dtype if x.dtype.kind == "f" else np.float32)


_FAKE_QUANT_PRIM = Primitive(
    signature="fragment fake_quantize(x: tensor<scalar>, scale: scalar, zero_point: integer, qmin: integer, "
              "qmax: integer) -> (y: tensor<scalar>);",
    registry="nnef_kv",
    kernel=_fake_quantize,
    name="<fake_quantize>",
)


class QuantMixin:
    """graph.quant handling for the builder (mixin)."""

    def _fake_quant(self, name: str, value: Any, rhs: A.Expr, ctx: _Ctx) -> Any:
        """A tensor named in graph.quant: tract gives it a quantized type (QU8/QI8); here the values are
        kept as floats snapped to that grid (dequantized), so arithmetic on them matches tract's
        requantization. Integer constants are codes: they become ``(code - zero_point) * scale``."""
        q = self.quant.get(name)
        params = _quant_params(q, self._quant_where(name)) if q is not None else None
        if params is None or (isinstance(rhs, A.Invocation) and rhs.name == "variable"):
            return value  # variables are dequantized when read
        if not isinstance(value, (TRef, Lazy)):
            arr = literal_array(value, f"{self._here()}: node '{name}': ")
            if arr.dtype.kind in "iu":
                ref = self.const(((arr.astype(np.float64) - params["zero_point"]) * params["scale"]).astype(np.float32))
                self.slot_quant[ref.slot] = params
                return ref
            value = self.const(arr)
        ref = self.as_tensor(value, ctx, name)
        if ref.slot in self.constants and self.constants[ref.slot].dtype.kind in "iu":
            arr = self.constants[ref.slot]
            out = self.const(((arr.astype(np.float64) - params["zero_point"]) * params["scale"]).astype(np.float32))
        else:
            out = TRef(self._add_node("<fake_quantize>", _FAKE_QUANT_PRIM, [ref.slot], params, 1,
                                      f"{name}.quantize", getattr(rhs, "pos", None))[0])
        self.slot_quant[out.slot] = params
        return out

    def _quantized_bias(self, op: str, ins: list[Any]) -> list[Any]:
        """tract: the integer bias of a conv/matmul on quantized input and filter is in accumulator units
        (scale = input scale * filter scale)."""
        from .catalog import ops_having

        if op not in ops_having("quantized_bias") or len(ins) < 3 or not all(isinstance(i, int) for i in ins[:3]):
            return ins
        x, w, b = ins[:3]
        if x not in self.slot_quant or w not in self.slot_quant or b not in self.constants:
            return ins
        bias = self.constants[b]
        if bias.dtype.kind not in "iu":
            return ins
        scale = self.slot_quant[x]["scale"] * self.slot_quant[w]["scale"]
        return [x, w, self.const((bias.astype(np.float64) * scale).astype(np.float32)).slot, *ins[3:]]

    def _quant_where(self, tensor: str) -> str:
        """Message prefix for a graph.quant entry: ``.../graph.quant: tensor 'x': ``."""
        base = self.filename[: -len("graph.nnef")] if self.filename.endswith("graph.nnef") else ""
        return f"{base}graph.quant: tensor '{tensor}': "
