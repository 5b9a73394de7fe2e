"""``Session.run(..., stepwise=True)`` on graphs whose tokens are not counted by an integer input (issue 23.12):
an attention op's graph with float ``q``, ``k``, ``v`` ``[1, H, S, D]`` takes the one symbol its inputs share, or
``token_symbol=``; what cannot be told is refused naming the symbols and the parameter."""
from __future__ import annotations

import numpy as np
import pytest

import nnef_kv
from nnef_kv.io.archive import Model

GRAPH = """version 1.0;
extension nnef_kv;
extension tract_symbol S;
graph g(q, k, v) -> (o) {
  q = external<scalar>(shape = [1, 4, S, 16]);
  k = external<scalar>(shape = [1, 2, S, 16]);
  v = external<scalar>(shape = [1, 2, S, 16]);
  o = nnef_kv_kivi_sdpa(q, k, v, scale = 0.25, bits = 4, key_group = 4, value_group = 8, residual = 4);
}
"""

TWO = GRAPH.replace("extension tract_symbol S;", "extension tract_symbol S;\nextension tract_symbol B;").replace(
    "shape = [1, 4, S, 16]", "shape = [B, 4, S, 16]").replace("shape = [1, 2, S, 16]", "shape = [B, 2, S, 16]")


def _qkv(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    r = np.random.default_rng(seed)
    return {"q": r.standard_normal((1, 4, n, 16)).astype(np.float32),
            "k": r.standard_normal((1, 2, n, 16)).astype(np.float32),
            "v": r.standard_normal((1, 2, n, 16)).astype(np.float32)}


def _one_token_runs(session, feed: dict[str, np.ndarray]) -> np.ndarray:
    n = feed["q"].shape[2]
    return np.concatenate([session.run({k: a[:, :, t:t + 1] for k, a in feed.items()})["o"] for t in range(n)], axis=2)


@pytest.mark.parametrize("token_symbol", [None, "S"])
def test_float_inputs_sharing_one_symbol_run_stepwise_as_one_token_runs(token_symbol) -> None:
    feed = _qkv(13)
    want = _one_token_runs(Model(nnef_kv.parse(GRAPH)).session(), feed)
    s = Model(nnef_kv.parse(GRAPH)).session()
    got = s.run(feed, stepwise=True, token_symbol=token_symbol)["o"]
    assert got.shape == want.shape == (1, 4, 13, 16)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)  # quantized past: 13 tokens, groups of 4
    assert s.token_inputs(token_symbol) == ("S", {"q": 2, "k": 2, "v": 2})


def test_two_shared_symbols_need_token_symbol() -> None:
    s = Model(nnef_kv.parse(TWO)).session()
    feed = _qkv(6)
    with pytest.raises(nnef_kv.InputError, match=r"the inputs share the symbolic dims B, S; name it \(token_symbol="):
        s.run(feed, stepwise=True)
    s2 = Model(nnef_kv.parse(TWO)).session()
    want = _one_token_runs(s2, feed)
    np.testing.assert_allclose(s.run(feed, stepwise=True, token_symbol="S")["o"], want, rtol=1e-5, atol=1e-6)


def test_an_unknown_token_symbol_is_refused_naming_the_symbols() -> None:
    s = Model(nnef_kv.parse(GRAPH)).session()
    with pytest.raises(nnef_kv.InputError, match=r"token_symbol='T' is no symbolic dim of the inputs \(S\)"):
        s.run(_qkv(3), stepwise=True, token_symbol="T")
