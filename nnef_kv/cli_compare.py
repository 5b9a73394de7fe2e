"""The command-line faces of issue 15: ``nnef-kv compare`` and ``nnef-kv convert --auto-bits``.

:func:`add_commands` is called by :func:`nnef_kv.cli.build_parser`: it adds the ``compare`` subcommand,
the ``--auto-bits`` flags of ``convert``, and their handlers to the command table. Errors are
:class:`~nnef_kv.errors.InputError` (one line, exit 2, as every command); option values are checked
before any work and nothing is written unless the whole run succeeded."""
from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any, Callable

from .cli_io import INT_MAX
from .errors import InputError, clip

__all__ = ["add_commands", "cmd_compare", "cmd_auto_bits"]

_NAMES = {"contexts": "--context", "eval_tokens": "--eval-tokens", "chunk": "--chunk", "windows": "--windows",
          "windows_seed": "--windows-seed", "baseline": "--baseline"}


def _path(value: str, flag: str) -> Path:
    from .cli_io import existing_path

    return existing_path(value, "" if flag in ("archive", "input") else flag)


def _ints(text: str | None, flag: str, low: int = 1) -> list[int] | None:
    if text is None:
        return None
    out = []
    for part in [t for t in text.replace(" ", ",").split(",") if t]:
        if not (part.isascii() and part.lstrip("+-").isdigit()):
            raise InputError(f"{flag} {clip(repr(part), 40)}: a number of tokens is expected")
        v = int(part)
        if v < low:
            raise InputError(f"{flag} {v}: must be >= {low}")
        if v > INT_MAX:
            raise InputError(f"{flag} {clip(part, 30)}: too large (at most {INT_MAX})")
        out.append(v)
    if not out:
        raise InputError(f"{flag}: no value given")
    return out


def _positive(value: Any, flag: str, low: int = 1) -> Any:
    from .cli_io import int_at_least

    return None if value is None else int_at_least(flag, value, low)


def _report_dir(value: str | None, files: tuple[str, ...] = ("report.md", "report.json", "report.png"),
                inputs: tuple[Any, ...] = ()) -> Path | None:
    """``--report-dir``: absent or a folder nnef-kv can write in, its report files absent or regular (checked
    before any work: :func:`nnef_kv.cli_io.output_folder`)."""
    from .cli_io import output_folder

    return None if value is None else output_folder(value, "--report-dir", files=files, inputs=inputs)


def _source(args: argparse.Namespace, archive: Path) -> Any:
    from .text import SAMPLE_TEXT, token_source

    names = {"text": "--text", "ids": "--ids", "tokenizer": "--tokenizer", "prompt": "--prompt"}
    text, ids = getattr(args, "text", None), getattr(args, "ids", None)
    note = None
    if text is None and ids is None:
        text, note = SAMPLE_TEXT, f"no --text given: the sample text shipped with nnef-kv ({SAMPLE_TEXT.name})"
    src = token_source(text=text, ids=ids, tokenizer=getattr(args, "tokenizer", None), archive=archive, names=names)
    if note:
        src.notes.insert(0, note)
    return src


def _add_source(sp: argparse.ArgumentParser) -> None:
    g = sp.add_argument_group("tokens (one of; default: the sample text shipped with nnef-kv)")
    g.add_argument("--text", help="UTF-8 text file")
    g.add_argument("--ids", help=".npy or text file of token ids (no tokenizer needed)")
    g.add_argument("--tokenizer", help="tokenizer.json (or a folder holding one); default: found next to the archive")


def _add_runner(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--jobs", type=int, help="parallel jobs on a local process pool (default: the cores)")
    sp.add_argument("--ray", metavar="ADDRESS", help="run the jobs on a Ray cluster: its address, 'auto' (the cluster "
                                                     "this machine belongs to) or 'local' (start one here)")


# ---------------------------------------------------------------------------------------------- compare
def cmd_compare(args: argparse.Namespace) -> int:
    from .converters import frontends
    from .progress import progress_enabled
    from .validate.compare import DEFAULT_SCHEMES, CompareOptions, compare_model, parse_specs
    from .validate.compare_report import render_table, write_compare_report

    src = _path(args.archive, "archive")
    specs = parse_specs(args.schemes or DEFAULT_SCHEMES)
    opts = CompareOptions(contexts=_ints(args.context, "--context"),
                          eval_tokens=_positive(args.eval_tokens, "--eval-tokens"),
                          chunk=_positive(args.chunk, "--chunk"), tract=not args.no_tract,
                          windows=_positive(args.windows, "--windows"),
                          windows_seed=_positive(args.windows_seed, "--windows-seed", 0) or 0, baseline=args.baseline)
    jobs = _positive(args.jobs, "--jobs")
    out = _report_dir(args.report_dir, inputs=(src,))
    if args.ray is not None and jobs is not None:
        raise InputError("--jobs and --ray: give one (Ray schedules the jobs on its cluster's CPUs)")
    source = _source(args, src)
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
    return 130 if rep.interrupted else 0


def _add_compare(sub: Any) -> None:
    from .validate.compare import DEFAULT_SCHEMES

    sp = sub.add_parser("compare", help="every KV scheme on your f32 archive and text, side by side",
                        description="Converts the f32 archive under each scheme in memory and measures each as "
                                    "'validate' does (same contexts, stepwise teacher forcing, KL / ppl / same-top "
                                    "figures, KV bytes held); one table ordered by KV bytes, a failing scheme is a row "
                                    "with its reason. Schemes: NAME[:BITS][+option=value...], e.g. kivi:4, kivi:4/2 "
                                    "(key/value bits), kivi:4+key_axis=token, q8_0, q4_0/q8_0 (llama.cpp -ctk/-ctv), "
                                    "hf:4, hf:4+backend=hqq, tract, tract-cache:8.")
    sp.add_argument("archive", help="the f32 decoder (NNEF folder, .tar, .tgz, or .onnx)")
    _add_source(sp)
    sp.add_argument("--schemes", help=f"comma-separated schemes (default: {DEFAULT_SCHEMES})")
    sp.add_argument("--context", help="context lengths L1,L2,... (default: validate's rule: 8 x the schemes' largest "
                                      "full-precision window, at least 256, capped by the model and text)")
    sp.add_argument("--eval-tokens", type=int, default=None,
                    help="predictions measured per window and context (default 512, capped by the model and the text)")
    sp.add_argument("--windows", type=int, default=None,
                    help="disjoint windows of the text, the same tokens for every scheme and context (default: 4, "
                         "or as many as the text holds)")
    sp.add_argument("--windows-seed", type=int, default=0,
                    help="0: windows spread evenly over the text; another: placed at random by this seed")
    sp.add_argument("--baseline", metavar="SCHEME",
                    help="the row each KL difference is measured against, paired on the same tokens (one of "
                         "--schemes, as written; default: the row of lowest mean KL)")
    sp.add_argument("--chunk", type=int, help="prefill in calls of N tokens (default: one call)")
    sp.add_argument("--report-dir", help="write report.md, report.json and report.png (Pareto plot) here")
    sp.add_argument("--no-tract", action="store_true", help="do not try tract on the converted archives")
    _add_runner(sp)


# ---------------------------------------------------------------------------------------------- wiring
def add_commands(sub: Any, commands: dict[str, Callable[[argparse.Namespace], int]]) -> None:
    """Add ``compare`` (parser and handler) and ``convert``'s ``--auto-bits`` flags to the CLI (``cmd_convert``
    hands ``--auto-bits`` to :func:`cmd_auto_bits`)."""
    _add_compare(sub)
    commands["compare"] = cmd_compare
    _add_auto_bits(sub.choices["convert"])


# ---------------------------------------------------------------------------------------------- auto-bits
_AUTO_ONLY = ("max_kl", "match_uniform_kl", "text", "ids", "tokenizer", "context", "eval_tokens", "jobs", "ray",
              "report_dir", "windows", "windows_seed", "ladder", "layer_groups")


def _add_auto_bits(sp: argparse.ArgumentParser) -> None:
    g = sp.add_argument_group("--auto-bits: bits per layer (and per K and V) meeting a KL budget with the fewest KV "
                              "bytes, measured on a text (see nnef_kv/validate/autobits.py)")
    g.add_argument("--auto-bits", action="store_true", help="choose --layer-bits for --scheme (kivi, ggml, hf, "
                                                            "tract-cache) by measuring")
    g.add_argument("--max-kl", type=float, help="the budget: mean KL(p_ref || p) in nats at the context")
    g.add_argument("--match-uniform-kl", action="store_true", default=None,
                   help="also never above the KL of the best uniform setting within the budget")
    g.add_argument("--text", help="UTF-8 text file (default: the sample text shipped with nnef-kv)")
    g.add_argument("--ids", help=".npy or text file of token ids")
    g.add_argument("--tokenizer", help="tokenizer.json (or a folder holding one); default: found next to the input")
    g.add_argument("--context", help="the context length measured (default: validate's rule: 8 x the scheme's "
                                     "full-precision window, at least 256, capped by model and text)")
    g.add_argument("--eval-tokens", type=int, help="predictions measured per window (default 512, capped)")
    g.add_argument("--windows", type=int, help="disjoint windows of the text: the first half (rounded up) chosen on, "
                                               "the rest held out (default: 4, or as many as the text holds; >= 2)")
    g.add_argument("--windows-seed", type=int, help="0 (default): windows spread evenly; another: placed at random")
    g.add_argument("--ladder", help="the levels searched, comma-separated, a subset of the scheme's (default: all: "
                                    "kivi 2,3,4,5,6,8; ggml q4_0,iq4_nl,q4_1,q5_0,q5_1,q8_0; ...)")
    g.add_argument("--layer-groups", type=int, help="units of consecutive layers sharing a setting (default: one "
                                                    "layer a unit up to 8 layers, else 8 groups; each unit costs "
                                                    "a run per lower level)")
    g.add_argument("--report-dir", help="write report.md and report.json of the choice here (default: beside the "
                                        "output, OUTPUT.auto-bits.md / .json)")
    _add_runner(g)


def cmd_auto_bits(args: argparse.Namespace) -> int:
    from .atomic import atomic_write
    from .converters import convert, frontends
    from .converters.options import from_arguments
    from .io.archive import save
    from .progress import progress_enabled
    from .validate.autobits import auto_bits, pick_ladder, scheme_ladder
    from .validate.autobits_report import render_json, render_markdown, render_text
    from .validate.compare import CompareOptions

    if args.max_kl is None:
        raise InputError("--auto-bits: give the budget, --max-kl X (mean KL in nats)")
    if not args.max_kl >= 0 or args.max_kl == float("inf"):
        raise InputError(f"--max-kl {args.max_kl}: " + ("not a number" if args.max_kl != args.max_kl else
                                                        "must be a finite number >= 0"))
    if args.layer_bits:
        raise InputError("--layer-bits and --auto-bits: give one (--auto-bits chooses the layer bits)")
    opts = from_arguments(args)
    src = _path(args.input, "input")
    from .cli_io import output_model
    from .targets import check_file

    out, _ = output_model(args.output, "-o", [src])  # refused before any work: what save would refuse
    out = Path(args.output)
    rd = _report_dir(args.report_dir, files=("report.md", "report.json"), inputs=(src,))
    if rd is None:
        for name in (f"{out.name}.auto-bits.md", f"{out.name}.auto-bits.json"):
            check_file(out.parent / name, "the auto-bits report", inputs=[src])
    contexts = _ints(args.context, "--context")
    copts = CompareOptions(contexts=contexts, eval_tokens=_positive(args.eval_tokens, "--eval-tokens"),
                           tract=False, windows=_positive(args.windows, "--windows", 2),
                           windows_seed=_positive(args.windows_seed, "--windows-seed", 0) or 0)
    jobs = _positive(args.jobs, "--jobs")
    if args.ray is not None and jobs is not None:
        raise InputError("--jobs and --ray: give one")
    scheme = opts.scheme
    values = {k: v for k, v in opts.values().items() if k in opts.scheme_object.option_names}
    ladder = None if args.ladder is None else [x for x in args.ladder.split(",") if x.strip()]
    if ladder is not None:  # refused before any work
        pick_ladder(scheme, scheme_ladder(scheme, values)[0], ladder)
    source = _source(args, src)
    model = frontends.load(src)
    res = auto_bits(model, source, scheme, values, float(args.max_kl), copts, str(src), jobs=jobs, ray=args.ray,
                    names=_NAMES, show_progress=progress_enabled(),
                    match_uniform=bool(args.match_uniform_kl),
                    ladder=ladder,
                    groups=_positive(args.layer_groups, "--layer-groups"))
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
        return 1
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
    return 0


def auto_bits_requested(args: argparse.Namespace) -> bool:
    """``convert``: whether ``--auto-bits`` was given; an auto-bits option without it is refused (one line)."""
    if getattr(args, "auto_bits", False):
        return True
    given = [k for k in _AUTO_ONLY if getattr(args, k, None) is not None]
    if given:
        raise InputError(f"--{given[0].replace('_', '-')}: only with --auto-bits")
    return False
