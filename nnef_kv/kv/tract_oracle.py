"""Run tract 0.23.9's own quantized-KV ops on NumPy inputs (the oracle of the parity tests).

Each helper writes a one-node NNEF graph as text into a temporary folder, loads it with
``tract.nnef().with_tract_transformers()`` and keeps one stateful tract session. Outputs are matched
by position (tract renames them). Needs the ``tract`` Python package (dev extra).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

__all__ = ["TractOracleSdpa", "TractOracleDynCache"]

_DT = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16"}


def _load(text: str):
    import tract  # imported lazily: optional dependency

    with tempfile.TemporaryDirectory(prefix="nnef_kv_oracle_") as tmp:
        (Path(tmp) / "graph.nnef").write_text(text)
        model = tract.nnef().with_tract_transformers().load(tmp)
    return model.into_runnable().spawn_state()


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
        self.state = _load(text)

    def __call__(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        return self.state.run([q, k, v])[0].to_numpy()


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
        self.state = _load(text)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.state.run([x])[0].to_numpy()
