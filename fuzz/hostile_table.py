"""Regenerate the table "What nnef-kv refuses" of docs/hardening.md from real runs.

    python fuzz/hostile_table.py > /tmp/table.md     # from the repository root; uses tests/properties/test_hostile.py helpers

Each row: the hostile input, the error message, the limit involved, seconds and peak traced memory
(tracemalloc) of the refusal. Archives are built in a temporary folder (their paths are shortened in the table).
"""
from __future__ import annotations

import io
import os
import sys
import tarfile
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests" / d)
                for d in ("", "unit", "properties", "oracle", "e2e")]  # the test helpers and the test groups

import nnef_kv  # noqa: E402
import test_hostile as H  # noqa: E402
from nnef_kv.limits import Limits  # noqa: E402

Row = tuple[str, str, str, float, int]


def case(rows: list[Row], label: str, fn: Callable[[], Any], limit: str = "—") -> None:
    """Run ``fn``, record its nnef-kv error (or "ACCEPTED?!"), seconds and peak traced bytes."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        fn()
        msg = "ACCEPTED?!"
    except nnef_kv.NnefKvError as e:
        msg = f"{type(e).__name__}: {e}"
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    rows.append((label, msg, limit, seconds, peak))


def main() -> None:
    d = Path(tempfile.mkdtemp(prefix="nnef-kv-hostile-"))
    os.chdir(d)
    rows: list[Row] = []
    P = Path(".")
    case(rows, "tar member with an absolute path `/etc/evil.dat`", lambda: nnef_kv.load(H.write_tar(P/"abs.tar", H.base_members()+[H.reg("/etc/evil.dat", H.W_DAT)])))
    case(rows, "tar member `../evil.dat`", lambda: nnef_kv.load(H.write_tar(P/"dotdot.tar", H.base_members()+[H.reg("../evil.dat", H.W_DAT)])))
    case(rows, "symbolic link member", lambda: nnef_kv.load(H.write_tar(P/"sym.tar", H.base_members()+[H.special("x.dat", tarfile.SYMTYPE, "/etc/passwd")])))
    f = P/"symdir"; f.mkdir(exist_ok=True); (f/"graph.nnef").write_bytes(H.GRAPH)
    if not (f/"w.dat").is_symlink(): (f/"w.dat").symlink_to("/etc/passwd")
    case(rows, "symbolic link in a model folder to `/etc/passwd` (followed: a regular file)", lambda: nnef_kv.load(f))
    f1 = P/"symdir2"; f1.mkdir(exist_ok=True); (f1/"graph.nnef").write_bytes(H.GRAPH)
    if not (f1/"w.dat").is_symlink(): (f1/"w.dat").symlink_to("/etc")
    case(rows, "symbolic link in a model folder to a folder", lambda: nnef_kv.load(f1))
    case(rows, "hard link member", lambda: nnef_kv.load(H.write_tar(P/"hard.tar", H.base_members()+[H.special("x.dat", tarfile.LNKTYPE, "graph.nnef")])))
    case(rows, "character/block device member", lambda: nnef_kv.load(H.write_tar(P/"dev.tar", H.base_members()+[H.special("null", tarfile.CHRTYPE)])))
    case(rows, "FIFO member", lambda: nnef_kv.load(H.write_tar(P/"fifo.tar", H.base_members()+[H.special("pipe", tarfile.FIFOTYPE)])))
    f2 = P/"fifodir"; f2.mkdir(exist_ok=True); (f2/"graph.nnef").write_bytes(H.GRAPH)
    if not (f2/"w.dat").exists(): os.mkfifo(f2/"w.dat")
    case(rows, "FIFO in a model folder", lambda: nnef_kv.load(f2))
    case(rows, "duplicate member (`graph.nnef` and `./graph.nnef`)", lambda: nnef_kv.load(H.write_tar(P/"dup.tar", H.base_members()+[H.reg("./graph.nnef", b"x")])))
    case(rows, "member header claiming 100 GB for a `.dat` (no data behind it)", lambda: nnef_kv.load(H._huge_member_archive(P, "big.dat", False)), "max_tensor_bytes")
    case(rows, "member header claiming 100 GB for another file, `.tgz`", lambda: nnef_kv.load(H._huge_member_archive(P, "big.bin", True)), "max_archive_bytes")
    case(rows, "`graph.quant` claiming 100 GB", lambda: nnef_kv.load(H._huge_member_archive(P, "graph.quant", False)), "max_text_bytes")
    H._bomb(d/"bomb1.tgz", 1, 256 << 20)
    case(rows, f"gzip bomb: {os.path.getsize(d/'bomb1.tgz')} B `.tgz` inflating to 256 MiB in one member (limit 32 MiB)", lambda: nnef_kv.load(P/"bomb1.tgz", limits=Limits(max_archive_bytes=32 << 20)), "max_archive_bytes")
    H._bomb(d/"bomb2.tgz", 64, 8 << 20)
    case(rows, f"gzip bomb: {os.path.getsize(d/'bomb2.tgz')} B `.tgz`, 64 members of 8 MiB (limit 32 MiB)", lambda: nnef_kv.load(P/"bomb2.tgz", limits=Limits(max_archive_bytes=32 << 20)), "max_archive_bytes")
    case(rows, "41 members, limit 10", lambda: nnef_kv.load(H.write_tar(P/"many.tar", H.base_members()+[H.reg(f"r{i}.json", b"{}") for i in range(39)]), limits=Limits(max_members=10)), "max_members")
    case(rows, "`graph.nnef` of 20 kB, limit 4096 B", lambda: nnef_kv.load(H.write_tar(P/"text.tar", [H.reg("graph.nnef", H.GRAPH + b"# padding\n" * 2000), H.reg("w.dat", H.W_DAT)]), limits=Limits(max_text_bytes=4096)), "max_text_bytes")
    case(rows, "`.dat` of 16 kB, limit 1024 B", lambda: nnef_kv.load(H.write_tar(P/"bigdat.tar", [H.reg("graph.nnef", H.GRAPH), H.reg("w.dat", nnef_kv.tensors.dat.encode_tensor(np.zeros(4096, np.float32)))]), limits=Limits(max_tensor_bytes=1024)), "max_tensor_bytes")
    case(rows, "`.dat` whose dims multiply past 2^64", lambda: nnef_kv.read_tensor(io.BytesIO(H.dat_header(16, [0xFFFFFFFF]*8))))
    case(rows, "`.dat` of 0 items whose non-zero dims numpy cannot describe", lambda: nnef_kv.read_tensor(io.BytesIO(H.dat_header(0, [50331650, 0, 1392508931, 65536], bits=64, item_type=3))))
    case(rows, "`.dat` whose data size disagrees with its shape", lambda: nnef_kv.read_tensor(io.BytesIO(H.dat_header(16, [4, 4]) + bytes(16))))
    case(rows, "`.dat` truncated", lambda: nnef_kv.read_tensor(io.BytesIO(H.dat_header(64, [4, 4]) + bytes(10))))
    n=(1<<30)-1
    case(rows, "`.dat` stream announcing 4 GB, limit 1 MiB", lambda: nnef_kv.read_tensor(io.BytesIO(H.dat_header(n*4, [n]) + bytes(10)), limits=Limits(max_tensor_bytes=1<<20)), "max_tensor_bytes")
    case(rows, "string `.dat` announcing 2^32 strings, empty payload", lambda: nnef_kv.read_tensor(io.BytesIO(H.dat_header(0, [0x10000, 0x10000], bits=0xFFFFFFFF, item_type=0x5452_1000))))
    case(rows, "100,000 nested parentheses", lambda: nnef_kv.parse(H.graph_text(f"  y = {'('*100000}x{')'*100000};"), filename="deep.nnef"), "max_nesting")
    case(rows, "100,000 nested `relu(`", lambda: nnef_kv.parse(H.graph_text(f"  y = {'relu('*100000}x{')'*100000};"), filename="deep.nnef"), "max_nesting")
    case(rows, "`x + x + ... + x`, 20,000 terms", lambda: nnef_kv.parse(H.graph_text("  y = x" + " + x"*20000 + ";"), filename="chain.nnef"), "max_nesting")
    case(rows, "50 nested parentheses, `Limits(max_nesting=20)`", lambda: nnef_kv.parse(H.graph_text(f"  y = {'('*50}x{')'*50};"), filename="n.nnef", limits=Limits(max_nesting=20)), "max_nesting")
    case(rows, "undefined identifier", lambda: H.session_of(H.graph_text("  y = relu(zz);")))
    case(rows, "graph output never assigned", lambda: H.session_of(H.graph_text("  y = relu(x);", outputs="y, z")))
    case(rows, "cycle through tract-style reassignment (`a = add(a, y); y = a;`)", lambda: H.session_of(H.graph_text("  a = relu(x);\n  a = add(a, y);\n  y = a;")))
    case(rows, "cycle between two names", lambda: H.session_of(H.graph_text("  a = add(x, b);\n  b = add(a, x);\n  y = b;")))
    case(rows, "fragment calling itself", lambda: H.session_of(H.graph_text("  y = f(x);", fragments="fragment f(a: tensor<scalar>) -> (b: tensor<scalar>) { b = f(a); }")))
    case(rows, "two fragments calling each other", lambda: H.session_of(H.graph_text("  y = f(x);", fragments="fragment f(a: tensor<scalar>) -> (b: tensor<scalar>) { b = g2(a); }\nfragment g2(a: tensor<scalar>) -> (b: tensor<scalar>) { b = f(a); }")))
    case(rows, "comprehension over `range_of([0] * 1000000000)` (10^9 items)", lambda: H.session_of(H.graph_text("  r = [for i in range_of([0] * 1000000000) yield i];\n  y = x;")), "max_comprehension_items")
    case(rows, "nested comprehensions, 10^6 x 10^6 items", lambda: H.session_of(H.graph_text("  n = [for i in range_of([0] * 1000000) yield [for j in range_of([0] * 1000000) yield j]];\n  y = x;")), "max_comprehension_items")
    case(rows, "`2 ^ 1000000000000` in an attribute expression", lambda: H.session_of(H.graph_text("  n = 2 ^ 1000000000000;\n  y = x;")))
    case(rows, "`constant<scalar>(shape = [10^9, 10^9], ...)`", lambda: H.session_of(H.graph_text("  c = constant<scalar>(shape = [1000000000, 1000000000], value = [0.0]);\n  y = add(x, c);")), "max_tensor_bytes")
    print("| hostile input | error (copied from a run) | limit | seconds | peak MiB |")
    print("|---|---|---|---|---|")
    for a, b, c, sec, peak in rows:
        b = b.replace(str(d) + "/", "").replace("|", "\\|")
        print(f"| {a} | `{b}` | {c if c == '—' else '`'+c+'`'} | {sec:.3f} | {peak / 2**20:.1f} |")


if __name__ == "__main__":
    main()
