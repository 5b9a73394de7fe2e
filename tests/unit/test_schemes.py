"""KV schemes are plug-ins: the registry (lookup, one-line error), each scheme's one option check (the
same words from ``convert`` and from the op's constructor), the CLI's ``--scheme`` choices and flags
read from the registry, and a scheme registered at test time picked up by the CLI, ``convert``, the
report and ``demo`` without any other edit."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import nnef_kv
from nnef_kv import ConversionError, GraphError
from nnef_kv.cli import build_parser, main
from nnef_kv.converters import ConvertOptions, convert
from nnef_kv.converters import schemes as S
from nnef_kv.kv.kivi import KiviSdpa
from nnef_kv.models import DecoderConfig, build_decoder

from conftest import REPO
from test_converters import attention_graph

CFG = DecoderConfig(vocab=256, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, mlp=64, seed=3)


@pytest.fixture(scope="module")
def f32(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("schemes") / "f32.nnef.tar"
    nnef_kv.save(build_decoder(CFG), path)
    return path


def _err_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err and "\n" not in err and "Traceback" not in err, err
    return err


def _subparser(name: str):
    import argparse

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _flags(parser) -> dict[str, object]:
    return {opt: a for a in parser._actions for opt in a.option_strings}


# ---------------------------------------------------------------------------------------------- registry
def test_registry_holds_todays_schemes_with_their_ops():
    assert list(S.SCHEMES) == ["kivi", "tract", "tract-cache", "ggml", "hf", "rotated"]
    assert {n: s.op for n, s in S.SCHEMES.items()} == {
        "kivi": "nnef_kv_kivi_sdpa", "tract": "tract_transformers_quantized_kv_sdpa",
        "tract-cache": "tract_transformers_quantized_dyn_kv_cache", "ggml": "nnef_kv_ggml_sdpa",
        "hf": "nnef_kv_hf_quantized_sdpa", "rotated": "nnef_kv_rotated_sdpa"}
    assert {n: s.rewrite for n, s in S.SCHEMES.items()} == {"kivi": "attention", "tract": "attention",
                                                           "tract-cache": "cache", "ggml": "attention",
                                                           "hf": "attention", "rotated": "attention"}
    assert S.scheme("tract") is S.SCHEMES["tract"]
    assert S.fixed_bits("tract_transformers_quantized_kv_sdpa") == 8 and S.fixed_bits("nnef_kv_kivi_sdpa") is None


@pytest.mark.parametrize("name", ["fp8", "", None, ["kivi"]])
def test_unknown_scheme_is_one_line_listing_the_choices(name):
    with pytest.raises(ConversionError) as exc:
        S.scheme(name)
    msg = str(exc.value)
    assert "\n" not in msg
    assert msg == f"option scheme={name!r}: expected one of kivi, tract, tract-cache, ggml, hf, rotated"


def test_schemes_module_imports_no_converter():
    """The scheme registry is data beside the converters: it imports no rewrite pass (only the layer-bits data)."""
    from test_layering import PACKAGE, graph

    deps = graph(PACKAGE)["nnef_kv.converters.schemes"]
    passes = {d for d in deps if d.startswith("nnef_kv.converters")} - {"nnef_kv.converters.layer_bits"}
    assert deps and not passes, deps


# ---------------------------------------------------------------------------------------------- options
BAD = [  # (scheme, option values, the message after "option ")
    ("kivi", dict(bits=9), "bits=9: scheme kivi takes 1..8 bits"),
    ("kivi", dict(bits=0), "bits=0: scheme kivi takes 1..8 bits"),
    ("kivi", dict(key_group=0), "key_group=0: must be >= 1"),
    ("kivi", dict(value_group=-4), "value_group=-4: must be >= 1"),
    ("kivi", dict(residual=-1), "residual=-1: must be >= 0"),
    ("kivi", dict(sinks=-2), "sinks=-2: must be >= 0"),
    ("kivi", dict(bits=4.0), "bits=4.0: an integer is expected"),
    ("kivi", dict(bits=True), "bits=True: an integer is expected"),
    ("kivi", dict(bits=9, key_group=1.5), "key_group=1.5: an integer is expected"),  # types first, as before
    ("tract", dict(bits=9), "bits=9: scheme tract stores 8-bit codes (tract_transformers_quantized_kv_sdpa): give 8 "
                            "or no bits"),
    # issue 13 item 8: a width tract's op would ignore is refused, not ignored (was: accepted with a note)
    ("tract", dict(bits=4), "bits=4: scheme tract stores 8-bit codes (tract_transformers_quantized_kv_sdpa): give 8 "
                            "or no bits"),
    # an option the scheme does not take is refused, whatever its value (was: checked by its owner, then ignored)
    ("tract", dict(key_group=0), "key_group=0: scheme tract does not take it (it takes bits; key_group is an option "
                                 "of scheme kivi)"),
    ("tract", dict(key_group=16), "key_group=16: scheme tract does not take it (it takes bits; key_group is an "
                                  "option of scheme kivi)"),
    ("tract-cache", dict(residual=8), "residual=8: scheme tract-cache does not take it (it takes bits, layer_bits; "
                                      "residual is an option of scheme kivi)"),
    ("kivi", dict(sinks=10 ** 20), "sinks=100000000000000000000: too large: the op holds it as a 64-bit integer "
                                   "(at most 9223372036854775807)"),
    ("kivi", dict(residual=2 ** 63), "residual=9223372036854775808: too large: the op holds it as a 64-bit integer "
                                     "(at most 9223372036854775807)"),
    ("tract-cache", dict(bits=6), "bits=6: scheme tract-cache takes 4 or 8 bits"),
    ("tract-cache", dict(bits=3), "bits=3: scheme tract-cache takes 4 or 8 bits"),
    ("kivi", dict(colour=1), "colour=1: not an option of any scheme (scheme kivi takes bits, key_group, "
                             "value_group, residual, sinks, key_bits, value_bits, key_axis, layer_bits)"),
]


@pytest.mark.parametrize("scheme,values,message", BAD)
def test_one_check_per_scheme_for_every_entry_point(scheme, values, message, tmp_path):
    """convert(), ConvertOptions and the scheme itself refuse with the same line, before any work."""
    expected = f"option {message}"
    with pytest.raises(ConversionError) as a:
        convert(tmp_path / "never-opened.nnef.tgz", scheme=scheme, **values)
    with pytest.raises(ConversionError) as b:
        ConvertOptions.of(scheme, **values)
    with pytest.raises(ConversionError) as c:
        S.scheme(scheme).validate(values)
    assert str(a.value) == str(b.value) == str(c.value) == expected


@pytest.mark.parametrize("values", [dict(bits=9), dict(bits=0), dict(key_group=0), dict(value_group=-4),
                                    dict(residual=-1), dict(sinks=-2), dict(sinks=10 ** 20), dict(residual=2 ** 63)])
def test_kivi_op_and_convert_refuse_in_the_same_words(values, tmp_path):
    """The op's constructor (attributes read from an archive) keeps its GraphError, with convert's words."""
    with pytest.raises(ConversionError) as conv:
        convert(tmp_path / "x.nnef.tgz", scheme="kivi", **values)
    with pytest.raises(GraphError) as op:
        KiviSdpa(**values)
    assert str(op.value) == "nnef_kv_kivi_sdpa: " + str(conv.value).removeprefix("option ")


def test_valid_options_take_the_scheme_defaults():
    assert S.scheme("kivi").validate({}) == S.KiviOptions(4, 32, 32, 32, 0)
    o = ConvertOptions.of("tract")  # only the scheme's own options, at its defaults
    assert o.as_dict() == {"scheme": "tract", "bits": 8}
    assert o.scheme_options == S.TractOptions(bits=8)
    assert ConvertOptions.of("kivi").as_dict() == {"scheme": "kivi", "bits": 4, "key_group": 32, "value_group": 32,
                                                   "residual": 32, "sinks": 0, "key_bits": 0, "value_bits": 0,
                                                   "key_axis": "channel", "layer_bits": ""}
    with pytest.raises(ConversionError, match="key_group=8: scheme tract does not take it"):
        ConvertOptions.of("tract", key_group=8)  # was: checked, kept and ignored
    with pytest.raises(ConversionError, match="key_group=8: scheme tract does not take it"):
        ConvertOptions("tract", key_group=8).validate()
    assert ConvertOptions("kivi", bits=2).validate().scheme_options == S.KiviOptions(bits=2)


def test_scheme_notes_and_report_settings():
    assert S.scheme("tract").notes(S.TractOptions(8)) == []  # no "bits ignored" note: such bits are refused
    assert S.report_settings("tract_transformers_quantized_kv_sdpa", {"axis": 2, "scale": 0.5}) == "bits 8"
    assert S.report_settings("nnef_kv_kivi_sdpa", {"axis": 2, "scale": 0.5, "bits": 4, "key_group": 32,
                                                   "is_causal": True}) == "bits 4, key_group 32"
    # scheme ggml writes the op now: its reported attributes
    assert S.report_settings("nnef_kv_ggml_sdpa", {"key_type": "q8_0", "residual": 0}) == "key_type q8_0, residual 0"


# ---------------------------------------------------------------------------------------------- CLI
def test_cli_scheme_choices_and_flags_come_from_the_registry():
    conv = _subparser("convert")
    flags = _flags(conv)
    assert flags["--scheme"].choices == list(S.SCHEMES)
    assert flags["--scheme"].default == S.DEFAULT_SCHEME
    for spec in S.all_options():
        f = flags[spec.flag]
        # a bool option is a bare flag (--rotate): argparse's store_const has no type
        assert f.dest == spec.name and (f.type is spec.type or (spec.type is bool and f.const is True))
    assert {"--bits", "--key-group", "--value-group", "--residual", "--sinks"} <= set(flags)
    help_text = flags["--scheme"].help
    assert all(f"{s.name}: {s.summary}" in help_text for s in S.SCHEMES.values())


def test_cli_prints_the_schemes_bits(f32, tmp_path, capsys):
    assert main(["convert", str(f32), "-o", str(tmp_path / "t.nnef.tar"), "--scheme", "tract"]) == 0
    assert "with scheme tract, 8 bits (fixed) ->" in capsys.readouterr().out
    out = tmp_path / "c.nnef.tar"
    assert main(["convert", str(f32), "-o", str(out), "--scheme", "tract-cache", "--bits", "8"]) == 0
    assert "with scheme tract-cache, 8 bits ->" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------- plug-in
@dataclass(frozen=True)
class WindowOptions:
    bits: int = S.option(8)
    window: int = S.option(16, "newest tokens kept in full precision (fake scheme)")


def _window_attributes(o: WindowOptions, site: S.AttentionSite) -> dict:
    return dict(axis=2, scale=float(site.scale), bits=o.bits, key_group=8, value_group=8, residual=o.window,
                sinks=0, is_causal=bool(site.is_causal))


def _window_check(values):
    from nnef_kv.kv.settings import IntSetting, first_problem

    return first_problem(values, {"bits": IntSetting(1, 8), "window": IntSetting(0)})


FAKE = S.Scheme(name="kivi-window", op="nnef_kv_kivi_sdpa", summary="nnef_kv_kivi_sdpa, groups of 8 (test)",
                rewrite="attention", options=WindowOptions, check=_window_check, make_attributes=_window_attributes,
                softcap=False, mask_note="attention '{output}': mask '{mask}' gone",
                notes=lambda o: [f"fake scheme, window {o.window}"], reported=("bits", "residual"), demo="bits")


@pytest.fixture
def fake_scheme(monkeypatch):
    monkeypatch.setitem(S.SCHEMES, FAKE.name, FAKE)
    yield FAKE
    monkeypatch.undo()
    assert FAKE.name not in S.SCHEMES


def test_a_registered_scheme_is_picked_up_everywhere(fake_scheme, f32, tmp_path, capsys):
    flags = _flags(_subparser("convert"))
    assert "kivi-window" in flags["--scheme"].choices and "--window" in flags
    out = tmp_path / "w.nnef.tar"
    assert main(["convert", str(f32), "-o", str(out), "--scheme", "kivi-window", "--window", "24"]) == 0
    assert "with scheme kivi-window, 8 bits ->" in capsys.readouterr().out
    text = nnef_kv.dump(nnef_kv.load(out).document)
    assert text.count("nnef_kv_kivi_sdpa(") == CFG.layers and "residual = 24" in text and "key_group = 8" in text
    assert "extension nnef_kv" in text

    # the API, its report and the bad-value path
    model, report = convert(f32, scheme="kivi-window", window=4)
    assert "scheme kivi-window (bits 8, window 4)" in report.to_text() and "fake scheme, window 4" in report.notes
    rng = np.random.default_rng(0)
    logits = model.session().run({"input_ids": rng.integers(0, CFG.vocab, (1, 5)).astype(np.int64)})["outputs"]
    assert np.isfinite(logits).all()
    for argv, needle in ((["--window", "-1"], "option window=-1: must be >= 0"),
                         (["--bits", "9"], "option bits=9: must be in 1..8")):
        assert main(["convert", str(f32), "-o", str(tmp_path / "bad.tar"), "--scheme", "kivi-window", *argv]) == 2
        assert needle in _err_line(capsys)
    assert not (tmp_path / "bad.tar").exists()
    # another scheme's option given to kivi: refused, whatever its value (issue 13 item 8; was: checked by its owner)
    for value in (-3, 4):
        with pytest.raises(ConversionError, match=f"option window={value}: scheme kivi does not take it"):
            convert(f32, scheme="kivi", window=value)

    # demo: a "bits" scheme gets a row per bit width
    from nnef_kv.validate.demo import DemoOptions, variants

    got = [(label, bits) for label, bits, _ in variants(DemoOptions(bits=(4,), tract=False))]
    assert got == [("f32 (reference)", "32"), ("kivi", "4"), ("kivi-window", "4")]


def test_demo_variants_read_the_registry():
    from nnef_kv.validate.demo import DemoOptions, bits_problem, variants

    got = variants(DemoOptions(bits=(8, 2)))
    assert [(a, b) for a, b, _ in got] == [("f32 (reference)", "32"), ("kivi", "8"), ("kivi", "2"), ("tract", "8")]
    assert got[-1][2] == {"scheme": "tract", "bits": 8}
    assert [a for a, _, _ in variants(DemoOptions(bits=(4,), tract=False))] == ["f32 (reference)", "kivi"]
    assert bits_problem(9) == "scheme kivi takes 1..8 bits" and bits_problem(3) is None


def test_passes_read_the_scheme_not_its_name(fake_scheme):
    """The mask note and the softcap refusal of a fused scheme come from its Scheme object."""
    from nnef_kv.io.archive import Model

    mask = ("q_pos = unsqueeze(tract_core_range(P, P + S, 1), axes = [1]);\n"
            "  k_pos = unsqueeze(tract_core_range(0, P + S, 1), axes = [0]);\n"
            "  mask = mul(tract_core_cast(gt(k_pos, q_pos), to = 'f32'), -1e9);")  # causal, from the lengths
    text = attention_graph(scale=f"{mask}\n  ss0 = div(s, 2.0);\n  ss = add(ss0, mask);")
    _, report = convert(Model.from_text(text), scheme="kivi-window")
    assert any(n.startswith("attention 'y': mask 'mask' gone") for n in report.notes), report.notes
    capped = attention_graph(scale="t0 = div(s, 3.0);\n  t1 = tanh(t0);\n  ss = mul(t1, 3.0);")
    with pytest.raises(ConversionError, match=r"nnef_kv_kivi_sdpa has no softcap: use --scheme kivi \(softcap "
                                              r"attribute\) or --scheme tract-cache"):
        convert(Model.from_text(capped), scheme="kivi-window")


def test_docs_list_the_files_a_scheme_touches():
    doc = (REPO / "docs" / "architecture.md").read_text()
    for path in ("nnef_kv/converters/schemes.py", "nnef_kv/kv/kivi/sdpa.py", "nnef_kv/grammar/nnef_kv_ops.nnef",
                 "nnef_kv/converters/frontends/"):
        assert path in doc
        assert (REPO / path).exists(), path


def test_huge_windows_allocate_nothing_up_front():
    """Settings the op holds but no sequence reaches (sinks / residual of 10^15: never quantized) cost memory for
    the tokens held only: the op used to reserve all of them at its first call (ValueError: Maximum allowed
    dimension exceeded, for the archive convert --sinks 10^20 used to write)."""
    rng = np.random.default_rng(0)
    for kw in (dict(sinks=10 ** 15), dict(residual=10 ** 15), dict(key_group=10 ** 15)):
        op = KiviSdpa(scale=0.25, bits=4, **kw)
        for _ in range(3):
            q, k, v = (rng.standard_normal((1, 2, 4, 16)).astype(np.float32) for _ in range(3))
            out = op(q, k, v)
        assert np.isfinite(out).all() and op.nbytes()["codes"] == 0, kw
        assert sum(op.nbytes().values()) < 1 << 20, (kw, op.nbytes())


# ---------------------------------------------------------------------------------------------- plug-in, all the way
@dataclass(frozen=True)
class LadderOptions:
    bits: int = S.option(8)
    layer_bits: str = S.option("", type=str)


def _ladder_level(values):
    def level(text):
        b = int(text)  # ValueError for a non-integer
        if b not in (2, 4, 8):
            raise ValueError(f"{b} bits: expected 2, 4 or 8")
        return b
    return level


def _ladder_attributes(o: LadderOptions, site: S.AttentionSite) -> dict:
    bits, _ = S.layer_settings(LADDER, o, site.layer)
    return dict(axis=2, scale=float(site.scale), bits=bits, key_group=8, value_group=8, residual=8, sinks=0,
                is_causal=bool(site.is_causal))


LADDER = S.Scheme(name="kivi-ladder", op="nnef_kv_kivi_sdpa", summary="nnef_kv_kivi_sdpa, 2/4/8 bits (test)",
                  rewrite="attention", options=LadderOptions, check=lambda values: None,
                  make_attributes=_ladder_attributes, mask_note="attention '{output}': mask '{mask}' gone",
                  reported=("bits",), window=lambda o: 16, level=_ladder_level, ladder=lambda values: (2, 4, 8))


@pytest.fixture
def ladder_scheme(monkeypatch):
    monkeypatch.setitem(S.SCHEMES, LADDER.name, LADDER)
    yield LADDER
    monkeypatch.undo()
    assert LADDER.name not in S.SCHEMES


def test_a_plugin_scheme_runs_through_compare_and_auto_bits(ladder_scheme, tmp_path, capsys):
    """A scheme registered at test time, with a ladder and a per-layer level of its own, is measured by
    ``compare`` (its specs parsed by its level rule, its rows coloured as its own family) and searched by
    ``convert --auto-bits`` (its ladder), in worker processes that receive it by reference."""
    import json
    import pickle

    from nnef_kv.validate.compare import parse_spec

    assert pickle.loads(pickle.dumps(LADDER)) is LADDER and pickle.loads(pickle.dumps(S.SCHEMES["kivi"])) is \
        S.SCHEMES["kivi"]
    assert S.plugins() == (LADDER,)
    import dataclasses

    with pytest.raises(ConversionError, match="scheme kivi: a built-in scheme has that name"):
        S.register(dataclasses.replace(LADDER, name="kivi"))
    assert parse_spec("kivi-ladder:4").kwargs == {"bits": 4}
    with pytest.raises(nnef_kv.errors.InputError, match="KEY/VALUE bits are for kivi"):
        parse_spec("kivi-ladder:4/2")  # one setting for keys and values (its level_options)
    path = tmp_path / "f32.nnef.tar"
    nnef_kv.save(build_decoder(DecoderConfig(vocab=256, hidden=32, layers=2, heads=2, kv_heads=1, head_dim=8,
                                             mlp=32, seed=3)), path)
    ids = tmp_path / "ids.npy"
    np.save(ids, np.random.default_rng(0).integers(0, 256, 600))
    out = tmp_path / "rep"
    rc = main(["compare", str(path), "--ids", str(ids), "--schemes", "kivi-ladder:2,kivi-ladder:8", "--context", "64",
               "--eval-tokens", "8", "--windows", "2", "--no-tract", "--jobs", "2", "--report-dir", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    rows = {r["scheme"]: r for r in json.loads((out / "report.json").read_text())["rows"]}
    assert {r["status"] for r in rows.values()} == {"measured"} and {r["family"] for r in rows.values()} == \
        {"kivi-ladder"}
    assert rows["kivi-ladder:2"]["kv_bytes"] < rows["kivi-ladder:8"]["kv_bytes"]

    conv = tmp_path / "auto.nnef.tar"
    rd = tmp_path / "auto"
    rc = main(["convert", str(path), "-o", str(conv), "--scheme", "kivi-ladder", "--auto-bits", "--max-kl", "50",
               "--ids", str(ids), "--context", "64", "--eval-tokens", "8", "--windows", "2", "--jobs", "2",
               "--report-dir", str(rd)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    rep = json.loads((rd / "report.json").read_text())
    assert rep["scheme"] == "kivi-ladder" and rep["ladder"] == [2, 4, 8] and not rep["split"]
    assert len(rep["uniform"]) == 3 and rep["chosen"] is not None
    text = nnef_kv.dump(nnef_kv.load(conv).document)
    assert text.count("nnef_kv_kivi_sdpa(") == 2 and "bits = 2" in text  # a budget of 50 nats: the cheapest


def test_convert_options_are_values():
    """ConvertOptions holds a scheme name and its values (no scheme's fields of its own): equal, hashable,
    immutable, and pickled to worker processes unchanged."""
    import pickle

    o = ConvertOptions.of("ggml", key_type="q4_0", rotate=True)
    back = pickle.loads(pickle.dumps(o))
    assert o == ConvertOptions.of("ggml", key_type="q4_0", rotate=True) and hash(o) == hash(back)
    assert pickle.loads(pickle.dumps(o)) == o and o.scheme_options.rotate is True
    with pytest.raises(AttributeError):
        o.scheme = "kivi"
