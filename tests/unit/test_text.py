"""nnef_kv.text: tokenizers found where exporters put them, texts and id files read with one-line errors."""
from __future__ import annotations

import json

import numpy as np
import pytest

from nnef_kv.errors import InputError
from nnef_kv.text import (
    byte_level_tokenizer,
    decode_stream,
    find_tokenizer,
    load_tokenizer,
    read_ids,
    read_text,
    sample_text,
    token_source,
)

from conftest import FIXTURES, requires_shared


@pytest.fixture()
def tok_file(tmp_path):
    p = tmp_path / "src" / "tokenizer.json"
    p.parent.mkdir()
    byte_level_tokenizer().save(str(p))
    return p


@pytest.mark.parametrize("layout", ["beside", "model-folder", "torch-to-nnef", "parent"])
def test_find_tokenizer_where_exporters_put_it(tmp_path, tok_file, layout) -> None:
    data = tok_file.read_bytes()
    if layout == "beside":
        archive, tok = tmp_path / "m.nnef.tgz", tmp_path / "tokenizer.json"
    elif layout == "model-folder":
        archive = tmp_path / "model_dir"
        archive.mkdir()
        tok = archive / "tokenizer.json"
    elif layout == "torch-to-nnef":  # EXPORT/model/model.nnef.tgz + EXPORT/tokenizer/tokenizer.json
        (tmp_path / "EXPORT" / "model").mkdir(parents=True)
        (tmp_path / "EXPORT" / "tokenizer").mkdir()
        archive, tok = (
            tmp_path / "EXPORT" / "model" / "model.nnef.tgz",
            tmp_path / "EXPORT" / "tokenizer" / "tokenizer.json",
        )
    else:
        (tmp_path / "a" / "b").mkdir(parents=True)
        archive, tok = tmp_path / "a" / "b" / "m.nnef.tar", tmp_path / "a" / "tokenizer.json"
    if not archive.exists():
        archive.write_bytes(b"")
    tok.write_bytes(data)
    assert find_tokenizer(archive) == tok
    src = token_source(prompt="hello", archive=archive)
    assert src.ids == byte_level_tokenizer().encode("hello").ids
    assert src.notes == [f"tokenizer found next to the archive: {tok}"]


def test_no_tokenizer_found_says_where_it_looked(tmp_path) -> None:
    archive = tmp_path / "m.nnef.tgz"
    archive.write_bytes(b"")
    assert find_tokenizer(archive) is None
    with pytest.raises(
        InputError, match=r"^text needs a tokenizer: none found next to .*give tokenizer PATH or ids FILE"
    ):
        token_source(text=tmp_path / "x.txt", archive=archive)


def test_load_tokenizer_errors(tmp_path) -> None:
    (tmp_path / "a.json").write_text('{"model": 1}')
    (tmp_path / "b.json").write_text("[1, 2")
    (tmp_path / "c.json").write_text('{"x": 1}')
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(InputError, match="not a valid tokenizer"):
        load_tokenizer(tmp_path / "a.json")
    with pytest.raises(InputError, match="not a readable tokenizer JSON file"):
        load_tokenizer(tmp_path / "b.json")
    with pytest.raises(InputError, match="not a Hugging Face tokenizer"):
        load_tokenizer(tmp_path / "c.json", what="--tokenizer")
    with pytest.raises(InputError, match="no tokenizer.json in this folder"):
        load_tokenizer(tmp_path / "empty_dir")
    with pytest.raises(InputError, match="no such file"):
        load_tokenizer(tmp_path / "absent.json")


@requires_shared
def test_byte_level_tokenizer_is_the_fixtures_one() -> None:
    path = FIXTURES / "exports" / "llama_default" / "tokenizer.json"
    fixture = load_tokenizer(path)
    ours = byte_level_tokenizer()
    assert json.loads(path.read_text())["model"]["vocab"] == ours.get_vocab()
    text = sample_text()[:2000] + " naïve ☃ 日本"
    assert ours.encode(text).ids == fixture.encode(text).ids
    assert ours.decode(ours.encode(text).ids) == text


def test_read_text_and_ids(tmp_path) -> None:
    (tmp_path / "ok.txt").write_text("héllo", encoding="utf-8")
    assert read_text(tmp_path / "ok.txt") == "héllo"
    (tmp_path / "bad.txt").write_bytes(b"ab\xff")
    with pytest.raises(InputError, match=r"not UTF-8 text \(byte 0xff at offset 2\)"):
        read_text(tmp_path / "bad.txt")
    (tmp_path / "blank.txt").write_text(" \n\t")
    with pytest.raises(InputError, match="the text is empty"):
        read_text(tmp_path / "blank.txt")
    (tmp_path / "ids.txt").write_text("1, 2 3\n4")
    assert read_ids(tmp_path / "ids.txt") == [1, 2, 3, 4]
    np.save(tmp_path / "ids.npy", np.array([[5, 6, 7]], np.int64))
    assert read_ids(tmp_path / "ids.npy") == [5, 6, 7]
    np.save(tmp_path / "f.npy", np.array([1.5]))
    with pytest.raises(InputError, match="expected integer ids"):
        read_ids(tmp_path / "f.npy")
    (tmp_path / "neg.txt").write_text("3 -1")
    with pytest.raises(InputError, match="token id -1 at position 1 is negative"):
        read_ids(tmp_path / "neg.txt", what="--ids")


def test_token_source_takes_exactly_one_source(tmp_path) -> None:
    with pytest.raises(InputError, match="give exactly one of text, prompt or ids"):
        token_source()
    with pytest.raises(InputError, match=r"\(got text, ids\)"):
        token_source(text="a", ids=[1])
    src = token_source(ids=[3, 4], names={"ids": "--ids"})
    with pytest.raises(InputError, match="^--ids: token id 4 at position 1 is outside the model's vocabulary of 4 ids"):
        src.check_vocabulary(4)


def test_decode_stream_holds_back_incomplete_characters() -> None:
    tok = byte_level_tokenizer()
    ids = tok.encode("a☃b").ids  # ☃ is 3 bytes
    step = decode_stream(tok)
    shown = [step(ids[:i]) for i in range(1, len(ids) + 1)]
    assert shown == ["a", "", "", "☃", "b"]
    cut = decode_stream(tok)
    assert cut(ids[:2]) == "a" and cut(ids[:3]) == ""
    assert cut(ids[:3], final=True) == "\ufffd"  # at the end, what there is
