"""The GGUF front end (nnef_kv/converters/frontends/gguf.py) on small GGUF files written by the gguf package.

Each imported model is checked against the NumPy reference of the same weights in HF order
(nnef_kv/models/reference.py): the Q/K row order llama.cpp stores is undone, biases and q/k norms
read, tied embeddings one array. The bad-input table: one line naming the file and the key or tensor,
exit 2, nothing written.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType as Q  # noqa: E402

from nnef_kv.converters.frontends.gguf import gguf_import  # noqa: E402
from nnef_kv.errors import ConversionError  # noqa: E402
from nnef_kv.interpreter.session import Session  # noqa: E402
from nnef_kv.models import DecoderConfig, build_decoder_weights, empty_cache  # noqa: E402
from nnef_kv.models.reference import reference_logits  # noqa: E402

from gguf_world import byte_tokens, dequantized, write_gguf  # noqa: E402

IDS = np.array([[5, 70, 120, 33, 9, 200, 17]], np.int64)


def _cfg(**kw):
    base = dict(vocab=259, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, mlp=96, max_positions=512)
    base.update(kw)
    return DecoderConfig(**base)


def _logits(model, cfg, ids=IDS):
    out = Session(model).run({"input_ids": ids, **empty_cache(cfg)})
    return np.asarray(next(iter(out.values()))).reshape(-1)


@pytest.mark.parametrize("arch,kw", [
    ("llama", {}),
    ("llama", {"tied_embeddings": True}),
    ("qwen2", {"attention_bias": True}),
    ("qwen3", {"qk_norm": True, "tied_embeddings": True}),
])
def test_an_imported_decoder_computes_the_models_logits(tmp_path, arch, kw):
    cfg = _cfg(**kw)
    w = build_decoder_weights(cfg)
    path = write_gguf(tmp_path / "m.gguf", cfg, w, arch=arch)
    imp = gguf_import(path)
    assert imp.config.tied_embeddings == cfg.tied_embeddings
    assert imp.config.attention_bias == cfg.attention_bias and imp.config.qk_norm == cfg.qk_norm
    ref = reference_logits(cfg, w, IDS)[-1]
    got = _logits(imp.model, imp.config)
    assert np.abs(got - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())
    if cfg.tied_embeddings:  # one array, read by the gather and the LM head
        assert "lm_head.weight" not in imp.model.tensors


def test_without_undoing_the_row_interleave_the_logits_differ(tmp_path):
    """The check above can fail: read as a qwen2 file (no interleave undone), the llama file computes
    another model."""
    cfg = _cfg()
    w = build_decoder_weights(cfg)
    path = write_gguf(tmp_path / "m.gguf", cfg, w, arch="llama")
    imp = gguf_import(path)
    ref = reference_logits(cfg, w, IDS)[-1]
    from nnef_kv.converters.frontends import gguf as G

    spec = G.ARCHITECTURES["llama"]
    try:
        G.ARCHITECTURES["llama"] = G.ArchSpec()
        wrong = gguf_import(path)
    finally:
        G.ARCHITECTURES["llama"] = spec
    assert np.abs(_logits(imp.model, imp.config) - ref).max() < 1e-3
    assert np.abs(_logits(wrong.model, wrong.config) - ref).max() > 1e-2


def test_quantized_tensors_are_dequantized_as_gguf_quants_does(tmp_path):
    cfg = _cfg(hidden=64, mlp=96)
    w = build_decoder_weights(cfg)
    types = {"proj.weight": Q.Q4_1, "lm_head.weight": Q.Q8_0, "embed_tokens.weight": Q.Q8_0}
    path = write_gguf(tmp_path / "m.gguf", cfg, w, types=types)
    imp = gguf_import(path)
    ref = reference_logits(cfg, dequantized(w, types), IDS)[-1]
    assert np.abs(_logits(imp.model, imp.config) - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())
    assert imp.tensor_types == {"F32": 2 * cfg.layers + 1, "Q4_1": 7 * cfg.layers, "Q8_0": 2}
    assert any("dequantized to f32" in n and "Q4_1" in n for n in imp.notes)


def test_keep_holds_q4_0_as_tract_blocks_and_a_q8_0_embedding_as_q8_1(tmp_path):
    from nnef_kv.tensors.blockquant import BlockQuantTensor

    cfg = _cfg(tied_embeddings=True)
    w = build_decoder_weights(cfg)
    types = {"q_proj.weight": Q.Q4_0, "k_proj.weight": Q.Q4_0, "up_proj.weight": Q.Q4_1,
             "embed_tokens.weight": Q.Q8_0}
    path = write_gguf(tmp_path / "m.gguf", cfg, w, types=types)
    imp = gguf_import(path, weights="keep")
    t = imp.model.tensors
    q = t["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q, BlockQuantTensor) and q.format == "Q4_0"
    emb = t["model.embed_tokens.weight"]
    assert isinstance(emb, BlockQuantTensor) and emb.format == "Q8_1"
    assert isinstance(t["lm_head.weight"], np.ndarray)  # tract runs no product of Q8_1 weights
    assert isinstance(t["model.layers.0.mlp.up_proj.weight"], np.ndarray)  # Q4_1: dequantized
    assert any("dequantized to f32: 2 Q4_1" in n for n in imp.notes)
    ref = reference_logits(cfg, dequantized(w, types), IDS)[-1]
    assert np.abs(_logits(imp.model, imp.config) - ref).max() <= 1e-4 * max(1.0, np.abs(ref).max())
    # the blocks are the file's bytes, the Q/K rows moved as whole rows of blocks
    f32 = gguf_import(path, weights="f32").model.tensors["model.layers.0.self_attn.q_proj.weight"]
    assert np.array_equal(q.dequantize().reshape(f32.shape), f32)


@pytest.mark.tract
def test_tract_runs_the_keep_and_f16_archives(tmp_path):
    import nnef_kv
    from nnef_kv import tract_driver as td

    if not td.available():
        pytest.skip("tract not installed")
    cfg = _cfg(tied_embeddings=True)
    w = build_decoder_weights(cfg)
    path = write_gguf(tmp_path / "m.gguf", cfg, w, types={"proj.weight": Q.Q4_0, "embed_tokens.weight": Q.Q8_0})
    c = empty_cache(cfg)
    for mode in ("keep", "f16", "f32"):
        imp = gguf_import(path, weights=mode)
        out = nnef_kv.save(imp.model, tmp_path / f"{mode}.nnef.tar")
        ours = _logits(nnef_kv.load(out), imp.config)
        theirs = np.asarray(td.run(td.runnable(str(out)), [IDS] + list(c.values()))[0]).reshape(-1)
        assert np.abs(ours - theirs).max() <= 1e-4 * max(1.0, np.abs(ours).max()), mode


def test_the_tokenizer_is_the_files(tmp_path):
    from tokenizers import Tokenizer

    cfg = _cfg()
    path = write_gguf(tmp_path / "m.gguf", cfg, build_decoder_weights(cfg))
    imp = gguf_import(path)
    tok = Tokenizer.from_str(imp.beside["tokenizer.json"].decode())
    tokens, _ = byte_tokens()
    enc = tok.encode(" the cat").ids
    assert [tokens[i] for i in enc] == ["Ġthe", "Ġ", "c", "a", "t"]
    assert tok.decode(enc) == " the cat"
    conf = json.loads(imp.beside["tokenizer_config.json"])
    assert conf["bos_token"] == tokens[0] and conf["eos_token"] == tokens[1] and conf["add_bos_token"] is False
    assert conf["chat_template"].startswith("{% for m in messages %}")


def _run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "nnef_kv", *args], capture_output=True, text=True, cwd=cwd)


def test_convert_writes_the_archive_and_the_tokenizer_beside_it(tmp_path):
    cfg = _cfg()
    path = write_gguf(tmp_path / "m.gguf", cfg, build_decoder_weights(cfg))
    r = _run_cli("convert", str(path), "-o", str(tmp_path / "out" / "m.nnef.tgz"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out" / "m.nnef.tgz").is_file() and (tmp_path / "out" / "tokenizer.json").is_file()
    assert "imported" in r.stdout
    # a second model into the same folder keeps the first tokenizer: its own is named after the archive
    (tmp_path / "out" / "tokenizer.json").write_text('{"model": {}}')
    r = _run_cli("convert", str(path), "-o", str(tmp_path / "out" / "k4.nnef.tgz"), "--scheme", "kivi", "--bits", "4")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "out" / "tokenizer.json").read_text() == '{"model": {}}'
    assert (tmp_path / "out" / "k4.tokenizer.json").is_file()
    from nnef_kv.text import find_tokenizer

    assert find_tokenizer(tmp_path / "out" / "k4.nnef.tgz") == tmp_path / "out" / "k4.tokenizer.json"


def _huge_counts(p: Path) -> None:
    raw = bytearray(p.read_bytes())
    raw[8:16] = (10 ** 12).to_bytes(8, "little")
    p.write_bytes(bytes(raw))


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size * 2 // 3])


def _tensor_type(p: Path) -> None:
    """Set the GGML type of the first tensor ('token_embd.weight' is written first) to 99."""
    raw = bytearray(p.read_bytes())
    name = b"token_embd.weight"
    at = raw.index(name) + len(name)
    n_dims = int.from_bytes(raw[at:at + 4], "little")
    at += 4 + 8 * n_dims
    raw[at:at + 4] = (99).to_bytes(4, "little")
    p.write_bytes(bytes(raw))


def _set(key, value):
    def edit(w):
        w.kv_data[0][key].value = value
    return edit


BAD = [
    ("truncated", dict(post=_truncate), "truncated"),
    ("10^12 tensors", dict(post=_huge_counts), "more than its"),
    ("unknown architecture", dict(arch="mamba"), "architecture 'mamba'"),
    ("unknown tensor type", dict(post=_tensor_type), "'token_embd.weight': unknown GGML tensor type 99"),
    ("missing key", dict(meta=lambda w: w.kv_data[0].pop("llama.attention.layer_norm_rms_epsilon")),
     "'llama.attention.layer_norm_rms_epsilon' is missing"),
    ("shape vs metadata", dict(meta=_set("llama.feed_forward_length", 80)), "'blk.0.ffn_gate.weight' has shape"),
    ("missing tensor", dict(skip=("blk.1.ffn_up.weight",)), "'blk.1.ffn_up.weight' is missing"),
    ("stray tensor", dict(extra={"blk.0.ffn_gate_exps.weight": np.zeros((2, 4), np.float32)}),
     "'blk.0.ffn_gate_exps.weight' is not part of a llama decoder"),
    ("unknown tokenizer", dict(meta=_set("tokenizer.ggml.model", "rwkv")), "'tokenizer.ggml.model' = 'rwkv'"),
    ("unknown pre-tokenizer", dict(pre="klingon"), "'tokenizer.ggml.pre' = 'klingon'"),
]


def _bad_file(tmp_path: Path, spec: dict) -> Path:
    cfg = _cfg()
    path = write_gguf(tmp_path / "bad.gguf", cfg, build_decoder_weights(cfg), edit_meta=spec.get("meta"),
                      skip=spec.get("skip", ()), extra_tensors=spec.get("extra"), pre=spec.get("pre", "smollm"))
    if "arch" in spec:  # the same bytes under another architecture's name (same length: 'llama' -> 'mamba')
        path.write_bytes(path.read_bytes().replace(b"llama", spec["arch"].encode()))
    if "post" in spec:
        spec["post"](path)
    return path


@pytest.mark.parametrize("case,spec,message", BAD, ids=[b[0] for b in BAD])
def test_bad_gguf_is_refused_in_one_line_and_nothing_is_written(tmp_path, case, spec, message):
    path = _bad_file(tmp_path, spec)
    with pytest.raises(ConversionError) as e:
        gguf_import(path)
    assert message in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)
    out = tmp_path / "o" / "x.nnef.tgz"
    r = _run_cli("convert", str(path), "-o", str(out))
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not out.exists() and not (tmp_path / "o" / "tokenizer.json").exists()


def test_generate_chat_applies_the_gguf_chat_template(tmp_path):
    cfg = _cfg()
    path = write_gguf(tmp_path / "m.gguf", cfg, build_decoder_weights(cfg))
    out = tmp_path / "m.nnef.tgz"
    assert _run_cli("convert", str(path), "-o", str(out)).returncode == 0
    from nnef_kv.cli import _chat_prompt
    from nnef_kv.text import chat_config

    conf = chat_config(tmp_path / "tokenizer.json")
    assert _chat_prompt(conf, "hi") == "<user>hi"
    r = _run_cli("generate", str(out), "--prompt", "hi", "--chat", "--max-new-tokens", "3")
    assert r.returncode == 0, r.stderr
    (tmp_path / "tokenizer_config.json").unlink()
    r = _run_cli("generate", str(out), "--prompt", "hi", "--chat")
    assert r.returncode == 2 and "--chat: no chat template found" in r.stderr


def test_the_gguf_reader_applies_the_archive_limits(tmp_path):
    from nnef_kv.limits import Limits, using_limits

    cfg = _cfg()
    path = write_gguf(tmp_path / "m.gguf", cfg, build_decoder_weights(cfg))
    with using_limits(Limits(max_members=10)):
        with pytest.raises(ConversionError, match=r"claims \d+ tensors, more than max_members \(10\)"):
            gguf_import(path)
    with using_limits(Limits(max_tensor_bytes=1000)):
        with pytest.raises(ConversionError, match="'token_embd.weight': 66304 bytes, more than max_tensor_bytes"):
            gguf_import(path)
