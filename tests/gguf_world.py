"""Small GGUF files written with the ``gguf`` package's writer, as llama.cpp's converter lays them out.

:func:`write_gguf` takes a :class:`~nnef_kv.models.DecoderConfig` and its HF-order weights
(:func:`~nnef_kv.models.build_decoder_weights`) and writes them under the GGUF tensor names, with the
llama architecture's Q/K rows interleaved the way llama.cpp's ``convert_hf_to_gguf.py`` stores them
(written here from the layout's description, independently of the front end's inverse), weights as
F32 or quantized by ``gguf.quants`` (``types``: label suffix -> GGML type), and a small byte-level BPE
tokenizer. ``edit`` hooks let the bad-input tests change one key or one tensor.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np

LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}
GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
          "lm_head.weight": "output.weight"}


def interleave_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's storage of Q/K for its RoPE: within each head, HF rows ``i`` and ``i + D/2`` become rows
    ``2i`` and ``2i + 1``."""
    rows = w.shape[0]
    d = rows // n_head
    out = np.empty_like(w)
    for h in range(n_head):
        for i in range(d // 2):
            out[h * d + 2 * i] = w[h * d + i]
            out[h * d + 2 * i + 1] = w[h * d + d // 2 + i]
    return out


def byte_tokens() -> tuple[list[str], list[str]]:
    """256 byte-level tokens (GPT-2's alphabet) plus the merges of ' t', 'he', ' the'."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = ["Ġ t", "h e", "Ġt he"]
    tokens = alphabet + ["Ġt", "he", "Ġthe"]
    return tokens, merges


def write_gguf(path: Path, cfg: Any, weights: dict[str, np.ndarray], *, arch: str = "llama",
               types: dict[str, Any] | None = None, tokens: tuple[list[str], list[str]] | None = None,
               edit_meta: Callable[[Any], None] | None = None, skip: tuple[str, ...] = (),
               extra_tensors: dict[str, np.ndarray] | None = None, pre: str = "smollm") -> Path:
    import gguf
    from gguf import GGMLQuantizationType as Q

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.layers)
    w.add_context_length(cfg.max_positions)
    w.add_embedding_length(cfg.hidden)
    w.add_feed_forward_length(cfg.mlp)
    w.add_head_count(cfg.heads)
    w.add_head_count_kv(cfg.kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.eps)
    w.add_vocab_size(cfg.vocab)
    toks, merges = tokens or byte_tokens()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(toks)
    w.add_token_types([1] * len(toks))
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    if edit_meta is not None:
        edit_meta(w)
    types = types or {}
    for label, value in weights.items():
        if label == "model.rotary_emb.inv_freq":
            continue
        if label in GLOBAL:
            name = GLOBAL[label]
        else:
            _, _, layer, rest = label.split(".", 3)
            name = f"blk.{layer}.{LAYER[rest]}"
        if name in skip:
            continue
        v = np.asarray(value, np.float32)
        if arch == "llama" and name.endswith("attn_q.weight"):
            v = interleave_rows(v, cfg.heads)
        elif arch == "llama" and name.endswith("attn_k.weight"):
            v = interleave_rows(v, cfg.kv_heads)
        kind = next((t for suffix, t in types.items() if label.endswith(suffix)), Q.F32)
        if kind == Q.F32 or v.ndim == 1:
            w.add_tensor(name, v)
        else:
            w.add_tensor(name, gguf.quants.quantize(v, kind), raw_dtype=kind)
    for name, v in (extra_tensors or {}).items():
        w.add_tensor(name, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def dequantized(weights: dict[str, np.ndarray], types: dict[str, Any]) -> dict[str, np.ndarray]:
    """The weights as the GGUF holds them (quantized then dequantized by ``gguf.quants``), HF order."""
    import gguf

    out = {}
    for label, v in weights.items():
        kind = next((t for suffix, t in types.items() if label.endswith(suffix)), None)
        if kind is not None and np.asarray(v).ndim == 2:
            out[label] = gguf.quants.dequantize(gguf.quants.quantize(np.asarray(v, np.float32), kind), kind)
        else:
            out[label] = v
    return out
