"""``nnef_kv.validate(archive, reference, text=..., tokenizer=..., contexts=...)``: the Python face of
``nnef-kv validate``, returning the report object the command writes."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from ..errors import InputError
from .runner import ValidateOptions, ValidationReport, validate_model

__all__ = ["validate", "tokenizer_beside"]


def tokenizer_beside(tokenizer: Any, archive: str | None, reference: str | None, needed: bool) -> tuple[Any, str]:
    """The tokenizer to use: the one given, else none (found beside the archive by ``token_source``), else the
    one beside the reference (the export's folder) when none is beside the archive; and a note saying so."""
    if tokenizer is not None or not needed or reference is None:
        return tokenizer, ""
    from ..text import find_tokenizer

    if archive is not None and find_tokenizer(archive) is not None:
        return None, ""
    found = find_tokenizer(reference)
    if found is None:
        return None, ""
    return found, f"tokenizer found next to the reference: {found}"


def _model(x: Any, what: str) -> tuple[Any, str | None]:
    if isinstance(x, (str, os.PathLike)):
        from ..io.archive import load

        if not Path(x).exists():
            raise InputError(f"{what} {x}: no such file or folder")
        return load(x), os.fspath(x)
    if not hasattr(x, "document"):
        raise InputError(f"{what}: expected an archive path or an nnef_kv.Model, got {type(x).__name__}")
    return x, None


def validate(archive: Any, reference: Any = None, *, text: str | os.PathLike | None = None, prompt: str | None = None,
             ids: str | os.PathLike | Sequence[int] | None = None, tokenizer: Any = None,
             contexts: Sequence[int] | None = None, eval_tokens: int | None = None, windows: int | None = None,
             windows_seed: int = 0, chunk: int | None = None,
             max_kl: float | None = None, min_token_agreement: float | None = None,
             max_ppl_ratio: float | None = None, max_attention_deviation: float | None = None,
             parity: bool = True, parity_atol: float | None = None, parity_rtol: float | None = None,
             allow_different_weights: bool = False, report_dir: str | os.PathLike | None = None) -> ValidationReport:
    """Validate ``archive`` (a path or a Model) against ``reference`` (the f32 archive it was converted
    from) on ``text`` (a UTF-8 file), ``prompt`` (a string) or ``ids`` (a file or a list); with none of them,
    on the sample text shipped with nnef-kv. ``tokenizer``: a path, a ``tokenizers.Tokenizer``, or None (the
    ``tokenizer.json`` found next to the archive). Returns the :class:`ValidationReport` (``verdict``,
    ``contexts`` ...); ``report_dir`` also writes report.json/.md/.png there. Bad input raises
    :class:`~nnef_kv.errors.InputError` before any decoding."""
    from ..text import SAMPLE_TEXT, token_source
    from .report import write_report

    if contexts is not None and (isinstance(contexts, (str, bytes, int)) or not hasattr(contexts, "__iter__")):
        raise InputError(f"contexts={contexts!r}: a list of context lengths is expected (e.g. contexts=[128, 512])")
    options = ValidateOptions(contexts=list(contexts) if contexts is not None else None, eval_tokens=eval_tokens,
                              windows=windows, windows_seed=windows_seed, chunk=chunk, max_kl=max_kl,
                              min_token_agreement=min_token_agreement,
                              max_ppl_ratio=max_ppl_ratio, max_attention_deviation=max_attention_deviation,
                              parity=parity, parity_atol=parity_atol, parity_rtol=parity_rtol,
                              allow_different_weights=allow_different_weights).check()
    if report_dir is not None and Path(report_dir).exists() and not Path(report_dir).is_dir():
        raise InputError(f"report_dir {report_dir}: exists and is not a folder")
    model, path = _model(archive, "archive")
    ref = _model(reference, "reference")[0] if reference is not None else None
    note = None
    if text is None and prompt is None and ids is None:
        text = SAMPLE_TEXT
        note = f"no text given: the sample text shipped with nnef-kv ({SAMPLE_TEXT.name})"
    ref_path = os.fspath(reference) if isinstance(reference, (str, os.PathLike)) else None
    tokenizer, tok_note = tokenizer_beside(tokenizer, path, ref_path, text is not None or prompt is not None)
    source = token_source(text=text, prompt=prompt, ids=ids, tokenizer=tokenizer, archive=path)
    if tok_note:
        source.notes.append(tok_note)
    if note:
        source.notes.insert(0, note)
    rep = validate_model(model, ref, source, options, path=path)
    if report_dir is not None:
        write_report(rep, report_dir)
    return rep
