"""The options of the commands that measure on a text (``validate``, ``compare``, ``convert --auto-bits``), declared
once by :func:`add_measure_options`, and what they are read into: the tokens, the context lengths, the
``--report-dir`` folder. ``--jobs`` / ``--ray`` (:func:`add_jobs_options`) are compare's and auto-bits'."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..errors import InputError, clip
from .args import INT_MAX, CliError, int_at_least, output_folder, parse_ids

#: the option of each measuring field, for the error messages of nnef_kv.validate
NAMES = {"contexts": "--context", "eval_tokens": "--eval-tokens", "windows": "--windows",
         "windows_seed": "--windows-seed", "chunk": "--chunk"}

SAMPLE = "the sample text shipped with nnef-kv"


def add_measure_options(parser: Any, *, report: str, group: Any = None, prompt: bool = False, chunk: bool = False,
                        one_context: bool = False, windows_seed: int | None = 0, windows_note: str = "",
                        model: str = "the archive") -> None:
    """``--text`` (``--prompt`` with ``prompt``), ``--ids``, ``--tokenizer``, ``--context``, ``--eval-tokens``,
    ``--windows``, ``--windows-seed`` (its default: ``windows_seed``), ``--chunk`` (with ``chunk``) and
    ``--report-dir`` (its help: ``report``) on ``parser``. The token options go in a group of their own, unless
    ``group`` is given: then every option goes there. ``one_context``: ``--context`` takes one length;
    ``windows_note``: what the command does with the windows; ``model``: where a tokenizer is looked for."""
    tokens = group if group is not None else parser.add_argument_group(f"tokens (one of; default: {SAMPLE})")
    rest = group if group is not None else parser
    tokens.add_argument("--text", help="UTF-8 text file" + (f" (default: {SAMPLE})" if group is not None else ""))
    if prompt:
        tokens.add_argument("--prompt", help="text given on the command line")
    tokens.add_argument("--ids", help=".npy or text file of token ids (no tokenizer needed)")
    tokens.add_argument("--tokenizer", help=f"tokenizer.json (or a folder holding one); default: found next to {model}")
    rest.add_argument("--context", help=("the context length measured" if one_context else "context lengths L1,L2,...")
                      + " (default: 8 x the largest full-precision window of the KV caches measured, at least 256, "
                        "capped by the model and the text)")
    rest.add_argument("--eval-tokens", type=int, default=None,
                      help="predictions measured per window and context (default 512, capped by the model and the "
                           "text)")
    rest.add_argument("--windows", type=int, default=None,
                      help="disjoint windows of the text, each prefilled to the context then teacher-forced, the same "
                           "tokens at every context and scheme" + (f"; {windows_note}" if windows_note else "")
                           + " (default: 4, or as many as the text holds)")
    rest.add_argument("--windows-seed", type=int, default=windows_seed,
                      help="0 (default): windows spread evenly over the text; another: placed at random by this seed")
    if chunk:
        rest.add_argument("--chunk", type=int, help="prefill in calls of N tokens (default: one call)")
    rest.add_argument("--report-dir", help=report)


def add_jobs_options(parser: Any) -> None:
    """``--jobs N`` / ``--ray ADDRESS``: where compare's and auto-bits' jobs run."""
    parser.add_argument("--jobs", type=int, help="parallel jobs on a local process pool (default: the cores)")
    parser.add_argument("--ray", metavar="ADDRESS", help="run the jobs on a Ray cluster: its address, 'auto' (the "
                                                         "cluster this machine belongs to) or 'local' (start one here)")


# ---------------------------------------------------------------------------------------------- values
def token_source(args: argparse.Namespace, src: Path, *, default_text: bool) -> Any:
    """The tokens of ``--text``/``--prompt``/``--ids``/``--prompt-ids`` (``--tokenizer`` or the one found next
    to the archive); with none given and ``default_text``, the shipped sample text."""
    from ..text import SAMPLE_TEXT, token_source

    names = {"text": "--text", "prompt": "--prompt", "ids": "--ids", "tokenizer": "--tokenizer"}
    text, prompt, ids = getattr(args, "text", None), getattr(args, "prompt", None), getattr(args, "ids", None)
    if getattr(args, "prompt_ids", None) is not None:
        if text is not None or prompt is not None or ids is not None:
            raise CliError("--prompt-ids: give only one of --prompt-ids, --prompt, --text or --ids")
        got = parse_ids(args.prompt_ids)
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


def lengths(text: str | None, flag: str, low: int = 1) -> list[int] | None:
    """compare's and auto-bits' ``--context L1,L2,...`` (validate's: :func:`nnef_kv.cli.args.parse_contexts`)."""
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


def positive(value: Any, flag: str, low: int = 1) -> Any:
    """An optional integer option: None, or an integer >= ``low``."""
    return None if value is None else int_at_least(flag, value, low)


def report_dir(value: str | None, files: tuple[str, ...] = ("report.md", "report.json", "report.png"),
               inputs: tuple[Any, ...] = ()) -> Path | None:
    """``--report-dir``: absent or a folder nnef-kv can write in, its report files absent or regular (checked
    before any work: :func:`nnef_kv.cli.args.output_folder`)."""
    return None if value is None else output_folder(value, "--report-dir", files=files, inputs=inputs)
