"""The checks of the KV ops' integer settings (``bits``, group sizes, windows), shared by the schemes
(options given to ``convert`` or the CLI, :mod:`.schemes`) and the ops (attributes read from an
archive), so that both refuse a value in the same words. A check answers the first bad value as a
:class:`Problem`; the caller raises it with its own prefix and exception type (``option ...`` and
:class:`~nnef_kv.errors.ConversionError` when converting, the op's name and
:class:`~nnef_kv.errors.GraphError` for an attribute)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple


class Problem(NamedTuple):
    """A refused setting: ``str(p)`` is ``name=value: reason``."""

    name: str
    value: Any
    reason: str

    def __str__(self) -> str:
        value = repr(self.value)
        return f"{self.name}={value if len(value) <= 60 else value[:57] + '...'}: {self.reason}"


#: the largest value an op's integer attribute holds: the ops keep their settings (and save them in a state)
#: as 64-bit signed integers, as tract reads NNEF integer attributes
INT_ATTRIBUTE_MAX = (1 << 63) - 1


@dataclass(frozen=True)
class IntSetting:
    """An integer setting: at least ``lowest``, at most ``highest`` (without one: what the op's 64-bit
    attribute holds, :data:`INT_ATTRIBUTE_MAX`), one of ``allowed`` when given; ``reason`` replaces the
    default wording of a value out of range."""

    lowest: int
    highest: int | None = None
    allowed: tuple[int, ...] | None = None
    reason: str | None = None

    def problem(self, name: str, value: Any) -> Problem | None:
        if not isinstance(value, int) or isinstance(value, bool):
            return Problem(name, value, "an integer is expected")
        if self.highest is None and value > INT_ATTRIBUTE_MAX:
            return Problem(name, value, f"too large: the op holds it as a 64-bit integer (at most "
                                        f"{INT_ATTRIBUTE_MAX})")
        ok = value >= self.lowest and (self.highest is None or value <= self.highest) \
            and (self.allowed is None or value in self.allowed)
        if ok:
            return None
        default = f"must be >= {self.lowest}" if self.highest is None else f"must be in {self.lowest}..{self.highest}"
        return Problem(name, value, self.reason or default)


def first_problem(values: Mapping[str, Any], settings: Mapping[str, IntSetting]) -> Problem | None:
    """The first bad value of ``values`` (names of ``settings``): every value is checked for being an
    integer first, then each against its range, in the order given."""
    for name, v in values.items():
        if name not in settings:
            return Problem(name, v, f"not a setting here (settings: {', '.join(settings)})")
        if not isinstance(v, int) or isinstance(v, bool):
            return Problem(name, v, "an integer is expected")
    for name, v in values.items():
        p = settings[name].problem(name, v)
        if p is not None:
            return p
    return None
