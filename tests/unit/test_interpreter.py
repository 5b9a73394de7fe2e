"""Graph building and planning: argument binding, literals, operators, attribute expressions, symbols,
fragments, constant folding, and the error paths (unknown op, bad inputs, inconsistent symbols)."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import nnef_kv
from nnef_kv.errors import GraphError, InputError, UnknownOpError


def model_of(text: str, tensors: dict[str, np.ndarray] | None = None) -> Any:
    from nnef_kv.io.archive import Model

    return Model(nnef_kv.parse(text, filename="t/graph.nnef"), dict(tensors or {}), source="t")


def run(text: str, tensors: dict[str, np.ndarray] | None = None, **inputs: Any) -> dict[str, np.ndarray]:
    return model_of(text, tensors).session().run(inputs)


X = np.arange(6, dtype=np.float32).reshape(2, 3) - 2.5


def test_argument_binding_follows_tract() -> None:
    text = """version 1.0;
fragment f(a: tensor<scalar>, b: scalar = 1.0, c: scalar = 2.0) -> (y: tensor<scalar>) { y = a * b + c; }
graph g(x) -> (p, q, r, s)
{
  x = external<scalar>(shape = [2, 3]);
  p = f(x, 3.0, c = 5.0);
  q = f(c = 5.0, a = x, b = 4.0);
  r = f(x, c = 5.0, 3.0);
  s = f(x, unknown = 7.0);
}
"""
    out = run(text, x=X)
    np.testing.assert_allclose(out["p"], X * 3 + 5)
    np.testing.assert_allclose(out["q"], X * 4 + 5)
    np.testing.assert_allclose(out["r"], X * 1 + 5)  # positional after a named one is not used: default b
    np.testing.assert_allclose(out["s"], X * 1 + 2)  # unknown named argument ignored


def test_binary_and_unary_ops_take_operands_by_position_like_tract() -> None:
    text = """version 1.0;
graph g(x, z) -> (a, b, c)
{
  x = external<scalar>(shape = [2, 3]);
  z = external<scalar>(shape = [2, 3]);
  a = add(x = x, 1.0);
  b = sub(y = x, x = z);
  c = exp(y = x);
}
"""
    z = np.full((2, 3), 10.0, np.float32)
    out = run(text, x=X, z=z)
    np.testing.assert_allclose(out["a"], X + 1)
    np.testing.assert_allclose(out["b"], X - z)  # written order, names ignored
    np.testing.assert_allclose(out["c"], np.exp(X), rtol=1e-6)


def test_literals_integer_is_i64_decimal_is_f32() -> None:
    text = """version 1.0;
graph g(n, x) -> (a, b, c)
{
  n = external<integer>(shape = [2]);
  x = external<scalar>(shape = [2]);
  a = add(n, 1);
  b = add(x, 1.5);
  c = [[1.0, 2.0]];
}
"""
    out = run(text, n=np.array([3, 4], np.int64), x=np.array([0.5, 1.0], np.float32))
    assert out["a"].dtype == np.int64 and out["a"].tolist() == [4, 5]
    assert out["b"].dtype == np.float32 and out["b"].tolist() == [2.0, 2.5]
    assert out["c"].dtype == np.float32 and out["c"].shape == (1, 2)


def test_operators_on_tensors_and_attributes() -> None:
    text = """version 1.0;
graph g(x) -> (a, b, c, d, e)
{
  x = external<scalar>(shape = [2, 3]);
  a = (x + 1.0) * 2.0 - x / 4.0;
  b = -x ^ 2.0;
  c = select(x > 0.0 && x < 2.0, x, 0.0);
  d = (!(x >= 0.0)) || x == 0.5;
  e = sum_reduce(x, axes = [2 - 1]);
}
"""
    out = run(text, x=X)
    np.testing.assert_allclose(out["a"], (X + 1) * 2 - X / 4)
    np.testing.assert_allclose(out["b"], -(X ** 2))
    np.testing.assert_allclose(out["c"], np.where((X > 0) & (X < 2), X, 0))
    np.testing.assert_array_equal(out["d"], ~(X >= 0) | (X == 0.5))
    np.testing.assert_allclose(out["e"], X.sum(axis=1, keepdims=True))


def test_attribute_expressions_if_comprehension_subscript() -> None:
    text = """version 1.0;
fragment pick(x: tensor<scalar>, ax: integer[]) -> (y: tensor<scalar>)
{
  n = length_of(ax);
  axes = [for i in ax yield i + 1] if n > 0 else [0];
  y = sum_reduce(x, axes = [axes[0] - 1]);
}
graph g(x) -> (a, b)
{
  x = external<scalar>(shape = [2, 3]);
  a = pick(x, ax = [1]);
  b = pick(x, ax = [0, 1]);
}
"""
    out = run(text, x=X)
    np.testing.assert_allclose(out["a"], X.sum(axis=1, keepdims=True))
    np.testing.assert_allclose(out["b"], X.sum(axis=0, keepdims=True))


def test_document_fragment_wins_over_primitive() -> None:
    text = """version 1.0;
fragment relu(x: tensor<scalar>) -> (y: tensor<scalar>) { y = x * 10.0; }
graph g(x) -> (y) { x = external<scalar>(shape = [2, 3]); y = relu(x); }
"""
    np.testing.assert_allclose(run(text, x=X)["y"], X * 10)


def test_reassignment_shadows_and_lazy_attributes_keep_their_binding() -> None:
    text = """version 1.0;
extension tract_registry tract_core;
graph g(x) -> (y, z)
{
  x = external<scalar>(shape = [2, 3]);
  s = tract_core_shape_of(x);
  d = squeeze(slice(s, axes = [0], begin = [1], end = [2]), axes = [0]);
  y = reshape(x, shape = [d, -1]);
  d = 2;
  z = reshape(x, shape = [d, -1]);
}
"""
    out = run(text, x=X)
    assert out["y"].shape == (3, 2)  # d read at run time from the shape tensor: 3
    assert out["z"].shape == (2, 3)


def test_symbols_from_input_shapes() -> None:
    text = """version 1.0;
extension tract_symbol S;
graph g(a, b, c) -> (y, t)
{
  a = external<scalar>(shape = [1, S]);
  b = external<scalar>(shape = [1, S + 2]);
  c = external<scalar>(shape = [2 * S]);
  y = concat([a, slice(b, axes = [1], begin = [0], end = [S])], axis = 0);
  t = tile(a, repeats = [S, 1]);
}
"""
    m = model_of(text)
    s = m.session()
    out = s.run({"a": np.ones((1, 3), np.float32), "b": np.zeros((1, 5), np.float32),
                 "c": np.zeros(6, np.float32)})
    assert out["y"].shape == (2, 3)
    assert out["t"].shape == (3, 3)
    out = s.run({"a": np.ones((1, 2), np.float32), "b": np.zeros((1, 4), np.float32),
                 "c": np.zeros(4, np.float32)})
    assert out["t"].shape == (2, 2)
    with pytest.raises(InputError, match=r"input 'b'.*S \+ 2"):
        s.run({"a": np.ones((1, 2), np.float32), "b": np.zeros((1, 5), np.float32), "c": np.zeros(4, np.float32)})


def test_symbol_bound_inconsistently_by_two_inputs() -> None:
    text = """version 1.0;
extension tract_symbol S;
graph g(a, b) -> (y)
{
  a = external<scalar>(shape = [S, 2]);
  b = external<scalar>(shape = [S, 2]);
  y = add(a, b);
}
"""
    s = model_of(text).session()
    with pytest.raises(InputError, match=r"symbol S is 3 from input 'a' but 4 from input 'b'"):
        s.run({"a": np.zeros((3, 2), np.float32), "b": np.zeros((4, 2), np.float32)})


GRAPH = """version 1.0;
graph g(x, n) -> (y)
{
  x = external<scalar>(shape = [2, 3]);
  n = external<integer>(shape = [2]);
  y = exp(x);
}
"""


def test_input_errors_name_the_input() -> None:
    s = model_of(GRAPH).session()
    n = np.zeros(2, np.int64)
    with pytest.raises(InputError, match="missing input 'x'"):
        s.run({"n": n})
    with pytest.raises(InputError, match=r"input 'x' has shape \[2, 4\]"):
        s.run({"x": np.zeros((2, 4), np.float32), "n": n})
    with pytest.raises(InputError, match=r"input 'x' has rank 1"):
        s.run({"x": np.zeros(6, np.float32), "n": n})
    with pytest.raises(InputError, match=r"input 'x' has dtype float64"):
        s.run({"x": np.zeros((2, 3)), "n": n})
    with pytest.raises(InputError, match=r"input 'n' has dtype int32"):
        s.run({"x": np.zeros((2, 3), np.float32), "n": n.astype(np.int32)})
    with pytest.raises(InputError, match="unknown input 'z'"):
        s.run({"x": np.zeros((2, 3), np.float32), "n": n, "z": n})


def test_nan_passes_through_a_graph() -> None:
    s = model_of(GRAPH).session()
    x = np.full((2, 3), np.nan, np.float32)
    y = s.run({"x": x, "n": np.zeros(2, np.int64)})["y"]
    assert np.isnan(y).all()


def test_unknown_op_raises_at_session_creation_with_location() -> None:
    text = """version 1.0;
graph g(x) -> (y)
{
  x = external<scalar>(shape = [2]);
  y = frobnicate(x, k = 3);
}
"""
    m = model_of(text)
    with pytest.raises(UnknownOpError, match=r"t/graph\.nnef:5:7: unknown operation 'frobnicate' \(node 'y'\)"):
        m.session()


def test_variables_constant_folding_and_pretransposed_weights() -> None:
    w = np.arange(12, dtype=np.float32).reshape(4, 3) / 7
    b = np.arange(4, dtype=np.float32).reshape(1, 4)
    text = """version 1.0;
graph g(x) -> (y, z)
{
  x = external<scalar>(shape = [2, 3]);
  w = variable<scalar>(label = 'w', shape = [4, 3]);
  b = variable<scalar>(label = 'bias', shape = [1, 4]);
  w1 = unsqueeze(w, axes = [0]);
  y = linear(x, w1, b);
  z = matmul(x, w, transposeB = true);
}
"""
    m = model_of(text, {"w": w, "bias": b})
    s = m.session()
    assert s.plan.info["folded"] >= 1  # the unsqueeze of a constant
    out = s.run({"x": X})
    np.testing.assert_allclose(out["y"], X @ w.T + b, rtol=1e-6)
    np.testing.assert_allclose(out["z"], X @ w.T, rtol=1e-6)
    assert m.session().plan is s.plan  # planned once per model


def test_products_of_one_input_by_constant_weights_are_fused() -> None:
    rng = np.random.default_rng(3)
    ws = {n: rng.standard_normal((1, o, 8)).astype(np.float32) for n, o in (("wq", 8), ("wk", 4), ("wv", 4), ("wo", 5))}
    bias = rng.standard_normal((1, 5)).astype(np.float32)
    text = """version 1.0;
graph g(x) -> (q, k, v, o, p)
{
  x = external<scalar>(shape = [1, S, 8]);
  wq = variable<scalar>(label = 'wq', shape = [1, 8, 8]);
  wk = variable<scalar>(label = 'wk', shape = [1, 4, 8]);
  wv = variable<scalar>(label = 'wv', shape = [1, 4, 8]);
  wo = variable<scalar>(label = 'wo', shape = [1, 5, 8]);
  b = variable<scalar>(label = 'b', shape = [1, 5]);
  q = matmul(x, wq, transposeA = false, transposeB = true);
  h = exp(q);
  k = matmul(x, wk, transposeA = false, transposeB = true);
  v = matmul(x, wv, transposeA = false, transposeB = true);
  o = linear(x, wo, b);
  p = matmul(h, wo, transposeA = false, transposeB = true);
}
"""
    s = model_of(text, {**ws, "b": bias}).session()
    assert s.plan.info["fused_projections"] == 2  # k and v join q; the biased linear and p (input h) do not
    assert s.plan.info["steps"] == s.plan.info["nodes"] - 2
    for n in (1, 5):
        x = rng.standard_normal((1, n, 8)).astype(np.float32)
        out, caps = s.run({"x": x}, capture=["k"])
        for name in ("q", "k", "v"):
            np.testing.assert_allclose(out[name], x @ ws["w" + name][0].T, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(caps["k"], out["k"])
        np.testing.assert_allclose(out["o"], x @ ws["wo"][0].T + bias, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out["p"], np.exp(out["q"]) @ ws["wo"][0].T, rtol=1e-5, atol=1e-5)


def test_missing_variable_and_wrong_variable_shape() -> None:
    text = """version 1.0;
graph g(x) -> (y)
{
  x = external<scalar>(shape = [2]);
  w = variable<scalar>(label = 'w', shape = [2]);
  y = add(x, w);
}
"""
    with pytest.raises(GraphError, match="no tensor 'w'"):
        model_of(text).session()
    with pytest.raises(GraphError, match=r"tensor 'w' has shape \[3\], declared \[2\]"):
        model_of(text, {"w": np.zeros(3, np.float32)}).session()


def test_array_results_split_into_names() -> None:
    text = """version 1.0;
graph g(x) -> (a, b, m)
{
  x = external<scalar>(shape = [2, 4]);
  [a, b] = split(x, axis = 1, ratios = [1, 1]);
  m, v = moments(x, axes = [1]);
}
"""
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    out = run(text, x=x)
    np.testing.assert_array_equal(out["a"], x[:, :2])
    np.testing.assert_array_equal(out["b"], x[:, 2:])
    np.testing.assert_allclose(out["m"], x.mean(axis=1, keepdims=True))


def test_outputs_in_graph_order_and_runs_repeatable() -> None:
    text = """version 1.0;
graph g(x) -> (z, a)
{ x = external<scalar>(shape = [2, 3]); a = exp(x); z = neg(x); }
"""
    s = model_of(text).session()
    o1 = s.run({"x": X})
    o2 = s.run({"x": X})
    assert list(o1) == ["z", "a"]
    np.testing.assert_array_equal(o1["a"], o2["a"])


SUBMODEL_OUTER = """version 1.0;
extension tract_registry tract_core;
graph g(x) -> (y)
{{
  x = external<scalar>(shape = [2, 3]);
  y = tract_core_submodel([x], label = {label});
}}
"""
SUBMODEL_INNER = "version 1.0;\ngraph g(x) -> (y) { x = external<scalar>(shape = [2, 3]); y = neg(x); }\n"


@pytest.mark.parametrize("label", ["../evil", "ABS", "inner/../../evil", ".", "inner/x", "1"])
def test_submodel_label_cannot_leave_the_model(tmp_path: Any, label: str) -> None:
    """``tract_core_submodel(label = ...)`` is resolved as ``source / label``: a label escaping the model's
    folder (absolute, ``..``, separators) is refused with a GraphError naming it, although the target exists."""
    (tmp_path / "model" / "inner").mkdir(parents=True)
    (tmp_path / "evil").mkdir()
    (tmp_path / "model" / "inner" / "graph.nnef").write_text(SUBMODEL_INNER)
    (tmp_path / "evil" / "graph.nnef").write_text(SUBMODEL_INNER)
    if label == "ABS":
        label = str(tmp_path / "evil")
    text_label = label if label == "1" else '"' + label + '"'
    (tmp_path / "model" / "graph.nnef").write_text(SUBMODEL_OUTER.format(label=text_label))
    with pytest.raises(GraphError, match="label") as info:
        nnef_kv.load(tmp_path / "model").session()
    assert "tract_core_submodel 'y'" in str(info.value)
    if label != "1":
        assert repr(label) in str(info.value)
    # the loader refuses such labels by itself too (it is reachable without the builder's check)
    model = nnef_kv.load(tmp_path / "model", check=False)
    with pytest.raises(GraphError, match="not a plain file name"):
        model.load_submodel(label if label != "1" else "..")


def test_submodel_with_a_plain_label_runs(tmp_path: Any) -> None:
    (tmp_path / "model" / "inner").mkdir(parents=True)
    (tmp_path / "model" / "inner" / "graph.nnef").write_text(SUBMODEL_INNER)
    (tmp_path / "model" / "graph.nnef").write_text(SUBMODEL_OUTER.format(label='"inner"'))
    out = nnef_kv.load(tmp_path / "model").session().run({"x": X})
    np.testing.assert_array_equal(out["y"], -X)
