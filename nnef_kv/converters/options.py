"""Conversion options, their validation (done before any work, by the scheme: :mod:`nnef_kv.kv.schemes`)
and their command-line flags (declared by the schemes)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Sequence

from ..kv import schemes as _schemes


class _SchemeNames(Sequence):
    """The registered scheme names, read when used (a scheme registered later is in)."""

    def __getitem__(self, i):  # type: ignore[override]
        return tuple(_schemes.SCHEMES)[i]

    def __len__(self) -> int:
        return len(_schemes.SCHEMES)

    def __repr__(self) -> str:
        return repr(tuple(_schemes.SCHEMES))


#: the scheme names (a live view of :data:`nnef_kv.kv.schemes.SCHEMES`)
SCHEMES = _SchemeNames()


@dataclass(frozen=True)
class ConvertOptions:
    """What the attention/KV caches become (the public options type of :func:`~nnef_kv.converters.convert`).

    scheme: a name of :data:`nnef_kv.kv.schemes.SCHEMES`: ``kivi`` (nnef-kv's ``nnef_kv_kivi_sdpa``),
    ``tract`` (``tract_transformers_quantized_kv_sdpa``) or ``tract-cache``
    (``tract_transformers_quantized_dyn_kv_cache`` per cache, attention unchanged).
    bits: code bits (kivi 1..8; tract-cache 4 or 8; the tract fused op is always 8-bit and ignores it).
    key_group / value_group / residual / sinks: KIVI's grouping, full-precision window, attention sinks.
    extra: options of schemes that take others (name -> value).

    :meth:`validate` is the scheme's own check (:meth:`nnef_kv.kv.schemes.Scheme.validate`).
    """

    scheme: str = _schemes.DEFAULT_SCHEME
    bits: int = 4
    key_group: int = 32
    value_group: int = 32
    residual: int = 32
    sinks: int = 0
    extra: Mapping[str, Any] = field(default_factory=dict, hash=False)

    @classmethod
    def of(cls, scheme: str = _schemes.DEFAULT_SCHEME, **values: Any) -> "ConvertOptions":
        """Validated options of ``scheme`` from ``values`` (a missing or None value: the scheme's default)."""
        s = _schemes.scheme(scheme)
        given = {k: v for k, v in values.items() if v is not None}
        chosen = s.validate(given)
        merged = {**given, **{f.name: getattr(chosen, f.name) for f in fields(chosen)}}
        own = {f.name for f in fields(cls)} - {"scheme", "extra"}
        return cls(scheme, **{k: v for k, v in merged.items() if k in own},
                   extra={k: v for k, v in merged.items() if k not in own})

    @property
    def scheme_object(self) -> _schemes.Scheme:
        return _schemes.scheme(self.scheme)

    @property
    def scheme_options(self) -> Any:
        """The scheme's own options (its options dataclass)."""
        return self.scheme_object.validate(self.values())

    def values(self) -> dict[str, Any]:
        """Every option but the scheme, by name."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("scheme", "extra")}
        out.update(self.extra)
        return out

    def validate(self) -> "ConvertOptions":
        self.scheme_object.validate(self.values())
        return self

    def as_dict(self) -> dict[str, Any]:
        """The keywords of :func:`~nnef_kv.converters.convert` that give these options."""
        return {"scheme": self.scheme, **self.values()}


# ---------------------------------------------------------------------------------------------- command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--scheme`` (the registered schemes) and every scheme's option flags (default: the scheme's)."""
    reg = _schemes.SCHEMES
    parser.add_argument("--scheme", default=_schemes.DEFAULT_SCHEME, choices=list(reg),
                        help="; ".join(f"{s.name}: {s.summary}" for s in reg.values()))
    for spec in _schemes.all_options():
        parser.add_argument(spec.flag, dest=spec.name, type=spec.type, default=None, help=spec.help)


def from_arguments(args: argparse.Namespace) -> ConvertOptions:
    """The validated options of parsed :func:`add_arguments` flags."""
    return ConvertOptions.of(args.scheme, **{s.name: getattr(args, s.name, None) for s in _schemes.all_options()})
