"""An op is one unit: its registration says everything tools need (positional binding, specialiser,
fresh result, role, description, state interface), and every tool reads the registry instead of a list.

The plug-in property is tested by registering a fake KV op at test time: without touching any other file,
the converter keeps it as a root, the inspector describes it, validation measures its attention, and
``convert`` sees it holds a quantized cache."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import nnef_kv
from nnef_kv.errors import ConversionError, GraphError
from nnef_kv.core import registry as R
from nnef_kv.interpreter.catalog import PRIMITIVES, lookup, ops_with
from nnef_kv.core.registry import NO_CHECKPOINT, KvState, Primitive

#: the binary and unit element-wise ops tract 0.23.9 registers (sonos/tract nnef/src/ops/nnef/mod.rs):
#: their operands bind by position whatever their names
TRACT_POSITIONAL = set(
    "add sub mul div pow eq ne lt gt le ge and or min max exp log sin cos abs neg sign recip tan acos asin atan "
    "cosh sinh acosh asinh atanh floor ceil round square sqrt rsqrt tanh sigmoid not".split())


def test_positional_ops_are_tracts_binary_and_unit_ops() -> None:
    assert ops_with(positional=True) == TRACT_POSITIONAL


def test_every_stateful_op_has_a_kv_state_a_role_and_a_description() -> None:
    lookup("add")
    for name, p in PRIMITIVES.items():
        if p.stateful:
            assert isinstance(p.state_factory, type) and issubclass(p.state_factory, KvState), name
            assert p.role in ("kv-cache", "attention+kv") and p.describe, name
        if p.role in ("kv-cache", "attention+kv"):
            assert p.stateful, name
    assert ops_with(role="kv-cache") >= {"tract_transformers_dyn_kv_cache",
                                          "tract_transformers_quantized_dyn_kv_cache"}
    assert ops_with(role="attention+kv") >= {"nnef_kv_kivi_sdpa", "nnef_kv_ggml_sdpa", "nnef_kv_hf_quantized_sdpa",
                                              "tract_transformers_quantized_kv_sdpa",
                                              "tract_transformers_window_kv_sdpa"}
    assert ops_with(quantized=True) == {"nnef_kv_kivi_sdpa", "nnef_kv_ggml_sdpa", "nnef_kv_hf_quantized_sdpa",
                                        "nnef_kv_rotated_sdpa", "tract_transformers_quantized_kv_sdpa",
                                        "tract_transformers_quantized_dyn_kv_cache"}
    assert ops_with(role="source") == {"external", "variable", "constant", "tract_core_external"}


def test_fresh_result_and_specializers_are_registered_with_their_ops() -> None:
    assert {"tract_core_rms_norm", "tract_core_silu"} <= ops_with(fresh_result=True)
    for name in ("reshape", "transpose", "unsqueeze", "tract_core_rms_norm", "tract_transformers_sdpa"):
        assert lookup(name).specialize is not None, name
    # an alias shares everything its registration says
    assert lookup("tract_transformers_rms_norm").specialize is lookup("tract_core_rms_norm").specialize


def test_a_bad_registration_is_refused() -> None:
    with pytest.raises(GraphError, match="role 'cache'"):
        Primitive("fragment f(x: tensor<scalar>) -> (y: tensor<scalar>);", "nnef", name="f", role="cache")

    class NotAState:
        pass

    with pytest.raises(GraphError, match="not a KvState"):
        Primitive("fragment f(x: tensor<scalar>) -> (y: tensor<scalar>);", "nnef", state_factory=NotAState,
                  name="f")


def test_a_kv_state_must_implement_the_state_interface() -> None:
    class Partial(KvState):
        def __call__(self, x):
            return x

        def reset(self) -> None:
            pass

    with pytest.raises(TypeError, match="abstract"):
        Partial()
    assert not Partial.has_stepwise()


def test_source_arguments_bind_in_their_signature_order(tmp_path: Path) -> None:
    """``tract_core_external(datum_type, shape)``: positional arguments in that order, as tract reads them
    (the builder once read the shape first)."""
    (tmp_path / "graph.nnef").write_text(
        'version 1.0;\nextension tract_registry tract_core;\n'
        'graph g(x) -> (y) {\n  x = tract_core_external("i64", [2, 3]);\n  y = add(x, x);\n}\n')
    spec = nnef_kv.load(tmp_path).session().plan.inputs[0]
    assert np.dtype(spec.dtype) == np.int64 and list(spec.shape) == [2, 3]
    tract = pytest.importorskip("tract")
    assert str(tract.nnef().load(str(tmp_path)).input_fact(0)) == "2,3,i64"


# ----------------------------------------------------------------------------- a KV op as a plug-in
FAKE = "nnef_kv_test_fake_sdpa"


class FakeSdpa(KvState):
    """Keeps every K/V exactly (so attention is exact) but says it is quantized."""

    QUANTIZED = True

    def __init__(self, axis: int = 2) -> None:
        self.k: np.ndarray | None = None
        self.v: np.ndarray | None = None

    def __call__(self, q, k, v):
        from nnef_kv.kv.exact import sdpa_array

        self.k = k if self.k is None else np.concatenate([self.k, k], 2)
        self.v = v if self.v is None else np.concatenate([self.v, v], 2)
        return sdpa_array(q, self.k, self.v, None, is_causal=True)

    def reset(self) -> None:
        self.k = self.v = None

    def state_tensors(self):
        return {} if self.k is None else {"k": self.k, "v": self.v}

    def load_state_tensors(self, tensors) -> None:
        self.k, self.v = tensors.get("k"), tensors.get("v")

    def nbytes(self):
        return {"codes": 0, "params": 0, "full_precision": 0 if self.k is None else self.k.nbytes + self.v.nbytes}

    def checkpoint(self):
        return NO_CHECKPOINT

    def rollback(self, token) -> None:
        raise AssertionError("never called: no checkpoint was taken")

    def census(self):
        n = 0 if self.k is None else self.k.shape[2]
        return {"tokens": n, "quantized": n, "full_precision": 0, "f32_bytes": 0}


@pytest.fixture
def fake_op(monkeypatch: pytest.MonkeyPatch) -> str:
    lookup("add")
    prim = Primitive(f"fragment {FAKE}(q: tensor<scalar>, k: tensor<scalar>, v: tensor<scalar>, axis: integer = 2)"
                     " -> (output: tensor<scalar>);", "nnef_kv", state_factory=FakeSdpa, name=FAKE,
                     role="attention+kv", describe="a test op")
    monkeypatch.setitem(R.PRIMITIVES, FAKE, prim)
    return FAKE


GRAPH = f"""version 1.0;
extension nnef_kv;
graph g(q, k, v) -> (y) {{
  q = external<scalar>(shape = [1, 2, 1, 4]);
  k = external<scalar>(shape = [1, 2, 1, 4]);
  v = external<scalar>(shape = [1, 2, 1, 4]);
  unused = {FAKE}(q, k, v);
  y = add(q, 1.0);
}}
"""


def test_a_registered_kv_op_is_known_to_every_tool(fake_op: str) -> None:
    from nnef_kv.converters import convert
    from nnef_kv.converters.graph_edit import GraphEdit
    from nnef_kv.summary import summarize
    from nnef_kv.validate.capture import fused_attention_ops

    doc = nnef_kv.parse(GRAPH)
    g = GraphEdit(doc)
    assert g.dead_code() == []  # its result is unused, but it holds state: kept
    assert fake_op in fused_attention_ops()
    model = nnef_kv.Model(document=doc, tensors={})
    assert any(op == fake_op and desc.startswith("a test op") for _, op, desc in summarize(model).kv_caches)
    with pytest.raises(ConversionError, match=f"already holds a quantized KV cache \\({fake_op}"):
        convert(model)
    s = model.session()
    rng = np.random.default_rng(0)
    ins = {n: rng.standard_normal((1, 2, 1, 4)).astype(np.float32) for n in "qkv"}
    s.run(ins)
    assert s.kv_cache_bytes()["full_precision"] == 2 * 2 * 4 * 4


def test_the_published_nnef_kv_declarations_are_the_registered_ones() -> None:
    """One way of declaring an op: its signature on its registration. ``nnef_kv/grammar/nnef_kv_ops.nnef``
    publishes the nnef_kv ops' declarations with their documentation; it must declare exactly the registered
    ops with the same parameters (names, types, defaults, order) and results."""
    from nnef_kv.grammar import parse

    published = (Path(nnef_kv.__file__).parent / "grammar" / "nnef_kv_ops.nnef").read_text()
    fragments = {f.name: f for f in parse("version 1.0;\n" + published, filename="nnef_kv_ops.nnef").fragments}
    lookup("add")  # loads every op family
    mine = {name: p for name, p in PRIMITIVES.items() if p.registry == "nnef_kv"}
    assert set(fragments) == set(mine) and len(mine) >= 4

    def declared(f):  # a declaration without its position in its file
        return f.name, f.generic, f.params, f.results

    for name, prim in mine.items():
        registered = parse("version 1.0;\n" + prim.signature, filename=name).fragments[0]
        assert declared(fragments[name]) == declared(registered), name
    # each stateful op's class carries its registration in its own module
    for name, prim in PRIMITIVES.items():
        if prim.stateful:
            assert prim.state_factory.__module__.startswith("nnef_kv.kv."), (name, prim.state_factory.__module__)
