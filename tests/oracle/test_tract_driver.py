"""nnef_kv.tract_driver: the one way the project drives tract (loaders, in-memory models, outputs by
position, a state kept across calls, the one-line error without tract)."""
from __future__ import annotations

import builtins

import numpy as np
import pytest

from nnef_kv import tract_driver
from nnef_kv.errors import InputError, NnefKvError

from conftest import requires_tract

KV_TEXT = """version 1.0;
extension tract_registry tract_core;
extension tract_registry tract_transformers;
extension tract_symbol S;
extension tract_symbol P;
graph g(x) -> (renamed_by_tract, twice)
{
  x = tract_core_external(shape = [1, 2, S, 4], datum_type = 'f32');
  renamed_by_tract = tract_transformers_dyn_kv_cache(x, name = 'c', axis = 2, datum_type = 'f32',
      past_sequence_shape = [1, 2, P, 4], input_sequence_shape = [1, 2, S, 4]);
  twice = mul(x, 2.0);
}
"""


def test_missing_tract_is_one_line(monkeypatch) -> None:
    real = builtins.__import__

    def no_tract(name, *args, **kwargs):
        if name == "tract" or name.startswith("tract."):
            raise ImportError("No module named 'tract'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tract)
    with pytest.raises(tract_driver.TractMissing) as err:
        tract_driver.framework()
    assert isinstance(err.value, ImportError) and isinstance(err.value, NnefKvError)
    assert "\n" not in str(err.value) and "pip install" in str(err.value)


def test_loader_chains_are_parsed_or_refused() -> None:
    assert tract_driver._chain("tract.nnef()") == []
    assert tract_driver._chain("tract.nnef().with_onnx().without_tract_core()") == ["with_onnx", "without_tract_core"]
    with pytest.raises(InputError, match="not a tract NNEF loader"):
        tract_driver._chain("tract.onnx()")


@requires_tract
def test_unknown_extension_is_refused() -> None:
    with pytest.raises(InputError, match="no with_nonsense"):
        tract_driver.framework(("nonsense",))


@requires_tract
def test_in_memory_model_stateful_outputs_by_position_and_reset() -> None:
    from nnef_kv.io.archive import Model

    model = Model.from_text(KV_TEXT)
    state = tract_driver.Stateful(model)
    assert state.input_names == ["x"] and len(state.output_names) == 2
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((1, 2, n, 4)).astype(np.float32) for n in (3, 1))
    first = state.run([a])
    np.testing.assert_array_equal(first[0], a)  # position 0: the cache, whatever tract calls it
    np.testing.assert_array_equal(first[1], 2 * a)
    np.testing.assert_array_equal(state.run_first([b]), np.concatenate([a, b], axis=2))  # state kept
    state.reset()
    np.testing.assert_array_equal(state.run_first([b]), b)
    # one-shot runs: a fresh state each time
    for source in (model, tract_driver.load_text(KV_TEXT), tract_driver.runnable(model)):
        np.testing.assert_array_equal(tract_driver.run(source, [b])[1], 2 * b)


@requires_tract
def test_decoder_feeds_a_session_cache_signature() -> None:
    from nnef_kv.models import DecoderConfig, build_decoder
    from nnef_kv.validate.decode import detect_signature

    for cache in ("explicit", "dyn"):
        model = build_decoder(DecoderConfig(vocab=32, hidden=16, layers=1, heads=2, kv_heads=1, head_dim=8, mlp=16,
                                            cache=cache))
        session = model.session()
        sig = detect_signature(session.plan)
        dec = tract_driver.Decoder(model, sig)
        ids = np.array([[1, 2, 3]], np.int64)
        for _ in range(2):  # a reset starts the sequence again
            dec.reset()
            session.reset()
            cache_in = sig.empty_caches()
            for call in (ids, np.array([[4]], np.int64)):
                ours = session.run({**cache_in, sig.ids_input: call})
                cache_in = {i: ours[o] for i, o in sig.cache_outputs.items()}
                theirs = dec(call)
                assert list(theirs) == sig.output_names
                np.testing.assert_allclose(theirs[sig.logits_output], ours[sig.logits_output], atol=1e-5)
        assert set(dec.cache) == set(sig.cache_inputs)
