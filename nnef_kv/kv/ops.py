"""Registration of the quantized-KV stateful kernels with the interpreter's registry.

Each registered class is built once per session as ``cls(**attrs)`` and called ``state(*tensors)``
per run; the math lives in plain classes (:mod:`.tract_fused`, :mod:`.tract_dyn_cache`,
:mod:`.kivi`, :mod:`.ggml_sdpa`, :mod:`.hf_quantized`, :mod:`.rotated`) that work without any graph.
"""
from __future__ import annotations

import re
from pathlib import Path

from ..errors import GraphError
from ..core.registry import stateful
from .ggml_sdpa import GgmlSdpa
from .hf_quantized import HfQuantizedSdpa
from .kivi import KiviSdpa
from .rotated import RotatedSdpa
from .tract_dyn_cache import TractQuantizedDynKvCache
from .tract_fused import TractQuantizedKvSdpa

__all__ = ["QuantizedKvSdpaKernel", "QuantizedDynKvCacheKernel", "KiviSdpaKernel", "GgmlSdpaKernel",
           "HfQuantizedSdpaKernel", "RotatedSdpaKernel", "ROTATED_SIGNATURE",
           "KIVI_SIGNATURE", "GGML_SDPA_SIGNATURE", "HF_QUANTIZED_SIGNATURE",
           "nnef_kv_signature"]

NNEF_KV_DECL_FILE = Path(__file__).resolve().parents[1] / "grammar" / "nnef_kv_ops.nnef"
KIVI_DECL_FILE = NNEF_KV_DECL_FILE  # the file's former name here (it declared only the KIVI op)


def nnef_kv_signature(name: str) -> str:
    """The fragment declaration of the op ``name``, read from the shipped .nnef file (comments
    stripped, on one line)."""
    lines = [ln.split("#", 1)[0] for ln in NNEF_KV_DECL_FILE.read_text().splitlines()]
    text = " ".join(ln.strip() for ln in lines if ln.strip())
    found = [decl.strip() + ";" for decl in text.split(";")
             if re.match(rf"fragment\s+{re.escape(name)}\s*[(<]", decl.strip())]
    if len(found) != 1:
        raise GraphError(f"{NNEF_KV_DECL_FILE}: {len(found)} declarations of {name}, expected one")
    return found[0]


KIVI_SIGNATURE = nnef_kv_signature("nnef_kv_kivi_sdpa")
GGML_SDPA_SIGNATURE = nnef_kv_signature("nnef_kv_ggml_sdpa")
HF_QUANTIZED_SIGNATURE = nnef_kv_signature("nnef_kv_hf_quantized_sdpa")
ROTATED_SIGNATURE = nnef_kv_signature("nnef_kv_rotated_sdpa")

QUANTIZED_KV_SDPA_SIGNATURE = (
    "fragment tract_transformers_quantized_kv_sdpa(q: tensor<scalar>, k: tensor<scalar>, v: tensor<scalar>, "
    "axis: integer = 2, scale: scalar = 0.0) -> (output: tensor<scalar>);"
)
QUANTIZED_DYN_KV_CACHE_SIGNATURE = (
    "fragment tract_transformers_quantized_dyn_kv_cache(input: tensor<scalar>, name: string, axis: integer, "
    "bits: integer, per_channel: integer, datum_type: string, past_sequence_shape: integer[], "
    "input_sequence_shape: integer[]) -> (output: tensor<scalar>);"
)


@stateful(QUANTIZED_KV_SDPA_SIGNATURE, "tract_transformers", role="attention+kv",
          describe="tract fused u8 cache + attention")
class QuantizedKvSdpaKernel(TractQuantizedKvSdpa):
    """``tract_transformers_quantized_kv_sdpa``; ``scale = 0.0`` (the default) means tract's absent
    scale, ``1 / sqrt(D)``."""


@stateful(QUANTIZED_DYN_KV_CACHE_SIGNATURE, "tract_transformers", role="kv-cache",
          describe="tract quantized cache (4/8 bits), dequantized on read")
class QuantizedDynKvCacheKernel(TractQuantizedDynKvCache):
    """``tract_transformers_quantized_dyn_kv_cache``."""

    def __init__(self, name: str = "", axis: int = 2, bits: int = 8, per_channel: int = 0,
                 datum_type: str = "f32", past_sequence_shape=(), input_sequence_shape=()) -> None:
        super().__init__(name=name, axis=axis, bits=bits, per_channel=per_channel, datum_type=datum_type,
                         past_sequence_shape=past_sequence_shape, input_sequence_shape=input_sequence_shape)


@stateful(KIVI_SIGNATURE, "nnef_kv", role="attention+kv", describe="nnef-kv KIVI cache (1..8 bits) + attention")
class KiviSdpaKernel(KiviSdpa):
    """``nnef_kv_kivi_sdpa`` (declaration in ``nnef_kv/grammar/nnef_kv_ops.nnef``)."""


@stateful(GGML_SDPA_SIGNATURE, "nnef_kv", role="attention+kv",
          describe="llama.cpp ggml-typed cache (q8_0 ... iq4_nl, f16, f32) + attention")
class GgmlSdpaKernel(GgmlSdpa):
    """``nnef_kv_ggml_sdpa``: llama.cpp's ggml-typed KV cache (declaration in
    ``nnef_kv/grammar/nnef_kv_ops.nnef``)."""


@stateful(HF_QUANTIZED_SIGNATURE, "nnef_kv", role="attention+kv",
          describe="Hugging Face QuantizedCache (quanto / HQQ) + attention")
class HfQuantizedSdpaKernel(HfQuantizedSdpa):
    """``nnef_kv_hf_quantized_sdpa``: Hugging Face ``QuantizedCache`` (quanto / HQQ) + exact attention."""


@stateful(ROTATED_SIGNATURE, "nnef_kv", role="attention+kv",
          describe="nnef-kv rotated-codebook cache (Hadamard + Lloyd-Max, 1..4 bits, f16 norms) + attention")
class RotatedSdpaKernel(RotatedSdpa):
    """``nnef_kv_rotated_sdpa`` (declaration in ``nnef_kv/grammar/nnef_kv_ops.nnef``)."""
