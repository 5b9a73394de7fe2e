"""The ``nnef-kv`` command line (also ``python -m nnef_kv``).

Commands: ``inspect``, ``convert``, ``run``, ``generate``, ``validate``, ``demo``, ``compare`` (``nnef-kv COMMAND -h``).

Errors are one readable line on stderr and exit code 2 (no traceback unless ``--debug``, accepted
anywhere on the line). Option values are checked before any work, so a refused command writes nothing.
``validate`` exits 1 when a check or a threshold given on the command line is not met.

``run`` input convention (``--inputs io.npz``): a key ``NAME`` is fed to graph input ``NAME`` at every
step; ``NAME@K`` is fed at step ``K`` only (0-based) and wins over ``NAME``. The number of steps is
``--steps`` or else ``1 + the largest K``. An explicit cache input (``in_cache_*``...) missing at a step is
fed from the previous step's matching output (``out_cache_*``), empty at step 0. Keys named like a
graph *output* are taken as expected values: the max |difference| is printed next to the stats.
With ``-o out.npz`` the outputs are saved under the same convention (``NAME`` for one step, else
``NAME@K``).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from .errors import NnefKvError
from .limits import Limits, current_limits, using_limits

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class CliError(NnefKvError):
    """A bad command line (missing file, bad option value)."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit code 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


# ----------------------------------------------------------------------------------------------
# option checks (before any work)
# ----------------------------------------------------------------------------------------------
def _existing_path(value: str) -> Path:
    p = Path(value)
    if not p.exists():
        raise CliError(f"{value}: no such file or folder")
    return p


def _int_at_least(name: str, value: Any, low: int) -> int:
    if value is None or isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise CliError(f"{name} {value}: must be an integer >= {low}")
    return value


def _fraction(name: str, value: float | None, low: float = 0.0, high: float = math.inf) -> float | None:
    if value is None:
        return None
    if not (math.isfinite(value) or value == math.inf) or not low <= value <= high:
        bound = f"in [{low:g}, {high:g}]" if math.isfinite(high) else f">= {low:g}"
        raise CliError(f"{name} {value}: must be {bound}")
    return value


def _parse_ids(text: str | None, what: str = "--prompt-ids") -> list[int] | None:
    if text is None:
        return None
    parts = [t for t in text.replace(" ", ",").split(",") if t]
    if not parts:
        raise CliError(f"{what}: no token ids given")
    ids = []
    for t in parts:
        try:
            v = int(t)
        except ValueError:
            raise CliError(f"{what}: {t!r} is not an integer token id") from None
        if v < 0:
            raise CliError(f"{what}: token id {v} is negative")
        if v >= 1 << 63:
            raise CliError(f"{what}: token id {t[:30]} is too large")
        ids.append(v)
    return ids


def _check_output_path(out: str, inputs: Sequence[Path]) -> Path:
    p = Path(out)
    for i in inputs:
        try:
            if p.exists() and p.resolve() == i.resolve():
                raise CliError(f"{out}: the output would overwrite the input")
        except OSError:
            pass
    if p.exists() and p.is_dir() and not (p / "graph.nnef").exists() and any(p.iterdir()):
        raise CliError(f"{out}: a non-empty folder that is not a model archive; refusing to replace it")
    return p


# ----------------------------------------------------------------------------------------------
# commands
# ----------------------------------------------------------------------------------------------
def cmd_inspect(args: argparse.Namespace) -> int:
    from .io.archive import load
    from .summary import summarize

    from .converters.attention import exporter_problems
    from .converters.graph_edit import GraphEdit

    src = _existing_path(args.archive)
    model = load(src)
    if model.document.graph is not None:
        problems = exporter_problems(GraphEdit(model.document, model.tensors, str(src)))
        if problems:
            raise CliError(problems[0])
    print(summarize(model).to_text())
    return EXIT_OK


def cmd_convert(args: argparse.Namespace) -> int:
    from .converters import convert, frontends
    from .converters.options import from_arguments
    from .io.archive import save
    from .progress import progress_bar

    opts = from_arguments(args)
    src = _existing_path(args.input)
    out = _check_output_path(args.output, [src])
    t0 = time.perf_counter()
    with progress_bar(f"converting {src.name}", total=3) as advance:
        model = frontends.load(src)
        advance()
        converted, report = convert(model, **opts.as_dict())
        advance()
        save(converted, out)
        advance()
    for line in getattr(report, "attentions", []) or []:
        print(f"  {line}")
    bits = opts.scheme_object.bits_text(opts.scheme_options)
    print(f"converted {len(getattr(report, 'attentions', []) or [])} attention block(s) of {src} with scheme "
          f"{opts.scheme}, {bits} bits -> {out} ({time.perf_counter() - t0:.2f} s)")
    return EXIT_OK


def _npz_feeds(npz: dict[str, Any], inputs: list[str], outputs: list[str], where: str
               ) -> tuple[dict[str, Any], dict[int, dict[str, Any]], dict[str, Any], dict[int, dict[str, Any]], int]:
    """Split npz keys into (every-step inputs, per-step inputs, every-step expected, per-step expected, max K)."""
    common: dict[str, Any] = {}
    per: dict[int, dict[str, Any]] = {}
    exp_common: dict[str, Any] = {}
    exp_per: dict[int, dict[str, Any]] = {}
    last = -1
    for key, value in npz.items():
        name, _, step = key.partition("@")
        k: int | None = None
        if step:
            if not step.isdigit():
                raise CliError(f"{where}: key {key!r}: the step after '@' must be a non-negative integer")
            k = int(step)
            last = max(last, k)
        if name in inputs:
            (common if k is None else per.setdefault(k, {}))[name] = value
        elif name in outputs:
            (exp_common if k is None else exp_per.setdefault(k, {}))[name] = value
        else:
            raise CliError(f"{where}: key {key!r} names no graph input or output (inputs: {', '.join(inputs)})")
    return common, per, exp_common, exp_per, last


def _float_casts(feed: dict[str, Any], session: Any, casted: set[str], allowed: bool, where: Path) -> dict[str, Any]:
    """Float inputs cast to the float type the graph declares when ``allowed`` (tract's
    --allow-float-casts), each cast named once on stderr; else a float of another width is refused."""
    out = dict(feed)
    for spec in session.plan.inputs:
        x = out.get(spec.name)
        if x is None:
            continue
        a = np.asarray(x)
        want = np.dtype(spec.dtype)
        if a.dtype.kind == "f" and want.kind == "f" and a.dtype != want:
            if not allowed:
                raise CliError(f"{where}: input '{spec.name}' is {a.dtype}, the graph declares {want} "
                               f"(--allow-float-casts casts float inputs, as tract's flag does)")
            out[spec.name] = a.astype(want)
            if spec.name not in casted:
                casted.add(spec.name)
                print(f"note: --allow-float-casts: input '{spec.name}' {a.dtype} cast to {want}", file=sys.stderr)
    return out


def cmd_run(args: argparse.Namespace) -> int:
    import numpy as np

    from .atomic import atomic_write
    from .io.archive import load
    from .progress import progress_bar
    from .validate.decode import detect_signature

    if args.steps is not None:
        _int_at_least("--steps", args.steps, 1)
    src = _existing_path(args.archive)
    npz_path = _existing_path(args.inputs)
    out_path = _check_output_path(args.output, [src, npz_path]) if args.output else None
    try:
        with np.load(npz_path, allow_pickle=False) as z:
            npz = {k: z[k] for k in z.files}
    except (OSError, ValueError) as exc:
        raise CliError(f"{npz_path}: not a readable .npz file: {exc}") from None
    model = load(src)
    session = model.session()
    inputs, outputs = list(session.input_names), list(session.output_names)
    common, per, exp_common, exp_per, last = _npz_feeds(npz, inputs, outputs, str(npz_path))
    steps = args.steps if args.steps is not None else max(1, last + 1)
    try:
        sig = detect_signature(session.plan, str(src))
        feedback = dict(sig.cache_outputs) if sig.explicit else {}
        empty = sig.empty_caches() if sig.explicit else {}
    except NnefKvError:
        feedback, empty = {}, {}
    results: list[dict[str, Any]] = []
    prev: dict[str, Any] = {}
    casted: set[str] = set()
    with progress_bar(f"running {src.name}", total=steps) as advance:
        for k in range(steps):
            feed = dict(common)
            feed.update(per.get(k, {}))
            for name in inputs:
                if name in feed:
                    continue
                if name in feedback and (k > 0 or name in empty):
                    feed[name] = prev[feedback[name]] if k > 0 else empty[name]
                else:
                    raise CliError(f"{npz_path}: no value for input '{name}' at step {k} (keys '{name}' or "
                                   f"'{name}@{k}')")
            feed = _float_casts(feed, session, casted, args.allow_float_casts, npz_path)
            res = session.run(feed)
            results.append(res)
            prev = res
            advance()
    for k, res in enumerate(results):
        expected = dict(exp_common)
        expected.update(exp_per.get(k, {}))
        for name, arr in res.items():
            a = np.asarray(arr)
            line = f"step {k} {name}: {a.dtype} {list(a.shape)}"
            if a.size and a.dtype.kind in "fiub":
                af = a.astype(np.float64)
                nan = int(np.isnan(af).sum())
                fin = af[np.isfinite(af)]
                if fin.size:
                    line += f" min {fin.min():.6g} max {fin.max():.6g} mean {fin.mean():.6g}"
                line += f" NaN {nan}"
            if name in expected:
                e = np.asarray(expected[name])
                if e.shape == a.shape:
                    line += f" | max|diff| vs npz {float(np.max(np.abs(a.astype(np.float64) - e))) if a.size else 0.0:.3g}"
                else:
                    line += f" | npz has shape {list(e.shape)}"
            print(line)
    if out_path is not None:
        arrays = {}
        for k, res in enumerate(results):
            for name, arr in res.items():
                arrays[name if steps == 1 else f"{name}@{k}"] = np.asarray(arr)
        with atomic_write(out_path) as f:
            np.savez(f, **arrays)
        print(f"wrote {len(arrays)} arrays to {out_path}")
    return EXIT_OK


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
    source = _token_source(args, src, default_text=False)
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
    stopped = None
    try:
        logits = decoder(np.asarray(source.ids, np.int64))
        for i in range(n):
            tok = int(np.argmax(logits))
            show(tok)
            if i + 1 < n:
                logits = decoder(np.asarray([tok], np.int64))
    except KeyboardInterrupt:
        stopped = "interrupted"
    finally:
        if text_of is not None and produced:
            out.write(text_of(produced, final=True))
        out.write("\n")
        out.flush()
        dt = time.perf_counter() - t0
        kv = decoder.kv_bytes().get("total", 0)
        kind = "explicit cache" if decoder.sig.explicit else "session cache"
        print(f"{len(produced)} tokens in {dt:.2f} s ({len(produced) / dt if dt else 0:.1f} tok/s), {kind}, "
              f"KV {kv:,} bytes at {len(source.ids) + max(len(produced) - 1, 0)} positions"
              + (f" ({stopped})" if stopped else ""), file=sys.stderr)
    return EXIT_INTERRUPTED if stopped else EXIT_OK


_VALIDATE_NAMES = {"contexts": "--context", "eval_tokens": "--eval-tokens", "chunk": "--chunk", "max_kl": "--max-kl",
                   "min_token_agreement": "--min-token-agreement", "max_ppl_ratio": "--max-ppl-ratio",
                   "max_attention_deviation": "--max-attention-deviation", "parity_atol": "--parity-atol",
                   "parity_rtol": "--parity-rtol", "reference": "--reference"}


def _parse_contexts(text: str | None) -> list[int] | None:
    if text is None:
        return None
    out = []
    for part in [t for t in text.replace(" ", ",").split(",") if t]:
        try:
            out.append(int(part))
        except ValueError:
            raise CliError(f"--context {part!r}: a context is a number of tokens") from None
    if not out:
        raise CliError("--context: no context length given")
    return out


def _validate_options(args: argparse.Namespace) -> Any:
    from .validate.runner import ValidateOptions

    return ValidateOptions(
        contexts=_parse_contexts(args.context), eval_tokens=args.eval_tokens, chunk=args.chunk,
        max_kl=args.max_kl, min_token_agreement=args.min_token_agreement, max_ppl_ratio=args.max_ppl_ratio,
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
        rd = Path(args.report_dir)
        if rd.exists() and not rd.is_dir():
            raise CliError(f"{rd}: --report-dir exists and is not a folder")
    source = _token_source(args, src, default_text=True)
    model = load(src)
    reference = load(ref_path) if ref_path else None
    with progress_bar(f"validating {src.name}", total=None) as advance:
        rep = validate_model(model, reference, source, opts, progress=advance, path=str(src), names=_VALIDATE_NAMES)
    _print_validation(rep)
    if args.report_dir:
        paths = write_report(rep, args.report_dir)
        print(f"report: {', '.join(str(p) for p in paths)}")
    return EXIT_OK if rep.ok else EXIT_CHECK_FAILED


def cmd_demo(args: argparse.Namespace) -> int:
    from .models import DecoderConfig
    from .progress import progress_bar
    from .validate.demo import DemoOptions, bits_problem, format_table, run_demo

    bits = _parse_ids(args.bits, "--bits") or []
    for b in bits:
        if bits_problem(b):
            raise CliError(f"--bits {b}: {bits_problem(b)}")
    contexts = _parse_contexts(args.context) or []
    for c in contexts:
        _int_at_least("--context", c, 1)
    if args.report_dir and Path(args.report_dir).exists() and not Path(args.report_dir).is_dir():
        raise CliError(f"{args.report_dir}: --report-dir exists and is not a folder")
    cfg = DecoderConfig(vocab=_int_at_least("--vocab", args.vocab, 256), hidden=_int_at_least("--hidden", args.hidden, 1),
                        layers=_int_at_least("--layers", args.layers, 1), heads=_int_at_least("--heads", args.heads, 1),
                        kv_heads=_int_at_least("--kv-heads", args.kv_heads, 1),
                        head_dim=_int_at_least("--head-dim", args.head_dim, 2), mlp=_int_at_least("--mlp", args.mlp, 1),
                        seed=_int_at_least("--seed", args.seed, 0), cache=args.cache)
    cfg.validate()
    opts = DemoOptions(config=cfg, bits=tuple(bits), tract=not args.no_tract, contexts=tuple(contexts),
                       eval_tokens=_int_at_least("--eval-tokens", args.eval_tokens, 1), report_dir=args.report_dir,
                       key_group=_int_at_least("--key-group", args.key_group, 1),
                       value_group=_int_at_least("--value-group", args.value_group, 1),
                       residual=_int_at_least("--residual", args.residual, 0),
                       save_dir=args.save_dir)
    t0 = time.perf_counter()
    with progress_bar("demo: decoding and validating", total=None) as advance:
        rows = run_demo(opts, progress=advance)
    print(format_table(rows, opts))
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


def build_parser() -> argparse.ArgumentParser:
    from .cli_compare import add_commands
    from .converters.options import add_arguments as add_convert_arguments

    p = _Parser(prog="nnef-kv", description="NNEF archives with a quantized KV cache.")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors (accepted anywhere)")
    lim = p.add_argument_group("resource limits for untrusted archives (defaults: nnef_kv.limits.Limits)")
    lim.add_argument("--max-archive-bytes", type=int, help="decompressed bytes read from one archive")
    lim.add_argument("--max-tensor-bytes", type=int, help="payload bytes of one .dat tensor")
    lim.add_argument("--max-members", type=int, help="members (files) in one archive or folder")
    lim.add_argument("--max-nesting", type=int, help="nesting depth of expressions in NNEF text")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    sp = sub.add_parser("inspect", help="graph summary: inputs, outputs, op counts, parameter bytes, KV layout")
    sp.add_argument("archive", help="NNEF folder, .tar or .tgz")

    sp = sub.add_parser("convert", help="rewrite a decoder's attention/KV cache to a quantized KV cache")
    sp.add_argument("input", help="NNEF folder, .tar, .tgz, graph.nnef, or .onnx (converters/frontends)")
    sp.add_argument("-o", "--output", required=True, help="output archive (folder, .tar, .tgz)")
    add_convert_arguments(sp)  # --scheme and the schemes' flags (nnef_kv.kv.schemes)

    sp = sub.add_parser("run", help="run an archive on inputs from an .npz, one or several steps",
                        description="NPZ keys: NAME (every step) or NAME@K (step K). Missing explicit caches are fed "
                                    "back from the previous step's outputs (empty at step 0).")
    sp.add_argument("archive")
    sp.add_argument("--inputs", required=True, help=".npz of inputs (NAME or NAME@STEP keys)")
    sp.add_argument("-o", "--output", help="write outputs to this .npz")
    sp.add_argument("--steps", type=int, help="number of runs (default: 1 + the largest @STEP)")
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
    sp.add_argument("--max-new-tokens", type=int, default=16, help="tokens to generate (default 16)")

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
    src_group.add_argument("--tokenizer", help="tokenizer.json (or a folder holding one); default: found next to the archive")
    sp.add_argument("--context", help="context lengths L1,L2,... (default: 8 x the KV ops' full-precision window, "
                                      "at least 256, capped by the model and the text)")
    sp.add_argument("--eval-tokens", type=int, default=64, help="predictions measured per context (default 64)")
    sp.add_argument("--chunk", type=int, help="prefill in calls of N tokens (default: one call)")
    sp.add_argument("--report-dir", help="write report.json, report.md and report.png here")
    sp.add_argument("--max-kl", type=float, help="fail when the mean KL(p_ref||p) (nats) is above")
    sp.add_argument("--min-token-agreement", type=float, help="fail when the same-top-1 fraction is below (0..1)")
    sp.add_argument("--max-ppl-ratio", type=float, help="fail when ppl / ppl_reference is above")
    sp.add_argument("--max-attention-deviation", type=float, help="fail when the worst per-layer attention deviation is above")
    sp.add_argument("--no-parity", action="store_true", help="do not run tract")
    sp.add_argument("--parity-atol", type=float, help="tract parity tolerance, absolute (default f32 1e-4, f16 1e-3)")
    sp.add_argument("--parity-rtol", type=float, help="tract parity tolerance, x max |logit| (default f32 1e-3, f16 2e-2)")
    sp.add_argument("--allow-different-weights", action="store_true",
                    help="compare against a reference whose weights differ from the archive's")

    sp = sub.add_parser("demo", help="a built-in decoder, its KV cache quantized at several bit widths, validated on a text",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sp.add_argument("--bits", default="8,4,2", help="kivi bit widths")
    sp.add_argument("--no-tract", action="store_true", help="skip the tract scheme row")
    sp.add_argument("--context", default="256,1024", help="context lengths measured")
    sp.add_argument("--eval-tokens", type=int, default=64, help="teacher-forced predictions per context")
    sp.add_argument("--key-group", type=int, default=32, help="kivi: tokens per key group")
    sp.add_argument("--value-group", type=int, default=32, help="kivi: channels per value group")
    sp.add_argument("--residual", type=int, default=32, help="kivi: newest tokens kept in full precision")
    sp.add_argument("--vocab", type=int, default=256, help="vocabulary (>= 256: the text is read byte by byte)")
    sp.add_argument("--hidden", type=int, default=64, help="hidden size")
    sp.add_argument("--layers", type=int, default=2, help="layers")
    sp.add_argument("--heads", type=int, default=4, help="query heads")
    sp.add_argument("--kv-heads", type=int, default=2, help="key/value heads")
    sp.add_argument("--head-dim", type=int, default=16, help="head size")
    sp.add_argument("--mlp", type=int, default=128, help="MLP size")
    sp.add_argument("--seed", type=int, default=0, help="weights seed")
    sp.add_argument("--cache", default="explicit", choices=["explicit", "dyn"], help="how the f32 model holds its cache")
    sp.add_argument("--report-dir", help="write one validation report per model into this folder")
    sp.add_argument("--save-dir", help="keep the f32 and converted archives in this folder")
    add_commands(sub, COMMANDS)  # compare, convert --auto-bits (nnef_kv/cli_compare.py)
    return p


_LIMIT_FLAGS = ("max_archive_bytes", "max_tensor_bytes", "max_members", "max_nesting")


def _limits_from(args: argparse.Namespace) -> Limits:
    """The defaults, with every ``--max-*`` flag given on the command line applied (each must be >= 1)."""
    given = {k: getattr(args, k) for k in _LIMIT_FLAGS if getattr(args, k, None) is not None}
    for k, v in given.items():
        _int_at_least("--" + k.replace("_", "-"), v, 1)
    return dataclasses.replace(current_limits(), **given)


def main(argv: Sequence[str] | None = None) -> int:
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
        with using_limits(limits):
            return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print("nnef-kv: interrupted", file=sys.stderr)
        return 130
    except NnefKvError as exc:
        if debug:
            raise
        print(f"nnef-kv {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (OSError, MemoryError) as exc:
        if debug:
            raise
        print(f"nnef-kv {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:  # a bug: still one line; --debug shows the traceback
        if debug:
            raise
        print(f"nnef-kv {args.command}: internal error: {type(exc).__name__}: {exc} (rerun with --debug)",
              file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
