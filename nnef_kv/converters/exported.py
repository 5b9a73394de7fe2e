"""What an export lost: the sliding window its ``config.json`` declares and its graph's masks do not hold.

Stock torch-to-nnef 0.24.12 exports of Mistral, Gemma 2/3 and Qwen2 encode one plain causal mask for every
layer; the ``config.json`` the exporter writes beside the archive still says ``sliding_window``. The masks are
read by evaluating them (:mod:`.masks`) on the attentions :mod:`.attention` finds.
"""
from __future__ import annotations

from typing import Any

from ..errors import NnefKvError
from .attention import find_attention
from .graph_edit import GraphEdit
from .masks import read_block_masks


def declared_windows(config: dict[str, Any]) -> tuple[int, int, int] | None:
    """``(window, sliding layers, layers)`` a Hugging Face ``config.json`` declares, else None: from
    ``layer_types`` (``"sliding_attention"`` entries) when given, else every layer when ``sliding_window`` is a
    positive integer and ``use_sliding_window`` is not false."""
    w = config.get("sliding_window")
    if isinstance(config.get("text_config"), dict) and w is None:  # multimodal configs nest the decoder's
        return declared_windows(config["text_config"])
    if not isinstance(w, int) or isinstance(w, bool) or w <= 0:
        return None
    types = config.get("layer_types")
    if isinstance(types, list) and types:
        n = sum(1 for t in types if t == "sliding_attention")
        return (w, n, len(types)) if n else None
    if config.get("use_sliding_window") is False:
        return None
    layers = config.get("num_hidden_layers")
    layers = layers if isinstance(layers, int) and layers > 0 else 0
    return w, layers, layers


def config_beside(path: Any) -> Any:
    """The ``config.json`` an exporter left with the archive at ``path`` (inside a folder archive, named
    ``<base>.config.json`` beside it, or ``config.json`` beside it: torch-to-nnef's layout), else None."""
    from pathlib import Path

    from ..text import named_beside

    p = Path(path)
    for c in ((p / "config.json",) if p.is_dir() else ()) + (named_beside(p, "config.json"), p.parent / "config.json"):
        if c.is_file():
            return c
    return None


def lost_window_note(model: Any, path: Any) -> str | None:
    """One line when the ``config.json`` beside the archive declares a sliding window but no attention mask of
    the graph holds one (the export runs the model without its window), else None."""
    import json

    cfg = config_beside(path)
    if cfg is None or getattr(model, "document", None) is None or model.document.graph is None:
        return None
    try:
        with open(cfg, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    declared = declared_windows(config) if isinstance(config, dict) else None
    if declared is None:
        return None
    try:
        g = GraphEdit(model.document, getattr(model, "tensors", {}) or {})
        g.make_ssa()
        blocks, _ = find_attention(g)
        read_block_masks(g, blocks)
    except NnefKvError:
        return None
    kinds = [b.mask_reading.kind if b.mask is not None else ("causal" if b.is_causal else "none") for b in blocks]
    windowed, causal = kinds.count("window"), kinds.count("causal")
    w, sliding, layers = declared
    if not blocks or windowed >= sliding or causal == 0:
        return None
    return (f"{cfg} declares a sliding window of {w} tokens on {sliding} of {layers} layers, but {windowed or 'none'} "
            f"of the graph's {len(blocks)} attention masks holds one ({causal} read as plain causal): the export runs "
            f"the model without its window, alike up to {w} positions, different past them (stock torch-to-nnef "
            f"0.24.12 exports of Mistral, Gemma 2/3 and Qwen2 do not encode the window)")
