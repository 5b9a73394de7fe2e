"""Fragment parameters: which are tensors and which attributes, and how an invocation's arguments bind to
them (positional then named, defaults filled, as tract does)."""
from __future__ import annotations

from dataclasses import dataclass
from ..grammar import ast as A

__all__ = ["ParamInfo", "param_info", "bind_arguments"]


def _is_tensor_type(t: A.TypeSpec | None) -> bool:
    return isinstance(t, A.TensorType)


def _is_tensor_array(t: A.TypeSpec | None) -> bool:
    return isinstance(t, A.ArrayType) and isinstance(t.item, A.TensorType)


@dataclass
class ParamInfo:
    name: str
    kind: str  # "tensor", "tensors", "attr"
    default: A.Expr | None
    is_array: bool = False


_PARAM_CACHE: dict[int, tuple[A.FragmentDecl, list[ParamInfo], list[A.Result]]] = {}


def param_info(decl: A.FragmentDecl) -> tuple[list[ParamInfo], list[A.Result]]:
    """Parameter kinds (tensor, tensor array, attribute) and results of a declaration, cached."""
    hit = _PARAM_CACHE.get(id(decl))
    if hit is not None and hit[0] is decl:
        return hit[1], hit[2]
    params = [
        ParamInfo(
            p.name,
            "tensor" if _is_tensor_type(p.type) else "tensors" if _is_tensor_array(p.type) else "attr",
            p.default,
            isinstance(p.type, A.ArrayType),
        )
        for p in decl.params
    ]
    _PARAM_CACHE[id(decl)] = (decl, params, list(decl.results))
    return params, list(decl.results)


def bind_arguments(inv: A.Invocation, params: list[ParamInfo]) -> dict[str, A.Expr | None]:
    """tract's rule: a named argument wins; else the positional argument at the parameter's index if
    every argument up to it is positional; else the default. Unknown named arguments are ignored."""
    named = {a.name: a.value for a in inv.args if a.name is not None}
    out: dict[str, A.Expr | None] = {}
    for i, p in enumerate(params):
        if p.name in named:
            out[p.name] = named[p.name]
        elif i < len(inv.args) and all(a.name is None for a in inv.args[: i + 1]):
            out[p.name] = inv.args[i].value
        else:
            out[p.name] = p.default
    return out
