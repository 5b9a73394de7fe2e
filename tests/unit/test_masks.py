"""Masks read by evaluating them (nnef_kv/converters/masks.py): what each attention's mask is, and the
conversions refused where the scheme's op cannot express it (a sliding window, a bias, anything else)."""
from __future__ import annotations

import numpy as np
import pytest

from nnef_kv.converters import convert
from nnef_kv.converters.attention import find_attention
from nnef_kv.converters.graph_edit import GraphEdit
from nnef_kv.converters.masks import MaskSite, combine, length_symbols, pattern, read_masks
from nnef_kv.errors import ConversionError
from nnef_kv.io.archive import Model
from nnef_kv.converters.schemes import SCHEMES
from nnef_kv.models import DecoderConfig, build_decoder, build_decoder_weights
from nnef_kv.models.llama import build_decoder_text, empty_cache
from nnef_kv.models.reference import reference_logits

W = 8
CFG = DecoderConfig(layers=2, vocab=64, hidden=32, heads=4, kv_heads=2, head_dim=8, mlp=48, sliding_window=W)
ATTENTION_SCHEMES = sorted(n for n, s in SCHEMES.items() if s.rewrite == "attention")


def _decode(model: Model, ids: list[int], cfg: DecoderConfig, prompt: int = 5) -> np.ndarray:
    """Last-position logits after a ``prompt``-token prefill and each one-token step (explicit caches fed back)."""
    s = model.session()
    feed = dict(empty_cache(cfg), input_ids=np.array([ids[:prompt]], np.int64))
    rows = []
    for k in range(prompt, len(ids) + 1):
        out = s.run(feed)
        rows.append(np.asarray(out["outputs"])[0, -1])
        if k == len(ids):
            break
        feed = {n.replace("out_", "in_"): v for n, v in out.items() if n.startswith("out_cache")}
        feed["input_ids"] = np.array([[ids[k]]], np.int64)
    return np.stack(rows)


def _readings(model: Model) -> dict:
    g = GraphEdit(model.document, model.tensors)
    g.make_ssa()
    blocks, _ = find_attention(g)
    query, past = length_symbols(g, [c for b in blocks for c in (b.key, b.value)])
    return read_masks(g, [MaskSite(b.mask, b.is_causal) for b in blocks if b.mask], query, past)


def _edited(cfg: DecoderConfig, old: str, new: str) -> Model:
    text = build_decoder_text(cfg)
    assert old in text
    return Model.from_text(text.replace(old, new), build_decoder_weights(cfg))


# -- one evaluation ------------------------------------------------------------------------------
def test_pattern_names_each_form() -> None:
    s, p = 3, 10
    t = s + p
    q = p + np.arange(s)[:, None]
    k = np.arange(t)[None, :]
    causal = np.where(k <= q, 0.0, -np.inf).astype(np.float32)
    assert pattern(causal, s, p)[0] == "causal"
    assert pattern(causal[None, None], s, p)[0] == "causal"  # [1, 1, S, T] broadcasts
    assert pattern(k <= q, s, p)[0] == "causal"  # a bool mask: true lets through
    window = np.where((k <= q) & (k > q - 4), 0.0, -1e9)
    assert pattern(window, s, p)[:2] == ("window", 4)
    assert pattern(np.zeros((1, t)), s, p)[0] == "full"
    assert pattern(np.zeros((1, t)), s, p, causal_too=True)[0] == "causal"  # sdpa's is_causal with a padding mask
    kind, _, why = pattern(causal + np.where(k <= q, -0.5 * (q - k), 0.0), s, p)
    assert kind == "other" and "bias" in why  # ALiBi-like: not a mask
    heads = np.stack([causal, window.astype(np.float32)])[None]
    kind, _, why = pattern(heads, s, p)
    assert kind == "other" and "heads" in why
    kind, _, why = pattern(np.where(k < q, 0.0, -np.inf), s, p)
    assert kind == "other" and "the full prefix nor one sliding window" in why  # a query not seeing itself
    kind, _, why = pattern(np.where(k >= q, 0.0, -np.inf), s, p)
    assert kind == "other" and "later key" in why
    kind, _, why = pattern(np.full((s, t), -np.inf), s, p)
    assert kind == "other" and "sees no key" in why
    kind, _, why = pattern(np.zeros((s, t + 1)), s, p)
    assert kind == "other" and "does not broadcast" in why


def test_combine_needs_every_length_to_agree() -> None:
    assert combine([(2, 29, ("causal", 0, "")), (2, 250, ("window", 16, ""))], "x").kind == "other"  # 31 > 16
    assert combine([(4, 0, ("causal", 0, "")), (2, 29, ("window", 32, ""))], "x").window == 32  # 4 <= 32
    assert combine([(4, 0, ("full", 0, "")), (2, 9, ("full", 0, ""))], "x").kind == "none"
    assert combine([(1, 0, ("full", 0, "")), (1, 9, ("full", 0, ""))], "x").kind == "causal"  # one query: alike
    assert combine([(4, 0, ("full", 0, "")), (2, 9, ("causal", 0, ""))], "x").kind == "other"


# -- masks of whole graphs -------------------------------------------------------------------------
@pytest.mark.parametrize("cache", ["explicit", "dyn"])
def test_the_built_decoders_read_as_they_were_built(cache: str) -> None:
    for window, kind in ((0, "causal"), (W, "window")):
        cfg = DecoderConfig(**{**CFG.__dict__, "cache": cache, "sliding_window": window})
        (reading,) = _readings(build_decoder(cfg)).values()
        assert reading.kind == kind and reading.window == window
        assert "positions" in reading.checked


def test_a_windowed_export_runs_as_hf_s_windowed_model() -> None:
    ids = [int(x) for x in np.random.default_rng(1).integers(0, CFG.vocab, 24)]
    got = _decode(build_decoder(CFG), ids, CFG)
    want = reference_logits(CFG, build_decoder_weights(CFG), np.array(ids))[4:]
    np.testing.assert_allclose(got, want, atol=1e-4)
    full = reference_logits(DecoderConfig(**{**CFG.__dict__, "sliding_window": 0}), build_decoder_weights(CFG),
                            np.array(ids))[4:]
    assert np.abs(full[W:] - want[W:]).max() > 1e-2  # past the window the window matters


NO_WINDOW = sorted(n for n, s in SCHEMES.items() if s.rewrite == "attention" and not s.sliding)
SLIDING = sorted(n for n, s in SCHEMES.items() if s.sliding)
#: a head size ggml's blocks take (32 values along head_dim)
CFG32 = DecoderConfig(layers=2, vocab=64, hidden=64, heads=4, kv_heads=2, head_dim=32, mlp=64, sliding_window=W)
#: each sliding scheme at its most accurate setting: the conversion must follow the windowed model
ACCURATE = {"kivi": {"bits": 8}, "ggml": {"key_type": "q8_0", "value_type": "q8_0"},
            "hf": {"backend": "hqq", "bits": 8, "group_size": 32, "residual": 4}}


def test_the_schemes_with_a_window_are_the_issue_s() -> None:
    assert SLIDING == ["ggml", "hf", "kivi"] and "tract" in NO_WINDOW


@pytest.mark.parametrize("scheme", NO_WINDOW)
def test_a_window_is_refused_by_the_schemes_without_one(scheme: str) -> None:
    with pytest.raises(ConversionError) as exc:
        convert(build_decoder(CFG), scheme)
    msg = str(exc.value)
    assert f"sliding window of {W} tokens" in msg and "attention_mask" in msg and "nothing written" in msg
    assert "tract-cache" in msg and "--scheme kivi" in msg and "\n" not in msg


@pytest.mark.parametrize("scheme", SLIDING)
def test_a_windowed_decoder_converts_and_follows_the_window(scheme: str) -> None:
    """Past the window the converted model is the windowed one (not the full-attention one), and each sliding
    op holds a bounded cache: its bytes stop growing once the window is full (the converter's position counter,
    4 bytes a token, is no sliding layer's)."""
    cfg = CFG32
    model, report = convert(build_decoder(cfg), scheme, **ACCURATE[scheme])
    ops = [st.rhs for st in model.document.graph.body if getattr(st.rhs, "name", "") == SCHEMES[scheme].op]
    assert len(ops) == 2 and all(inv.named()["window"].value == W for inv in ops)
    assert any(f"window = {W}" in n for n in report.notes)
    ids = [int(x) for x in np.random.default_rng(3).integers(0, cfg.vocab, 200)]
    s = model.session()
    sliding = [st for st in s.states if type(st).__name__.endswith("Sdpa")]
    assert len(sliding) == 2
    rows, held = [np.asarray(s.run({"input_ids": np.array([ids[:5]], np.int64)})["outputs"])[0, -1]], []
    for t in ids[5:]:
        rows.append(np.asarray(s.run({"input_ids": np.array([[t]], np.int64)})["outputs"])[0, -1])
        held.append(sum(sum(st.nbytes()[k] for k in ("codes", "params", "full_precision")) for st in sliding))
    got = np.stack(rows)
    weights = build_decoder_weights(cfg)
    want = reference_logits(cfg, weights, np.array(ids))[4:]
    full = reference_logits(DecoderConfig(**{**cfg.__dict__, "sliding_window": 0}), weights, np.array(ids))[4:]
    past = slice(W + 4, None)  # positions past the window
    err, off = np.abs(got - want)[past].max(), np.abs(full - want)[past].max()
    assert err < 0.1 * off, (err, off)
    assert (got.argmax(-1) == want.argmax(-1))[past].mean() >= 0.95
    late, early = max(held[100:]), max(held[:100])  # page 64 + window 8: the first page is dropped at 71
    assert late <= early  # flat past the window (+ the page being filled)
    assert all(st.census()["evicted"] > 0 for st in sliding)


def test_sinks_with_a_window_are_refused() -> None:
    with pytest.raises(ConversionError) as exc:
        convert(build_decoder(CFG), "kivi", sinks=4)
    msg = str(exc.value)
    assert "--sinks 4" in msg and "sliding window" in msg and "nothing written" in msg


def test_tract_cache_keeps_the_window() -> None:
    model, report = convert(build_decoder(CFG), "tract-cache", bits=8)
    assert any("out_of_window" in st.lhs.name for st in model.document.graph.body if hasattr(st.lhs, "name"))
    ids = [int(x) for x in np.random.default_rng(2).integers(0, CFG.vocab, 24)]
    s = model.session()
    got = np.stack([np.asarray(s.run({"input_ids": np.array([ids[:5]], np.int64)})["outputs"])[0, -1]]
                   + [np.asarray(s.run({"input_ids": np.array([[t]], np.int64)})["outputs"])[0, -1] for t in ids[5:]])
    want = reference_logits(CFG, build_decoder_weights(CFG), np.array(ids))[4:]
    full = reference_logits(DecoderConfig(**{**CFG.__dict__, "sliding_window": 0}), build_decoder_weights(CFG),
                            np.array(ids))[4:]
    assert np.abs(got - want).max() < 0.25 * np.abs(full - want).max()  # the window's model, not the full one


def test_a_bias_in_place_of_a_mask_is_refused_with_its_node() -> None:
    cfg = DecoderConfig(**{**CFG.__dict__, "sliding_window": 0})
    model = _edited(cfg, "mul(future_f32, -1e9)", "mul(future_f32, -2.5)")
    with pytest.raises(ConversionError) as exc:
        convert(model, "kivi")
    msg = str(exc.value)
    assert "mask 'attention_mask'" in msg and "bias of the scores" in msg and "-2.5" in msg


def test_a_mask_of_zeros_is_no_mask() -> None:
    cfg = DecoderConfig(**{**CFG.__dict__, "sliding_window": 0})
    model = _edited(cfg, "mul(future_f32, -1e9)", "mul(future_f32, 0.0)")
    converted, report = convert(model, "kivi", bits=8)
    ops = [st.rhs for st in converted.document.graph.body if getattr(st.rhs, "name", "") == "nnef_kv_kivi_sdpa"]
    assert ops and all(inv.named()["is_causal"].value is False for inv in ops)
    assert any("read as no mask" in n for n in report.notes)
    causal, _ = convert(build_decoder(cfg), "kivi", bits=8)
    ops = [st.rhs for st in causal.document.graph.body if getattr(st.rhs, "name", "") == "nnef_kv_kivi_sdpa"]
    assert ops and all(inv.named()["is_causal"].value is True for inv in ops)


def test_tract_s_lost_causal_mask_is_a_change_the_cli_prints(tmp_path, capsys) -> None:
    from nnef_kv import save
    from nnef_kv.cli import main

    cfg = DecoderConfig(**{**CFG.__dict__, "sliding_window": 0})
    src = tmp_path / "m.nnef.tar"
    save(build_decoder(cfg), src)
    assert main(["convert", str(src), "--scheme", "tract", "-o", str(tmp_path / "t.nnef.tar")]) == 0
    err = capsys.readouterr().err
    assert "note: attention" in err and "has no causal mask" in err
    assert main(["convert", str(src), "--scheme", "kivi", "-o", str(tmp_path / "k.nnef.tar")]) == 0
    assert "causal" not in capsys.readouterr().err  # kept: nothing to say


def test_the_cli_converts_a_window_or_refuses_it_and_writes_nothing(tmp_path, capsys) -> None:
    from nnef_kv import save
    from nnef_kv.cli import main

    src = tmp_path / "w.nnef.tar"
    save(build_decoder(CFG), src)
    out = tmp_path / "o.nnef.tar"
    assert main(["convert", str(src), "--scheme", "tract", "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"sliding window of {W} tokens" in err[0] and not out.exists()
    assert main(["convert", str(src), "--scheme", "kivi", "--bits", "8", "-o", str(out)]) == 0
    assert out.exists() and f"window = {W}" in (tmp_path / "o.nnef.tar").read_bytes().decode("latin-1")


# -- what an export lost -----------------------------------------------------------------------------
def test_declared_windows_reads_hf_configs() -> None:
    from nnef_kv.converters.exported import declared_windows

    assert declared_windows({"sliding_window": 4096, "num_hidden_layers": 32}) == (4096, 32, 32)  # Mistral
    assert declared_windows({"sliding_window": None, "num_hidden_layers": 32}) is None
    qwen2 = {"sliding_window": 4096, "use_sliding_window": False, "num_hidden_layers": 24}
    assert declared_windows(qwen2) is None
    assert declared_windows({**qwen2, "layer_types": ["full_attention"] * 24}) is None
    gemma2 = {"sliding_window": 4096, "layer_types": ["sliding_attention", "full_attention"] * 13}
    assert declared_windows(gemma2) == (4096, 13, 26)
    assert declared_windows({"text_config": gemma2}) == (4096, 13, 26)  # Gemma 3's nesting


def _with_config(tmp_path, model, config) -> object:
    import json

    from nnef_kv import save

    folder = tmp_path / "export"
    folder.mkdir()
    save(model, folder / "model.nnef.tgz")
    (folder / "config.json").write_text(json.dumps(config))
    return folder / "model.nnef.tgz"


@pytest.mark.parametrize("window, config, noted", [
    (0, {"sliding_window": 16, "num_hidden_layers": 2}, True),  # Mistral-like, exported without its window
    (0, {"sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"]}, True),
    (0, {"sliding_window": 16, "use_sliding_window": False, "num_hidden_layers": 2}, False),
    (0, {"num_hidden_layers": 2}, False),
    (16, {"sliding_window": 16, "num_hidden_layers": 2}, False),  # the window is in the masks
])
def test_inspect_convert_and_validate_say_what_the_export_lost(tmp_path, capsys, window, config, noted) -> None:
    from nnef_kv.cli import main

    cfg = DecoderConfig(**{**CFG.__dict__, "sliding_window": window})
    src = _with_config(tmp_path, build_decoder(cfg), config)
    assert main(["inspect", str(src)]) == 0
    err = capsys.readouterr().err
    assert ("declares a sliding window of 16 tokens" in err) is noted
    if noted:
        assert "runs the model without its window" in err and len(err.strip().splitlines()) == 1
        assert main(["convert", str(src), "-o", str(tmp_path / "k.nnef.tar")]) == 0
        assert "declares a sliding window of 16 tokens" in capsys.readouterr().err
        ids = tmp_path / "ids.txt"
        ids.write_text(" ".join(str(i % CFG.vocab) for i in range(3, 40)))
        assert main(["validate", str(tmp_path / "k.nnef.tar"), "--reference", str(src), "--ids", str(ids),
                     "--context", "8", "--eval-tokens", "8", "--windows", "1"]) in (0, 1)
        assert capsys.readouterr().err.count("declares a sliding window of 16 tokens") == 1


def test_the_lost_window_note_on_a_torch_to_nnef_export(tmp_path, capsys) -> None:
    import json
    import shutil

    from conftest import FIXTURES, requires_shared  # noqa: F401
    from nnef_kv.cli import main

    src = FIXTURES / "exports" / "qwen2_default"
    if not src.is_dir():
        pytest.skip(f"shared material not found at {src}")
    folder = tmp_path / "qwen2"
    folder.mkdir()
    shutil.copy(src / "model.nnef.tgz", folder)
    config = json.loads((src / "config.json").read_text())
    assert main(["inspect", str(folder / "model.nnef.tgz")]) == 0
    assert "sliding window" not in capsys.readouterr().err  # as exported: use_sliding_window false, no note
    config.update(use_sliding_window=True, sliding_window=16, layer_types=["sliding_attention", "full_attention"])
    (folder / "config.json").write_text(json.dumps(config))
    assert main(["inspect", str(folder / "model.nnef.tgz")]) == 0
    err = capsys.readouterr().err
    assert "declares a sliding window of 16 tokens on 1 of 2 layers" in err and "2 read as plain causal" in err


def test_a_mask_computed_from_input_values_is_refused() -> None:
    cfg = DecoderConfig(**{**CFG.__dict__, "sliding_window": 0})
    text = build_decoder_text(cfg)
    old = "mul(future_f32, -1e9)"
    assert old in text  # the mask now also adds each query's token id: data, not lengths
    model = Model.from_text(text.replace(old, "add(mul(future_f32, -1e9), transpose(tract_core_cast(input_ids, "
                                              "to = 'f32'), axes = [1, 0]))"), build_decoder_weights(cfg))
    with pytest.raises(ConversionError, match="depends on the values of the graph's inputs"):
        convert(model, "kivi")
