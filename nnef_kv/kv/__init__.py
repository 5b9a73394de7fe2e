"""Quantized KV caches: tract's two ops reproduced exactly, and the accurate KIVI op.

* :class:`TractQuantizedKvSdpa` -- ``tract_transformers_quantized_kv_sdpa`` (tract 0.23.9 semantics);
* :class:`TractQuantizedDynKvCache` -- ``tract_transformers_quantized_dyn_kv_cache``;
* :class:`KiviSdpa` -- ``nnef_kv_kivi_sdpa``: 1..8-bit packed KIVI cache + attention on the codes;
* :class:`GgmlSdpa` -- ``nnef_kv_ggml_sdpa``: llama.cpp's ggml-typed KV cache (q8_0 ... iq4_nl, f16, f32)
  + attention over it (blocks from :mod:`.ggml`);
* :class:`HfQuantizedSdpa` -- ``nnef_kv_hf_quantized_sdpa``: Hugging Face's ``QuantizedCache`` (quanto, HQQ);
* :mod:`.packing` -- sub-byte code packing.

The classes work without a graph; each is registered as a stateful op on its own class (``@stateful``).
"""
from __future__ import annotations

from .ggml_sdpa import GgmlSdpa, GgmlSdpaConfig
from .hf_quantized import HfQuantizedConfig, HfQuantizedSdpa
from .kivi import KiviConfig, KiviSdpa, hadamard
from .tract_dyn_cache import TractQuantizedDynKvCache
from .tract_fused import TractQuantizedKvSdpa, softmax_attention

__all__ = ["GgmlSdpa", "GgmlSdpaConfig", "HfQuantizedConfig", "HfQuantizedSdpa", "KiviConfig", "KiviSdpa", "hadamard",
           "TractQuantizedDynKvCache", "TractQuantizedKvSdpa", "softmax_attention"]
