"""Plan-time specialisation of kernels whose attributes are all known when the plan is built.

A generic kernel re-reads its attributes on every call (flattens a shape, normalises axes, parses a
datum type...). An op registers ``specialize=`` with its kernel (``@primitive(..., specialize=fn)``, in its
op file): ``fn(static attributes)`` returns a closure with that work done once, computing exactly what
the generic kernel computes (same NumPy calls in the same order, same roundings) on the inputs it
handles, and calling the generic kernel itself for any other input (another dtype, a rank it was not
prepared for, an error to report), or None when the attributes do not allow it.
``tests/properties/test_specialize.py`` checks each one against its generic kernel.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

from ..catalog import PRIMITIVES, lookup
from ...core.registry import Kernel, Primitive


class _Specializers(Mapping):
    """``{generic kernel: its op's specializer}``, read from the registry (every op loaded)."""

    def _table(self) -> dict[Kernel, Callable[[dict[str, Any]], Kernel | None]]:
        lookup("add")  # loads every op family
        return {p.kernel: p.specialize for p in PRIMITIVES.values() if p.kernel is not None and p.specialize}

    def __getitem__(self, kernel: Kernel) -> Callable[[dict[str, Any]], Kernel | None]:
        return self._table()[kernel]

    def __iter__(self):
        return iter(self._table())

    def __len__(self) -> int:
        return len(self._table())


#: generic kernel -> ``factory(static attributes) -> specialised kernel taking the inputs only, or None``
SPECIALIZERS: Mapping[Kernel, Callable[[dict[str, Any]], Kernel | None]] = _Specializers()


def specialize(prim: Primitive | Kernel, attrs: dict[str, Any]) -> Kernel | None:
    """A kernel equivalent to ``prim.kernel(*inputs, **attrs)`` taking the inputs only, or None
    (``prim``: a registered primitive, or a generic kernel)."""
    factory = prim.specialize if isinstance(prim, Primitive) else SPECIALIZERS.get(prim)
    return None if factory is None else factory(attrs)


__all__ = ["SPECIALIZERS", "specialize"]
