"""KV schemes: what an attention and its KV caches become when a decoder is converted.

One :class:`Scheme` per scheme in :data:`SCHEMES` (name -> scheme; :func:`scheme` looks one up). A
scheme holds everything the rest of nnef-kv knows about it: the NNEF op it writes, its options (a
dataclass whose fields carry the defaults, CLI flags and help) with their one check, how the
converter rewrites the graph for it (``rewrite``: ``"attention"``, each recognised attention becomes
one call of the op; ``"cache"``, each KV cache becomes one call of the op and the attention stays),
the op's attributes for one site (:meth:`Scheme.attributes`), what the fused op can express
(softcap, causal mask), its notes, and its rows in ``demo`` (the extensions its op needs come from the
op's registration).

The converter passes, ``convert``, the CLI (``--scheme`` choices and the option flags), ``demo`` and
``validate`` read these objects; none of them names a scheme. A new scheme is one entry here (and
the quantizer of its op): see ``docs/architecture-schemes.md``.

This module is data and small functions: it imports no converter module (the rewrite passes live in
:mod:`nnef_kv.converters.passes` and look the scheme's ``rewrite`` up there).
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable, Iterable, Mapping

from ..errors import ConversionError
from .kivi import kivi_problem
from .settings import IntSetting, Problem, first_problem

__all__ = ["Scheme", "SCHEMES", "DEFAULT_SCHEME", "AttentionSite", "CacheSite", "OptionSpec", "option", "scheme",
           "scheme_names", "all_options", "schemes_writing", "fixed_bits", "report_settings", "Problem",
           "KiviOptions", "TractOptions", "TractCacheOptions"]

DEFAULT_SCHEME = "kivi"
#: attributes a validation report shows for a KV op no scheme writes (nnef_kv_ggml_sdpa, ...)
REPORTED_BY_DEFAULT = ("bits", "key_group", "value_group", "residual", "sinks", "per_channel")


# ---------------------------------------------------------------------------------------------- options
@dataclass(frozen=True)
class OptionSpec:
    """One option of a scheme, as the CLI and ``convert`` see it."""

    name: str  # keyword of convert(), attribute of the options dataclass
    default: Any
    flag: str  # the CLI flag (``--key-group``)
    type: type
    help: str | None


def option(default: Any, help: str | None = None, flag: str | None = None, type: type | None = None) -> Any:
    """A field of a scheme's options dataclass: its default, CLI flag (default ``--name-with-dashes``),
    argparse type (default: the default's) and help."""
    return field(default=default, metadata={"help": help, "flag": flag, "type": type})


def _specs(options: type) -> tuple[OptionSpec, ...]:
    out = []
    for f in fields(options):
        md = f.metadata
        default = None if f.default is MISSING else f.default
        out.append(OptionSpec(f.name, default, md.get("flag") or "--" + f.name.replace("_", "-"),
                              md.get("type") or type(default), md.get("help")))
    return tuple(out)


@dataclass(frozen=True)
class KiviOptions:
    """Options of scheme ``kivi`` (checked by :func:`nnef_kv.kv.kivi.kivi_problem`, as the op's attributes)."""

    bits: int = option(4, "bits of each key and value code")
    key_group: int = option(32, "tokens per key group (keys are quantized per channel over this many tokens)")
    value_group: int = option(32, "channels per value group (values are quantized per token in groups of this "
                                  "many channels)")
    residual: int = option(32, "newest tokens kept in full precision")
    sinks: int = option(0, "first tokens kept in full precision")


@dataclass(frozen=True)
class TractOptions:
    """Options of scheme ``tract``: ``bits`` can only be 8 (tract's fused op stores 8-bit codes; another
    width is refused rather than ignored)."""

    bits: int = option(8)


@dataclass(frozen=True)
class TractCacheOptions:
    """Options of scheme ``tract-cache``."""

    bits: int = option(4)


TRACT_SETTINGS = {"bits": IntSetting(8, 8, allowed=(8,), reason="scheme tract stores 8-bit codes "
                                     "(tract_transformers_quantized_kv_sdpa): give 8 or no bits")}
TRACT_CACHE_SETTINGS = {"bits": IntSetting(4, 8, allowed=(4, 8), reason="scheme tract-cache takes 4 or 8 bits")}


# ---------------------------------------------------------------------------------------------- sites
@dataclass(frozen=True)
class AttentionSite:
    """What the converter found of one attention it rewrites (``rewrite = "attention"``)."""

    scale: float  # the scores' scale (1/sqrt(D) when the graph had none)
    is_causal: bool  # the attention was causal or masked
    softcap: float = 0.0  # tanh softcapping of the scores (0: none)


@dataclass(frozen=True)
class CacheSite:
    """One KV cache the converter rewrites (``rewrite = "cache"``)."""

    role: str  # "key" or "value"


# ---------------------------------------------------------------------------------------------- scheme
@dataclass(frozen=True)
class Scheme:
    """One KV scheme. Read by the converter passes, ``convert``, the CLI, ``demo`` and ``validate``."""

    name: str
    op: str  # the NNEF op it writes
    summary: str  # one line for --help (after "name: ")
    rewrite: str  # "attention": each attention becomes the op; "cache": each KV cache does
    options: type  # its options dataclass (fields made with option())
    check: Callable[[Mapping[str, Any]], Problem | None]  # the one check of (some of) its options' values
    make_attributes: Callable[[Any, Any], dict[str, Any]]  # (options, site) -> the op's attributes, in order
    softcap: bool = False  # attention schemes: the op computes tanh softcapping
    mask_note: str = ""  # attention schemes: what becomes of a mask ({output}, {mask}, {op})
    fixed_bits: int | None = None  # the op stores this many bits whatever the bits option
    notes: Callable[[Any], list[str]] = lambda options: []  # notes for the conversion report
    #: tokens the op holds before it quantizes any (sinks + window), from the options; None: from the first
    window: Callable[[Any], int] | None = None
    reported: tuple[str, ...] = ()  # attributes of the op a validation report shows
    demo: str | None = None  # "bits": demo rows at each --bits width; "tract": one row, dropped by --no-tract
    doc: str = ""

    @property
    def extensions(self) -> tuple[tuple[str, str], ...]:
        """The extension lines (name, argument) an archive holding the op declares (from its registration)."""
        from ..interpreter.catalog import extensions_for

        return extensions_for(self.op)

    @property
    def option_specs(self) -> tuple[OptionSpec, ...]:
        return _specs(self.options)

    @property
    def option_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in fields(self.options))

    def validate(self, values: Mapping[str, Any]) -> Any:
        """The scheme's options from ``values`` (a missing or None value: the scheme's default).

        Every value is checked: the scheme's own by :attr:`check`; a value of an option the scheme does not
        take is refused (it would be ignored: ``--scheme tract --key-group 16``), as is an option no scheme
        takes. Raises :class:`ConversionError` ``option name=value: reason`` (one line)."""
        mine = set(self.option_names)
        own = {k: v for k, v in values.items() if k in mine and v is not None}
        bad = self.check(own)
        for k, v in values.items():
            if bad is not None:
                break
            if k in mine or v is None:
                continue
            owner = next((s for s in SCHEMES.values() if k in s.option_names), None)
            takes = ", ".join(self.option_names) or "none"
            bad = Problem(k, v, f"scheme {self.name} does not take it (it takes {takes}; {k} is an option of "
                                f"scheme {owner.name})") if owner is not None else Problem(
                k, v, f"not an option of any scheme (scheme {self.name} takes {takes})")
        if bad is not None:
            raise ConversionError(f"option {bad}")
        return self.options(**own)

    def attributes(self, options: Any, site: AttentionSite | CacheSite) -> dict[str, Any]:
        """The op's attributes for one attention (``rewrite = "attention"``: every attribute but the
        inputs) or one cache (``rewrite = "cache"``: the attributes added to a dyn cache's, after ``axis``)."""
        return self.make_attributes(options, site)

    def bits_text(self, options: Any) -> str:
        """The bits the op stores, as the CLI prints them."""
        if self.fixed_bits is not None:
            return f"{self.fixed_bits} (fixed)"
        return str(getattr(options, "bits", "?"))

    def settings_text(self, options: Any) -> str:
        """``bits 4, key_group 32, ...``: the options, for the conversion report."""
        return ", ".join(f"{f.name} {getattr(options, f.name)}" for f in fields(self.options))


# ---------------------------------------------------------------------------------------------- the schemes
def _kivi_attributes(o: KiviOptions, site: AttentionSite) -> dict[str, Any]:
    extra = {"softcap": float(site.softcap)} if site.softcap else {}
    return dict(axis=2, scale=float(site.scale), bits=o.bits, key_group=o.key_group, value_group=o.value_group,
                residual=o.residual, sinks=o.sinks, is_causal=bool(site.is_causal), **extra)


def _tract_attributes(o: TractOptions, site: AttentionSite) -> dict[str, Any]:
    return dict(axis=2, scale=float(site.scale))


def _tract_cache_attributes(o: TractCacheOptions, site: CacheSite) -> dict[str, Any]:
    return dict(bits=o.bits, per_channel=1 if site.role == "key" else 0)  # keys per channel, values per token


SCHEMES: dict[str, Scheme] = {
    "kivi": Scheme(
        name="kivi", op="nnef_kv_kivi_sdpa", summary="nnef_kv_kivi_sdpa (1..8 bits)", rewrite="attention",
        options=KiviOptions, check=lambda values: kivi_problem(**values), make_attributes=_kivi_attributes,
        softcap=True,
        mask_note="attention '{output}': mask '{mask}' replaced by the op's causal masking",
        reported=("bits", "key_group", "value_group", "residual", "sinks"), demo="bits",
        window=lambda o: o.sinks + o.residual + o.key_group,
        doc="nnef-kv's accurate op: KIVI codes (keys per channel, values per token), a full-precision window "
            "and sinks, causal mask built in"),
    "tract": Scheme(
        name="tract", op="tract_transformers_quantized_kv_sdpa",
        summary="tract_transformers_quantized_kv_sdpa (8 bits)", rewrite="attention", options=TractOptions,
        check=lambda values: first_problem(values, TRACT_SETTINGS),
        make_attributes=_tract_attributes, fixed_bits=8,
        mask_note="attention '{output}': mask '{mask}' dropped: {op} has no causal mask (a multi-token call "
                  "attends to its whole cache)",
        demo="tract", doc="tract's fused op (u8 codes; no causal mask: a multi-token call attends to its whole cache)"),
    "tract-cache": Scheme(
        name="tract-cache", op="tract_transformers_quantized_dyn_kv_cache",
        summary="tract_transformers_quantized_dyn_kv_cache (4 or 8 bits)", rewrite="cache", options=TractCacheOptions,
        check=lambda values: first_problem(values, TRACT_CACHE_SETTINGS), make_attributes=_tract_cache_attributes,
        reported=("bits", "per_channel"),
        doc="each cache becomes tract's quantized dyn cache (keys per channel, values per token); the attention "
            "is left as exported"),
}


# ---------------------------------------------------------------------------------------------- queries
def scheme(name: Any) -> Scheme:
    """The scheme called ``name``; a one-line :class:`ConversionError` listing the choices otherwise."""
    try:
        return SCHEMES[name]
    except (KeyError, TypeError):
        raise ConversionError(f"option scheme={name!r}: expected one of {', '.join(SCHEMES)}") from None


def scheme_names() -> list[str]:
    return list(SCHEMES)


def all_options(schemes: Iterable[Scheme] | None = None) -> list[OptionSpec]:
    """Every option of the schemes (registry order; an option several schemes take, as the first declares it)."""
    seen: dict[str, OptionSpec] = {}
    for s in SCHEMES.values() if schemes is None else schemes:
        for spec in s.option_specs:
            seen.setdefault(spec.name, spec)
    return list(seen.values())


def schemes_writing(op: str) -> list[Scheme]:
    return [s for s in SCHEMES.values() if s.op == op]


def fixed_bits(op: str) -> int | None:
    """The bits ``op`` stores whatever its attributes say (tract's fused op: 8), when a scheme says so."""
    return next((s.fixed_bits for s in schemes_writing(op) if s.fixed_bits is not None), None)


def report_settings(op: str, attrs: Mapping[str, Any]) -> str:
    """``bits 4, key_group 32, ...``: the attributes of a KV op node a validation report shows."""
    writers = schemes_writing(op)
    keys = {k for s in writers for k in s.reported} if writers else set(REPORTED_BY_DEFAULT)
    shown = {k: v for k, v in attrs.items() if k in keys and isinstance(v, (int, float, bool, str))}
    bits = fixed_bits(op)
    if bits is not None:
        shown["bits"] = bits
    return ", ".join(f"{k} {v}" for k, v in shown.items())
