"""``nnef-kv convert``: an archive (NNEF, ONNX or GGUF) rewritten to a quantized KV cache; with ``--auto-bits``
the bits of each layer (and of K and V) chosen by measuring on a text, the fewest KV bytes within a KL budget
(:mod:`nnef_kv.validate.autobits`). Errors are one line, exit 2, checked before any work; with ``--auto-bits``
nothing is written unless a choice was made (exit 1 when none meets the budget)."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from ..errors import InputError
from .args import EXIT_CHECK_FAILED, EXIT_OK, existing_path, output_model
from .measure import NAMES, add_jobs_options, add_measure_options, lengths, positive, report_dir, token_source
from .words import note_lost_window, scheme_phrase

#: conversion notes the command repeats on stderr (what a user must not miss)
NOTE_PREFIXES = ("never quantized:",)

#: the options of --auto-bits only (refused without it)
_AUTO_ONLY = ("max_kl", "match_uniform_kl", "text", "ids", "tokenizer", "context", "eval_tokens", "jobs", "ray",
              "report_dir", "windows", "windows_seed", "ladder", "layer_groups")


def add_parser(sub: Any) -> None:
    from ..converters.options import add_arguments as add_convert_arguments

    sp = sub.add_parser("convert", help="rewrite a decoder's attention/KV cache to a quantized KV cache")
    sp.add_argument("input", help="NNEF folder, .tar, .tgz, graph.nnef, .onnx, or .gguf (converters/frontends)")
    sp.add_argument("-o", "--output", required=True,
                    help="output archive: a .tar, .tgz or .tar.gz file, or a folder (a name without a suffix). "
                         ".tar or folder: no compression, written at disk speed and memory-mapped on load (a weight "
                         "is read from the file when first used); .tgz: slightly smaller (about 0.93 of f32 weights), "
                         "written at about a quarter of a .tar's speed by ISA-L (zlib alone, if isal is missing: "
                         "about 1/20), inflated into memory on load (docs/benchmarks.md)")
    sp.add_argument("--weights", choices=["f32", "f16", "keep"], default=None,
                    help=".gguf input: f32 (default: dequantized as gguf.quants does), f16 (stored f16, computed f32) "
                         "or keep (Q4_0 / Q8_0 kept as tract blocks, other types dequantized)")
    add_convert_arguments(sp)  # --scheme and the schemes' flags (nnef_kv.converters.schemes)
    g = sp.add_argument_group("--auto-bits: bits per layer (and per K and V) meeting a KL budget with the fewest KV "
                              "bytes, measured on a text (see nnef_kv/validate/autobits.py)")
    g.add_argument("--auto-bits", action="store_true", help="choose --layer-bits for --scheme (kivi, ggml, hf, "
                                                            "tract-cache) by measuring")
    g.add_argument("--max-kl", type=float, help="the budget: mean KL(p_ref || p) in nats at the context")
    g.add_argument("--match-uniform-kl", action="store_true", default=None,
                   help="also never above the KL of the best uniform setting within the budget")
    add_measure_options(sp, group=g, one_context=True, windows_seed=None, model="the input",
                        windows_note="the first half (rounded up) chosen on, the rest held out, at least 2",
                        report="write report.md and report.json of the choice here (default: beside the output, "
                               "OUTPUT.auto-bits.md / .json)")
    g.add_argument("--ladder", help="the levels searched, comma-separated, a subset of the scheme's (default: all: "
                                    "kivi 2,3,4,5,6,8; ggml q4_0,iq4_nl,q4_1,q5_0,q5_1,q8_0; ...)")
    g.add_argument("--layer-groups", type=int, help="units of consecutive layers sharing a setting (default: one "
                                                    "layer a unit up to 8 layers, else 8 groups; each unit costs "
                                                    "a run per lower level)")
    add_jobs_options(g)


def cmd_convert(args: argparse.Namespace) -> int:
    if getattr(args, "auto_bits", False):
        return cmd_auto_bits(args)
    given = [k for k in _AUTO_ONLY if getattr(args, k, None) is not None]
    if given:
        raise InputError(f"--{given[0].replace('_', '-')}: only with --auto-bits")
    from ..converters import convert, frontends
    from ..converters.options import from_arguments, scheme_given
    from ..io.archive import save
    from ..progress import progress_bar
    from ..text import write_beside

    opts = from_arguments(args)
    src = existing_path(args.input)
    out, _ = output_model(args.output, "-o", [src])
    fe = frontends.detect(src)
    import_only = fe is not None and fe.name == "gguf" and not scheme_given(args)
    t0 = time.perf_counter()
    with progress_bar(f"{'importing' if import_only else 'converting'} {src.name}", total=2 + (not import_only)) \
            as advance:
        model = frontends.load(src, weights=getattr(args, "weights", None))
        advance()
        note_lost_window(model, src)
        if import_only:
            converted, report = model, None
        else:
            converted, report = convert(model, **opts.as_dict())
            advance()
        save(converted, args.output)
        advance()
    beside = write_beside(out, model.beside) if model.beside else []
    for note in model.import_notes:
        print(f"note: {note}", file=sys.stderr)
    done = f" and {', '.join(str(p) for p in beside)}" if beside else ""
    if report is None:
        print(f"imported {src} ({fe.kinds if fe else ''}) -> {args.output}{done} ({time.perf_counter() - t0:.2f} s)")
        return EXIT_OK
    for line in getattr(report, "attentions", []) or []:
        print(f"  {line}")
    changes = set(getattr(report, "changes", ()))
    for note in report.notes:
        if note.startswith(NOTE_PREFIXES) or note in changes:
            print(f"note: {note}", file=sys.stderr)
    print(f"converted {len(getattr(report, 'attentions', []) or [])} attention block(s) of {src} with scheme "
          f"{scheme_phrase(opts)} -> {args.output}{done} ({time.perf_counter() - t0:.2f} s)")
    return EXIT_OK


def cmd_auto_bits(args: argparse.Namespace) -> int:
    from ..atomic import atomic_write
    from ..converters import convert, frontends
    from ..converters.options import from_arguments
    from ..io.archive import save
    from ..progress import progress_enabled
    from ..targets import check_file
    from ..validate.autobits import auto_bits, pick_ladder, scheme_ladder
    from ..validate.autobits_report import render_json, render_markdown, render_text
    from ..validate.compare import CompareOptions

    if args.max_kl is None:
        raise InputError("--auto-bits: give the budget, --max-kl X (mean KL in nats)")
    if not args.max_kl >= 0 or args.max_kl == float("inf"):
        raise InputError(f"--max-kl {args.max_kl}: " + ("not a number" if args.max_kl != args.max_kl else
                                                        "must be a finite number >= 0"))
    if args.layer_bits:
        raise InputError("--layer-bits and --auto-bits: give one (--auto-bits chooses the layer bits)")
    opts = from_arguments(args)
    src = existing_path(args.input)
    out, _ = output_model(args.output, "-o", [src])  # refused before any work: what save would refuse
    out = Path(args.output)
    rd = report_dir(args.report_dir, files=("report.md", "report.json"), inputs=(src,))
    if rd is None:
        for name in (f"{out.name}.auto-bits.md", f"{out.name}.auto-bits.json"):
            check_file(out.parent / name, "the auto-bits report", inputs=[src])
    contexts = lengths(args.context, "--context")
    copts = CompareOptions(contexts=contexts, eval_tokens=positive(args.eval_tokens, "--eval-tokens"),
                           tract=False, windows=positive(args.windows, "--windows", 2),
                           windows_seed=positive(args.windows_seed, "--windows-seed", 0) or 0)
    jobs = positive(args.jobs, "--jobs")
    if args.ray is not None and jobs is not None:
        raise InputError("--jobs and --ray: give one")
    scheme = opts.scheme
    values = {k: v for k, v in opts.values().items() if k in opts.scheme_object.option_names}
    ladder = None if args.ladder is None else [x for x in args.ladder.split(",") if x.strip()]
    if ladder is not None:  # refused before any work
        pick_ladder(scheme, scheme_ladder(scheme, values)[0], ladder)
    source = token_source(args, src, default_text=True)
    model = frontends.load(src)
    res = auto_bits(model, source, scheme, values, float(args.max_kl), copts, str(src), jobs=jobs, ray=args.ray,
                    names=NAMES, show_progress=progress_enabled(),
                    match_uniform=bool(args.match_uniform_kl),
                    ladder=ladder,
                    groups=positive(args.layer_groups, "--layer-groups"))
    print(render_text(res))
    md, js = render_markdown(res).encode(), render_json(res).encode()
    if res.chosen is None:
        if rd is not None:  # the report of what was measured (no archive: nothing was chosen)
            rd.mkdir(parents=True, exist_ok=True)
            for name, data in (("report.md", md), ("report.json", js)):
                with atomic_write(rd / name) as f:
                    f.write(data)
        if res.rejected is not None:
            print("the choice failed on the held-out text (above): nothing written")
        else:
            print(f"no setting of scheme {scheme} meets --max-kl {args.max_kl:g} at context {res.context} (upper "
                  f"bounds of the 95% intervals): nothing written")
        return EXIT_CHECK_FAILED
    converted, _ = convert(model, **{**opts.as_dict(), "layer_bits": res.layer_bits})
    save(converted, out)
    base = rd if rd is not None else out.parent
    names = ("report.md", "report.json") if rd is not None else (f"{out.name}.auto-bits.md",
                                                                 f"{out.name}.auto-bits.json")
    base.mkdir(parents=True, exist_ok=True)
    for name, data in zip(names, (md, js)):
        with atomic_write(base / name) as f:
            f.write(data)
    print(f"wrote {out} (--layer-bits {res.layer_bits}) and {', '.join(str(base / n) for n in names)}")
    return EXIT_OK
