"""Numbers in, numbers out.

1. NaN, +-inf, +-0, denormals and near-overflow values flow through ops the way tract 0.23.9 computes them
   (tract is the oracle; where tract departs from IEEE on purpose or by approximation, nnef-kv's documented
   choice is asserted and the deviation named). Every comparison runs the same graph in tract.
2. Runs with mismatched dtypes or shapes are refused before any state changes: a stateful session
   (``tract_transformers_dyn_kv_cache``) that saw refused calls continues exactly like a fresh one.
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import nnef_kv
from nnef_kv.errors import InputError, NnefKvError
from nnef_kv.io.archive import Model

from conftest import CONFORMANCE, requires_tract

SPECIAL = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0, 1e-45, 3.4e38, -3.4e38, 0.5, -2.5], np.float32)
OTHER = np.array([1.0, np.inf, np.inf, 0.0, 0.0, np.nan, -np.inf, 0.0, 3.4e38, np.nan, -0.0, 2.0], np.float32)


def ours(text: str, feeds: dict[str, np.ndarray]) -> np.ndarray:
    session = Model(nnef_kv.parse(text, filename="numbers.nnef")).session()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy's overflow/invalid warnings: IEEE results expected
        return np.asarray(session.run(feeds)["y"])


def theirs(tmp_path: Path, graph: Any, feeds: list[np.ndarray]) -> np.ndarray:
    from tract_oracle import tract_run

    return np.asarray(tract_run(graph.write(tmp_path / "g"), feeds)[0])


def same_numbers(got: np.ndarray, want: np.ndarray, *, rtol: float = 1e-5, atol: float = 1e-6,
                 where: np.ndarray | None = None) -> None:
    """Same dtype and shape; floats: same NaN positions, same infinities (with sign), same sign of zero,
    finite values within rtol/atol; others: equal. ``where`` restricts the comparison to some elements."""
    assert got.dtype == want.dtype, f"dtype {got.dtype} != tract {want.dtype}"
    assert got.shape == want.shape, f"shape {got.shape} != tract {want.shape}"
    if where is not None:
        got, want = got[where], want[where]
    if got.dtype.kind != "f":
        np.testing.assert_array_equal(got, want)
        return
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"NaN positions: {got} vs tract {want}")
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want), err_msg=f"+inf: {got} vs tract {want}")
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg=f"-inf: {got} vs tract {want}")
    fin = np.isfinite(got) & np.isfinite(want)
    np.testing.assert_allclose(got[fin].astype(np.float64), want[fin].astype(np.float64), rtol=rtol, atol=atol)
    exact_zero = fin & (want == 0) & (np.abs(got) == 0)
    np.testing.assert_array_equal(np.signbit(got[exact_zero]), np.signbit(want[exact_zero]),
                                  err_msg="sign of zero")


# op -> body computing y from x (and w); all elementwise or small reductions over SPECIAL/OTHER
PARITY_OPS = {
    "add": "y = add(x, w);",
    "sub": "y = sub(x, w);",
    "mul": "y = mul(x, w);",
    "div": "y = div(x, w);",
    "pow": "y = pow(x, w);",
    "max": "y = max(x, w);",
    "min": "y = min(x, w);",
    "exp": "y = exp(x);",
    "log": "y = log(x);",
    "sqrt": "y = sqrt(x);",
    "rsqrt": "y = rsqrt(x);",
    "relu": "y = relu(x);",
    "abs": "y = abs(x);",
    "neg": "y = neg(x);",
    "sign": "y = sign(x);",
    "floor": "y = floor(x);",
    "ceil": "y = ceil(x);",
    "round": "y = round(x);",
    "sin": "y = sin(x);",
    "cos": "y = cos(x);",
    "elu": "y = elu(x);",
    "erf": "y = tract_core_erf(x);",
    "leaky_relu": "y = leaky_relu(x, alpha = 0.1);",
    "lt": "y = lt(x, w);",
    "le": "y = le(x, w);",
    "eq": "y = eq(x, w);",
    "ne": "y = ne(x, w);",
    "select": "y = select(lt(x, w), x, w);",
    "sum_reduce": "y = sum_reduce(x, axes = [0]);",
    "mean_reduce": "y = mean_reduce(x, axes = [0]);",
    "max_reduce": "y = max_reduce(x, axes = [0]);",
    "min_reduce": "y = min_reduce(x, axes = [0]);",
    "softmax": "y = softmax(x, axes = [0]);",
    "matmul": "y = matmul(unsqueeze(x, axes = [0]), unsqueeze(w, axes = [1]));",
    "rms_norm": "y = tract_core_rms_norm(unsqueeze(x, axes = [0]), axis = 1, eps = 1e-6);",
    "cast_f16": 'y = tract_core_cast(x, to = "f16");',
    "cast_i32": 'y = tract_core_cast(x, to = "i32");',
    "cast_i64": 'y = tract_core_cast(x, to = "i64");',
    "cast_u8": 'y = tract_core_cast(x, to = "u8");',
    "cast_bool": 'y = tract_core_cast(x, to = "bool");',
    "clamp": "y = clamp(x, 0.0, 1.0);",
    "argmax": "y = argmax_reduce(x, axes = [0]);",
}
KNOWN_DEVIATIONS: dict[str, str] = {}  # op -> reason of a strict xfail (none known)


def _graph(body: str) -> Any:
    from tract_oracle import Graph

    return Graph({"x": SPECIAL, "w": OTHER}, [body], ["y"], extensions=("tract_core", "tract_transformers"))


@requires_tract
@pytest.mark.parametrize("op", [
    pytest.param(op, marks=pytest.mark.xfail(strict=True, reason=KNOWN_DEVIATIONS[op])) if op in KNOWN_DEVIATIONS
    else op for op in PARITY_OPS])
def test_special_values_like_tract(tmp_path: Path, op: str) -> None:
    g = _graph(PARITY_OPS[op])
    want = theirs(tmp_path, g, [SPECIAL, OTHER])
    got = ours(g.text(), {"x": SPECIAL, "w": OTHER})
    same_numbers(got, want)


@requires_tract
@pytest.mark.parametrize("op", ["sigmoid", "tanh"])
def test_saturating_activations(tmp_path: Path, op: str) -> None:
    """sigmoid/tanh: like tract on every non-NaN input (tract's rational approximations saturate at 1 - 5e-7),
    but NaN stays NaN (IEEE; tract maps NaN to sigmoid ~4.5e-7, tanh ~-0.9999994: documented deviation)."""
    g = _graph(f"y = {op}(x);")
    want = theirs(tmp_path, g, [SPECIAL, OTHER])
    got = ours(g.text(), {"x": SPECIAL, "w": OTHER})
    nan_in = np.isnan(SPECIAL)
    same_numbers(got, want, where=~nan_in)
    assert np.isnan(got[nan_in]).all()
    assert not np.isnan(want[nan_in]).any(), "tract changed: it now propagates NaN (update docs/hardening.md)"
    with np.errstate(over="ignore"):
        ieee = np.tanh(SPECIAL[~nan_in].astype(np.float64)) if op == "tanh" else \
            1 / (1 + np.exp(-SPECIAL[~nan_in].astype(np.float64)))
    np.testing.assert_allclose(got[~nan_in], ieee, atol=1e-6)


@requires_tract
def test_softplus_does_not_overflow(tmp_path: Path) -> None:
    """softplus(3.4e38) = 3.4e38 in nnef-kv (stable log1p(exp(-|x|)) + max(x, 0)); tract overflows to inf
    there (documented deviation); elsewhere the same numbers as tract."""
    g = _graph("y = softplus(x);")
    want = theirs(tmp_path, g, [SPECIAL, OTHER])
    got = ours(g.text(), {"x": SPECIAL, "w": OTHER})
    big = SPECIAL == np.float32(3.4e38)
    same_numbers(got, want, where=~big)
    assert np.isposinf(want[big]).all() and got[big][0] == np.float32(3.4e38)


# a few graphs where special values meet (attention masks, norms, products)
GRAPHS = {
    "masked-softmax": (
        ["m = select(gt(w, 0.0), x, -inf);", "y = softmax(m, axes = [1]);"],
        {"x": np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [0.5, 0.5, 0.5]], np.float32),
         "w": np.array([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]], np.float32)},
    ),
    "inf-times-zero-matmul": (
        ["y = matmul(x, w);"],
        {"x": np.array([[np.inf, 1.0], [0.0, 2.0]], np.float32),
         "w": np.array([[0.0, 1.0], [1.0, -np.inf]], np.float32)},
    ),
    "rms-norm-of-inf": (
        ["y = tract_core_rms_norm(x, axis = 1, eps = 1e-6);"],
        {"x": np.array([[np.inf, 1.0, 2.0], [1e20, 1e20, 1e20], [0.0, 0.0, 0.0]], np.float32),
         "w": np.zeros((3, 3), np.float32)},
    ),
    "nan-in-residual-chain": (
        ["a = add(x, w);", "b = mul(a, 0.0);", "c = relu(b);", "y = sum_reduce(c, axes = [1]);"],
        {"x": np.array([[np.nan, 1.0], [np.inf, -np.inf]], np.float32), "w": np.ones((2, 2), np.float32)},
    ),
}


@requires_tract
@pytest.mark.parametrize("name", list(GRAPHS))
def test_special_values_through_graphs(tmp_path: Path, name: str) -> None:
    from tract_oracle import Graph

    body, feeds = GRAPHS[name]
    g = Graph(feeds, body, ["y"], extensions=("tract_core", "tract_transformers"))
    want = theirs(tmp_path, g, list(feeds.values()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = np.asarray(Model(nnef_kv.parse(g.text())).session().run(feeds)["y"])
    same_numbers(got, want)


# ------------------------------------------------------------------------------------------------
# refused calls leave a stateful session as it was
# ------------------------------------------------------------------------------------------------
KV_CASE = CONFORMANCE / "tract-python-written" / "tiny-llama-gqa-kv-f32"


@pytest.fixture(scope="module")
def kv_model() -> nnef_kv.Model:
    if not (KV_CASE / "graph.nnef").is_file():
        pytest.skip(f"conformance case not found: {KV_CASE}")
    model = nnef_kv.load(KV_CASE)
    assert "tract_transformers_dyn_kv_cache" in (model.text or "")
    return model


def _token(t: int) -> dict[str, np.ndarray]:
    return {"input_0": np.array([[t]], dtype=np.int64)}


REFUSED_FEEDS = {
    "float-ids": {"input_0": np.array([[3.0]], dtype=np.float32)},
    "int32-ids": {"input_0": np.array([[3]], dtype=np.int32)},
    "wrong-rank": {"input_0": np.array([3], dtype=np.int64)},
    "wrong-shape": {"input_0": np.array([[3, 4]], dtype=np.int64)},
    "missing-input": {},
    "unknown-input": {"input_0": np.array([[3]], dtype=np.int64), "bogus": np.zeros(1)},
    "not-an-array": {"input_0": "three"},
    "object-array": {"input_0": np.array([[None]], dtype=object)},
}


def _state(session: Any) -> list[dict[str, np.ndarray]]:
    return [{k: np.array(v, copy=True) for k, v in s.state_tensors().items()} for s in session.states]


@pytest.mark.parametrize("bad", list(REFUSED_FEEDS))
def test_refused_call_leaves_state_untouched(kv_model: nnef_kv.Model, bad: str) -> None:
    session = kv_model.session()
    first = session.run(_token(5))["output_0"]
    before = _state(session)
    with pytest.raises(NnefKvError) as info:
        session.run(REFUSED_FEEDS[bad])
    assert isinstance(info.value, InputError), f"{type(info.value).__name__}: {info.value}"
    assert "input_0" in str(info.value) or "bogus" in str(info.value), str(info.value)
    after = _state(session)
    assert len(before) == len(after) == 2  # two caches (keys, values)
    for b, a in zip(before, after):
        assert b.keys() == a.keys()
        for k in b:
            np.testing.assert_array_equal(a[k], b[k])
    second = session.run(_token(7))["output_0"]
    fresh = kv_model.session()
    np.testing.assert_array_equal(fresh.run(_token(5))["output_0"], first)
    np.testing.assert_array_equal(fresh.run(_token(7))["output_0"], second)
    assert session.kv_cache_bytes() == fresh.kv_cache_bytes()


def test_several_refused_calls_then_good_ones(kv_model: nnef_kv.Model) -> None:
    """Every kind of refused call, interleaved with good ones: outputs identical to a fresh session's."""
    session, fresh = kv_model.session(), kv_model.session()
    for step, tok in enumerate([3, 9, 1, 4]):
        for bad in REFUSED_FEEDS.values():
            with pytest.raises(InputError):
                session.run(bad)
        np.testing.assert_array_equal(session.run(_token(tok))["output_0"], fresh.run(_token(tok))["output_0"],
                                      err_msg=f"step {step}")


STATEFUL_GRAPH = """version 1.0;
extension tract_registry tract_core;
extension tract_registry tract_transformers;
extension tract_symbol P;
extension tract_symbol S;

graph g(x, idx) -> (y)
{
  x = tract_core_external(shape = [1, 2, S, 2], datum_type = "f32");
  idx = tract_core_external(shape = [1], datum_type = "i64");
  k = tract_transformers_dyn_kv_cache(x, name = "k", axis = 2, datum_type = "f32",
                                      past_sequence_shape = [1, 2, P, 2], input_sequence_shape = [1, 2, S, 2]);
  table = [[1.0, 2.0], [3.0, 4.0]];
  row = tract_core_gather(table, idx, axis = 0);
  y = add(sum_reduce(k, axes = [0, 1, 2, 3]), sum_reduce(row, axes = [0, 1]));
}
"""


def _stateful_feed(value: float, idx: int) -> dict[str, np.ndarray]:
    return {"x": np.full((1, 2, 1, 2), value, np.float32), "idx": np.array([idx], np.int64)}


def test_refused_symbolic_shape_leaves_state_untouched() -> None:
    """A sequence-length input whose shape breaks the graph's symbols is refused before the cache grows."""
    session = Model(nnef_kv.parse(STATEFUL_GRAPH, filename="kv.nnef")).session()
    session.run(_stateful_feed(1.0, 0))
    before = _state(session)
    with pytest.raises(InputError):
        session.run({"x": np.zeros((1, 3, 1, 2), np.float32), "idx": np.array([0], np.int64)})
    with pytest.raises(InputError):
        session.run({"x": np.zeros((1, 2, 1, 2), np.float64), "idx": np.array([0], np.int64)})
    for b, a in zip(before, _state(session)):
        for k in b:
            np.testing.assert_array_equal(a[k], b[k])


def test_failed_run_after_cache_update_rolls_back() -> None:
    session = Model(nnef_kv.parse(STATEFUL_GRAPH, filename="kv.nnef")).session()
    fresh = Model(nnef_kv.parse(STATEFUL_GRAPH, filename="kv.nnef")).session()
    np.testing.assert_array_equal(session.run(_stateful_feed(1.0, 0))["y"], fresh.run(_stateful_feed(1.0, 0))["y"])
    with pytest.raises(NnefKvError):
        session.run(_stateful_feed(100.0, 5))  # gather index 5 of a 2-row table: fails after the cache
    np.testing.assert_array_equal(session.run(_stateful_feed(2.0, 1))["y"], fresh.run(_stateful_feed(2.0, 1))["y"])
