"""A tiny model archive shipped with the package, and the recipe that builds it.

``tiny_decoder.nnef.tgz`` is one attention block with an explicit KV cache (the caller passes the
``P`` cached keys/values in and gets ``P + 1`` back), a SiLU-gated MLP and a tied-free output
projection: small enough to read (a few KB), large enough to exercise externals, variables whose
labels hold ``/``, ``matmul``, ``concat``, ``softmax`` and a ``tract_symbol``. It loads in tract
0.23.9 and in nnef-kv.

``build_sample()`` rebuilds it deterministically through :func:`nnef_kv.save`; the test suite checks
that the shipped file is byte-identical to a fresh build.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

SAMPLE_NAME = "tiny_decoder.nnef.tgz"
D_MODEL = 16
D_MLP = 32
SEED = 20260101

GRAPH = """\
version 1.0;

extension tract_registry tract_core;
extension tract_symbol P;

graph tiny_decoder( x, past_k, past_v ) -> ( y, k, v )
{
  x = external<scalar>(shape = [1, 16]);
  past_k = external<scalar>(shape = [P, 16]);
  past_v = external<scalar>(shape = [P, 16]);
  norm_w = variable<scalar>(label = "block/norm.weight", shape = [1, 16]);
  wq = variable<scalar>(label = "block/attn/wq", shape = [16, 16]);
  wk = variable<scalar>(label = "block/attn/wk", shape = [16, 16]);
  wv = variable<scalar>(label = "block/attn/wv", shape = [16, 16]);
  wo = variable<scalar>(label = "block/attn/wo", shape = [16, 16]);
  w_gate = variable<scalar>(label = "block/mlp/gate", shape = [16, 32]);
  w_up = variable<scalar>(label = "block/mlp/up", shape = [16, 32]);
  w_down = variable<scalar>(label = "block/mlp/down", shape = [32, 16]);
  ms = mean_reduce(sqr(x), axes = [1]);
  xn = mul(div(x, sqrt(add(ms, 1e-5))), norm_w);
  q = matmul(xn, wq);
  k_new = matmul(xn, wk);
  v_new = matmul(xn, wv);
  k = concat([past_k, k_new], axis = 0);
  v = concat([past_v, v_new], axis = 0);
  scores = mul(matmul(q, k, transposeB = true), 0.25);
  probs = softmax(scores, axes = [1]);
  h = add(x, matmul(matmul(probs, v), wo));
  gate = matmul(h, w_gate);
  act = mul(gate, sigmoid(gate));
  y = add(h, matmul(mul(act, matmul(h, w_up)), w_down));
}
"""


def sample_path() -> Path:
    """Path of the shipped sample archive."""
    return Path(__file__).resolve().parent / SAMPLE_NAME


def sample_tensors() -> dict[str, np.ndarray]:
    """The sample's weights (float32, seeded)."""
    rng = np.random.default_rng(SEED)
    d, m = D_MODEL, D_MLP

    def w(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(rows)).astype(np.float32)

    return {
        "block/norm.weight": (1.0 + 0.1 * rng.standard_normal((1, d))).astype(np.float32),
        "block/attn/wq": w(d, d),
        "block/attn/wk": w(d, d),
        "block/attn/wv": w(d, d),
        "block/attn/wo": w(d, d),
        "block/mlp/gate": w(d, m),
        "block/mlp/up": w(d, m),
        "block/mlp/down": w(m, d),
    }


def build_sample(path: str | Path | None = None) -> Path:
    """Build the sample archive at ``path`` (default: the shipped location) and return its path."""
    from ..io.archive import Model, save

    target = Path(path) if path is not None else sample_path()
    model = Model.from_text(GRAPH, sample_tensors(), source=str(target))
    return save(model, target)
