"""Sessions: state per stateful node, reset, independence, refused runs, saved state, KV byte accounting,
and the decoder fixtures reproducing their PyTorch reference decodes step by step."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import nnef_kv
from conftest import FIXTURES, HAVE_TRACT, requires_shared, requires_tract
from nnef_kv.errors import InputError, StateError

KV_TEXT = """version 1.0;
extension tract_registry tract_transformers;
extension tract_symbol S;
extension tract_symbol P;
graph cache(x) -> (y, n)
{
  x = external<scalar>(shape = [1, S, 2]);
  k = tract_transformers_dyn_kv_cache(x, name = 'k', axis = 1, datum_type = 'f32',
                                      past_sequence_shape = [1, P, 2], input_sequence_shape = [1, S, 2]);
  y = mul(k, 2.0);
  n = sum_reduce(k, axes = [1]);
}
"""


def kv_model(tmp_path: Path, text: str = KV_TEXT, name: str = "kv") -> Any:
    d = tmp_path / name
    d.mkdir(exist_ok=True)
    (d / "graph.nnef").write_text(text)
    return nnef_kv.load(d)


def steps(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, s, 2)).astype(np.float32) for s in [3] + [1] * (n - 1)]


def test_state_accumulates_resets_and_is_per_session(tmp_path: Path) -> None:
    model = kv_model(tmp_path)
    a, b = model.session(), model.session()
    xs = steps(3)
    for i, x in enumerate(xs):
        y = a.run({"x": x})["y"]
        np.testing.assert_allclose(y, 2 * np.concatenate(xs[: i + 1], axis=1))
    assert b.run({"x": xs[0]})["y"].shape == (1, 3, 2)  # b never saw a's tokens
    a.reset()
    np.testing.assert_allclose(a.run({"x": xs[1]})["y"], 2 * xs[1])


def test_refused_run_leaves_state_untouched(tmp_path: Path) -> None:
    s = kv_model(tmp_path).session()
    xs = steps(2)
    s.run({"x": xs[0]})
    before = s.kv_cache_bytes()
    with pytest.raises(InputError):
        s.run({"x": np.zeros((1, 2, 3), np.float32)})
    with pytest.raises(InputError):
        s.run({"x": xs[1].astype(np.float64)})
    assert s.kv_cache_bytes() == before
    np.testing.assert_allclose(s.run({"x": xs[1]})["y"], 2 * np.concatenate(xs, axis=1))


def test_kv_cache_bytes_sums_states(tmp_path: Path) -> None:
    s = kv_model(tmp_path).session()
    empty = s.kv_cache_bytes()
    assert empty["total"] == empty["codes"] + empty["params"] + empty["full_precision"]
    s.run({"x": steps(1)[0]})
    got = s.kv_cache_bytes()
    # three f32 rows of 2 cached, in a buffer with spare rows for later runs: all of it counted
    assert got["full_precision"] == s.states[0].capacity * 2 * 4 >= 3 * 2 * 4
    assert got["total"] == got["codes"] + got["params"] + got["full_precision"]


def test_save_and_restore_state(tmp_path: Path) -> None:
    model = kv_model(tmp_path)
    s = model.session()
    xs = steps(4)
    for x in xs[:2]:
        s.run({"x": x})
    path = tmp_path / "state.tar"
    s.save_state(path)
    restored = model.session(state=path)
    np.testing.assert_array_equal(restored.run({"x": xs[2]})["y"], s.run({"x": xs[2]})["y"])
    other = kv_model(tmp_path, KV_TEXT.replace("mul(k, 2.0)", "mul(k, 3.0)"), "other")
    with pytest.raises(StateError, match="another model"):
        other.session(state=path)
    (tmp_path / "junk.tar").write_bytes(b"not a tar")
    with pytest.raises(StateError):
        model.session(state=tmp_path / "junk.tar")


@pytest.mark.skipif(not HAVE_TRACT, reason="tract is not installed")
@pytest.mark.tract
def test_stateful_parity_with_tract(tmp_path: Path) -> None:
    from nnef_kv import tract_driver

    model = kv_model(tmp_path)
    ours = model.session()
    theirs = tract_driver.Stateful(tmp_path / "kv")
    for x in steps(4, seed=3):
        mine = ours.run({"x": x})
        ref = theirs.run([x])
        np.testing.assert_allclose(mine["y"], ref[0], rtol=1e-6)
        np.testing.assert_allclose(mine["n"], ref[1], rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# decoder fixtures (explicit cache inputs/outputs)
# ------------------------------------------------------------------------------------------------
FIXTURE_MODELS = {"llama_gqa": 3, "gpt2": 6}  # name -> kv heads


@requires_shared
@pytest.mark.parametrize("name", sorted(FIXTURE_MODELS))
def test_fixture_one_call_with_cache(name: str) -> None:
    d = np.load(FIXTURES / name / "io.npz")
    s = nnef_kv.load(FIXTURES / name / "model.nnef.tgz").session()
    out = s.run({k: d[k] for k in s.input_names})
    for k, v in out.items():
        np.testing.assert_allclose(v, d[k], atol=1e-5, rtol=0, err_msg=f"{name} {k}")


@requires_shared
@pytest.mark.parametrize("name", sorted(FIXTURE_MODELS))
def test_fixture_decode_matches_reference(name: str) -> None:
    kv = FIXTURE_MODELS[name]
    d = np.load(FIXTURES / name / "decode_io.npz")
    s = nnef_kv.load(FIXTURES / name / "model.nnef.tgz").session()
    cache = {f"in_cache_{t}_{l}": np.zeros((1, kv, 0, 16), np.float32) for l in range(3) for t in ("key", "value")}
    tok, n = d["tokens"], int(d["n_prompt"])
    calls = [tok[:n]] + [tok[i:i + 1] for i in range(n, len(tok))]
    assert len(calls) == d["logits"].shape[0]
    for i, ids in enumerate(calls):
        out = s.run(dict(cache, input_ids=ids[None].astype(np.int64)))
        np.testing.assert_allclose(out["outputs"][0, -1], d["logits"][i], atol=1e-5, rtol=0,
                                   err_msg=f"{name} call {i} vs PyTorch")
        np.testing.assert_allclose(out["outputs"][0, -1], d["tract_logits"][i], atol=1e-5, rtol=0,
                                   err_msg=f"{name} call {i} vs tract")
        cache = {k.replace("out_", "in_"): v for k, v in out.items() if k.startswith("out_cache_")}
    for l in range(3):
        for t in ("key", "value"):
            np.testing.assert_allclose(cache[f"in_cache_{t}_{l}"], d[f"final_out_cache_{t}_{l}"], atol=1e-5, rtol=0)


@requires_shared
@pytest.mark.skipif(not HAVE_TRACT, reason="tract is not installed")
@pytest.mark.tract
def test_scan_state_persists_across_runs_like_tract() -> None:
    """export-scan-state: a tract_core_scan whose recurrent state outlives the call (tract keeps it)."""
    from conftest import CONFORMANCE
    from nnef_kv import tract_driver

    path = CONFORMANCE / "tract-harness" / "export-scan-state"
    ours = nnef_kv.load(path).session()
    theirs = tract_driver.Stateful(path, extensions=())  # plain tract.nnef()
    rng = np.random.default_rng(5)
    for s in (1, 3, 2):
        x = rng.standard_normal((s, 4)).astype(np.float32)
        ref = theirs.run_first([x])
        np.testing.assert_allclose(ours.run({"input": x})["output"], ref, rtol=1e-6)
    ours.reset()
    x = np.ones((1, 4), np.float32)
    h0 = nnef_kv.load(path).tensors["h0"]
    np.testing.assert_allclose(ours.run({"input": x})["output"], np.asarray(h0) + x, rtol=1e-6)


def test_benchmark_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/decode.py builds its archive and decodes (tiny config, nnef-kv only)."""
    import importlib.util

    from conftest import REPO

    spec = importlib.util.spec_from_file_location("bench_decode", REPO / "benchmarks" / "decode.py")
    assert spec is not None and spec.loader is not None
    import sys

    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    assert mod.main(["--quick", "--no-tract", "--gqa-kv-heads", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("nnef-kv/1") == 2 and "tokens/s" in out
    assert mod.main(["--quick", "--profile"]) == 0
    out = capsys.readouterr().out
    assert "tract_core_rms_norm*mul" in out and "per token" in out  # the fused step, timed by op
    assert mod.main(["--quick", "--plan-gain", "--lockstep", "1"]) == 0
    assert "(same tokens)" in capsys.readouterr().out


@requires_tract
def test_benchmark_lockstep_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/decode.py's paired mode: nnef-kv and tract side by side, same tokens."""
    import importlib.util
    import sys

    from conftest import REPO

    spec = importlib.util.spec_from_file_location("bench_decode_lockstep", REPO / "benchmarks" / "decode.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    assert mod.main(["--quick", "--gqa-kv-heads", "0", "--lockstep", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("same tokens: True") == 2 and "BLAS on 1" in out and "BLAS on 2" in out


# ------------------------------------------------------------------------------------------------
# capture, errors placed at their node, tract_assert, liveness
# ------------------------------------------------------------------------------------------------
def doc_session(text: str, tensors: dict[str, np.ndarray] | None = None) -> Any:
    from nnef_kv.io.archive import Model

    return Model(nnef_kv.parse(text, filename="t/graph.nnef"), dict(tensors or {}), source="t").session()


CAPTURE_TEXT = """version 1.0;
fragment twice(a: tensor<scalar>) -> (b: tensor<scalar>) { inner = mul(a, 2.0); b = add(inner, 1.0); }
graph g(x) -> (y)
{
  x = external<scalar>(shape = [2, 3]);
  h = exp(x);
  t = twice(h);
  h = neg(t);
  y = sum_reduce(h, axes = [1]);
}
"""


def test_capture_returns_named_intermediates_and_same_outputs() -> None:
    s = doc_session(CAPTURE_TEXT)
    x = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
    plain = s.run({"x": x})
    outs, caps = s.run({"x": x}, capture=["h", "t", "t.inner", "h#1", "x"])
    np.testing.assert_array_equal(outs["y"], plain["y"])
    assert list(outs) == ["y"]
    np.testing.assert_array_equal(caps["h"], np.exp(x))  # the first assignment of a reassigned name
    np.testing.assert_array_equal(caps["t.inner"], np.exp(x) * np.float32(2))  # a node inside a fragment
    np.testing.assert_array_equal(caps["t"], np.exp(x) * np.float32(2) + np.float32(1))
    np.testing.assert_array_equal(caps["h#1"], -caps["t"])  # the later assignment, by node name
    np.testing.assert_array_equal(caps["x"], x)
    with pytest.raises(InputError, match="no tensor named 'nope'"):
        s.run({"x": x}, capture=["nope"])
    # a node given as such: its own output, even where an identifier of the same name is another tensor
    nested = doc_session(CAPTURE_TEXT.replace("h = neg(t);", "h = neg(t);\n  o = neg(exp(t));")
                         .replace("-> (y)", "-> (y, o)"))
    exp_node = next(n for n in nested.plan.step_nodes if n.op == "exp" and n.name != "h")
    assert exp_node.name == "o"  # the nested invocation is named after the statement, as in tract
    _, by_node = nested.run({"x": x}, capture=[exp_node, "o"])
    np.testing.assert_array_equal(by_node["o"], -np.exp(caps["t"]))  # by identifier
    _, by_node = nested.run({"x": x}, capture=[exp_node])
    np.testing.assert_array_equal(by_node["o"], np.exp(caps["t"]))  # by node


def test_capture_leaves_state_as_a_plain_run(tmp_path: Path) -> None:
    model = kv_model(tmp_path)
    a, b = model.session(), model.session()
    for x in steps(3):
        ya = a.run({"x": x})
        yb, caps = b.run({"x": x}, capture=["k"])
        np.testing.assert_array_equal(ya["y"], yb["y"])
        np.testing.assert_array_equal(caps["k"] * np.float32(2), yb["y"])
    assert a.kv_cache_bytes() == b.kv_cache_bytes()


def test_validate_capture_takes_the_public_capture_path(monkeypatch: pytest.MonkeyPatch) -> None:
    import functools

    from nnef_kv.interpreter.session import Session
    from nnef_kv.validate.capture import attention_step_indices, run_capturing

    text = """version 1.0;
extension tract_registry tract_transformers;
graph g(q, k, v) -> (y)
{
  q = external<scalar>(shape = [1, 2, 3, 4]);
  k = external<scalar>(shape = [1, 2, 3, 4]);
  v = external<scalar>(shape = [1, 2, 3, 4]);
  att = tract_transformers_sdpa(q, k, v, is_causal = true);
  y = mul(att, 3.0);
}
"""
    calls: list[Any] = []
    original = Session.run

    @functools.wraps(original)
    def spy(self: Session, inputs: dict[str, Any], capture: Any = None) -> Any:
        calls.append(capture)
        return original(self, inputs, capture=capture)

    monkeypatch.setattr(Session, "run", spy)
    s = doc_session(text)
    rng = np.random.default_rng(1)
    feed = {n: rng.standard_normal((1, 2, 3, 4)).astype(np.float32) for n in "qkv"}
    idx = attention_step_indices(s.plan)
    outs, caps = run_capturing(s, feed, idx)
    assert len(calls) == 1 and [n.name for n in calls[0]] == ["att"]  # nodes, picked by op
    np.testing.assert_allclose(caps[0] * np.float32(3), outs["y"], rtol=1e-6)


def test_kernel_error_names_node_and_location() -> None:
    from nnef_kv.errors import GraphError

    text = """version 1.0;
graph g(a, b) -> (y)
{
  a = external<scalar>(shape = [S]);
  b = external<scalar>(shape = [T]);
  y = add(a, b);
}
"""
    s = doc_session(text)
    with pytest.raises(GraphError, match=r"^t/graph\.nnef:6:7: node 'y' \(add\): ValueError: ") as info:
        s.run({"a": np.zeros(2, np.float32), "b": np.zeros(3, np.float32)})
    assert isinstance(info.value.__cause__, ValueError)
    assert info.value.node == "y" and info.value.location == "t/graph.nnef:6:7"  # type: ignore[attr-defined]
    # an nnef-kv error raised by a kernel keeps its type and message, placed at the node
    text2 = """version 1.0;
extension tract_registry tract_core;
graph g(ids) -> (y)
{
  ids = tract_core_external(shape = [2], datum_type = 'i64');
  table = constant<scalar>(shape = [3, 2], value = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
  y = tract_core_gather(table, ids, axis = 0);
}
"""
    s2 = doc_session(text2)
    np.testing.assert_array_equal(s2.run({"ids": np.array([2, 0])})["y"], [[5, 6], [1, 2]])
    with pytest.raises(InputError, match=r"^t/graph\.nnef:7:7: node 'y' \(tract_core_gather\): tract_core_gather: "
                                         r"index out of range"):
        s2.run({"ids": np.array([0, 3])})
    # a NaN is a value, not an error
    assert np.isnan(s.run({"a": np.full(2, np.nan, np.float32), "b": np.zeros(1, np.float32)})["y"]).all()


ASSERT_TEXT = """version 1.0;
extension tract_registry tract_transformers;
extension tract_symbol S;
extension tract_symbol P;
extension tract_assert S >= 1;
extension tract_assert S+P < 6;
extension tract_assert tg: S==1;
extension tract_assert U*2 <= 4;
graph cache(x) -> (y)
{
  x = external<scalar>(shape = [1, S, 2]);
  k = tract_transformers_dyn_kv_cache(x, name = 'k', axis = 1, datum_type = 'f32',
                                      past_sequence_shape = [1, P, 2], input_sequence_shape = [1, S, 2]);
  y = mul(k, 2.0);
}
"""


def test_tract_assert_checked_once_symbols_are_bound(tmp_path: Path) -> None:
    s = kv_model(tmp_path, ASSERT_TEXT, "asserted").session()
    s.run({"x": np.zeros((1, 3, 2), np.float32)})  # S = 3 (the scenario hint tg: S==1 is not enforced)
    s.run({"x": np.zeros((1, 2, 2), np.float32)})  # S + P = 5
    before = s.kv_cache_bytes()
    with pytest.raises(InputError, match=r"graph\.nnef:6:\d+: tract_assert S\+P < 6 does not hold \(S = 1, P = 5\)"):
        s.run({"x": np.zeros((1, 1, 2), np.float32)})
    assert s.kv_cache_bytes() == before  # refused before anything ran
    s.reset()
    with pytest.raises(InputError, match=r"tract_assert S >= 1 does not hold \(S = 0\)"):
        s.run({"x": np.zeros((1, 0, 2), np.float32)})


def test_tract_assert_parsing() -> None:
    from nnef_kv.errors import GraphError
    from nnef_kv.interpreter.assertions import parse_assertion

    a = parse_assertion("min(S, 4) + 2*P/3 - -1 == (S # 1)")
    assert a.symbols == ("S", "P")
    assert a.check({"S": 7, "P": 3}) is True  # 4 + 2 + 1 == 7
    assert a.check({"S": 6, "P": 3}) is False
    assert a.check({"S": 6}) is None
    assert parse_assertion("pp: P==0").check({"P": 5}) is None
    for bad in ("S +", "S = 1", "S < 1 2", "P/S > 0"):
        with pytest.raises(GraphError, match="tract_assert"):
            parse_assertion(bad)


def test_intermediates_are_freed_after_their_last_reader() -> None:
    import tracemalloc

    n, size = 40, 1 << 20  # 40 chained tensors of 4 MiB: 160 MiB if every value were kept
    body = ["  x = external<scalar>(shape = [N]);", "  t0 = add(x, 1.0);"]
    body += [f"  t{i} = mul(t{i - 1}, 1.0);" for i in range(1, n)]
    body += [f"  s = slice(t{n - 1}, axes = [0], begin = [0], end = [t1_len]);"]
    text = ("version 1.0;\nextension tract_symbol N;\ngraph g(x) -> (y, z)\n{\n" + "\n".join(body)
            + f"\n  y = sum_reduce(s, axes = [0]);\n  z = t{n // 2};\n}}\n")
    text = text.replace("t1_len", "3")
    s = doc_session(text)
    x = np.ones(size, np.float32)
    tracemalloc.start()
    try:
        outs, caps = s.run({"x": x}, capture=["t5"])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert s.plan.info["liveness"] == 1
    assert peak < 6 * x.nbytes, f"peak {peak / x.nbytes:.1f} tensors"  # x, the graph output z, t5, two live
    np.testing.assert_array_equal(outs["z"], x + 1)
    np.testing.assert_array_equal(caps["t5"], x + 1)  # captured values are kept
    assert float(outs["y"][0]) == 6.0


def test_value_read_as_an_attribute_stays_alive_until_that_reader() -> None:
    text = """version 1.0;
extension tract_registry tract_core;
graph g(x, n) -> (y)
{
  x = external<scalar>(shape = [6]);
  n = tract_core_external(shape = [], datum_type = 'i64');
  m = add(n, 1);
  z = mul(x, 2.0);
  y = slice(z, axes = [0], begin = [0], end = [m]);
}
"""
    s = doc_session(text)
    assert s.plan.info["liveness"] == 1
    x = np.arange(6, dtype=np.float32)
    np.testing.assert_array_equal(s.run({"x": x, "n": np.array(2)})["y"], [0, 2, 4])


def test_threads_2_splits_large_products_with_the_same_results() -> None:
    from nnef_kv.interpreter.plan import parallel
    from nnef_kv.interpreter.session import Session
    from nnef_kv.io.archive import Model

    rng = np.random.default_rng(7)
    w = rng.standard_normal((1, 320, 256)).astype(np.float32)  # 320 KB: split
    text = """version 1.0;
graph g(x) -> (y)
{
  x = external<scalar>(shape = [1, S, 256]);
  w = variable<scalar>(label = 'w', shape = [1, 320, 256]);
  y = matmul(x, w, transposeA = false, transposeB = true);
}
"""
    model = Model(nnef_kv.parse(text), {"w": w})
    one, two = Session(model, threads=1), Session(model, threads=2)
    before = parallel.SPLITTER.split + parallel.SPLITTER.paused
    for n in (1, 7):
        x = rng.standard_normal((1, n, 256)).astype(np.float32)
        a, b = one.run({"x": x})["y"], two.run({"x": x})["y"]
        # a product large enough to split is the same two column halves on one thread and on two: same bits
        np.testing.assert_array_equal(b, a)
        np.testing.assert_allclose(b, x @ w[0].T, rtol=1e-5, atol=1e-4)
    # the 7-row product split, or run whole while splitting is paused (the helper was late on a loaded
    # machine); the 1-row one (82k multiply-adds) is under MIN_SPLIT_WORK: on the calling thread
    assert parallel.SPLITTER.split + parallel.SPLITTER.paused == before + 1 and not parallel.SPLITTER.active
    with pytest.raises(InputError, match="threads"):
        Session(model, threads=0)
    # a splitter of its own: column halves on a multiple of 16, the product unchanged, the helper stops
    sp = parallel.ColumnSplitter()
    try:
        a, b = rng.standard_normal((3, 40)).astype(np.float32), rng.standard_normal((40, 100)).astype(np.float32)
        for _ in range(5):
            np.testing.assert_allclose(sp.matmul(a, b), a @ b, rtol=1e-6, atol=1e-5)
        assert sp.split + sp.paused == 5
        # a helper late too often pauses splitting for PAUSE products, then splitting is tried again
        sp._skip, sp._late = 0, 0.9
        sp.matmul(a, b)
        assert sp._skip == parallel.PAUSE
        paused = sp.paused
        for _ in range(parallel.PAUSE):
            np.testing.assert_allclose(sp.matmul(a, b), a @ b, rtol=1e-6, atol=1e-5)
        assert sp.paused == paused + parallel.PAUSE and sp._skip == 0
    finally:
        sp.close()
    assert sp._thread is None


KIVI_FAILING_GRAPH = """version 1.0;
extension tract_registry tract_core;

graph g(q, idx) -> (y)
{
  q = tract_core_external(shape = [1, 2, 1, 8], datum_type = "f32");
  idx = tract_core_external(shape = [1], datum_type = "i64");
  a = nnef_kv_kivi_sdpa(q, q, q, scale = 0.35, bits = 4, key_group = 4, value_group = 8, residual = 4);
  table = [[1.0, 2.0], [3.0, 4.0]];
  row = tract_core_gather(table, idx, axis = 0);
  y = add(sum_reduce(a, axes = [0, 1, 2, 3]), sum_reduce(row, axes = [0, 1]));
}
"""


def test_failed_run_rolls_the_quantized_cache_back() -> None:
    """A run failing downstream of a KIVI cache that already took its token leaves the cache as before
    the run (O(1) checkpoint): the session goes on exactly as one that never saw the failed run."""
    from nnef_kv.errors import NnefKvError
    from nnef_kv.io.archive import Model

    text = KIVI_FAILING_GRAPH.replace("shape = [1, 2, 1, 8]", "shape = [1, 2, S, 8]").replace(
        "tract_core;\n", "tract_core;\nextension tract_symbol S;\n", 1)
    model = Model(nnef_kv.parse(text, filename="kivi.nnef"))
    rng = np.random.default_rng(0)
    qs = [rng.standard_normal((1, 2, int(n), 8)).astype(np.float32) for n in [1, 3, 1, 5, 1, 1, 2, 1, 1, 1]]
    session, fresh = model.session(), model.session()
    for i, q in enumerate(qs):
        if i in (2, 3, 6):  # the token(s) cross key-group and residual boundaries in the failed runs
            with pytest.raises(NnefKvError):
                session.run({"q": q, "idx": np.array([7])})  # gather fails after the KIVI cache took q
        np.testing.assert_array_equal(session.run({"q": q, "idx": np.array([1])})["y"],
                                      fresh.run({"q": q, "idx": np.array([1])})["y"])
    a, b = session.states[0].state_tensors(), fresh.states[0].state_tensors()
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_failed_run_after_a_state_without_rollback_makes_the_session_refuse_until_reset(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A state that takes no checkpoint (here KIVI's answers NO_CHECKPOINT): after a run fails downstream of it, the
    session refuses to go on from a state that run may have advanced (no silent drift), and reset()
    makes it usable again."""
    from nnef_kv.errors import NnefKvError
    from nnef_kv.io.archive import Model
    from nnef_kv.core.registry import NO_CHECKPOINT
    from nnef_kv.kv.kivi import KiviSdpa

    monkeypatch.setattr(KiviSdpa, "checkpoint", lambda self: NO_CHECKPOINT)
    model = Model(nnef_kv.parse(KIVI_FAILING_GRAPH, filename="kivi.nnef"))
    rng = np.random.default_rng(0)
    qs = [rng.standard_normal((1, 2, 1, 8)).astype(np.float32) for _ in range(6)]
    session, fresh = model.session(), model.session()
    for q in qs[:3]:
        np.testing.assert_array_equal(session.run({"q": q, "idx": np.array([0])})["y"],
                                      fresh.run({"q": q, "idx": np.array([0])})["y"])
    with pytest.raises(NnefKvError):
        session.run({"q": qs[3], "idx": np.array([7])})  # gather fails after the KIVI cache took the token
    with pytest.raises(StateError, match="reset"):
        session.run({"q": qs[4], "idx": np.array([0])})
    session.reset()
    fresh.reset()
    for q in qs:
        np.testing.assert_array_equal(session.run({"q": q, "idx": np.array([1])})["y"],
                                      fresh.run({"q": q, "idx": np.array([1])})["y"])
