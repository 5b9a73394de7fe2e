"""The rotated-codebook KV cache ``nnef_kv_rotated_sdpa``: a seeded random-sign Hadamard (or orthogonal)
rotation, one f16 norm a vector, Lloyd-Max codes.

- ``sdpa``: :class:`RotatedSdpa` (the state), its settings and their check (:func:`rotated_problem`);
- ``codebooks``: the codebooks, their boundaries and the rotation;
- ``kernels``: scores and value sums straight from the codes, numba cores in ``_jit`` beside each NumPy
  reference.
"""
from __future__ import annotations

from .sdpa import ROTATED_SETTINGS, RotatedConfig, RotatedSdpa, rotated_problem

__all__ = ["RotatedConfig", "RotatedSdpa", "ROTATED_SETTINGS", "rotated_problem"]
