"""Run a tiny NNEF graph in tract (the oracle), for the tract-op tests: a thin test helper over
:mod:`nnef_kv.tract_driver`.

Not a test module: helpers imported by ``test_tract_ops.py``, ``test_tract_decode.py``, ``test_numbers.py``
and ``test_kv_tract_ops.py`` (tract's two quantized-KV ops, one stateful tract session each).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from nnef_kv import tract_driver

#: what the op tests load graphs with
EXTENSIONS = ("tract_transformers", "onnx")

_TRACT_NAMES = {
    np.dtype(np.float16): "f16",
    np.dtype(np.float32): "f32",
    np.dtype(np.float64): "f64",
    np.dtype(np.int8): "i8",
    np.dtype(np.int16): "i16",
    np.dtype(np.int32): "i32",
    np.dtype(np.int64): "i64",
    np.dtype(np.uint8): "u8",
    np.dtype(np.bool_): "bool",
}


@dataclass
class Graph:
    """A graph: named inputs (shapes/dtypes from example arrays), body lines, output names."""

    inputs: dict[str, np.ndarray]
    body: Sequence[str]
    outputs: Sequence[str]
    extensions: Sequence[str] = ("tract_core",)
    fragments: str = ""
    symbols: Sequence[str] = field(default_factory=tuple)
    input_shapes: dict[str, str] = field(default_factory=dict)  # override, e.g. {"x": "[1, 2, S, 4]"}

    def text(self) -> str:
        lines = ["version 1.0;", ""]
        lines += [f"extension tract_registry {e};" for e in self.extensions]
        lines += [f"extension tract_symbol {s};" for s in self.symbols]
        lines.append("")
        if self.fragments:
            lines.append(self.fragments)
        lines.append(f"graph g({', '.join(self.inputs)}) -> ({', '.join(self.outputs)}) {{")
        for name, arr in self.inputs.items():
            shape = self.input_shapes.get(name, "[" + ", ".join(str(d) for d in arr.shape) + "]")
            dt = _TRACT_NAMES[np.asarray(arr).dtype]
            lines.append(f'  {name} = tract_core_external(shape = {shape}, datum_type = "{dt}");')
        lines += [f"  {b}" for b in self.body]
        lines.append("}")
        return "\n".join(lines) + "\n"

    def write(self, folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "graph.nnef").write_text(self.text())
        return folder


def tract_load(folder: Path):
    return tract_driver.load(folder, EXTENSIONS)


def tract_run(folder: Path, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Load ``folder`` in tract, run once, outputs by position."""
    return tract_driver.run(folder, [np.ascontiguousarray(a) for a in inputs], EXTENSIONS)


def assert_close(got: np.ndarray, want: np.ndarray, *, what: str = "") -> None:
    """f32 (and others): atol=rtol=1e-5; f16: 1e-3; integers and bools exactly; dtype and shape must match."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != tract {want.shape}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != tract {want.dtype}"
    if want.dtype.kind == "f":
        tol = 1e-3 if want.dtype == np.float16 else 1e-5
        np.testing.assert_allclose(
            got.astype(np.float64), want.astype(np.float64), atol=tol, rtol=tol, err_msg=what
        )
    else:
        np.testing.assert_array_equal(got, want, err_msg=what)


# ------------------------------------------------------------------------------------------------
# tract's quantized-KV ops on NumPy inputs: a one-node graph, one stateful tract session
# ------------------------------------------------------------------------------------------------
_DT = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16"}


class TractOracleSdpa:
    """A tract session of ``tract_transformers_quantized_kv_sdpa`` (sequence lengths symbolic)."""

    def __init__(self, b: int, hq: int, hkv: int, d: int, scale: float | None = None,
                 dtype: np.dtype | type = np.float32) -> None:
        dt = _DT[np.dtype(dtype)]
        scale_arg = "" if scale is None else f", scale = {float(scale)!r}"
        text = f"""version 1.0;
extension tract_registry tract_core;
extension tract_registry tract_transformers;
extension tract_symbol SQ;
extension tract_symbol SK;
graph g(q, k, v) -> (o) {{
  q = tract_core_external(shape = [{b}, {hq}, SQ, {d}], datum_type = '{dt}');
  k = tract_core_external(shape = [{b}, {hkv}, SK, {d}], datum_type = '{dt}');
  v = tract_core_external(shape = [{b}, {hkv}, SK, {d}], datum_type = '{dt}');
  o = tract_transformers_quantized_kv_sdpa(q, k, v, axis = 2{scale_arg});
}}
"""
        self.text = text
        self.state = tract_driver.Stateful(tract_driver.load_text(text))

    def __call__(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        return self.state.run_first([q, k, v])


class TractOracleDynCache:
    """A tract session of ``tract_transformers_quantized_dyn_kv_cache`` on ``[B, H, S, D]``."""

    def __init__(self, b: int, h: int, d: int, bits: int, per_channel: bool,
                 dtype: np.dtype | type = np.float32) -> None:
        dt = _DT[np.dtype(dtype)]
        text = f"""version 1.0;
extension tract_registry tract_core;
extension tract_registry tract_transformers;
extension tract_symbol S;
extension tract_symbol P;
graph g(x) -> (y) {{
  x = tract_core_external(shape = [{b}, {h}, S, {d}], datum_type = '{dt}');
  y = tract_transformers_quantized_dyn_kv_cache(x, name = "cache", axis = 2, bits = {bits},
        per_channel = {int(per_channel)}, datum_type = "{dt}",
        past_sequence_shape = [{b}, {h}, P, {d}], input_sequence_shape = [{b}, {h}, S, {d}]);
}}
"""
        self.text = text
        self.state = tract_driver.Stateful(tract_driver.load_text(text))

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.state.run_first([x])
