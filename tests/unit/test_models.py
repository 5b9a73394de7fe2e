"""The built-in decoder (nnef_kv.models): its NNEF graph against an independent NumPy forward, in the
interpreter and in tract, both cache layouts."""
from __future__ import annotations

import numpy as np
import pytest

from nnef_kv.errors import GraphError
from nnef_kv.models import DecoderConfig, build_decoder, build_decoder_text, build_decoder_weights, empty_cache
from nnef_kv.models.reference import reference_logits

from conftest import requires_tract

SMALL = dict(vocab=48, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, mlp=48)


def _decode_interp(cfg: DecoderConfig, ids: np.ndarray, n_prompt: int) -> np.ndarray:
    session = build_decoder(cfg).session()
    cache = empty_cache(cfg)
    got = []
    for chunk in [ids[:n_prompt]] + [ids[i:i + 1] for i in range(n_prompt, ids.size)]:
        out = session.run(dict(cache, input_ids=chunk[None].astype(np.int64)))
        got.append(out["outputs"][0, -1])
        cache = {k.replace("out_", "in_", 1): v for k, v in out.items() if k.startswith("out_cache_")}
    return np.array(got)


@pytest.mark.parametrize("cache", ["explicit", "dyn"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4)])
def test_graph_matches_numpy_forward(cache: str, heads: int, kv_heads: int) -> None:
    cfg = DecoderConfig(**{**SMALL, "heads": heads, "kv_heads": kv_heads}, cache=cache, seed=3)
    ids = np.random.default_rng(5).integers(0, cfg.vocab, 11)
    want = reference_logits(cfg, build_decoder_weights(cfg), ids)[4:]  # prompt of 5, then 6 single tokens
    got = _decode_interp(cfg, ids, 5)
    assert got.shape == want.shape == (7, cfg.vocab)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)


def test_explicit_signature_and_cache_growth() -> None:
    cfg = DecoderConfig(**SMALL)
    s = build_decoder(cfg).session()
    assert s.input_names == ["input_ids", "in_cache_key_0", "in_cache_value_0", "in_cache_key_1", "in_cache_value_1"]
    assert s.output_names == ["outputs", "out_cache_key_0", "out_cache_value_0", "out_cache_key_1", "out_cache_value_1"]
    out = s.run(dict(empty_cache(cfg), input_ids=np.array([[1, 2, 3]], np.int64)))
    assert out["outputs"].shape == (1, 1, cfg.vocab)
    assert out["out_cache_key_1"].shape == (1, cfg.kv_heads, 3, cfg.head_dim)


def test_weights_are_deterministic_and_seeded() -> None:
    a = build_decoder_weights(DecoderConfig(**SMALL, seed=1))
    b = build_decoder_weights(DecoderConfig(**SMALL, seed=1))
    c = build_decoder_weights(DecoderConfig(**SMALL, seed=2))
    assert a.keys() == b.keys()
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["lm_head.weight"], c["lm_head.weight"])
    assert all(v.dtype == np.float32 for v in a.values())


def test_dyn_variant_uses_session_cache_ops() -> None:
    text = build_decoder_text(DecoderConfig(**SMALL, cache="dyn"))
    assert "tract_transformers_dyn_kv_cache" in text and "tract_transformers_sdpa" in text
    assert "in_cache" not in text
    s = build_decoder(DecoderConfig(**SMALL, cache="dyn")).session()
    assert s.input_names == ["input_ids"]
    s.run({"input_ids": np.array([[1, 2]], np.int64)})
    assert s.kv_cache_bytes()["total"] > 0


@pytest.mark.parametrize("bad", [dict(heads=3, kv_heads=2), dict(head_dim=7), dict(cache="paged"), dict(layers=0)])
def test_bad_config_is_refused(bad: dict) -> None:
    with pytest.raises(GraphError):
        build_decoder_text(DecoderConfig(**{**SMALL, **bad}))


@requires_tract
@pytest.mark.parametrize("cache", ["explicit", "dyn"])
def test_tract_runs_the_builtin_decoder(tmp_path, cache: str) -> None:
    """tract (the oracle) loads the archive nnef-kv writes and agrees with the NumPy forward."""
    import nnef_kv
    from nnef_kv.validate import TractDecoder, detect_signature, run_decode

    cfg = DecoderConfig(**SMALL, cache=cache, seed=4)
    model = build_decoder(cfg)
    path = tmp_path / "m.nnef.tar"
    nnef_kv.save(model, path)
    ids = np.random.default_rng(9).integers(0, cfg.vocab, 9)
    sig = detect_signature(model.session().plan)
    trace = run_decode(TractDecoder(str(path), sig), ids[:4], 5, tokens=ids)
    want = reference_logits(cfg, build_decoder_weights(cfg), ids)[3:]
    np.testing.assert_allclose(trace.logits, want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4)])
def test_tract_spelling_matches_numpy_forward(heads: int, kv_heads: int) -> None:
    """``spelling="tract"`` (tract's fused ops, caches in the state): same model, same reference."""
    cfg = DecoderConfig(**{**SMALL, "heads": heads, "kv_heads": kv_heads}, cache="dyn", spelling="tract", seed=3)
    text = build_decoder_text(cfg)
    for op in ("tract_core_rms_norm", "tract_transformers_apply_rope", "tract_core_silu", "is_causal = true",
               "tract_core_range(P, P + S, 1)", "transposeB = true"):
        assert op in text, op
    assert "tract_assert" not in text and "softmax" not in text and "sigmoid" not in text
    ids = np.random.default_rng(5).integers(0, cfg.vocab, 11)
    want = reference_logits(cfg, build_decoder_weights(cfg), ids)[4:]
    got = _decode_interp(cfg, ids, 5)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    plain = build_decoder_weights(DecoderConfig(**{**cfg.to_dict(), "spelling": "torch-to-nnef"}))
    tract_w = build_decoder_weights(cfg)
    assert all(np.array_equal(plain[k].reshape(-1), tract_w[k].reshape(-1)) for k in plain)  # same values
    assert tract_w["lm_head.weight"].shape == (1, cfg.vocab, cfg.hidden)


def test_tract_spelling_needs_the_dyn_cache() -> None:
    with pytest.raises(GraphError, match="spelling"):
        build_decoder_text(DecoderConfig(**SMALL, spelling="tract"))
    with pytest.raises(GraphError, match="spelling"):
        build_decoder_text(DecoderConfig(**SMALL, cache="dyn", spelling="onnx"))


@requires_tract
def test_tract_runs_the_tract_spelling(tmp_path) -> None:
    import nnef_kv
    from nnef_kv.validate import TractDecoder, detect_signature, run_decode

    cfg = DecoderConfig(**SMALL, cache="dyn", spelling="tract", seed=4)
    model = build_decoder(cfg)
    path = tmp_path / "m.nnef.tar"
    nnef_kv.save(model, path)
    ids = np.random.default_rng(9).integers(0, cfg.vocab, 9)
    trace = run_decode(TractDecoder(str(path), detect_signature(model.session().plan)), ids[:4], 5, tokens=ids)
    want = reference_logits(cfg, build_decoder_weights(cfg), ids)[3:]
    np.testing.assert_allclose(trace.logits, want, atol=2e-5, rtol=0)
