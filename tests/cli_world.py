"""A small world of good, bad and special files for the command-line tests
(tests/properties/test_cli_hostile.py), the CLI
fuzz target (tests/properties/test_fuzz.py) and the refusal table (fuzz/cli_table.py).

``World.make(root)`` writes, under ``root/in`` (inputs, never to be changed) tiny decoders (a 16-position bound, so
no command can do much work), graphs that fail nnef-kv's check, junk, empty, truncated and hostile ``.npz`` files,
a FIFO, symbolic links and (as root) a character device made with ``os.mknod``; ``World.reset_out()`` rebuilds
``root/out``, the targets: an existing regular file, a model folder, a non-model folder holding a precious file,
a FIFO, a character device, links to each, a file standing where a folder should. ``World.damage()`` lists what
changed where nothing may change: the inputs, the special files, the precious folder, and any temporary left.
Nothing here touches ``/dev``."""
from __future__ import annotations

import contextlib
import hashlib
import io
import os
import stat
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT_USER = hasattr(os, "geteuid") and os.geteuid() == 0
NO_CHAR_DEVICE = "creating a character device (os.mknod) needs root; the char-device cases are skipped"

GRAPHS = {
    "undef": "version 1.0;\ngraph g(x) -> (y) {\n  x = external<scalar>(shape = [1, 4]);\n  y = relu(zz);\n}\n",
    "badadd": "version 1.0;\ngraph g(x, c) -> (y) {\n  x = external<scalar>(shape = [2]);\n"
              "  c = external<scalar>(shape = [3]);\n  y = add(x, c);\n}\n",
    "strop": "version 1.0;\ngraph g(x) -> (y) {\n  x = external<scalar>(shape = [2]);\n  y = add(x, \"hello\");\n}\n",
    "badreshape": "version 1.0;\ngraph g(x) -> (y) {\n  x = external<scalar>(shape = [2, 3]);\n"
                  "  y = reshape(x, shape = [4, 2]);\n}\n",
    "hugeext": "version 1.0;\ngraph g(x) -> (y) {\n  x = external<scalar>(shape = [100000, 100000, 100000]);\n"
               "  y = relu(x);\n}\n",
    "unknownop": "version 1.0;\ngraph g(x) -> (y) {\n  x = external<scalar>(shape = [2, 3]);\n"
                 "  y = frobnicate(x);\n}\n",
}
#: a shared export with torch-to-nnef's --reify-sdpa-operator bug (tests/e2e/test_exports.py UNRUNNABLE)
SDPA_EXPORT = Path(__file__).resolve().parents[1].parent / "shared/fixtures/exports/llama_sdpa/model.nnef.tgz"
T2N_EXPORT = SDPA_EXPORT.parents[1] / "llama_default" / "model.nnef.tgz"
PLAIN = "version 1.0;\ngraph g(x) -> (y) {\n  x = external<scalar>(shape = [1, 4]);\n  y = relu(x);\n}\n"


def _npz_header_only(path: Path, shape: tuple[int, ...]) -> None:
    hdr = io.BytesIO()
    np.lib.format.write_array_header_1_0(hdr, {"descr": "<f4", "fortran_order": False, "shape": shape})
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("input_ids.npy", hdr.getvalue())


def _hub_cache(root: Path, archive: Path) -> None:
    """The Hugging Face hub cache layout: ``snapshots/<rev>/NAME`` a relative symbolic link to ``blobs/<hash>``."""
    from nnef_kv.io.container import read_container

    (root / "blobs").mkdir(parents=True)
    snap = root / "snapshots" / "0123abc"
    for m in read_container(archive)[1]:
        blob = hashlib.sha256(bytes(m.data)).hexdigest()
        (root / "blobs" / blob).write_bytes(bytes(m.data))
        (snap / m.name).parent.mkdir(parents=True, exist_ok=True)
        (snap / m.name).symlink_to(os.path.relpath(root / "blobs" / blob, (snap / m.name).parent))


def _mknod_char(path: Path) -> bool:
    """A character device like /dev/full (1, 7), made in the test's own folder; False when not permitted."""
    if not ROOT_USER:
        return False
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 7))
    except (PermissionError, OSError):
        return False
    return True


def _digest(p: Path) -> str:
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return "absent"
    if stat.S_ISLNK(st.st_mode):
        return "link->" + os.readlink(p)
    if stat.S_ISDIR(st.st_mode):
        return "dir"
    if stat.S_ISREG(st.st_mode):
        return hashlib.sha256(p.read_bytes()).hexdigest()[:16]
    return f"special {stat.S_IFMT(st.st_mode):o}"


#: the options naming a folder the command writes into (files added there are asked for)
OUTPUT_FOLDER_OPTIONS = ("--report-dir", "--save-dir")


def snapshot(folder: Path) -> dict[str, str]:
    """relative path -> digest (links, folders and special files by kind) of everything under ``folder``."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            out[str(p.relative_to(folder))] = _digest(p)
    return out


@dataclass
class World:
    root: Path
    has_char: bool = False
    inputs_snapshot: dict[str, str] = field(default_factory=dict)

    @property
    def ins(self) -> Path:
        return self.root / "in"

    @property
    def out(self) -> Path:
        return self.root / "out"

    # ------------------------------------------------------------------------------------------
    @classmethod
    def make(cls, root: Path) -> "World":
        import nnef_kv
        from nnef_kv.models import DecoderConfig, build_decoder, empty_cache
        from nnef_kv.text import byte_level_tokenizer

        w = cls(Path(root))
        d = w.ins
        d.mkdir(parents=True, exist_ok=True)
        cfg = DecoderConfig(vocab=256, hidden=16, layers=1, heads=2, kv_heads=1, head_dim=8, mlp=16, seed=3,
                            max_positions=16)
        nnef_kv.save(build_decoder(cfg), d / "f32.nnef.tar")
        nnef_kv.save(build_decoder(DecoderConfig(**{**cfg.to_dict(), "cache": "dyn"})), d / "dyn.nnef.tar")
        nnef_kv.save(nnef_kv.Model.from_text(PLAIN), d / "plain.nnef.tar")
        for name, text in GRAPHS.items():
            (d / name).mkdir(exist_ok=True)
            (d / name / "graph.nnef").write_text(text)
        byte_level_tokenizer().save(str(d / "tokenizer.json"))
        (d / "junk.tgz").write_bytes(b"this is not a tar archive at all\n" * 10)
        (d / "empty").write_bytes(b"")
        (d / "m.onnx").write_bytes(b"\x08\x07 definitely not protobuf \xff\xff")
        nnef_kv.write_tensor(d / "w.dat", np.zeros((4, 4), np.float32))
        np.savez(d / "io.npz", **dict(empty_cache(cfg), input_ids=np.array([[7, 8]], np.int64)))
        np.savez(d / "ids1.npz", input_ids=np.array([[7]], np.int64))
        feed = dict(empty_cache(cfg), input_ids=np.array([[7, 8]], np.int64))
        good = build_decoder(cfg).session().run(feed)["outputs"]
        np.savez(d / "expect_ok.npz", **feed, outputs=good)  # the outputs as computed: --assert passes
        np.savez(d / "expect_bad.npz", **feed, outputs=good + 100)  # off by 100: --assert fails
        np.savez(d / "x.npz", x=np.array([[np.inf, -np.inf, 1.0, np.nan]], np.float32))
        np.savez(d / "badkey.npz", input_ids=np.zeros((1, 2), np.int64), bogus=np.zeros(2))
        np.savez(d / "badstep.npz", **{"input_ids@x": np.zeros((1, 2), np.int64)})
        np.savez(d / "strexp.npz", **dict(empty_cache(cfg), input_ids=np.array([[1, 2]], np.int64)),
                 outputs=np.array(["a", "b"]))
        np.savez(d / "obj.npz", x=np.array([{"a": 1}], dtype=object))
        np.save(d / "arr.npy", np.zeros(3))
        (d / "empty.npz").write_bytes(b"")
        (d / "trunc.npz").write_bytes((d / "io.npz").read_bytes()[:100])
        (d / "text.npz").write_text("hello, I am text\n")
        _npz_header_only(d / "huge.npz", (1 << 50, 1))  # claims 4 PiB: header only
        np.savez_compressed(d / "bomb.npz", input_ids=np.zeros((4 << 20,), np.int64))  # 32 MiB inflated, ~33 kB
        (d / "prompt.txt").write_text("We hold these truths")
        (d / "ids.txt").write_text("1 2 3")
        (d / "bigid.txt").write_text("1 2 300")
        (d / "hugeid.txt").write_text("1 99999999999999999999999")
        os.mkfifo(d / "fifo")
        w.has_char = _mknod_char(d / "chr")
        (d / "link_f32.tar").symlink_to(d / "f32.nnef.tar")
        _hub_cache(d / "hub", d / "f32.nnef.tar")
        (d / "export").mkdir()  # an export folder: the archive beside its files, no graph.nnef
        (d / "export" / "model.nnef.tgz").write_bytes((d / "f32.nnef.tar").read_bytes())
        byte_level_tokenizer().save(str(d / "export" / "tokenizer.json"))
        if T2N_EXPORT.is_file():  # torch-to-nnef's llama: the planner fuses the embedding's gather into a step
            (d / "t2n.nnef.tgz").write_bytes(T2N_EXPORT.read_bytes())
        big = byte_level_tokenizer()
        big.add_tokens([f"<x{i}>" for i in range(60)])  # 316 ids for a 256-row embedding
        big.save(str(d / "tok316.json"))
        if SDPA_EXPORT.is_file():  # torch-to-nnef --reify-sdpa-operator of a GQA llama: S = 1 baked in a reshape
            (d / "sdpa_gqa.nnef.tgz").write_bytes(SDPA_EXPORT.read_bytes())
        for name, target in (("link_to_fifo", "../fifo"), ("link_to_dir", "../hub"), ("link_dangling", "../nowhere")):
            (d / name).mkdir()
            (d / name / "graph.nnef").write_text(PLAIN)
            (d / name / "w.dat").symlink_to(target)
        w.inputs_snapshot = snapshot(d)
        w.reset_out()
        return w

    def reset_out(self) -> None:
        import shutil

        import nnef_kv

        o = self.out
        if o.exists():
            shutil.rmtree(o)
        o.mkdir(parents=True)
        (o / "existing.npz").write_bytes(b"precious content")
        (o / "existing.tgz").write_bytes(b"precious archive")
        nnef_kv.save(nnef_kv.Model.from_text(PLAIN), o / "model")
        (o / "precious").mkdir()
        (o / "precious" / "keep.txt").write_text("do not delete me")
        (o / "empty_dir").mkdir()
        os.mkfifo(o / "fifo")
        if self.has_char:
            _mknod_char(o / "chr")
        (o / "link_file.npz").symlink_to("existing.npz")
        (o / "link_file.tgz").symlink_to("existing.tgz")
        (o / "link_fifo.npz").symlink_to("fifo")
        (o / "link_fifo.tgz").symlink_to("fifo")
        (o / "dangling.npz").symlink_to("nowhere.npz")
        (o / "loop.npz").symlink_to("loop.npz")
        (o / "file_parent").write_text("a file where a folder would be")
        (o / "rdir").mkdir()
        os.mkfifo(o / "rdir" / "report.json")

    def subs(self) -> dict[str, str]:
        return {"in": str(self.ins), "out": str(self.out)}

    # ------------------------------------------------------------------------------------------
    def damage(self, argv: list[str] = ()) -> list[str]:
        """What changed that must not: the inputs, special files, the precious folder, and temporaries left.
        ``argv``: the command that ran; when it named the precious folder as an output folder (``--report-dir``,
        demo's ``--save-dir``), files added beside ``keep.txt`` are what was asked for (the folder is still damaged
        if ``keep.txt`` changed)."""
        bad = []
        now = snapshot(self.ins)
        if now != self.inputs_snapshot:
            diff = sorted(k for k in set(now) | set(self.inputs_snapshot) if now.get(k) != self.inputs_snapshot.get(k))
            bad.append(f"inputs changed: {diff}")
        o = self.out
        checks = {"fifo": stat.S_ISFIFO, "rdir/report.json": stat.S_ISFIFO}
        if self.has_char:
            checks["chr"] = stat.S_ISCHR
        for name, test in checks.items():
            with contextlib.suppress(FileNotFoundError):
                if not test(os.lstat(o / name).st_mode):
                    bad.append(f"{name} is no longer what it was")
                continue
            bad.append(f"{name} is gone")
        for link in ("link_file.npz", "link_file.tgz", "link_fifo.npz", "link_fifo.tgz", "dangling.npz", "loop.npz"):
            if not (o / link).is_symlink():
                bad.append(f"{link} is no longer a symbolic link")
        keep = o / "precious" / "keep.txt"
        as_reports = any(a in OUTPUT_FOLDER_OPTIONS and b == str(o / "precious") for a, b in zip(argv, list(argv)[1:]))
        if not keep.is_file() or keep.read_text() != "do not delete me" or (
                len(os.listdir(o / "precious")) != 1 and not as_reports):
            bad.append("the precious folder changed")
        for dirpath, dirnames, filenames in os.walk(self.root):
            for name in dirnames + filenames:
                if ".nnef-kv-" in name:
                    bad.append(f"temporary left: {Path(dirpath, name)}")
        return bad


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """``nnef_kv.cli.main(argv)`` with stdout and stderr captured: (exit code, stdout, stderr)."""
    from nnef_kv.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def without_paths(text: str, world: World | Any) -> str:
    """``text`` with the world's folder removed (what a message says beyond the paths it names)."""
    return text.replace(str(world.root) + "/", "").replace(str(world.root), "")
