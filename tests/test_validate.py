"""nnef_kv.validate: metrics, attention capture, decode driver, round trip, parity, numeric cost, reports."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

import nnef_kv
from nnef_kv.models import DecoderConfig, build_decoder, empty_cache
from nnef_kv.validate import (
    InterpreterDecoder,
    ValidateOptions,
    check_round_trip,
    detect_signature,
    kl_divergence,
    numeric_cost,
    reference_trace,
    rel_l2,
    run_decode,
    summary_stats,
    validate_model,
    write_report,
)
from nnef_kv.validate.capture import attention_step_indices, run_capturing

from conftest import FIXTURES, requires_shared, requires_tract

CFG = DecoderConfig(vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, mlp=64, seed=11)
PROMPT = [int(i) for i in np.random.default_rng(2).integers(0, CFG.vocab, 40)]


@pytest.fixture(scope="module")
def f32_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "f32.nnef.tar"
    nnef_kv.save(build_decoder(CFG), path)
    return nnef_kv.load(path)


@pytest.fixture(scope="module")
def ref_trace(f32_model):
    return reference_trace(f32_model, PROMPT, 40)


def _converted(model, **kw):
    from nnef_kv.converters import convert

    return convert(model, key_group=16, value_group=16, residual=16, **kw)[0]


# -- metrics -----------------------------------------------------------------------------------
def test_rel_l2_and_kl_values() -> None:
    ref = np.array([3.0, 4.0])
    assert rel_l2(ref, ref) == 0.0
    assert rel_l2(np.array([3.0, 5.0]), ref) == pytest.approx(1 / 5)
    assert math.isnan(rel_l2(np.array([np.nan, 4.0]), ref))
    p_logits, q_logits = np.array([0.0, 0.0]), np.array([0.0, np.log(3.0)])
    want = 0.5 * np.log(0.5 / 0.25) + 0.5 * np.log(0.5 / 0.75)
    assert kl_divergence(p_logits, q_logits) == pytest.approx(want, rel=1e-12)
    x = np.random.default_rng(0).standard_normal((5, 50))
    assert np.all(kl_divergence(x, x) == 0.0)
    assert np.all(kl_divergence(x, x[:, ::-1]) > 0.0)
    st = summary_stats([1.0, 2.0, 3.0, 4.0])
    assert st["mean"] == 2.5 and st["max"] == 4.0 and st["p50"] == 2.5


# -- capture and decode ------------------------------------------------------------------------
def test_capture_finds_one_attention_per_layer_and_matches_run(f32_model) -> None:
    s = f32_model.session()
    idx = attention_step_indices(s.plan)
    assert len(idx) == CFG.layers
    feed = dict(empty_cache(CFG), input_ids=np.array([PROMPT[:7]], np.int64))
    outs, caps = run_capturing(s, feed, idx)
    plain = f32_model.session().run(feed)
    for k in plain:
        np.testing.assert_array_equal(outs[k], plain[k])
    assert [c.shape for c in caps] == [(1, CFG.heads, 7, CFG.head_dim)] * CFG.layers


def test_capture_on_kivi_archive(f32_model) -> None:
    m = _converted(f32_model, scheme="kivi", bits=4)
    s = m.session()
    idx = attention_step_indices(s.plan)
    assert [s.plan.step_nodes[i].op for i in idx] == ["nnef_kv_kivi_sdpa"] * CFG.layers


def test_detect_signature_explicit_and_session(f32_model) -> None:
    sig = detect_signature(f32_model.session().plan)
    assert sig.explicit and sig.ids_input == "input_ids" and sig.logits_output == "outputs"
    assert sig.cache_outputs["in_cache_value_1"] == "out_cache_value_1"
    assert sig.empty_caches()["in_cache_key_0"].shape == (1, CFG.kv_heads, 0, CFG.head_dim)
    dyn = detect_signature(build_decoder(DecoderConfig(**{**CFG.to_dict(), "cache": "dyn"})).session().plan)
    assert not dyn.explicit and dyn.input_names == ["input_ids"]


def test_teacher_forced_decode_equals_greedy_when_fed_its_own_tokens(f32_model, ref_trace) -> None:
    again = run_decode(InterpreterDecoder(f32_model), PROMPT, 40, tokens=ref_trace.tokens)
    np.testing.assert_array_equal(again.logits, ref_trace.logits)
    assert ref_trace.tokens[len(PROMPT):] == ref_trace.predictions[:-1]
    assert ref_trace.kv_bytes["total"] == 2 * CFG.layers * CFG.kv_heads * (len(PROMPT) + 40) * CFG.head_dim * 4


@requires_shared
def test_decode_driver_reproduces_fixture_logits() -> None:
    d = np.load(FIXTURES / "llama_gqa" / "decode_io.npz")
    model = nnef_kv.load(FIXTURES / "llama_gqa" / "model.nnef.tgz")
    tok, n = [int(t) for t in d["tokens"]], int(d["n_prompt"])
    trace = run_decode(InterpreterDecoder(model), tok[:n], int(d["n_steps"]), tokens=tok)
    np.testing.assert_allclose(trace.logits, d["logits"], atol=1e-4, rtol=0)


# -- round trip ----------------------------------------------------------------------------------
def test_round_trip_ok(f32_model) -> None:
    r = check_round_trip(f32_model)
    assert r.ok, r.problems
    assert r.tensors == len(f32_model.tensors) and r.written_bytes > 0


def test_round_trip_reports_what_does_not_survive(f32_model, monkeypatch) -> None:
    """A reader that changes one tensor value and drops another: the check names both."""
    import nnef_kv.io.archive as archive

    real_load = archive.load

    def lossy_load(path, *a, **kw):
        m = real_load(path, *a, **kw)
        t = dict(m.tensors)
        w = np.array(t["lm_head.weight"], copy=True)
        w[0, 0] = np.nextafter(w[0, 0], np.float32(np.inf))
        t["lm_head.weight"] = w
        del t["model.norm.weight"]
        m.tensors = t
        return m

    monkeypatch.setattr(archive, "load", lossy_load)
    r = check_round_trip(f32_model)
    assert not r.ok
    assert any("lm_head.weight" in p and "differs" in p for p in r.problems)
    assert any("model.norm.weight" in p and "missing" in p for p in r.problems)


# -- numeric cost ----------------------------------------------------------------------------------
def test_reference_against_itself_costs_nothing(f32_model, ref_trace) -> None:
    cost, _ = numeric_cost(f32_model, ref_trace)
    assert cost.attention_max == 0.0 and cost.token_agreement == 1.0
    assert max(cost.kl) == 0.0 and cost.kv_ratio == 1.0


def test_cost_grows_as_bits_shrink(f32_model, ref_trace) -> None:
    costs = {b: numeric_cost(_converted(f32_model, scheme="kivi", bits=b), ref_trace)[0] for b in (8, 4, 2)}
    dev = {b: c.attention_mean for b, c in costs.items()}
    kv = {b: c.kv_bytes["total"] for b, c in costs.items()}
    assert 0 < dev[8] < dev[4] < dev[2]
    assert kv[8] > kv[4] > kv[2] > 0
    assert costs[8].attention_max < 0.05
    assert costs[8].kl_stats()["mean"] < costs[2].kl_stats()["mean"]
    assert len(costs[4].attention) == 41 and len(costs[4].attention[0]) == CFG.layers


def test_validate_thresholds_and_report(tmp_path, f32_model, ref_trace) -> None:
    m = _converted(f32_model, scheme="kivi", bits=2)
    ok = validate_model(m, f32_model, ValidateOptions(steps=40, max_attention_deviation=10.0, min_token_agreement=0.0,
                                                      max_kl=10.0), ref_trace=ref_trace)
    assert ok.ok, [c.to_dict() for c in ok.checks]
    bad = validate_model(m, f32_model, ValidateOptions(steps=40, max_attention_deviation=1e-9, max_kl=0.0),
                         ref_trace=ref_trace)
    assert not bad.ok
    failed = {c.name for c in bad.checks if not c.ok}
    assert failed == {"max attention deviation", "max KL"}
    paths = write_report(bad, tmp_path / "rep")
    assert sorted(p.name for p in paths) == ["report.json", "report.md", "report.png"]
    data = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert data["ok"] is False and data["numeric_cost"]["calls"] == 41
    assert len(data["numeric_cost"]["steps"]) == 41
    assert data["tract_parity"]["status"] == "skipped" and "nnef_kv" in data["tract_parity"]["reason"]
    assert "FAIL" in (tmp_path / "rep" / "report.md").read_text()
    assert (tmp_path / "rep" / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in (tmp_path / "rep").iterdir() if p.name.startswith(".")]  # no temporaries left


@requires_tract
def test_tract_parity_on_tract_cache_archive(f32_model, ref_trace) -> None:
    m = _converted(f32_model, scheme="tract-cache", bits=8)
    rep = validate_model(m, f32_model, ValidateOptions(steps=40), ref_trace=ref_trace)
    assert rep.parity is not None and rep.parity.status == "ok", rep.parity
    assert rep.parity.calls == 41 and rep.parity.max_abs < 1e-4
    assert rep.ok
