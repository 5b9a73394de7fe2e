"""``tract_moe_ffn``: tract's routed mixture-of-experts feed-forward (registry ``tract_transformers``).

torch-to-nnef 0.24.12 writes it for every MoE block it knows (Mixtral, Qwen MoE, OLMoE, Gemma 4,
GPT-OSS); tract 0.23.9 runs it. The semantics, established against tract 0.23.9 on random inputs
(``tests/oracle/test_tract_moe.py``, which keeps tract the oracle):

* ``x`` ``[..., D]`` is read as ``N = prod(...)`` rows; router logits ``x . wg^T (+ wg_bias)``, ``wg`` ``[E, D]``;
* the ``k`` largest logits of a row pick its experts (ties: the lower expert index); their weights by
  ``gate``: ``softmax_topk`` (softmax over the k picked logits), ``softmax_all`` (softmax over all E, the
  k picked, not renormalised), ``sigmoid`` (of each picked logit), ``raw`` (the picked logits);
* expert ``e``: ``g = x . w1[e] (+ w1_bias[e])``; with ``w3``, ``u = x . w3[e] (+ w3_bias[e])`` and
  ``h = act(g) * u``, else ``h = act(g)``; ``act``: ``swiglu``/``silu`` ``g sigmoid(g)``, ``gelu``
  (tanh approximation), ``relu``; ``swiglu`` needs ``w3``. With ``act_limit > 0`` (GPT-OSS's clamped
  SwiGLU) ``g = min(g, limit)``, ``u = clip(u, -limit, limit)``, ``h = (u + 1) g sigmoid(act_alpha g)``
  (``act_alpha`` is read only then; default 1);
* ``y = sum over the k picks of weight * (h . w2[e] (+ w2_bias[e]))``, shape of ``x``.

Layouts: ``canonical`` ``w1``/``w3`` ``[E, D, H]``, ``w2`` ``[E, H, D]``; ``linear`` (the linear-filter
orientation) ``w1``/``w3`` ``[E, H, D]``, ``w2`` ``[E, D, H]``. Biases: ``wg_bias`` ``[E]``, ``w1_bias``/``w3_bias``
``[E, H]``, ``w2_bias`` ``[E, D]``, given all four or none (tract maps them by position after ``w3``).
Computed in f32 (f64 for f64 input), the result in ``x``'s type.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import GraphError
from ...core.coerce import as_float, float_compute_dtype
from ...core.registry import primitive

REG = "tract_transformers"
GATES = ("softmax_topk", "softmax_all", "sigmoid", "raw")
ACTIVATIONS = ("swiglu", "silu", "gelu", "relu")
LAYOUTS = ("canonical", "linear")


def _given(t: Any) -> bool:
    """A tensor input given (the declared default ``false`` means absent)."""
    return t is not None and not (np.ndim(t) == 0 and np.asarray(t).dtype == np.bool_ and not bool(t))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # overflow-free


def _act(g: np.ndarray, name: str) -> np.ndarray:
    if name in ("swiglu", "silu"):
        return g * _sigmoid(g)
    if name == "gelu":
        return 0.5 * g * (1.0 + np.tanh(np.float32(0.7978845608028654) * (g + np.float32(0.044715) * g * g * g)))
    return np.maximum(g, 0)


def _weights(logits: np.ndarray, k: int, gate: str) -> tuple[np.ndarray, np.ndarray]:
    """``(experts [N, k], weights [N, k])`` of each row's router logits ``[N, E]``."""
    idx = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    top = np.take_along_axis(logits, idx, axis=-1)
    if gate == "softmax_topk":
        e = np.exp(top - top.max(-1, keepdims=True))
        return idx, e / e.sum(-1, keepdims=True)
    if gate == "softmax_all":
        e = np.exp(logits - logits.max(-1, keepdims=True))
        return idx, np.take_along_axis(e / e.sum(-1, keepdims=True), idx, axis=-1)
    if gate == "sigmoid":
        return idx, _sigmoid(top)
    return idx, top


def _check(x, wg, w1, w2, w3, biases, k, activation, gate, layout) -> tuple[int, int, int]:
    if activation not in ACTIVATIONS:
        raise GraphError(f"tract_moe_ffn: activation '{activation}' is not one of {', '.join(ACTIVATIONS)}")
    if gate not in GATES:
        raise GraphError(f"tract_moe_ffn: gate '{gate}' is not one of {', '.join(GATES)}")
    if layout not in LAYOUTS:
        raise GraphError(f"tract_moe_ffn: expert_layout '{layout}' is not one of {', '.join(LAYOUTS)}")
    if activation == "swiglu" and w3 is None:
        raise GraphError("tract_moe_ffn: activation 'swiglu' needs w3 (the up projection)")
    if np.ndim(wg) != 2 or np.ndim(w1) != 3 or np.ndim(w2) != 3 or np.ndim(x) < 1:
        raise GraphError(f"tract_moe_ffn: x [.., D], wg [E, D], w1 and w2 of rank 3 expected, got x "
                         f"{list(np.shape(x))}, wg {list(np.shape(wg))}, w1 {list(np.shape(w1))}, w2 {list(np.shape(w2))}")
    e, d = np.shape(wg)
    h = np.shape(w1)[2] if layout == "canonical" else np.shape(w1)[1]
    want = {"w1": (e, d, h), "w2": (e, h, d)} if layout == "canonical" else {"w1": (e, h, d), "w2": (e, d, h)}
    if w3 is not None:
        want["w3"] = want["w1"]
    got = {"w1": np.shape(w1), "w2": np.shape(w2), "w3": np.shape(w3) if w3 is not None else None}
    for name, shape in want.items():
        if tuple(got[name]) != shape:
            raise GraphError(f"tract_moe_ffn: {name} is {list(got[name])}, expected {list(shape)} "
                             f"({layout} layout, E = {e}, D = {d}, H = {h})")
    if np.shape(x)[-1] != d:
        raise GraphError(f"tract_moe_ffn: x's last axis is {np.shape(x)[-1]}, the router wg [E, D] has D = {d}")
    if not 1 <= k <= e:
        raise GraphError(f"tract_moe_ffn: k = {k} experts per token, out of E = {e}")
    if biases is not None:
        for name, b, shape in zip(("wg_bias", "w1_bias", "w3_bias", "w2_bias"), biases, ((e,), (e, h), (e, h), (e, d))):
            if tuple(np.shape(b)) != shape:
                raise GraphError(f"tract_moe_ffn: {name} is {list(np.shape(b))}, expected {list(shape)}")
    return e, d, h


@primitive(
    "fragment tract_moe_ffn(x: tensor<scalar>, wg: tensor<scalar>, w1: tensor<scalar>, w2: tensor<scalar>,"
    " w3: tensor<scalar> = false, wg_bias: tensor<scalar> = false, w1_bias: tensor<scalar> = false,"
    " w3_bias: tensor<scalar> = false, w2_bias: tensor<scalar> = false, k: integer, activation: string,"
    ' gate: string, act_alpha: scalar = 1.0, act_limit: scalar = 0.0, expert_layout: string = "canonical")'
    " -> (y: tensor<scalar>);",
    REG,
    describe="routed mixture-of-experts feed-forward",
)
def tract_moe_ffn(x: np.ndarray, wg: np.ndarray, w1: np.ndarray, w2: np.ndarray, w3: Any = None,
                  wg_bias: Any = None, w1_bias: Any = None, w3_bias: Any = None, w2_bias: Any = None, *,
                  k: int, activation: str, gate: str, act_alpha: float = 1.0, act_limit: float = 0.0,
                  expert_layout: str = "canonical") -> np.ndarray:
    """The module docstring's semantics (tract 0.23.9)."""
    x = np.asarray(x)
    w3 = w3 if _given(w3) else None
    given = [_given(b) for b in (wg_bias, w1_bias, w3_bias, w2_bias)]
    if any(given) and not all(given):
        raise GraphError("tract_moe_ffn: biases are given all four (wg_bias, w1_bias, w3_bias, w2_bias) or none")
    biases = (wg_bias, w1_bias, w3_bias, w2_bias) if all(given) else None
    if biases is not None and w3 is None:
        raise GraphError("tract_moe_ffn: biases need w3 (tract maps them by position after it)")
    k = int(k)
    _check(x, wg, w1, w2, w3, biases, k, str(activation), str(gate), str(expert_layout))
    work = float_compute_dtype(x.dtype)
    rows = x.reshape(-1, x.shape[-1]).astype(work)

    def t(a):  # the weights as float arrays, canonical orientation
        a = np.asarray(a, work)
        return a if expert_layout == "canonical" else a.swapaxes(1, 2)

    w1c, w2c = t(w1), t(w2)
    w3c = t(w3) if w3 is not None else None
    bg, b1, b3, b2 = ((np.asarray(b, work) for b in biases) if biases is not None else (None,) * 4)
    logits = rows @ np.asarray(wg, work).T
    if bg is not None:
        logits = logits + bg
    experts, weights = _weights(logits, k, str(gate))
    limit = as_float(act_limit)
    alpha = work.type(as_float(act_alpha))
    out = np.zeros_like(rows)
    for e in np.unique(experts):
        r, j = np.nonzero(experts == e)
        xe = rows[r]
        g = xe @ w1c[e] + (b1[e] if b1 is not None else 0)
        if w3c is not None:
            u = xe @ w3c[e] + (b3[e] if b3 is not None else 0)
            if limit > 0 and activation == "swiglu":
                g = np.minimum(g, work.type(limit))
                u = np.clip(u, work.type(-limit), work.type(limit))
                h = (u + 1) * g * _sigmoid(alpha * g)
            else:
                h = _act(g, str(activation)) * u
        else:
            h = _act(g, str(activation))
        y = h @ w2c[e] + (b2[e] if b2 is not None else 0)
        out[r] += weights[r, j][:, None] * y  # an expert is picked at most once per row
    return out.reshape(x.shape).astype(x.dtype)
