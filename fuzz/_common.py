"""Shared bits of the atheris harnesses: the property (only nnef-kv errors escape) and small limits."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable

from nnef_kv.errors import NnefKvError
from nnef_kv.limits import Limits

# small limits: a fuzzed literal must not make the harness allocate gigabytes
LIMITS = Limits(max_archive_bytes=64 << 20, max_tensor_bytes=16 << 20, max_members=1000, max_text_bytes=1 << 20,
                max_nesting=200, max_comprehension_items=100_000)

CORPUS_DIRS = {
    "nnef": ["*.nnef"],
    "quant": ["*.quant"],
    "dat": ["*.dat"],
    "archive": ["*.tgz", "*.tar"],
}


def only_nnef_kv_errors(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """``fn(...)``; an nnef-kv error is a fine outcome (returns None), anything else propagates to atheris."""
    try:
        return fn(*args, **kw)
    except NnefKvError as e:
        if not str(e).strip():
            raise AssertionError(f"{type(e).__name__} with an empty message") from e
        return None


def seed_corpus(kind: str, out: Path) -> Path:
    """Copy the shared conformance files of one kind into ``out`` (a corpus folder for libFuzzer)."""
    shared = Path(__file__).resolve().parents[1].parent / "shared" / "conformance"
    out.mkdir(parents=True, exist_ok=True)
    if shared.is_dir():
        for pattern in CORPUS_DIRS[kind]:
            for i, p in enumerate(sorted(shared.rglob(pattern))):
                if p.is_file() and p.stat().st_size <= 64 << 10:
                    (out / f"{p.stem}-{i}{p.suffix}").write_bytes(p.read_bytes())
    return out


def main(test_one_input: Callable[[bytes], None], kind: str) -> None:
    """``python fuzz/fuzz_X.py [libFuzzer flags] [corpus dirs]``; with no corpus folder given, a seed
    corpus is made from ../shared/conformance in ``$TMPDIR/nnef-kv-fuzz-corpus/<kind>/`` (outside the
    repository: libFuzzer adds the inputs it finds interesting there)."""
    import tempfile

    import atheris

    args = list(sys.argv)
    if not any(os.path.isdir(a) for a in args[1:]):
        folder = Path(tempfile.gettempdir()) / "nnef-kv-fuzz-corpus" / kind
        args.append(str(seed_corpus(kind, folder)))
    atheris.Setup(args, test_one_input)
    atheris.Fuzz()
