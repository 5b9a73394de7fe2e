"""torch-to-nnef exports whose masks keep their sliding window (tests/fixtures/exports/*_window, made by
tools/make_window_exports.py: Mistral, Qwen2 with a full and a sliding layer, Gemma 2, Gemma 3 and GPT-OSS
(learned sinks, routed experts: tract_moe_ffn) alternating them; window 16, 112 tokens of HF's windowed model
in hf_ref.npz): the f32 archive is HF's windowed model, and the KIVI-8, ggml q8_0 and HF conversions follow it
past the window with bounded sliding layers; tract's fused op, which has no window, refuses; the tract-cache
conversion keeps it in the graph's mask; the GPT-OSS conversion validates on WikiText."""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest

import nnef_kv
from conftest import HAVE_TRACT, REPO
from nnef_kv.converters import convert
from nnef_kv.errors import ConversionError
from nnef_kv.validate.decode import InterpreterDecoder, TractDecoder
from nnef_kv.validate.metrics import kl_divergence
from nnef_kv.validate.parity import flip_bound

WINDOW = 16
DIRS = sorted(p for p in (REPO / "tests" / "fixtures" / "exports").glob("*_window") if (p / "hf_ref.npz").is_file())
#: each scheme at 8 bits; KIVI with every token past the first 4 read through its codes (no full-precision window)
SCHEMES = {"kivi": dict(bits=8, residual=0, key_group=4), "ggml": dict(key_type="q8_0", value_type="q8_0"),
           "hf": dict(backend="hqq", bits=8, group_size=32, residual=4)}


def _decode(dec, tokens, n, held=None):
    dec.reset()
    out = [dec(np.asarray(tokens[:n]))]
    for t in tokens[n:]:
        out.append(dec(np.asarray([t])))
        if held is not None:
            held.append(held_by_sliding_layers(dec))
    return np.stack(out)


def held_by_sliding_layers(dec) -> int:
    states = [s for s in dec.session.states if getattr(getattr(s, "cfg", None), "window", 0)]
    return sum(s.nbytes()["codes"] + s.nbytes()["params"] + s.nbytes()["full_precision"] for s in states)


@pytest.fixture(scope="module", params=DIRS, ids=lambda p: p.name)
def export(request):
    d = request.param
    h = np.load(d / "hf_ref.npz")
    return {"dir": d, "model": nnef_kv.load(d / "model.nnef.tgz"), "hf": h,
            "tokens": [int(t) for t in h["tokens"]], "n": int(h["n_prompt"])}


def test_the_five_architectures_are_here() -> None:
    assert [p.name for p in DIRS] == ["gemma2_window", "gemma3_window", "gptoss_window", "mistral_window",
                                      "qwen2_window"]


def test_the_f32_export_is_hf_s_windowed_model(export) -> None:
    h = export["hf"]
    got = _decode(InterpreterDecoder(export["model"]), export["tokens"], export["n"])
    assert got.shape[0] == 105
    past = slice(WINDOW, None)
    assert np.abs(got - h["logits"]).max() <= 1e-5
    assert np.abs(h["logits_windowless"] - h["logits"])[past].max() > 1.0  # the window matters past it


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_each_sliding_scheme_follows_the_window(export, scheme) -> None:
    try:
        model, report = convert(export["model"], scheme, **SCHEMES[scheme])
    except ConversionError as exc:  # Gemma 2 softcaps its scores: only KIVI's op (and tract-cache) computes that
        assert export["dir"].name == "gemma2_window" and scheme in ("ggml", "hf") and "softcapped" in str(exc)
        return
    if export["dir"].name == "gptoss_window":  # both layers' sink columns read, one logit a head
        assert sum("sink_logits" in n for n in report.notes) == 2
    windows = [n for n in report.notes if f"window = {WINDOW}" in n]
    assert len(windows) == (2 if "mistral" in export["dir"].name else 1)  # the others: one full, one sliding layer
    dec = InterpreterDecoder(model)
    held: list[int] = []
    got = _decode(dec, export["tokens"], export["n"], held)
    ref = export["hf"]["logits"]
    past = slice(WINDOW, None)  # 89 calls past the window
    same_top = float(np.mean(got[past].argmax(-1) == ref[past].argmax(-1)))
    kls = kl_divergence(ref[past], got[past])
    kl = float(kls.mean())
    lost = float(kl_divergence(ref[past], export["hf"]["logits_windowless"][past]).mean())  # without its window
    # every scheme follows the window: the same top-1, KL 50x below the windowless model's, the median below 1e-3;
    # KIVI-8 meets the figure on the mean (HF's hqq-8 on gptoss_window: one call, 55, at KL 0.26 makes its
    # mean 3.0e-3; that call is the worst of KIVI-4 and quanto-4 too, and residual 32 gives 2.6e-6)
    assert same_top >= 0.95 and kl < 0.02 * lost, (same_top, kl, lost)
    assert float(np.median(kls)) < 1e-3
    if scheme == "kivi":
        assert kl < 1e-3 and kl < 0.01 * lost, kl
    sliding = [st for st in dec.session.states if getattr(getattr(st, "cfg", None), "window", 0)]
    assert sliding and all(st.evicted > 0 for st in sliding)  # 112 tokens: every sliding layer dropped its front
    peak = export["n"] + 1 + int(np.argmax(held))  # the total held when the sliding layers' bytes peaked
    assert peak <= WINDOW + 64 + 4, (peak, held)  # the window + an eviction page of 64 (+ a key group); flat after


def test_ops_without_sink_logits_refuse_gpt_oss_sinks() -> None:
    """GPT-OSS's sliding layer is refused by rotated and tract for its window first; the sinks alone (its full
    layer) are refused naming the column and the schemes that keep them."""
    from types import SimpleNamespace

    from nnef_kv.converters.attention import find_attention
    from nnef_kv.converters.graph_edit import GraphEdit
    from nnef_kv.converters.passes import _check_scheme
    from nnef_kv.converters.schemes import SCHEMES

    d = next(p for p in DIRS if p.name == "gptoss_window")
    model = nnef_kv.load(d / "model.nnef.tgz")
    g = GraphEdit(model.document, model.tensors, str(d))
    g.make_ssa()  # the export assigns one name twice (an unused argmax of the scores in each layer)
    blocks, misses = find_attention(g)
    assert len(blocks) == 2 and not misses and all(len(b.sink_logits) == 4 for b in blocks)
    full = blocks[1]  # layer 1: full causal, sinks
    for name in ("rotated", "tract"):
        ctx = SimpleNamespace(graph=g, scheme=SCHEMES[name], settings=SCHEMES[name].options())
        with pytest.raises(ConversionError, match="learned sink logit per head \\(the column '.*sinksExpand0'.*"
                                                  "--scheme kivi or --scheme ggml or --scheme hf keep them"):
            _check_scheme(ctx, full)


def test_tract_s_fused_op_refuses_the_window(export) -> None:
    with pytest.raises(ConversionError, match=f"sliding window of {WINDOW} tokens.*--scheme kivi"):
        convert(export["model"], "tract")


def test_the_tract_cache_conversion_keeps_the_window_in_the_mask(export) -> None:
    """tract's quantized dyn cache stores every token, the graph's mask keeps the window; tract runs it alike
    (tests/e2e/test_exports.py, with the code-flip bound of validation)."""
    model, _ = convert(export["model"], "tract-cache", bits=8)
    got = _decode(InterpreterDecoder(model), export["tokens"], export["n"])
    past, h = slice(WINDOW, None), export["hf"]
    kl = float(kl_divergence(h["logits"][past], got[past]).mean())
    lost = float(kl_divergence(h["logits"][past], h["logits_windowless"][past]).mean())
    assert kl < 1e-3 and kl < 0.01 * lost, (kl, lost)


#: tract 0.23.9 takes 6 s (mistral_window) to 20 s (the others) to load each of these archives, and the parity
#: probe loads a second one: Mistral's in the default run, the others marked slow
TRACT_DIRS = [d if d.name == "mistral_window" else pytest.param(d, marks=pytest.mark.slow) for d in DIRS]


@pytest.mark.skipif(not HAVE_TRACT, reason="needs the tract Python package")
@pytest.mark.parametrize("d", TRACT_DIRS, ids=lambda p: p.name)
def test_tract_runs_the_tract_cache_conversion_alike_over_all_112_tokens(d) -> None:
    """tract's projections round in another order: the few u8 codes at a rounding boundary may land one step
    away (a flipped key moves the 16 steps it stays in the window). The bound is validation's: every code the
    measured K/V noise could flip, flipped at once (nnef_kv/validate/parity.py)."""
    h = np.load(d / "hf_ref.npz")
    model, _ = convert(nnef_kv.load(d / "model.nnef.tgz"), "tract-cache", bits=8)
    dec = InterpreterDecoder(model)
    tokens, n = [int(t) for t in h["tokens"]], int(h["n_prompt"])
    got = _decode(dec, tokens, n)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "converted.nnef.tgz"
        nnef_kv.save(model, path)
        theirs = _decode(TractDecoder(str(path), dec.sig), tokens, n)
    diff = float(np.abs(theirs - got).max())
    if diff > 1e-4:
        flips = flip_bound(model, InterpreterDecoder(model), tokens, n, len(tokens) - n + 1, None, n,
                           lambda dec: _decode(dec, tokens, n), got)
        assert flips.flipped > 0 and flips.logits < 0.05, flips  # a bound, not a pass: a few codes one step away
        assert diff <= 1e-4 + flips.logits, (diff, flips)


def test_the_gpt_oss_kivi_conversion_validates_on_wikitext(tmp_path, capsys) -> None:
    """convert --scheme kivi, then validate against the f32 export on WikiText-2 (byte-level tokenizer) at two
    contexts, one past the window: PASS at --max-kl 0.01, its sink logits and windows in the archive."""
    from conftest import SHARED
    from nnef_kv.cli import main

    d = REPO / "tests" / "fixtures" / "exports" / "gptoss_window"
    out = tmp_path / "gptoss.kivi8.nnef.tgz"
    assert main(["convert", str(d / "model.nnef.tgz"), "--scheme", "kivi", "--bits", "8", "-o", str(out)]) == 0
    graph = nnef_kv.load(out).document
    kivi = [a for a in graph.graph.body if getattr(a.rhs, "name", "") == "nnef_kv_kivi_sdpa"]
    assert len(kivi) == 2 and all(any(x.name == "sink_logits" for x in a.rhs.args) for a in kivi)
    text = SHARED / "data" / "wikitext2" / "wiki.test.raw.part1"
    rc = main(["validate", str(out), "--reference", str(d / "model.nnef.tgz"), "--text", str(text), "--tokenizer",
               str(d / "tokenizer.json"), "--context", "64,160", "--eval-tokens", "32", "--windows", "2",
               "--max-kl", "0.01", "--report-dir", str(tmp_path / "report")])
    printed = capsys.readouterr().out
    assert rc == 0 and printed.rstrip().splitlines()[-2] == "PASS", printed[-2000:]
    assert "over 64 predictions" in printed
