"""``nnef-kv inspect``: the graph summary, after a check run (the graph built and run once on zeros)."""
from __future__ import annotations

from typing import Any

from .args import EXIT_OK, CliError, existing_path
from .words import note_lost_window


def add_parser(sub: Any) -> None:
    sp = sub.add_parser("inspect", help="graph summary: inputs, outputs, op counts, parameter bytes, KV layout",
                        description="Builds the graph and runs it once on zeros of the declared inputs (every symbol "
                                    "= 1) in a throwaway session that leaves the weights as the archive holds them "
                                    "(none transposed, joined or dequantized for it): the first error is reported "
                                    "with its file:line:col (exit 2); the outputs' dtypes and shapes are printed.")
    sp.add_argument("archive", help="NNEF folder, .tar, .tgz or graph.nnef")
    sp.add_argument("--no-check", action="store_true", help="the text summary only: no graph building, no check run")


def cmd_inspect(args: Any) -> int:
    """``nnef-kv inspect``: the summary, after the check run (build, one run on zeros) unless ``--no-check``."""
    from ..converters import frontends
    from ..converters.caches import refuse_exporter_problems
    from ..interpreter.check import check_model
    from ..io.archive import load
    from ..summary import summarize

    src = existing_path(args.archive)
    fe = frontends.detect(src)
    if fe is not None and fe.name != "nnef":
        raise CliError(f"{src}: {fe.kinds}; inspect reads NNEF models (a folder, .tar, .tgz or graph.nnef): convert it "
                       f"first (nnef-kv convert {src} -o {src.name.split('.')[0] or 'model'}.nnef.tgz)")
    model = frontends.load(src) if fe is not None else load(src)
    refuse_exporter_problems(model, str(src))  # a known exporter bug, explained
    if not args.no_check:  # the note evaluates the masks: graph building
        note_lost_window(model, src)
    checked = None if args.no_check or model.document.graph is None else check_model(model)
    print(summarize(model).to_text())
    if checked is not None:
        print(checked.to_text())
    return EXIT_OK
