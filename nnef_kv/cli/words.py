"""The words the command line prints for convert, demo and generate (issue 23.11): the scheme and what its op
stores, the demo rows that read nothing quantized, the demo decoder's size check, the kernels' compile note."""
from __future__ import annotations

import sys
from typing import Any

from ..limits import current_limits
from .args import CliError


def scheme_phrase(opts: Any) -> str:
    """``kivi, 4 bits``, ``kivi, 1 bit``, ``tract, 8 bits (fixed)``, ``ggml, cache types q4_0/q8_0 (keys/values)``,
    ``hf (hqq backend), 4 bits``: the scheme and what its op stores, as the convert line says it."""
    options = opts.scheme_options
    text = opts.scheme_object.bits_text(options)
    backend = getattr(options, "backend", None)
    name = opts.scheme + (f" ({backend} backend)" if backend else "")
    head, _, rest = text.partition(" ")
    parts = head.split("/")
    if text.startswith("per layer "):
        numeric = not any(c.isalpha() for c in text[10:])
        return f"{name}, {'bits' if numeric else 'cache types'} per layer {text[10:]}"
    if all(p.isdigit() for p in parts):
        unit = "bit" if parts == ["1"] else "bits"
        return f"{name}, {head} {unit}" + (" (keys/values)" if len(parts) == 2 else "") + (f" {rest}" if rest else "")
    kind = "cache type" if len(set(parts)) == 1 else "cache types"
    return f"{name}, {kind} {parts[0] if len(set(parts)) == 1 else head}" + (" (keys/values)" if len(set(parts)) > 1
                                                                             else "")


def mark_unquantized(rows: list[Any]) -> list[str]:
    """Rows of a quantized-KV model whose evaluated tokens read no quantized entry get ``*`` after their model,
    and the reason ``validate`` gives (its failed "quantized entries read" check) is returned as a note."""
    notes: list[str] = []
    for row in rows:
        rep = row.report
        if rep is None or not rep.kv_ops:
            continue
        failed = [c for c in rep.checks if c.name == f"quantized entries read @ {row.context}" and not c.ok]
        if failed:
            row.label += " *"
            if not notes:
                notes.append(f"* {failed[0].detail}")
    return notes


def demo_size(cfg: Any) -> None:
    """Refuse a demo decoder whose weights would be over the limits (before it is built)."""
    lim = current_limits()
    emb, mlp, att = cfg.vocab * cfg.hidden, cfg.hidden * cfg.mlp, cfg.heads * cfg.head_dim * cfg.hidden
    mats = {f"--vocab {cfg.vocab} x --hidden {cfg.hidden}": emb, f"--hidden {cfg.hidden} x --mlp {cfg.mlp}": mlp,
            f"--heads {cfg.heads} x --head-dim {cfg.head_dim} x --hidden {cfg.hidden}": att}
    name, biggest = max(mats.items(), key=lambda kv: kv[1])
    total = 4 * (2 * emb + cfg.layers * (3 * mlp + 4 * att))
    if 4 * biggest > lim.max_tensor_bytes:
        raise CliError(f"{name}: one weight of the demo decoder would take {4 * biggest} bytes, over "
                       f"max_tensor_bytes={lim.max_tensor_bytes}")
    if total > lim.max_archive_bytes:
        raise CliError(f"--layers {cfg.layers}: the demo decoder's weights would take about {total} bytes, over "
                       f"max_archive_bytes={lim.max_archive_bytes}")


def compiled() -> float:
    """Seconds the numba kernels spent compiling in this process (their first run on a machine)."""
    from ..kernels import compile_seconds

    return compile_seconds()


def note_compiling(message: str) -> None:
    print(f"note: {message} (numba keeps them in its on-disk cache)", file=sys.stderr, flush=True)


def note_lost_window(model: Any, path: Any, said: set[str] | None = None) -> None:
    """``note: ...`` on stderr when the ``config.json`` beside the archive declares a sliding window the graph's
    masks do not hold (:func:`~nnef_kv.converters.exported.lost_window_note`); a note already in ``said`` is not
    repeated."""
    from ..converters.exported import lost_window_note

    note = lost_window_note(model, path)
    if note and note not in (said if said is not None else ()):
        print(f"note: {note}", file=sys.stderr)
        if said is not None:
            said.add(note)
