"""Model archives: folders, .tar, .tgz; the Model object; safety checks and limits; reproducible saves."""
from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest

import nnef_kv
from nnef_kv.errors import ArchiveError, LimitError, TensorFileError
from nnef_kv.io.archive import Model, load, save
from nnef_kv.tensors.blockquant import BlockQuantTensor
from nnef_kv.tensors.dat import DatInfo, encode_tensor
from nnef_kv.limits import Limits

from conftest import CONFORMANCE, FIXTURES, requires_shared

SIMPLE = """version 1.0;

graph G( x ) -> ( y )
{
  x = external<scalar>(shape = [2, 3]);
  w = variable<scalar>(label = "w", shape = [2, 3]);
  y = add(x, w);
}
"""


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------
def same_tensor(a, b) -> bool:
    if isinstance(a, BlockQuantTensor) or isinstance(b, BlockQuantTensor):
        return a == b
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == object:
        return a.tolist() == b.tolist()
    return a.tobytes() == b.tobytes()


def assert_same_model(a: Model, b: Model) -> None:
    assert a.document == b.document
    assert a.quantization == b.quantization
    assert sorted(a.tensors) == sorted(b.tensors)
    for label in a.tensors:
        assert same_tensor(a.tensors[label], b.tensors[label]), label
    assert a.resources == b.resources


def manifest_models() -> list[tuple[str, Path]]:
    """(case, path) of every model (folder or archive) of the conformance MANIFEST."""
    if not (CONFORMANCE / "MANIFEST.json").is_file():
        return []
    out = []
    for case in json.loads((CONFORMANCE / "MANIFEST.json").read_text()):
        base = CONFORMANCE / case["path"]
        if case.get("model") is not None:
            out.append((case["case"], base if case["model"] == "." else base / case["model"]))
        elif base.is_dir() and (base / "graph.nnef").is_file():
            out.append((case["case"], base))
    return out


MODELS = manifest_models()
FIXTURE_ARCHIVES = sorted(FIXTURES.glob("*/model.nnef.tgz")) if FIXTURES.is_dir() else []


def simple_model(**tensors) -> Model:
    return Model.from_text(SIMPLE, tensors or {"w": np.arange(6, dtype=np.float32).reshape(2, 3)})


def make_tar(path: Path, entries: list[tuple], gz: bool = False) -> Path:
    """entries: (name, bytes) for files or (name, TarInfo-type, linkname) for special members."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
        for e in entries:
            ti = tarfile.TarInfo(e[0])
            if len(e) == 2:
                ti.size = len(e[1])
                tf.addfile(ti, io.BytesIO(e[1]))
            else:
                ti.type, ti.linkname = e[1], e[2]
                tf.addfile(ti)
    data = buf.getvalue()
    path.write_bytes(gzip.compress(data, mtime=0) if gz else data)
    return path


W_DAT = encode_tensor(np.zeros((2, 3), np.float32))


# ----------------------------------------------------------------------------------------------
# the conformance corpus and the fixtures
# ----------------------------------------------------------------------------------------------
@requires_shared
def test_manifest_lists_models():
    assert len(MODELS) >= 70
    kinds = {p.suffix or "dir" for _, p in MODELS}
    assert {".tgz", "dir"} <= kinds


@requires_shared
@pytest.mark.parametrize("case,path", MODELS, ids=[c for c, _ in MODELS])
def test_conformance_model_loads_and_round_trips(tmp_path, case, path):
    model = load(path)
    assert model.document.graph is not None
    assert model.source == str(path) and model.text is not None
    model.check_variables()
    originals = {}
    if path.is_dir():
        originals = {p.relative_to(path).as_posix()[:-4]: p.read_bytes() for p in path.rglob("*.dat")}
    for suffix in ("dir", "m.nnef.tar", "m.nnef.tgz"):
        target = tmp_path / suffix
        save(model, target)
        again = load(target)
        assert_same_model(model, again)
        if suffix != "dir":  # reproducible bytes
            assert save(again, tmp_path / ("again-" + suffix)).read_bytes() == target.read_bytes()
        if suffix == "dir":  # every tensor file is written back byte for byte
            for label in model.tensors:
                if label in originals:
                    assert (target / f"{label}.dat").read_bytes() == originals[label], label


@requires_shared
@pytest.mark.parametrize("archive", FIXTURE_ARCHIVES, ids=[p.parent.name for p in FIXTURE_ARCHIVES])
def test_fixture_archives_load_and_round_trip_exactly(tmp_path, archive):
    model = load(archive)
    labels = model.variable_labels()
    assert labels and all(model.resolve_label(lab) for lab in labels)
    with tarfile.open(archive) as tf:
        raw = {
            m.name[:-4].removeprefix("./"): tf.extractfile(m).read() for m in tf.getmembers() if m.name.endswith(".dat")
        }
    assert sorted(raw) == sorted(model.tensors)
    out = save(model, tmp_path / "copy.nnef.tgz")
    with tarfile.open(out) as tf:
        for m in tf.getmembers():
            if m.name.endswith(".dat"):
                assert tf.extractfile(m).read() == raw[m.name[:-4]], m.name
    assert_same_model(model, load(out))


@requires_shared
def test_submodel_members_are_kept_as_resources(tmp_path):
    model = load(CONFORMANCE / "tract-harness/submodel")
    assert {"nnet1.nnef.tar", "nnet2/graph.nnef", "nnet2/output_bias.dat", "expected", "io.npz"} <= set(model.resources)
    assert not any(label.startswith("nnet2/") for label in model.tensors)
    save(model, tmp_path / "s.tar")
    assert load(tmp_path / "s.tar").resources == model.resources


@requires_shared
def test_uncompressed_reads_are_views(tmp_path):
    model = load(CONFORMANCE / "tract-harness/gru-epilogue")
    save(model, tmp_path / "g.tar")
    for m in (model, load(tmp_path / "g.tar")):
        for t in m.tensors.values():
            assert not t.flags.writeable and not t.flags.owndata


# ----------------------------------------------------------------------------------------------
# the Model
# ----------------------------------------------------------------------------------------------
def test_variable_labels_come_from_graph_and_fragments():
    text = """version 1.0;

fragment block( x: tensor<scalar> ) -> ( y: tensor<scalar> )
{
  b = variable<scalar>(shape = [2, 3], label = "frag/b");
  y = add(x, b);
}

graph G( x ) -> ( y )
{
  x = external<scalar>(shape = [2, 3]);
  w = variable<scalar>([2, 3], "/w");
  y = block(add(x, w));
}
"""
    m = Model.from_text(text, {"w": np.zeros((2, 3), np.float32)})
    assert m.variable_labels() == ["frag/b", "/w"]
    assert m.resolve_label("/w") == "w"
    with pytest.raises(ArchiveError, match="frag/b"):
        m.check_variables()
    m.tensors["frag/b"] = np.ones((2, 3), np.float32)
    m.check_variables()


def test_missing_variable_file_names_archive_and_label(tmp_path):
    make_tar(tmp_path / "m.tar", [("graph.nnef", SIMPLE.encode())])
    with pytest.raises(ArchiveError) as e:
        load(tmp_path / "m.tar")
    assert "m.tar" in str(e.value) and "'w'" in str(e.value)
    assert load(tmp_path / "m.tar", check=False).tensors == {}


def test_tract_style_leading_slash_labels(tmp_path):
    text = SIMPLE.replace('label = "w"', 'label = "/w"')
    make_tar(tmp_path / "m.tar", [("graph.nnef", text.encode()), ("./w.dat", W_DAT)])
    m = load(tmp_path / "m.tar")
    assert list(m.tensors) == ["w"] and m.variable_labels() == ["/w"]
    assert m.tensor("/w").shape == (2, 3)


def test_save_in_every_format_and_reproducible_bytes(tmp_path):
    m = simple_model()
    m.tensors["odd/la,bel(1).x"] = np.array([1, 2], dtype=np.int64)
    m.tensor_info["odd/la,bel(1).x"] = DatInfo(item_type=3, bits_per_item=64)
    m.resources["notes.json"] = b'{"a": 1}'
    for name in ("a.tar", "a.tgz", "a.nnef.tgz", "a.tar.gz", "a.nnef.tar"):
        first = save(m, tmp_path / name).read_bytes()
        second = save(m, tmp_path / ("again-" + name)).read_bytes()
        assert first == second, name
        assert_same_model(m, load(tmp_path / name))
    save(m, tmp_path / "folder")
    assert (tmp_path / "folder/odd/la,bel(1).x.dat").is_file()
    assert load(tmp_path / "folder").tensor_info["odd/la,bel(1).x"].item_type == 3
    assert_same_model(m, load(tmp_path / "folder"))


def test_saved_tar_headers_are_deterministic(tmp_path):
    m = simple_model()
    raw = save(m, tmp_path / "a.tgz").read_bytes()
    assert raw[:2] == b"\x1f\x8b" and raw[4:8] == bytes(4) and not raw[3] & 0x08  # mtime 0, no file name
    with tarfile.open(tmp_path / "a.tgz") as tf:
        infos = tf.getmembers()
    assert [i.name for i in infos] == ["graph.nnef", "w.dat"]
    for i in infos:
        assert (i.mtime, i.uid, i.gid, i.uname, i.gname, i.mode) == (0, 0, 0, "", "", 0o644)
    text = tarfile.open(tmp_path / "a.tgz").extractfile("graph.nnef").read().decode()
    assert text == nnef_kv.dump(m.document)


def test_long_and_unicode_names_round_trip(tmp_path):
    label = "x" * 150 + "/é.(S,max(0,S+-1))..S"
    m = simple_model()
    m.tensors[label] = np.float64(3.5).reshape(())
    save(m, tmp_path / "l.tar")
    assert same_tensor(load(tmp_path / "l.tar").tensors[label], m.tensors[label])


def test_gzip_is_sniffed_by_magic_not_suffix(tmp_path):
    m = simple_model()
    save(m, tmp_path / "a.tgz")
    shutil.copy(tmp_path / "a.tgz", tmp_path / "model.bin")
    save(m, tmp_path / "b.tar")
    shutil.copy(tmp_path / "b.tar", tmp_path / "plain.tgz")
    assert_same_model(load(tmp_path / "model.bin"), m)
    assert_same_model(load(tmp_path / "plain.tgz"), m)


def test_hidden_members_are_ignored(tmp_path):
    make_tar(
        tmp_path / "m.tgz",
        [("./graph.nnef", SIMPLE.encode()), ("./w.dat", W_DAT), ("._w.dat", b"junk"), (".git/config", b"x"),
         ("sub/.hidden.dat", b"junk")],
        gz=True,
    )
    m = load(tmp_path / "m.tgz")
    assert list(m.tensors) == ["w"] and m.resources == {}


def test_save_refuses_names_that_would_not_read_back(tmp_path):
    for label in ("a/../b", ".hidden", "a//b", "dir/.x"):
        m = simple_model()
        m.tensors[label] = np.zeros(1, np.float32)
        with pytest.raises(ArchiveError):
            save(m, tmp_path / "x.tar")
    assert not (tmp_path / "x.tar").exists()


def test_failed_save_leaves_nothing(tmp_path):
    m = simple_model()
    m.tensors["bad"] = np.array([object()])
    for name in ("x.tgz", "x.tar", "xdir"):
        with pytest.raises(TensorFileError):
            save(m, tmp_path / name)
    assert list(tmp_path.iterdir()) == []


def test_modified_tensor_drops_an_encoding_that_no_longer_fits(tmp_path):
    m = simple_model()
    m.tensor_info["w"] = DatInfo(item_type=3, bits_per_item=64)  # stale: w is f32
    save(m, tmp_path / "d")
    assert load(tmp_path / "d").tensors["w"].dtype == np.float32


def test_session_is_delegated_lazily():
    m = simple_model()
    try:
        from nnef_kv.interpreter.session import Session  # noqa: F401
    except ImportError:
        pytest.skip("the interpreter session is not there yet")
    s = m.session()
    assert type(s).__name__ == "Session"


# ----------------------------------------------------------------------------------------------
# refusals
# ----------------------------------------------------------------------------------------------
REFUSED = {
    "absolute": ([("graph.nnef", SIMPLE.encode()), ("/etc/w.dat", W_DAT)], "absolute"),
    "dotdot": ([("graph.nnef", SIMPLE.encode()), ("a/../../w.dat", W_DAT)], ".."),
    "symlink": ([("graph.nnef", SIMPLE.encode()), ("w.dat", tarfile.SYMTYPE, "/etc/passwd")], "symbolic link"),
    "hardlink": ([("graph.nnef", SIMPLE.encode()), ("w.dat", tarfile.LNKTYPE, "graph.nnef")], "hard link"),
    "device": ([("graph.nnef", SIMPLE.encode()), ("w.dat", tarfile.CHRTYPE, "")], "device"),
    "fifo": ([("graph.nnef", SIMPLE.encode()), ("w.dat", tarfile.FIFOTYPE, "")], "FIFO"),
    "duplicate": ([("graph.nnef", SIMPLE.encode()), ("w.dat", W_DAT), ("./w.dat", W_DAT)], "duplicate"),
    "no graph": ([("w.dat", W_DAT)], "no graph.nnef"),
    "utf8": ([("graph.nnef", b"version 1.0; \xff\xfe")], "UTF-8"),
    "bad tensor": ([("graph.nnef", SIMPLE.encode()), ("w.dat", W_DAT[:130])], "w.dat"),
}


@pytest.mark.parametrize("gz", [False, True], ids=["tar", "tgz"])
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsafe_or_broken_archives_are_refused(tmp_path, case, gz):
    entries, words = REFUSED[case]
    p = make_tar(tmp_path / "evil.tar", entries, gz=gz)
    with pytest.raises((ArchiveError, TensorFileError)) as e:
        load(p)
    assert "evil.tar" in str(e.value) and words in str(e.value)


def test_not_an_archive(tmp_path):
    (tmp_path / "x.tar").write_bytes(b"hello world" * 100)
    with pytest.raises(ArchiveError, match="x.tar"):
        load(tmp_path / "x.tar")
    (tmp_path / "y.tgz").write_bytes(b"\x1f\x8b" + b"garbage" * 10)
    with pytest.raises(ArchiveError, match="y.tgz"):
        load(tmp_path / "y.tgz")
    with pytest.raises(ArchiveError, match="missing"):
        load(tmp_path / "missing")


def test_truncated_tgz(tmp_path):
    save(simple_model(), tmp_path / "a.tgz")
    raw = (tmp_path / "a.tgz").read_bytes()
    (tmp_path / "t.tgz").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ArchiveError, match="t.tgz"):
        load(tmp_path / "t.tgz")


def test_folder_symlinks_to_files_are_followed_and_others_refused(tmp_path):
    """Issue 23.7: a local model folder whose members link to regular files (the HF hub cache layout) loads;
    a link to anything else is refused, naming the member."""
    d = tmp_path / "m"
    save(simple_model(), d)
    os.symlink(d / "w.dat", d / "v.dat")
    assert load(d) is not None
    os.unlink(d / "v.dat")
    os.symlink(tmp_path, d / "v.dat")
    with pytest.raises(ArchiveError, match="v.dat"):
        load(d)


def test_limits(tmp_path):
    m = simple_model()
    save(m, tmp_path / "a.tgz")
    with pytest.raises(LimitError, match="max_members"):
        load(tmp_path / "a.tgz", limits=Limits(max_members=1))
    with pytest.raises(LimitError, match="max_text_bytes"):
        load(tmp_path / "a.tgz", limits=Limits(max_text_bytes=10))
    with pytest.raises(LimitError, match="max_tensor_bytes"):
        load(tmp_path / "a.tgz", limits=Limits(max_tensor_bytes=8))
    save(m, tmp_path / "d")
    with pytest.raises(LimitError, match="max_archive_bytes"):
        load(tmp_path / "d", limits=Limits(max_archive_bytes=100))


def test_gzip_bomb_stops_early(tmp_path):
    """A 64 MiB member compressed to ~64 KB: decompression stops once the budget is spent."""
    bomb = tmp_path / "bomb.tgz"
    with open(bomb, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, compresslevel=1) as gz:
        with tarfile.open(fileobj=gz, mode="w|") as tf:
            ti = tarfile.TarInfo("graph.nnef")
            ti.size = 64 << 20

            class Zeros(io.RawIOBase):
                def readable(self):
                    return True

                def readinto(self, b):
                    b[:] = bytes(len(b))
                    return len(b)

            tf.addfile(ti, io.BufferedReader(Zeros()))
    assert bomb.stat().st_size < 1 << 20
    with pytest.raises(LimitError, match="max_archive_bytes"):
        load(bomb, limits=Limits(max_archive_bytes=1 << 20, max_text_bytes=1 << 30))


# ----------------------------------------------------------------------------------------------
# the shipped sample
# ----------------------------------------------------------------------------------------------
def test_shipped_sample_is_a_fresh_build(tmp_path):
    from nnef_kv.samples import build_sample, sample_path

    shipped = sample_path()
    assert shipped.is_file() and shipped.stat().st_size < 16 * 1024
    fresh = build_sample(tmp_path / "tiny_decoder.nnef.tgz")
    assert fresh.read_bytes() == shipped.read_bytes()
    m = load(shipped)
    assert len(m.variable_labels()) == 8 and all(lab.startswith("block/") for lab in m.variable_labels())
    assert m.document.graph.inputs == ("x", "past_k", "past_v")
    assert all(t.dtype == np.float32 for t in m.tensors.values())


def test_saved_files_get_ordinary_permissions(tmp_path):
    import stat

    from nnef_kv.io.container import default_mode

    m = simple_model()
    for name in ("a.tgz", "d"):
        save(m, tmp_path / name)
    assert stat.S_IMODE((tmp_path / "a.tgz").stat().st_mode) == default_mode()
    assert stat.S_IMODE((tmp_path / "d").stat().st_mode) == default_mode(0o777)
    assert stat.S_IMODE((tmp_path / "d" / "w.dat").stat().st_mode) == default_mode()


@pytest.mark.parametrize("name", ["d", "m.tar", "m.tgz"])
def test_saving_over_the_source_keeps_the_tensors(tmp_path, name):
    """Tensors mapped from the old file stay valid while the new one replaces it."""
    first = simple_model()
    first.tensors["big"] = np.arange(50_000, dtype=np.float32)
    save(first, tmp_path / name)
    m = load(tmp_path / name)
    m.tensors["extra"] = np.ones(3, np.int8)
    save(m, tmp_path / name)
    again = load(tmp_path / name)
    assert same_tensor(again.tensors["big"], first.tensors["big"]) and "extra" in again.tensors
    assert same_tensor(m.tensors["big"], first.tensors["big"])
