"""``tract_moe_ffn`` (nnef_kv/interpreter/ops/tract_moe.py) against tract 0.23.9, the oracle, on random inputs:
every gate, activation and layout, biases, GPT-OSS's clamped SwiGLU, rank-3 input; and a plain NumPy loop
(one token, one expert at a time) where tract is not installed. Bad shapes and names fail naming the op."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import HAVE_TRACT
from nnef_kv.errors import GraphError
from nnef_kv.interpreter.ops.tract_moe import tract_moe_ffn

T, D, H, E = 5, 8, 6, 4
NAMES = ["x", "wg", "w1", "w2", "w3", "wg_bias", "w1_bias", "w3_bias", "w2_bias"]


def _inputs(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = {"x": (T, D), "wg": (E, D), "w1": (E, D, H), "w2": (E, H, D), "w3": (E, D, H), "wg_bias": (E,),
              "w1_bias": (E, H), "w3_bias": (E, H), "w2_bias": (E, D)}
    return {k: (rng.standard_normal(s) * (2.0 if k == "x" else 1.0)).astype(np.float32) for k, s in shapes.items()}


def _loop(x, wg, w1, w2, w3=None, bg=None, b1=None, b3=None, b2=None, *, k, gate, activation, alpha=1.0, limit=0.0):
    """The semantics one token and one expert at a time (f64)."""
    x = x.reshape(-1, x.shape[-1]).astype(np.float64)
    out = np.zeros_like(x)
    sig = lambda z: 1 / (1 + np.exp(-z))  # noqa: E731
    act = {"swiglu": lambda g: g * sig(g), "silu": lambda g: g * sig(g), "relu": lambda g: np.maximum(g, 0),
           "gelu": lambda g: 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))}[activation]
    for t in range(len(x)):
        lg = x[t] @ wg.T + (0 if bg is None else bg)
        idx = sorted(range(len(lg)), key=lambda e: (-lg[e], e))[:k]
        top = lg[idx]
        w = {"softmax_topk": np.exp(top - top.max()) / np.exp(top - top.max()).sum(),
             "softmax_all": (np.exp(lg - lg.max()) / np.exp(lg - lg.max()).sum())[idx],
             "sigmoid": sig(top), "raw": top}[gate]
        for j, e in enumerate(idx):
            g = x[t] @ w1[e] + (0 if b1 is None else b1[e])
            if w3 is None:
                h = act(g)
            else:
                u = x[t] @ w3[e] + (0 if b3 is None else b3[e])
                if limit and activation == "swiglu":
                    g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
                    h = (u + 1) * g * sig(alpha * g)
                else:
                    h = act(g) * u
            out[t] += w[j] * (h @ w2[e] + (0 if b2 is None else b2[e]))
    return out


CASES = [  # (attributes, inputs given, linear layout)
    (dict(k=2, activation="swiglu", gate="softmax_topk"), 5, False),
    (dict(k=2, activation="swiglu", gate="softmax_topk", act_alpha=1.702, act_limit=7.0), 9, False),  # GPT-OSS
    (dict(k=2, activation="swiglu", gate="softmax_topk", act_limit=1.0), 5, False),  # clamped, alpha 1
    (dict(k=2, activation="swiglu", gate="softmax_topk", act_alpha=2.0), 5, False),  # alpha alone: unused
    (dict(k=2, activation="swiglu", gate="softmax_all"), 5, False),
    (dict(k=2, activation="swiglu", gate="sigmoid"), 5, False),
    (dict(k=2, activation="swiglu", gate="raw"), 5, False),
    (dict(k=1, activation="swiglu", gate="softmax_topk"), 5, False),
    (dict(k=4, activation="swiglu", gate="softmax_topk"), 9, False),
    (dict(k=2, activation="silu", gate="softmax_topk"), 4, False),
    (dict(k=2, activation="relu", gate="softmax_topk"), 4, False),
    (dict(k=2, activation="gelu", gate="softmax_topk"), 4, False),
    (dict(k=2, activation="gelu", gate="softmax_topk"), 5, False),  # gated GELU (Gemma 4)
    (dict(k=2, activation="swiglu", gate="softmax_topk", expert_layout="linear"), 9, True),
]


def _args(case):
    attrs, n, linear = case
    a = _inputs()
    ins = [a[k] for k in NAMES[:n]]
    if linear:
        ins = [np.ascontiguousarray(w.swapaxes(1, 2)) if i in (2, 3, 4) else w for i, w in enumerate(ins)]
    return attrs, ins, [a[k] for k in NAMES[:n]]


def _nnef_attr(v) -> str:
    return f"'{v}'" if isinstance(v, str) else repr(v)


def _tract(attrs, ins, rank3=False):
    from nnef_kv import tract_driver

    names = NAMES[:len(ins)]
    if rank3:
        ins = [ins[0][None], *ins[1:]]
    ext = "\n".join(f"    {n} = external<scalar>(shape = {list(i.shape)});" for n, i in zip(names, ins))
    att = "".join(f", {k} = {_nnef_attr(v)}" for k, v in attrs.items())
    text = (f"version 1.0;\nextension tract_registry tract_transformers;\ngraph g({', '.join(names)}) -> (y) {{\n"
            f"{ext}\n    y = tract_moe_ffn({', '.join(names)}{att});\n}}\n")
    return tract_driver.run(tract_driver.runnable(tract_driver.load_text(text)), ins)[0]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in c[0].values()) + f"-{c[1]}in")
def test_matches_the_plain_loop(case) -> None:
    attrs, ins, canonical = _args(case)
    got = tract_moe_ffn(*ins, **attrs)
    kw = dict(k=attrs["k"], gate=attrs["gate"], activation=attrs["activation"], alpha=attrs.get("act_alpha", 1.0),
              limit=attrs.get("act_limit", 0.0))
    want = _loop(*canonical, **kw)
    assert got.dtype == np.float32 and got.shape == (T, D)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.skipif(not HAVE_TRACT, reason="needs the tract Python package")
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in c[0].values()) + f"-{c[1]}in")
def test_matches_tract(case) -> None:
    attrs, ins, _ = _args(case)
    got = tract_moe_ffn(*ins, **attrs)
    theirs = _tract(attrs, ins)
    np.testing.assert_allclose(got, theirs, rtol=1e-5, atol=2e-6 * np.abs(theirs).max())


@pytest.mark.skipif(not HAVE_TRACT, reason="needs the tract Python package")
def test_rank3_input_keeps_its_shape_like_tract() -> None:
    attrs, ins, _ = _args(CASES[1])
    got = tract_moe_ffn(ins[0][None], *ins[1:], **attrs)
    assert got.shape == (1, T, D)
    np.testing.assert_allclose(got, _tract(attrs, ins, rank3=True), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change,message", [
    (dict(activation="tanh"), "activation 'tanh' is not one of"),
    (dict(gate="top1"), "gate 'top1' is not one of"),
    (dict(expert_layout="rows"), "expert_layout 'rows'"),
    (dict(k=5), "k = 5 experts per token, out of E = 4"),
    (dict(drop_w3=True), "activation 'swiglu' needs w3"),
    (dict(w2=np.zeros((E, D, H), np.float32)), r"w2 is \[4, 8, 6\], expected \[4, 6, 8\]"),
    (dict(partial_bias=True), "biases are given all four"),
])
def test_bad_inputs_fail_naming_the_op(change, message) -> None:
    a = _inputs()
    attrs = dict(k=2, activation="swiglu", gate="softmax_topk")
    attrs.update({k: v for k, v in change.items() if k in ("activation", "gate", "expert_layout", "k")})
    ins = [a[k] for k in NAMES[:5]]
    if "w2" in change:
        ins[3] = change["w2"]
    if change.get("drop_w3"):
        ins = ins[:4]
    if change.get("partial_bias"):
        ins = ins + [a["wg_bias"]]
    with pytest.raises(GraphError, match="tract_moe_ffn: " + message):
        tract_moe_ffn(*ins, **attrs)
