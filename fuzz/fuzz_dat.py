"""atheris harness: the ``.dat`` reader (``read_tensor`` on a stream and ``decode_tensor`` on bytes must agree),
then a decoded tensor re-encodes to the same value.

    python fuzz/fuzz_dat.py -max_total_time=60
"""
from __future__ import annotations

import io

import atheris

with atheris.instrument_imports():
    import numpy as np

    import nnef_kv
    from nnef_kv.tensors.dat import decode_tensor, encode_tensor

from _common import LIMITS, main, only_nnef_kv_errors


def test_one_input(data: bytes) -> None:
    a = only_nnef_kv_errors(nnef_kv.read_tensor, io.BytesIO(data), limits=LIMITS)
    b = only_nnef_kv_errors(decode_tensor, data, limits=LIMITS)
    assert (a is None) == (b is None), "stream and bytes readers disagree"
    if b is not None:
        value, info = b
        again, _ = decode_tensor(encode_tensor(value, info), limits=LIMITS)
        if isinstance(value, np.ndarray) and value.dtype != object:
            assert again.tobytes() == value.tobytes() and again.shape == value.shape


if __name__ == "__main__":
    main(test_one_input, "dat")
