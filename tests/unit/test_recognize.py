"""The one attention recognizer (``nnef_kv/interpreter/plan/recognize.py``) on the interpreter's built graph,
and the three tools that read it agreeing: the converter, validation's capture and the plan's fast path."""
from __future__ import annotations

import numpy as np
import pytest

from nnef_kv.interpreter.builder import build_graph
from nnef_kv.interpreter.plan import recognize as R
from nnef_kv.interpreter.plan.chains import chain_members
from nnef_kv.io.archive import Model
from nnef_kv.models.llama import DecoderConfig, build_decoder
from nnef_kv.validate.capture import attention_step_indices

from test_converters import attention_graph


def _found(text: str) -> tuple[R.View, list[R.Found], list[R.Miss]]:
    w = R.View(build_graph(Model.from_text(text).document))
    return (w, *R.recognize(w))


def test_a_decomposed_attention_over_explicit_caches():
    w, found, misses = _found(attention_graph())
    assert not misses and len(found) == 1
    f = found[0]
    assert (f.kind, f.output.name, f.softmax.name, f.scale, f.mask, f.softcap) == ("plain", "y", "p", 0.5, None, None)
    assert (f.key.kind, w.name(f.key.full), w.name(f.key.past), w.name(f.key.new)) == ("explicit", "ok", "pk", "k")
    assert (w.name(f.value.full), w.name(f.value.new), w.name(f.q)) == ("ov", "v", "x")
    assert [n.name for n in R.attention_outputs(w.graph)] == ["y"]


def test_a_scale_the_graph_computes_is_read_by_the_op_kernels():
    """``div(s, sqrt(c))`` with ``c`` a variable computed from constants: the kernels give 1/2, in f32."""
    text = attention_graph(scale="c = add(3.0, 1.0);\n  r = sqrt(c);\n  ss = div(s, r);")
    _, found, _ = _found(text)
    assert found[0].scale == pytest.approx(0.5) and isinstance(found[0].scale, float)


def test_a_miss_names_the_node_and_what_was_expected():
    _, found, misses = _found(attention_graph(scale="ss = exp(s);"))
    assert not found and [(m.node, m.op, m.around) for m in misses] == [("ss", "exp", "p")]
    assert misses[0].message().startswith("recognition of the attention around 'p' stopped at node 'ss' (exp): "
                                          "expected a cast, a constant scale")


def test_no_cache_is_a_miss_for_the_converter_but_an_attention_for_capture():
    w, found, misses = _found(attention_graph(cache=False))
    assert not found and [(m.node, m.op) for m in misses] == [("x", "tract_core_external")]
    assert [n.name for n in R.attention_outputs(w.graph)] == ["y"]


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_converter_capture_and_plan_see_the_same_attentions(kv_heads: int):
    """The built-in decoder (grouped-query when kv_heads < heads): the recognizer finds one attention a layer;
    validation captures exactly the plan steps the fast path fused, which are the recognizer's outputs."""
    cfg = DecoderConfig(layers=3, heads=4, kv_heads=kv_heads)
    model = build_decoder(cfg)
    graph = build_graph(model.document, model.tensors)
    found, misses = R.recognize(R.View(graph))
    assert not misses and len(found) == cfg.layers
    outputs = [n.name for n in R.attention_outputs(graph)]
    assert outputs == [f.output.name for f in found]
    plan = model.session(threads=1).plan
    fused = [i for i, n in enumerate(plan.step_nodes) if n.op == "attention"]
    assert attention_step_indices(plan) == fused and len(fused) == cfg.layers
    assert [chain_members(plan.step_nodes[i])[-1].name for i in fused] == outputs
    assert all(np.isclose(f.scale, cfg.head_dim ** -0.5) for f in found)


def test_an_op_the_interpreter_cannot_run_is_read_around():
    """The converter builds its graph to read it, not to run it: an unknown op after the attention is an opaque
    node (as before the recognizer moved to the built graph, the archive still converts)."""
    from nnef_kv.converters import convert

    text = attention_graph().replace("  y = matmul(p, ov);\n", "  y0 = matmul(p, ov);\n  y = frobnicate(y0);\n")
    _, report = convert(Model.from_text(text), "kivi", bits=8)
    assert [a.split(" (")[0] for a in report.attentions] == ["plain attention -> 'y0'"]
