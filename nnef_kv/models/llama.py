"""A small LLaMA-style decoder written as NNEF text, with deterministic random weights.

The graph follows what torch-to-nnef's LLM export writes (see ``shared/fixtures/README.md``):

* ``cache="explicit"`` (default): inputs ``input_ids [1, S]`` (i64) and, per layer ``l``,
  ``in_cache_key_l`` / ``in_cache_value_l [1, kv_heads, P, head_dim]``; outputs ``outputs [1, 1, vocab]``
  (logits of the last position) then ``out_cache_key_l`` / ``out_cache_value_l [1, kv_heads, P+S, head_dim]``
  (``concat([in_cache, new], axis = 2)``). Keys are cached after RoPE. Attention is plain
  ``matmul`` / ``softmax`` / ``matmul`` with an in-graph causal mask; grouped-query attention repeats
  the KV heads with ``unsqueeze`` / ``tile`` / ``reshape`` as the exporter does.
* ``cache="dyn"``: the cache lives in the session (``tract_transformers_dyn_kv_cache`` per K and V)
  and attention is ``tract_transformers_sdpa``; the only input is ``input_ids`` and the only output
  ``outputs``. The past length is read from layer 0's value cache (values need no position), so the
  graph needs no position input.
* ``cache="dyn", spelling="tract"``: the same model in the form tract itself writes once it has detected a
  LLaMA (``transformers_detect_all``; what ``benchmarks/decode.py`` times): ``tract_core_rms_norm``,
  ``tract_transformers_apply_rope``, ``tract_core_silu``, ``tract_transformers_dyn_kv_cache`` and a causal
  ``tract_transformers_sdpa`` (no mask tensor), positions ``P .. P+S-1`` from the symbol ``P`` (bound by
  the caches), weights ``[1, out, in]`` used through ``matmul(..., transposeB = true)``, norm weights
  ``[1, 1, hidden]``, the final norm on the last position only; no ``tract_assert``. The default spelling,
  ``"torch-to-nnef"``, is the exporter's chains of small ops described above.
* ``weights="q4_0"`` (torch-to-nnef spelling): the linear weights (q/k/v/o, gate/up/down, LM head) as
  tract Q4_0 blocks (:meth:`~nnef_kv.tensors.blockquant.BlockQuantTensor.quantize_q4_0`), declared
  ``variable(label, shape)`` as ``--compression-method min_max_q4_0`` writes them; the embedding and the
  norms stay f32.

Blocks: token embedding (gather), per layer RMSNorm -> Q/K/V projections -> RoPE (rotate-half, theta
``rope_theta``) -> attention -> output projection -> residual, RMSNorm -> SwiGLU MLP -> residual; final
RMSNorm and LM head on the last position.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

__all__ = ["DecoderConfig", "build_decoder_text", "build_decoder_weights", "build_decoder", "empty_cache",
           "cache_input_names", "cache_output_names"]

_CACHE_KINDS = ("explicit", "dyn")
_SPELLINGS = ("torch-to-nnef", "tract")
_WEIGHTS = ("f32", "q4_0")
#: the labels (suffixes) of the linear weights that ``weights="q4_0"`` stores as Q4_0 blocks
_LINEAR_WEIGHTS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
                   "up_proj.weight", "down_proj.weight", "lm_head.weight")


@dataclass(frozen=True)
class DecoderConfig:
    """Sizes and seed of the built-in decoder. ``heads`` must be a multiple of ``kv_heads``."""

    vocab: int = 128
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    mlp: int = 128
    rope_theta: float = 10000.0
    eps: float = 1e-5
    max_positions: int = 4096
    seed: int = 0
    init_std: float = 0.1
    cache: str = "explicit"
    spelling: str = "torch-to-nnef"
    weights: str = "f32"
    name: str = field(default="nnef_kv_tiny_llama")
    #: the LM head reads the token embedding (one array, used by the gather and the last linear)
    tied_embeddings: bool = False
    #: q/k/v projections with a bias (Qwen2)
    attention_bias: bool = False
    #: an RMSNorm over head_dim on each query and key head before RoPE (Qwen3)
    qk_norm: bool = False
    #: HF's sliding-window attention in the graph's mask (0: none): a query at position p sees the keys in
    #: (p - W, p], every layer
    sliding_window: int = 0

    def validate(self) -> None:
        from ..errors import GraphError

        for k in ("vocab", "hidden", "layers", "heads", "kv_heads", "head_dim", "mlp", "max_positions"):
            if int(getattr(self, k)) < 1:
                raise GraphError(f"decoder config: {k} must be >= 1, got {getattr(self, k)}")
        if int(self.sliding_window) < 0:
            raise GraphError(f"decoder config: sliding_window must be >= 0, got {self.sliding_window}")
        if self.heads % self.kv_heads:
            raise GraphError(f"decoder config: heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise GraphError(f"decoder config: head_dim must be even for RoPE, got {self.head_dim}")
        if self.cache not in _CACHE_KINDS:
            raise GraphError(f"decoder config: cache must be one of {_CACHE_KINDS}, got {self.cache!r}")
        if self.spelling not in _SPELLINGS:
            raise GraphError(f"decoder config: spelling must be one of {_SPELLINGS}, got {self.spelling!r}")
        if self.weights not in _WEIGHTS:
            raise GraphError(f"decoder config: weights must be one of {_WEIGHTS}, got {self.weights!r}")
        if self.weights != "f32" and (self.spelling != "torch-to-nnef" or self.hidden % 32 or self.mlp % 32
                                      or (self.heads * self.head_dim) % 32):
            raise GraphError("decoder config: weights='q4_0' needs the torch-to-nnef spelling and hidden, mlp and "
                             "heads * head_dim multiples of 32 (Q4_0 blocks of 32 inputs)")
        if self.spelling == "tract" and (self.tied_embeddings or self.attention_bias or self.qk_norm):
            raise GraphError("decoder config: tied embeddings, attention biases and q/k norms are written in the "
                             "torch-to-nnef spelling only")
        if self.spelling == "tract" and self.cache != "dyn":
            raise GraphError("decoder config: spelling='tract' is written with cache='dyn' only (tract's own form "
                             "keeps the caches in its state)")

    @property
    def groups(self) -> int:
        return self.heads // self.kv_heads

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def cache_input_names(cfg: DecoderConfig) -> list[str]:
    """``in_cache_key_0, in_cache_value_0, in_cache_key_1, ...`` (empty for ``cache="dyn"``)."""
    if cfg.cache != "explicit":
        return []
    return [f"in_cache_{kv}_{l}" for l in range(cfg.layers) for kv in ("key", "value")]


def cache_output_names(cfg: DecoderConfig) -> list[str]:
    return [n.replace("in_", "out_", 1) for n in cache_input_names(cfg)]


def empty_cache(cfg: DecoderConfig) -> dict[str, np.ndarray]:
    """Empty (P = 0) cache inputs for the first call of an explicit-cache decoder."""
    return {n: np.zeros((1, cfg.kv_heads, 0, cfg.head_dim), np.float32) for n in cache_input_names(cfg)}


# ----------------------------------------------------------------------------------------------
# weights
# ----------------------------------------------------------------------------------------------
def build_decoder_weights(cfg: DecoderConfig) -> dict[str, np.ndarray]:
    """Deterministic weights (NumPy ``default_rng(seed)``), labelled like a HF LLaMA export.

    Projections are ``N(0, init_std)``; norm weights ``1 + 0.2 N(0, 1)`` (not all ones, so no exporter
    would fold them away); K projections get a few amplified channels, as real models have outlier
    key channels (what makes per-channel key quantization matter).
    """
    cfg.validate()
    rng = np.random.default_rng(cfg.seed)
    h, d = cfg.hidden, cfg.head_dim

    def w(*shape: int, std: float | None = None) -> np.ndarray:
        return (rng.standard_normal(shape) * (cfg.init_std if std is None else std)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.2 * rng.standard_normal(h)).astype(np.float32)

    t: dict[str, np.ndarray] = {"model.embed_tokens.weight": w(cfg.vocab, h, std=1.0)}
    for l in range(cfg.layers):
        p = f"model.layers.{l}."
        t[p + "input_layernorm.weight"] = norm()
        t[p + "self_attn.q_proj.weight"] = w(cfg.heads * d, h)
        k = w(cfg.kv_heads * d, h)
        outlier_rows = rng.choice(cfg.kv_heads * d, size=max(1, cfg.kv_heads * d // 16), replace=False)
        k[outlier_rows] *= 4.0
        t[p + "self_attn.k_proj.weight"] = k
        t[p + "self_attn.v_proj.weight"] = w(cfg.kv_heads * d, h)
        if cfg.attention_bias:
            for proj, n in (("q", cfg.heads), ("k", cfg.kv_heads), ("v", cfg.kv_heads)):
                t[p + f"self_attn.{proj}_proj.bias"] = w(n * d)
        if cfg.qk_norm:
            for proj in ("q", "k"):
                t[p + f"self_attn.{proj}_norm.weight"] = (1.0 + 0.2 * rng.standard_normal(d)).astype(np.float32)
        t[p + "self_attn.o_proj.weight"] = w(h, cfg.heads * d)
        t[p + "post_attention_layernorm.weight"] = norm()
        t[p + "mlp.gate_proj.weight"] = w(cfg.mlp, h)
        t[p + "mlp.up_proj.weight"] = w(cfg.mlp, h)
        t[p + "mlp.down_proj.weight"] = w(h, cfg.mlp)
    t["model.norm.weight"] = norm()
    if not cfg.tied_embeddings:
        t["lm_head.weight"] = w(cfg.vocab, h)
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    t["model.rotary_emb.inv_freq"] = inv.astype(np.float32)
    if cfg.spelling == "tract":  # same values, tract's shapes: [1, out, in], [1, 1, hidden], [1, head_dim / 2]
        for k, v in t.items():
            if k == "model.embed_tokens.weight":
                continue
            t[k] = v.reshape((1, 1, *v.shape) if k.endswith("norm.weight") else (1, *v.shape))
    if cfg.weights == "q4_0":
        from ..tensors.blockquant import BlockQuantTensor

        for k in list(t):
            if k.endswith(_LINEAR_WEIGHTS):
                t[k] = BlockQuantTensor.quantize_q4_0(t[k])
    return t


# ----------------------------------------------------------------------------------------------
# graph text
# ----------------------------------------------------------------------------------------------
#: how a weight is stored: ``"f32"`` (default), ``"f16"`` (an f16 ``.dat`` cast to f32 in the graph), ``"blocks"``
#: (tract block-quantized Q4_0 / Q8_1, declared without a ``<scalar>`` generic, as the exporter does)
STORAGE_KINDS = ("f32", "f16", "blocks")


class _Writer:
    def __init__(self, storage: dict[str, str] | None = None) -> None:
        self.lines: list[str] = []
        self.storage = dict(storage or {})  # label -> one of STORAGE_KINDS

    def __call__(self, lhs: str, rhs: str) -> str:
        self.lines.append(f"    {lhs} = {rhs};")
        return lhs


def _var(out: _Writer, name: str, label: str, shape: tuple[int, ...]) -> str:
    dims = ", ".join(str(s) for s in shape)
    kind = out.storage.get(label, "f32")
    if kind == "blocks":
        return out(name, f"variable(label = '{label}', shape = [{dims}])")
    if kind == "f16":
        v = out(f"{name}_f16", f"variable<scalar>(label = '{label}', shape = [{dims}])")
        return out(name, f"tract_core_cast({v}, to = 'f32')")
    return out(name, f"variable<scalar>(label = '{label}', shape = [{dims}])")


def _dim(out: _Writer, x: str, axis: int, name: str) -> str:
    """A rank-0 tensor holding ``x.shape[axis]`` (the exporter's shape_of / slice / squeeze)."""
    shp = out(f"{name}_shape", f"tract_core_shape_of({x})")
    sl = out(f"{name}_sliced", f"slice({shp}, axes = [0], begin = [{axis}], end = [{axis + 1}], stride = [1])")
    return out(name, f"squeeze({sl}, axes = [0])")


def _rmsnorm(out: _Writer, x: str, label: str, prefix: str, cfg: DecoderConfig, axis: int = 2,
             result: str | None = None) -> str:
    """RMSNorm over ``axis``: the hidden axis of ``[1, S, hidden]`` (default) or, ``axis=3``, each head of
    ``[1, n, S, D]`` (Qwen3's q_norm / k_norm). ``result``: the output's name (default ``{prefix}_out``)."""
    sq = out(f"{prefix}_pow", f"sqr({x})")
    mean = out(f"{prefix}_variance", f"mean_reduce({sq}, axes = [{axis}])")
    add = out(f"{prefix}_add", f"add({mean}, {float(cfg.eps)!r})")
    rs = out(f"{prefix}_rsqrt", f"rsqrt({add})")
    normed = out(f"{prefix}_normed", f"mul({x}, {rs})")
    wv = _var(out, f"{prefix}_weight", label, (cfg.hidden if axis == 2 else cfg.head_dim,))
    we = out(f"{prefix}_weight_expanded", f"unsqueeze({wv}, axes = [{', '.join(map(str, range(axis)))}])")
    return out(result or f"{prefix}_out", f"mul({we}, {normed})")


def _linear(out: _Writer, x: str, label: str, shape: tuple[int, int], name: str, bias: str | None = None,
            weight: str | None = None) -> str:
    """``x @ W^T (+ b)``; ``weight``: an already declared ``[out, in]`` variable (a tied embedding)."""
    wv = weight or _var(out, f"{name}_weight", label, shape)
    we = out(f"{name}_weight_expanded", f"unsqueeze({wv}, axes = [0])")
    if bias is None:
        return out(name, f"linear({x}, {we}, 0.0)")
    lin = out(f"{name}_nobias", f"linear({x}, {we}, 0.0)")
    bv = _var(out, f"{name}_bias", bias, (shape[0],))
    be = out(f"{name}_bias_expanded", f"unsqueeze({bv}, axes = [0, 1])")
    return out(name, f"add({lin}, {be})")


def _rope(out: _Writer, x: str, cos: str, sin: str, cfg: DecoderConfig, name: str) -> str:
    half = cfg.head_dim // 2
    d = cfg.head_dim
    xc = out(f"{name}_cos", f"mul({x}, {cos})")
    x1 = out(f"{name}_x1", f"slice({x}, axes = [3], begin = [0], end = [{half}], stride = [1])")
    x2 = out(f"{name}_x2", f"slice({x}, axes = [3], begin = [{half}], end = [{d}], stride = [1])")
    nx2 = out(f"{name}_neg", f"neg({x2})")
    rot = out(f"{name}_rotated", f"concat([{nx2}, {x1}], axis = 3)")
    xs = out(f"{name}_sin", f"mul({rot}, {sin})")
    return out(name, f"add({xc}, {xs})")


def _heads(out: _Writer, x: str, n: int, cfg: DecoderConfig, seq: str, name: str) -> str:
    """``[1, S, n*D]`` -> ``[1, n, S, D]``."""
    r = out(f"{name}_view", f"reshape({x}, shape = [1, {seq}, {n}, {cfg.head_dim}])")
    return out(name, f"transpose({r}, axes = [0, 2, 1, 3])")


def _repeat_kv(out: _Writer, x: str, cfg: DecoderConfig, total: str, name: str) -> str:
    """``[1, Hkv, T, D]`` -> ``[1, Hq, T, D]`` (each KV head repeated ``groups`` times, adjacent)."""
    if cfg.groups == 1:
        return x
    u = out(f"{name}_unsqueezed", f"unsqueeze({x}, axes = [2])")
    t = out(f"{name}_repeat", f"tile({u}, repeats = [1, 1, {cfg.groups}, 1, 1])")
    return out(name, f"reshape({t}, shape = [1, {cfg.heads}, {total}, {cfg.head_dim}])")


def default_storage(cfg: DecoderConfig) -> dict[str, str]:
    """label -> storage kind of the weights :func:`build_decoder_weights` makes (``weights="q4_0"``: the linear
    weights are blocks)."""
    if cfg.weights != "q4_0":
        return {}
    labels = [f"model.layers.{l}.{k}" for l in range(cfg.layers) for k in _LINEAR_WEIGHTS if k != "lm_head.weight"]
    return {k: "blocks" for k in labels + ([] if cfg.tied_embeddings else ["lm_head.weight"])}


def build_decoder_text(cfg: DecoderConfig, storage: dict[str, str] | None = None) -> str:
    """The ``graph.nnef`` text of the decoder described by ``cfg``; ``storage``: label -> how the weight is
    stored (:data:`STORAGE_KINDS`; default :func:`default_storage`)."""
    cfg.validate()
    if cfg.spelling == "tract":
        return _tract_text(cfg)
    explicit = cfg.cache == "explicit"
    d, hq, hkv = cfg.head_dim, cfg.heads, cfg.kv_heads
    out = _Writer(default_storage(cfg) if storage is None else storage)
    inputs = ["input_ids"] + cache_input_names(cfg)
    outputs = ["outputs"] + cache_output_names(cfg)
    out("input_ids", "tract_core_external(shape = [1, S], datum_type = 'i64')")
    for n in cache_input_names(cfg):
        out(n, f"tract_core_external(shape = [1, {hkv}, P, {d}], datum_type = 'f32')")
    seq = _dim(out, "input_ids", 1, "seq_len")
    emb = _var(out, "embed_tokens_weight", "model.embed_tokens.weight", (cfg.vocab, cfg.hidden))
    # tract gathers from block-quantized data only when told the output type
    dt = ", datum_type = 'f32'" if out.storage.get("model.embed_tokens.weight") == "blocks" else ""
    hidden = out("hidden_0", f"tract_core_gather({emb}, input_ids, axis = 0{dt})")
    inv = _var(out, "rope_inv_freq", "model.rotary_emb.inv_freq", (d // 2,))
    inv_e = out("rope_inv_freq_expanded", f"unsqueeze({inv}, axes = [0, 1])")
    scale = 1.0 / float(np.sqrt(d))

    positions_ready = False
    past = total = cos = sin = mask = ""

    def positions(past_len: str) -> None:
        nonlocal total, cos, sin, mask, positions_ready
        total = out("total_len", f"add({seq}, {past_len})")
        pos = out("cache_position", f"tract_core_range({past_len}, {total}, 1)")
        pos2 = out("position_ids", f"unsqueeze({pos}, axes = [0, 2])")
        posf = out("position_f32", f"tract_core_cast({pos2}, to = 'f32')")
        freqs = out("rope_freqs", f"mul({posf}, {inv_e})")
        embr = out("rope_emb", f"concat([{freqs}, {freqs}], axis = 2)")
        c = out("rope_cos", f"cos({embr})")
        s = out("rope_sin", f"sin({embr})")
        cos = out("rope_cos_heads", f"unsqueeze({c}, axes = [1])")
        sin = out("rope_sin_heads", f"unsqueeze({s}, axes = [1])")
        q_pos = out("q_pos", f"unsqueeze({pos}, axes = [1])")
        all_pos = out("k_range", f"tract_core_range(0, {total}, 1)")
        k_pos = out("k_pos", f"unsqueeze({all_pos}, axes = [0])")
        fut = out("future", f"gt({k_pos}, {q_pos})")
        if cfg.sliding_window:
            edge = out("window_edge", f"sub({q_pos}, {int(cfg.sliding_window)})")
            old = out("out_of_window", f"le({k_pos}, {edge})")
            fut = out("masked_keys", f"or({fut}, {old})")
        futf = out("future_f32", f"tract_core_cast({fut}, to = 'f32')")
        neg = out("mask_2d", f"mul({futf}, -1e9)")
        mask = neg if not explicit else out("attention_mask", f"unsqueeze({neg}, axes = [0, 1])")
        positions_ready = True

    if explicit:
        past = _dim(out, "in_cache_key_0", 2, "past_len")
        positions(past)

    for l in range(cfg.layers):
        p = f"layer{l}"
        lab = f"model.layers.{l}."
        x = _rmsnorm(out, hidden, lab + "input_layernorm.weight", f"{p}_input_norm", cfg)
        def bias(proj: str) -> str | None:
            return lab + f"self_attn.{proj}_proj.bias" if cfg.attention_bias else None

        q = _linear(out, x, lab + "self_attn.q_proj.weight", (hq * d, cfg.hidden), f"{p}_q_proj", bias("q"))
        k = _linear(out, x, lab + "self_attn.k_proj.weight", (hkv * d, cfg.hidden), f"{p}_k_proj", bias("k"))
        v = _linear(out, x, lab + "self_attn.v_proj.weight", (hkv * d, cfg.hidden), f"{p}_v_proj", bias("v"))
        qh = _heads(out, q, hq, cfg, seq, f"{p}_q")
        kh = _heads(out, k, hkv, cfg, seq, f"{p}_k")
        vh = _heads(out, v, hkv, cfg, seq, f"{p}_v")
        if cfg.qk_norm:
            qh = _rmsnorm(out, qh, lab + "self_attn.q_norm.weight", f"{p}_q_norm", cfg, 3, f"{p}_q_norm")
            kh = _rmsnorm(out, kh, lab + "self_attn.k_norm.weight", f"{p}_k_norm", cfg, 3, f"{p}_k_norm")
        if explicit:
            vc = out(f"out_cache_value_{l}", f"concat([in_cache_value_{l}, {vh}], axis = 2)")
        else:
            vc = out(f"{p}_value_cache",
                     f"tract_transformers_dyn_kv_cache({vh}, name = 'cache_value_{l}', axis = 2, datum_type = 'f32', "
                     f"past_sequence_shape = [1, {hkv}, P, {d}], input_sequence_shape = [1, {hkv}, S, {d}])")
            if not positions_ready:
                t_all = _dim(out, vc, 2, "cached_len")
                past = out("past_len", f"sub({t_all}, {seq})")
                positions(past)
        qr = _rope(out, qh, cos, sin, cfg, f"{p}_q_rope")
        kr = _rope(out, kh, cos, sin, cfg, f"{p}_k_rope")
        if explicit:
            kc = out(f"out_cache_key_{l}", f"concat([in_cache_key_{l}, {kr}], axis = 2)")
            kx = _repeat_kv(out, kc, cfg, total, f"{p}_key_states")
            vx = _repeat_kv(out, vc, cfg, total, f"{p}_value_states")
            kt = out(f"{p}_key_t", f"transpose({kx}, axes = [0, 1, 3, 2])")
            sc = out(f"{p}_scores", f"matmul({qr}, {kt}, transposeA = false, transposeB = false)")
            scs = out(f"{p}_scores_scaled", f"mul({sc}, {scale!r})")
            scm = out(f"{p}_scores_masked", f"add({scs}, {mask})")
            pr = out(f"{p}_probs", f"softmax({scm}, axes = [3])")
            att = out(f"{p}_attn_output", f"matmul({pr}, {vx}, transposeA = false, transposeB = false)")
        else:
            kc = out(f"{p}_key_cache",
                     f"tract_transformers_dyn_kv_cache({kr}, name = 'cache_key_{l}', axis = 2, datum_type = 'f32', "
                     f"past_sequence_shape = [1, {hkv}, P, {d}], input_sequence_shape = [1, {hkv}, S, {d}])")
            att = out(f"{p}_attn_output",
                      f"tract_transformers_sdpa({qr}, {kc}, {vc}, {mask}, scale = {scale!r}, datum_type = 'f32', "
                      f"acc_datum_type = 'f32', is_causal = false)")
        at = out(f"{p}_attn_t", f"transpose({att}, axes = [0, 2, 1, 3])")
        ar = out(f"{p}_attn_merged", f"reshape({at}, shape = [1, {seq}, {hq * d}])")
        o = _linear(out, ar, lab + "self_attn.o_proj.weight", (cfg.hidden, hq * d), f"{p}_o_proj")
        h1 = out(f"{p}_residual_attn", f"add({hidden}, {o})")
        x2 = _rmsnorm(out, h1, lab + "post_attention_layernorm.weight", f"{p}_post_norm", cfg)
        g = _linear(out, x2, lab + "mlp.gate_proj.weight", (cfg.mlp, cfg.hidden), f"{p}_gate_proj")
        gs = out(f"{p}_gate_sigmoid", f"sigmoid({g})")
        ga = out(f"{p}_gate_silu", f"mul({g}, {gs})")
        u = _linear(out, x2, lab + "mlp.up_proj.weight", (cfg.mlp, cfg.hidden), f"{p}_up_proj")
        gu = out(f"{p}_swiglu", f"mul({ga}, {u})")
        dn = _linear(out, gu, lab + "mlp.down_proj.weight", (cfg.hidden, cfg.mlp), f"{p}_down_proj")
        hidden = out(f"hidden_{l + 1}", f"add({h1}, {dn})")

    fin = _rmsnorm(out, hidden, "model.norm.weight", "final_norm", cfg)
    last_begin = out("last_begin", f"sub({seq}, 1)")
    last = out("last_hidden", f"slice({fin}, axes = [1], begin = [{last_begin}], end = [{seq}], stride = [1])")
    _linear(out, last, "lm_head.weight", (cfg.vocab, cfg.hidden), "outputs",
            weight=emb if cfg.tied_embeddings else None)

    head = ["version 1.0;", "", "extension tract_registry tract_core;"]
    if not explicit:
        head.append("extension tract_registry tract_transformers;")
    head += ["extension tract_symbol S;", "extension tract_symbol P;", "extension tract_assert S >= 1;",
             "extension tract_assert P >= 0;", f"extension tract_assert S+P < {cfg.max_positions};", ""]
    head.append(f"graph {cfg.name}({', '.join(inputs)}) -> ({', '.join(outputs)})")
    return "\n".join(head + ["{"] + out.lines + ["}"]) + "\n"


def _tract_text(cfg: DecoderConfig) -> str:
    """``spelling="tract"``: tract's fused ops, caches in tract's state (see the module docstring)."""
    d, hq, hkv, hid = cfg.head_dim, cfg.heads, cfg.kv_heads, cfg.hidden
    out = _Writer()
    out("input_ids", "tract_core_external(shape = [1, S], datum_type = 'i64')")
    emb = _var(out, "embed", "model.embed_tokens.weight", (cfg.vocab, hid))
    out("hidden_0", f"tract_core_gather({emb}, input_ids, axis = 0)")
    # rotary tables of the positions P .. P+S-1 (P is bound by the KV caches' state)
    out("pos", "tract_core_range(P, P + S, 1)")
    out("pos_f", "tract_core_cast(pos, to = 'f32')")
    out("pos_2", "unsqueeze(pos_f, axes = [1])")
    inv = _var(out, "inv_freq", "model.rotary_emb.inv_freq", (1, d // 2))
    out("freqs", f"mul(pos_2, {inv})")
    out("rope_emb", "concat([freqs, freqs], axis = 1)")
    out("rope_cos", "cos(rope_emb)")
    cos = out("cos", "unsqueeze(rope_cos, axes = [0, 1])")
    out("rope_sin", "sin(rope_emb)")
    sin = out("sin", "unsqueeze(rope_sin, axes = [0, 1])")
    scale = 1.0 / float(np.sqrt(d))

    def norm(x: str, label: str, name: str) -> str:
        wv = _var(out, f"{name}_weight", label, (1, 1, hid))
        r = out(f"{name}_rms", f"tract_core_rms_norm({x}, axis = 2, eps = {float(cfg.eps)!r})")
        return out(name, f"mul({r}, {wv})")

    def linear(x: str, label: str, shape: tuple[int, int], name: str) -> str:
        wv = _var(out, f"{name}_weight", label, (1, *shape))
        return out(name, f"matmul({x}, {wv}, transposeA = false, transposeB = true)")

    hidden = "hidden_0"
    for l in range(cfg.layers):
        p, lab = f"layer{l}", f"model.layers.{l}."
        x = norm(hidden, lab + "input_layernorm.weight", f"{p}_input_norm")
        heads = {}
        for proj, n in (("q", hq), ("k", hkv), ("v", hkv)):
            lin = linear(x, lab + f"self_attn.{proj}_proj.weight", (n * d, hid), f"{p}_{proj}_proj")
            r = out(f"{p}_{proj}_view", f"reshape({lin}, shape = [{n}, {d}], axis_start = 2, axis_count = 1)")
            heads[proj] = out(f"{p}_{proj}", f"transpose({r}, axes = [0, 2, 1, 3])")
        qr = out(f"{p}_q_rope", f"tract_transformers_apply_rope({heads['q']}, {cos}, {sin})")
        kr = out(f"{p}_k_rope", f"tract_transformers_apply_rope({heads['k']}, {cos}, {sin})")
        caches = {}
        for kv, src in (("key", kr), ("value", heads["v"])):
            caches[kv] = out(f"{p}_{kv}_cache",
                             f"tract_transformers_dyn_kv_cache({src}, name = 'cache_{kv}_{l}', axis = 2, "
                             f"datum_type = 'f32', past_sequence_shape = [1, {hkv}, P, {d}], "
                             f"input_sequence_shape = [1, {hkv}, S, {d}])")
        att = out(f"{p}_attn_output",
                  f"tract_transformers_sdpa({qr}, {caches['key']}, {caches['value']}, scale = {scale!r}, "
                  f"datum_type = 'f32', acc_datum_type = 'f32', is_causal = true)")
        at = out(f"{p}_attn_t", f"transpose({att}, axes = [0, 2, 1, 3])")
        ar = out(f"{p}_attn_merged", f"reshape({at}, shape = [{hq * d}], axis_start = 2, axis_count = 2)")
        o = linear(ar, lab + "self_attn.o_proj.weight", (hid, hq * d), f"{p}_o_proj")
        h1 = out(f"{p}_residual_attn", f"add({hidden}, {o})")
        x2 = norm(h1, lab + "post_attention_layernorm.weight", f"{p}_post_norm")
        g = linear(x2, lab + "mlp.gate_proj.weight", (cfg.mlp, hid), f"{p}_gate_proj")
        u = linear(x2, lab + "mlp.up_proj.weight", (cfg.mlp, hid), f"{p}_up_proj")
        gs = out(f"{p}_gate_silu", f"tract_core_silu({g})")
        gu = out(f"{p}_swiglu", f"mul({gs}, {u})")
        dn = linear(gu, lab + "mlp.down_proj.weight", (hid, cfg.mlp), f"{p}_down_proj")
        hidden = out(f"hidden_{l + 1}", f"add({h1}, {dn})")

    last = out("last_hidden", f"slice({hidden}, axes = [1], begin = [S - 1], end = [S])")
    fin = norm(last, "model.norm.weight", "final_norm")
    linear(fin, "lm_head.weight", (cfg.vocab, hid), "outputs")
    head = ["version 1.0;", "", "extension tract_registry tract_core;", "extension tract_registry tract_transformers;",
            "extension tract_symbol S;", "extension tract_symbol P;", ""]
    head.append(f"graph {cfg.name}(input_ids) -> (outputs)")
    return "\n".join(head + ["{"] + out.lines + ["}"]) + "\n"


def build_decoder(cfg: DecoderConfig | None = None):
    """The decoder as an in-memory :class:`nnef_kv.Model` (save it with ``nnef_kv.save``)."""
    from ..io.archive import Model

    cfg = cfg or DecoderConfig()
    return Model.from_text(build_decoder_text(cfg), build_decoder_weights(cfg), source=None)
