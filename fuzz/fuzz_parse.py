"""atheris harness: ``nnef_kv.parse`` on arbitrary text, then ``parse(dump(doc)) == doc``.

    python fuzz/fuzz_parse.py -max_total_time=60
"""
from __future__ import annotations

import atheris

with atheris.instrument_imports():
    import nnef_kv
    import nnef_kv.grammar  # noqa: F401

from _common import LIMITS, main, only_nnef_kv_errors


def test_one_input(data: bytes) -> None:
    text = data.decode("utf-8", "surrogateescape")
    doc = only_nnef_kv_errors(nnef_kv.parse, text, filename="fuzz.nnef", limits=LIMITS)
    if doc is not None:
        again = nnef_kv.parse(nnef_kv.dump(doc), filename="fuzz-dump.nnef")
        assert again == doc, "parse(dump(doc)) != doc"


if __name__ == "__main__":
    main(test_one_input, "nnef")
