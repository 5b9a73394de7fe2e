"""The built-in decoder's forward pass written directly in NumPy (float64), independent of any NNEF
interpreter: the ground truth the NNEF graph of :mod:`.llama` is tested against."""
from __future__ import annotations

import numpy as np

from .llama import DecoderConfig

__all__ = ["reference_logits"]


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def _rope(x: np.ndarray, pos: np.ndarray, inv: np.ndarray) -> np.ndarray:
    """``x [H, T, D]`` rotated for positions ``pos [T]`` (rotate-half convention)."""
    freqs = pos[:, None] * inv[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * np.cos(emb) + rot * np.sin(emb)


def reference_logits(cfg: DecoderConfig, weights: dict[str, np.ndarray], ids: np.ndarray) -> np.ndarray:
    """Logits ``[T, vocab]`` of every position of ``ids`` (one full causal forward, float64). The weights
    may have either spelling's shapes (``spelling="tract"`` adds leading unit axes)."""
    w = {k: v.astype(np.float64).reshape(v.shape[-1:] if k.endswith(("norm.weight", "inv_freq", "bias"))
                                         else v.shape[-2:])
         for k, v in weights.items()}
    ids = np.asarray(ids).reshape(-1)
    t, d = ids.size, cfg.head_dim
    pos = np.arange(t, dtype=np.float64)
    inv = w["model.rotary_emb.inv_freq"]
    h = w["model.embed_tokens.weight"][ids]
    causal = np.triu(np.ones((t, t), bool), 1)
    if cfg.sliding_window:  # HF's sliding layers: a query at p sees the keys in (p - W, p]
        causal |= np.tril(np.ones((t, t), bool), -int(cfg.sliding_window))
    for l in range(cfg.layers):
        p = f"model.layers.{l}."
        x = _rms(h, w[p + "input_layernorm.weight"], cfg.eps)
        def proj(name: str, n: int) -> np.ndarray:
            y = x @ w[p + f"self_attn.{name}_proj.weight"].T
            if cfg.attention_bias:
                y = y + w[p + f"self_attn.{name}_proj.bias"]
            y = y.reshape(t, n, d).transpose(1, 0, 2)
            return _rms(y, w[p + f"self_attn.{name}_norm.weight"], cfg.eps) if cfg.qk_norm and name != "v" else y

        q, k, v = proj("q", cfg.heads), proj("k", cfg.kv_heads), proj("v", cfg.kv_heads)
        q, k = _rope(q, pos, inv), _rope(k, pos, inv)
        k = np.repeat(k, cfg.groups, axis=0)
        v = np.repeat(v, cfg.groups, axis=0)
        s = q @ k.transpose(0, 2, 1) / np.sqrt(d)
        s = np.where(causal, -np.inf, s)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        a = (s @ v).transpose(1, 0, 2).reshape(t, cfg.heads * d)
        h = h + a @ w[p + "self_attn.o_proj.weight"].T
        x = _rms(h, w[p + "post_attention_layernorm.weight"], cfg.eps)
        g = x @ w[p + "mlp.gate_proj.weight"].T
        u = x @ w[p + "mlp.up_proj.weight"].T
        h = h + ((g / (1 + np.exp(-g))) * u) @ w[p + "mlp.down_proj.weight"].T
    head = w["model.embed_tokens.weight"] if cfg.tied_embeddings else w["lm_head.weight"]
    return _rms(h, w["model.norm.weight"], cfg.eps) @ head.T
