"""The Python API under a careless or hostile caller (issue 13, items 2, 3 and 15): one table.

Each case calls the API with a wrong kind of argument or a target it must not write, and checks: the exception
is an ``NnefKvError`` or a ``TypeError`` (``ArgumentError`` is both), its message says what was expected, names
the path or value at fault, is one line and at most 300 characters beyond the paths it names; and nothing changed
at the targets (tests/cli_world.py's invariants: special files, links, the precious folder, no temporary left)."""
from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pytest

import nnef_kv
from cli_world import NO_CHAR_DEVICE, World, snapshot, without_paths

MAX_MESSAGE = 300


@dataclass(frozen=True)
class ApiCase:
    id: str
    call: Callable[[World, Any], Any]  # (world, fixtures) -> result
    error: type  # expected exception class
    needle: str
    what: str
    root: bool = False


def _m(w: World) -> nnef_kv.Model:
    return nnef_kv.load(w.ins / "plain.nnef.tar")


def _session(w: World) -> Any:
    return nnef_kv.load(w.ins / "dyn.nnef.tar").session()


CASES = [
    ApiCase("load-bytes-content", lambda w, _: nnef_kv.load((w.ins / "f32.nnef.tar").read_bytes()), TypeError,
            "nnef_kv.load: expected the path of a model folder, .tar or .tgz (str, bytes or os.PathLike), got bytes "
            "(", "load(archive bytes)"),
    ApiCase("load-file-object", lambda w, _: nnef_kv.load(open(w.ins / "f32.nnef.tar", "rb")), TypeError,
            "got a file object (BufferedReader", "load(open file)"),
    ApiCase("load-none", lambda w, _: nnef_kv.load(None), TypeError, "got None", "load(None)"),
    ApiCase("load-int", lambda w, _: nnef_kv.load(12), TypeError, "got int 12", "load(12)"),
    ApiCase("load-limits-str", lambda w, _: nnef_kv.load(w.ins / "f32.nnef.tar", limits="big"), TypeError,
            "limits must be an nnef_kv.Limits, got str 'big'", "load(path, limits='big')"),
    ApiCase("load-fifo", lambda w, _: nnef_kv.load(w.ins / "fifo"), nnef_kv.ArchiveError,
            "fifo: a FIFO (named pipe), not a model folder", "load(FIFO)"),
    ApiCase("load-chr", lambda w, _: nnef_kv.load(w.ins / "chr"), nnef_kv.ArchiveError,
            "chr: a character device, not a model folder", "load(character device)", root=True),
    ApiCase("load-dat", lambda w, _: nnef_kv.load(w.ins / "w.dat"), nnef_kv.ArchiveError,
            "w.dat: not an NNEF model archive: an NNEF tensor file", "load(x.dat)"),
    ApiCase("load-onnx", lambda w, _: nnef_kv.load(w.ins / "m.onnx"), nnef_kv.ArchiveError,
            "m.onnx: not an NNEF model archive: an ONNX model; convert it first", "load(x.onnx)"),
    ApiCase("save-non-model-folder", lambda w, _: nnef_kv.save(_m(w), w.out / "precious"), nnef_kv.OutputError,
            "precious: a folder that is not a model (no graph.nnef) and not empty: refusing to replace it",
            "save(m, 'precious') over a folder of other files"),
    ApiCase("save-over-file", lambda w, _: nnef_kv.save(_m(w), w.out / "file_parent"), nnef_kv.OutputError,
            "file_parent: is a file; a model folder must be a folder", "save(m, 'notes') over a regular file"),
    ApiCase("save-onnx", lambda w, _: nnef_kv.save(_m(w), w.out / "x.onnx"), nnef_kv.OutputError,
            "x.onnx: cannot write a model as '.onnx': name a .tar, .tgz or .tar.gz file, or a folder",
            "save(m, 'x.onnx')"),
    ApiCase("save-zip", lambda w, _: nnef_kv.save(_m(w), w.out / "ok.zip"), nnef_kv.OutputError,
            "cannot write a model as '.zip'", "save(m, 'ok.zip')"),
    ApiCase("save-fifo", lambda w, _: nnef_kv.save(_m(w), w.out / "link_fifo.tgz"), nnef_kv.OutputError,
            "link_fifo.tgz: is a FIFO (named pipe) (the symbolic link points to", "save(m, link to a FIFO)"),
    ApiCase("save-chr", lambda w, _: nnef_kv.save(_m(w), w.out / "chr"), nnef_kv.OutputError,
            "chr: is a character device", "save(m, character device)", root=True),
    ApiCase("save-not-a-model", lambda w, _: nnef_kv.save("model", w.out / "m.tgz"), TypeError,
            "nnef_kv.save: expected an nnef_kv.Model to save, got str 'model'", "save('model', path)"),
    ApiCase("save-file-object", lambda w, _: nnef_kv.save(_m(w), io.BytesIO()), TypeError,
            "nnef_kv.save: expected the path to write (a folder, .tar, .tgz or .tar.gz) (str, bytes or os.PathLike), "
            "got a file object (BytesIO)", "save(m, BytesIO())"),
    ApiCase("run-list", lambda w, _: _session(w).run([np.array([[1]])]), TypeError,
            "session.run: inputs must be a dict of input name -> array (the graph's inputs: input_ids), got list of "
            "1 items", "session.run([array])"),
    ApiCase("run-none", lambda w, _: _session(w).run(None), TypeError, "inputs must be a dict of input name -> "
            "array (the graph's inputs: input_ids), got None", "session.run(None)"),
    ApiCase("run-array", lambda w, _: _session(w).run(np.zeros((1, 2), np.int64)), TypeError,
            "inputs must be a dict", "session.run(array)"),
    ApiCase("run-string", lambda w, _: _session(w).run({"input_ids": "1 2 3"}), nnef_kv.InputError,
            "input 'input_ids': cannot convert str '1 2 3' to int64", "session.run({'input_ids': '1 2 3'})"),
    ApiCase("run-long-key", lambda w, _: _session(w).run({"x" * 10000: 1}), nnef_kv.InputError,
            "unknown input 'xxxxxxxx", "session.run({10,000-char name: 1})"),
    ApiCase("save-state-fifo", lambda w, _: _session(w).save_state(w.out / "fifo"), nnef_kv.OutputError,
            "fifo: is a FIFO (named pipe)", "session.save_state(FIFO)"),
    ApiCase("save-state-none", lambda w, _: _session(w).save_state(None), TypeError,
            "session.save_state: expected the path of the state file to write", "session.save_state(None)"),
    ApiCase("load-state-fifo", lambda w, _: _session(w).load_state(w.ins / "fifo"), nnef_kv.StateError,
            "fifo: is a FIFO (named pipe): not a saved session state", "session.load_state(FIFO)"),
    ApiCase("load-state-junk", lambda w, _: _session(w).load_state(w.ins / "junk.tgz"), nnef_kv.StateError,
            "junk.tgz: not a saved session state", "session.load_state(junk)"),
    ApiCase("read-tensor-fifo", lambda w, _: nnef_kv.read_tensor(w.ins / "fifo"), nnef_kv.TensorFileError,
            "fifo: is a FIFO (named pipe), not a .dat file", "read_tensor(FIFO)"),
    ApiCase("read-tensor-none", lambda w, _: nnef_kv.read_tensor(None), TypeError,
            "nnef_kv.read_tensor: expected the path of a .dat file or a binary file object", "read_tensor(None)"),
    ApiCase("write-tensor-fifo", lambda w, _: nnef_kv.write_tensor(w.out / "fifo", np.zeros(2)), nnef_kv.OutputError,
            "fifo: is a FIFO (named pipe)", "write_tensor(FIFO, array)"),
    ApiCase("write-tensor-int", lambda w, _: nnef_kv.write_tensor(7, np.zeros(2)), TypeError,
            "nnef_kv.write_tensor: expected the path of the .dat file to write or a binary file object",
            "write_tensor(7, array)"),
    ApiCase("parse-bytes", lambda w, _: nnef_kv.parse(b"version 1.0;"), TypeError,
            "parse() takes str (decode UTF-8 first), not bytes", "parse(bytes)"),
    ApiCase("convert-int", lambda w, _: __import__("nnef_kv.converters").converters.convert(12),
            nnef_kv.ConversionError, "convert: expected a Model or a path, got int", "converters.convert(12)"),
    ApiCase("validate-int", lambda w, _: nnef_kv.validate(12), nnef_kv.InputError,
            "archive: expected an archive path or an nnef_kv.Model, got int", "validate(12)"),
]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    return World.make(tmp_path_factory.mktemp("hostile-api"))


def check_api_case(world: World, case: ApiCase) -> str:
    """Run ``case`` and check it; returns the error line (``Type: message``)."""
    world.reset_out()
    before = snapshot(world.out)
    with pytest.raises((nnef_kv.NnefKvError, TypeError)) as info:
        case.call(world, None)
    e = info.value
    msg = str(e)
    assert isinstance(e, case.error), (type(e), msg)
    assert case.needle in msg, msg
    assert "\n" not in msg and len(without_paths(msg, world)) <= MAX_MESSAGE, msg
    assert world.damage() == []
    assert snapshot(world.out) == before
    return f"{type(e).__name__}: {msg}"


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_api_case(world: World, case: ApiCase) -> None:
    if case.root and not world.has_char:
        pytest.skip(NO_CHAR_DEVICE)
    check_api_case(world, case)


def test_bytes_path_and_writes_through_links(world) -> None:
    """A bytes path is a path; a link to a regular file is written through (the link stays a link)."""
    import os

    m = nnef_kv.load(os.fsencode(world.ins / "plain.nnef.tar"))
    assert m.document.graph is not None
    world.reset_out()
    nnef_kv.save(m, world.out / "link_file.tgz")
    assert (world.out / "link_file.tgz").is_symlink() and nnef_kv.load(world.out / "existing.tgz").tensors == {}
    nnef_kv.save(m, world.out / "model")  # an existing model folder is replaced
    nnef_kv.save(m, world.out / "empty_dir")  # and so is an empty folder
    assert (world.out / "empty_dir" / "graph.nnef").is_file()
    assert world.damage() == []
