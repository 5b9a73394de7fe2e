"""How far tract and nnef-kv disagree with *themselves* on an archive holding tract's quantized KV ops, beside
how far they disagree with each other: the noise floor of validate's tract-parity column.

tract's quantized cache stores 8-bit codes computed from K/V whose last bits depend on the order the
projections were summed in; a code at a rounding boundary then lands on either neighbour, a whole step apart,
and the logits move (``nnef_kv/validate/parity.py``). Prefilling the same tokens in chunks of another size
changes that order in either engine. This script runs the first validation window (a prefill of ``--context``
tokens, then ``--eval-tokens`` teacher-forced one-token calls) with the prefill in one call and in each of
``--chunks``, in tract 0.23.9 and in nnef-kv, and prints the max |logit difference| of every pair:
tract vs tract and nnef-kv vs nnef-kv (another chunking), nnef-kv vs tract (the same chunking).

    nnef-kv demo --save-dir DIR          # DIR/tc8.tar: the demo's 8-bit tract-cache conversion of SmolLM2
    python benchmarks/parity_noise.py DIR/tc8.tar --text nnef_kv/samples/texts/wikitext2_test_38.txt
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's nnef_kv first

import nnef_kv  # noqa: E402
from nnef_kv.text import token_source  # noqa: E402
from nnef_kv.validate.decode import InterpreterDecoder, TractDecoder  # noqa: E402
from nnef_kv.validate.runner import _measure  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("archive")
    ap.add_argument("--text", required=True, help="the text validate measures on")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--eval-tokens", type=int, default=32)
    ap.add_argument("--chunks", default="256,128,64", help="prefill chunk sizes besides one call (comma-separated)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    ids = token_source(text=args.text, archive=args.archive).ids
    dec = InterpreterDecoder(nnef_kv.load(args.archive))
    ctx, n = args.context, args.eval_tokens
    chunks = [None] + [int(c) for c in args.chunks.split(",") if c]
    tract, ours = {}, {}
    for c in chunks:
        tract[c] = _measure(TractDecoder(args.archive, dec.sig), ids, ctx, n, c, None, [ctx]).logits
        ours[c] = _measure(dec, ids, ctx, n, c, None, [ctx]).logits

    def d(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))

    name = {None: "one call"} | {c: f"chunks of {c}" for c in chunks[1:]}
    print(f"{args.archive}: context {ctx}, {n} predictions (the first window), load average "
          f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("max |logit difference|:")
    for c in chunks[1:]:
        print(f"  tract one call vs tract {name[c]:15s} {d(tract[None], tract[c]):.3g}    "
              f"nnef-kv one call vs nnef-kv {name[c]:15s} {d(ours[None], ours[c]):.3g}")
    for c in chunks:
        print(f"  nnef-kv vs tract, prefill in {name[c]:15s} {d(ours[c], tract[c]):.3g}")
    print(f"({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
