"""``nnef-kv compare``: scheme specs, the table on a shared fixture decoder with its text (rows, ordering,
KL falling as bits grow within a scheme, a failing scheme as a row), report files, refusals, and the same
table from Ray as from the process pool (slow)."""
from __future__ import annotations

import importlib.util
import json

import pytest

from nnef_kv.cli import main
from nnef_kv.errors import InputError
from nnef_kv.validate.compare import parse_spec, parse_specs, pareto_front

from conftest import FIXTURES, requires_shared, requires_tract

LLAMA = FIXTURES / "exports" / "llama_default" / "model.nnef.tgz"
HAVE_RAY = importlib.util.find_spec("ray") is not None


@pytest.mark.parametrize("text,scheme,options", [
    ("kivi:4", "kivi", {"bits": 4}),
    ("kivi:4/2", "kivi", {"bits": 4, "value_bits": 2}),
    ("kivi:8/8", "kivi", {"bits": 8}),
    ("kivi:4+key_axis=token+residual=64", "kivi", {"bits": 4, "key_axis": "token", "residual": 64}),
    ("q8_0", "ggml", {"key_type": "q8_0", "value_type": "q8_0"}),
    ("q4_0/q8_0", "ggml", {"key_type": "q4_0", "value_type": "q8_0"}),
    ("ggml:q5_1+residual=16", "ggml", {"key_type": "q5_1", "value_type": "q5_1", "residual": 16}),
    ("hf:2", "hf", {"bits": 2}),
    ("hf:4+backend=hqq", "hf", {"bits": 4, "backend": "hqq"}),
    ("tract", "tract", {}),
    ("tract-cache:8", "tract-cache", {"bits": 8}),
    ("kivi+layer_bits=8/4;4", "kivi", {"layer_bits": "8/4,4"}),  # ';' for the commas of a value
    ("kivi+layer_bits=8/4,4", None, None),  # a comma splits entries: '4' is no scheme
])
def test_scheme_specs(text, scheme, options):
    if scheme is None:
        with pytest.raises(InputError):
            parse_specs(text)
        return
    s = parse_spec(text)
    assert (s.text, s.scheme, s.kwargs) == (text, scheme, options)


@pytest.mark.parametrize("text,message", [
    ("fp8", "--schemes 'fp8': unknown scheme 'fp8'"),
    ("hf:4/2", "KEY/VALUE bits are for kivi"),
    ("kivi:9", "--schemes 'kivi:9': option bits=9: scheme kivi takes 1..8 bits"),
    ("hf:3", "HF's quanto backend takes 2, 4 bits"),
    ("q4_0/q9_9", "option value_type='q9_9'"),
    ("kivi:4+colour=red", "scheme kivi has no option 'colour'"),
    ("kivi:4+residual", "'residual' is not option=value"),
    ("tract-cache:6", "scheme tract-cache takes 4 or 8 bits"),
    ("tract:4", "scheme tract stores 8-bit codes"),
    ("tract-cache:4/8", "KEY/VALUE bits are for kivi"),
])
def test_bad_specs_are_one_line(text, message):
    with pytest.raises(InputError) as exc:
        parse_specs(text)
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_duplicate_and_empty_specs():
    with pytest.raises(InputError, match="given twice"):
        parse_specs("kivi:4,kivi:4")
    with pytest.raises(InputError, match="no scheme"):
        parse_specs(" , ")


def test_pareto_front():
    pts = [(1.0, 5.0), (2.0, 1.0), (3.0, 1.0), (2.0, 3.0), (0.5, 9.0)]
    assert pareto_front(pts) == [True, True, False, False, True]


@requires_shared
@requires_tract
def test_compare_on_a_shared_fixture_decoder_with_its_text(tmp_path, capsys):
    """llama_default (torch-to-nnef export) with the sample text through its own tokenizer."""
    out = tmp_path / "report"
    schemes = "kivi:2,kivi:4,kivi:8,hf:2,hf:4,tract-cache:4,tract-cache:8,q8_0,kivi:4+residual=400"
    rc = main(["compare", str(LLAMA), "--schemes", schemes, "--context", "96", "--eval-tokens", "16",
               "--windows", "2", "--jobs", "2", "--report-dir", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "report.md", "report.png"]
    rep = json.loads((out / "report.json").read_text())
    rows = {r["scheme"]: r for r in rep["rows"]}
    assert set(rows) == set(schemes.split(","))
    for key in ("scheme", "bits_per_value", "kv_bytes", "kv_bytes_f32", "kl_mean", "kl_p99", "ppl_ratio",
                "top1_agreement", "tract_runs"):
        assert all(key in r for r in rep["rows"]), key
    # the failing scheme is a row with its reason (llama.cpp's blocks of 32 along head_dim 16)
    assert rows["q8_0"]["status"] == "failed" and "not a multiple of 32" in rows["q8_0"]["reason"]
    # a window longer than the context: nothing quantized read, so not measured (no vacuous figures)
    assert rows["kivi:4+residual=400"]["status"] == "not measured"
    assert "nothing was quantized" in rows["kivi:4+residual=400"]["reason"]
    measured = [r for r in rep["rows"] if r["status"] == "measured"]
    assert len(measured) == 7
    # ordering: measured rows by KV bytes held, then the others
    assert [r["kv_bytes"] for r in measured] == sorted(r["kv_bytes"] for r in measured)
    assert [r["status"] for r in rep["rows"]][-2:] == ["not measured", "failed"]
    # KL falls as bits grow within a scheme
    for fam in (("kivi:2", "kivi:4", "kivi:8"), ("hf:2", "hf:4"), ("tract-cache:4", "tract-cache:8")):
        kls = [rows[s]["kl_mean"] for s in fam]
        assert kls == sorted(kls, reverse=True) and kls[0] > kls[-1], (fam, kls)
        byts = [rows[s]["kv_bytes"] for s in fam]
        assert byts == sorted(byts), (fam, byts)
    # bits per value from the bytes held: 32 x held / f32
    for r in measured:
        assert r["bits_per_value"] == pytest.approx(32 * r["kv_bytes"] / r["kv_bytes_f32"])
        # KIVI and HF read a prefill call's own tokens exactly (its prediction reads nothing quantized); tract's
        # cache quantizes them before the attention reads them
        assert r["tokens_reading_quantized"] == (16 if r["scheme"].startswith("tract-cache") else 15) * 2
        # the figures' count and intervals, and the paired difference to the baseline (the row of lowest KL)
        assert r["predictions"] == 32 and r["kl_mean_ci95"][0] <= r["kl_mean"] <= r["kl_mean_ci95"][1]
        assert r["top1_agreement_ci95"][0] <= r["top1_agreement"] <= r["top1_agreement_ci95"][1]
        assert r["ppl_ratio_ci95"][0] <= r["ppl_ratio"] <= r["ppl_ratio_ci95"][1]
        assert r["kl_diff_ci95"][0] <= r["kl_diff"] <= r["kl_diff_ci95"][1]
    assert rep["predictions"] == 32 and rep["windows"] == 2
    best = min(measured, key=lambda r: r["kl_mean"])
    assert rep["baseline"] == {"96": best["scheme"]} and best["kl_diff"] == 0 and best["pareto"]
    assert rows["kivi:2"]["kl_diff_significant"] and rows["kivi:2"]["kl_diff"] > 0
    # tract: its ops load and run; nnef-kv's own are refused by tract, and the row says so
    assert rows["tract-cache:4"]["tract_runs"] is True and rows["kivi:4"]["tract_runs"] is False
    assert "nnef_kv_kivi_sdpa" in rows["kivi:4"]["tract_detail"]
    assert "tract-cache:4" in printed and "q8_0" in printed and "not a multiple of 32" in printed
    md = (out / "report.md").read_text()
    assert "| kivi:4 |" in md and "report.png" in md


def test_compare_refuses_before_any_work(tmp_path, capsys):
    out = tmp_path / "never"
    rc = main(["compare", str(tmp_path / "missing.nnef.tgz"), "--report-dir", str(out)])
    assert rc == 2 and not out.exists()
    assert "no such file" in capsys.readouterr().err
    if LLAMA.exists():
        for args, msg in ((["--schemes", "kivi:3,fp8"], "unknown scheme 'fp8'"), (["--context", "0"], "--context 0"),
                          (["--eval-tokens", "0"], "--eval-tokens 0"), (["--jobs", "0"], "--jobs 0"),
                          (["--context", "100000"], "--context 100000")):
            rc = main(["compare", str(LLAMA), "--report-dir", str(out), *args])
            err = capsys.readouterr().err
            assert rc == 2 and msg in err and err.count("\n") == 1, err
            assert not out.exists()


@pytest.mark.slow
@requires_shared
@pytest.mark.skipif(not HAVE_RAY, reason="ray is not installed (pip install -e '.[ray]')")
def test_ray_gives_the_same_table_as_the_process_pool():
    import ray

    import nnef_kv
    from nnef_kv.text import token_source
    from nnef_kv.validate.compare import CompareOptions, compare_model
    from nnef_kv.validate.compare_report import render_table

    model = nnef_kv.load(LLAMA)
    specs = parse_specs("kivi:2,kivi:4,hf:4,tract-cache:4,q8_0")
    opts = CompareOptions(contexts=[96], eval_tokens=12)

    def table(**kw):
        src = token_source(text=nnef_kv.text.SAMPLE_TEXT, archive=LLAMA)
        rep = compare_model(model, src, specs, opts, label=str(LLAMA), show_progress=False, **kw)
        return rep, [{k: v for k, v in r.to_dict(rep.contexts).items() if k != "seconds"} for r in rep.rows]

    pool, pool_rows = table(jobs=2)
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        on_ray, ray_rows = table(ray="local")
    finally:
        ray.shutdown()
    assert on_ray.runner.startswith("ray") and pool.runner.startswith("local process pool")
    assert ray_rows == pool_rows
    assert render_table(on_ray) == render_table(pool)


@requires_shared
def test_compare_refuses_an_archive_already_quantized(tmp_path, capsys):
    from nnef_kv.converters import convert_file

    q = tmp_path / "kivi.nnef.tgz"
    convert_file(LLAMA, q, scheme="kivi")
    rc = main(["compare", str(q), "--schemes", "kivi:4", "--context", "96", "--eval-tokens", "4",
               "--tokenizer", str(LLAMA.parent / "tokenizer.json")])
    err = capsys.readouterr().err
    assert rc == 2 and "holds a quantized KV cache already (nnef_kv_kivi_sdpa" in err and err.count("\n") == 1


def _die_on_odd(shared, item, tick):
    import os

    if item % 2:
        os._exit(3)  # the worker process dies
    return item * shared


def test_a_dead_worker_is_a_result_not_an_abort():
    from nnef_kv.validate.jobs import run_tasks

    got, where = run_tasks(_die_on_odd, 10, [0, 1, 2], ["a", "b", "c"], jobs=1, show_progress=False,
                           on_error=lambda item, exc: f"died: {type(exc).__name__}")
    assert got[0] == 0 and got[1].startswith("died: ") and "process pool" in where
    with pytest.raises(Exception):
        run_tasks(_die_on_odd, 10, [1], ["b"], jobs=1, show_progress=False)


# -- issue 22: paired differences, the significant front; issue 23.9: reasons, Ctrl-C ---------------------
def _row(name, kv_bytes, kl_tokens):
    from nnef_kv.validate.compare import SchemeRow

    kl = [float(x) for x in kl_tokens]
    return SchemeRow(name, "measured", per_context=[{"context": 64, "kv_bytes": kv_bytes, "kl_tokens": kl,
                                                     "kl_mean": sum(kl) / len(kl)}])


def test_the_significant_front_keeps_rows_a_rerun_could_reorder():
    """Four rows on the same 512 predictions: b (more bytes than a, KL lower by noise only) stays on the
    front; c (more bytes than a and KL higher beyond the noise) is off it; d is the baseline (lowest KL)."""
    import numpy as np

    from nnef_kv.validate.compare import CompareReport, paired

    rng = np.random.default_rng(1)
    text = np.exp(rng.standard_normal(512))  # what the text costs every scheme
    rows = [_row("a", 100, 0.010 * text + 1e-4 * rng.standard_normal(512)),
            _row("b", 120, 0.010 * text + 1e-4 * rng.standard_normal(512)),
            _row("c", 130, 0.020 * text),
            _row("d", 200, 0.001 * text)]
    rep = CompareReport("x", "t", [64], 128, rows, starts=[64, 400, 800, 1200])
    paired(rep)
    at = {r.scheme: r.at(64) for r in rows}
    assert rep.baseline == {64: "d"} and at["d"]["kl_diff"] == 0 and at["d"]["kl_diff_ci95"] == [0.0, 0.0]
    assert {k for k, s in at.items() if s["pareto"]} == {"a", "b", "d"}
    assert at["c"]["kl_diff_significant"] and at["c"]["kl_diff_ci95"][0] > 0
    lo, hi = at["a"]["kl_diff_ci95"]
    assert lo <= at["a"]["kl_diff"] <= hi
    paired(rep, baseline="a")  # another baseline, as --baseline gives
    assert rep.baseline == {64: "a"} and at["a"]["kl_diff"] == 0 and not at["b"]["kl_diff_significant"]


def test_the_table_shows_the_short_reason():
    from nnef_kv.validate.compare import short_reason

    long = ("measure: /very/long/path/to/the/archive/graph.nnef: line 12: nnef_kv_ggml_sdpa 'attn0': head_dim D "
            "= 16 is not a multiple of 32")
    assert short_reason(long) == "measure: head_dim D = 16 is not a multiple of 32"
    got = short_reason("convert: scheme ggml: --group-size 7: must divide 64")
    assert got == "convert: --group-size 7: must divide 64"  # a short cause keeps what it is about
    assert short_reason("the job's worker died: BrokenProcessPool") == "the job's worker died: BrokenProcessPool"
    assert short_reason("") == ""


def test_ctrl_c_keeps_and_prints_the_rows_measured(monkeypatch, tmp_path, capsys):
    """Ctrl-C during the jobs: the rows finished are kept, printed and written; the others say "not run";
    exit 130."""
    import numpy as np

    import nnef_kv
    from nnef_kv.models import DecoderConfig, build_decoder
    from nnef_kv.validate import jobs
    from nnef_kv.validate.compare import run_job

    real = jobs.run_tasks

    def interrupted(fn, shared, items, labels, **kw):
        done, where = real(fn, shared, items[:1], labels[:1], **kw)
        raise jobs.Interrupted(done + [None] * (len(items) - 1), where)

    monkeypatch.setattr(jobs, "run_tasks", interrupted)
    path = tmp_path / "f32.nnef.tar"
    nnef_kv.save(build_decoder(DecoderConfig(vocab=256, hidden=32, layers=1, heads=2, kv_heads=1, head_dim=8,
                                             mlp=32, seed=3)), path)
    out = tmp_path / "rep"
    ids = tmp_path / "ids.npy"
    np.save(ids, np.random.default_rng(0).integers(0, 256, 400))
    rc = main(["compare", str(path), "--ids", str(ids), "--schemes", "kivi:4+residual=16,kivi:2+residual=16",
               "--context", "64", "--eval-tokens", "8", "--windows", "2", "--no-tract", "--jobs", "1",
               "--report-dir", str(out)])
    printed = capsys.readouterr().out
    assert rc == 130 and run_job is not None
    assert "interrupted (Ctrl-C): 1 of 2 schemes measured" in printed
    rep = json.loads((out / "report.json").read_text())
    rows = {r["scheme"]: r for r in rep["rows"]}
    assert rep["interrupted"] and rows["kivi:4+residual=16"]["status"] == "measured"
    assert rows["kivi:2+residual=16"]["reason"] == "not run: interrupted (Ctrl-C)"
