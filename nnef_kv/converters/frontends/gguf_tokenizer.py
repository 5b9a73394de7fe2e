"""A GGUF's tokenizer (``tokenizer.ggml.*``) as a Hugging Face ``tokenizer.json``, built with ``tokenizers``.

Two GGUF tokenizer models are read:

* ``gpt2`` (byte-level BPE): the vocabulary and merges as stored; the pre-tokenizer is the sequence of
  split patterns llama.cpp applies for the file's ``tokenizer.ggml.pre`` (:data:`PRE_PATTERNS`; each
  pattern splits the pieces the previous one left, matches and gaps both kept, then bytes are mapped
  to GPT-2's alphabet); ``llama3``-family files also merge a whole piece that is in the vocabulary
  first (llama.cpp's ``ignore_merges``). An unknown ``tokenizer.ggml.pre`` is refused by name.
* ``llama`` (SentencePiece BPE): the pieces and their scores; llama.cpp merges, again and again, the
  adjacent pair whose concatenation is the highest-scoring piece, so the merges are every such pair
  ranked by that score; ``▁`` for spaces, a leading ``▁`` when ``tokenizer.ggml.add_space_prefix``
  (default true, as llama.cpp), bytes outside the vocabulary as ``<0xNN>`` pieces.

Control tokens (type 3) become special added tokens, user-defined ones (type 4) added tokens, both
matched in the text as llama.cpp does with ``parse_special``. BOS is prepended only when
``tokenizer.ggml.add_bos_token`` is true. ``tokenizer_config.json`` beside it carries the BOS/EOS
tokens and the chat template (``tokenizer.chat_template``) for ``generate --chat``.
"""
from __future__ import annotations

import json
from typing import Any

from ...errors import ConversionError

__all__ = ["tokenizer_files", "build_tokenizer", "PRE_PATTERNS"]

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

#: ``tokenizer.ggml.pre`` -> the split patterns llama.cpp applies, in order, and whether a piece found whole
#: in the vocabulary skips the merges
PRE_PATTERNS: dict[str, tuple[tuple[str, ...], bool]] = {
    **{k: ((_GPT2,), False) for k in ("gpt-2", "gpt2", "mpt", "olmo", "jais")},
    **{k: ((r"\p{N}", _GPT2), False) for k in ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                                               "minerva-7b")},
    **{k: ((_LLAMA3,), True) for k in ("llama3", "llama-v3", "llama-bpe", "dbrx", "smaug-bpe", "falcon3")},
    **{k: ((_QWEN2,), False) for k in ("qwen2", "stablelm2", "deepseek-r1-qwen", "megrez")},
}

CONTROL, USER_DEFINED, BYTE = 3, 4, 6


def _fail(where: Any, what: str) -> ConversionError:
    return ConversionError(f"{where}: {what}")


def build_tokenizer(meta: dict[str, Any], where: Any) -> Any:
    """The ``tokenizers.Tokenizer`` of the GGUF metadata ``meta`` (``where``: the file, for messages)."""
    from tokenizers import AddedToken, Tokenizer, processors

    model = meta.get("tokenizer.ggml.model")
    if model is None:
        raise _fail(where, "metadata key 'tokenizer.ggml.model' is missing (no tokenizer in the file)")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise _fail(where, "metadata key 'tokenizer.ggml.tokens' is missing or empty")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise _fail(where, f"metadata key 'tokenizer.ggml.token_type' has {len(types)} entries for {len(tokens)} "
                           "tokens")
    if model == "gpt2":
        tok = _byte_level_bpe(meta, tokens, where)
    elif model == "llama":
        tok = _sentencepiece_bpe(meta, tokens, types, where)
    else:
        raise _fail(where, f"metadata key 'tokenizer.ggml.model' = {model!r}: nnef-kv reads the 'gpt2' (BPE) and "
                           "'llama' (SentencePiece) tokenizers")
    added = [AddedToken(t, special=ty == CONTROL, normalized=False) for t, ty in zip(tokens, types)
             if ty in (CONTROL, USER_DEFINED)]
    specials = [a for a in added if a.special]
    if specials:
        tok.add_special_tokens(specials)
    plain = [a for a in added if not a.special]
    if plain:
        tok.add_tokens(plain)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", model == "llama"):
        if bos is None or not 0 <= int(bos) < len(tokens):
            raise _fail(where, "metadata 'tokenizer.ggml.add_bos_token' is true but 'tokenizer.ggml.bos_token_id' is "
                               "missing or outside the vocabulary")
        b = tokens[int(bos)]
        tok.post_processor = processors.TemplateProcessing(single=f"{b} $A", pair=f"{b} $A {b} $B",
                                                           special_tokens=[(b, int(bos))])
    return tok if isinstance(tok, Tokenizer) else tok


def _byte_level_bpe(meta: dict[str, Any], tokens: list[str], where: Any) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_PATTERNS:
        raise _fail(where, f"metadata key 'tokenizer.ggml.pre' = {pre!r}: a pre-tokenizer nnef-kv does not know "
                           f"(known: {', '.join(sorted(PRE_PATTERNS))})")
    patterns, ignore_merges = PRE_PATTERNS[pre]
    merges = meta.get("tokenizer.ggml.merges")
    if not isinstance(merges, list):
        raise _fail(where, "metadata key 'tokenizer.ggml.merges' is missing (a 'gpt2' tokenizer needs its merges)")
    pairs = []
    for i, m in enumerate(merges):
        parts = m.split(" ")
        if len(parts) != 2:
            raise _fail(where, f"metadata key 'tokenizer.ggml.merges' entry {i} {m[:40]!r} is not two pieces")
        pairs.append((parts[0], parts[1]))
    vocab = {t: i for i, t in enumerate(tokens)}
    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exceptions
        raise _fail(where, f"the 'gpt2' tokenizer cannot be built from 'tokenizer.ggml.merges' ({str(exc)[:120]})") \
            from None
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in patterns]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(meta: dict[str, Any], tokens: list[str], types: list[int], where: Any) -> Any:
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = meta.get("tokenizer.ggml.scores")
    if not isinstance(scores, list) or len(scores) != len(tokens):
        raise _fail(where, "metadata key 'tokenizer.ggml.scores' is missing or not one score per token (a 'llama' "
                           "tokenizer needs them)")
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for t, i in vocab.items():
        if types[i] in (CONTROL, USER_DEFINED, BYTE) or len(t) < 2:
            continue
        for k in range(1, len(t)):
            a, b = t[:k], t[k:]
            if a in vocab and b in vocab:
                ranked.append((-float(scores[i]), i, vocab[a], a, b))
    ranked.sort()
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    unk_token = tokens[int(unk)] if unk is not None and 0 <= int(unk) < len(tokens) else None
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in ranked], unk_token=unk_token,
                               byte_fallback=True, fuse_unk=True))
    steps = [normalizers.Replace(" ", "\u2581")]
    if meta.get("tokenizer.ggml.add_space_prefix", True):
        steps.insert(0, normalizers.Prepend("\u2581"))
    tok.normalizer = normalizers.Sequence(steps)
    strip = [decoders.Strip(" ", 1, 0)] if meta.get("tokenizer.ggml.add_space_prefix", True) else []
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + strip)
    return tok


def tokenizer_files(g: Any) -> tuple[dict[str, bytes], list[str]]:
    """``{"tokenizer.json": ..., "tokenizer_config.json": ...}`` for the GGUF ``g`` and the notes to report."""
    meta, where = g.metadata, g.path
    tok = build_tokenizer(meta, where)
    tokens = meta["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        i = meta.get(key)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    config = {"bos_token": token("tokenizer.ggml.bos_token_id"), "eos_token": token("tokenizer.ggml.eos_token_id"),
              "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
              "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") ==
                                             "llama")),
              "chat_template": meta.get("tokenizer.chat_template"), "source": f"{where} (tokenizer.ggml.*)"}
    notes = [f"tokenizer: {meta.get('tokenizer.ggml.model')} / {meta.get('tokenizer.ggml.pre', '-')}, {len(tokens)} "
             f"tokens; BOS {'added' if config['add_bos_token'] else 'not added'}; chat template "
             f"{'kept' if config['chat_template'] else 'absent'}"]
    return {"tokenizer.json": tok.to_str().encode("utf-8"),
            "tokenizer_config.json": (json.dumps(config, indent=1, ensure_ascii=False) + "\n").encode("utf-8")}, notes
