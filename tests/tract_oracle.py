"""Run a tiny NNEF graph in tract (the oracle), for the tract-op tests.

Not a test module: helpers imported by ``test_tract_ops.py`` and ``test_tract_decode.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

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
    import tract

    return tract.nnef().with_tract_transformers().with_onnx().load(str(folder))


def tract_run(folder: Path, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Load ``folder`` in tract, run once, outputs by position."""
    runnable = tract_load(folder).into_runnable()
    return [v.to_numpy() for v in runnable.run([np.ascontiguousarray(a) for a in inputs])]


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
