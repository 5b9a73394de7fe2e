"""Nothing lost: every writer goes through a temporary file in the target folder and a rename, so a failure
(an OSError such as a full disk, or KeyboardInterrupt) in the middle of a write leaves the previous file
untouched (or no file at all) and no temporary behind.

The failure is injected mid-write: the file objects of :mod:`nnef_kv.atomic` (and the plain ``open`` used inside
an atomic folder) are wrapped so that ``write`` raises once half of the bytes the writer produces went through.
A control run without failure measures that size first, so the trip point is always strictly inside the write.
"""
from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

import nnef_kv
import nnef_kv.atomic as atomic_mod
import nnef_kv.io.container as container_mod

from conftest import CONFORMANCE, FIXTURES

GRAPH = """version 1.0;

graph g(x) -> (y)
{
  x = external<scalar>(shape = [4, 256]);
  w = variable<scalar>(label = "w", shape = [4, 256]);
  y = add(x, w);
}
"""
KV_CASE = CONFORMANCE / "tract-python-written" / "tiny-llama-gqa-kv-f32"


class Tripped(Exception):
    """Marker: the injected failure was raised (used to check it was the injected one that surfaced)."""


class Wire:
    """Counts bytes written through every wrapped file; raises ``exc`` once more than ``after`` went through."""

    def __init__(self, after: int | None = None, exc: BaseException | None = None) -> None:
        self.after, self.exc = after, exc
        self.written = 0
        self.tripped = False

    def write(self, f: Any, data: Any) -> int:
        n = memoryview(data).nbytes
        if self.after is not None and self.written + n > self.after:
            keep = self.after - self.written
            if keep > 0:
                f.write(memoryview(data).cast("B")[:keep])  # a partial write really reaches the disk
            self.written = self.after
            self.tripped = True
            assert self.exc is not None
            raise self.exc
        self.written += n
        return f.write(data)


class WiredFile:
    """A file object whose writes go through a :class:`Wire`."""

    def __init__(self, f: Any, wire: Wire) -> None:
        self._f, self._wire = f, wire

    def write(self, data: Any) -> int:
        return self._wire.write(self._f, data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __enter__(self) -> "WiredFile":
        self._f.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._f.__exit__(*exc)

    def __iter__(self) -> Any:
        return iter(self._f)


class _OsProxy:
    """``os`` for nnef_kv.atomic, with ``fdopen`` wrapped."""

    def __init__(self, wire: Wire) -> None:
        self._wire = wire

    def fdopen(self, fd: int, *args: Any, **kw: Any) -> WiredFile:
        return WiredFile(os.fdopen(fd, *args, **kw), self._wire)

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)


def install(monkeypatch: pytest.MonkeyPatch, wire: Wire) -> None:
    """Route the writes of atomic_write (files) and of write_container inside atomic_dir (folders) through ``wire``."""
    import builtins

    monkeypatch.setattr(atomic_mod, "os", _OsProxy(wire))

    def wired_open(file: Any, mode: str = "r", *args: Any, **kw: Any) -> Any:
        f = builtins.open(file, mode, *args, **kw)
        return WiredFile(f, wire) if any(c in mode for c in "wax+") else f

    monkeypatch.setattr(container_mod, "open", wired_open, raising=False)


def snapshot(folder: Path) -> dict[str, str]:
    """relative path -> sha256 of every file (and '<dir>' for folders) under ``folder``, hidden ones included."""
    out: dict[str, str] = {}
    for p in sorted(folder.rglob("*")):
        rel = str(p.relative_to(folder))
        out[rel] = "<dir>" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


# ------------------------------------------------------------------------------------------------
# the writers: name -> (prepare() -> write(target)), target name
# ------------------------------------------------------------------------------------------------
def _model() -> nnef_kv.Model:
    rng = np.random.default_rng(0)
    return nnef_kv.Model.from_text(GRAPH, {"w": rng.standard_normal((4, 256)).astype(np.float32)})


def _other_model() -> nnef_kv.Model:
    return nnef_kv.Model.from_text(GRAPH, {"w": np.ones((4, 256), np.float32)})


def writer_save(suffix: str) -> tuple[Callable[[Path], Any], Callable[[Path], Any], str]:
    return (lambda t: nnef_kv.save(_model(), t)), (lambda t: nnef_kv.save(_other_model(), t)), f"model{suffix}"


def writer_write_tensor() -> tuple[Callable[[Path], Any], Callable[[Path], Any], str]:
    big = np.arange(64 * 1024, dtype=np.float32)
    return (lambda t: nnef_kv.write_tensor(t, big)), (lambda t: nnef_kv.write_tensor(t, -big)), "w.dat"


def writer_convert() -> tuple[Callable[[Path], Any], Callable[[Path], Any], str]:
    pytest.importorskip("nnef_kv.converters")
    from nnef_kv.converters import convert_file

    src = FIXTURES / "gpt2" / "model.nnef.tgz"
    if not src.is_file():
        pytest.skip(f"fixture not found: {src}")
    return ((lambda t: convert_file(src, t, scheme="kivi", bits=8)),
            (lambda t: convert_file(src, t, scheme="kivi", bits=4)), "converted.nnef.tgz")


def _kv_session(steps: int) -> Any:
    if not KV_CASE.is_dir():
        pytest.skip(f"conformance case not found: {KV_CASE}")
    model = nnef_kv.load(KV_CASE)
    session = model.session()
    for k in range(steps):
        session.run({"input_0": np.array([[k + 1]], dtype=np.int64)})
    return session


def writer_save_state() -> tuple[Callable[[Path], Any], Callable[[Path], Any], str]:
    s3, s1 = _kv_session(3), _kv_session(1)
    if not hasattr(s3, "save_state"):
        pytest.skip("Session.save_state is not there yet")
    return (lambda t: s3.save_state(t)), (lambda t: s1.save_state(t)), "state.tar"


def writer_report(which: str) -> tuple[Callable[[Path], Any], Callable[[Path], Any], str]:
    try:
        from nnef_kv.validate import ValidateOptions, ValidationReport, write_report
    except ImportError as e:  # pragma: no cover - the validate package lands during the session
        pytest.skip(f"nnef_kv.validate.write_report is not there yet ({e})")
    new = ValidationReport(archive="new.nnef.tgz", reference=None, options=ValidateOptions(eval_tokens=8),
                           notes=["new " * 500])
    old = ValidationReport(
        archive="old.nnef.tgz", reference=None, options=ValidateOptions(eval_tokens=4), notes=["old"]
    )
    # the report is a folder of three files; the target checked is one of them
    return (lambda t: write_report(new, t.parent)), (lambda t: write_report(old, t.parent)), which


def writer_cli_run_output() -> tuple[Callable[[Path], Any], Callable[[Path], Any], str]:
    """``nnef-kv run ARCHIVE --inputs x.npz -o out.npz`` (the CLI's output writer)."""
    import tempfile

    try:
        from nnef_kv.cli import main
    except ImportError as e:  # pragma: no cover
        pytest.skip(f"nnef_kv.cli is not there yet ({e})")
    src = Path(tempfile.mkdtemp(prefix="nnef-kv-nl-"))
    nnef_kv.save(_model(), src / "m.nnef.tar")
    rng = np.random.default_rng(1)
    np.savez(src / "x.npz", x=rng.standard_normal((4, 256)).astype(np.float32))
    np.savez(src / "x2.npz", x=np.zeros((4, 256), np.float32))

    def run(inputs: str) -> Callable[[Path], Any]:
        def go(t: Path) -> None:
            import contextlib
            import io

            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                rc = main(["run", str(src / "m.nnef.tar"), "--inputs", str(src / inputs), "-o", str(t)])
            if rc == 130:  # the CLI turns KeyboardInterrupt into exit status 130
                raise KeyboardInterrupt
            if rc == 2 and "(injected)" in err.getvalue():  # the CLI's one error line for the injected OSError
                line = err.getvalue().strip()
                assert "\n" not in line and f"-o {t}" not in line and str(t) in line and ".tmp" not in line, line
                raise OSError(errno.ENOSPC, line)
            assert rc == 0, err.getvalue()

        return go

    return run("x.npz"), run("x2.npz"), "out.npz"


WRITERS: dict[str, Callable[[], tuple[Callable[[Path], Any], Callable[[Path], Any], str]]] = {
    "save-tar": lambda: writer_save(".nnef.tar"),
    "save-tgz": lambda: writer_save(".nnef.tgz"),
    "save-folder": lambda: writer_save(""),  # a folder: a name without a suffix ("model.nnef" is refused now)
    "write_tensor": writer_write_tensor,
    "convert_file": writer_convert,
    "save_state": writer_save_state,
    "report.json": lambda: writer_report("report.json"),
    "report.md": lambda: writer_report("report.md"),
    "report.png": lambda: writer_report("report.png"),
    "cli-run-output": writer_cli_run_output,
}
SLOW = {"convert_file"}


def _bytes_of_target(folder: Path, name: str) -> int:
    p = folder / name
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size


def _trip_point(tmp_path: Path, write: Callable[[Path], Any], name: str,
                monkeypatch: pytest.MonkeyPatch) -> int:
    """Bytes the writer pushes through the wire for ``name`` when nothing fails; we trip at half of that."""
    folder = tmp_path / "control"
    folder.mkdir()
    wire = Wire()
    with monkeypatch.context() as m:
        install(m, wire)
        write(folder / name)
    assert (folder / name).exists()
    assert wire.written >= _bytes_of_target(folder, name) > 0
    # for the report the wire sees all three files: trip inside the one under test
    if name.startswith("report."):
        before = 0
        for other in ("report.json", "report.md", "report.png"):
            if other == name:
                return before + _bytes_of_target(folder, name) // 2
            before += _bytes_of_target(folder, other)
    return wire.written // 2


@pytest.mark.parametrize("exc_kind", ["oserror", "keyboardinterrupt"])
@pytest.mark.parametrize("previous", [False, True], ids=["fresh", "over-previous"])
@pytest.mark.parametrize("writer", list(WRITERS))
def test_failed_write_loses_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str, previous: bool,
                                    exc_kind: str) -> None:
    write, write_previous, name = WRITERS[writer]()
    after = _trip_point(tmp_path, write, name, monkeypatch)
    folder = tmp_path / "out"
    folder.mkdir()
    if previous:
        write_previous(folder / name)
    before = snapshot(folder)
    exc: BaseException = (OSError(errno.ENOSPC, "No space left on device (injected)") if exc_kind == "oserror"
                          else KeyboardInterrupt())
    wire = Wire(after=after, exc=exc)
    with monkeypatch.context() as m:
        install(m, wire)
        with pytest.raises(type(exc)) as info:
            write(folder / name)
    assert wire.tripped, "the injected failure never fired: the writer bypassed the atomic path"
    assert info.value is exc or isinstance(info.value, KeyboardInterrupt) or "injected" in str(info.value), info.value
    after_snapshot = snapshot(folder)
    if name.startswith("report."):  # files written before the failing one are complete new files; the rest stay
        order = ["report.json", "report.md", "report.png"]
        for other in order[order.index(name):]:
            assert after_snapshot.get(other) == before.get(other), other
        assert {k for k in after_snapshot if k.startswith(".")} == set(), after_snapshot
    else:
        assert after_snapshot == before, (before, after_snapshot)
    leftovers = [p.name for p in folder.iterdir() if p.name.startswith(".")]
    assert not leftovers, f"temporaries left behind: {leftovers}"
    if previous and name.endswith((".tar", ".tgz", ".nnef")) and not name.startswith("state"):
        nnef_kv.load(folder / name)  # the previous archive is still whole


@pytest.mark.parametrize("writer", ["save-tar", "write_tensor", "save_state"])
def test_successful_write_replaces_and_cleans(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer: str) -> None:
    """The control: with the wire installed but no failure, the writers replace the target and leave no temporary."""
    write, write_previous, name = WRITERS[writer]()
    write_previous(tmp_path / name)
    old = snapshot(tmp_path)
    wire = Wire()
    with monkeypatch.context() as m:
        install(m, wire)
        write(tmp_path / name)
    assert wire.written > 0
    assert snapshot(tmp_path) != old
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_failed_state_save_keeps_session_usable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A state save interrupted mid-write does not disturb the session: it still saves and runs on."""
    session = _kv_session(2)
    if not hasattr(session, "save_state"):
        pytest.skip("Session.save_state is not there yet")
    target = tmp_path / "state.tar"
    with monkeypatch.context() as m:
        install(m, Wire(after=100, exc=OSError(errno.EIO, "I/O error (injected)")))
        with pytest.raises(OSError, match="injected"):
            session.save_state(target)
    assert not target.exists()
    session.save_state(target)
    fresh = _kv_session(0)
    fresh.load_state(target)
    x = {"input_0": np.array([[7]], dtype=np.int64)}
    np.testing.assert_array_equal(session.run(x)["output_0"], fresh.run(x)["output_0"])
