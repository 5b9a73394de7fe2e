"""``convert``: a decoder archive in, a quantized-KV archive out (see :mod:`.passes`)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .schemes import DEFAULT_SCHEME
from ..errors import ConversionError
from ..interpreter.catalog import ops_with
from .graph_edit import GraphEdit
from .options import ConvertOptions
from .caches import exporter_problems
from .masks import positions_bound
from .passes import (
    REWRITES,
    CacheShapeToSymbolPass,
    CleanupPass,
    ConversionContext,
    NormalizePass,
    PassReport,
    PositionBindingPass,
)



@dataclass
class ConversionReport:
    """What :func:`convert` did: the options, each pass's report, the attentions converted."""

    source: str
    options: ConvertOptions
    passes: list[PassReport] = field(default_factory=list)
    attentions: list[str] = field(default_factory=list)
    caches: list[str] = field(default_factory=list)  # cache schemes (tract-cache): the caches replaced
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    tensors_removed: list[str] = field(default_factory=list)

    @property
    def inputs_removed(self) -> list[str]:
        return [n for p in self.passes for n in p.inputs_removed]

    @property
    def outputs_removed(self) -> list[str]:
        return [n for p in self.passes for n in p.outputs_removed]

    @property
    def notes(self) -> list[str]:
        return [n for p in self.passes for n in p.notes]

    @property
    def changes(self) -> list[str]:
        """The notes on what the converted model computes differently (beyond its cache's quantization)."""
        return [n for p in self.passes for n in p.changes]

    def to_text(self) -> str:
        o = self.options
        head = [f"converted {self.source} with scheme {o.scheme} ({o.scheme_object.settings_text(o.scheme_options)})",
                f"attentions converted: {len(self.attentions)}"]
        head += [f"  {a}" for a in self.attentions]
        head.append(f"inputs: {', '.join(self.inputs)}; outputs: {', '.join(self.outputs)}")
        if self.tensors_removed:
            head.append(f"tensors no longer used, dropped: {len(self.tensors_removed)}")
        return "\n".join(head + [p.to_text() for p in self.passes if p.changed or p.notes])


def _load(model_or_path: Any) -> Any:
    if isinstance(model_or_path, (str, os.PathLike)):
        from .frontends import load

        return load(model_or_path)
    if not hasattr(model_or_path, "document"):
        raise ConversionError(f"convert: expected a Model or a path, got {type(model_or_path).__name__}")
    return model_or_path


def convert(model_or_path: Any, scheme: str = DEFAULT_SCHEME, **scheme_options: Any) -> tuple[Any, ConversionReport]:
    """Convert a decoder (``Model``, or a path any front end reads: :mod:`.frontends`) to a quantized-KV model.

    ``scheme`` names a :data:`nnef_kv.converters.schemes.SCHEMES` entry; the keywords are its options (an option left
    out or None takes the scheme's default: kivi's are bits 4, key_group 32, value_group 32, residual 32,
    sinks 0, ...; :attr:`Scheme.options` lists each scheme's).
    Returns a new :class:`~nnef_kv.Model` (the input is not modified) and a :class:`ConversionReport`.
    Raises :class:`~nnef_kv.errors.ConversionError` for a bad option (before any work), a graph
    with no attention the passes recognise, or attention without a KV cache.
    """
    options = ConvertOptions.of(scheme, **scheme_options)
    s = options.scheme_object
    model = _load(model_or_path)
    where = str(getattr(model, "source", None) or "<model>")
    tensors = getattr(model, "tensors", {}) or {}
    g = GraphEdit(model.document, tensors, where)
    ctx = ConversionContext(g, options)
    report = ConversionReport(where, options)
    problems = exporter_problems(g)
    if problems:
        raise ConversionError(problems[0])
    report.passes.append(NormalizePass().run(ctx))
    rewrite = REWRITES[s.rewrite]  # the scheme's rewrite pass
    report.passes.append(rewrite().run(ctx))
    done = rewrite.converted(ctx)
    if not done:
        quantized = ops_with(quantized=True)  # every op registered with a quantized KV state
        held = [(n.name, n.op) for n in g.nodes if n.op in quantized]
        if held:
            raise ConversionError(f"{where}: the graph already holds a quantized KV cache ({held[0][1]} "
                                  f"'{held[0][0]}'); nothing to convert")
        if ctx.misses:
            raise ConversionError(f"{where}: {ctx.misses[0].message()}; nothing to convert")
        raise ConversionError(f"{where}: {rewrite.nothing_found}; nothing to convert")
    report.passes.append(CacheShapeToSymbolPass().run(ctx))
    report.passes.append(PositionBindingPass().run(ctx))
    report.passes.append(CleanupPass().run(ctx, model))
    report.attentions = [b.describe() for b in (ctx.blocks or ctx.found)]
    report.caches = [f"{c.role}s: '{c.full}' ({c.kind})" for c in ctx.caches]
    report.passes[-1].notes.extend(s.notes(ctx.settings))
    doc = g.document()
    never = _never_quantized(s, ctx.settings, doc)
    if never:
        report.passes[-1].notes.append(never)
    new_model = _rebuild(model, doc, report)
    _check_runs(new_model, model, options, where)
    report.inputs = list(g.inputs)
    report.outputs = list(g.outputs)
    return new_model, report


def _never_quantized(s: Any, settings: Any, doc: Any) -> str | None:
    """The note for options that keep every token in full precision on this graph (the op's window is
    longer than the positions the graph holds), else None."""
    bound = positions_bound(doc)
    if s.window is None or bound is None:
        return None
    window = s.window(settings)
    if window <= bound[0]:
        return None
    return (f"never quantized: the op quantizes once it holds {window} tokens ({s.settings_text(settings)}), the "
            f"model holds at most {bound[0]} positions ({bound[1]}): every token stays in full precision")


def _check_runs(new_model: Any, model: Any, options: ConvertOptions, where: str) -> None:
    """The check ``nnef-kv inspect`` runs (build, one run on zeros: :func:`~nnef_kv.interpreter.check.check_model`),
    on the converted model: what the scheme's op would refuse at run time (ggml's head_dim not a multiple of 32,
    hf's group_size not dividing it) is refused now, with the op's reason, before anything is written. A failure
    the input model has as well is not the conversion's: it is left to the commands that run it; one that goes
    away with 2 or 4 tokens a symbol is a limit of short inputs, not of the archive."""
    from ..errors import NnefKvError
    from ..interpreter.check import check_model

    try:  # on the plan a session of the converted model will run (prepared and cached, as before issue 26)
        check_model(new_model, prepare_weights=True)
    except NnefKvError as exc:
        try:
            check_model(model, prepare_weights=True)
        except NnefKvError:
            return
        for more in (2, 4):  # a failure of one-token runs only (hqq packs rows in pairs) is not refused
            try:
                check_model(new_model, symbol_value=more, prepare_weights=True)
                return
            except NnefKvError:
                pass
        detail = str(exc)
        marker = "was refused: "
        if marker in detail:
            detail = detail.split(marker, 1)[1]
        if "node '" in detail:  # the location is the input's graph.nnef: the node names the converted graph's place
            detail = detail[detail.index("node '"):]
        op = options.scheme_object.op
        detail = detail.replace(f"({op}): {op}: ", f"({op}): ")
        raise ConversionError(f"{where}: scheme {options.scheme}: the converted graph cannot run ({detail}); "
                              f"nothing written") from None


def _rebuild(model: Any, doc: Any, report: ConversionReport) -> Any:
    """A copy of ``model`` with the new document and only the tensors its variables still read."""
    from ..io.archive import Model

    tensors = dict(getattr(model, "tensors", {}) or {})
    probe = Model(document=doc, tensors=tensors)
    used = {probe.resolve_label(lab) for lab in probe.variable_labels()}
    report.tensors_removed = sorted(k for k in tensors if k not in used)
    kept = {k: v for k, v in tensors.items() if k in used}
    if isinstance(model, Model):
        info = {k: v for k, v in model.tensor_info.items() if k in kept}
        return replace(model, document=doc, tensors=kept, tensor_info=info, text=None,
                       source=model.source)
    return Model(document=doc, tensors=kept, source=getattr(model, "source", None))


def convert_file(in_path: str | os.PathLike, out_path: str | os.PathLike, **options: Any) -> ConversionReport:
    """Convert the archive at ``in_path`` and write the result to ``out_path`` (folder, .tar, .tgz;
    written atomically by :func:`nnef_kv.save`). Returns the report."""
    from ..io.archive import save

    model, report = convert(in_path, **options)
    save(model, Path(out_path))
    return report
