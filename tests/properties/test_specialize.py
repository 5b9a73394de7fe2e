"""Plan-time speed-ups that must not change a single bit: specialised kernels (interpreter/specialize.py),
producer-into-product fusion (interpreter/fuse.py) and compiled integer attributes (graph.py)."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import nnef_kv
from nnef_kv.errors import GraphError, NnefKvError
from nnef_kv.interpreter.ops import nnef_std as S
from nnef_kv.interpreter.ops import tract_core as C
from nnef_kv.interpreter.ops import tract_transformers as T
from nnef_kv.interpreter.plan import build_plan, execute, bind_inputs
from nnef_kv.interpreter.plan import get_plan
from nnef_kv.interpreter.plan.specialize import SPECIALIZERS, specialize
from nnef_kv.io.archive import Model


def same(fast: Callable[[], Any], slow: Callable[[], Any]) -> None:
    """Both give bit-identical arrays of one dtype and shape, or both raise an nnef-kv error of one type
    (a NumPy error passing through is compared by type too)."""
    try:
        want = slow()
    except Exception as exc:  # noqa: BLE001
        with pytest.raises(type(exc)):
            fast()
        return
    got = fast()
    assert type(got) is type(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    assert np.array_equal(np.signbit(got), np.signbit(want)) if got.dtype.kind == "f" else True


def arrays(dtype: Any, shape: tuple[int, ...], seed: int, special: bool = False) -> np.ndarray:
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal(shape) * 3).astype(dtype)
    if special and a.size >= 4:
        flat = a.reshape(-1)
        flat[:4] = [np.nan, np.inf, -np.inf, -0.0]
    return a


def test_every_specializer_is_registered_for_a_registered_kernel() -> None:
    from nnef_kv.interpreter.catalog import PRIMITIVES, lookup

    lookup("add")  # loads every op module
    kernels = {p.kernel for p in PRIMITIVES.values()}
    assert set(SPECIALIZERS) <= kernels
    assert specialize(S.reshape, {"shape": [0, -1]}) is None  # input-dependent: left to the generic kernel


@settings(max_examples=150, deadline=None)
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=4), start=st.integers(0, 4), count=st.integers(0, 3),
       new=st.lists(st.integers(1, 6), min_size=0, max_size=3), seed=st.integers(0, 9))
def test_reshape_specialized_matches_generic(
    shape: list[int], start: int, count: int, new: list[int], seed: int
) -> None:
    x = arrays(np.float32, tuple(shape), seed)
    if start <= len(shape) and start + count <= len(shape) and new and int(np.prod(new)) == int(
            np.prod(shape[start:start + count])):
        pass  # a valid reshape; otherwise both must fail alike
    attrs = {"shape": new, "axis_start": start, "axis_count": count}
    fast = specialize(S.reshape, attrs)
    assert fast is not None
    same(lambda: fast(x), lambda: S.reshape(x, **attrs))


@settings(max_examples=100, deadline=None)
@given(rank=st.integers(1, 5), data=st.data())
def test_transpose_and_unsqueeze_specialized_match_generic(rank: int, data: st.DataObject) -> None:
    shape = tuple(data.draw(st.lists(st.integers(1, 3), min_size=rank, max_size=rank)))
    x = arrays(np.float32, shape, 0)
    n = data.draw(st.integers(0, rank + 1))
    axes = data.draw(st.permutations(list(range(n))))
    fast = specialize(S.transpose, {"axes": list(axes)})
    assert fast is not None
    same(lambda: fast(x), lambda: S.transpose(x, axes=list(axes)))
    un = data.draw(st.lists(st.integers(0, rank + 2), min_size=1, max_size=3, unique=True))
    fu = specialize(S.unsqueeze, {"axes": un})
    assert fu is not None
    same(lambda: fu(x), lambda: S.unsqueeze(x, axes=un))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN/inf inputs: the generic kernel warns alike
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
@pytest.mark.parametrize("shape,axis", [((1, 1, 16), 2), ((1, 5, 16), -1), ((2, 3, 4), 1), ((4,), 0), ((2, 3), 2),
                                        ((3, 2), -3), ((1, 0), 1), ((3, 0), -1)])
def test_rms_norm_specialized_matches_generic(dtype: Any, shape: tuple[int, ...], axis: int) -> None:
    x = arrays(dtype, shape, 1, special=shape == (2, 3, 4))
    fast = specialize(C.tract_core_rms_norm, {"axis": axis, "eps": 1e-5})
    assert fast is not None
    same(lambda: fast(x), lambda: C.tract_core_rms_norm(x, axis=axis, eps=1e-5))


def rope_out_of_place(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """apply_rope as separate ops, each product rounded to x's type: what the kernel's in-place form must equal."""
    if x.shape[-1] % 2:
        raise GraphError("odd last axis")
    half, dt = x.shape[-1] // 2, x.dtype
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return (np.multiply(x, cos.astype(dt)) + np.multiply(rot, sin.astype(dt))).astype(dt)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN/inf inputs: the generic kernel warns alike
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_silu_and_rope_fast_forms_match_the_plain_ones(dtype: Any) -> None:
    """silu's f32 path (no dtype dispatch) and apply_rope's in-place second product change no bit."""
    g = arrays(dtype, (1, 3, 40), 2, special=True)
    g.reshape(-1)[4:6] = [-1000.0, 1000.0]  # exp overflows: no warning, same values
    with np.errstate(over="raise"):
        same(lambda: C.tract_core_silu(g), lambda: C._float_unary(g, C._silu))
    for xs, cs in [
        ((1, 4, 3, 8), (1, 1, 3, 8)),
        ((2, 3, 8), (3, 8)),
        ((1, 2, 1, 8), (1, 1, 5, 8)),
        ((1, 2, 3, 7), (3, 7)),
    ]:
        x = arrays(dtype, xs, 3, special=True)
        c, s = arrays(np.float32, cs, 4), arrays(np.float32, cs, 5)
        same(lambda: T.tract_transformers_apply_rope(x, c, s), lambda: rope_out_of_place(x, c, s))


@pytest.mark.parametrize("hq,hkv,sq,skv", [(4, 4, 1, 9), (4, 2, 1, 9), (4, 1, 3, 7), (2, 2, 5, 5), (2, 2, 6, 4)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("mask", [None, False, "float"])
def test_sdpa_specialized_matches_generic(hq: int, hkv: int, sq: int, skv: int, causal: bool, mask: Any) -> None:
    q, k, v = (arrays(np.float32, (1, h, n, 8), i) for i, (h, n) in enumerate([(hq, sq), (hkv, skv), (hkv, skv)]))
    m = np.asarray(False) if mask is False else (arrays(np.float32, (sq, skv), 9) if mask == "float" else None)
    attrs = {"scale": 0.25, "datum_type": "f32", "acc_datum_type": "f32", "is_causal": causal}
    fast = specialize(T.tract_transformers_sdpa, attrs)
    assert fast is not None
    args = (q, k, v) if m is None else (q, k, v, m)
    same(lambda: fast(*args), lambda: T.tract_transformers_sdpa(*args, **attrs))


def test_sdpa_bad_datum_type_is_left_to_the_generic_kernel() -> None:
    assert specialize(T.tract_transformers_sdpa, {"acc_datum_type": "nonsense"}) is None


# ------------------------------------------------------------------------------------------------
# whole plans: fused + specialised vs plain, bit for bit
# ------------------------------------------------------------------------------------------------
BLOCK = """version 1.0;
extension tract_registry tract_core;
extension tract_symbol S;
graph g(x) -> (y, r2)
{
  x = tract_core_external(shape = [1, S, 16], datum_type = 'f32');
  w1 = variable<scalar>(label = 'w1', shape = [1, 1, 16]);
  wg = variable<scalar>(label = 'wg', shape = [1, 16, 24]);
  wu = variable<scalar>(label = 'wu', shape = [1, 16, 24]);
  wide = variable<scalar>(label = 'wide', shape = [3, 1, 24]);
  n = mul(tract_core_rms_norm(x, axis = 2, eps = 1e-5), w1);
  g = matmul(n, wg);
  u = matmul(n, wu);
  a = mul(u, tract_core_silu(g));
  r2 = tract_core_rms_norm(x, axis = 2, eps = 1e-5);
  b = mul(tract_core_silu(g), wide);
  s = tract_core_silu(u);
  c = add(mul(s, 2.0), s);
  d = mul(tract_core_silu(u), tract_core_rms_norm(g, axis = 2, eps = 1e-5));
  y = add(add(add(a, slice(b, axes = [0], begin = [0], end = [1])), c), d);
}
"""


def block_model() -> Model:
    rng = np.random.default_rng(0)
    t = {k: rng.standard_normal(s).astype(np.float32) for k, s in
         [("w1", (1, 1, 16)), ("wg", (1, 16, 24)), ("wu", (1, 16, 24)), ("wide", (3, 1, 24))]}
    return Model(nnef_kv.parse(BLOCK, filename="t/graph.nnef"), t, source="t")


def run_plan(plan: Any, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    v = bind_inputs(plan, inputs)
    execute(plan, v, [])
    return {n: v[s] for n, s in plan.outputs}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NaN/inf inputs: the generic kernel warns alike
def test_fused_plan_matches_unfused_bit_for_bit() -> None:
    model = block_model()
    fused = get_plan(model)
    plain = build_plan(fused.graph, fuse_ops=False, specialize_kernels=False)
    # rms_norm->mul(w1) and silu(g)->mul(u) fuse; silu(g)->mul(wide) too (w broadcasts wider: generic mul);
    # silu(u) has two readers and r2 is a graph output: neither fuses; mul(silu(u), rms_norm(g)): one of the
    # two producers fuses, the other runs as its own step
    assert fused.info["fused_ops"] == 4 and plain.info["fused_ops"] == 0
    assert fused.info["steps"] == plain.info["steps"] - 4
    assert any(n.op == "tract_core_rms_norm*mul" for n in fused.step_nodes)
    for seq in (1, 4):
        x = arrays(np.float32, (1, seq, 16), seq, special=seq == 4)
        a, b = run_plan(fused, {"x": x}), run_plan(plain, {"x": x})
        for name in ("y", "r2"):
            np.testing.assert_array_equal(a[name], b[name])
        assert a["y"].shape == (1, seq, 24)


def test_capturing_a_fused_value_runs_the_unfused_plan() -> None:
    model = block_model()
    session = model.session()
    plan = session.plan
    x = arrays(np.float32, (1, 2, 16), 7)
    inner = [n for n in plan.unfused().step_nodes if n.op == "tract_core_silu"]
    slots = {s for n in inner for s in n.outputs}
    assert slots & plan.elided
    outs, caps = session.run({"x": x}, capture=["n", inner[0]])
    want = run_plan(build_plan(plan.graph, fuse_ops=False), {"x": x})
    np.testing.assert_array_equal(outs["y"], want["y"])
    np.testing.assert_array_equal(caps[inner[0].name], C.tract_core_silu(caps["n"] @ model.tensors["wg"][0]))
    assert plan.unfused() is plan.unfused()  # built once


def test_error_in_a_fused_producer_names_it() -> None:
    text = """version 1.0;
extension tract_registry tract_core;
graph g(x) -> (y)
{
  x = tract_core_external(shape = [2, 3], datum_type = 'f32');
  w = variable<scalar>(label = 'w', shape = [2, 3]);
  y = mul(tract_core_rms_norm(x, axis = 5, eps = 1e-5), w);
}
"""
    model = Model(nnef_kv.parse(text, filename="t/graph.nnef"), {"w": np.ones((2, 3), np.float32)}, source="t")
    with pytest.raises(GraphError, match=r"graph\.nnef:7:\d+: .*tract_core_rms_norm.*axis 5 out of range"):
        model.session().run({"x": np.ones((2, 3), np.float32)})


# ------------------------------------------------------------------------------------------------
# compiled integer attributes
# ------------------------------------------------------------------------------------------------
ATTRS = """version 1.0;
extension tract_registry tract_core;
extension tract_symbol S;
graph g(x, n) -> (r, s, t)
{
  x = tract_core_external(shape = [1, S, 4], datum_type = 'f32');
  n = tract_core_external(shape = [], datum_type = 'i64');
  r = tract_core_range(S - 7, S * 2 - (0 - S) / 2, 1);
  s = slice(x, axes = [1], begin = [-S / 2], end = [S - 1]);
  t = reshape(x, shape = [S * 2, n / 2]);
}
"""


@pytest.mark.parametrize("seq", [2, 5, 8])  # S = 1: end 0 means "to the end" (run_both below)
def test_compiled_attributes_match_the_interpreter(seq: int) -> None:
    doc = nnef_kv.parse(ATTRS, filename="t/graph.nnef")
    x = arrays(np.float32, (1, seq, 4), seq)
    n = np.asarray(4, np.int64)
    out = Model(doc, {}, source="t").session().run({"x": x, "n": n})
    # NNEF integer division truncates towards zero: (0 - S) / 2 = -(S // 2)
    np.testing.assert_array_equal(out["r"], np.arange(seq - 7, 2 * seq + seq // 2, dtype=np.int64))
    begin = -(seq // 2)
    np.testing.assert_array_equal(out["s"], x[:, begin + seq if begin < 0 else begin:seq - 1])
    np.testing.assert_array_equal(out["t"], x.reshape(seq * 2, 2))
    lazies = [a for node in get_plan(Model(doc, {}, source="t")).step_nodes for a in node.attrs.values()
              if hasattr(a, "fn")]
    assert lazies, "the attributes above are per-run values"


def run_both(monkeypatch: pytest.MonkeyPatch, text: str, inputs: dict[str, np.ndarray]) -> None:
    """The same outputs, or the same error message, with attribute compilation on and off."""
    from nnef_kv.interpreter.builder import GraphBuilder

    def attempt() -> Any:
        model = Model(nnef_kv.parse(text, filename="t/graph.nnef"), {}, source="t")
        try:
            return model.session().run(inputs)
        except NnefKvError as exc:
            return f"{type(exc).__name__}: {exc}"

    compiled = attempt()
    with monkeypatch.context() as m:
        m.setattr(GraphBuilder, "_compile_int", lambda self, e, ctx: None)
        interpreted = attempt()
    if isinstance(interpreted, str):
        assert compiled == interpreted
    else:
        assert not isinstance(compiled, str), compiled
        for k in interpreted:
            same(lambda: compiled[k], lambda: interpreted[k])


@pytest.mark.parametrize("expr,value", [
    ("[f * 2, 3]", np.asarray(2.0, np.float32)),  # a float operand: the interpreter's result
    ("[f * 2, 3]", np.asarray(2, np.int64)),
    ("[12 / f, 1]", np.asarray(0, np.int64)),  # division by zero: the interpreter's error
    ("[f * 4611686018427387904 * 4 + 12, 1]", np.asarray(1, np.int64)),  # wider than 64 bits: refused alike
    ("[-f - -f + 12, 1]", np.asarray(-3, np.int64)),
])
def test_compiled_attribute_agrees_with_the_interpreter(monkeypatch: pytest.MonkeyPatch, expr: str,
                                                        value: np.ndarray) -> None:
    text = f"""version 1.0;
extension tract_registry tract_core;
graph g(x, f) -> (t)
{{
  x = tract_core_external(shape = [2, 6], datum_type = 'f32');
  f = tract_core_external(shape = [], datum_type = '{'f32' if value.dtype.kind == 'f' else 'i64'}');
  t = reshape(x, shape = {expr});
}}
"""
    x = np.arange(12, dtype=np.float32).reshape(2, 6)
    run_both(monkeypatch, text, {"x": x, "f": value})


def test_compiled_attributes_agree_on_the_symbol_example(monkeypatch: pytest.MonkeyPatch) -> None:
    for seq in (1, 3, 8):
        run_both(monkeypatch, ATTRS, {"x": arrays(np.float32, (1, seq, 4), seq), "n": np.asarray(4, np.int64)})


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_decoder_decodes_bit_identically_with_and_without_the_plan_speedups(tmp_path: Any, kv_heads: int) -> None:
    """The benchmark's LLaMA-style decoder (dyn_kv_cache + sdpa, rope, rms_norm, SwiGLU): prefill then 12
    decode steps, the optimised plan against one built with no fusion and no specialisation."""
    import importlib.util
    import sys

    from conftest import REPO

    spec = importlib.util.spec_from_file_location("bench_decode_plan", REPO / "benchmarks" / "decode.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    cfg = mod.Config(layers=2, hidden=64, heads=4, kv_heads=kv_heads, ffn=96, vocab=64)
    folder = mod.write_archive(cfg, tmp_path / "dec")
    fast_model, plain_model = nnef_kv.load(folder), nnef_kv.load(folder)
    fast = get_plan(fast_model)
    plain = build_plan(fast.graph, fuse_ops=False, specialize_kernels=False)
    object.__setattr__(plain_model, "_nnef_kv_plan", (plain_model.document, plain))
    assert fast.info["fused_ops"] == 3 * cfg.layers + 1  # 2 rms_norm + 1 silu a layer, the final norm
    assert fast.info["specialized"] > 0 and plain.info["specialized"] == 0
    a, b = fast_model.session(), plain_model.session()
    tokens = np.array([[3, 1, 4, 1, 5, 9, 2, 6]], np.int64)
    for step in range(13):
        la, lb = a.run({"input_ids": tokens})["outputs"], b.run({"input_ids": tokens})["outputs"]
        np.testing.assert_array_equal(la, lb)
        tokens = np.array([[int(np.argmax(la[0, -1]))]], np.int64)
