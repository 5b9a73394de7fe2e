"""``nnef-kv compare``: every KV scheme on one f32 archive and text, measured as ``validate`` does, side by side
(issue 15). Errors are one line, exit 2, as every command; option values are checked before any work and nothing
is written unless the whole run succeeded."""
from __future__ import annotations

import argparse
import time
from typing import Any

from ..errors import InputError
from .args import EXIT_INTERRUPTED, EXIT_OK, existing_path
from .measure import NAMES, add_jobs_options, add_measure_options, lengths, positive, report_dir, token_source

_NAMES = {**NAMES, "baseline": "--baseline"}


def add_parser(sub: Any) -> None:
    from ..validate.compare import DEFAULT_SCHEMES

    sp = sub.add_parser("compare", help="every KV scheme on your f32 archive and text, side by side",
                        description="Converts the f32 archive under each scheme in memory and measures each as "
                                    "'validate' does (same contexts, stepwise teacher forcing, KL / ppl / same-top "
                                    "figures, KV bytes held); one table ordered by KV bytes, a failing scheme is a row "
                                    "with its reason. Schemes: NAME[:BITS][+option=value...], e.g. kivi:4, kivi:4/2 "
                                    "(key/value bits), kivi:4+key_axis=token, q8_0, q4_0/q8_0 (llama.cpp -ctk/-ctv), "
                                    "hf:4, hf:4+backend=hqq, tract, tract-cache:8.")
    sp.add_argument("archive", help="the f32 decoder (NNEF folder, .tar, .tgz, or .onnx)")
    sp.add_argument("--schemes", help=f"comma-separated schemes (default: {DEFAULT_SCHEMES})")
    add_measure_options(sp, chunk=True, report="write report.md, report.json and report.png (Pareto plot) here")
    sp.add_argument("--baseline", metavar="SCHEME",
                    help="the row each KL difference is measured against, paired on the same tokens (one of "
                         "--schemes, as written; default: the row of lowest mean KL)")
    sp.add_argument("--no-tract", action="store_true", help="do not try tract on the converted archives")
    add_jobs_options(sp)


def cmd_compare(args: argparse.Namespace) -> int:
    from ..converters import frontends
    from ..progress import progress_enabled
    from ..validate.compare import DEFAULT_SCHEMES, CompareOptions, compare_model, parse_specs
    from ..validate.compare_report import render_table, write_compare_report

    src = existing_path(args.archive)
    specs = parse_specs(args.schemes or DEFAULT_SCHEMES)
    opts = CompareOptions(contexts=lengths(args.context, "--context"),
                          eval_tokens=positive(args.eval_tokens, "--eval-tokens"),
                          chunk=positive(args.chunk, "--chunk"), tract=not args.no_tract,
                          windows=positive(args.windows, "--windows"),
                          windows_seed=positive(args.windows_seed, "--windows-seed", 0) or 0, baseline=args.baseline)
    jobs = positive(args.jobs, "--jobs")
    out = report_dir(args.report_dir, inputs=(src,))
    if args.ray is not None and jobs is not None:
        raise InputError("--jobs and --ray: give one (Ray schedules the jobs on its cluster's CPUs)")
    source = token_source(args, src, default_text=True)
    model = frontends.load(src)
    t0 = time.perf_counter()
    rep = compare_model(model, source, specs, opts, label=str(src), jobs=jobs, ray=args.ray, names=_NAMES,
                        show_progress=progress_enabled())
    print(f"compare {src}: {len(specs)} schemes, context {', '.join(map(str, rep.contexts))}, "
          f"{rep.predictions} predictions each ({len(rep.starts)} window(s) x {rep.eval_tokens}); {rep.tokens}")
    for n in rep.notes:
        print(f"  note: {n}")
    print(render_table(rep))
    print(f"({time.perf_counter() - t0:.1f} s on {rep.runner})")
    if out is not None:
        paths = write_compare_report(rep, out)
        print(f"report: {', '.join(str(p) for p in paths)}")
    return EXIT_INTERRUPTED if rep.interrupted else EXIT_OK
