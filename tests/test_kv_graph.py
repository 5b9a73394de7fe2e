"""The quantized-KV ops inside NNEF graphs run by the interpreter: sessions, byte counts, saved state."""
from __future__ import annotations

import numpy as np
import pytest

import nnef_kv
from nnef_kv.errors import StateError
from nnef_kv.kv import KiviSdpa, TractQuantizedDynKvCache, TractQuantizedKvSdpa

KIVI_GRAPH = """version 1.0;
extension nnef_kv;
graph g(q, k, v) -> (o) {
  q = external<scalar>(shape = [1, 4, 1, 16]);
  k = external<scalar>(shape = [1, 2, 1, 16]);
  v = external<scalar>(shape = [1, 2, 1, 16]);
  o = nnef_kv_kivi_sdpa(q, k, v, scale = 0.25, bits = 3, key_group = 8, residual = 8, sinks = 1);
}
"""

TRACT_GRAPH = """version 1.0;
extension tract_registry tract_core;
extension tract_registry tract_transformers;
extension tract_symbol P;
graph g(q, k, v) -> (o, kc) {
  q = external<scalar>(shape = [1, 4, 1, 16]);
  k = external<scalar>(shape = [1, 2, 1, 16]);
  v = external<scalar>(shape = [1, 2, 1, 16]);
  o = tract_transformers_quantized_kv_sdpa(q, k, v, axis = 2);
  kc = tract_transformers_quantized_dyn_kv_cache(k, name = "k0", axis = 2, bits = 4, per_channel = 1,
        datum_type = "f32", past_sequence_shape = [1, 2, P, 16], input_sequence_shape = [1, 2, 1, 16]);
}
"""


def _session(text):
    pytest.importorskip("nnef_kv.interpreter.session")
    from nnef_kv.interpreter.session import DocumentModel

    return DocumentModel(nnef_kv.parse(text))


def _feed(rng):
    return {"q": rng.standard_normal((1, 4, 1, 16)).astype(np.float32),
            "k": rng.standard_normal((1, 2, 1, 16)).astype(np.float32),
            "v": rng.standard_normal((1, 2, 1, 16)).astype(np.float32)}


def test_kivi_graph_matches_plain_class_and_saves_state(tmp_path):
    model = _session(KIVI_GRAPH)
    sess = model.session()
    plain = KiviSdpa(scale=0.25, bits=3, key_group=8, residual=8, sinks=1)
    rng = np.random.default_rng(0)
    for _ in range(30):
        x = _feed(rng)
        out = sess.run(x)["o"]
        np.testing.assert_array_equal(out, plain(x["q"], x["k"], x["v"]))
    nb = sess.kv_cache_bytes()
    ref = plain.nbytes()
    assert nb["codes"] == ref["codes"] and nb["params"] == ref["params"] and nb["full_precision"] == ref["full_precision"]
    path = tmp_path / "state.tar"
    sess.save_state(path)
    restored = model.session(state=path)
    for _ in range(10):
        x = _feed(rng)
        np.testing.assert_array_equal(sess.run(x)["o"], restored.run(x)["o"])


def test_kivi_state_of_another_config_is_refused(tmp_path):
    a = _session(KIVI_GRAPH).session()
    rng = np.random.default_rng(1)
    a.run(_feed(rng))
    path = tmp_path / "s.tar"
    a.save_state(path)
    other = _session(KIVI_GRAPH.replace("bits = 3", "bits = 2"))
    with pytest.raises(StateError):
        other.session(state=path)


def test_tract_ops_in_a_graph():
    model = _session(TRACT_GRAPH)
    sess = model.session()
    fused = TractQuantizedKvSdpa()
    cache = TractQuantizedDynKvCache(name="k0", bits=4, per_channel=1)
    rng = np.random.default_rng(2)
    for i in range(40):
        x = _feed(rng)
        res = sess.run(x)
        np.testing.assert_array_equal(res["o"], fused(x["q"], x["k"], x["v"]))
        np.testing.assert_array_equal(res["kc"], cache(x["k"]))
        assert res["kc"].shape == (1, 2, i + 1, 16)
