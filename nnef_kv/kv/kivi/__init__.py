"""KIVI (Liu et al. 2024) as ``nnef_kv_kivi_sdpa``: keys quantized per channel, values per token, on packed codes.

- ``sdpa``: :class:`KiviSdpa`, the cache and its attention (the state the op registers);
- ``config``: :class:`KiviConfig`, the settings and their one check (:func:`kivi_problem`), ``hadamard``;
- ``parts``: the buffers and views the state is made of; ``attend``: attention over codes + exact parts;
  ``variant``: the dequantize-then-attend variant;
- ``kernels``: the decode-step attention on the packed codes, numba cores in ``_jit`` beside each NumPy
  reference.
"""
from __future__ import annotations

from .config import CODES_LAYOUT, KIVI_SETTINGS, KiviConfig, hadamard, kivi_problem
from .sdpa import KiviSdpa

__all__ = ["KiviConfig", "KiviSdpa", "hadamard", "kivi_problem", "KIVI_SETTINGS", "CODES_LAYOUT"]
