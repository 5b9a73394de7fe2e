"""KV bytes of a decoder converted from tract's stateful form (dyn caches) and from the explicit form (issue 23.3).

    python benchmarks/stateful_kv_bytes.py [--tokens 1024]

Same weights in both forms (4 layers, 4 heads, 2 kv heads x 32, seed 3); each converted with kivi (4-bit) and tract's
fused op, then one prefill of ``--tokens`` tokens in nnef-kv; prints the KV bytes (InterpreterDecoder.kv_bytes).
"""
from __future__ import annotations

import argparse

import numpy as np

from nnef_kv.converters import convert
from nnef_kv.models import DecoderConfig, build_decoder
from nnef_kv.validate.decode import InterpreterDecoder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    n = ap.parse_args().tokens
    for form in ("dyn", "explicit"):
        cfg = DecoderConfig(vocab=256, hidden=64, layers=4, heads=4, kv_heads=2, head_dim=32, mlp=64, seed=3,
                            cache=form)
        for scheme in ("kivi", "tract"):
            conv, _ = convert(build_decoder(cfg), scheme=scheme)
            dec = InterpreterDecoder(conv)
            dec(np.arange(n, dtype=np.int64) % 256)
            print(f"{form:8s} form, {scheme:5s}: KV {dec.kv_bytes().get('total', 0):,} bytes at {n} tokens")


if __name__ == "__main__":
    main()
