"""Converter passes on small graphs written in the test, option checks, refusals, and the
dyn-cache pass on tract's own decoder export (shared conformance corpus)."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import CONFORMANCE, requires_shared, requires_tract

import nnef_kv
from nnef_kv import ConversionError
from nnef_kv.converters import convert
from nnef_kv.io.archive import Model

HEAD = """version 1.0;
extension tract_registry tract_core;
extension tract_symbol S;
extension tract_symbol P;
"""


def attention_graph(*, qk: str = "s = matmul(x, ok, transposeB = true);", scale: str = "ss = div(s, 2.0);",
                    repeat: str = "", kname: str = "ok", vname: str = "ov", concat_axis: int = 2,
                    cache: bool = True) -> str:
    """x [1, 2, S, 4] is this call's q = k-source = v-source; the caches are pk/pv [1, 2, P, 4]."""
    if cache:
        sig = "graph g(x, pk, pv) -> (y, ok, ov)"
        caches = f"""  pk = tract_core_external(shape = [1, 2, P, 4], datum_type = 'f32');
  pv = tract_core_external(shape = [1, 2, P, 4], datum_type = 'f32');
  ok = concat([pk, k], axis = {concat_axis});
  ov = concat([pv, v], axis = {concat_axis});
"""
    else:
        sig = "graph g(x) -> (y)"
        caches = "  ok = copy(k);\n  ov = copy(v);\n"
    return HEAD + f"""{sig}
{{
  x = tract_core_external(shape = [1, 2, S, 4], datum_type = 'f32');
  k = mul(x, 0.5);
  v = add(x, 1.0);
{caches}  {repeat}
  {qk}
  {scale}
  p = softmax(ss, axes = [3]);
  y = matmul(p, {vname});
}}
"""


def _run_explicit(model: Model, xs: list[np.ndarray]) -> list[np.ndarray]:
    s = model.session()
    cache = {"pk": np.zeros((1, 2, 0, 4), np.float32), "pv": np.zeros((1, 2, 0, 4), np.float32)}
    out = []
    for x in xs:
        r = s.run(dict(cache, x=x))
        out.append(r["y"])
        cache = {"pk": r["ok"], "pv": r["ov"]}
    return out


def _steps() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.standard_normal((1, 2, 1, 4)).astype(np.float32) for _ in range(5)]


# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("opts,name", [
    (dict(bits=0), "bits"), (dict(bits=9), "bits"), (dict(scheme="tract-cache", bits=6), "bits"),
    (dict(key_group=0), "key_group"), (dict(value_group=0), "value_group"), (dict(residual=-1), "residual"),
    (dict(sinks=-2), "sinks"), (dict(scheme="fp8"), "scheme"), (dict(bits=4.0), "bits"),
])
def test_bad_options_refused_before_any_work(opts, name, tmp_path):
    with pytest.raises(ConversionError, match=f"option {name}="):
        convert(tmp_path / "does-not-exist.nnef.tgz", **opts)  # the path is never opened


def test_no_attention_refused():
    text = HEAD + "graph g(x) -> (y) { x = external(shape = [1, 4]); y = relu(x); }"
    with pytest.raises(ConversionError, match=r"no attention found: looked for attention: q \. K\^T"):
        convert(Model.from_text(text))


def test_attention_without_cache_refused():
    with pytest.raises(ConversionError, match="stopped at node 'x' .*: expected a KV cache: concat"):
        convert(Model.from_text(attention_graph(cache=False)))


def test_head_mapping_other_than_repeat_interleave_refused():
    text = attention_graph(
        repeat="okr = tile(ok, repeats = [1, 2, 1, 1]);\n  ovr = tile(ov, repeats = [1, 2, 1, 1]);",
        qk="xq = tile(x, repeats = [1, 2, 1, 1]);\n  s = matmul(xq, okr, transposeB = true);",
        vname="ovr",
    )
    with pytest.raises(ConversionError, match="only the grouped-query repeat"):
        convert(Model.from_text(text))


def test_cache_on_other_axis_refused():
    with pytest.raises(ConversionError, match="concatenates on axis 1"):
        convert(Model.from_text(attention_graph(concat_axis=1)))


@pytest.mark.parametrize(
    "variant",
    [
        dict(),  # transposeB, div scale, no mask
        dict(qk="kt = transpose(ok, axes = [0, 1, 3, 2]);\n  s = matmul(x, kt);", scale="ss = mul(s, 0.5);"),
        dict(
            repeat="u = unsqueeze(ok, axes = [2]);\n  t = tile(u, repeats = [1, 1, 1, 1, 1]);\n"
                   "  okr = reshape(t, shape = [1, 2, -1, 4]);",
            qk="s = matmul(x, okr, transposeB = true);",
        ),
    ],
)
def test_explicit_cache_pass_kivi_is_exact_without_quantization(variant):
    original = Model.from_text(attention_graph(**variant))
    before = original.document
    model, report = convert(original, scheme="kivi", bits=8, residual=64)
    assert original.document == before  # the input model is not modified
    assert list(model.document.graph.inputs) == ["x"] and list(model.document.graph.outputs) == ["y"]
    assert report.inputs_removed == ["pk", "pv"] and report.outputs_removed == ["ok", "ov"]
    (inv,) = [st.rhs for st in model.document.graph.body if getattr(st.rhs, "name", "") == "nnef_kv_kivi_sdpa"]
    named = inv.named()
    assert named["scale"].value == pytest.approx(0.5)
    assert named["is_causal"].value is False  # no mask in the original: not causal
    xs = _steps()
    ref = _run_explicit(original, xs)
    s = model.session()
    got = [s.run({"x": x})["y"] for x in xs]
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_tract_cache_scheme_keeps_attention_and_quantizes_caches():
    model, report = convert(Model.from_text(attention_graph()), scheme="tract-cache", bits=8)
    body = {st.lhs.name: st.rhs for st in model.document.graph.body}
    for name, per_channel in (("ok", 1), ("ov", 0)):
        inv = body[name]
        assert inv.name == "tract_transformers_quantized_dyn_kv_cache"
        n = inv.named()
        assert n["bits"].value == 8 and n["per_channel"].value == per_channel and n["axis"].value == 2
        assert nnef_kv.grammar.dump_expr(n["past_sequence_shape"]) == "[1, 2, P, 4]"
        assert nnef_kv.grammar.dump_expr(n["input_sequence_shape"]) == "[1, 2, S, 4]"
    assert body["p"].name == "softmax"
    xs = _steps()
    s = model.session()
    got = [s.run({"x": x})["y"] for x in xs]
    ref = _run_explicit(Model.from_text(attention_graph()), xs)
    worst = max(float(np.abs(a - b).max()) for a, b in zip(got, ref))
    assert 0 < worst < 0.05  # 8-bit quantized caches: close, not identical


def test_reassigned_names_are_normalized():
    text = attention_graph().replace("  k = mul(x, 0.5);", "  k = mul(x, 0.25);\n  k = mul(x, 0.5);")
    model, report = convert(Model.from_text(text), scheme="kivi", residual=64)
    assert any("re-assigned" in n for n in report.notes)
    xs = _steps()
    ref = _run_explicit(Model.from_text(text), xs)
    s = model.session()
    for x, r in zip(xs, ref):
        np.testing.assert_allclose(s.run({"x": x})["y"], r, atol=1e-6)


def test_report_text_lists_passes():
    _, report = convert(Model.from_text(attention_graph()), scheme="tract")
    text = report.to_text()
    assert "scheme tract" in text and "attention:" in text and "inputs removed: pk, pv" in text
    assert "ignored" not in text  # bits tract's op would ignore are refused instead (issue 13 item 8)
    with pytest.raises(ConversionError, match="bits=4: scheme tract stores 8-bit codes"):
        convert(Model.from_text(attention_graph()), scheme="tract", bits=4)


# ----------------------------------------------------------------------------------------------
TRACT_WRITTEN = CONFORMANCE / "tract-python-written" / "tiny-llama-gqa-kv-f32"


@requires_shared
def test_dyn_cache_pass_on_tract_export():
    """tract_transformers_dyn_kv_cache + tract_transformers_sdpa -> fused op (tract's own export)."""
    original = nnef_kv.load(TRACT_WRITTEN)
    toks = [5, 17, 3, 42, 8, 9, 11]
    s0 = original.session()
    ref = [s0.run({"input_0": np.array([[t]], np.int64)})["output_0"] for t in toks]
    model, report = convert(original, scheme="kivi", bits=8)
    assert len(report.attentions) == 1 and report.attentions[0].startswith("sdpa attention")
    ops = [getattr(st.rhs, "name", None) for st in model.document.graph.body]
    assert "tract_transformers_sdpa" not in ops and ops.count("tract_transformers_dyn_kv_cache") == 1  # positions
    s = model.session()
    got = [s.run({"input_0": np.array([[t]], np.int64)})["output_0"] for t in toks]
    worst = max(float(np.abs(a - b).max()) for a, b in zip(got, ref))
    assert worst < 1e-5, worst  # residual 32 > 7 tokens: nothing quantized


@requires_shared
@requires_tract
def test_dyn_cache_pass_tract_scheme_matches_tract(tmp_path):
    from nnef_kv import tract_driver

    model, _ = convert(TRACT_WRITTEN, scheme="tract")
    path = tmp_path / "fused.nnef.tgz"
    nnef_kv.save(model, path)
    toks = [5, 17, 3, 42, 8, 9, 11]
    s = model.session()
    ours = [s.run({"input_0": np.array([[t]], np.int64)})["output_0"] for t in toks]
    state = tract_driver.Stateful(path)
    theirs = [state.run_first([np.array([[t]], np.int64)]) for t in toks]
    worst = max(float(np.abs(a - b).max()) for a, b in zip(ours, theirs))
    assert worst < 1e-4, worst


@requires_shared
def test_dyn_cache_pass_tract_cache_scheme():
    model, report = convert(TRACT_WRITTEN, scheme="tract-cache", bits=4)
    ops = [getattr(st.rhs, "name", None) for st in model.document.graph.body]
    assert ops.count("tract_transformers_quantized_dyn_kv_cache") == 2 and "tract_transformers_sdpa" in ops
    body = {st.lhs.name: st.rhs for st in model.document.graph.body if hasattr(st.lhs, "name")}
    assert body["input_1"].named()["per_channel"].value == 1 and body["input_2"].named()["per_channel"].value == 0
    s = model.session()
    out = [s.run({"input_0": np.array([[t]], np.int64)})["output_0"] for t in (5, 17, 3)]
    assert all(np.all(np.isfinite(o)) for o in out)


@pytest.mark.parametrize("scheme", ["kivi", "tract", "tract-cache"])
def test_already_converted_graph_refused(scheme):
    model, _ = convert(Model.from_text(attention_graph()), scheme=scheme, bits=8)
    with pytest.raises(ConversionError, match="already holds a quantized KV cache"):
        convert(model, scheme="kivi")


# -- attention recognised by what it computes -------------------------------------------------------
def _kivi_vs_source(text: str, **kw) -> tuple[list[np.ndarray], list[np.ndarray], object]:
    src = Model.from_text(text)
    conv, report = convert(src, scheme="kivi", bits=8, key_group=1, value_group=4, residual=64, **kw)
    want = _run_explicit(src, _steps())
    s = conv.session()
    got = [s.run({"x": x})["y"] for x in _steps()]
    return got, want, report


def test_einsum_attention_with_casts_converts():
    """q.K^T and p.V as tract_core_einsum (both K layouts), through f32 casts, as torch-to-nnef writes f16
    attention accumulated in f32; the residual window holds every token, so the op is exact."""
    for qk in ("kt = transpose(ok, axes = [0, 1, 3, 2]);\n  xa = tract_core_cast(x, to = 'f32');\n  "
               "kb = tract_core_cast(kt, to = 'f32');\n  "
               "s = tract_core_einsum([xa, kb], expr = 'bcij,bcjk->bcik', acc = 'f32', output = 'f32');",
               "s = tract_core_einsum([x, ok], expr = 'bcij,bckj->bcik', acc = 'f32');"):
        text = attention_graph(qk=qk).replace("y = matmul(p, ov);",
                                              "y = tract_core_einsum([p, ov], expr = 'bcij,bcjk->bcik', acc = 'f32');")
        got, want, report = _kivi_vs_source(text)
        assert report.attentions[0].startswith("einsum attention")
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_softcapped_scores_convert_to_kivi_softcap():
    text = attention_graph(scale="s1 = mul(s, 0.5);\n  s2 = div(s1, 3.0);\n  s3 = tanh(s2);\n  ss = mul(s3, 3.0);")
    got, want, report = _kivi_vs_source(text)
    assert "softcap 3" in report.attentions[0]
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ConversionError, match=r"softcapped \(tanh, cap 3\) and tract_transformers_quantized_kv_sdpa "
                                              r"has no softcap: use --scheme kivi"):
        convert(Model.from_text(text), scheme="tract")
    tc, _ = convert(Model.from_text(text), scheme="tract-cache", bits=8)  # the caches only: any attention
    assert [n for n in nnef_kv.dump(tc.document).split("\n") if "tanh(" in n]


def test_unrecognisable_attention_names_the_node_and_the_form(tmp_path, capsys):
    text = attention_graph(scale="ss = exp(s);")
    with pytest.raises(ConversionError, match=r"recognition of the attention around 'p' stopped at node 'ss' \(exp\): "
                                              r"expected a cast, a constant scale \(mul/div by a scalar\), tanh "
                                              r"softcapping or an additive mask"):
        convert(Model.from_text(text))
    text = attention_graph(scale="t = mul(s, x);\n  ss = add(t, 1.0);")
    with pytest.raises(
        ConversionError,
        match=r"stopped at node 't' \(mul\): expected .*a mul by a tensor that is not a "
        r"scalar constant",
    ):
        convert(Model.from_text(text))
    from nnef_kv.cli import main

    path = tmp_path / "odd.nnef.tar"
    nnef_kv.save(Model.from_text(attention_graph(scale="ss = exp(s);")), path)
    assert main(["convert", str(path), "-o", str(tmp_path / "out.nnef.tar")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "stopped at node 'ss' (exp)" in err and not (tmp_path / "out.nnef.tar").exists()


def test_a_bias_on_the_scores_is_refused_by_fused_schemes_only():
    text = attention_graph(scale="ss = add(s, 0.5);")
    with pytest.raises(ConversionError, match=r"attention 'y': its scores go through 'ss' \(adds the constant 0.5\)"):
        convert(Model.from_text(text), scheme="kivi")
    convert(Model.from_text(text), scheme="tract-cache", bits=8)


def test_attention_inside_a_document_fragment_is_inlined():
    frag = """
fragment my_attention(q: tensor<scalar>, k: tensor<scalar>, v: tensor<scalar>, c: tensor<scalar>)
-> (out: tensor<scalar>)
{
  s = tract_core_einsum(inputs = [q, k], expr = "bcij,bckj->bcik", acc = "f32");
  p = softmax(mul(s, c) + 0.0 * c, axes = [3]);
  out = tract_core_einsum(inputs = [p, v], expr = "bcij,bcjk->bcik", acc = "f32");
}
"""
    text = attention_graph(qk="y = my_attention(x, ok, ov, 0.5);", scale="")
    body = text.split("  p = softmax(ss, axes = [3]);\n  y = matmul(p, ov);\n")
    text = body[0].replace("extension tract_symbol P;\n", "extension tract_symbol P;\n" + frag) + body[1]
    src = Model.from_text(text)
    conv, report = convert(src, scheme="kivi", bits=8, key_group=1, value_group=4, residual=64)
    assert any("inlined" in n for p in report.passes for n in p.notes)
    want = _run_explicit(src, _steps())
    s = conv.session()
    for x, w in zip(_steps(), want):
        np.testing.assert_allclose(s.run({"x": x})["y"], w, rtol=1e-5, atol=1e-6)


def test_sdpa_over_explicit_caches_converts():
    """--reify-sdpa-operator's form: tract_transformers_sdpa reading concat([cache input, new]) whose shape
    the graph reads afterwards (the attention output's reshape)."""
    text = HEAD + """graph g(x, pk, pv) -> (y, ok, ov)
{
  x = tract_core_external(shape = [1, 2, S, 4], datum_type = 'f32');
  pk = tract_core_external(shape = [1, 2, P, 4], datum_type = 'f32');
  pv = tract_core_external(shape = [1, 2, P, 4], datum_type = 'f32');
  k = mul(x, 0.5);
  v = add(x, 1.0);
  ok = concat([pk, k], axis = 2);
  ov = concat([pv, v], axis = 2);
  a = tract_transformers_sdpa(x, ok, ov, is_causal = true, scale = 0.5);
  ov_shape = tract_core_shape_of(ov);
  ov_d3 = squeeze(slice(ov_shape, axes = [0], begin = [3], end = [4], stride = [1]), axes = [0]);
  y = reshape(a, shape = [1, 2, -1, ov_d3]);
}
"""
    src = Model.from_text(text)
    kivi = dict(key_group=1, value_group=4, residual=64)
    for scheme in ("kivi", "tract", "tract-cache"):
        conv, report = convert(src, scheme=scheme, bits=8, **(kivi if scheme == "kivi" else {}))
        assert conv.session().input_names == ["x"], scheme
        assert report.attentions[0].startswith("sdpa attention")
    got = [s for s in [convert(src, scheme="kivi", bits=8, key_group=1, value_group=4, residual=64)[0].session()]]
    want = _run_explicit(src, _steps())
    for x, w in zip(_steps(), want):
        np.testing.assert_allclose(got[0].run({"x": x})["y"], w, rtol=1e-5, atol=1e-6)
