"""Check that a model is a graph nnef-kv can run: what ``nnef-kv inspect`` does before it prints a summary.

The graph is built (undefined identifiers, unknown ops, ill-typed attributes and operands are refused with
their ``file:line:col``), then run once, in a throwaway session whose plan leaves the weights as the archive
holds them (``prepare_weights=False``: nothing transposed, joined, repacked or dequantized for it, so a
memory-mapped archive is read, not copied; issue 26), on zeros of the shapes and dtypes the graph
declares for its inputs, every symbol bound to 1 (``S = 1``, ``P = 1``): a shape or dtype error (``add`` of
``[2]`` and ``[3]``, a reshape that cannot be) is then reported by the node it happens in, as the first
run of the model would. What comes out is each output's dtype and shape at that binding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import GraphError, InputError, LimitError, NnefKvError
from ..limits import current_limits
from .values import Lazy

SYMBOL_VALUE = 1


@dataclass
class CheckResult:
    """What the check run gave: the symbol binding and each output's (dtype, shape)."""

    symbols: dict[str, int] = field(default_factory=dict)
    outputs: list[tuple[str, str, list[int]]] = field(default_factory=list)

    def to_text(self) -> str:
        at = ", ".join(f"{k}={v}" for k, v in self.symbols.items())
        head = "check: graph built, one run on zeros of the declared inputs" + (f" ({at})" if at else "") + ": ok"
        return "\n".join([head] + [f"  {name}: {dtype} {shape}" for name, dtype, shape in self.outputs])


def check_model(model: Any, symbol_value: int = SYMBOL_VALUE, prepare_weights: bool = False) -> CheckResult:
    """Build ``model``'s graph and run it once on zeros (see the module doc); raises the first error.
    ``symbol_value``: the value of every symbol (default 1). ``prepare_weights``: run the model's own plan
    instead (weights prepared, the plan cached on the model): for a caller that runs the model next, as
    ``convert`` does for ``compare`` and auto-bits (the converted model measured in memory)."""
    SYMBOL_VALUE = symbol_value  # noqa: N806 - the module default, or the caller's
    from .session import Session

    # default: a throwaway plan leaving the weights as the archive holds them
    session = Session(model, threads=1, prepare_weights=prepare_weights)
    plan = session.plan
    g = plan.graph
    v = list(plan.base)
    symbols = {name: SYMBOL_VALUE for name in g.symbols}
    for name, slot in g.symbols.items():
        v[slot] = SYMBOL_VALUE
    feed: dict[str, np.ndarray] = {}
    for spec in plan.inputs:
        dims = []
        for d in spec.shape:
            if isinstance(d, str):
                dims.append(SYMBOL_VALUE)
            elif isinstance(d, Lazy):
                try:
                    dims.append(int(d.fn(v)))
                except Exception as exc:  # noqa: BLE001 - reported with the input's declaration
                    raise GraphError(f"{spec.location}: input '{spec.name}': cannot evaluate the dim {d.text} "
                                     f"with every symbol = {SYMBOL_VALUE} ({exc})") from None
            else:
                dims.append(int(d))
        if any(n < 0 for n in dims):
            raise GraphError(f"{spec.location}: input '{spec.name}' declares a negative dim {dims}")
        nbytes = math.prod(dims) * np.dtype(spec.dtype).itemsize
        limit = getattr(model, "limits", None) or current_limits()
        if nbytes > limit.max_tensor_bytes:
            raise LimitError(f"{spec.location}: input '{spec.name}' declares {spec.dtype} {dims}: the check run's "
                             f"zeros would take {nbytes} bytes, over max_tensor_bytes={limit.max_tensor_bytes}")
        feed[spec.name] = np.zeros(dims, spec.dtype)
    try:
        out = session.run(feed)
    except InputError as exc:  # the graph's own assertions refuse the binding: say which
        raise GraphError(f"{model.name}: the check run (every symbol = {SYMBOL_VALUE}) was refused: {exc}") from None
    except NnefKvError:
        raise
    res = CheckResult(symbols=symbols)
    for name, value in out.items():
        a = np.asarray(value)
        res.outputs.append((name, str(a.dtype), list(a.shape)))
    return res
