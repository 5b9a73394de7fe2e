"""Small models built in code: the built-in demo decoder (:mod:`.llama`) and its NumPy reference (:mod:`.reference`)."""
from __future__ import annotations

from .llama import (
    DecoderConfig,
    build_decoder,
    build_decoder_text,
    build_decoder_weights,
    cache_input_names,
    cache_output_names,
    empty_cache,
)

__all__ = ["DecoderConfig", "build_decoder", "build_decoder_text", "build_decoder_weights", "cache_input_names",
           "cache_output_names", "empty_cache"]
