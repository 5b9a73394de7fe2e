"""The operation registry: an op name -> a :class:`Primitive` (its NNEF signature and its kernel).

Kernels are plain NumPy code, one small function (or, for stateful ops, one class) per op, in the
spirit of ``onnx.reference``. The graph builder uses the signature to tell tensor parameters from
attribute parameters and to fill defaults, then calls:

* stateless: ``kernel(*tensors, **attrs)`` -> one array, or a tuple of arrays for several results;
* stateful: ``state = factory(**attrs)`` once per session, then ``state(*tensors)`` each run.

``tensors`` are the tensor parameters in declaration order (a ``tensor<>[]`` parameter is passed as
a list of arrays; an absent optional tensor as ``None``); ``attrs`` are every attribute parameter by
name, defaults filled, as Python values (int, float, bool, str, lists/tuples of those).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Protocol, runtime_checkable

import numpy as np

from ..errors import GraphError


@runtime_checkable
class StatefulKernel(Protocol):
    """What a session keeps for each stateful node (KV caches)."""

    def __call__(self, *tensors: np.ndarray | None) -> np.ndarray | tuple[np.ndarray, ...]: ...

    def reset(self) -> None: ...

    def state_tensors(self) -> dict[str, np.ndarray]:
        """Everything needed to continue bit-identically, as named arrays (for ``save_state``)."""
        ...

    def load_state_tensors(self, tensors: dict[str, np.ndarray]) -> None: ...

    def nbytes(self) -> dict[str, int]:
        """Bytes actually held: keys ``codes``, ``params``, ``full_precision`` (and any other)."""
        ...


@dataclass(frozen=True)
class Primitive:
    """A registered operation."""

    signature: str  # one NNEF fragment declaration, e.g. "fragment relu(x: tensor<scalar>) -> (y: tensor<scalar>);"
    registry: str  # "nnef", "tract_core", "tract_transformers", "nnef_kv", ...
    kernel: Callable[..., Any] | None = None
    state_factory: Callable[..., StatefulKernel] | None = None
    name: str = field(default="")

    @property
    def stateful(self) -> bool:
        return self.state_factory is not None

    @cached_property
    def decl(self):  # -> nnef_kv.grammar.ast.FragmentDecl
        from ..grammar import parse

        doc = parse(self.signature, filename=f"<signature of {self.name}>")
        if len(doc.fragments) != 1:
            raise GraphError(f"signature of {self.name} must declare exactly one fragment")
        return doc.fragments[0]


PRIMITIVES: dict[str, Primitive] = {}


def _name_of(signature: str) -> str:
    head = signature.split("fragment", 1)[1].strip()
    end = min(i for i in (head.find("("), head.find("<")) if i >= 0)
    return head[:end].strip()


def _register(prim: Primitive) -> None:
    if prim.name in PRIMITIVES:
        raise GraphError(f"operation {prim.name} registered twice")
    PRIMITIVES[prim.name] = prim


def primitive(signature: str, registry: str = "nnef", *aliases: str) -> Callable[[Callable], Callable]:
    """Register a stateless kernel: ``@primitive("fragment exp(x: tensor<scalar>) -> (y: tensor<scalar>);")``.

    ``aliases`` registers the same kernel under other names with the same parameter list.
    """

    def deco(fn: Callable) -> Callable:
        name = _name_of(signature)
        _register(Primitive(signature=signature, registry=registry, kernel=fn, name=name))
        for alias in aliases:
            _register(
                Primitive(signature=signature.replace(name, alias, 1), registry=registry, kernel=fn, name=alias)
            )
        return fn

    return deco


def stateful(signature: str, registry: str) -> Callable[[type], type]:
    """Register a stateful kernel class: one instance per session, built as ``cls(**attrs)``."""

    def deco(cls: type) -> type:
        name = _name_of(signature)
        _register(Primitive(signature=signature, registry=registry, state_factory=cls, name=name))
        return cls

    return deco
