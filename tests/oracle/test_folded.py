"""Archives tract wrote after ``transform("detect_kv_cache")`` (heads folded into reshape / transpose around the two
products, the cache in the session) convert under every scheme (nnef_kv/converters/folded.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import nnef_kv
from conftest import FIXTURES
from nnef_kv.converters import convert
from nnef_kv.errors import ConversionError
from nnef_kv.models import DecoderConfig, build_decoder
from nnef_kv.models.reference import reference_logits
from nnef_kv.models.llama import build_decoder_weights

tract = pytest.importorskip("tract")

TOKENS = [5, 17, 3, 42, 8, 9, 11, 2, 30, 7, 1, 19, 25, 4, 13, 6, 22, 10]
PROMPT = 6


def _cfg(kv_heads: int, heads: int, **more) -> DecoderConfig:
    return DecoderConfig(layers=2, vocab=64, hidden=64, heads=heads, kv_heads=kv_heads, head_dim=32, mlp=48, **more)


def _tract_written(tmp_path: Path, source: Path, name: str) -> Path:
    """``source`` loaded by tract, ``detect_kv_cache``, written back as a folder."""
    nnef = tract.nnef().with_tract_transformers()
    m = nnef.load(str(source))
    m.transform("detect_kv_cache")
    out = tmp_path / name
    nnef.write_model_to_dir(m, str(out))
    return out


def _built(tmp_path: Path, cfg: DecoderConfig, name: str = "tw") -> Path:
    src = tmp_path / f"{name}.nnef.tar"
    nnef_kv.save(build_decoder(cfg), src)
    return _tract_written(tmp_path, src, name)


def _decode(model, toks=TOKENS, prompt=PROMPT) -> np.ndarray:
    s = model.session()
    name = s.input_names[0]
    outs = [s.run({name: np.array([toks[:prompt]], np.int64)})]
    outs += [s.run({name: np.array([[t]], np.int64)}) for t in toks[prompt:]]
    rows = [np.asarray(next(iter(o.values()))) for o in outs]
    return np.stack([r.reshape(-1, r.shape[-1])[-1] for r in rows])


@pytest.fixture(scope="module")
def gqa(tmp_path_factory) -> Path:
    return _built(tmp_path_factory.mktemp("gqa"), _cfg(1, heads=2))


def test_tract_folds_the_heads_and_nnef_kv_still_runs_it(gqa) -> None:
    text = (gqa / "graph.nnef").read_text()
    assert "tract_transformers_dyn_kv_cache" in text and "transpose(" in text  # the folded form, cache in state
    cfg = _cfg(1, heads=2)
    want = reference_logits(cfg, build_decoder_weights(cfg), np.array(TOKENS))[PROMPT - 1:]
    np.testing.assert_allclose(_decode(nnef_kv.load(gqa)), want, atol=1e-4)


@pytest.mark.parametrize("scheme, options", [
    ("kivi", {"bits": 8, "residual": 64}),  # every token in the full-precision window: the rewrite alone
    ("kivi", {"bits": 4, "residual": 0, "key_group": 4, "value_group": 4}),
    ("ggml", {"key_type": "q4_0", "value_type": "q8_0"}),
    ("hf", {"bits": 4}),
    ("rotated", {"bits": 3}),
    ("tract", {}),
    ("tract-cache", {"bits": 4}),
])
def test_every_scheme_converts_the_folded_archive_as_the_export(gqa, scheme, options) -> None:
    """The scheme on tract's folded archive computes what it computes on the export tract read."""
    model, report = convert(nnef_kv.load(gqa), scheme, **options)
    if scheme != "tract-cache":
        assert len(report.attentions) == 2 and all(a.startswith("folded attention") for a in report.attentions)
    same, _ = convert(build_decoder(_cfg(1, heads=2)), scheme, **options)
    got, want = _decode(model), _decode(same)
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert np.abs(want - _decode(nnef_kv.load(gqa))).max() > (1e-6 if options.get("residual") != 64 else -1)


@pytest.mark.parametrize("kv_heads", [2, 4])  # 4 query heads: GQA over 2 kv heads, MHA over 4
def test_mha_and_gqa_layouts(tmp_path, kv_heads) -> None:
    cfg = _cfg(kv_heads, heads=4)
    folder = _built(tmp_path, cfg)
    model, report = convert(nnef_kv.load(folder), "kivi", bits=8, residual=64)
    assert len(report.attentions) == 2
    np.testing.assert_allclose(_decode(model), _decode(nnef_kv.load(folder)), atol=2e-5)


def test_a_windowed_mask_tract_wrote_is_still_read(tmp_path) -> None:
    """The window of a tract-written archive is read and kept (KIVI at 8 bits, every token exact: the windowed
    export's logits), or refused by tract's op, which has none."""
    cfg = _cfg(1, heads=2, sliding_window=4)
    folder = _built(tmp_path, cfg)
    with pytest.raises(ConversionError, match="sliding window of 4 tokens"):
        convert(nnef_kv.load(folder), "tract")
    model, report = convert(nnef_kv.load(folder), "kivi", bits=8, residual=64)
    assert any("window = 4" in n for n in report.notes)
    want = reference_logits(cfg, build_decoder_weights(cfg), np.array(TOKENS))[PROMPT - 1:]
    np.testing.assert_allclose(_decode(model), want, atol=1e-4)


def test_a_folded_graph_that_is_not_attention_is_refused(gqa, tmp_path) -> None:
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(gqa, bad)
    lines = (bad / "graph.nnef").read_text().splitlines()
    hit = [i for i, line in enumerate(lines) if " = softmax(" in line]
    assert len(hit) == 2 and all("axes = [2]" in lines[i] for i in hit)
    for i in hit:  # a softmax over the queries, not the keys: the products around it are no attention
        lines[i] = lines[i].replace("axes = [2]", "axes = [1]")
    (bad / "graph.nnef").write_text("\n".join(lines) + "\n")
    with pytest.raises(ConversionError, match="followed through layout ops"):
        convert(nnef_kv.load(bad), "kivi")


SHARED = ["llama_default", "gpt2_default", "qwen2_default", "llamamha_sdpa"]


@pytest.mark.parametrize("name", SHARED)
def test_torch_to_nnef_exports_tract_rewrote(tmp_path, name) -> None:
    src = FIXTURES / "exports" / name / "model.nnef.tgz"
    if not src.is_file():
        pytest.skip(f"shared material not found at {src}")
    folder = _tract_written(tmp_path, src, name)
    ref = np.load(FIXTURES / "exports" / name / "hf_ref.npz")
    toks = [int(t) for t in ref["tokens"]]
    n = int(ref["n_prompt"])
    original = nnef_kv.load(folder)
    base = _decode(original, toks, n)
    np.testing.assert_allclose(base, ref["logits"][: len(base)], atol=1e-4)
    for scheme, options in (("kivi", {"bits": 8, "residual": 64}), ("tract-cache", {"bits": 8})):
        model, report = convert(original, scheme, **options)
        got = _decode(model, toks, n)
        assert np.array_equal(got.argmax(-1), base.argmax(-1)) and np.abs(got - base).max() < 0.05


def test_tract_runs_the_tract_cache_conversion_of_its_own_rewrite(gqa) -> None:
    """tract (the oracle) runs the converted archive and agrees with nnef-kv on it."""
    from nnef_kv.tract_driver import Stateful

    model, _ = convert(nnef_kv.load(gqa), "tract-cache", bits=8)
    ours = _decode(model)
    oracle = Stateful(model)
    rows = [oracle.run_first([np.array([TOKENS[:PROMPT]], np.int64)])]
    rows += [oracle.run_first([np.array([[t]], np.int64)]) for t in TOKENS[PROMPT:]]
    theirs = np.stack([r.reshape(-1, r.shape[-1])[-1] for r in rows])
    np.testing.assert_allclose(ours, theirs, atol=1e-3)


def test_validate_reads_a_folded_reference_one_token_a_call(gqa, tmp_path, capsys) -> None:
    """tract's folded last layer keeps only its last query, which a stepwise run cannot pass through: the
    decoder notices (the failed run changed nothing) and teacher-forces with one-token calls, the same answers."""
    from nnef_kv.cli import main
    from nnef_kv.validate.decode import InterpreterDecoder

    folded_dec, plain_dec = InterpreterDecoder(nnef_kv.load(gqa)), InterpreterDecoder(build_decoder(_cfg(1, heads=2)))
    for d in (folded_dec, plain_dec):
        d.prefill(TOKENS[:PROMPT])
    got, want = folded_dec.teacher(TOKENS[PROMPT:])[0], plain_dec.teacher(TOKENS[PROMPT:])[0]
    assert folded_dec.stepwise is False and plain_dec.stepwise is True
    np.testing.assert_allclose(got, want, atol=1e-4)
    out = tmp_path / "k.nnef.tar"
    assert main(["convert", str(gqa), "--scheme", "kivi", "-o", str(out)]) == 0
    ids = tmp_path / "ids.txt"
    ids.write_text(" ".join(str((7 * i) % 64) for i in range(200)))
    capsys.readouterr()
    assert main(["validate", str(out), "--reference", str(gqa), "--ids", str(ids), "--context", "32",
                 "--eval-tokens", "32", "--windows", "2"]) in (0, 1)
    text = capsys.readouterr().out
    assert "Mean KLD" in text and "64; 95% intervals" in text
