"""atheris harness: ``nnef_kv.load`` on arbitrary bytes written as a .tar/.tgz file (gzip sniffed by magic),
then ``model.session()``.

    python fuzz/fuzz_archive.py -max_total_time=60
"""
from __future__ import annotations

import os
import tempfile

import atheris

with atheris.instrument_imports():
    import nnef_kv
    import nnef_kv.io.archive  # noqa: F401
    import nnef_kv.io.container  # noqa: F401

from _common import LIMITS, main, only_nnef_kv_errors

_TARGET = os.path.join(tempfile.mkdtemp(prefix="nnef-kv-atheris-"), "model.nnef.tgz")


def test_one_input(data: bytes) -> None:
    with open(_TARGET, "wb") as f:
        f.write(data)
    model = only_nnef_kv_errors(nnef_kv.load, _TARGET, limits=LIMITS)
    if model is not None:
        only_nnef_kv_errors(model.session)


if __name__ == "__main__":
    main(test_one_input, "archive")
