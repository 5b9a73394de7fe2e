"""The trained decoders of ``tests/fixtures`` (``tools/make_trained_decoder.py``): each archive is the
model its ``config.json`` describes, and where the PyTorch reference was kept (``reference.npz``: the 512
held-out bytes and PyTorch's last-position logits) nnef-kv reproduces it."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import nnef_kv
from nnef_kv.models import DecoderConfig, empty_cache

FIXTURES = Path(__file__).resolve().parent / "fixtures"
TRAINED = sorted(p.parent for p in FIXTURES.glob("trained_llama*/config.json"))


def _config(d: Path) -> DecoderConfig:
    c = json.loads((d / "config.json").read_text())
    return DecoderConfig(vocab=c["vocab"], hidden=c["hidden"], layers=c["layers"], heads=c["heads"],
                         kv_heads=c["kv_heads"], head_dim=c["head_dim"], mlp=c["mlp"], name=c["name"])


def test_the_fixtures_are_there():
    assert {d.name for d in TRAINED} >= {"trained_llama", "trained_llama_seq1024"}


@pytest.mark.parametrize("d", TRAINED, ids=lambda d: d.name)
def test_archive_is_the_configured_model(d):
    cfg = _config(d)
    assert cfg.name == d.name
    model = nnef_kv.load(d / "model.nnef.tgz")
    sess = model.session()
    ids = np.frombuffer(b"We hold these truths", np.uint8).astype(np.int64)[None]
    out = sess.run(dict(empty_cache(cfg), input_ids=ids))
    assert np.asarray(out["outputs"]).shape[-1] == cfg.vocab
    caches = [k for k in out if k != "outputs"]
    assert len(caches) == 2 * cfg.layers
    assert all(np.asarray(out[k]).shape == (1, cfg.kv_heads, ids.shape[1], cfg.head_dim) for k in caches)


@pytest.mark.parametrize("d", [d for d in TRAINED if (d / "reference.npz").exists()], ids=lambda d: d.name)
def test_archive_reproduces_pytorch(d):
    cfg = _config(d)
    ref = np.load(d / "reference.npz")
    out = nnef_kv.load(d / "model.nnef.tgz").session().run(
        dict(empty_cache(cfg), input_ids=ref["ids"].astype(np.int64)[None]))
    got = np.asarray(out["outputs"]).reshape(-1, cfg.vocab)[-1]
    assert float(np.abs(got - ref["last_logits"]).max()) < 1e-4  # the build measured 9.3e-6
    assert int(got.argmax()) == int(ref["last_logits"].argmax())
