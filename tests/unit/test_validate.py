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
    return run_decode(InterpreterDecoder(f32_model), PROMPT, 40)


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


def test_round_trip_hashes_the_second_write_as_save_writes_it(f32_model, tmp_path) -> None:
    """The second write is hashed as it is made (never put on disk): the hash of the file save writes."""
    import hashlib

    from nnef_kv.validate.roundtrip import _tar_sha256

    path = nnef_kv.save(f32_model, tmp_path / "m.nnef.tar")
    assert _tar_sha256(f32_model) == hashlib.sha256(path.read_bytes()).hexdigest()
    assert check_round_trip(f32_model).sha256 == hashlib.sha256(path.read_bytes()).hexdigest()


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
    # the second write (of what was read back) differs, member by member: the changed and the dropped tensor
    assert any(p.startswith("second write differs") and "lm_head.weight.dat" in p and "model.norm.weight.dat" in p
               for p in r.problems), r.problems


# -- validation on text -------------------------------------------------------------------------------
TEXT_CFG = DecoderConfig(vocab=256, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, mlp=64, seed=11)


@pytest.fixture(scope="module")
def text_ref(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "f32.nnef.tar"
    nnef_kv.save(build_decoder(TEXT_CFG), path)
    return nnef_kv.load(path)


@pytest.fixture(scope="module")
def source():
    from nnef_kv.text import byte_level_tokenizer, sample_text, token_source

    return token_source(prompt=sample_text(), tokenizer=byte_level_tokenizer())


def _kivi(model, bits, **kw):
    from nnef_kv.converters import convert

    opts = dict(key_group=16, value_group=8, residual=16)
    opts.update(kw)
    return convert(model, scheme="kivi", bits=bits, **opts)[0]


def test_teacher_forced_predictions_equal_one_token_calls(text_ref, source) -> None:
    """The N predictions of a context are those of the tokens L .. L+N-1: the prefill's last position,
    then each fed token's own (stepwise, as one-token calls would give them)."""
    from nnef_kv.validate.runner import _measure

    ids, L, N = source.ids, 100, 12
    dec = InterpreterDecoder(_kivi(text_ref, 4))
    m = _measure(dec, ids, L, N, None, None)
    one = InterpreterDecoder(_kivi(text_ref, 4))
    want = [one(np.asarray(ids[:L]))] + [one(np.asarray([t])) for t in ids[L:L + N - 1]]
    np.testing.assert_allclose(m.logits, np.stack(want), rtol=0, atol=1e-5 * np.abs(want).max())
    assert m.reads[0] == 0 and (m.reads[1:] > 0).all()  # the prefill itself is read in full precision


def test_kl_grows_as_bits_fall_and_every_context_reads_quantized(text_ref, source) -> None:
    opts = ValidateOptions(contexts=[96, 300], eval_tokens=32, windows=2, parity=False)
    reps = {b: validate_model(_kivi(text_ref, b), text_ref, source, opts) for b in (8, 4, 2)}
    for rep in reps.values():
        assert rep.verdict == "measured" and rep.ok, [c.to_dict() for c in rep.checks]
        for res in rep.contexts:
            s = res.summary()
            assert s["quantized_tokens"] > 0 and s["tokens_reading_quantized"] > 0
            assert 0 < s["kv_bytes"] < s["kv_bytes_f32"]
    for i in range(2):
        kl = [reps[b].contexts[i].summary()["kl_mean"] for b in (8, 4, 2)]
        assert 0 < kl[0] < kl[1] < kl[2]
        assert kl[0] < 1e-4


def test_reference_against_itself(text_ref, source) -> None:
    rep = validate_model(text_ref, text_ref, source, ValidateOptions(contexts=[64], eval_tokens=16, parity=False))
    s = rep.contexts[0].summary()
    assert s["kl_max"] == 0.0 and s["top1_agreement"] == 1.0 and s["ppl_ratio"] == 1.0
    assert s["attention_deviation"]["max"] == 0.0
    # nothing quantized: not a pass, whatever the figures
    assert rep.verdict == "fail" and "no quantized KV cache" in " ".join(c.detail for c in rep.checks if not c.ok)


def test_vacuous_context_fails_and_a_long_one_measures(text_ref, source) -> None:
    """Both ends: a context inside the full-precision window (residual 32 + key_group 32) is refused as
    measuring nothing; the default context measures a quantized regime."""
    m = _kivi(text_ref, 4, key_group=32, value_group=8, residual=32)
    short = validate_model(m, text_ref, source, ValidateOptions(contexts=[20], eval_tokens=16, parity=False))
    assert short.verdict == "fail"
    msg = next(c.detail for c in short.checks if not c.ok)
    assert msg == ("nothing was quantized: context 20 fits in the full-precision window (residual 32 + key_group 32); "
                   "use --context >= 512")
    default = validate_model(m, text_ref, source, ValidateOptions(eval_tokens=16, parity=False))
    assert [r.context for r in default.contexts] == [512] and default.verdict == "measured"
    assert default.contexts[0].summary()["quantized_tokens"] >= 512 - 63


def test_thresholds_pass_and_fail(text_ref, source) -> None:
    m = _kivi(text_ref, 2)
    base = dict(contexts=[128], eval_tokens=24, parity=False)
    ok = validate_model(m, text_ref, source, ValidateOptions(**base, max_kl=10.0, min_token_agreement=0.0,
                                                             max_ppl_ratio=100.0, max_attention_deviation=10.0))
    assert ok.verdict == "pass", [c.to_dict() for c in ok.checks]
    bad = validate_model(m, text_ref, source, ValidateOptions(**base, max_kl=0.0, max_attention_deviation=1e-9))
    assert bad.verdict == "fail"
    assert {c.name for c in bad.checks if not c.ok} == {"max kl @ 128", "max attention deviation @ 128"}
    alone = validate_model(m, None, source, ValidateOptions(**base, max_kl=1.0))
    assert alone.verdict == "fail" and "needs a reference" in " ".join(c.detail for c in alone.checks)
    assert alone.contexts[0].summary()["ppl"] > 1  # the archive's own perplexity is still measured


def test_different_and_quantized_references_are_refused(text_ref, source) -> None:
    other = build_decoder(DecoderConfig(**{**TEXT_CFG.to_dict(), "seed": 12}))
    m = _kivi(text_ref, 4)
    opts = ValidateOptions(contexts=[64], eval_tokens=8, parity=False)
    with pytest.raises(nnef_kv.InputError, match="not the same model as the archive"):
        validate_model(m, other, source, opts)
    with pytest.raises(nnef_kv.InputError, match="holds a quantized KV cache itself"):
        validate_model(m, _kivi(text_ref, 2), source, opts)
    rep = validate_model(m, other, source, ValidateOptions(contexts=[64], eval_tokens=8, parity=False,
                                                           allow_different_weights=True))
    assert rep.contexts[0].summary()["top1_agreement"] < 0.9  # a different model, measured on request


@pytest.mark.parametrize("opts,match", [
    (dict(contexts=[9_000]), "the model must hold"),
    (dict(contexts=[8150]), "tokens of text, the text has 8150"),
    (dict(max_kl=float("nan")), "not a number"),
    (dict(min_token_agreement=2.0), r"in \[0, 1\]"),
    (dict(eval_tokens=0), "must be an integer >= 1"),
])
def test_bad_options_are_refused_before_decoding(text_ref, source, opts, match, monkeypatch) -> None:
    import nnef_kv.validate.runner as runner

    monkeypatch.setattr(runner, "_measure", lambda *a, **k: pytest.fail("decoded before refusing"))
    model = build_decoder(DecoderConfig(**{**TEXT_CFG.to_dict(), "max_positions": 9000}))
    with pytest.raises(nnef_kv.InputError, match=match):
        validate_model(_kivi(model, 4), model, source, ValidateOptions(**opts))


def test_ids_outside_the_vocabulary_name_the_option(text_ref) -> None:
    from nnef_kv.text import token_source

    src = token_source(ids=[1, 2, 300, 4] * 100, names={"ids": "--ids"})
    with pytest.raises(
        nnef_kv.InputError, match=r"^--ids: token id 300 at position 2 is outside the model's vocabulary of 256"
    ):
        validate_model(_kivi(text_ref, 4), text_ref, src, ValidateOptions(contexts=[64], eval_tokens=8))


def test_chunked_prefill_is_near_the_one_call_prefill(text_ref, source) -> None:
    m = _kivi(text_ref, 4)
    one = validate_model(m, text_ref, source, ValidateOptions(contexts=[256], eval_tokens=16, parity=False))
    chunked = validate_model(
        m, text_ref, source, ValidateOptions(contexts=[256], eval_tokens=16, chunk=64, parity=False)
    )
    a, b = one.contexts[0], chunked.contexts[0]
    assert b.chunk == 64 and b.archive.reads[0] > 0 == a.archive.reads[0]  # earlier chunks are read quantized
    assert b.summary()["kl_mean"] < 10 * a.summary()["kl_mean"] + 1e-6


def test_report_files(tmp_path, text_ref, source) -> None:
    rep = validate_model(_kivi(text_ref, 4), text_ref, source,
                         ValidateOptions(contexts=[64, 200], eval_tokens=16, parity=False, max_kl=1.0))
    paths = write_report(rep, tmp_path / "rep")
    assert sorted(p.name for p in paths) == ["report.json", "report.md", "report.png"]
    data = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert data["verdict"] == "pass" and [c["context"] for c in data["contexts"]] == [64, 200]
    keys = {"context", "eval_tokens", "kl_mean", "kl_p99", "top1_agreement", "ppl_reference", "ppl", "quantized_tokens",
            "full_precision_tokens", "kv_bytes", "kv_bytes_f32"}
    for c in data["contexts"]:
        assert keys <= set(c)
        assert len(c["per_token"]["kl"]) == 16 * c["windows"] == c["predictions"]
        assert len(c["per_token"]["attention_deviation"][0]) == TEXT_CFG.layers
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "**Verdict: PASS**" in md and "## context 200" in md and "Mean KLD" in md
    assert (tmp_path / "rep" / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in (tmp_path / "rep").iterdir() if p.name.startswith(".")]  # no temporaries left


@requires_shared
@pytest.mark.parametrize("name", ["llama_gqa", "gpt2"])
def test_shared_fixture_decoders_at_8_4_2_bits(name, source) -> None:
    """The shared torch-to-nnef decoders (no tokenizer of their own: the byte-level one, ids < 320),
    converted with a residual small enough that most tokens are quantized."""
    ref = nnef_kv.load(FIXTURES / name / "model.nnef.tgz")
    opts = ValidateOptions(contexts=[200], eval_tokens=32, windows=2, parity=False)
    kl = []
    for bits in (8, 4, 2):
        rep = validate_model(_kivi(ref, bits, key_group=16, value_group=16, residual=16), ref, source, opts)
        s = rep.contexts[0].summary()
        assert rep.ok and s["quantized_tokens"] > 0
        # all but each window's prefill prediction (read in full precision)
        assert s["tokens_reading_quantized"] == 31 * s["windows"]
        kl.append(s["kl_mean"])
    assert kl[0] < kl[1] < kl[2] and kl[0] < 1e-4


@requires_tract
def test_tract_parity_on_tract_cache_archive(text_ref, source) -> None:
    from nnef_kv.converters import convert

    m = convert(text_ref, scheme="tract-cache", bits=8)[0]
    rep = validate_model(m, text_ref, source, ValidateOptions(contexts=[100], eval_tokens=24))
    assert rep.parity is not None and rep.parity.status == "ok", rep.parity
    assert rep.parity.calls == 24 and rep.parity.max_abs < 1e-4
    assert rep.ok and rep.verdict == "measured"


@requires_shared
def test_export_with_its_own_tokenizer_through_the_api(tmp_path) -> None:
    """A torch-to-nnef export and the tokenizer.json it ships: nnef_kv.validate on a text file, default
    context (capped by the model's 256 positions), 8/4/2-bit KIVI with the default residual 32."""
    from nnef_kv.converters import convert
    from nnef_kv.text import sample_text

    folder = FIXTURES / "exports" / "llama_default"
    text = tmp_path / "text.txt"
    text.write_text(sample_text())
    ref = nnef_kv.load(folder / "model.nnef.tgz")
    kl = []
    for bits in (8, 4, 2):
        out = tmp_path / f"k{bits}.nnef.tgz"
        nnef_kv.save(convert(ref, bits=bits)[0], out)
        rep = nnef_kv.validate(out, folder / "model.nnef.tgz", text=text, tokenizer=folder / "tokenizer.json",
                               eval_tokens=32, windows=2, parity=False)
        (res,) = rep.contexts
        assert res.context == 256 - 32 and rep.verdict == "measured"  # S+P < 256: 224 + 32 - 1 = 255 positions
        s = res.summary()
        assert s["quantized_tokens"] == 192 and s["tokens_reading_quantized"] == 31 * s["windows"]
        kl.append(s["kl_mean"])
    assert kl[0] < kl[1] < kl[2] and kl[0] < 1e-4


def test_bytes_used_beside_bytes_held_at_short_lengths(text_ref, source) -> None:
    """tract's quantized dyn cache grows its codes by 256 tokens: below that it holds more than f32; the
    bytes it has written are reported beside."""
    from nnef_kv.converters import convert

    m = convert(text_ref, scheme="tract-cache", bits=4)[0]
    rep = validate_model(m, text_ref, source, ValidateOptions(contexts=[40], eval_tokens=8, parity=False))
    s = rep.contexts[0].summary()
    assert s["kv_bytes"] > s["kv_bytes_f32"] > s["kv_bytes_used"] > 0
    for c in rep.contexts[0].archive.census:
        assert c["bytes_used"] <= c["bytes"]


@requires_shared
@requires_tract
def test_f16_archive_tract_parity_follows_its_dtype() -> None:
    """An f16 export converted to tract's quantized dyn cache: parity with tract judged with the f16
    tolerance (an f32-sized one failed it at argmax agreement 1.000)."""
    from nnef_kv.converters import convert
    from nnef_kv.text import token_source

    d = FIXTURES / "exports" / "llama_f16"
    ref = nnef_kv.load(d / "model.nnef.tgz")
    src = token_source(prompt=open(d / "config.json").read() * 3, tokenizer=d / "tokenizer.json")
    rep = validate_model(convert(ref, scheme="tract-cache", bits=8)[0], ref, src,
                         ValidateOptions(contexts=[120], eval_tokens=16))
    p = rep.parity
    assert p.status == "ok" and p.atol >= 1e-3 and p.rtol == 2e-2 and p.max_abs > 1e-4, p
    assert "quantized-cache term" in p.reason, p  # the f16 atol plus the code-flip term (validate/parity.py)
    strict = validate_model(convert(ref, scheme="tract-cache", bits=8)[0], ref, src,  # --parity-atol/--parity-rtol
                            ValidateOptions(contexts=[120], eval_tokens=16, parity_atol=1e-6, parity_rtol=0.0))
    assert strict.parity.status == "mismatch" and (strict.parity.atol, strict.parity.rtol) == (1e-6, 0.0)
    assert not strict.ok and "tract parity" in {c.name for c in strict.checks if not c.ok}


# -- issue 22: windows, intervals, NaN logits, defaults, hints; issue 23: API and progress ---------------------
def test_windows_predict_the_same_tokens_at_every_context_and_figures_carry_intervals(text_ref, source) -> None:
    """Two contexts, three windows: the same predicted text tokens at both contexts (only the prefill's length
    differs); every mean has its 95% interval around it; the count behind the figures is given."""
    opts = ValidateOptions(contexts=[64, 200], eval_tokens=48, windows=3, parity=False, round_trip=False)
    rep = validate_model(_kivi(text_ref, 4), text_ref, source, opts)
    a, b = rep.contexts
    assert a.starts == b.starts and len(a.starts) == 3 and a.text_positions == b.text_positions
    assert a.targets == [source.ids[i] for i in a.text_positions]
    assert all(s2 - s1 >= 200 + 48 for s1, s2 in zip(a.starts, a.starts[1:]))  # disjoint windows
    for res in rep.contexts:
        s = res.summary()
        assert s["predictions"] == 144 and s["windows"] == 3 and s["nonfinite_predictions"] == 0
        for key, ci in (("kl_mean", "kl_mean_ci95"), ("top1_agreement", "top1_agreement_ci95"),
                        ("ppl_ratio", "ppl_ratio_ci95"), ("ppl", "ppl_ci95")):
            assert s[ci][0] <= s[key] <= s[ci][1], (key, s[key], s[ci])
        assert s["kl_mean_ci95"][0] >= 0 and 0 <= s["top1_agreement_ci95"][0] <= s["top1_agreement_ci95"][1] <= 1
        # the Python API reads the figures as attributes (README: report.contexts[0].kl_mean)
        assert res.kl_mean == s["kl_mean"] and res.kl_mean_ci95 == s["kl_mean_ci95"] and res.predictions == 144
    with pytest.raises(AttributeError, match="no attribute 'kl_mea'"):
        a.kl_mea
    seeded = validate_model(_kivi(text_ref, 4), text_ref, source,
                            ValidateOptions(contexts=[64], eval_tokens=48, windows=3, windows_seed=5, parity=False,
                                            round_trip=False))
    assert seeded.contexts[0].starts != a.starts  # another seed, other windows


def test_percentiles_of_64_values_are_not_printed(text_ref, source) -> None:
    from nnef_kv.validate.report import format_summary

    rep = validate_model(_kivi(text_ref, 2), text_ref, source,
                         ValidateOptions(contexts=[64], eval_tokens=64, windows=1, parity=False, round_trip=False))
    s = rep.contexts[0].summary()
    assert s["predictions"] == 64
    assert s["kl_p99"] is None and s["kl_p99_9"] is None  # 64 values: p99 would be their maximum
    assert s["kl_p90"] is not None and s["kl_median"] is not None
    rows = dict(format_summary(s))
    assert rows["99.0% KLD"] == "- (too few predictions for p99)" and rows["Maximum KLD"] != "-"
    assert "[" in rows["Mean KLD"] and rows["predictions behind the figures"].startswith("64;")


def test_nan_logits_are_counted_never_compared(text_ref, source) -> None:
    """All-NaN logits in some predictions: counted, left out of KL / same-top / ppl (never "the same top"),
    and a failed check naming how many."""
    from nnef_kv.validate.results import ContextResult, Measurement
    from nnef_kv.validate.runner import _finite_checks
    from nnef_kv.validate.results import ValidationReport

    rng = np.random.default_rng(0)
    ref = rng.standard_normal((40, 16)).astype(np.float32)
    mine = ref + 0.01 * rng.standard_normal((40, 16)).astype(np.float32)
    mine[[3, 7, 8]] = np.nan
    ref[11, 2] = np.inf
    targets = [int(t) for t in rng.integers(0, 16, 40)]

    def meas(lg):
        return Measurement(lg, [], np.ones(40, np.int64), [], 0, 0, 0.0, starts=[100, 300])

    res = ContextResult(100, 20, None, targets, meas(mine), meas(ref), starts=[100, 300])
    s = res.summary()
    assert s["nonfinite_predictions"] == 4 and s["nonfinite_archive"] == 3 and s["nonfinite_reference"] == 1
    assert s["predictions"] == 36 and math.isfinite(s["kl_mean"]) and math.isfinite(s["ppl_ratio"])
    ok = res.finite_rows()
    tm = res.token_measures()
    assert s["top1_agreement"] == pytest.approx(float(np.mean(tm["top1"][ok])))
    assert res.to_dict()["per_token"]["top1"][3] is None  # not "same top"
    rep = ValidationReport(archive="a", reference="r", options=ValidateOptions(), contexts=[res])
    _finite_checks(rep)
    (c,) = rep.checks
    assert not c.ok and c.detail.startswith("4 of 40 predictions have NaN or Inf logits (archive 3, reference 1)")


def test_thresholds_are_judged_on_the_interval_bound(text_ref, source) -> None:
    """--max-kl between the mean and the interval's upper bound: a FAIL that says why."""
    m = _kivi(text_ref, 2)
    base = dict(contexts=[128], eval_tokens=64, windows=2, parity=False, round_trip=False)
    s = validate_model(m, text_ref, source, ValidateOptions(**base)).contexts[0].summary()
    lo, hi = s["kl_mean_ci95"]
    assert lo < s["kl_mean"] < hi
    mid = (s["kl_mean"] + hi) / 2
    rep = validate_model(m, text_ref, source, ValidateOptions(**base, max_kl=mid))
    (c,) = [c for c in rep.checks if c.name.startswith("max kl")]
    assert not c.ok and f"upper bound {hi:.4g} > limit {mid:g}" in c.detail and "judged on the interval" in c.detail
    assert validate_model(m, text_ref, source, ValidateOptions(**base, max_kl=hi * 1.01)).verdict == "pass"


def test_default_plan_is_one_rule_for_validate_compare_and_auto_bits(text_ref, source) -> None:
    """The same archive and settings give the same default context and windows in validate, compare and
    auto-bits (compare derives the full-precision window from the schemes it converts)."""
    from nnef_kv.text import TokenSource
    from nnef_kv.validate.compare import CompareOptions, SchemeSpec, prepare, spec_windows
    from nnef_kv.validate.results import DEFAULT_EVAL_TOKENS

    kw = dict(key_group=32, value_group=8, residual=32)
    rep = validate_model(_kivi(text_ref, 4, **kw), text_ref, source, ValidateOptions(parity=False, round_trip=False))
    spec = SchemeSpec("kivi:4", "kivi", tuple(sorted({"bits": 4, **kw}.items())))
    fp = spec_windows(text_ref, [spec])
    assert fp == [k["fp_window"] for k in rep.kv_ops]
    job, notes = prepare(text_ref, TokenSource(ids=list(source.ids), option="--text", description="t"),
                         CompareOptions(), "f32", windows=fp)
    assert job.contexts == [r.context for r in rep.contexts] == [512]
    assert job.eval_tokens == rep.contexts[0].eval_tokens == DEFAULT_EVAL_TOKENS
    assert job.starts == rep.contexts[0].starts and len(job.starts) == 4
    assert "context 512 (default: 8 x the full-precision window 64)" in notes


def test_no_hint_the_model_cannot_satisfy() -> None:
    """A context that reads nothing quantized gets a hint only when a context that would read quantized
    entries fits in the model (255 positions here) and the text; else what to change instead."""
    from nnef_kv.validate.runner import _context_hint

    assert _context_hint("--context", 64, 16, None, 5000) == "use --context >= 512"
    assert _context_hint("--context", 64, 32, 255, 5000) == ("use --context 224 (the longest the model and the "
                                                             "text allow; > 64 reads quantized entries)")
    msg = _context_hint("--context", 288, 32, 255, 5000)
    assert "--context >=" not in msg and "the model holds 255 positions" in msg and "--residual" in msg
    assert "the text has 300 tokens" in _context_hint("--context", 288, 32, None, 300)


@requires_shared
def test_impossible_hint_is_never_printed_on_a_bounded_export(tmp_path) -> None:
    """The torch-to-nnef export holds 255 positions; KIVI with a 400-token residual can never read a quantized
    entry there: the failed check says so instead of `use --context >= 3456`."""
    from nnef_kv.converters import convert

    folder = FIXTURES / "exports" / "llama_default"
    ref = nnef_kv.load(folder / "model.nnef.tgz")
    rep = nnef_kv.validate(convert(ref, bits=4, residual=400)[0], ref, ids=list(range(2, 250)) * 3, contexts=[100],
                           eval_tokens=16, parity=False)
    (c,) = [c for c in rep.checks if not c.ok]
    assert "no context can read a quantized entry here (the model holds 255 positions" in c.detail
    assert ">=" not in c.detail


def test_api_contexts_must_be_a_list_named_by_the_parameter(text_ref, source) -> None:
    for bad in (128, "128"):
        with pytest.raises(nnef_kv.InputError) as e:
            nnef_kv.validate(text_ref, text_ref, ids=list(source.ids[:600]), contexts=bad)
        assert str(e.value) == f"contexts={bad!r}: a list of context lengths is expected (e.g. contexts=[128, 512])"


@requires_shared
def test_tokenizer_is_found_beside_the_reference(tmp_path) -> None:
    """The archive under test written elsewhere (no tokenizer beside it): the export's tokenizer, beside the
    --reference, is used and named."""
    from nnef_kv.converters import convert

    folder = FIXTURES / "exports" / "llama_default"
    ref = folder / "model.nnef.tgz"
    out = tmp_path / "alone" / "k4.nnef.tgz"
    out.parent.mkdir()
    nnef_kv.save(convert(nnef_kv.load(ref), bits=4, residual=16)[0], out)
    rep = nnef_kv.validate(out, ref, prompt="We hold these truths to be self-evident, " * 20, contexts=[64],
                           eval_tokens=8, windows=1, parity=False)
    assert f"tokenizer found next to the reference: {folder / 'tokenizer.json'}" in rep.notes


def test_progress_total_is_known_before_the_work(text_ref, source) -> None:
    class Bar:
        def __init__(self):
            self.totals, self.n = [], 0

        def __call__(self, n=1):
            self.n += n

        def set_total(self, total):
            self.totals.append(total)

    bar = Bar()
    validate_model(_kivi(text_ref, 4), text_ref, source,
                   ValidateOptions(contexts=[64, 100], eval_tokens=8, windows=2, chunk=40, parity=False,
                                   round_trip=False), progress=bar)
    # per window: ceil(L / 40) prefill calls + the stepwise run, for the archive and the reference
    assert bar.totals[0] == 2 * 2 * ((2 + 1) + (3 + 1)) == bar.n and bar.totals[-1] == bar.n
