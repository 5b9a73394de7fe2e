"""Every per-layer setting of a grid measured: what no search can beat, to judge ``--auto-bits`` against.

    python benchmarks/auto_bits_grid.py [--archive A] [--scheme ggml] [--keys q4_0,q5_0,q5_1]
        [--values q4_0,q4_1,q5_0] [--context 1024] [--max-kl 0.002] [--jobs N]

Each layer's keys take one of ``--keys`` and its values one of ``--values``: all
``len(keys)**L * len(values)**L`` settings of an L-layer model are measured by validate's machinery (the
same jobs as ``--auto-bits``), then ``--auto-bits --match-uniform-kl`` runs on the same model, text and
context. Printed: the best uniform setting within ``--max-kl`` (the target KL), the cheapest grid settings
measured at or under it, and the auto-bits choice, each with its KV bytes, KL and saving against the
uniform setting. The grid is a subset of the search space, so its best is a lower bound on bytes only
within the grid; a choice cheaper than it lies outside the grid.
"""
from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from auto_bits import common_args, load_inputs  # noqa: E402  (this script's folder is on sys.path)

from nnef_kv.validate.autobits import Candidate, _layers, _spec, auto_bits  # noqa: E402
from nnef_kv.validate.compare import job_steps, prepare, run_job, worker_died  # noqa: E402
from nnef_kv.validate.jobs import run_tasks  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_args(ap)
    ap.add_argument("--scheme", default="ggml")
    ap.add_argument("--keys", default="q4_0,q5_0,q5_1")
    ap.add_argument("--values", default="q4_0,q4_1,q5_0")
    ap.add_argument("--max-kl", type=float, default=0.002)
    ap.add_argument("--top", type=int, default=5)
    a = ap.parse_args()
    conv = int if a.scheme != "ggml" else str
    keys, values = [conv(x) for x in a.keys.split(",")], [conv(x) for x in a.values.split(",")]
    model, src, copts = load_inputs(a)
    layers = _layers(model, a.scheme)
    memo: dict = {}  # ("search", layer_bits text) -> row: what auto-bits measured is not measured again for the grid
    t0 = time.perf_counter()
    r = auto_bits(model, src, a.scheme, {}, a.max_kl, copts, a.archive, jobs=a.jobs, show_progress=False,
                  match_uniform=True, cache=memo)
    t_auto = time.perf_counter() - t0
    bu, ch = r.best_uniform, r.chosen
    if bu is None:
        sys.exit(f"no uniform {a.scheme} setting within --max-kl {a.max_kl}")
    settings = [list(zip(ks, vs)) for ks in itertools.product(keys, repeat=layers)
                for vs in itertools.product(values, repeat=layers)]
    print(f"{a.archive}, scheme {a.scheme}, {layers} layers, context {a.context}, {a.eval_tokens} predictions; "
          f"grid keys {a.keys} x values {a.values}: {len(settings)} settings", flush=True)
    specs = [_spec(a.scheme, {}, s, str(i)) for i, s in enumerate(settings)]
    todo = [sp for sp in specs if ("search", sp.kwargs["layer_bits"]) not in memo]
    t0 = time.perf_counter()
    where = "auto-bits' runs only"
    if todo:
        job, _ = prepare(model, src, copts, a.archive, pick=lambda st: st[:1])  # auto-bits' search window
        rows, where = run_tasks(run_job, job, todo, [sp.text for sp in todo], jobs=a.jobs,
                                steps=job_steps(copts, job.contexts), show_progress=False, on_error=worker_died)
        memo.update((("search", sp.kwargs["layer_bits"]), row) for sp, row in zip(todo, rows))
    t_grid = time.perf_counter() - t0
    grid = [Candidate(sp.kwargs["layer_bits"], s, memo[("search", sp.kwargs["layer_bits"])])
            for sp, s in zip(specs, settings)]
    measured = [c for c in grid if math.isfinite(c.kl)]
    within = sorted((c.kv_bytes, c.kl, c.label) for c in measured if c.kl <= bu.kl)

    def line(what: str, b: float, kl: float, bits: str) -> str:
        return f"| {what} | {bits} | {int(b):,} | {kl:.3g} | {100 * (1 - b / bu.kv_bytes):.1f}% |"

    print("| setting | --layer-bits | KV bytes | KL | fewer bytes than the uniform one |")
    print("|---|---|---|---|---|")
    print(line(f"best uniform within --max-kl {a.max_kl:g}", bu.kv_bytes, bu.kl, bu.label.removeprefix("uniform ")))
    for i, (b, kl, bits) in enumerate(within[:a.top]):
        print(line(f"grid, cheapest #{i + 1} at KL <= {bu.kl:.3g}", b, kl, bits))
    if ch is not None:
        print(line("--auto-bits --match-uniform-kl", ch.kv_bytes, ch.kl, r.layer_bits))
    print(f"({len(measured)} of {len(settings)} grid settings measured ({len(specs) - len(todo)} of them by "
          f"auto-bits), the others in {t_grid:.0f} s on {where}, "
          f"{len(within)} at or under the uniform KL; auto-bits {t_auto:.0f} s)")


if __name__ == "__main__":
    main()
