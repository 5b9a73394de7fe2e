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
    from nnef_kv.io.archive import Model

    return Model(nnef_kv.parse(text))


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
    assert (
        nb["codes"] == ref["codes"] and nb["params"] == ref["params"] and nb["full_precision"] == ref["full_precision"]
    )
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


def test_dyn_cache_binds_past_length_symbol():
    """The storage-only cache binds the symbol of ``past_sequence_shape[axis]`` to the tokens it
    holds before a run (what the session uses for ``P``); other forms bind nothing."""
    rng = np.random.default_rng(3)
    c = TractQuantizedDynKvCache(name="k0", bits=8, per_channel=0, past_sequence_shape=[1, 2, "P", 16])
    assert c.symbol_bindings() == {"P": 0}
    for t in (3, 1, 5):
        c(rng.standard_normal((1, 2, t, 16)).astype(np.float32))
    assert c.symbol_bindings() == {"P": 9}
    restored = TractQuantizedDynKvCache(name="k0", bits=8, per_channel=0, past_sequence_shape=[1, 2, "P", 16])
    restored.load_state_tensors(c.state_tensors())
    assert restored.symbol_bindings() == {"P": 9}
    restored.reset()
    assert restored.symbol_bindings() == {"P": 0}
    for shape in ([1, 2, 7, 16], [1, 2, "P + 1", 16], [1, 2], (), None):
        assert TractQuantizedDynKvCache(past_sequence_shape=shape).symbol_bindings() == {}


def test_session_binds_past_length_from_the_cache():
    """Through a session: an input declared ``[1, P]`` must have the cache's past length, one more
    each run; a wrong length is refused before any state changes."""
    from nnef_kv.errors import InputError

    text = TRACT_GRAPH.replace("graph g(q, k, v) -> (o, kc) {", "graph g(q, k, v, past) -> (o, kc, pk) {").replace(
        '  o = tract_transformers_quantized_kv_sdpa', '  past = external<scalar>(shape = [1, P]);\n'
        '  pk = add(past, 1.0);\n  o = tract_transformers_quantized_kv_sdpa')
    sess = _session(text).session()
    rng = np.random.default_rng(4)
    for i in range(5):
        x = dict(_feed(rng), past=np.zeros((1, i), np.float32))
        res = sess.run(x)
        assert res["kc"].shape == (1, 2, i + 1, 16) and res["pk"].shape == (1, i)
        assert sess._state_symbols()["P"][0] == i + 1
    with pytest.raises(InputError, match="P"):
        sess.run(dict(_feed(rng), past=np.zeros((1, 3), np.float32)))
    assert sess._state_symbols()["P"][0] == 5  # the refused run did not touch the caches
