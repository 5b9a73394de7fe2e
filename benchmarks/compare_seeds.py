"""Does ``compare`` decide on noise? The same compare run twice on other windows of the text; every
significant ordering the first run printed must hold in the second.

    python benchmarks/compare_seeds.py ARCHIVE --text TEXT --schemes kivi:4,q4_0,... [--context 2048]
        [--seeds 0,7] [--jobs 2] [--work DIR] [-- extra compare options]

Each seed is one ``nnef-kv compare`` (``--windows-seed``: 0 spreads the windows evenly, another places them at
random), its report.json read back. Two kinds of ordering are checked, at each context:

* against the baseline row: a row whose paired KL difference to the baseline excludes zero (``*`` in the
  output) must lie on the same side of the same baseline in the other run;
* between any two rows: when the first run's 95% intervals of the mean KL do not overlap, the second run's
  means must be in the same order.

A failed check is printed and the exit code is 1."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run_compare(archive: str, args: argparse.Namespace, seed: int, out: Path, extra: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "nnef_kv", "compare", archive, "--text", args.text, "--schemes", args.schemes,
           "--windows-seed", str(seed), "--report-dir", str(out), "--jobs", str(args.jobs), *extra]
    if args.context:
        cmd += ["--context", args.context]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "NNEF_KV_PROGRESS": "0"})
    print(p.stdout.rstrip())
    if p.returncode not in (0, 1):
        sys.exit(f"compare (seed {seed}) failed: {p.stderr.strip()}")
    print(f"(seed {seed}: {time.perf_counter() - t0:.0f} s; load average {os.getloadavg()[0]:.2f})")
    return json.loads((out / "report.json").read_text())


def _per(row: dict[str, Any], ctx: int) -> dict[str, Any]:
    return next((c for c in row.get("per_context", []) if c.get("context") == ctx), {})


def orderings(rep: dict[str, Any]) -> list[tuple[int, str, str, str]]:
    """The significant orderings of a report: (context, lower row, higher row, why)."""
    out = []
    for ctx in rep["contexts"]:
        base = rep["baseline"].get(str(ctx))
        rows = {r["scheme"]: _per(r, ctx) for r in rep["rows"] if r["status"] == "measured"}
        for name, f in rows.items():
            if name != base and f.get("kl_diff_significant"):
                lo, hi = (base, name) if f["kl_diff"] > 0 else (name, base)
                out.append((ctx, lo, hi, f"paired difference to the baseline {base}"))
        for a, fa in rows.items():
            for b, fb in rows.items():
                ia, ib = fa.get("kl_mean_ci95"), fb.get("kl_mean_ci95")
                if a != b and ia and ib and ia[1] < ib[0]:
                    out.append((ctx, a, b, "95% intervals apart"))
    merged: dict[tuple[int, str, str], list[str]] = {}
    for ctx, lo, hi, why in out:  # one ordering of a pair, its reasons joined
        merged.setdefault((ctx, lo, hi), []).append(why)
    return [(ctx, lo, hi, "; ".join(whys)) for (ctx, lo, hi), whys in merged.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("archive")
    ap.add_argument("--text", required=True)
    ap.add_argument("--schemes", required=True)
    ap.add_argument("--context", default=None)
    ap.add_argument("--seeds", default="0,7")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--work", default=None)
    a, extra = ap.parse_known_args()
    extra = [x for x in extra if x != "--"]
    seeds = [int(s) for s in a.seeds.split(",")]
    tmp = None if a.work else tempfile.TemporaryDirectory(prefix="nnef_kv_seeds_")
    work = Path(a.work or tmp.name)
    reps = {s: run_compare(a.archive, a, s, work / f"seed{s}", extra) for s in seeds}
    first, *others = seeds
    bad = 0
    found = orderings(reps[first])
    for s in others:
        rep = reps[s]
        for ctx, lo, hi, why in found:
            rows = {r["scheme"]: _per(r, ctx) for r in rep["rows"] if r["status"] == "measured"}
            if lo not in rows or hi not in rows:
                print(f"  context {ctx}: {lo} < {hi} ({why}): a row is missing at seed {s}")
                bad += 1
                continue
            kept = rows[lo]["kl_mean"] < rows[hi]["kl_mean"]
            if not kept:
                bad += 1
            print(f"  context {ctx}: {lo} < {hi} ({why}, seed {first}): seed {s} "
                  f"{rows[lo]['kl_mean']:.4g} vs {rows[hi]['kl_mean']:.4g} {'kept' if kept else 'REVERSED'}")
    print(f"{len(found)} significant orderings at seed {first}; {bad} not kept at seed(s) "
          f"{', '.join(map(str, others))}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
