"""Schemes ggml (llama.cpp -ctk/-ctv), hf (transformers QuantizedCache), the KIVI variants and per-layer
settings (``--layer-bits``): registry entries, the attributes written per layer, one-line refusals,
and the converted decoders run."""
from __future__ import annotations

import numpy as np
import pytest

from nnef_kv.converters import convert
from nnef_kv.errors import ConversionError
from nnef_kv.converters import schemes as S
from nnef_kv.models import DecoderConfig, build_decoder
from test_stepwise import assert_states_close

CFG = DecoderConfig(vocab=64, hidden=64, layers=3, heads=4, kv_heads=2, head_dim=32, mlp=64, seed=1)


@pytest.fixture(scope="module")
def model():
    return build_decoder(CFG)


def _kv_nodes(m, op):
    return [n for n in m.session().plan.step_nodes if n.op == op]


CASES = [
    ("ggml", dict(key_type="q4_0", value_type="q8_0"), "nnef_kv_ggml_sdpa",
     [dict(key_type="q4_0", value_type="q8_0", residual=0)] * 3),
    ("ggml", dict(layer_bits="q8_0,q4_0/q8_0,q5_1", residual=4), "nnef_kv_ggml_sdpa",
     [dict(key_type="q8_0", value_type="q8_0", residual=4), dict(key_type="q4_0", value_type="q8_0"),
      dict(key_type="q5_1", value_type="q5_1")]),
    ("hf", dict(), "nnef_kv_hf_quantized_sdpa",  # HF's defaults
     [dict(bits=4, group_size=64, residual=128, axis_key=0, axis_value=0, backend="quanto")] * 3),
    ("hf", dict(backend="hqq", layer_bits="1:2", axis_key=1), "nnef_kv_hf_quantized_sdpa",
     [dict(bits=4, backend="hqq", axis_key=1), dict(bits=2), dict(bits=4)]),
    ("kivi", dict(layer_bits="8,4/2,2", key_axis="token"), "nnef_kv_kivi_sdpa",
     [dict(bits=8, value_bits=0, key_axis="token"), dict(bits=4, value_bits=2), dict(bits=2, value_bits=0)]),
    ("kivi", dict(bits=4, value_bits=2), "nnef_kv_kivi_sdpa", [dict(bits=4, value_bits=2)] * 3),
    ("kivi", dict(bits=4, key_bits=8), "nnef_kv_kivi_sdpa", [dict(bits=8, value_bits=4)] * 3),
    ("tract-cache", dict(layer_bits="8/4,4,8"), "tract_transformers_quantized_dyn_kv_cache",
     [dict(bits=8, per_channel=1), dict(bits=4, per_channel=0), dict(bits=4, per_channel=1),
      dict(bits=4, per_channel=0), dict(bits=8, per_channel=1), dict(bits=8, per_channel=0)]),
]


@pytest.mark.parametrize("scheme,options,op,want", CASES)
def test_attributes_per_layer_and_the_converted_decoder_runs(model, scheme, options, op, want):
    conv, rep = convert(model, scheme=scheme, **options)
    nodes = _kv_nodes(conv, op)
    if op.startswith("tract"):  # caches in graph order: layer by layer, keys and values
        nodes = sorted(nodes, key=lambda n: (n.name.rsplit("_", 1)[-1], "value" in n.name))
    assert len(nodes) == len(want)
    for node, w in zip(nodes, want):
        for k, v in w.items():
            assert node.attrs.get(k, 0) == v, (node.name, k, node.attrs)
    out = conv.session().run({"input_ids": np.array([[1, 2, 3, 4, 5, 6, 7, 8]], np.int64)})
    assert np.isfinite(out["outputs"]).all()


@pytest.mark.parametrize("scheme,options,message", [
    ("kivi", dict(layer_bits="8,4"), "option layer_bits='8,4': 2 entries for 3 attention layers"),
    ("kivi", dict(layer_bits="5:4"), "option layer_bits='5:4': layer 5 named, the graph has 3 attention layers"),
    ("hf", dict(layer_bits="4/2,4,4"), "option layer_bits='4/2,4,4': entry '4/2': KEY/VALUE entries are not "
                                       "taken by this scheme"),
    ("hf", dict(layer_bits="3,4,4"), "option layer_bits='3,4,4': entry '3': 3 bits: expected 2, 4"),
    ("ggml", dict(layer_bits="q3_0,q8_0,q8_0"), "option layer_bits='q3_0,q8_0,q8_0': entry 'q3_0': 'q3_0' is not "
                                                "a ggml cache type"),
    ("ggml", dict(key_type="q2_k"), "option key_type='q2_k': expected one of f32, f16, q4_0"),
    ("hf", dict(bits=3), "option bits=3: HF's quanto backend takes 2, 4 bits"),
    ("hf", dict(backend="hqq", axis_key=-1), "option axis_key=-1: HF's hqq backend takes axis 0 or 1"),
    ("hf", dict(backend="bnb"), "option backend='bnb': expected 'quanto' or 'hqq'"),
    ("kivi", dict(key_axis="head"), "option key_axis='head': expected 'channel' or 'token'"),
    ("kivi", dict(value_bits=9), "option value_bits=9: 0 (= bits) or 1..8"),
    ("kivi", dict(layer_bits="8,4:2"), "not both"),
    ("tract-cache", dict(layer_bits="8,2,8"), "entry '2': 2 bits: expected 4, 8"),
])
def test_refusals_are_one_line_naming_the_option(model, scheme, options, message):
    with pytest.raises(ConversionError) as exc:
        convert(model, scheme=scheme, **options)
    assert "\n" not in str(exc.value) and message in str(exc.value), str(exc.value)


def test_ggml_refuses_a_head_size_that_is_not_whole_blocks():
    m = build_decoder(DecoderConfig(vocab=64, hidden=32, layers=1, heads=2, kv_heads=1, head_dim=16, mlp=32))
    with pytest.raises(ConversionError, match="scheme ggml: the converted graph cannot run .*not a multiple of 32"):
        convert(m, scheme="ggml")  # at convert time, as the op would at run time (issue 23.1)


def test_bits_text_and_report_settings():
    assert S.scheme("ggml").bits_text(S.GgmlOptions("q4_0", "q8_0")) == "q4_0/q8_0"
    assert S.scheme("kivi").bits_text(S.KiviOptions(bits=4, value_bits=2)) == "4/2"
    assert S.scheme("kivi").bits_text(S.KiviOptions(layer_bits="8,4")) == "per layer 8,4"
    assert S.scheme("hf").bits_text(S.HfOptions()) == "4"
    assert S.report_settings("nnef_kv_hf_quantized_sdpa", dict(bits=4, group_size=64, residual=128, axis_key=0,
                                                               axis_value=0, backend="quanto", scale=0.1)) == \
        "bits 4, group_size 64, residual 128, axis_key 0, axis_value 0, backend quanto"


def test_cli_offers_the_new_schemes_and_flags():
    from nnef_kv.cli import build_parser
    import argparse

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    flags = {o for a in sub.choices["convert"]._actions for o in a.option_strings}
    assert {"--key-type", "--value-type", "--group-size", "--backend", "--axis-key", "--axis-value", "--key-bits",
            "--value-bits", "--key-axis", "--layer-bits"} <= flags


@pytest.mark.parametrize("scheme,options", [
    ("ggml", dict(key_type="q4_0", value_type="q8_0")), ("ggml", dict(key_type="q5_1", residual=8)),
    ("hf", dict(bits=4, group_size=32, residual=8)), ("hf", dict(bits=2, backend="hqq", axis_key=1, axis_value=1,
                                                                   group_size=16, residual=5)),
    ("kivi", dict(bits=4, value_bits=2, key_group=8, value_group=8, residual=8)),
    ("kivi", dict(bits=3, key_axis="token", key_group=8, value_group=8, residual=4, layer_bits="8,2/4,3")),
])
def test_session_stepwise_equals_one_token_runs(model, scheme, options):
    """Whole decoders under the new schemes: a stepwise run answers as one-token runs, and leaves the
    same state (within the rounding of a batched weight product). The ops are exact on equal inputs
    (their own tests); here a stepwise run computes K and V for all its tokens in one weight product,
    whose last bits may differ from one-token runs', and a value on a rounding edge then lands one code
    apart: at 4 bits and below one code is a sizeable step, so the logits are held to the change such
    flips make (at most 1% of the codes differ), the KIVI op (which reads the newest tokens exactly) to
    1e-5."""
    from nnef_kv.validate.decode import InterpreterDecoder

    conv, _ = convert(model, scheme=scheme, **options)
    ids = [int(i) for i in np.random.default_rng(7).integers(0, 64, 60)]
    one = InterpreterDecoder(conv)
    want = np.stack([one(np.asarray(ids[:12]))] + [one(np.asarray([t])) for t in ids[12:]])
    step = InterpreterDecoder(conv)
    first = step(np.asarray(ids[:12]))
    out = step.session.run({step.sig.ids_input: np.asarray(ids[12:], np.int64)[None]}, stepwise=True)
    lg = np.asarray(out[step.sig.logits_output]).reshape(-1, 64)
    got = np.concatenate([first[None], lg])
    assert got.shape == want.shape == (49, 64)
    tol = 1e-5 if scheme == "kivi" else 1e-4
    assert np.abs(got - want).max() <= tol * np.abs(want).max()
    assert_states_close(one.session.states, step.session.states)
