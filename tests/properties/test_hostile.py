"""Hostile inputs, one test each: every one is refused with a clear one-line nnef-kv error, within bounded
time and memory, and nothing is written anywhere.

Cases that could eat the machine if a protection regressed (gzip bombs, 10^9-item comprehensions, huge
constants, huge integer powers) run in a child process with an address-space cap (``RLIMIT_AS``) and a
timeout (:func:`run_capped`), so a regression fails the test instead of swapping the host to death.
Peak memory of in-process cases is measured with ``tracemalloc``; time bounds are generous sanity bounds.
"""
from __future__ import annotations

import gzip
import io
import os
import resource
import subprocess
import sys
import tarfile
import textwrap
import time
import tracemalloc
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

import nnef_kv
from nnef_kv.errors import ArchiveError, GraphError, LimitError, NnefKvError, NnefSyntaxError, TensorFileError
from nnef_kv.tensors.dat import encode_tensor
from nnef_kv.limits import Limits

MiB = 1 << 20
GiB = 1 << 30

GRAPH = b"""version 1.0;

graph g(x) -> (y)
{
  x = external<scalar>(shape = [2]);
  w = variable<scalar>(label = "w", shape = [2]);
  y = add(x, w);
}
"""
W_DAT = encode_tensor(np.array([1.0, 2.0], dtype=np.float32))


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
def reg(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    ti = tarfile.TarInfo(name)
    ti.size = len(data)
    return ti, data


def special(name: str, kind: bytes, linkname: str = "") -> tuple[tarfile.TarInfo, None]:
    ti = tarfile.TarInfo(name)
    ti.type = kind
    ti.linkname = linkname
    if kind in (tarfile.CHRTYPE, tarfile.BLKTYPE):
        ti.devmajor, ti.devminor = 1, 3
    return ti, None


def write_tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]], gz: bool = False) -> Path:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
        for ti, data in members:
            tf.addfile(ti, io.BytesIO(data) if data else None)
    raw = buf.getvalue()
    path.write_bytes(gzip.compress(raw, mtime=0) if gz else raw)
    return path


def base_members() -> list[tuple[tarfile.TarInfo, bytes | None]]:
    return [reg("graph.nnef", GRAPH), reg("w.dat", W_DAT)]


class Measured:
    """Result of :func:`measure`: the exception raised, seconds taken, peak traced bytes."""

    def __init__(self, exc: BaseException | None, seconds: float, peak: int) -> None:
        self.exc, self.seconds, self.peak = exc, seconds, peak


def measure(fn: Callable[[], Any]) -> Measured:
    """Run ``fn`` under tracemalloc; the nnef-kv error it raises (anything else propagates)."""
    tracemalloc.start()
    t0 = time.perf_counter()
    exc: BaseException | None = None
    try:
        fn()
    except NnefKvError as e:
        exc = e
    finally:
        seconds = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return Measured(exc, seconds, peak)


def refused(fn: Callable[[], Any], kind: type[NnefKvError], pattern: str, *, seconds: float = 10.0,
            peak: int = 64 * MiB) -> NnefKvError:
    """``fn`` raises ``kind`` with a one-line message containing ``pattern``, in bounded time and memory."""
    m = measure(fn)
    assert m.exc is not None, "accepted, expected a refusal"
    assert isinstance(m.exc, kind), f"{type(m.exc).__name__}: {m.exc}"
    msg = str(m.exc)
    assert pattern in msg, msg
    assert "\n" not in msg, f"not one line: {msg!r}"
    assert m.seconds < seconds, f"took {m.seconds:.1f} s"
    assert m.peak < peak, f"peak {m.peak / MiB:.1f} MiB"
    return m.exc


def run_capped(code: str, *, mem: int = 1536 * MiB, timeout: float = 60.0) -> tuple[str, float]:
    """Run ``code`` in a child Python with RLIMIT_AS=``mem``; returns (last stdout line, seconds).

    The code must print one line ``ErrorType: message`` (see :data:`CHILD_PRELUDE`). A timeout gives
    ``"TIMEOUT"``, a crash ``"CRASH rc=..: <stderr tail>"``.
    """

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))

    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", CHILD_PRELUDE + textwrap.dedent(code)], capture_output=True,
                              text=True, timeout=timeout, preexec_fn=cap,
                              env={**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired:
        return "TIMEOUT", time.perf_counter() - t0
    seconds = time.perf_counter() - t0
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return f"CRASH rc={proc.returncode}: {proc.stderr.strip()[-300:]}", seconds
    return lines[-1], seconds


CHILD_PRELUDE = """
import sys, nnef_kv
from nnef_kv.limits import Limits
from nnef_kv.io.archive import Model
def outcome(fn):
    try:
        fn()
        print("OK")
    except nnef_kv.NnefKvError as e:
        print(f"{type(e).__name__}: {e}")
    except BaseException as e:
        print(f"FOREIGN {type(e).__name__}: {e}")
def session_of(text):
    return Model(nnef_kv.parse(text, filename="hostile.nnef")).session()
"""


def graph_text(body: str, fragments: str = "", outputs: str = "y") -> str:
    return (f"version 1.0;\n{fragments}\ngraph g(x) -> ({outputs})\n{{\n  x = external<scalar>(shape = [2]);\n"
            f"{body}\n}}\n")


def session_of(text: str) -> Any:
    from nnef_kv.io.archive import Model

    return Model(nnef_kv.parse(text, filename="hostile.nnef")).session()


# ------------------------------------------------------------------------------------------------
# archives: unsafe members
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("gz", [False, True], ids=["tar", "tgz"])
def test_absolute_path_member(tmp_path: Path, gz: bool) -> None:
    p = write_tar(tmp_path / "m.tar", base_members() + [reg("/etc/evil.dat", W_DAT)], gz)
    refused(lambda: nnef_kv.load(p), ArchiveError, "member '/etc/evil.dat' has an absolute path")


@pytest.mark.parametrize("gz", [False, True], ids=["tar", "tgz"])
@pytest.mark.parametrize("name", ["../evil.dat", "a/../../evil.dat"])
def test_dotdot_member(tmp_path: Path, gz: bool, name: str) -> None:
    p = write_tar(tmp_path / "m.tar", base_members() + [reg(name, W_DAT)], gz)
    refused(lambda: nnef_kv.load(p), ArchiveError, f"member {name!r} escapes the archive ('..')")
    assert not (tmp_path.parent / "evil.dat").exists()


@pytest.mark.parametrize("gz", [False, True], ids=["tar", "tgz"])
def test_symlink_member(tmp_path: Path, gz: bool) -> None:
    p = write_tar(tmp_path / "m.tar", base_members() + [special("x.dat", tarfile.SYMTYPE, "/etc/passwd")], gz)
    refused(lambda: nnef_kv.load(p), ArchiveError, "member 'x.dat' is a symbolic link")


def test_symlink_in_folder(tmp_path: Path) -> None:
    d = tmp_path / "model"
    d.mkdir()
    (d / "graph.nnef").write_bytes(GRAPH)
    (d / "w.dat").symlink_to("/etc/passwd")  # followed (a regular file), read as a .dat: refused as one
    refused(lambda: nnef_kv.load(d), nnef_kv.NnefKvError, "w.dat: not an NNEF tensor file")
    (d / "w.dat").unlink()
    (d / "w.dat").symlink_to(tmp_path)
    refused(lambda: nnef_kv.load(d), ArchiveError, "member 'w.dat' is a symbolic link to a folder")


@pytest.mark.parametrize("gz", [False, True], ids=["tar", "tgz"])
def test_hard_link_member(tmp_path: Path, gz: bool) -> None:
    p = write_tar(tmp_path / "m.tar", base_members() + [special("x.dat", tarfile.LNKTYPE, "graph.nnef")], gz)
    refused(lambda: nnef_kv.load(p), ArchiveError, "member 'x.dat' is a hard link")


@pytest.mark.parametrize("kind", [tarfile.CHRTYPE, tarfile.BLKTYPE], ids=["char", "block"])
def test_device_member(tmp_path: Path, kind: bytes) -> None:
    p = write_tar(tmp_path / "m.tar", base_members() + [special("null", kind)])
    refused(lambda: nnef_kv.load(p), ArchiveError, "member 'null' is a device")


def test_fifo_member(tmp_path: Path) -> None:
    p = write_tar(tmp_path / "m.tar", base_members() + [special("pipe", tarfile.FIFOTYPE)])
    refused(lambda: nnef_kv.load(p), ArchiveError, "member 'pipe' is a FIFO")


def test_fifo_in_folder(tmp_path: Path) -> None:
    """A FIFO in a model folder is refused without opening it (opening would block forever)."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "graph.nnef").write_bytes(GRAPH)
    os.mkfifo(d / "w.dat")
    refused(lambda: nnef_kv.load(d), ArchiveError, "member 'w.dat' is not a regular file", seconds=5)


@pytest.mark.parametrize("second", ["graph.nnef", "./graph.nnef", "a/../graph.nnef"])
def test_duplicate_member(tmp_path: Path, second: str) -> None:
    p = write_tar(tmp_path / "m.tar", base_members() + [reg(second, b"version 1.0;\ngraph h() -> () {}\n")])
    if ".." in second:
        refused(lambda: nnef_kv.load(p), ArchiveError, "escapes the archive")
    else:
        refused(lambda: nnef_kv.load(p), ArchiveError, "duplicate member 'graph.nnef'")


def test_loading_writes_nothing(tmp_path: Path) -> None:
    """Loading (even a hostile archive) never extracts: the folder holds exactly what it held."""
    p = write_tar(tmp_path / "m.tar", base_members() + [reg("sub/x.json", b"{}")])
    before = sorted(tmp_path.rglob("*"))
    model = nnef_kv.load(p)
    model.session().run({"x": np.zeros(2, np.float32)})
    assert sorted(tmp_path.rglob("*")) == before


def test_save_refuses_escaping_member_names(tmp_path: Path) -> None:
    """A resource named '../x' (built in code) is refused before anything is written anywhere."""
    model = nnef_kv.load(write_tar(tmp_path / "m.tar", base_members()))
    model.resources["../../escaped.txt"] = b"x"
    out = tmp_path / "out" / "saved.tar"
    refused(lambda: nnef_kv.save(model, out), ArchiveError, "cannot store member '../../escaped.txt'")
    assert not (tmp_path / "escaped.txt").exists() and not out.exists()


# ------------------------------------------------------------------------------------------------
# archives: sizes (refused from the header, gzip bombs)
# ------------------------------------------------------------------------------------------------
def _huge_member_archive(tmp_path: Path, name: str, gz: bool) -> Path:
    """A tar whose header claims 100 GB for ``name`` -- and holds no data at all."""
    ti = tarfile.TarInfo(name)
    ti.size = 100 * 10**9
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
        g, data = reg("graph.nnef", GRAPH)
        tf.addfile(g, io.BytesIO(data))
        tf.addfile(ti)  # header only
    raw = buf.getvalue()
    p = tmp_path / ("huge.tgz" if gz else "huge.tar")
    p.write_bytes(gzip.compress(raw) if gz else raw)
    assert p.stat().st_size < 64 * 1024
    return p


@pytest.mark.parametrize("gz", [False, True], ids=["tar", "tgz"])
@pytest.mark.parametrize("name,pattern", [
    ("big.dat", "big.dat is 100000000000 bytes, over max_tensor_bytes="),
    ("big.bin", "max_archive_bytes="),
    ("graph.quant", "graph.quant is 100000000000 bytes, over max_text_bytes="),
])
def test_member_claiming_100_GB(tmp_path: Path, gz: bool, name: str, pattern: str) -> None:
    p = _huge_member_archive(tmp_path, name, gz)
    refused(lambda: nnef_kv.load(p), LimitError, pattern, seconds=5, peak=8 * MiB)


def _bomb(path: Path, members: int, member_bytes: int) -> Path:
    """A .tgz of ``members`` members of zeros: tiny on disk, ``members * member_bytes`` inflated."""

    class Zeros(io.RawIOBase):
        def __init__(self, n: int) -> None:
            self.n = n

        def readable(self) -> bool:
            return True

        def readinto(self, b: Any) -> int:
            k = min(len(b), self.n)
            b[:k] = bytes(k)
            self.n -= k
            return k

    with gzip.GzipFile(path, "wb", compresslevel=9, mtime=0) as gz:
        with tarfile.open(fileobj=gz, mode="w", format=tarfile.GNU_FORMAT) as tf:
            g, data = reg("graph.nnef", GRAPH)
            tf.addfile(g, io.BytesIO(data))
            for i in range(members):
                ti = tarfile.TarInfo(f"zeros{i}.bin")
                ti.size = member_bytes
                tf.addfile(ti, io.BufferedReader(Zeros(member_bytes), 1 << 20))
    return path


def test_gzip_bomb_single_member(tmp_path: Path) -> None:
    """256 MiB of zeros in one member of a ~250 KB .tgz: refused from the member header, nothing inflated."""
    p = _bomb(tmp_path / "bomb.tgz", 1, 256 * MiB)
    assert p.stat().st_size < 1 * MiB
    refused(lambda: nnef_kv.load(p, limits=Limits(max_archive_bytes=32 * MiB)), LimitError,
            "claims 268435456 bytes, more than max_archive_bytes=33554432", seconds=10, peak=8 * MiB)


def test_gzip_bomb_many_members(tmp_path: Path) -> None:
    """64 members of 8 MiB (512 MiB inflated): stops at the limit; peak memory stays near the limit."""
    p = _bomb(tmp_path / "bomb.tgz", 64, 8 * MiB)
    assert p.stat().st_size < 1 * MiB
    refused(lambda: nnef_kv.load(p, limits=Limits(max_archive_bytes=32 * MiB)), LimitError,
            "max_archive_bytes=33554432", seconds=20, peak=48 * MiB)


def test_gzip_bomb_default_limits_child(tmp_path: Path) -> None:
    """With the default limits, a .tgz whose members claim 20 GiB in all (on disk: a few KB) is refused
    before inflating (a child process capped at 1.5 GiB of address space would die otherwise)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
        g, data = reg("graph.nnef", GRAPH)
        tf.addfile(g, io.BytesIO(data))
        ti = tarfile.TarInfo("weights.bin")
        ti.size = 20 * GiB
        tf.addfile(ti)
    p = tmp_path / "claims.tgz"
    p.write_bytes(gzip.compress(buf.getvalue()))
    line, seconds = run_capped(f"outcome(lambda: nnef_kv.load({str(p)!r}))", timeout=60)
    assert line.startswith("LimitError: ") and "max_archive_bytes=17179869184" in line, line
    assert seconds < 30


@pytest.mark.parametrize("kind", ["tar", "dir"])
def test_too_many_members(tmp_path: Path, kind: str) -> None:
    members = base_members() + [reg(f"r{i}.json", b"{}") for i in range(40)]
    if kind == "tar":
        p = write_tar(tmp_path / "m.tar", members)
    else:
        p = tmp_path / "model"
        p.mkdir()
        for ti, data in members:
            (p / ti.name).write_bytes(data or b"")
    refused(lambda: nnef_kv.load(p, limits=Limits(max_members=10)), LimitError, "more than max_members=10 members")
    assert nnef_kv.load(p, limits=Limits(max_members=100)).resources  # the same archive under a higher limit


def _limit_case(tmp_path: Path, gz: bool = False) -> tuple[Path, dict[str, int]]:
    """An archive and the exact size of everything the limits measure in it."""
    graph = GRAPH
    w = encode_tensor(np.arange(64, dtype=np.float32))
    text = graph.replace(b"shape = [2]", b"shape = [64]")
    members = [reg("graph.nnef", text), reg("w.dat", w), reg("meta.json", b"{}"), reg("notes.txt", b"x" * 100)]
    p = write_tar(tmp_path / ("m.tgz" if gz else "m.tar"), members, gz)
    sizes = {
        "max_members": len(members),
        "max_text_bytes": len(text),
        "max_tensor_bytes": len(w) - 128,
        "max_archive_bytes": sum(len(d) for _, d in members),
    }
    return p, sizes


@pytest.mark.parametrize("field", ["max_members", "max_text_bytes", "max_tensor_bytes", "max_archive_bytes"])
def test_limit_boundaries(tmp_path: Path, field: str) -> None:
    """Each limit is exact: an archive using exactly the limit loads, one byte/member less is refused."""
    p, sizes = _limit_case(tmp_path)
    at = Limits(**{field: sizes[field]})
    assert nnef_kv.load(p, limits=at).tensors["w"].shape == (64,)
    refused(lambda: nnef_kv.load(p, limits=Limits(**{field: sizes[field] - 1})), LimitError, f"{field}=")


@pytest.mark.parametrize("field", ["max_members", "max_text_bytes", "max_tensor_bytes", "max_archive_bytes"])
def test_limit_boundaries_tgz(tmp_path: Path, field: str) -> None:
    """Same for .tgz; the decompressed stream also holds tar headers and padding, so max_archive_bytes is
    checked against the inflated tar size."""
    p, sizes = _limit_case(tmp_path, gz=True)
    if field == "max_archive_bytes":
        sizes[field] = len(gzip.decompress(p.read_bytes()))
    assert nnef_kv.load(p, limits=Limits(**{field: sizes[field]})).tensors["w"].shape == (64,)
    refused(lambda: nnef_kv.load(p, limits=Limits(**{field: sizes[field] - 1})), LimitError, f"{field}=")


# ------------------------------------------------------------------------------------------------
# .dat files
# ------------------------------------------------------------------------------------------------
def dat_header(length: int, shape: list[int], bits: int = 32, item_type: int = 0, major: int = 1) -> bytes:
    import struct

    ext = list(shape) + [0] * (8 - len(shape))
    return struct.pack("<2sBBII8III", b"\x4e\xef", major, 0, length, len(shape), *ext, bits, item_type) + bytes(76)


def test_dat_dims_product_overflows() -> None:
    blob = dat_header(16, [0xFFFFFFFF] * 8)
    refused(lambda: nnef_kv.read_tensor(io.BytesIO(blob)), TensorFileError,
            "the product of dims [4294967295, 4294967295, 4294967295, 4294967295, 4294967295, 4294967295, "
            "4294967295, 4294967295] overflows")


def test_dat_empty_but_undescribable_shape() -> None:
    """Found by atheris: extents [50331650, 0, 1392508931, 65536] hold 0 items, yet numpy cannot even make
    an empty array of that shape (ValueError escaped before the fix in tensors/dat.py:_count)."""
    blob = dat_header(0, [50331650, 0, 1392508931, 65536], bits=64, item_type=3)
    refused(lambda: nnef_kv.read_tensor(io.BytesIO(blob)), TensorFileError,
            "the product of non-zero dims [50331650, 0, 1392508931, 65536] overflows")


def test_dat_size_disagrees_with_shape() -> None:
    blob = dat_header(16, [4, 4]) + bytes(16)
    refused(lambda: nnef_kv.read_tensor(io.BytesIO(blob)), TensorFileError,
            "data size 16 bytes does not match shape [4, 4] x 32 bits (64 bytes expected)")


def test_dat_truncated_payload() -> None:
    blob = dat_header(64, [4, 4]) + bytes(10)
    refused(lambda: nnef_kv.read_tensor(io.BytesIO(blob)), TensorFileError,
            "truncated file (10 payload bytes, 64 expected)")


def test_dat_claiming_4_GB_from_a_stream_reads_nothing_big() -> None:
    """A consistent header announcing 4 GB (f32 x 2^30-1) with 10 bytes behind it: no 4 GB read or buffer."""
    n = (1 << 30) - 1
    blob = dat_header(n * 4, [n]) + bytes(10)
    refused(lambda: nnef_kv.read_tensor(io.BytesIO(blob)), TensorFileError, "truncated file", peak=16 * MiB)
    refused(lambda: nnef_kv.read_tensor(io.BytesIO(blob), limits=Limits(max_tensor_bytes=MiB)), LimitError,
            "tensor payload of 4294967292 bytes exceeds max_tensor_bytes=1048576", peak=MiB)


def test_dat_over_max_tensor_bytes_in_archive(tmp_path: Path) -> None:
    big = encode_tensor(np.zeros(4096, np.float32))
    p = write_tar(tmp_path / "m.tar", [reg("graph.nnef", GRAPH), reg("w.dat", big)])
    refused(lambda: nnef_kv.load(p, limits=Limits(max_tensor_bytes=1024)), LimitError,
            "w.dat is 16512 bytes, over max_tensor_bytes=1024")


def test_dat_huge_string_count() -> None:
    """A string tensor announcing 2^32 strings with an empty payload: refused before allocating 2^32 slots."""
    blob = dat_header(0, [0x10000, 0x10000], bits=0xFFFFFFFF, item_type=0x5452_1000)
    refused(lambda: nnef_kv.read_tensor(io.BytesIO(blob)), TensorFileError,
            "4294967296 strings cannot fit in 0 payload bytes", peak=MiB)


# ------------------------------------------------------------------------------------------------
# texts and graphs
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("opening,closing", [("(", ")"), ("[", "]"), ("relu(", ")"), ("-", ""), ("!", "")])
def test_deeply_nested_expression(opening: str, closing: str) -> None:
    depth = 100_000
    text = graph_text(f"  y = {opening * depth}x{closing * depth};")
    refused(lambda: nnef_kv.parse(text, filename="deep.nnef"), NnefSyntaxError, "deep.nnef:6:", seconds=20)
    refused(lambda: nnef_kv.parse(text, filename="deep.nnef"), NnefSyntaxError, "nesting too deep", seconds=20)


def test_nesting_limit_is_enforced_and_overridable() -> None:
    text = graph_text(f"  y = {'(' * 50}x{')' * 50};")
    refused(lambda: nnef_kv.parse(text, filename="n.nnef", limits=Limits(max_nesting=20)), NnefSyntaxError,
            "nesting too deep")
    assert nnef_kv.parse(text, filename="n.nnef", limits=Limits(max_nesting=60)).graph is not None


def test_nesting_limit_through_load(tmp_path: Path) -> None:
    text = graph_text(f"  y = {'(' * 50}x{')' * 50};").encode()
    p = write_tar(tmp_path / "m.tar", [reg("graph.nnef", text)])
    refused(lambda: nnef_kv.load(p, limits=Limits(max_nesting=20)), NnefSyntaxError, "nesting too deep")
    assert nnef_kv.load(p).document.graph is not None


def test_long_flat_operator_chain() -> None:
    """``x + x + ... + x`` (20,000 terms) is left-nested 20,000 deep in the AST: refused, in bounded time."""
    text = graph_text("  y = x" + " + x" * 20_000 + ";")
    refused(lambda: nnef_kv.parse(text, filename="chain.nnef"), NnefSyntaxError, "nesting too deep", seconds=30)


def test_text_over_max_text_bytes(tmp_path: Path) -> None:
    text = GRAPH + b"# padding\n" * 2000
    p = write_tar(tmp_path / "m.tar", [reg("graph.nnef", text), reg("w.dat", W_DAT)])
    refused(lambda: nnef_kv.load(p, limits=Limits(max_text_bytes=4096)), LimitError,
            f"graph.nnef is {len(text)} bytes, over max_text_bytes=4096")


def test_undefined_identifier() -> None:
    text = graph_text("  y = relu(zz);")
    refused(lambda: session_of(text), GraphError, "undefined identifier 'zz'")


def test_output_never_assigned() -> None:
    text = graph_text("  y = relu(x);", outputs="y, z")
    refused(lambda: session_of(text), GraphError, "graph output 'z' is never assigned")


def test_cycle_through_reassignment() -> None:
    """tract-style reassignment cannot close a loop: ``a`` is read before ``y`` exists."""
    text = graph_text("  a = relu(x);\n  a = add(a, y);\n  y = a;")
    refused(lambda: session_of(text), GraphError, "undefined identifier 'y'")


def test_cycle_between_two_names() -> None:
    text = graph_text("  a = add(x, b);\n  b = add(a, x);\n  y = b;")
    refused(lambda: session_of(text), GraphError, "undefined identifier 'b'")


def test_recursive_fragment() -> None:
    frag = "fragment f(a: tensor<scalar>) -> (b: tensor<scalar>) { b = f(a); }"
    text = graph_text("  y = f(x);", fragments=frag)
    refused(lambda: session_of(text), GraphError, "fragment 'f' nests too deep (recursive?)", seconds=10)


def test_mutually_recursive_fragments() -> None:
    frags = ("fragment f(a: tensor<scalar>) -> (b: tensor<scalar>) { b = g2(a); }\n"
             "fragment g2(a: tensor<scalar>) -> (b: tensor<scalar>) { b = f(a); }")
    text = graph_text("  y = f(x);", fragments=frags)
    refused(lambda: session_of(text), GraphError, "nests too deep (recursive?)", seconds=10)


def test_comprehension_limit_is_enforced() -> None:
    """A comprehension over more items than max_comprehension_items (default 10^7) is refused up front
    (run in a capped child: the 2 * 10^7-item array it iterates over takes 160 MB)."""
    text = graph_text("  r = [for i in [0, 1] * 10000000 yield i];\n  y = x;")
    line, seconds = run_capped(f"outcome(lambda: session_of({text!r}))", timeout=60)
    assert line.startswith("LimitError: ") and "20000000" in line, line
    assert seconds < 30


def test_comprehension_over_a_billion_items() -> None:
    text = graph_text("  r = [for i in range_of([0] * 1000000000) yield i];\n  y = x;")
    line, seconds = run_capped(f"outcome(lambda: session_of({text!r}))", timeout=30)
    assert line.startswith("LimitError: ") and "1000000000" in line, line
    assert seconds < 20


def test_nested_comprehensions_are_bounded_in_total() -> None:
    body = ("  n = [for i in range_of([0] * 1000000) yield [for j in range_of([0] * 1000000) yield j]];\n"
            "  y = x;")
    line, seconds = run_capped(f"outcome(lambda: session_of({graph_text(body)!r}))", timeout=8)
    assert line.startswith("LimitError: "), line


def test_huge_integer_power() -> None:
    text = graph_text("  n = 2 ^ 1000000000000;\n  y = x;")
    line, seconds = run_capped(f"outcome(lambda: session_of({text!r}))", timeout=8)
    assert line.startswith(("GraphError: ", "LimitError: ")) and "2 ^ 1000000000000" in line, line
    assert seconds < 10


def test_huge_constant() -> None:
    text = graph_text("  c = constant<scalar>(shape = [1000000000, 1000000000], value = [0.0]);\n  y = add(x, c);")
    line, seconds = run_capped(f"outcome(lambda: session_of({text!r}))", timeout=30)
    assert line.startswith("LimitError: ") and "max_tensor_bytes" in line, line


def test_comprehension_limit_from_load(tmp_path: Path) -> None:
    text = graph_text("  r = [for i in range_of([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]) yield i];\n  y = x;")
    p = write_tar(tmp_path / "m.tar", [reg("graph.nnef", text.encode())])
    model = nnef_kv.load(p, limits=Limits(max_comprehension_items=10))
    refused(model.session, LimitError, "max_comprehension_items")
