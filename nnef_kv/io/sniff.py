"""What a file that is not an NNEF archive is, from its first bytes (and its suffix): so that ``load`` and the
command line can say "an ONNX model: convert it first" instead of "not a tar archive"."""
from __future__ import annotations

import os
import zipfile
from pathlib import Path

from ..tensors.dat import MAGIC as DAT_MAGIC

HEAD_BYTES = 512

#: what to do with each kind of file, for messages
CONVERT_HINT = "convert it first: nnef-kv convert {path} -o {stem}.nnef.tgz (or nnef_kv.converters.convert)"


def _zip_kind(path: Path) -> str:
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return "a damaged zip archive"
    if names and all(n.endswith(".npy") for n in names):
        return f"a NumPy .npz archive of {len(names)} array(s) (nnef-kv run takes it as --inputs)"
    return "a zip archive (NNEF models are folders, .tar or .tgz files)"


def describe_file(path: str | os.PathLike) -> str | None:
    """A few words saying what ``path`` is when it is positively something other than an NNEF archive (a
    tar or gzip file), with what to use instead; None when it is not recognised (or is a tar/gzip)."""
    p = Path(path)
    try:
        size = os.stat(p).st_size
        with open(p, "rb") as f:
            head = f.read(HEAD_BYTES)
    except OSError:
        return None
    if size == 0:
        return "an empty file"
    if head[:2] == b"\x1f\x8b" or head[257:262] == b"ustar":
        return None
    stem = p.name.split(".")[0] or "model"
    if p.suffix.lower() == ".onnx":
        return "an ONNX model; " + CONVERT_HINT.format(path=os.fspath(p), stem=stem)
    if head[:2] == DAT_MAGIC and len(head) >= 128:
        return "an NNEF tensor file (.dat), one tensor of a model: give the model folder, .tar or .tgz"
    if head[:6] == b"\x93NUMPY":
        return "a NumPy .npy array (nnef-kv run takes inputs as an .npz: np.savez(path, NAME=array))"
    if head[:4] in (b"PK\x03\x04", b"PK\x05\x06"):
        return _zip_kind(p)
    if head[:4] == b"GGUF":
        return "a GGUF file (llama.cpp weights)"
    text = head.lstrip()
    if text.startswith(b"version") or text.startswith(b"graph") or text.startswith(b"extension"):
        return (f"NNEF text; a model is the folder holding graph.nnef and its .dat files: give "
                f"{os.fspath(p.parent) or '.'}")
    if text[:1] in (b"{", b"["):
        return "a JSON file (a model is a folder, .tar or .tgz file)"
    import codecs

    try:  # a character cut at the end of the head is not an error
        decoded = codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return None
    if decoded and all(c.isprintable() or c in "\n\r\t" for c in decoded[:256]):
        return "a text file (a model is a folder, .tar or .tgz file)"
    return None
