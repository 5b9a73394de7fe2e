"""Where nnef-kv and tract part on an archive of tract's quantized dyn cache (docs/kv.md 2b, issue 23.2).

One prefill call of the first N tokens of a text in both engines (tract's tensors read as extra graph
outputs); prints the layer-0 RMS norm and projections' differences, then for each cache op its K/V
difference, the codes and ``(lo, step)`` that differ when nnef-kv's cache stores each engine's K/V, and
for the first and last layers whether the op alone in tract, on tract's K/V, gives nnef-kv's output.

    python tools/tract_kv_diff.py ARCHIVE TOKENIZER [N] [--text FILE]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from tract_oracle import TractOracleDynCache  # noqa: E402

from nnef_kv import tract_driver  # noqa: E402
from nnef_kv.io.archive import load  # noqa: E402
from nnef_kv.kv.packing import unpack_bits  # noqa: E402
from nnef_kv.kv.tract_dyn_cache import TractQuantizedDynKvCache  # noqa: E402
from nnef_kv.validate import parity  # noqa: E402

TEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext2" / "wiki.test.raw.part1"
LAYER0 = ["layer0_input_norm_variance", "layer0_input_norm_rsqrt", "layer0_input_norm_out", "layer0_k_proj",
          "layer0_v_proj"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("archive")
    ap.add_argument("tokenizer")
    ap.add_argument("n", type=int, nargs="?", default=1024)
    ap.add_argument("--text", default=str(TEXT))
    a = ap.parse_args()
    from tokenizers import Tokenizer

    t0 = time.time()
    model = load(a.archive)
    ops = {rhs.positional()[0].name: rhs for rhs in (x.rhs for x in model.document.graph.body)
           if getattr(rhs, "name", "") == parity.QUANTIZED_TRACT_OPS[0]}
    known = {x.lhs.name for x in model.document.graph.body if hasattr(x.lhs, "name")}
    names = [k for k in LAYER0 if k in known] + list(ops)
    text = Path(a.text).read_text()[: 40 * a.n]
    ids = Tokenizer.from_file(a.tokenizer).encode(text).ids[: a.n]
    feed = np.asarray(ids, np.int64).reshape(1, -1)
    sess = model.session()
    ids_input = sess.plan.inputs[0].name
    _, caps = sess.run({ids_input: feed}, capture=names)
    ours = {k: np.array(caps[k]) for k in names}
    del caps
    n_out = len(model.document.graph.outputs)
    got = tract_driver.Stateful(parity._with_outputs(model, names)).run([feed])
    theirs = {k: got[n_out + i] for i, k in enumerate(names)}
    print(f"{len(ids)} tokens, both engines in {time.time() - t0:.0f} s")
    for k in names[: len(names) - len(ops)]:
        print(f"{k:28s} max |diff| {np.abs(ours[k] - theirs[k]).max():.3g} (max |x| {np.abs(theirs[k]).max():.3g})")
    total = held = 0
    for i, (x, rhs) in enumerate(ops.items()):
        bits, pc = int(rhs.named()["bits"].value), int(rhs.named()["per_channel"].value)
        a_, b_ = (TractQuantizedDynKvCache(bits=bits, per_channel=pc) for _ in range(2))
        a_(ours[x])
        yb = b_(theirs[x])
        alone = ""
        if i < 2 or i >= len(ops) - 2:
            b, h, _, d = theirs[x].shape
            same = np.array_equal(yb, TractOracleDynCache(b, h, d, bits, bool(pc))(theirs[x]))
            alone = f"; tract's op alone on tract's K/V == nnef-kv's: {same}"
        ca = unpack_bits(a_.packed.view(), bits, a_.d).astype(int)
        cb = unpack_bits(b_.packed.view(), bits, b_.d).astype(int)
        flips = int((ca != cb).sum())
        total, held = total + flips, held + ca.size
        dp = int((a_.params.view() != b_.params.view()).sum())
        print(f"{x:18s} per_channel {pc}: K/V max |diff| {np.abs(ours[x] - theirs[x]).max():.3g} "
              f"(max |x| {np.abs(theirs[x]).max():.3g}); codes differing {flips} of {ca.size} "
              f"(max |dcode| {int(np.abs(ca - cb).max()) if ca.size else 0}); lo/step differing {dp} of "
              f"{a_.params.view().size}{alone}")
    print(f"codes differing: {total} of {held} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
