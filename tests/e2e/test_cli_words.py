"""What the command line says (issue 23.11): help metavars, limit defaults as numbers, the convert line's bits."""
from __future__ import annotations

import pytest

from nnef_kv.cli import _scheme_phrase, build_parser
from nnef_kv.converters.options import ConvertOptions
from nnef_kv.limits import Limits


def _help(*argv: str) -> str:
    p = build_parser()
    if not argv:
        return " ".join(p.format_help().split())
    sub = next(a for a in p._actions if a.__class__.__name__ == "_SubParsersAction")
    return " ".join(sub.choices[argv[0]].format_help().split())


@pytest.mark.parametrize("flag,metavar", [("--key-axis", "AXIS"), ("--layer-bits", "BITS"), ("--key-type", "TYPE"),
                                          ("--value-type", "TYPE"), ("--backend", "BACKEND"), ("--bits", "N")])
def test_convert_metavars_say_what_the_value_is(flag, metavar) -> None:
    assert f"{flag} {metavar} " in _help("convert")


def test_limit_defaults_are_numbers() -> None:
    text = _help()
    d = Limits()
    assert "nnef_kv.limits.Limits" not in text
    for flag, value in (("--max-archive-bytes", d.max_archive_bytes), ("--max-tensor-bytes", d.max_tensor_bytes),
                        ("--max-members", d.max_members), ("--max-nesting", d.max_nesting)):
        after = text.split(f"{flag} N ", 1)[1]
        assert f"(default {value})" in after.split(" --", 1)[0], (flag, after[:200])


@pytest.mark.parametrize("scheme,options,words", [
    ("kivi", {}, "kivi, 4 bits"),
    ("kivi", dict(bits=1), "kivi, 1 bit"),
    ("kivi", dict(bits=4, value_bits=2), "kivi, 4/2 bits (keys/values)"),
    ("kivi", dict(layer_bits="8,4/2"), "kivi, bits per layer 8,4/2"),
    ("tract", {}, "tract, 8 bits (fixed)"),
    ("ggml", dict(key_type="q4_0", value_type="q4_0"), "ggml, cache type q4_0"),
    ("ggml", dict(key_type="q4_0"), "ggml, cache types q4_0/q8_0 (keys/values)"),
    ("ggml", dict(layer_bits="q8_0,q4_0/q8_0"), "ggml, cache types per layer q8_0,q4_0/q8_0"),
    ("hf", dict(backend="hqq"), "hf (hqq backend), 4 bits"),
    ("hf", {}, "hf (quanto backend), 4 bits"),
])
def test_the_convert_line_names_bits_types_and_backend(scheme, options, words) -> None:
    assert _scheme_phrase(ConvertOptions.of(scheme, **options)) == words
