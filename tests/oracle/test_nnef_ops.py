"""NNEF standard operations: nnef-kv against tract 0.23.9 (the oracle) on small graphs, plus kernel tests
for the operations tract does not implement (split, rcp, constant, gelu, argmax_pool, ...)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import HAVE_TRACT

RNG = np.random.default_rng(1234)


def _x(*shape: int, lo: float = -2.0, hi: float = 2.0) -> np.ndarray:
    return RNG.uniform(lo, hi, size=shape).astype(np.float32)


X = _x(2, 3, 4)
XP = _x(2, 3, 4, lo=0.1, hi=3.0)
Y = _x(2, 3, 4)
Y23 = _x(2, 3)
IMG = _x(1, 4, 7, 6)
IMG1 = _x(1, 2, 9)

# name -> (graph body lines, inputs: name -> array). Every input is declared with external<scalar>.
CASES: dict[str, tuple[str, dict[str, np.ndarray]]] = {}


def case(name: str, body: str, **inputs: np.ndarray) -> None:
    CASES[name] = (body, inputs)


for _op in ["exp", "sin", "cos", "tanh", "sigmoid", "abs", "sign", "neg", "floor", "ceil", "round", "sqr",
            "relu", "copy", "softplus", "atan", "elu"]:
    case(_op, f"y = {_op}(x);", x=X)
for _op in ["log", "sqrt", "rsqrt", "log2", "rsqr"]:
    case(_op, f"y = {_op}(x);", x=XP)
case("recip", "y = recip(x);", x=XP)
case("leaky_relu", "y = leaky_relu(x, alpha = 0.2);", x=X)
case("prelu", "a = [[[0.1]], [[0.3]]];\n  y = prelu(x, a);", x=X)
for _op in ["add", "sub", "mul", "div", "pow", "min", "max"]:
    case(f"{_op}_same", f"y = {_op}(x, z);", x=XP if _op == "pow" else X, z=Y)
    case(f"{_op}_trailing_broadcast", f"y = {_op}(x, z);", x=XP if _op == "pow" else X, z=Y23)
case("add_literal", "y = add(x, 1.5);", x=X)
case("operators", "y = (x + z) * 2.0 - x / 4.0;", x=X, z=Y)
case("pow_operator", "y = x ^ 2.0;", x=X)
for _op in ["lt", "gt", "le", "ge", "eq", "ne"]:
    case(_op, f"y = {_op}(x, z);", x=X, z=np.where(RNG.uniform(size=X.shape) < 0.3, X, Y))
case("and_or_not", "a = lt(x, 0.0);\n  b = gt(z, 0.0);\n  y = or(and(a, b), not(a));", x=X, z=Y)
case("select", "y = select(x > z, x, z);", x=X, z=Y)
case("clamp", "y = clamp(x, -0.5, 0.5);", x=X)
case("sum_reduce", "y = sum_reduce(x, axes = [1]);", x=X)
case("sum_reduce_2", "y = sum_reduce(x, axes = [0, 2]);", x=X)
case("mean_reduce", "y = mean_reduce(x, axes = [2]);", x=X)
case("max_reduce", "y = max_reduce(x, axes = [1, 2]);", x=X)
case("min_reduce", "y = min_reduce(x, axes = [0]);", x=X)
case("argmax_reduce", "y = argmax_reduce(x, axes = [2]);", x=X)
case("argmin_reduce", "y = argmin_reduce(x, axes = [1]);", x=X)
case("reshape", "y = reshape(x, shape = [0, -1]);", x=X)
case("reshape_axis_start", "y = reshape(x, shape = [2, 2], axis_start = 2, axis_count = 1);", x=X)
case("squeeze_unsqueeze", "a = unsqueeze(x, axes = [0, 3]);\n  y = squeeze(a, axes = [0]);", x=X)
case("transpose", "y = transpose(x, axes = [2, 0, 1]);", x=X)
case("transpose_partial", "y = transpose(x, axes = [1, 0]);", x=X)
case("concat", "y = concat([x, z, x], axis = 1);", x=X, z=Y)
case("stack", "y = stack([x, z], axis = 1);", x=X, z=Y)
case("slice", "y = slice(x, axes = [1, 2], begin = [1, 0], end = [3, -1]);", x=X)
case("slice_end_zero", "y = slice(x, axes = [2], begin = [1], end = [0]);", x=X)
case("slice_stride", "y = slice(x, axes = [2], begin = [0], end = [4], stride = [2]);", x=X)
case("pad_constant", "y = pad(x, padding = [(0, 0), (1, 2), (2, 1)], value = 1.5);", x=X)
case("pad_reflect", "y = pad(x, padding = [(0, 0), (1, 1), (2, 1)], border = 'reflect');", x=X)
case("tile", "y = tile(x, repeats = [1, 2, 3]);", x=X)
case("matmul", "y = matmul(x, z, transposeB = true);", x=X, z=Y)
case("matmul_ta", "y = matmul(x, z, transposeA = true);", x=X, z=Y)
case("matmul_2d", "w = [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]];\n  y = matmul(x, w);", x=_x(3, 4))
case("linear_bias", "y = linear(x, z, b);", x=_x(5, 4), z=_x(3, 4), b=_x(1, 3))
case("softmax", "y = softmax(x, axes = [2]);", x=X)
case("softmax_default_axis", "y = softmax(x);", x=X)
case("conv_2d", "y = conv(x, w, b);", x=IMG, w=_x(3, 4, 3, 3), b=_x(1, 3))
case("conv_stride_pad", "y = conv(x, w, padding = [(1, 0), (0, 2)], stride = [2, 2]);", x=IMG, w=_x(6, 4, 3, 2))
case("conv_dilation", "y = conv(x, w, dilation = [2, 1], padding = [(0, 0), (0, 0)]);", x=IMG, w=_x(2, 4, 2, 2))
case("conv_groups", "y = conv(x, w, groups = 2);", x=IMG, w=_x(4, 2, 3, 3))
case("conv_depthwise", "y = conv(x, w, groups = 0);", x=IMG, w=_x(4, 1, 3, 3))
case("conv_1d", "y = conv(x, w, stride = [2]);", x=IMG1, w=_x(3, 2, 3))
case("deconv_2d", "y = deconv(x, w);", x=IMG, w=_x(3, 4, 3, 3))
case("deconv_stride", "y = deconv(x, w, stride = [2, 2], padding = [(1, 1), (0, 1)]);", x=IMG, w=_x(2, 4, 3, 3))
case("deconv_stride_auto", "y = deconv(x, w, stride = [2, 2]);", x=IMG, w=_x(2, 4, 3, 3))
case("deconv_groups_dilation", "y = deconv(x, w, groups = 2, dilation = [2, 1], padding = [(0, 0), (0, 0)]);", x=IMG,
     w=_x(6, 2, 2, 3))
case("max_pool", "y = max_pool(x, size = [1, 1, 3, 3], stride = [1, 1, 2, 2], border = 'ignore');", x=IMG)
case(
    "max_pool_pad",
    "y = max_pool(x, size = [1, 1, 2, 2], padding = [(0, 0), (0, 0), (1, 1), (0, 1)], border = 'constant');",
    x=IMG,
)
case("avg_pool_ignore", "y = avg_pool(x, size = [1, 1, 3, 3], border = 'ignore');", x=IMG)
case("avg_pool_constant", "y = avg_pool(x, size = [1, 1, 3, 3], border = 'constant');", x=IMG)
case("box", "y = box(x, size = [1, 1, 2, 2], stride = [1, 1, 2, 2]);", x=IMG)
case("debox", "y = debox(x, size = [1, 1, 2, 2], stride = [1, 1, 2, 2], padding = [(0,0),(0,0),(0,0),(0,0)]);", x=IMG)
case("batch_normalization", "y = batch_normalization(x, m, v, o, s, epsilon = 0.001);", x=IMG,
     m=_x(1, 4), v=_x(1, 4, lo=0.5, hi=2.0), o=_x(1, 4), s=_x(1, 4))
case("l2_normalization", "y = l2_normalization(x, axes = [1], epsilon = 0.00001);", x=IMG)
case("l1_normalization", "y = l1_normalization(x, axes = [1, 2], bias = 0.5);", x=IMG)
case(
    "local_response_normalization",
    "y = local_response_normalization(x, size = [1, 3, 1, 1], alpha = 0.5, beta = 0.75, bias = 2.0);",
    x=IMG,
)
case("local_mean_normalization", "y = local_mean_normalization(x, size = [1, 1, 3, 3]);", x=IMG)
case(
    "local_variance_normalization",
    "y = local_variance_normalization(x, size = [1, 1, 3, 3], bias = 1.0, epsilon = 0.001);",
    x=IMG,
)
case("moments", "m, v = moments(x, axes = [2]);\n  y = add(m, v);", x=X)
case("rms_pool", "y = rms_pool(x, size = [1, 1, 2, 2]);", x=IMG)
case("literal_constant", "c = [[1.0, 2.0, 3.0, 4.0]];\n  y = add(x, c);", x=_x(3, 4))
case("fragment_override", "y = relu(x);", x=X)


def _graph_text(body: str, inputs: dict[str, np.ndarray], fragments: str = "") -> str:
    decl = "\n".join(f"  {n} = external<scalar>(shape = {list(a.shape)});" for n, a in inputs.items())
    return (f"version 1.0;\n{fragments}\ngraph g({', '.join(inputs)}) -> (y)\n{{\n{decl}\n  {body}\n}}\n")


def _write(tmp_path: Path, name: str, text: str) -> Path:
    d = tmp_path / name.replace("/", "_")
    d.mkdir()
    (d / "graph.nnef").write_text(text)
    return d


def _nnef_kv_run(path: Path, inputs: dict[str, np.ndarray]) -> np.ndarray:
    import nnef_kv

    return nnef_kv.load(path).session().run(inputs)["y"]


FRAGMENT_OVERRIDE = "fragment relu(x: tensor<scalar>) -> (y: tensor<scalar>) { y = x * 2.0; }\n"


@pytest.mark.skipif(not HAVE_TRACT, reason="tract is not installed")
@pytest.mark.tract
@pytest.mark.parametrize("name", sorted(CASES))
def test_op_matches_tract(name: str, tmp_path: Path) -> None:
    from nnef_kv import tract_driver

    body, inputs = CASES[name]
    frags = FRAGMENT_OVERRIDE if name == "fragment_override" else ""
    path = _write(tmp_path, name, _graph_text(body, inputs, frags))
    try:
        model = tract_driver.runnable(path, extensions=())  # plain tract.nnef()
    except Exception as exc:  # noqa: BLE001 - tract refuses: that case is listed below
        pytest.fail(f"tract refuses case {name}: {str(exc).splitlines()[0]}")
    ref = tract_driver.run(model, list(inputs.values()))[0]
    got = _nnef_kv_run(path, inputs)
    assert got.shape == ref.shape, f"{name}: shape {got.shape} vs tract {ref.shape}"
    assert got.dtype == ref.dtype, f"{name}: dtype {got.dtype} vs tract {ref.dtype}"
    if ref.dtype.kind in "biu":
        np.testing.assert_array_equal(got, ref)
    else:
        np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5, equal_nan=True)


# ------------------------------------------------------------------------------------------------
# Operations tract lacks: hand-computed expectations
# ------------------------------------------------------------------------------------------------
def _run_text(tmp_path: Path, text: str, inputs: dict[str, np.ndarray], outputs: tuple[str, ...] = ("y",)) -> Any:
    import nnef_kv

    d = _write(tmp_path, "g", text)
    res = nnef_kv.load(d).session().run(inputs)
    return [res[o] for o in outputs]


def test_split_and_unstack(tmp_path: Path) -> None:
    x = np.arange(24, dtype=np.float32).reshape(2, 6, 2)
    text = """version 1.0;
graph g(x) -> (a, b, c, u0, u1)
{
  x = external<scalar>(shape = [2, 6, 2]);
  [a, b, c] = split(x, axis = 1, ratios = [1, 2, 3]);
  [u0, u1] = unstack(x, axis = 0);
}
"""
    a, b, c, u0, u1 = _run_text(tmp_path, text, {"x": x}, ("a", "b", "c", "u0", "u1"))
    np.testing.assert_array_equal(a, x[:, 0:1])
    np.testing.assert_array_equal(b, x[:, 1:3])
    np.testing.assert_array_equal(c, x[:, 3:6])
    np.testing.assert_array_equal(u0, x[0])
    np.testing.assert_array_equal(u1, x[1])


def test_constant_rcp_gelu_selu(tmp_path: Path) -> None:
    x = np.array([-2.0, -0.5, 0.25, 3.0], np.float32)
    text = """version 1.0;
graph g(x) -> (c, r, ge, se, si)
{
  x = external<scalar>(shape = [4]);
  c = constant<scalar>(shape = [2, 2], value = [1.0, 2.0, 3.0, 4.0]);
  r = rcp(x);
  ge = gelu(x);
  se = selu(x);
  si = silu(x);
}
"""
    c, r, ge, se, si = _run_text(tmp_path, text, {"x": x}, ("c", "r", "ge", "se", "si"))
    np.testing.assert_array_equal(c, np.array([[1, 2], [3, 4]], np.float32))
    np.testing.assert_allclose(r, 1 / x, rtol=1e-6)
    np.testing.assert_allclose(ge, x / (1 + np.exp(-1.702 * x)), rtol=1e-6)
    selu_ref = 1.05070102 * np.where(x < 0, 1.67326319 * (np.exp(x) - 1), x)
    np.testing.assert_allclose(se, selu_ref, rtol=1e-6)
    np.testing.assert_allclose(si, x / (1 + np.exp(-x)), rtol=1e-6)


def test_quantize_ops() -> None:
    from nnef_kv.interpreter.ops import nnef_std as K

    x = np.array([-1.0, -0.3, 0.0, 0.26, 0.9, 2.0], np.float32)
    lo, hi = np.array(-1.0, np.float32), np.array(1.0, np.float32)
    y = K.linear_quantize(x, lo, hi, bits=2)  # 4 levels over [-1, 1]: -1, -1/3, 1/3, 1
    np.testing.assert_allclose(y, [-1, -1 / 3, 1 / 3, 1 / 3, 1, 1], rtol=1e-6)
    z = K.zero_point_linear_quantize(x, zero_point=0, scale=0.5, bits=8, signed=True, symmetric=False)
    np.testing.assert_allclose(z, np.clip(K._round(x / 0.5), -128, 127) * 0.5)
    lq = K.logarithmic_quantize(np.array([0.3, -5.0, 0.0], np.float32), np.array(4.0, np.float32), bits=3)
    np.testing.assert_allclose(lq, [0.25, -4.0, 0.0])
    mm = K.min_max_linear_quantize(x, lo, hi, bits=8, signed=False, symmetric=False)
    assert np.max(np.abs(mm - np.clip(x, -1, 1))) <= 1 / 255 + 1e-6


def test_argmax_pool_and_max_pool_with_index() -> None:
    from nnef_kv.interpreter.ops import nnef_std as K

    x = np.array([[[[1.0, 5.0, 2.0, 0.0], [3.0, 4.0, 9.0, 1.0]]]], np.float32)
    idx = K.argmax_pool(x, size=[1, 1, 2, 2], stride=[1, 1, 2, 2], padding=[(0, 0)] * 4)
    np.testing.assert_array_equal(idx, [[[[1, 2]]]])
    out, idx2 = K.max_pool_with_index(x, size=[1, 1, 2, 2], stride=[1, 1, 2, 2], padding=[(0, 0)] * 4)
    np.testing.assert_array_equal(out, [[[[5.0, 9.0]]]])
    np.testing.assert_array_equal(idx2, idx)


def test_integer_division_truncates_like_tract() -> None:
    from nnef_kv.interpreter.catalog import lookup

    div = lookup("div").kernel
    got = div(np.array([7, -7, 6], np.int64), np.array([2, 2, -4], np.int64))
    np.testing.assert_array_equal(got, [3, -3, -1])
    assert got.dtype == np.int64


def test_f16_stays_f16() -> None:
    from nnef_kv.interpreter.catalog import lookup

    x = np.array([1.0, 2.0], np.float16)
    assert lookup("add").kernel(x, np.array(1.0, np.float32)).dtype == np.float16
    assert lookup("matmul").kernel(x.reshape(1, 2), x.reshape(2, 1)).dtype == np.float16
    assert lookup("exp").kernel(x).dtype == np.float16


def test_resampling_ops_tract_lacks() -> None:
    from nnef_kv.interpreter.ops import nnef_std as K

    x = _x(1, 2, 6, 4)
    np.testing.assert_array_equal(K.nearest_upsample(x, [2, 3]), np.repeat(np.repeat(x, 2, 2), 3, 3))
    np.testing.assert_array_equal(K.nearest_downsample(x, [2, 2]), x[:, :, ::2, ::2])
    np.testing.assert_allclose(K.area_downsample(x, [2, 2]), x.reshape(1, 2, 3, 2, 2, 2).mean(axis=(3, 5)),
                               rtol=1e-6)
    a, b = 1.0, 3.0
    line = np.array([[[a, b]]], np.float32)
    up = K.multilinear_upsample(line, [2], method="symmetric", border="replicate")
    np.testing.assert_allclose(up[0, 0], [a, 0.75 * a + 0.25 * b, 0.25 * a + 0.75 * b, b])
    up = K.multilinear_upsample(line, [2], method="aligned")
    np.testing.assert_allclose(up[0, 0], [a, a + (b - a) / 3, a + 2 * (b - a) / 3, b], rtol=1e-6)
    up = K.multilinear_upsample(line, [2], method="symmetric", border="constant")
    np.testing.assert_allclose(up[0, 0], [0.75 * a, 0.75 * a + 0.25 * b, 0.25 * a + 0.75 * b, 0.75 * b])


def test_misc_kernels_tract_lacks() -> None:
    from nnef_kv.interpreter.ops import nnef_std as K

    np.testing.assert_allclose(K.add_n([X, Y, X]), 2 * X + Y, rtol=1e-6)
    np.testing.assert_array_equal(K.slice_(X, axes=[2], begin=[-3], end=[4]), X[:, :, 1:4])
    np.testing.assert_array_equal(K.slice_(X, axes=[2], begin=[1], end=[100]), X[:, :, 1:])
    np.testing.assert_array_equal(K.slice_(X, axes=[2], begin=[3], end=[-5], stride=[-1]), X[:, :, 3::-1])
    np.testing.assert_array_equal(K.pad(X, [(0, 0), (1, 1), (2, 0)], border="replicate"),
                                  np.pad(X, [(0, 0), (1, 1), (2, 0)], mode="edge"))
    np.testing.assert_array_equal(K.pad(X, [(0, 0), (1, 1), (2, 0)], border="reflect-even"),
                                  np.pad(X, [(0, 0), (1, 1), (2, 0)], mode="symmetric"))
    np.testing.assert_array_equal(K.gather(X, np.array([[2, 0]]), axis=1), X[:, [[2, 0]]])
    np.testing.assert_array_equal(K.tile(X, [1, 1, 2]), np.concatenate([X, X], axis=2))


def test_nan_passes_through_kernels() -> None:
    from nnef_kv.interpreter.catalog import lookup

    x = np.array([np.nan, 1.0], np.float32)
    for op in ("exp", "sigmoid", "tanh", "neg", "abs", "sqrt"):
        assert np.isnan(lookup(op).kernel(x)[0]), op
    assert np.isnan(lookup("add").kernel(x, x)[0])
    assert np.isnan(lookup("softmax").kernel(x.reshape(1, 2), axes=[1])).all()
    # tract's max/min ignore NaN, and relu is max(x, 0.0): relu(NaN) = 0 and max_reduce skips NaN
    assert lookup("relu").kernel(x)[0] == 0.0
    assert lookup("max_reduce").kernel(np.array([np.nan, -1.0, 2.0], np.float32), axes=[0])[0] == 2.0
