"""Per-layer settings of a KV scheme: ``--layer-bits 8,4,4,2`` (one entry per attention layer, in graph
order) or ``0:8,3:2`` (``layer:entry`` pairs; the layers not named take the scheme's uniform setting).

An entry is one value for the layer's keys and values (``4``), or ``KEY/VALUE`` (``8/4``: keys 8 bits,
values 4) for the schemes whose keys and values can differ. What a value is depends on the scheme:
a bit width (``kivi``, ``hf``, ``tract-cache``) or a llama.cpp cache type (``ggml``: ``q8_0``,
``q4_0/q8_0``). A scheme's ``check`` parses the text with :func:`parse` (the values checked by the
scheme's own rule) and :func:`count_problem` checks it against the number of layers the converter
found; ``make_attributes`` reads one layer's entry with :func:`entry_for`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..kv.settings import Problem

__all__ = ["LayerSpec", "parse", "entry_for", "count_problem", "format_spec"]

NAME = "layer_bits"


@dataclass(frozen=True)
class LayerSpec:
    """A parsed ``--layer-bits``: ``entries`` (key value, value value) per listed layer; ``indexed``:
    given as ``layer:entry`` pairs (else one entry per layer, in order)."""

    entries: dict[int, tuple[object, object]]
    indexed: bool

    @property
    def empty(self) -> bool:
        return not self.entries


def parse(text: object, value: Callable[[str], object], split_kv: bool, what: str = "bits") -> LayerSpec | Problem:
    """``text`` -> :class:`LayerSpec`, or the :class:`Problem` of its first bad entry. ``value`` turns one
    value's text into the scheme's value (raising ``ValueError`` with the reason); ``split_kv``: the
    scheme takes ``KEY/VALUE`` entries."""
    if text is None or text == "":
        return LayerSpec({}, False)
    if not isinstance(text, str):
        return Problem(NAME, text, "expected text such as 8,4,4,2 or 0:8,3:2")
    parts = [p.strip() for p in text.replace(" ", ",").split(",") if p.strip()]
    if not parts:
        return Problem(NAME, text, "no entry given")
    indexed = [":" in p for p in parts]
    if any(indexed) and not all(indexed):
        return Problem(NAME, text, "give one entry per layer (8,4,4,2) or layer:entry pairs (0:8,3:2), not both")
    entries: dict[int, tuple[object, object]] = {}
    for i, part in enumerate(parts):
        layer = i
        body = part
        if indexed[i]:
            head, _, body = part.partition(":")
            if not head.strip().isdigit():
                return Problem(NAME, text, f"entry {part!r}: the layer before ':' must be an integer >= 0")
            layer = int(head)
            if layer in entries:
                return Problem(NAME, text, f"layer {layer} given twice")
        halves = body.split("/")
        if len(halves) > 2 or (len(halves) == 2 and not split_kv):
            why = "KEY/VALUE entries are not taken by this scheme (keys and values share one setting)" \
                if len(halves) == 2 else "at most one '/' (KEY/VALUE)"
            return Problem(NAME, text, f"entry {part!r}: {why}")
        try:
            vals = [value(h.strip()) for h in halves]
        except ValueError as exc:
            return Problem(NAME, text, f"entry {part!r}: {exc}")
        entries[layer] = (vals[0], vals[-1])
    return LayerSpec(entries, all(indexed))


def entry_for(spec: LayerSpec, layer: int, default: tuple[object, object]) -> tuple[object, object]:
    """(key, value) setting of ``layer``: its entry, or ``default`` when the spec does not name it."""
    return spec.entries.get(layer, default)


def count_problem(spec: LayerSpec, text: str, layers: int, what: str = "attention layers") -> Problem | None:
    """The spec against the ``layers`` the converter found: one entry per layer, or indices below it."""
    if spec.empty:
        return None
    if spec.indexed:
        top = max(spec.entries)
        if top >= layers:
            return Problem(NAME, text, f"layer {top} named, the graph has {layers} {what} (0..{layers - 1})")
        return None
    if len(spec.entries) != layers:
        return Problem(NAME, text, f"{len(spec.entries)} entries for {layers} {what} (one per layer, or "
                                   f"layer:entry pairs)")
    return None


def format_spec(entries: list[tuple[object, object]]) -> str:
    """One entry per layer, as ``--layer-bits`` reads it back (``8,4/2,4``)."""
    return ",".join(str(k) if k == v else f"{k}/{v}" for k, v in entries)
