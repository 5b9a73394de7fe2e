"""Text in: tokenizers, texts and token-id files, found and read with one-line errors.

* :func:`find_tokenizer` looks where exporters put ``tokenizer.json`` next to an archive: beside it,
  inside a model folder, and torch-to-nnef's layout (``EXPORT/model/model.nnef.tgz`` with
  ``EXPORT/tokenizer/tokenizer.json``).
* :func:`load_tokenizer` reads a ``tokenizer.json`` (or a folder holding one) with the Hugging Face
  ``tokenizers`` package (no transformers, no torch).
* :func:`read_text` (UTF-8), :func:`read_ids` (``.npy`` or whitespace/comma-separated integers),
  :func:`token_source` (text or ids -> one :class:`TokenSource`, checked against a vocabulary).
* :func:`byte_level_tokenizer`: a 256-id byte-level BPE tokenizer without merges (the tokenizer of
  the shared fixture exports), for built-in models and tests; :func:`sample_text`: the public-domain
  text shipped with the package (the US Declaration of Independence, 1776).

Every error is an :class:`~nnef_kv.errors.InputError` whose message starts with the option (or API
argument) and the file it concerns.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from .errors import InputError
from .grammar.printer import short

__all__ = ["TOKENIZER_FILE", "archive_base", "named_beside", "write_beside", "chat_config", "find_tokenizer",
           "load_tokenizer", "read_text", "read_ids", "TokenSource",
           "token_source", "byte_level_tokenizer", "sample_text", "SAMPLE_TEXT", "WIKITEXT", "decode_stream"]

TOKENIZER_FILE = "tokenizer.json"
SAMPLE_TEXT = Path(__file__).resolve().parent / "samples" / "texts" / "declaration_of_independence.txt"
#: the first 38 articles of WikiText-2's raw test split (CC BY-SA 3.0; samples/texts/README.md): the text
#: llama.cpp users measure perplexity and KL divergence on
WIKITEXT = SAMPLE_TEXT.parent / "wikitext2_test_38.txt"
MAX_TEXT_BYTES = 1 << 30  # a text file larger than this is refused before it is read


#: suffixes taken off an archive's name to name the files written beside it (``smol.nnef.tgz`` -> ``smol``)
ARCHIVE_SUFFIXES = (".nnef.tgz", ".nnef.tar.gz", ".nnef.tar", ".tgz", ".tar.gz", ".tar", ".nnef", ".gguf", ".onnx")


def archive_base(path: str | os.PathLike) -> str:
    """The archive's name without its archive suffix (``model.nnef.tgz`` -> ``model``)."""
    name = Path(path).name
    low = name.lower()
    cut = next((s for s in ARCHIVE_SUFFIXES if low.endswith(s) and len(name) > len(s)), "")
    return name[: len(name) - len(cut)] if cut else name


def named_beside(archive: str | os.PathLike, file: str) -> Path:
    """``<base>.<file>`` beside ``archive``: where ``convert`` writes a front end's file when an unrelated
    ``<file>`` is already there (``smol.tokenizer.json``)."""
    a = Path(archive)
    return a.parent / f"{archive_base(a)}.{file}"


def find_tokenizer(archive: str | os.PathLike) -> Path | None:
    """The ``tokenizer.json`` an exporter left next to ``archive``, or None. Looked for, in order: the one
    named after the archive (``<base>.tokenizer.json``, see :func:`named_beside`), inside a model folder,
    beside the archive, ``../tokenizer/`` (torch-to-nnef), the parent folder."""
    a = Path(archive)
    here = a if a.is_dir() else a.parent
    candidates = [named_beside(a, TOKENIZER_FILE)]
    candidates += [a / TOKENIZER_FILE] if a.is_dir() else []
    candidates += [here / TOKENIZER_FILE if not a.is_dir() else here.parent / TOKENIZER_FILE,
                   here.parent / "tokenizer" / TOKENIZER_FILE, here / "tokenizer" / TOKENIZER_FILE,
                   here.parent / TOKENIZER_FILE]
    seen: set[Path] = set()
    for c in candidates:
        if c in seen:
            continue
        seen.add(c)
        if c.is_file():
            return c
    return None


def write_beside(archive: str | os.PathLike, files: dict[str, bytes]) -> list[Path]:
    """Write a front end's files (``tokenizer.json``, ``tokenizer_config.json``) beside ``archive``, each
    atomically: under its own name when absent or holding the same bytes, else all of them as
    ``<base>.<name>`` (found first by :func:`find_tokenizer`), so no unrelated file is replaced."""
    from .atomic import atomic_write

    a = Path(archive)
    plain = all(not (a.parent / n).exists() or (a.parent / n).read_bytes() == b for n, b in files.items())
    written = []
    for name, data in files.items():
        target = a.parent / name if plain else named_beside(a, name)
        if target.exists() and target.read_bytes() == data:
            written.append(target)
            continue
        with atomic_write(target) as f:
            f.write(data)
        written.append(target)
    return written


def chat_config(tokenizer_path: str | os.PathLike) -> dict[str, Any] | None:
    """The ``tokenizer_config.json`` beside a tokenizer (``<base>.tokenizer_config.json`` for
    ``<base>.tokenizer.json``), parsed, or None when there is none or it is not a JSON object."""
    p = Path(tokenizer_path)
    name = p.name[: -len(TOKENIZER_FILE)] + "tokenizer_config.json" if p.name.endswith(TOKENIZER_FILE) else None
    cfg = p.parent / name if name else None
    if cfg is None or not cfg.is_file():
        return None
    try:
        doc = json.loads(cfg.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def load_tokenizer(path: str | os.PathLike, what: str = "--tokenizer") -> Any:
    """A ``tokenizers.Tokenizer`` from ``tokenizer.json`` or a folder holding one."""
    p = Path(path)
    if p.is_dir():
        p = p / TOKENIZER_FILE
        if not p.is_file():
            raise InputError(f"{what} {path}: no {TOKENIZER_FILE} in this folder")
    _regular(p, what, path)
    try:
        from tokenizers import Tokenizer
    except ImportError:  # pragma: no cover - a dependency of the package
        raise InputError(f"{what} {path}: the 'tokenizers' package is not installed (pip install tokenizers)") from None
    try:
        raw = p.read_bytes()
        doc = json.loads(raw.decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise InputError(f"{what} {p}: not a readable tokenizer JSON file ({short(exc, 160)})") from None
    if not isinstance(doc, dict) or "model" not in doc:
        raise InputError(f"{what} {p}: a JSON file but not a Hugging Face tokenizer (no 'model' entry)")
    try:
        return Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exceptions
        raise InputError(f"{what} {p}: not a valid tokenizer ({short(exc, 160)})") from None


def _regular(p: Path, what: str, path: Any) -> None:
    """Refuse what is not a regular file (links followed): absent, a folder, a FIFO, a device."""
    from .targets import kind_of, resolve

    kind = kind_of(resolve(p))
    if kind != "file":
        raise InputError(f"{what} {path}: " + ("no such file" if kind == "absent" else f"is a {kind}, not a file"))


def read_text(path: str | os.PathLike, what: str = "--text") -> str:
    """The UTF-8 text of ``path`` (not empty)."""
    p = Path(path)
    try:
        _regular(p, what, path)
        size = p.stat().st_size
        if size > MAX_TEXT_BYTES:
            raise InputError(f"{what} {path}: {size} bytes, more than the {MAX_TEXT_BYTES} a text may have")
        data = p.read_bytes()
    except OSError as exc:
        raise InputError(f"{what} {path}: cannot read it ({exc.strerror or exc})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(
            f"{what} {path}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})"
        ) from None
    if not text.strip():
        raise InputError(f"{what} {path}: the text is empty")
    return text


def read_ids(path: str | os.PathLike, what: str = "--ids") -> list[int]:
    """Token ids from a ``.npy`` file (integers, 1-D or ``[1, N]``) or a text file of integers separated by
    whitespace or commas."""
    import numpy as np

    p = Path(path)
    _regular(p, what, path)
    if p.suffix.lower() == ".npy":
        if p.stat().st_size > MAX_TEXT_BYTES:
            raise InputError(f"{what} {path}: {p.stat().st_size} bytes, more than the {MAX_TEXT_BYTES} an ids file "
                             f"may have")
        try:  # memory-mapped: a header claiming more than the file holds is refused, nothing is allocated
            a = np.load(p, allow_pickle=False, mmap_mode="r")
        except (OSError, ValueError, EOFError) as exc:
            raise InputError(f"{what} {path}: not a readable .npy file ({short(exc, 160)})") from None
        if a.dtype.kind not in "iu" or not (a.ndim == 1 or (a.ndim == 2 and a.shape[0] == 1)):
            raise InputError(f"{what} {path}: expected integer ids of shape [N] or [1, N], got {a.dtype} "
                             f"{list(a.shape)}")
        ids = [int(x) for x in a.reshape(-1)]
    else:
        text = read_text(p, what)
        ids = []
        for i, tok in enumerate(text.replace(",", " ").split()):
            try:
                ids.append(int(tok))
            except ValueError:
                raise InputError(f"{what} {path}: item {i} {tok[:20]!r} is not an integer token id") from None
    if not ids:
        raise InputError(f"{what} {path}: no token ids in the file")
    neg = next((i for i, x in enumerate(ids) if x < 0), None)
    if neg is not None:
        raise InputError(f"{what} {path}: token id {ids[neg]} at position {neg} is negative")
    return ids


@dataclass
class TokenSource:
    """Token ids and where they came from (for reports and error messages)."""

    ids: list[int]
    option: str  # "--text", "--prompt", "--ids" (or the API argument)
    description: str
    tokenizer: Any = None
    tokenizer_path: str | None = None
    notes: list[str] = field(default_factory=list)

    label: str = ""  # the option and its file, for messages ("--ids ids.txt"); default: the option

    def check_vocabulary(self, vocab: int | None) -> None:
        """InputError naming the option (and file) and the first id outside ``[0, vocab)``."""
        if vocab is None:
            return
        for i, t in enumerate(self.ids):
            if not 0 <= t < vocab:
                raise InputError(f"{self.label or self.option}: token id {t} at position {i} is outside the model's "
                                 f"vocabulary of {vocab} ids ({self.description}){self._tokenizer_note(vocab)}")

    def _tokenizer_note(self, vocab: int) -> str:
        """When the ids came from a tokenizer larger than the model's vocabulary: say so (not this model's?)."""
        try:
            n = int(self.tokenizer.get_vocab_size(with_added_tokens=True)) if self.tokenizer is not None else 0
        except Exception:  # noqa: BLE001 - a tokenizer-like object without the method: nothing to add
            return ""
        if n <= vocab:
            return ""
        named = f" {self.tokenizer_path}" if self.tokenizer_path else ""
        return f"; the tokenizer{named} has {n} ids: not this model's tokenizer?"

    def decode(self, ids: Sequence[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(list(ids))


def token_source(*, text: str | os.PathLike | None = None, prompt: str | None = None,
                 ids: str | os.PathLike | Sequence[int] | None = None, tokenizer: Any = None,
                 archive: str | os.PathLike | None = None, names: dict[str, str] | None = None) -> TokenSource:
    """Exactly one of ``text`` (a file), ``prompt`` (a string) or ``ids`` (a file or a list of ints).

    ``tokenizer``: a ``tokenizers.Tokenizer``, a path, or None (then the one :func:`find_tokenizer`
    finds next to ``archive`` is used and named in the notes). ``names`` maps the argument names to the
    option names shown in errors (the CLI passes ``--text`` ...)."""
    nm = {"text": "text", "prompt": "prompt", "ids": "ids", "tokenizer": "tokenizer", **(names or {})}
    given = [k for k, v in (("text", text), ("prompt", prompt), ("ids", ids)) if v is not None]
    if len(given) != 1:
        raise InputError(f"give exactly one of {nm['text']}, {nm['prompt']} or {nm['ids']}"
                         + (f" (got {', '.join(nm[g] for g in given)})" if given else ""))
    kind = given[0]
    if kind == "ids":
        if isinstance(ids, (str, os.PathLike)):
            got = read_ids(ids, nm["ids"])
            return TokenSource(got, nm["ids"], f"{len(got)} ids from {ids}", label=f"{nm['ids']} {ids}")
        got = [int(i) for i in ids]  # type: ignore[union-attr]
        if not got:
            raise InputError(f"{nm['ids']}: no token ids given")
        return TokenSource(got, nm["ids"], f"{len(got)} ids")
    notes: list[str] = []
    tok_path: str | None = None
    if tokenizer is None:
        found = find_tokenizer(archive) if archive is not None else None
        if found is None:
            where = f" next to {archive}" if archive is not None else ""
            raise InputError(f"{nm[kind]} needs a tokenizer: none found{where} (looked for {TOKENIZER_FILE} beside "
                             f"the archive, in a model folder and in ../tokenizer/); give {nm['tokenizer']} PATH "
                             f"or {nm['ids']} FILE")
        tokenizer = found
        notes.append(f"tokenizer found next to the archive: {found}")
    if isinstance(tokenizer, (str, os.PathLike)):
        tok_path = str(tokenizer)
        tokenizer = load_tokenizer(tokenizer, nm["tokenizer"])
    if kind == "text":
        body = read_text(text, nm["text"])  # type: ignore[arg-type]
        label = f"{nm['text']} {text}"
    else:
        body = str(prompt)
        if not body.strip():
            raise InputError(f"{nm['prompt']}: the prompt is empty")
        label = nm["prompt"]
    try:
        enc = tokenizer.encode(body).ids
    except Exception as exc:  # noqa: BLE001
        raise InputError(f"{label}: the tokenizer failed on it ({short(exc, 160)})") from None
    if not enc:
        raise InputError(f"{label}: the tokenizer gives no tokens for it")
    desc = f"{len(enc)} tokens of {label if kind == 'text' else 'the prompt'} ({len(body)} characters)"
    if tok_path:
        desc += f", tokenizer {tok_path}"
    return TokenSource([int(i) for i in enc], nm[kind], desc, tokenizer, tok_path, notes, label=label)


def byte_level_tokenizer() -> Any:
    """A byte-level BPE tokenizer with 256 ids and no merges (one token per byte of the UTF-8 text),
    built in code: the tokenizer the shared fixture exports ship."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # GPT-2's byte order: the printable bytes first, then the others, as the fixtures' vocab lists them
    order = _gpt2_byte_order()
    vocab = {ch: i for i, ch in enumerate(order)}
    assert set(vocab) == set(alphabet)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _gpt2_byte_order() -> list[str]:
    """The characters GPT-2's byte-level alphabet gives bytes 0..255, in its vocabulary order."""
    first = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = {b: chr(b) for b in first}
    n = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    return [chars[b] for b in first] + [chars[b] for b in range(256) if b not in first]


def sample_text() -> str:
    """The public-domain text shipped with the package (the Declaration of Independence, 8,150 bytes)."""
    return SAMPLE_TEXT.read_text(encoding="utf-8")


def decode_stream(tokenizer: Any):
    """A function ``(ids, final=False) -> new text``: called with the ids produced so far, it returns the
    text they add since the last call, holding back an incomplete UTF-8 character (shown once it is
    complete, or as it decodes when ``final``)."""
    state = {"shown": ""}

    def step(ids: Sequence[int], final: bool = False) -> str:
        text = tokenizer.decode(list(ids))
        if not final:
            text = text.rstrip("\ufffd")  # the bytes of a character still coming
        new = text[len(state["shown"]):] if text.startswith(state["shown"]) else text
        state["shown"] = text
        return new

    return step
