"""``nnef-kv validate``: what the quantized KV cache costs on real text, against the f32 reference (KL, top-1
agreement, perplexity, attention deviation, KV bytes), with thresholds a verdict PASS/FAIL (exit 1 on FAIL)."""
from __future__ import annotations

import argparse
from typing import Any

from .args import EXIT_CHECK_FAILED, EXIT_OK, existing_path, output_folder, parse_contexts
from .measure import NAMES, add_measure_options, token_source
from .words import note_lost_window


def add_parser(sub: Any) -> None:
    sp = sub.add_parser("validate", help="what the quantized KV cache costs on real text, against the f32 reference",
                        description="For each --context L: prefill the first L tokens of the text, teacher-force the "
                                    "next --eval-tokens N stepwise, in the archive and in the reference; report KL, "
                                    "top-1 agreement, perplexity, attention deviation, tokens held quantized and KV "
                                    "bytes. Verdict MEASURED without thresholds, PASS/FAIL with them; exit 1 when a "
                                    "check fails (also when no evaluated token read a quantized entry).")
    sp.add_argument("archive")
    sp.add_argument("--reference", help="the f32 archive the one under test was converted from (same weights)")
    add_measure_options(sp, prompt=True, chunk=True, report="write report.json, report.md and report.png here")
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


_VALIDATE_NAMES = {**NAMES, "max_kl": "--max-kl", "min_token_agreement": "--min-token-agreement",
                   "max_ppl_ratio": "--max-ppl-ratio", "max_attention_deviation": "--max-attention-deviation",
                   "parity_atol": "--parity-atol", "parity_rtol": "--parity-rtol", "reference": "--reference"}


def _validate_options(args: argparse.Namespace) -> Any:
    from ..validate.runner import ValidateOptions

    return ValidateOptions(
        contexts=parse_contexts(args.context), eval_tokens=args.eval_tokens, windows=args.windows,
        windows_seed=args.windows_seed, chunk=args.chunk, max_kl=args.max_kl,
        min_token_agreement=args.min_token_agreement, max_ppl_ratio=args.max_ppl_ratio,
        max_attention_deviation=args.max_attention_deviation, parity=not args.no_parity,
        parity_atol=args.parity_atol, parity_rtol=args.parity_rtol,
        allow_different_weights=args.allow_different_weights,
    ).check(_VALIDATE_NAMES)


def _print_validation(rep: Any) -> None:
    from ..validate.report import format_summary

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
    from ..io.archive import load
    from ..progress import progress_bar
    from ..validate.report import write_report
    from ..validate.runner import validate_model

    opts = _validate_options(args)
    src = existing_path(args.archive)
    ref_path = existing_path(args.reference) if args.reference else None
    if args.report_dir:
        output_folder(args.report_dir, "--report-dir", files=("report.json", "report.md", "report.png"),
                      inputs=[src] + ([ref_path] if ref_path else []))
    from ..validate.api import tokenizer_beside

    args.tokenizer, tok_note = tokenizer_beside(args.tokenizer, str(src), str(ref_path) if ref_path else None,
                                                args.ids is None)
    source = token_source(args, src, default_text=True)
    if tok_note:
        source.notes.append(tok_note)
    model = load(src)
    reference = load(ref_path) if ref_path else None
    said: set[str] = set()
    for m, p in ((model, src), (reference, ref_path)):
        if m is not None:
            note_lost_window(m, p, said)
    with progress_bar(f"validating {src.name}", total=None) as advance:
        rep = validate_model(model, reference, source, opts, progress=advance, path=str(src), names=_VALIDATE_NAMES)
    _print_validation(rep)
    if args.report_dir:
        paths = write_report(rep, args.report_dir)
        print(f"report: {', '.join(str(p) for p in paths)}")
    return EXIT_OK if rep.ok else EXIT_CHECK_FAILED
