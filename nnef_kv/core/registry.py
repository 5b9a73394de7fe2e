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

import abc
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable

import numpy as np

from ..errors import GraphError, InputError


Kernel = Callable[..., Any]

#: what a registration can say an op is for (``role``); tools query these instead of keeping op lists
ROLES = (
    "source",        # a graph input or a stored tensor: external, variable, constant (built by the builder)
    "kv-cache",      # holds a K or V cache in the session and returns it (the attention is other nodes)
    "attention",     # a fused attention over the K/V it is given (no state)
    "attention+kv",  # a fused attention that keeps its own K/V cache (stateful)
)


class KvState(abc.ABC):
    """The state a session keeps for one stateful node (a KV cache, a scan loop's carried values).

    A session builds one per node with ``factory(**attrs)`` and calls ``state(*tensors)`` each run. What
    the session and the tools rely on is declared here, so a new KV op cannot forget it: subclasses must
    implement the abstract methods; the others have defaults that say "nothing of that kind"."""

    #: the state keeps quantized codes (False: everything in full precision)
    QUANTIZED: bool = False

    @abc.abstractmethod
    def __call__(self, *tensors: np.ndarray | None) -> np.ndarray | tuple[np.ndarray, ...]: ...

    @abc.abstractmethod
    def reset(self) -> None:
        """Forget everything accumulated (a new sequence)."""

    @abc.abstractmethod
    def state_tensors(self) -> dict[str, np.ndarray]:
        """Everything needed to continue bit-identically, as named arrays (for ``save_state``)."""

    @abc.abstractmethod
    def load_state_tensors(self, tensors: dict[str, np.ndarray]) -> None:
        """Restore what :meth:`state_tensors` gave (an empty dict: the empty state)."""

    @abc.abstractmethod
    def nbytes(self) -> dict[str, int]:
        """Bytes actually held: keys ``codes``, ``params``, ``full_precision`` (and any other)."""

    @abc.abstractmethod
    def checkpoint(self) -> Any:
        """An O(1) token for :meth:`rollback`, taken by the session before each run. A state that cannot
        offer one returns :data:`NO_CHECKPOINT`: a failed run then marks the session stale."""

    @abc.abstractmethod
    def rollback(self, token: Any) -> None:
        """Undo everything done since :meth:`checkpoint` returned ``token``."""

    def symbol_bindings(self) -> dict[str, int]:
        """Symbols the state binds (a KV cache binds its past-length symbol ``P`` to its length)."""
        return {}

    @classmethod
    def has_stepwise(cls) -> bool:
        """The class says how it runs stepwise (overrides :meth:`stepwise`)."""
        return cls.stepwise is not KvState.stepwise

    def stepwise(self, *tensors: np.ndarray | None) -> np.ndarray | tuple[np.ndarray, ...]:
        """A multi-token call answered as one-token calls would be (``Session.run(stepwise=True)``).
        The default refuses: a state must say how it runs stepwise."""
        raise InputError(f"{type(self).__name__}: no stepwise run")

    def stepwise_splits(self, n: int) -> list[int]:
        """Where a stepwise run of ``n`` new tokens must be cut into separate calls (none by default)."""
        return []

    def reads_quantized(self, n: int, stepwise: bool = True) -> np.ndarray:
        """For each of the next ``n`` tokens, how many cached tokens its attention reads quantized
        (``stepwise``: in one-token runs; else in one call). A quantized state must say."""
        if self.QUANTIZED:
            raise NotImplementedError(f"{type(self).__name__} does not say which tokens it reads quantized")
        return np.zeros(n, np.int64)

    def census(self) -> dict[str, int] | None:
        """Tokens held (``tokens``, ``quantized``, ``full_precision``, ``f32_bytes``), None if not a KV cache."""
        return None

    def used_nbytes(self) -> int:
        """Bytes of what is written (spare capacity left out); by default all that :meth:`nbytes` counts."""
        nb = self.nbytes()
        return int(nb.get("codes", 0) + nb.get("params", 0) + nb.get("full_precision", 0))


#: :meth:`KvState.checkpoint`'s answer when the state cannot be checkpointed cheaply
#: what a registration can say about an op (``facts``); every set of op names a tool needs is one of these, asked of
#: the registry (:func:`nnef_kv.interpreter.catalog.ops_having`), never written out elsewhere
FACTS = {
    "input": "declares a graph input (its value comes from the caller)",
    "view": "its result is its first operand's values under another shape, in the same order",
    "numpy_view": "applied as a NumPy view of its first operand (np.reshape / np.transpose): a plan view chain",
    "passthrough": "its result holds its one operand's values (a copy or a cast), the same shape",
    "kv_expand": "a step of grouped-query attention's K/V head expansion (repeat_kv: unsqueeze, tile/broadcast, "
                 "reshape)",
    "softmax": "a softmax over the given axes (an attention's probabilities)",
    "gather": "selects rows of its first operand by integer indices (an embedding lookup)",
    "fresh": "its kernel returns a new array every time, never a view of an operand",
    "memo": "a pure function of its operands' values with a small result, never writing into an operand: a shape "
            "memo may hold it (plan/chains.py)",
    "quantized_bias": "under tract's quantization its integer bias is in accumulator units (input x filter scale)",
}

NO_CHECKPOINT = object()

#: the name the state interface had before it became an abstract base
StatefulKernel = KvState


@dataclass(frozen=True)
class Primitive:
    """A registered operation: its NNEF signature, its kernel (or state class), and what tools need to
    know about it, so that no list elsewhere restates the registry.

    ``registry``: the tract registry (``extension tract_registry <registry>;``) an archive using the op
    declares (``nnef`` for the standard ops; ``nnef_kv`` for nnef-kv's own, ``extension nnef_kv;``).
    ``positional``: tract binds the operands by position, names ignored (its binary and unit element-wise
    ops: ``add(x = a, 1.0)`` is ``a + 1.0``). ``specialize``: ``specialize(attrs)`` returns a kernel taking
    the tensors only, with the static attributes read once, or None (:mod:`..plan.specialize`).
    ``fresh_result``: the kernel always returns a new array of its own, safe to overwrite in place, and a
    one-operand producer of it may be fused into the ``mul`` reading it (plan fusion; see the ``fresh`` fact for
    ops that only return new arrays). ``role``: one of :data:`ROLES`, or None. ``describe``: a one-line
    description for reports. ``facts``: names of :data:`FACTS`. ``scalar``: the op on Python numbers.
    """

    signature: str  # one NNEF fragment declaration, e.g. "fragment relu(x: tensor<scalar>) -> (y: tensor<scalar>);"
    registry: str  # "nnef", "tract_core", "tract_transformers", "nnef_kv", ...
    kernel: Callable[..., Any] | None = None
    state_factory: Callable[..., KvState] | None = None
    name: str = field(default="")
    positional: bool = False
    specialize: Callable[[dict[str, Any]], Callable[..., Any] | None] | None = None
    fresh_result: bool = False
    role: str | None = None
    describe: str = ""
    facts: frozenset[str] = frozenset()  # names of FACTS (declared with :func:`declare`)
    #: the op's value on Python scalars, for constant folding (None when undefined there: sqrt(-1)); None: no rule
    scalar: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "facts", frozenset(self.facts))
        bad = sorted(self.facts - set(FACTS))
        if bad:
            raise GraphError(f"operation {self.name}: fact {bad[0]!r} is not one of {', '.join(FACTS)}")
        if self.role is not None and self.role not in ROLES:
            raise GraphError(f"operation {self.name}: role {self.role!r} is not one of {', '.join(ROLES)}")
        if self.state_factory is not None and isinstance(self.state_factory, type) \
                and not issubclass(self.state_factory, KvState):
            raise GraphError(f"operation {self.name}: state class {self.state_factory.__name__} is not a KvState")

    @property
    def stateful(self) -> bool:
        return self.state_factory is not None

    @property
    def quantized(self) -> bool:
        """The op keeps a quantized KV cache (its state class says so)."""
        return bool(getattr(self.state_factory, "QUANTIZED", False))

    @property
    def params(self) -> tuple[str, ...]:
        """Parameter names in declaration order (how positional arguments bind)."""
        return tuple(p.name for p in self.decl.params)

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


def primitive(signature: str, registry: str = "nnef", *aliases: str, **about: Any) -> Callable[[Callable], Callable]:
    """Register a stateless kernel: ``@primitive("fragment exp(x: tensor<scalar>) -> (y: tensor<scalar>);")``.

    ``aliases`` registers the same kernel under other names with the same parameter list. ``about``: the
    :class:`Primitive` fields ``positional``, ``specialize``, ``fresh_result``, ``role``, ``describe``.
    """

    def deco(fn: Callable) -> Callable:
        name = _name_of(signature)
        _register(Primitive(signature=signature, registry=registry, kernel=fn, name=name, **about))
        for alias in aliases:
            _register(Primitive(signature=signature.replace(name, alias, 1), registry=registry, kernel=fn,
                                name=alias, **about))
        return fn

    return deco


def stateful(signature: str, registry: str, **about: Any) -> Callable[[type], type]:
    """Register a stateful kernel class (a :class:`KvState`): one instance per session, built as
    ``cls(**attrs)``. ``about``: ``role`` (``"kv-cache"``, ``"attention+kv"``), ``describe``."""

    def deco(cls: type) -> type:
        name = _name_of(signature)
        _register(Primitive(signature=signature, registry=registry, state_factory=cls, name=name, **about))
        return cls

    return deco


def declare(name: str, *facts: str, scalar: Callable[..., Any] | None = None) -> None:
    """Add ``facts`` (names of :data:`FACTS`) and a ``scalar`` rule to the registered op ``name``: for ops
    registered in bulk (``_binary``, ``_unary``), next to their registration in the op's family module."""
    import dataclasses

    prim = PRIMITIVES.get(name)
    if prim is None:
        raise GraphError(f"declare: operation {name} is not registered")
    PRIMITIVES[name] = dataclasses.replace(prim, facts=prim.facts | set(facts),
                                           scalar=scalar if scalar is not None else prim.scalar)


def source(signature: str, registry: str = "nnef", **about: Any) -> None:
    """Register a source op's signature (``external``, ``variable``...): the builder makes its value itself,
    the signature says how its arguments bind."""
    _register(Primitive(signature=signature, registry=registry, name=_name_of(signature), role="source", **about))
