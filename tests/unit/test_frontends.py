"""Front ends: what ``convert`` and ``nnef-kv convert`` read, recognised from the path (folder, .tar,
.tgz, graph.nnef, any-named tar/gzip by its bytes, .onnx), and one line naming the file and the
accepted kinds for anything else."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

import nnef_kv
from nnef_kv import ArchiveError, ConversionError
from nnef_kv.cli import main
from nnef_kv.converters import convert, frontends
from nnef_kv.converters.frontends import FRONTENDS, FrontEnd, accepted, detect
from nnef_kv.models import DecoderConfig, build_decoder

CFG = DecoderConfig(vocab=256, hidden=32, layers=1, heads=4, kv_heads=2, head_dim=8, mlp=64, seed=5)
HAVE_ONNX = all(importlib.util.find_spec(m) is not None for m in ("onnx", "onnxruntime", "nnef_tools"))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("frontends")
    model = build_decoder(CFG)
    out = {"folder": d / "m", "tar": d / "m.nnef.tar", "tgz": d / "m.nnef.tgz"}
    for p in out.values():
        nnef_kv.save(model, p)
    out["graph.nnef"] = out["folder"] / "graph.nnef"
    out["tar, any name"] = d / "model.bin"
    out["tar, any name"].write_bytes(out["tar"].read_bytes())
    out["tgz, any name"] = d / "model.data"
    out["tgz, any name"].write_bytes(out["tgz"].read_bytes())
    out["unknown"] = d / "notes.txt"
    out["unknown"].write_text("not a model\n")
    return out


@pytest.mark.parametrize("kind", ["folder", "tar", "tgz", "graph.nnef", "tar, any name", "tgz, any name"])
def test_nnef_inputs_are_detected_and_load(inputs, kind):
    assert detect(inputs[kind]) is FRONTENDS["nnef"]
    model = frontends.load(inputs[kind])
    assert model.document.graph is not None and model.tensors
    reference = nnef_kv.load(inputs["folder"])
    assert nnef_kv.dump(model.document) == nnef_kv.dump(reference.document)
    assert sorted(model.tensors) == sorted(reference.tensors)


def test_onnx_is_detected_by_its_suffix(tmp_path):
    for name in ("decoder.onnx", "DECODER.ONNX"):
        assert detect(tmp_path / name) is FRONTENDS["onnx"]  # a name: no need to open it


def test_unknown_input_is_one_line_naming_the_file_and_the_kinds(inputs, capsys, tmp_path):
    path = inputs["unknown"]
    assert detect(path) is None
    with pytest.raises(ConversionError) as exc:
        frontends.load(path)
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(f"{path}: ") and accepted() in msg
    assert "graph.nnef" in msg and ".onnx" in msg
    with pytest.raises(ConversionError, match="not a model nnef-kv reads"):
        convert(path)
    out = tmp_path / "out.nnef.tar"
    assert main(["convert", str(path), "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and str(path) in err and "accepted:" in err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_missing_path_says_so(tmp_path):
    for name in ("gone.nnef.tgz", "gone"):
        with pytest.raises(ArchiveError, match="no such file or folder"):
            frontends.load(tmp_path / name)


def test_convert_takes_every_nnef_input_alike(inputs):
    texts = {k: nnef_kv.dump(convert(inputs[k], scheme="kivi", bits=4)[0].document)
             for k in ("folder", "tar", "tgz", "graph.nnef")}
    assert len(set(texts.values())) == 1


@pytest.mark.skipif(not HAVE_ONNX, reason="onnx, onnxruntime and nnef-tools are needed")
def test_onnx_front_end_loads_through_the_registry(tmp_path):
    onnx = pytest.importorskip("onnx")
    from test_onnx_frontend import build_decoder as build_onnx_decoder

    path = tmp_path / "tiny.onnx"
    onnx.save(build_onnx_decoder(n_layers=1), str(path))
    model = frontends.load(path)
    assert "via nnef-tools" in str(model.source)
    from nnef_kv.converters.onnx_frontend import onnx_to_nnef  # the former module still imports

    assert nnef_kv.dump(onnx_to_nnef(path)[0].document) == nnef_kv.dump(model.document)


def test_a_registered_front_end_is_used(monkeypatch, tmp_path, inputs):
    """The next front end is one registry entry: here one that reads '.nnefdir' links to a folder."""
    link = tmp_path / "model.nnefdir"
    link.write_text(os.fspath(inputs["folder"]))
    fe = FrontEnd(name="link", kinds="a .nnefdir file naming a folder", suffixes=(".nnefdir",),
                  load=lambda p: nnef_kv.load(Path(p).read_text().strip()))
    assert detect(link) is None
    monkeypatch.setitem(FRONTENDS, "link", fe)
    assert detect(link) is fe
    model, report = convert(link, scheme="tract")
    assert report.attentions and "a .nnefdir file naming a folder" in accepted()
    monkeypatch.undo()
    assert "link" not in FRONTENDS
