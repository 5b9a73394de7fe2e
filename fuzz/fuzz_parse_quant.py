"""atheris harness: ``nnef_kv.parse_quant`` on arbitrary text.

    python fuzz/fuzz_parse_quant.py -max_total_time=60
"""
from __future__ import annotations

import atheris

with atheris.instrument_imports():
    import nnef_kv
    import nnef_kv.grammar  # noqa: F401

from _common import LIMITS, main, only_nnef_kv_errors


def test_one_input(data: bytes) -> None:
    only_nnef_kv_errors(nnef_kv.parse_quant, data.decode("utf-8", "surrogateescape"), filename="fuzz.quant",
                        limits=LIMITS)


if __name__ == "__main__":
    main(test_one_input, "quant")
