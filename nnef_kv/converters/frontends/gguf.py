"""GGUF (llama.cpp's model file) -> the NNEF archive torch-to-nnef writes for the same weights.

``nnef-kv convert model.gguf -o model.nnef.tgz`` reads the file with the ``gguf`` package's reader (a
memory map; no torch, no transformers) and writes the decoder of :mod:`nnef_kv.models.llama` in
torch-to-nnef's spelling (explicit ``in_cache_*``/``out_cache_*``, ``tract_assert S+P <
context_length``) over the file's own weights, plus, beside the archive, the GGUF's tokenizer as a
``tokenizer.json`` and ``tokenizer_config.json`` (BOS/EOS, chat template; :mod:`.gguf_tokenizer`).

Every hyper-parameter comes from the metadata (``{arch}.block_count``, ``.embedding_length``,
``.feed_forward_length``, ``.attention.head_count[_kv]``, ``.attention.key_length``,
``.attention.layer_norm_rms_epsilon``, ``.rope.freq_base``, ``.rope.dimension_count``,
``.context_length``); a tensor whose shape disagrees with them is refused, naming the tensor and
the key. Architectures: ``llama`` (Llama, SmolLM, Mistral-style: llama.cpp's converter stores Q/K rows
interleaved for its RoPE, undone here so the graph's rotate-half RoPE applies), ``qwen2`` (q/k/v biases)
and ``qwen3`` (per-head q/k RMSNorm); both store HF's row order. Anything else is refused by name.

Weights (``weights=``): ``"f32"`` (default) dequantized with ``gguf.quants.dequantize`` (llama.cpp's
reference dequantizers); ``"f16"`` the same values stored as f16 ``.dat`` files and cast to f32 in
the graph (half the file; f16 rounding of every weight); ``"keep"``: Q4_0 tensors kept as tract Q4_0
blocks (byte for byte) and a Q8_0 token embedding as tract Q8_1 (the same codes and scales, plus the block
sum tract stores; its gather is the one place tract 0.23.9 runs Q8_1), every other quantized type
dequantized to f32, each named in the import notes.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ...errors import ConversionError
from .base import FrontEnd

__all__ = ["GgufImport", "gguf_import", "read_gguf", "ARCHITECTURES", "WEIGHT_MODES", "FRONTEND"]

MAGIC = b"GGUF"
WEIGHT_MODES = ("f32", "f16", "keep")
#: the fewest bytes one metadata entry (key length, a 1-char key, type, a 1-byte value) and one tensor
#: entry (name length, name, n_dims, one dim, type, offset) take: counts a file cannot hold are refused
#: before anything is parsed
MIN_KV_BYTES = 8 + 1 + 4 + 1
MIN_TENSOR_BYTES = 8 + 1 + 4 + 8 + 4 + 8


@dataclass(frozen=True)
class ArchSpec:
    """How one GGUF architecture's tensors map onto :class:`~nnef_kv.models.DecoderConfig`."""

    permuted_qk: bool = False  # llama.cpp's converter interleaved Q/K rows for its RoPE (undone on import)
    bias: bool = False  # q/k/v biases
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE


ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec(permuted_qk=True),
    "qwen2": ArchSpec(bias=True),
    "qwen3": ArchSpec(qk_norm=True),
}

#: GGUF tensor name (after ``blk.N.``) -> HF label (after ``model.layers.N.``)
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                   "output.weight": "lm_head.weight"}


@dataclass
class GgufTensor:
    """One tensor of a GGUF file: its name, GGML type code, dims (GGUF order: ``ne[0]`` first) and bytes."""

    name: str
    type_code: int
    dims: tuple[int, ...]
    data: np.ndarray  # uint8 view of the file (memory map)

    @property
    def shape(self) -> tuple[int, ...]:
        """The numpy (row-major) shape: the dims reversed."""
        return tuple(reversed(self.dims))

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.type_code).name


@dataclass
class GgufFile:
    """The metadata (key -> Python value; arrays as lists) and tensors (name -> :class:`GgufTensor`) of one file."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GgufTensor]


@dataclass
class GgufImport:
    """What :func:`gguf_import` made: the model, its config, the files to write beside the archive."""

    model: Any
    config: Any
    architecture: str
    weights: str
    notes: list[str] = field(default_factory=list)
    tensor_types: dict[str, int] = field(default_factory=dict)  # GGUF type name -> tensors of it
    beside: dict[str, bytes] = field(default_factory=dict)  # file name -> bytes (tokenizer.json, ...)



def _fail(path: Path, what: str) -> ConversionError:
    return ConversionError(f"{path}: {what}")


class _Cursor:
    """Little-endian reads from the memory-mapped file, each bounds-checked (a truncated file is named)."""

    SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}

    def __init__(self, path: Path, buf: Any) -> None:
        self.path, self.buf, self.pos = path, buf, 0

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > len(self.buf):
            raise _fail(self.path, f"truncated: {what} needs {n} bytes at offset {self.pos}, the file has "
                                   f"{len(self.buf)}")
        b = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return b

    def scalar(self, code: int, what: str) -> Any:
        fmt = self.SCALARS[code]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.scalar(10, what)
        raw = self.take(n, what)
        return raw.decode("utf-8", "replace")

    def value(self, code: int, what: str) -> Any:
        if code in self.SCALARS:
            return self.scalar(code, what)
        if code == 8:
            return self.string(what)
        if code == 9:
            item = self.scalar(4, what)
            n = self.scalar(10, what)
            if n > len(self.buf) - self.pos:
                raise _fail(self.path, f"truncated or corrupt: {what} claims {n} items at offset {self.pos}")
            if item in self.SCALARS:
                fmt = self.SCALARS[item]
                return np.frombuffer(self.take(n * struct.calcsize(fmt), what), dtype=np.dtype(fmt)).tolist()
            if item == 8:
                return [self.string(what) for _ in range(n)]
            raise _fail(self.path, f"{what}: an array of GGUF value type {item} is not read")
        raise _fail(self.path, f"{what}: unknown GGUF value type {code}")


def read_gguf(path: str | os.PathLike) -> GgufFile:
    """Parse the header, metadata and tensor table of ``path`` (the tensor data stays in a memory map).
    Counts the file cannot hold, a truncated file, an unknown value or tensor type, a tensor past the end
    of the file or over ``max_tensor_bytes``: one line naming the file and the key or tensor."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from ...limits import current_limits

    p = Path(path)
    try:
        size = p.stat().st_size
        buf = np.memmap(p, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    except (OSError, ValueError) as exc:
        raise _fail(p, f"cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    c = _Cursor(p, buf)
    if bytes(buf[:4]) != MAGIC:
        raise _fail(p, "not a GGUF file (no 'GGUF' magic)")
    c.pos = 4
    version = c.scalar(4, "the version")
    if version not in (2, 3):
        raise _fail(p, f"GGUF version {version} (versions 2 and 3 are read)")
    n_tensors, n_kv = c.scalar(10, "the tensor count"), c.scalar(10, "the metadata count")
    room = size - c.pos
    if n_kv * MIN_KV_BYTES > room or n_tensors * MIN_TENSOR_BYTES > room:
        raise _fail(p, f"header claims {n_kv} metadata entries and {n_tensors} tensors, more than its "
                       f"{size} bytes can hold (truncated or corrupt)")
    limits = current_limits()
    if n_tensors > limits.max_members:
        raise _fail(p, f"header claims {n_tensors} tensors, more than max_members ({limits.max_members})")
    meta: dict[str, Any] = {}
    for i in range(n_kv):
        key = c.string(f"metadata entry {i}'s key")
        meta[key] = c.value(c.scalar(4, f"metadata key {key!r}'s type"), f"metadata key {key!r}")
    infos = []
    for i in range(n_tensors):
        name = c.string(f"tensor {i}'s name")
        n_dims = c.scalar(4, f"tensor {name!r}'s rank")
        if n_dims > 8:
            raise _fail(p, f"tensor {name!r}: rank {n_dims} (GGUF tensors have at most 4 dims)")
        dims = tuple(c.scalar(10, f"tensor {name!r}'s dims") for _ in range(n_dims))
        code = c.scalar(4, f"tensor {name!r}'s type")
        offset = c.scalar(10, f"tensor {name!r}'s offset")
        try:
            kind = GGMLQuantizationType(code)
            block, type_size = GGML_QUANT_SIZES[kind]
        except (ValueError, KeyError):
            raise _fail(p, f"tensor {name!r}: unknown GGML tensor type {code}") from None
        count = int(np.prod(dims, dtype=object)) if dims else 1
        if count % block:
            raise _fail(p, f"tensor {name!r}: {count} values are not whole {kind.name} blocks of {block}")
        infos.append((name, code, dims, offset, count // block * type_size))
    align = meta.get("general.alignment", 32)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise _fail(p, f"metadata key 'general.alignment' = {align!r}: not a power of two")
    start = -(-c.pos // align) * align
    tensors: dict[str, GgufTensor] = {}
    for name, code, dims, offset, nbytes in infos:
        if name in tensors:
            raise _fail(p, f"tensor {name!r} appears twice")
        if nbytes > limits.max_tensor_bytes:
            raise _fail(p, f"tensor {name!r}: {nbytes} bytes, more than max_tensor_bytes ({limits.max_tensor_bytes})")
        begin = start + offset
        if begin + nbytes > size:
            raise _fail(p, f"tensor {name!r}: its data ends at byte {begin + nbytes}, past the end of the file "
                           f"({size} bytes; truncated)")
        tensors[name] = GgufTensor(name, code, dims, buf[begin:begin + nbytes])
    return GgufFile(p, meta, tensors)


# ----------------------------------------------------------------------------------------------
# metadata
# ----------------------------------------------------------------------------------------------
class _Meta:
    def __init__(self, g: GgufFile, arch: str) -> None:
        self.g, self.arch = g, arch

    def get(self, key: str, default: Any = None, *, required: bool = False, kind: type = int) -> Any:
        full = key if key.startswith(("general.", "tokenizer.")) else f"{self.arch}.{key}"
        if full not in self.g.metadata:
            if required:
                raise _fail(self.g.path, f"metadata key {full!r} is missing (needed for architecture {self.arch!r})")
            return default
        v = self.g.metadata[full]
        try:
            return kind(v)
        except (TypeError, ValueError):
            raise _fail(self.g.path, f"metadata key {full!r} = {str(v)[:60]!r} is not a {kind.__name__}") from None


def _config(g: GgufFile, arch: str, spec: ArchSpec, notes: list[str]) -> Any:
    from ...models import DecoderConfig

    m = _Meta(g, arch)
    layers = m.get("block_count", required=True)
    hidden = m.get("embedding_length", required=True)
    heads = m.get("attention.head_count", required=True)
    kv_heads = m.get("attention.head_count_kv", heads)
    head_dim = m.get("attention.key_length", hidden // heads if heads else 0)
    if m.get("attention.value_length", head_dim) != head_dim:
        raise _fail(g.path, f"metadata {arch}.attention.value_length differs from key_length ({head_dim}): not a "
                            "decoder nnef-kv writes")
    rope_dims = m.get("rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise _fail(g.path, f"metadata {arch}.rope.dimension_count = {rope_dims}: partial rotary embeddings "
                            f"(head_dim {head_dim}) are not supported")
    scaling = m.get("rope.scaling.type", "none", kind=str)
    if scaling not in ("none", ""):
        raise _fail(g.path, f"metadata {arch}.rope.scaling.type = {scaling!r}: RoPE scaling is not supported")
    if f"{arch}.rope.freq_base" in g.metadata:
        theta = m.get("rope.freq_base", kind=float)
    else:
        theta = 10000.0
        notes.append(f"{arch}.rope.freq_base absent: llama.cpp's default base 10000 used")
    eps = m.get("attention.layer_norm_rms_epsilon", required=True, kind=float)
    context = m.get("context_length", required=True)
    window = m.get("attention.sliding_window", 0)
    if window and window < context:
        notes.append(f"{arch}.attention.sliding_window = {window}: the graph has no window, so its bound is the "
                     f"window (S+P < {window}, not the context length {context}): no position is computed "
                     "without the window the model was trained with")
        context = window
    emb = g.tensors.get("token_embd.weight")
    if emb is None:
        raise _fail(g.path, "tensor 'token_embd.weight' (the token embedding) is missing")
    vocab = int(emb.shape[0]) if len(emb.shape) == 2 else -1
    if m.get("vocab_size", vocab) != vocab:
        raise _fail(g.path, f"tensor 'token_embd.weight' has {vocab} rows but metadata {arch}.vocab_size = "
                            f"{m.get('vocab_size')}")
    mlp = m.get("feed_forward_length", required=True)
    for k, v in (("block_count", layers), ("embedding_length", hidden), ("attention.head_count", heads),
                 ("attention.head_count_kv", kv_heads), ("attention.key_length", head_dim),
                 ("feed_forward_length", mlp), ("context_length", context)):
        if v < 1:
            raise _fail(g.path, f"metadata {arch}.{k} = {v}: must be >= 1")
    if heads % kv_heads or head_dim % 2:
        raise _fail(g.path, f"metadata {arch}.attention.head_count = {heads} is not a multiple of head_count_kv = "
                            f"{kv_heads}, or head_dim {head_dim} is odd")
    name = str(g.metadata.get("general.name", "gguf_model"))
    return DecoderConfig(vocab=vocab, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                         head_dim=head_dim, mlp=mlp, rope_theta=theta, eps=eps, max_positions=context,
                         cache="explicit", name=_identifier(name), tied_embeddings="output.weight" not in g.tensors,
                         attention_bias=spec.bias, qk_norm=spec.qk_norm)


def _identifier(name: str) -> str:
    s = "".join(c if c.isalnum() or c == "_" else "_" for c in name.strip()) or "gguf_model"
    return s if not s[0].isdigit() else f"m_{s}"


# ----------------------------------------------------------------------------------------------
# tensors
# ----------------------------------------------------------------------------------------------
def _expected(cfg: Any, spec: ArchSpec) -> dict[str, tuple[tuple[int, ...], str]]:
    """GGUF tensor name -> (numpy shape, the metadata keys the shape comes from)."""
    h, d, l_, v = cfg.hidden, cfg.head_dim, cfg.layers, cfg.vocab
    out: dict[str, tuple[tuple[int, ...], str]] = {
        "token_embd.weight": ((v, h), "vocab_size, embedding_length"),
        "output_norm.weight": ((h,), "embedding_length"),
    }
    if not cfg.tied_embeddings:
        out["output.weight"] = ((v, h), "vocab_size, embedding_length")
    qd, kd = cfg.heads * d, cfg.kv_heads * d
    for i in range(l_):
        b = f"blk.{i}."
        out.update({
            b + "attn_norm.weight": ((h,), "embedding_length"),
            b + "attn_q.weight": ((qd, h), "attention.head_count x key_length, embedding_length"),
            b + "attn_k.weight": ((kd, h), "attention.head_count_kv x key_length, embedding_length"),
            b + "attn_v.weight": ((kd, h), "attention.head_count_kv x key_length, embedding_length"),
            b + "attn_output.weight": ((h, qd), "embedding_length, attention.head_count x key_length"),
            b + "ffn_norm.weight": ((h,), "embedding_length"),
            b + "ffn_gate.weight": ((cfg.mlp, h), "feed_forward_length, embedding_length"),
            b + "ffn_up.weight": ((cfg.mlp, h), "feed_forward_length, embedding_length"),
            b + "ffn_down.weight": ((h, cfg.mlp), "embedding_length, feed_forward_length"),
        })
        if spec.bias:
            out.update({b + "attn_q.bias": ((qd,), "attention.head_count x key_length"),
                        b + "attn_k.bias": ((kd,), "attention.head_count_kv x key_length"),
                        b + "attn_v.bias": ((kd,), "attention.head_count_kv x key_length")})
        if spec.qk_norm:
            out.update({b + "attn_q_norm.weight": ((d,), "attention.key_length"),
                        b + "attn_k_norm.weight": ((d,), "attention.key_length")})
    return out


def _label(name: str) -> str:
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    _, layer, rest = name.split(".", 2)
    return f"model.layers.{layer}.{_LAYER_TENSORS[rest]}"


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row interleaving: within each head, rows ``(2i, 2i+1)`` go back to ``(i, i + D/2)``
    (the rotate-half order of HF's RoPE). Works on values ``[rows, in]`` and on blocks ``[rows, nb, bytes]``."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensor_value(g: GgufFile, t: GgufTensor, shape: tuple[int, ...], mode: str, heads: int | None = None) -> Any:
    """The archive's value of GGUF tensor ``t`` (numpy shape ``shape``) under weight mode ``mode``."""
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    from ...tensors.blockquant import BLOCK_LEN, Q4_0_GGML, Q8_1_READ, BlockQuantTensor

    kind = Q(t.type_code)
    # tract 0.23.9 runs Q4_0 blocks in products and gathers, Q8_1 in gathers only ("running pass codegen" on a
    # product of Q8_1 weights)
    keeps = (Q.Q4_0, Q.Q8_0) if t.name == "token_embd.weight" else (Q.Q4_0,)
    if mode == "keep" and kind in keeps and len(shape) == 2 and shape[1] % BLOCK_LEN == 0:
        raw = t.data.reshape(shape[0], shape[1] // BLOCK_LEN, -1)
        if heads:
            raw = _unpermute(raw, heads)
        if kind == Q.Q4_0:
            return BlockQuantTensor(shape=shape, blocks=np.ascontiguousarray(raw).reshape(-1), item_type=Q4_0_GGML)
        d = np.ascontiguousarray(raw[:, :, :2]).view(np.float16)  # [rows, nb, 1]
        q = np.ascontiguousarray(raw[:, :, 2:]).view(np.int8)
        s = (d.astype(np.float32) * q.astype(np.int32).sum(-1, keepdims=True).astype(np.float32)).astype(np.float16)
        blocks = np.concatenate([d.view(np.uint8), s.view(np.uint8), q.view(np.uint8)], axis=-1)
        return BlockQuantTensor(shape=shape, blocks=blocks.reshape(-1), item_type=Q8_1_READ)
    if kind == Q.F32:
        values = t.data.view(np.float32)
    elif kind == Q.F16:
        values = t.data.view(np.float16).astype(np.float32)
    else:
        try:
            values = quants.dequantize(t.data.reshape(shape[:-1] + (-1,)), kind)
        except NotImplementedError:
            raise _fail(g.path, f"tensor {t.name!r}: GGUF type {kind.name} cannot be dequantized by the gguf "
                                "package") from None
    values = np.asarray(values, np.float32).reshape(shape)
    if heads:
        values = _unpermute(values, heads)
    if mode == "f16" and values.ndim == 2:
        return values.astype(np.float16)
    return np.ascontiguousarray(values)


def gguf_import(path: str | os.PathLike, weights: str = "f32") -> GgufImport:
    """The NNEF model of the GGUF decoder at ``path`` (see the module docstring)."""
    from ...io.archive import Model
    from ...models.llama import build_decoder_text
    from .gguf_tokenizer import tokenizer_files

    if weights not in WEIGHT_MODES:
        raise ConversionError(f"--weights {weights!r}: expected one of {', '.join(WEIGHT_MODES)}")
    g = read_gguf(path)
    arch = g.metadata.get("general.architecture")
    if arch is None:
        raise _fail(g.path, "metadata key 'general.architecture' is missing")
    if arch not in ARCHITECTURES:
        raise _fail(g.path, f"architecture {arch!r} is not one nnef-kv imports (it imports "
                            f"{', '.join(ARCHITECTURES)})")
    spec = ARCHITECTURES[arch]
    notes: list[str] = []
    cfg = _config(g, arch, spec, notes)
    expected = _expected(cfg, spec)
    extra = [n for n in g.tensors if n not in expected and n != "rope_freqs.weight"]
    if extra:
        raise _fail(g.path, f"tensor {extra[0]!r} is not part of a {arch} decoder nnef-kv writes"
                            + (f" ({len(extra)} such tensors)" if len(extra) > 1 else ""))
    missing = [n for n in expected if n not in g.tensors]
    if missing:
        raise _fail(g.path, f"tensor {missing[0]!r} is missing" + (f" ({len(missing)} missing)" if len(missing) > 1
                                                                     else ""))
    tensors: dict[str, Any] = {}
    storage: dict[str, str] = {}
    counts: dict[str, int] = {}
    dequantized: dict[str, int] = {}
    for t in g.tensors.values():
        counts[t.type_name] = counts.get(t.type_name, 0) + 1
    for name, (shape, keys) in expected.items():
        t = g.tensors[name]
        got = t.shape
        if got != shape:
            raise _fail(g.path, f"tensor {name!r} has shape {list(got)} but the metadata ({arch}.{keys}) gives "
                                f"{list(shape)}")
        heads = None
        if spec.permuted_qk and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg.heads if name.endswith("attn_q.weight") else cfg.kv_heads
        value = _tensor_value(g, t, shape, weights, heads)
        label = _label(name)
        tensors[label] = value
        kind = type(value).__name__
        if kind == "BlockQuantTensor":
            storage[label] = "blocks"
        elif value.dtype == np.float16:
            storage[label] = "f16"
        tname = t.type_name
        if tname not in ("F32", "F16") and kind != "BlockQuantTensor":
            dequantized[tname] = dequantized.get(tname, 0) + 1
    emb = tensors["model.embed_tokens.weight"]
    if cfg.tied_embeddings and getattr(emb, "format", None) == "Q8_1":  # the LM head cannot read Q8_1 in tract
        tensors["lm_head.weight"] = _tensor_value(g, g.tensors["token_embd.weight"], emb.shape, "f32")
        cfg = replace(cfg, tied_embeddings=False)
        notes.append("tied embedding: the gather reads its Q8_1 blocks, the LM head an f32 copy (tract 0.23.9 runs "
                     "no product of Q8_1 weights)")
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    if "rope_freqs.weight" in g.tensors:  # Llama 3's per-frequency factors: theta_i / factor_i
        f = np.asarray(g.tensors["rope_freqs.weight"].data, np.float64).reshape(-1)
        if f.size != d // 2:
            raise _fail(g.path, f"tensor 'rope_freqs.weight' has {f.size} values, expected head_dim / 2 = {d // 2}")
        inv = inv / f
        notes.append("rope_freqs.weight: per-frequency RoPE factors applied to the inverse frequencies")
    tensors["model.rotary_emb.inv_freq"] = inv.astype(np.float32)
    if dequantized:
        notes.append("dequantized to f32: " + ", ".join(f"{n} {k} tensors" for k, n in sorted(dequantized.items()))
                     + ({"keep": " (tract runs Q4_0 blocks, and Q8_0 ones in the embedding's gather only)"}
                        .get(weights, "")))
    kept = {k: v for k, v in storage.items() if v == "blocks"}
    if kept:
        notes.append(f"kept as tract blocks: {len(kept)} tensors (Q4_0 as Q4_0, a Q8_0 embedding as Q8_1; the same "
                     "values)")
    text = build_decoder_text(cfg, storage)
    model = Model.from_text(text, tensors, source=str(g.path))
    beside, tok_notes = tokenizer_files(g)
    notes += tok_notes
    return GgufImport(model, cfg, arch, weights, notes, counts, beside)


def load(path: Path, weights: str = "f32") -> Any:
    """The NNEF model of the GGUF decoder at ``path`` (:func:`gguf_import`); the files to write beside the
    archive are on ``model.beside``, the import's notes on ``model.notes``."""
    imp = gguf_import(path, weights)
    imp.model.beside = dict(imp.beside)
    imp.model.import_notes = list(imp.notes)
    return imp.model


def _sniff(head: bytes) -> bool:
    return head[:4] == MAGIC


FRONTEND = FrontEnd(name="gguf", kinds="a .gguf file (llama.cpp)", load=load, suffixes=(".gguf",), sniff=_sniff,
                    options=("weights",))
