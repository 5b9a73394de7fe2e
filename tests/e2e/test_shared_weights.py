"""One copy of the weights (issue 26): ``validate`` gives the converted archive the reference's arrays after
checking they are equal, and the two sessions then hold one set of weights (the fused projections too)."""
from __future__ import annotations

import numpy as np
import pytest

import nnef_kv
from nnef_kv.models import DecoderConfig, build_decoder
from nnef_kv.validate import ValidateOptions, validate_model

CFG = DecoderConfig(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, mlp=128, seed=5)


@pytest.fixture(scope="module")
def source():
    from nnef_kv.text import byte_level_tokenizer, sample_text, token_source

    return token_source(prompt=sample_text()[:4000], tokenizer=byte_level_tokenizer())


@pytest.fixture()
def pair(tmp_path):
    """(f32 archive path, KIVI-4 archive path): two files, so each loads its own arrays."""
    from nnef_kv.converters import convert

    f32 = tmp_path / "f32.nnef.tar"
    nnef_kv.save(build_decoder(CFG), f32)
    kivi = tmp_path / "kivi4.nnef.tar"
    nnef_kv.save(convert(nnef_kv.load(f32), scheme="kivi", bits=4, key_group=16, value_group=8, residual=16)[0], kivi)
    return f32, kivi


def _roots(plan) -> dict[int, int]:
    """id -> bytes of the distinct arrays (their outermost ndarray) a plan holds as constants."""
    out: dict[int, int] = {}
    for x in plan.base:
        if isinstance(x, np.ndarray) and x.nbytes >= 4096:
            r = x
            while isinstance(r.base, np.ndarray):
                r = r.base
            out[id(r)] = r.nbytes
    return out


def _held(*models) -> int:
    """Bytes of the distinct arrays the models' plans hold (an array two plans share counted once)."""
    seen: dict[int, int] = {}
    for m in models:
        seen.update(_roots(m.session().plan))
    return sum(seen.values())


OPTS = dict(contexts=[64], eval_tokens=8, parity=False, round_trip=False)


def test_validate_gives_the_archive_the_references_arrays(pair, source) -> None:
    f32, kivi = pair
    ref, model = nnef_kv.load(f32), nnef_kv.load(kivi)
    before = {k: v for k, v in model.tensors.items()}
    assert not any(np.shares_memory(before[k], ref.tensors[k]) for k in before)  # two files, two copies
    rep = validate_model(model, ref, source, ValidateOptions(**OPTS))
    assert rep.contexts[0].summary()["tokens_reading_quantized"] > 0
    assert set(model.tensors) == set(before)
    for label, t in model.tensors.items():
        assert t is ref.tensors[label], label  # the very same objects: the archive's copy is released
        np.testing.assert_array_equal(t, before[label])
    # the sessions hold one set of weights: every large constant of the archive's plan is one of the reference's
    mine, theirs = _roots(model.session().plan), _roots(ref.session().plan)
    big = {i for i, n in mine.items() if n >= CFG.hidden * CFG.hidden * 4}
    assert big and big <= set(theirs)
    shared = _held(model, ref)

    ref2, model2 = nnef_kv.load(f32), nnef_kv.load(kivi)  # the same run, comparing nothing: two copies held
    validate_model(model2, ref2, source, ValidateOptions(**OPTS, allow_different_weights=True))
    assert not any(model2.tensors[k] is ref2.tensors[k] for k in model2.tensors)
    separate = _held(model2, ref2)
    weights = sum(t.nbytes for t in ref.tensors.values() if t.nbytes >= 4096)  # what _roots counts
    assert shared <= separate - weights, (shared, separate, weights)
    # and the figures are those of the unshared run
    rep2 = validate_model(nnef_kv.load(kivi), nnef_kv.load(f32), source, ValidateOptions(**OPTS))
    np.testing.assert_array_equal(rep2.contexts[0].archive.logits, rep.contexts[0].archive.logits)


def test_different_weights_are_refused_before_anything_is_shared(pair, source, tmp_path) -> None:
    f32, kivi = pair
    other = tmp_path / "other.nnef.tar"
    nnef_kv.save(build_decoder(DecoderConfig(**{**CFG.to_dict(), "seed": 6})), other)
    model, ref = nnef_kv.load(kivi), nnef_kv.load(other)
    before = dict(model.tensors)
    with pytest.raises(nnef_kv.InputError, match="not the same model as the archive"):
        validate_model(model, ref, source, ValidateOptions(**OPTS))
    assert all(model.tensors[k] is before[k] for k in before)  # nothing replaced


def test_one_changed_weight_is_refused(pair, source) -> None:
    f32, kivi = pair
    model, ref = nnef_kv.load(kivi), nnef_kv.load(f32)
    label = sorted(ref.tensors)[-1]
    changed = np.array(ref.tensors[label])
    changed.reshape(-1)[0] += 1.0
    ref.tensors[label] = changed
    with pytest.raises(nnef_kv.InputError, match=f"its tensor '{label}' differs"):
        validate_model(model, ref, source, ValidateOptions(**OPTS))


# -- compare's workers -------------------------------------------------------------------------------
def _pss_module():
    import importlib.util

    from conftest import REPO

    spec = importlib.util.spec_from_file_location("pss_peak", REPO / "tools" / "pss_peak.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif("fork" not in __import__("multiprocessing").get_all_start_methods(), reason="no fork here")
def test_compare_jobs_2_holds_one_copy_of_the_weights(tmp_path) -> None:
    """``compare --jobs 2``: the processes' summed PSS (a page shared by k processes counts 1/k in each: the
    memory they cost together; summed RSS would count every shared page once per process) at most 1.3x the
    largest single process's RSS (what one process holds, its shared pages in full). Before, each worker
    unpickled its own copy of the model: about 3x (parent and two workers, 171 MiB of weights here)."""
    import os
    import subprocess
    import sys

    from conftest import REPO

    cfg = DecoderConfig(vocab=32000, hidden=512, layers=4, heads=8, kv_heads=2, head_dim=64, mlp=1536, seed=3,
                        cache="explicit")
    path = tmp_path / "m.nnef.tar"
    nnef_kv.save(build_decoder(cfg), path)
    ids = tmp_path / "ids.txt"
    ids.write_text("\n".join(str(int(i)) for i in np.random.default_rng(0).integers(0, cfg.vocab, 400)))
    weights = sum(t.nbytes for t in nnef_kv.load(path).tensors.values())
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("NNEF_KV_START_METHOD", None)
    cmd = [sys.executable, "-m", "nnef_kv", "compare", str(path), "--ids", str(ids), "--schemes", "kivi:4,kivi:8",
           "--context", "64", "--eval-tokens", "8", "--windows", "1", "--no-tract", "--jobs", "2"]
    pss = _pss_module()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with pss.PeakSampler(proc.pid, interval=0.02) as s:
        out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "2 forked workers" in out
    peak = s.peak
    assert peak["n"] >= 3  # the parent and its two workers were sampled
    assert peak["max_rss"] > weights  # one process holds the weights ...
    assert peak["pss"] <= 1.3 * peak["max_rss"], (peak, weights)  # ... and all of them together barely more


def test_forked_and_spawned_workers_give_the_same_table(pair, source, monkeypatch) -> None:
    from nnef_kv.validate.compare import CompareOptions, compare_model, parse_specs

    f32, _ = pair
    specs = parse_specs("kivi:4,kivi:2")
    opts = CompareOptions(contexts=[64], eval_tokens=8, windows=1, tract=False)

    def rows(method):
        monkeypatch.setenv("NNEF_KV_START_METHOD", method)
        rep = compare_model(nnef_kv.load(f32), source, specs, opts, jobs=2, show_progress=False)
        assert f"{method}ed workers" in rep.runner
        return [{k: v for k, v in r.to_dict(rep.contexts).items() if k != "seconds"} for r in rep.rows]

    forked = rows("fork")
    assert [r["status"] for r in forked] == ["measured", "measured"]
    assert forked == rows("spawn")


def test_start_method_is_checked(monkeypatch) -> None:
    from nnef_kv.validate.jobs import start_method

    monkeypatch.setenv("NNEF_KV_START_METHOD", "threads")
    with pytest.raises(nnef_kv.InputError, match="NNEF_KV_START_METHOD='threads': one of"):
        start_method()
    monkeypatch.setenv("NNEF_KV_START_METHOD", "spawn")
    assert start_method() == "spawn"


# -- inspect's check ---------------------------------------------------------------------------------
def _refuse_weight_preparation(monkeypatch) -> list[str]:
    """Every way a plan prepares weights (transposes, joins, repacks or dequantizes them) raises; returns the
    names patched."""
    from nnef_kv.interpreter.plan import blockweights, weights

    def boom(name):
        def refuse(*a, **k):
            raise AssertionError(f"the check prepared weights: {name}")
        return refuse

    names = []
    for mod, name in ((weights, "_prepare_weight"), (weights, "rewrite_weights"), (weights, "fuse_projections"),
                      (weights, "_stacked"), (weights, "place_weights"), (blockweights, "rewrite_block_product"),
                      (blockweights, "materialize"), (blockweights, "fuse_block_projections")):
        monkeypatch.setattr(mod, name, boom(name))
        names.append(name)
    return names


@pytest.mark.parametrize("weights", ["f32", "q4_0"])
def test_inspect_checks_without_preparing_weights(tmp_path, monkeypatch, capsys, weights) -> None:
    from nnef_kv.cli import main
    from nnef_kv.interpreter.check import check_model

    cfg = DecoderConfig(**{**CFG.to_dict(), "weights": weights, "cache": "explicit"})
    path = tmp_path / "m.nnef.tar"
    nnef_kv.save(build_decoder(cfg), path)
    _refuse_weight_preparation(monkeypatch)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "check: graph built, one run on zeros of the declared inputs" in out and ": ok" in out
    model = nnef_kv.load(path)
    got = check_model(model)
    assert "_nnef_kv_plan" not in vars(model)  # the check's plan is not the model's (not cached)
    monkeypatch.undo()  # the same run on a session that prepares its weights: the same outputs
    s = model.session()
    feed = {i.name: np.zeros([1 if isinstance(d, str) else int(d) for d in i.shape], i.dtype) for i in s.plan.inputs}
    want = s.run(feed)
    assert got.outputs == [(k, str(np.asarray(v).dtype), list(np.shape(v))) for k, v in want.items()]


def test_the_check_still_reports_a_weight_of_the_wrong_shape(monkeypatch) -> None:
    from nnef_kv.interpreter.check import check_model
    from nnef_kv.io.archive import Model

    text = ("version 1.0;\n\ngraph G( x ) -> ( y )\n{\n  x = external<scalar>(shape = [1, 4]);\n"
            "  w = variable<scalar>(shape = [3, 5], label = 'w');\n  y = linear(x, w);\n}\n")
    model = Model.from_text(text, {"w": np.ones((3, 5), np.float32)}, source="bad")
    with pytest.raises(nnef_kv.NnefKvError) as prepared:  # what a session that prepares its weights says
        model.session().run({"x": np.zeros((1, 4), np.float32)})
    _refuse_weight_preparation(monkeypatch)
    with pytest.raises(nnef_kv.NnefKvError) as checked:
        check_model(Model.from_text(text, {"w": np.ones((3, 5), np.float32)}, source="bad"))
    assert str(checked.value) == str(prepared.value)
    assert str(checked.value).startswith("bad/graph.nnef:7:7: node 'y' (linear): ValueError: matmul")


def test_the_round_trip_compares_tensors_in_chunks_bit_for_bit() -> None:
    from nnef_kv.validate.roundtrip import _same_tensor

    a = np.zeros(1000, np.float32)
    assert _same_tensor(a, a.copy(), chunk=64)
    b = a.copy()
    b[-1] = np.float32(-0.0)  # equal as numbers, not as bits; in the last, partial chunk
    assert not _same_tensor(a, b, chunk=64)
    c, d = a.copy(), a.copy()
    c.view(np.uint32)[500], d.view(np.uint32)[500] = 0x7FC00001, 0x7FC00002  # two NaN payloads
    assert _same_tensor(c, c.copy(), chunk=64) and not _same_tensor(c, d, chunk=64)
    assert not _same_tensor(a, a.reshape(10, 100), chunk=64)


def test_convert_checks_on_the_plan_the_converted_model_runs(pair) -> None:
    """convert's own check (inspect's run on zeros) runs the converted model's prepared plan and leaves it
    cached: compare's and auto-bits' jobs measure that model next, on that plan (checked on a throwaway
    unprepared plan, each job would plan twice and read the weights the fused projections replace)."""
    from nnef_kv.converters import convert

    f32, _ = pair
    converted = convert(nnef_kv.load(f32), scheme="kivi", bits=4, key_group=16, value_group=8, residual=16)[0]
    cached = vars(converted).get("_nnef_kv_plan")
    assert cached is not None and converted.session().plan is cached[1]
