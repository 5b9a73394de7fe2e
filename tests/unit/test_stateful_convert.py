"""Converting tract's stateful form (``tract_transformers_dyn_kv_cache`` per cache) with a fused scheme (issue
23.3): the f32 cache whose shape only was still read (the cached length, ``shape_of(layer0_value_cache)``) goes;
the length comes from the symbols bound by the converted graph's state (``P + S``), so the archive holds the KV
bytes of the same model converted from the explicit form, and decodes the same logits, in nnef-kv and in tract.

Measured (``python benchmarks/stateful_kv_bytes.py``: 4 layers, 2 kv heads x 32, 1024 tokens): kivi 4-bit
667,776 -> 397,440 bytes (explicit form 397,440); tract's fused op 866,432 -> 596,096 (explicit 596,096)."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import requires_tract
from nnef_kv.converters import convert
from nnef_kv.models import DecoderConfig, build_decoder
from nnef_kv.validate.decode import InterpreterDecoder

CFG = dict(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=32, mlp=64, seed=5)
IDS = (np.arange(80, dtype=np.int64) * 7) % 256  # 80 tokens: kivi quantizes past its 32-token window


def _ops(model) -> list[str]:
    return [st.rhs.name for st in model.document.graph.body if hasattr(st.rhs, "name")]


def _decode(model) -> tuple[np.ndarray, int]:
    dec = InterpreterDecoder(model)
    out = [dec(IDS[:40])]
    out += [dec(IDS[i:i + 1]) for i in range(40, len(IDS))]
    return np.stack([np.asarray(o).reshape(-1, CFG["vocab"])[-1] for o in out]), dec.kv_bytes()["total"]


@pytest.mark.parametrize("scheme", ["kivi", "tract"])
def test_stateful_form_keeps_no_f32_cache_and_matches_the_explicit_form(scheme) -> None:
    dyn, rep = convert(build_decoder(DecoderConfig(**CFG, cache="dyn")), scheme=scheme)
    explicit, _ = convert(build_decoder(DecoderConfig(**CFG, cache="explicit")), scheme=scheme)
    assert _ops(dyn).count("tract_transformers_dyn_kv_cache") == 1  # the position cache only
    logits_dyn, kv_dyn = _decode(dyn)
    logits_exp, kv_exp = _decode(explicit)
    assert kv_dyn == kv_exp, (kv_dyn, kv_exp)
    np.testing.assert_allclose(logits_dyn, logits_exp, rtol=0, atol=1e-5)


@requires_tract
def test_tract_runs_the_converted_stateful_form(tmp_path) -> None:
    import nnef_kv
    from nnef_kv import tract_driver

    dyn, _ = convert(build_decoder(DecoderConfig(**CFG, cache="dyn")), scheme="tract")
    nnef_kv.save(dyn, tmp_path / "t.nnef.tgz")
    state = tract_driver.Stateful(tmp_path / "t.nnef.tgz")
    got = [state.run_first([IDS[None, :40]])[0, -1]]
    got += [state.run_first([IDS[None, i:i + 1]])[0, -1] for i in range(40, len(IDS))]
    want, _ = _decode(dyn)
    scale = float(np.abs(want).max())
    assert np.abs(np.array(got) - want).max() <= 1e-4 + 1e-3 * scale
