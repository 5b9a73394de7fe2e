"""Sessions: state per stateful node, reset, independence, refused runs, saved state, KV byte accounting,
and the decoder fixtures reproducing their PyTorch reference decodes step by step."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import nnef_kv
from conftest import FIXTURES, HAVE_TRACT, requires_shared
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
    assert got["full_precision"] == 3 * 2 * 4  # three f32 rows of 2 cached
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
    import tract

    model = kv_model(tmp_path)
    ours = model.session()
    theirs = tract.nnef().with_tract_transformers().load(str(tmp_path / "kv")).into_runnable().spawn_state()
    for x in steps(4, seed=3):
        mine = ours.run({"x": x})
        ref = [t.to_numpy() for t in theirs.run([x])]
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
    import tract

    from conftest import CONFORMANCE

    path = CONFORMANCE / "tract-harness" / "export-scan-state"
    ours = nnef_kv.load(path).session()
    theirs = tract.nnef().load(str(path)).into_runnable().spawn_state()
    rng = np.random.default_rng(5)
    for s in (1, 3, 2):
        x = rng.standard_normal((s, 4)).astype(np.float32)
        ref = theirs.run([x])[0].to_numpy()
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
