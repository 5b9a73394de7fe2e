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
the quantizer of its op): see ``docs/architecture.md`` (A KV scheme is one object).

This module is data and small functions: it imports no converter module (the rewrite passes live in
:mod:`nnef_kv.converters.passes` and look the scheme's ``rewrite`` up there).
"""
from __future__ import annotations

import pickle
import sys
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable, Iterable, Mapping

from ..errors import ConversionError
from . import layer_bits as LB
from ..kv.ggml_sdpa import CACHE_TYPES
from ..kv.kivi import kivi_problem
from ..kv.rotated import rotated_problem
from ..kv.settings import IntSetting, Problem, first_problem

__all__ = ["Scheme", "SCHEMES", "BUILTIN", "register", "plugins",
           "DEFAULT_SCHEME", "AttentionSite", "CacheSite", "OptionSpec", "option", "scheme",
           "scheme_names", "all_options", "schemes_writing", "fixed_bits", "report_settings", "Problem",
           "KiviOptions", "TractOptions", "TractCacheOptions", "GgmlOptions", "HfOptions", "RotatedOptions",
           "layer_settings"]

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
    key_bits: int = option(0, "kivi: bits of the keys (0: --bits)")
    value_bits: int = option(0, "kivi: bits of the values (0: --bits)")
    key_axis: str = option("channel", "kivi: keys quantized per 'channel' (KIVI, groups of key_group tokens) or per "
                                      "'token' (groups of value_group channels, as values)", type=str)
    layer_bits: str = option("", "per-layer bits, one entry per attention layer in graph order (8,4,4,2) or "
                                 "layer:entry pairs (0:8,3:2); KEY/VALUE entries (8/4) where keys and values can "
                                 "differ; ggml: cache types (q8_0,q4_0/q8_0)", type=str)


@dataclass(frozen=True)
class TractOptions:
    """Options of scheme ``tract``: ``bits`` can only be 8 (tract's fused op stores 8-bit codes; another
    width is refused rather than ignored)."""

    bits: int = option(8)


@dataclass(frozen=True)
class TractCacheOptions:
    """Options of scheme ``tract-cache``."""

    bits: int = option(4)
    layer_bits: str = option("", type=str)


@dataclass(frozen=True)
class GgmlOptions:
    """Options of scheme ``ggml`` (llama.cpp's ``-ctk`` / ``-ctv``)."""

    key_type: str = option("q8_0", "ggml: cache type of the keys (llama.cpp -ctk): " + ", ".join(CACHE_TYPES), type=str)
    value_type: str = option("q8_0", "ggml: cache type of the values (llama.cpp -ctv)", type=str)
    residual: int = option(0)
    layer_bits: str = option("", type=str)
    rotate: bool = option(False, "ggml: llama.cpp's Hadamard rotation of quantized K/V (its default since 2026-04; "
                                 "LLAMA_ATTN_ROT_DISABLE=1 there is this flag absent)", type=bool)


@dataclass(frozen=True)
class RotatedOptions:
    """Options of scheme ``rotated`` (checked by :func:`nnef_kv.kv.rotated.rotated_problem`, as the op's)."""

    bits: int = option(4)
    key_bits: int = option(0)
    value_bits: int = option(0)
    residual: int = option(0)
    sinks: int = option(0)
    seed: int = option(0, "rotated: seed of the random rotation (signs of the Hadamard matrix)")
    layer_bits: str = option("", type=str)


@dataclass(frozen=True)
class HfOptions:
    """Options of scheme ``hf`` (transformers 5.x ``QuantizedCache``; defaults are HF's)."""

    bits: int = option(4)
    group_size: int = option(64, "hf: q_group_size of HF's QuantizedCache")
    residual: int = option(128)
    axis_key: int = option(0, "hf: axis_key of HF's QuantizedCache (quanto 0/-1, hqq 0/1)")
    axis_value: int = option(0, "hf: axis_value of HF's QuantizedCache (quanto 0/-1, hqq 0/1)")
    backend: str = option("quanto", "hf: 'quanto' or 'hqq'", type=str)
    layer_bits: str = option("", type=str)


TRACT_SETTINGS = {"bits": IntSetting(8, 8, allowed=(8,), reason="scheme tract stores 8-bit codes "
                                     "(tract_transformers_quantized_kv_sdpa): give 8 or no bits")}
TRACT_CACHE_SETTINGS = {"bits": IntSetting(4, 8, allowed=(4, 8), reason="scheme tract-cache takes 4 or 8 bits")}
KIVI_VARIANT_SETTINGS = {"key_bits": IntSetting(0, 8, reason="0 (= bits) or 1..8"),
                         "value_bits": IntSetting(0, 8, reason="0 (= bits) or 1..8")}
HF_BITS = {"quanto": (2, 4), "hqq": (1, 2, 3, 4, 8)}
HF_AXES = {"quanto": (0, -1), "hqq": (0, 1)}


# ---------------------------------------------------------------------------------------------- per layer
def _bits_value(allowed: tuple[int, ...] | None, lowest: int = 1, highest: int = 8) -> Callable[[str], int]:
    def value(text: str) -> int:
        try:
            b = int(text)
        except ValueError:
            raise ValueError(f"{text!r} is not a bit width") from None
        if (allowed is not None and b not in allowed) or not lowest <= b <= highest:
            raise ValueError(f"{b} bits: expected " + (", ".join(map(str, allowed)) if allowed else
                                                       f"{lowest}..{highest}"))
        return b
    return value


def _ggml_type(text: str) -> str:
    t = text.lower()
    if t not in CACHE_TYPES:
        raise ValueError(f"{text!r} is not a ggml cache type ({', '.join(CACHE_TYPES)})")
    return t


def _option_values(options: Any) -> dict[str, Any]:
    return {f.name: getattr(options, f.name) for f in fields(options)}


def layer_settings(scheme_obj: "Scheme", options: Any, layer: int) -> tuple[Any, Any]:
    """The (keys, values) setting of attention layer ``layer`` (0-based, graph order) under ``options``:
    its ``--layer-bits`` entry, else the scheme's uniform setting (:attr:`Scheme.uniform`)."""
    default = scheme_obj.uniform(options)
    text = getattr(options, "layer_bits", "")
    if not text or scheme_obj.level is None:
        return default
    spec = LB.parse(text, scheme_obj.level_parser(_option_values(options)), scheme_obj.split)
    assert not isinstance(spec, Problem)  # checked when the options were made
    return LB.entry_for(spec, layer, default)


def _bits_uniform(options: Any) -> tuple[Any, Any]:
    b = getattr(options, "bits", None)
    return b, b


def _split_uniform(options: Any) -> tuple[Any, Any]:
    """kivi, rotated: ``key_bits`` / ``value_bits`` (0: ``bits``)."""
    return options.key_bits or options.bits, options.value_bits or options.bits


def _split_bits_options(keys: Any, values: Any) -> dict[str, Any]:
    return {"bits": keys, **({"value_bits": values} if values != keys else {})}


def _bits_options(keys: Any, values: Any) -> dict[str, Any] | None:
    return {"bits": keys} if keys == values else None


def _kivi_check(values: Mapping[str, Any]) -> Problem | None:
    base = {k: v for k, v in values.items() if k in ("bits", "key_group", "value_group", "residual", "sinks")}
    bad = kivi_problem(**base) or first_problem({k: v for k, v in values.items() if k in KIVI_VARIANT_SETTINGS},
                                                KIVI_VARIANT_SETTINGS)
    if bad is None and "key_axis" in values and values["key_axis"] not in ("channel", "token"):
        bad = Problem("key_axis", values["key_axis"], "expected 'channel' or 'token'")
    return bad


def _ggml_check(values: Mapping[str, Any]) -> Problem | None:
    for k in ("key_type", "value_type"):
        if k in values and (not isinstance(values[k], str) or values[k].lower() not in CACHE_TYPES):
            return Problem(k, values[k], f"expected one of {', '.join(CACHE_TYPES)}")
    bad = first_problem({k: v for k, v in values.items() if k == "residual"}, {"residual": IntSetting(0)})
    if bad is None and "rotate" in values and not isinstance(values["rotate"], bool):
        bad = Problem("rotate", values["rotate"], "expected true or false")
    return bad


def _rotated_check(values: Mapping[str, Any]) -> Problem | None:
    return rotated_problem(**{k: v for k, v in values.items() if k != "layer_bits"})


def _hf_check(values: Mapping[str, Any]) -> Problem | None:
    v = {"bits": 4, "backend": "quanto", "axis_key": 0, "axis_value": 0, **values}
    if v["backend"] not in HF_BITS:
        return Problem("backend", v["backend"], "expected 'quanto' or 'hqq'")
    ints = {"bits": IntSetting(1, 8), "group_size": IntSetting(1), "residual": IntSetting(0),
            "axis_key": IntSetting(-1, 1), "axis_value": IntSetting(-1, 1)}
    bad = first_problem({k: x for k, x in values.items() if k in ints}, ints)
    if bad is not None:
        return bad
    be = v["backend"]
    if v["bits"] not in HF_BITS[be]:
        return Problem("bits", v["bits"], f"HF's {be} backend takes {', '.join(map(str, HF_BITS[be]))} bits")
    for k in ("axis_key", "axis_value"):
        if v[k] not in HF_AXES[be]:
            return Problem(k, v[k], f"HF's {be} backend takes axis {' or '.join(map(str, HF_AXES[be]))}")
    if be == "hqq" and v["bits"] == 3 and 1 in (v["axis_key"], v["axis_value"]):
        return Problem("bits", 3, "HQQ 3-bit with axis 1: HF's cache fails at its first decode step")
    return None


def _tract_cache_check(values: Mapping[str, Any]) -> Problem | None:
    return first_problem({k: v for k, v in values.items() if k == "bits"}, TRACT_CACHE_SETTINGS)


# ---------------------------------------------------------------------------------------------- sites
@dataclass(frozen=True)
class AttentionSite:
    """What the converter found of one attention it rewrites (``rewrite = "attention"``)."""

    scale: float  # the scores' scale (1/sqrt(D) when the graph had none)
    is_causal: bool  # the attention was causal or masked
    softcap: float = 0.0  # tanh softcapping of the scores (0: none)
    layer: int = 0  # its index among the attentions rewritten (graph order)
    window: int = 0  # its mask's sliding window (0: none), on an op with ``Scheme.sliding``
    sink_logits: tuple = ()  # one learned softmax logit per query head (GPT-OSS's sinks), on ``Scheme.sink_logits``


@dataclass(frozen=True)
class CacheSite:
    """One KV cache the converter rewrites (``rewrite = "cache"``)."""

    role: str  # "key" or "value"
    layer: int = 0  # its index among the caches of its role (graph order)


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
    sliding: bool = False  # attention schemes: the op has a sliding window (its ``window`` attribute)
    sink_logits: bool = False  # attention schemes: the op takes learned per-head sink logits (``sink_logits``)
    mask_note: str = ""  # attention schemes: what becomes of a mask ({output}, {mask}, {op})
    causal: bool = True  # attention schemes: the op masks causally (else a causal mask is lost: a change noted)
    fixed_bits: int | None = None  # the op stores this many bits whatever the bits option
    notes: Callable[[Any], list[str]] = lambda options: []  # notes for the conversion report
    #: tokens the op holds before it quantizes any (sinks + window), from the options; None: from the first
    window: Callable[[Any], int] | None = None
    reported: tuple[str, ...] = ()  # attributes of the op a validation report shows
    reported_unless: Mapping[str, Any] = field(default_factory=dict)  # ... unless they hold these (defaults)
    demo: str | None = None  # "bits": demo rows at each --bits width; "tract": one row, dropped by --no-tract
    doc: str = ""
    # ---- per-layer settings: ``--layer-bits``, compare's ``NAME:SETTING``, ``--auto-bits`` (None: one fixed setting)
    #: the options' values (defaults filled in) -> the parser of one level as written (``"4"`` -> 4, ``"q4_0"``),
    #: raising ValueError with the reason
    level: Callable[[Mapping[str, Any]], Callable[[str], Any]] | None = None
    split: bool = False  # keys and values can take different levels (KEY/VALUE entries)
    uniform: Callable[[Any], tuple[Any, Any]] = _bits_uniform  # options -> (keys, values) without --layer-bits
    #: (keys, values) -> the options that give that setting to every layer (None: not expressible uniformly)
    level_options: Callable[[Any, Any], dict[str, Any] | None] = _bits_options
    level_fields: tuple[str, ...] = ("bits",)  # the options a --layer-bits entry stands for
    #: the options' values -> the levels ``--auto-bits`` climbs, cheapest first (None: auto-bits refuses the scheme)
    ladder: Callable[[Mapping[str, Any]], tuple[Any, ...]] | None = None
    level_names: bool = False  # a compare entry may be a level alone (``q4_0``, ``q4_0/q8_0``: this scheme)

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
        bad = self.check(own) or self._layers_text_problem(own)
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

    def level_parser(self, values: Mapping[str, Any]) -> Callable[[str], Any]:
        """How one level is read under the option values ``values`` (the scheme's defaults fill the rest)."""
        if self.level is None:
            raise ConversionError(f"scheme {self.name} has no per-layer setting")
        defaults = {spec.name: spec.default for spec in self.option_specs}
        return self.level({**defaults, **{k: v for k, v in values.items() if v is not None}})

    def parse_level(self, text: str, values: Mapping[str, Any] | None = None) -> Any:
        """One level as written (``"4"``, ``"Q4_0"``) -> the level; ValueError with the reason."""
        return self.level_parser(values or {})(text.strip())

    def levels(self, values: Mapping[str, Any] | None = None) -> tuple[Any, ...]:
        """The ladder ``--auto-bits`` climbs under ``values``, cheapest first (empty: the scheme has none)."""
        return tuple(self.ladder(values or {})) if self.ladder is not None and self.level is not None else ()

    def _layers_text_problem(self, values: Mapping[str, Any]) -> Problem | None:
        text = values.get("layer_bits")
        if not text:
            return None
        if self.level is None:
            return Problem("layer_bits", text, f"scheme {self.name} has one setting for every layer")
        got = LB.parse(text, self.level_parser(values), self.split)
        return got if isinstance(got, Problem) else None

    def __reduce__(self) -> tuple:
        """Pickled by reference (its functions are lambdas): a built-in scheme by name, a plug-in as the module-level
        name it is bound to (what a worker process imports to have it; see :func:`register`)."""
        if BUILTIN.get(self.name) is self:
            return scheme, (self.name,)
        mod = getattr(self.make_attributes, "__module__", None)
        names = [k for k, v in vars(sys.modules[mod]).items() if v is self] if mod in sys.modules else []
        if not names:
            raise pickle.PicklingError(f"scheme {self.name}: a plug-in scheme run in worker processes must be bound to "
                                       f"a module-level name of the module defining its functions ({mod})")
        return _module_scheme, (mod, names[0])

    def attributes(self, options: Any, site: AttentionSite | CacheSite) -> dict[str, Any]:
        """The op's attributes for one attention (``rewrite = "attention"``: every attribute but the
        inputs) or one cache (``rewrite = "cache"``: the attributes added to a dyn cache's, after ``axis``)."""
        return self.make_attributes(options, site)

    def bits_text(self, options: Any) -> str:
        """The bits the op stores, as the CLI prints them."""
        if self.fixed_bits is not None:
            return f"{self.fixed_bits} (fixed)"
        if getattr(options, "layer_bits", ""):
            return f"per layer {options.layer_bits}"
        k, v = layer_settings(self, options, -1)
        return str(k) if k == v else f"{k}/{v}"

    def layers_problem(self, options: Any, layers: int) -> Problem | None:
        """``--layer-bits`` against the number of attention layers (or caches of one role) found."""
        text = getattr(options, "layer_bits", "")
        if not text:
            return None
        spec = LB.parse(text, self.level_parser(_option_values(options)), self.split)
        return spec if isinstance(spec, Problem) else LB.count_problem(spec, text, layers)

    def settings_text(self, options: Any) -> str:
        """``bits 4, key_group 32, ...``: the options, for the conversion report."""
        return ", ".join(f"{f.name} {getattr(options, f.name)}" for f in fields(self.options))


# ---------------------------------------------------------------------------------------------- the schemes
def _kivi_attributes(o: KiviOptions, site: AttentionSite) -> dict[str, Any]:
    extra: dict[str, Any] = {"softcap": float(site.softcap)} if site.softcap else {}
    kb, vb = layer_settings(SCHEMES["kivi"], o, site.layer)
    if vb != kb:
        extra["value_bits"] = vb  # bits = the keys' (the op: value_bits 0 = bits)
    if o.key_axis != "channel":
        extra["key_axis"] = o.key_axis
    return dict(axis=2, scale=float(site.scale), bits=kb, key_group=o.key_group, value_group=o.value_group,
                residual=o.residual, sinks=o.sinks, is_causal=bool(site.is_causal), **extra, **_window(site))


def _window(site: AttentionSite) -> dict[str, Any]:
    """The ``window`` attribute of a sliding layer and the ``sink_logits`` of GPT-OSS's sinks (last: the ops
    declare them after every other)."""
    return ({"window": int(site.window)} if site.window else {}) | (
        {"sink_logits": [float(x) for x in site.sink_logits]} if site.sink_logits else {})


def _ggml_attributes(o: GgmlOptions, site: AttentionSite) -> dict[str, Any]:
    kt, vt = layer_settings(SCHEMES["ggml"], o, site.layer)
    extra = {"rotate": True} if o.rotate else {}
    return dict(axis=2, scale=float(site.scale), key_type=kt, value_type=vt, residual=o.residual,
                is_causal=bool(site.is_causal), **extra, **_window(site))


def _rotated_attributes(o: RotatedOptions, site: AttentionSite) -> dict[str, Any]:
    kb, vb = layer_settings(SCHEMES["rotated"], o, site.layer)
    vbits: dict[str, Any] = {"value_bits": vb} if vb != kb else {}  # bits = the keys' (value_bits 0 = bits)
    seed: dict[str, Any] = {"seed": o.seed} if o.seed else {}
    return dict(axis=2, scale=float(site.scale), bits=kb, **vbits, residual=o.residual, sinks=o.sinks,
                is_causal=bool(site.is_causal), **seed)


def _hf_attributes(o: HfOptions, site: AttentionSite) -> dict[str, Any]:
    bits, _ = layer_settings(SCHEMES["hf"], o, site.layer)
    return dict(axis=2, scale=float(site.scale), bits=bits, group_size=o.group_size, residual=o.residual,
                axis_key=o.axis_key, axis_value=o.axis_value, backend=o.backend, is_causal=bool(site.is_causal),
                **_window(site))


def _tract_attributes(o: TractOptions, site: AttentionSite) -> dict[str, Any]:
    return dict(axis=2, scale=float(site.scale))


def _tract_cache_attributes(o: TractCacheOptions, site: CacheSite) -> dict[str, Any]:
    kb, vb = layer_settings(SCHEMES["tract-cache"], o, site.layer)
    # keys per channel, values per token
    return dict(bits=kb if site.role == "key" else vb, per_channel=1 if site.role == "key" else 0)


SCHEMES: dict[str, Scheme] = {
    "kivi": Scheme(
        name="kivi", op="nnef_kv_kivi_sdpa", summary="nnef_kv_kivi_sdpa (1..8 bits)", rewrite="attention",
        options=KiviOptions, check=_kivi_check, make_attributes=_kivi_attributes,
        softcap=True,
        sliding=True,
        sink_logits=True,
        mask_note="attention '{output}': mask '{mask}' replaced by the op's causal masking",
        reported=("bits", "value_bits", "key_group", "value_group", "residual", "sinks", "key_axis"), demo="bits",
        reported_unless={"value_bits": 0, "key_axis": "channel"},
        window=lambda o: o.sinks + o.residual + o.key_group,
        level=lambda v: _bits_value(None), split=True, uniform=_split_uniform, level_options=_split_bits_options,
        level_fields=("bits", "key_bits", "value_bits"), ladder=lambda v: (2, 3, 4, 5, 6, 8),
        doc="nnef-kv's accurate op: KIVI codes (keys per channel, values per token), a full-precision window "
            "and sinks, causal mask built in"),
    "tract": Scheme(
        name="tract", op="tract_transformers_quantized_kv_sdpa",
        summary="tract_transformers_quantized_kv_sdpa (8 bits)", rewrite="attention", options=TractOptions,
        check=lambda values: first_problem(values, TRACT_SETTINGS),
        make_attributes=_tract_attributes, fixed_bits=8, causal=False,
        mask_note="attention '{output}': mask '{mask}' dropped: {op} has no causal mask (a multi-token call "
                  "attends to its whole cache)",
        demo="tract", doc="tract's fused op (u8 codes; no causal mask: a multi-token call attends to its whole cache)"),
    "tract-cache": Scheme(
        name="tract-cache", op="tract_transformers_quantized_dyn_kv_cache",
        summary="tract_transformers_quantized_dyn_kv_cache (4 or 8 bits)", rewrite="cache", options=TractCacheOptions,
        check=_tract_cache_check, make_attributes=_tract_cache_attributes,
        level=lambda v: _bits_value((4, 8)), split=True, ladder=lambda v: (4, 8),
        reported=("bits", "per_channel"),
        doc="each cache becomes tract's quantized dyn cache (keys per channel, values per token); the attention "
            "is left as exported"),
    "ggml": Scheme(
        name="ggml", op="nnef_kv_ggml_sdpa", summary="nnef_kv_ggml_sdpa (llama.cpp cache types --key-type / "
        "--value-type)", rewrite="attention", options=GgmlOptions, check=_ggml_check,
        make_attributes=_ggml_attributes,
        level=lambda v: _ggml_type, split=True, uniform=lambda o: (o.key_type, o.value_type),
        level_options=lambda k, v: {"key_type": k, "value_type": v}, level_fields=("key_type", "value_type"),
        ladder=lambda v: ("q4_0", "iq4_nl", "q4_1", "q5_0", "q5_1", "q8_0"), level_names=True,
        sliding=True,
        sink_logits=True,
        mask_note="attention '{output}': mask '{mask}' replaced by the op's causal masking",
        reported=("key_type", "value_type", "residual", "rotate"), reported_unless={"rotate": False},
        notes=lambda o: ["--rotate: llama.cpp's Walsh-Hadamard rotation of quantized K/V, applied by the op where "
                         "head_dim is a multiple of 64 (elsewhere the blocks are stored as without it)"]
        if o.rotate else [],
        doc="llama.cpp's -ctk/-ctv KV cache: every token's K and V rows in ggml blocks of 32 along head_dim "
            "(bit-exact with ggml's reference quantizers), no full-precision window unless --residual"),
    "hf": Scheme(
        name="hf", op="nnef_kv_hf_quantized_sdpa", summary="nnef_kv_hf_quantized_sdpa (Hugging Face "
        "QuantizedCache, quanto 2/4 bits or hqq)", rewrite="attention", options=HfOptions, check=_hf_check,
        make_attributes=_hf_attributes,
        level=lambda v: _bits_value(HF_BITS.get(v["backend"], HF_BITS["quanto"])),
        ladder=lambda v: HF_BITS.get(v.get("backend", "quanto"), HF_BITS["quanto"]),
        sliding=True,
        sink_logits=True,
        mask_note="attention '{output}': mask '{mask}' replaced by the op's causal masking",
        reported=("backend", "bits", "group_size", "residual", "axis_key", "axis_value"),
        doc="transformers 5.x QuantizedCache: the prefill attends exactly and is stored quantized, later calls "
            "read the dequantized store, the residual re-quantizes the whole history when full (HF's defaults)"),
    "rotated": Scheme(
        name="rotated", op="nnef_kv_rotated_sdpa", summary="nnef_kv_rotated_sdpa (random-sign Hadamard + "
        "Lloyd-Max codebook, 1..4 bits, one f16 norm a vector)", rewrite="attention", options=RotatedOptions,
        check=_rotated_check, make_attributes=_rotated_attributes,
        level=lambda v: _bits_value((1, 2, 3, 4, 32), highest=32), split=True, uniform=_split_uniform,
        level_options=_split_bits_options, level_fields=("bits", "key_bits", "value_bits"), ladder=lambda v: (2, 3, 4),
        mask_note="attention '{output}': mask '{mask}' replaced by the op's causal masking",
        reported=("bits", "value_bits", "residual", "sinks"), reported_unless={"value_bits": 0},
        window=lambda o: o.sinks + o.residual,
        doc="nnef-kv's rotated-codebook op: each key/value vector rotated (seeded random-sign Hadamard), its norm "
            "in f16, its coordinates coded against a Lloyd-Max codebook; attention reads the codes directly"),
}


#: the schemes nnef-kv ships (a plug-in is any other entry of SCHEMES: :func:`register`, :func:`plugins`)
BUILTIN: dict[str, Scheme] = dict(SCHEMES)


# ---------------------------------------------------------------------------------------------- queries
def register(s: Scheme) -> Scheme:
    """Add a plug-in scheme (one more entry of :data:`SCHEMES`). For ``compare`` and ``--auto-bits``, whose
    workers are new processes, bind it to a module-level name of the module that defines its functions: it
    travels to them by that name (:meth:`Scheme.__reduce__`)."""
    if s.name in BUILTIN:
        raise ConversionError(f"scheme {s.name}: a built-in scheme has that name")
    SCHEMES[s.name] = s
    return s


def plugins() -> tuple[Scheme, ...]:
    """The registered schemes nnef-kv does not ship."""
    return tuple(s for n, s in SCHEMES.items() if BUILTIN.get(n) is not s)


def _module_scheme(module: str, name: str) -> Scheme:
    import importlib

    return getattr(importlib.import_module(module), name)


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
    unless = {k: v for s in writers for k, v in s.reported_unless.items()}
    shown = {k: v for k, v in attrs.items() if k in keys and isinstance(v, (int, float, bool, str))
             and not (k in unless and v == unless[k])}
    bits = fixed_bits(op)
    if bits is not None:
        shown["bits"] = bits
    return ", ".join(f"{k} {v}" for k, v in shown.items())
