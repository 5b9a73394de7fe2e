"""Conversion options, their validation (done before any work, by the scheme: :mod:`nnef_kv.converters.schemes`)
and their command-line flags (declared by the schemes)."""
from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any, Mapping, Sequence

from . import schemes as _schemes


class _SchemeNames(Sequence):
    """The registered scheme names, read when used (a scheme registered later is in)."""

    def __getitem__(self, i):  # type: ignore[override]
        return tuple(_schemes.SCHEMES)[i]

    def __len__(self) -> int:
        return len(_schemes.SCHEMES)

    def __repr__(self) -> str:
        return repr(tuple(_schemes.SCHEMES))


#: the scheme names (a live view of :data:`nnef_kv.converters.schemes.SCHEMES`)
SCHEMES = _SchemeNames()


class ConvertOptions:
    """What the attention/KV caches become (the public options type of :func:`~nnef_kv.converters.convert`).

    ``scheme``: a name of :data:`nnef_kv.converters.schemes.SCHEMES`; the keywords: that scheme's options by name
    (its options dataclass says which, with their defaults, flags and help; kivi's: ``bits``, ``key_group``, ...).
    Nothing here is any one scheme's: an option left None is not given (the scheme's default); one the scheme
    does not take is refused by :meth:`validate`, the scheme's own check
    (:meth:`nnef_kv.converters.schemes.Scheme.validate`). Immutable and hashable.
    """

    __slots__ = ("scheme", "_given")

    def __init__(self, scheme: str = _schemes.DEFAULT_SCHEME, **values: Any) -> None:
        object.__setattr__(self, "scheme", scheme)
        object.__setattr__(self, "_given", tuple(sorted((k, v) for k, v in values.items() if v is not None)))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("ConvertOptions is immutable")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ConvertOptions) and (self.scheme, self._given) == (other.scheme, other._given)

    def __hash__(self) -> int:
        return hash((self.scheme, self._given))

    def __reduce__(self) -> tuple:  # immutable: rebuilt by its constructor
        return _rebuild_options, (self.scheme, self._given)

    def __repr__(self) -> str:
        return f"ConvertOptions({', '.join([repr(self.scheme)] + [f'{k}={v!r}' for k, v in self._given])})"

    @classmethod
    def of(cls, scheme: str = _schemes.DEFAULT_SCHEME, **values: Any) -> "ConvertOptions":
        """Validated options of ``scheme`` from ``values`` (a missing or None value: the scheme's default)."""
        chosen = _schemes.scheme(scheme).validate({k: v for k, v in values.items() if v is not None})
        return cls(scheme, **{f.name: getattr(chosen, f.name) for f in fields(chosen)})

    @property
    def scheme_object(self) -> _schemes.Scheme:
        return _schemes.scheme(self.scheme)

    @property
    def scheme_options(self) -> Any:
        """The scheme's own options (its options dataclass)."""
        return self.scheme_object.validate(self.values())

    def values(self) -> dict[str, Any]:
        """Every option given (not None) but the scheme, by name."""
        return dict(self._given)

    def validate(self) -> "ConvertOptions":
        self.scheme_object.validate(self.values())
        return self

    def as_dict(self) -> dict[str, Any]:
        """The keywords of :func:`~nnef_kv.converters.convert` that give these options."""
        return {"scheme": self.scheme, **self.values()}


def _rebuild_options(scheme: str, given: tuple[tuple[str, Any], ...]) -> ConvertOptions:
    return ConvertOptions(scheme, **dict(given))


# ---------------------------------------------------------------------------------------------- command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--scheme`` (the registered schemes) and every scheme's option flags (default: the scheme's)."""
    reg = _schemes.SCHEMES
    parser.add_argument("--scheme", default=_schemes.DEFAULT_SCHEME, choices=list(reg), action=_Given,
                        help="; ".join(f"{s.name}: {s.summary}" for s in reg.values())
                        + f" (default {_schemes.DEFAULT_SCHEME}; a .gguf input without --scheme or a scheme flag "
                          "is imported only: its f32 archive, KV cache unchanged)")
    for spec in _schemes.all_options():
        takers = [s for s in reg.values() if spec.name in s.option_names]
        defaults = ", ".join(f"{_default(s, spec.name)} ({s.name})" for s in takers)
        text = f"{spec.help or spec.name}{_only(takers, reg)}; default {defaults}"
        if spec.type is bool:  # an on/off option: a bare flag (--rotate)
            parser.add_argument(spec.flag, dest=spec.name, action="store_const", const=True, default=None, help=text)
        else:
            parser.add_argument(spec.flag, dest=spec.name, type=spec.type, default=None, metavar=_metavar(spec),
                                help=text)


def _metavar(spec: _schemes.OptionSpec) -> str:
    """``N`` for an integer option, else the flag's last word (``--key-axis AXIS``, ``--key-type TYPE``)."""
    if spec.type is int:
        return "N"
    if spec.type is float:
        return "X"
    return spec.flag.lstrip("-").rsplit("-", 1)[-1].upper()


def _only(takers: list[_schemes.Scheme], reg: Mapping[str, _schemes.Scheme]) -> str:
    if len(takers) == len(reg):
        return ""
    return f"; scheme{'s' if len(takers) > 1 else ''} {', '.join(s.name for s in takers)} only (refused by the others)"


def _default(s: _schemes.Scheme, name: str) -> Any:
    return next(o.default for o in s.option_specs if o.name == name)


def from_arguments(args: argparse.Namespace) -> ConvertOptions:
    """The validated options of parsed :func:`add_arguments` flags."""
    return ConvertOptions.of(args.scheme, **{s.name: getattr(args, s.name, None) for s in _schemes.all_options()})


def scheme_given(args: argparse.Namespace) -> bool:
    """Whether the command line chose a KV scheme: ``--scheme`` or any scheme's flag."""
    return getattr(args, "scheme_given", False) or any(getattr(args, s.name, None) is not None
                                                        for s in _schemes.all_options())


class _Given(argparse.Action):
    """Stores ``--scheme`` and records that it was given (``scheme_given``): a GGUF without it is imported only."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.scheme_given = True
