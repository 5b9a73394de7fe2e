"""``convert --auto-bits`` over a sweep of KL budgets: per budget, the best uniform setting within it and
the per-layer choice (KL no higher than the uniform one's), with the KV bytes saved.

    python benchmarks/auto_bits.py [--archive A] [--schemes kivi,ggml] [--context 1024] [--budgets ...]

Default: the trained fixture decoder (tests/fixtures/trained_llama) on the sample text shipped with
nnef-kv. Every row is measured by validate's machinery (nnef_kv/validate/autobits.py); runs of the same
setting are measured once for the whole sweep."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import nnef_kv  # noqa: E402
from nnef_kv.text import SAMPLE_TEXT, token_source  # noqa: E402
from nnef_kv.validate.autobits import auto_bits  # noqa: E402
from nnef_kv.validate.compare import CompareOptions  # noqa: E402

DEFAULT = ROOT / "tests" / "fixtures" / "trained_llama" / "model.nnef.tgz"


def common_args(ap: argparse.ArgumentParser) -> None:
    """The options this script shares with ``auto_bits_grid.py``: archive, context, predictions, jobs."""
    ap.add_argument("--archive", default=str(DEFAULT))
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--eval-tokens", type=int, default=64)
    ap.add_argument("--jobs", type=int)


def load_inputs(a: argparse.Namespace) -> tuple:
    """The model, the sample text's tokens and the measuring options of :func:`common_args`'s options."""
    model = nnef_kv.load(a.archive)
    src = token_source(text=SAMPLE_TEXT, archive=a.archive)
    return model, src, CompareOptions(contexts=[a.context], eval_tokens=a.eval_tokens, tract=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_args(ap)
    ap.add_argument("--schemes", default="kivi,ggml")
    ap.add_argument("--budgets", default="0.02,0.01,0.005,0.002,0.001,0.0005,0.0002,0.0001,0.00005")
    ap.add_argument("--match-uniform-kl", action="store_true", help="as convert --auto-bits --match-uniform-kl")
    a = ap.parse_args()
    model, src, copts = load_inputs(a)
    print(f"{a.archive}, context {a.context}, {a.eval_tokens} predictions of {SAMPLE_TEXT.name}")
    print("| scheme | --max-kl | best uniform | its KV bytes | its KL | --auto-bits --layer-bits | KV bytes | KL | "
          "fewer bytes | best uniform K/V pair (bytes, KL) | fewer bytes than it |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for scheme in a.schemes.split(","):
        cache: dict = {}
        t0 = time.perf_counter()
        for b in [float(x) for x in a.budgets.split(",")]:
            r = auto_bits(model, src, scheme, {}, b, copts, a.archive, jobs=a.jobs, cache=cache, show_progress=False,
                          match_uniform=a.match_uniform_kl)
            bu, ch = r.best_uniform, r.chosen
            if bu is None:
                print(f"| {scheme} | {b:g} | none within the budget | | | | | | |", flush=True)
                continue
            bp = r.best_pair
            pair = f"{bp.label.removeprefix('uniform ')} ({int(bp.kv_bytes):,}, {bp.kl:.3g})" if bp else "-"
            vs = f"{100 * r.saving(bp):.1f}%" if bp else "-"
            print(f"| {scheme} | {b:g} | {bu.label.removeprefix('uniform ')} | {int(bu.kv_bytes):,} | {bu.kl:.3g} | "
                  f"{r.layer_bits} | {int(ch.kv_bytes):,} | {ch.kl:.3g} | {100 * r.saving():.1f}% | {pair} | {vs} |",
                  flush=True)
        print(f"({scheme}: {len(cache)} settings measured, {time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
