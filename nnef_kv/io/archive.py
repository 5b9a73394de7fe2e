"""The :class:`Model` (document + tensors + graph.quant + other resources) and ``load``/``save``.

A model archive is a folder, a tar or a gzip-compressed tar (gzip is recognised by its magic
bytes, whatever the suffix) holding ``graph.nnef``, an optional ``graph.quant`` and one ``.dat``
file per variable. As in tract, a tensor's label is its member path without the final ``.dat``
(labels may hold ``/``, dots, commas, parentheses), and ``variable(label = L)`` looks up ``L``,
then ``L`` without a leading ``/``.

Everything else is kept as bytes in :attr:`Model.resources` and written back by :func:`save`:
JSON files, nested model archives (``x.nnef.tar``/``x.nnef.tgz``), sub-model folders (every
member under ``x/`` when ``x/graph.nnef`` exists, the way tract groups them), reference files.

Saving writes ``nnef_kv.dump(model.document)`` (canonical text), so graph edits made by
converters are what gets saved; :attr:`Model.text` keeps the text as read, for display and
messages. Tensors keep the encoding they were read with (:class:`~nnef_kv.tensors.dat.DatInfo`) when it
still fits the value, so an untouched tensor is written back byte for byte.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ArchiveError, ArgumentError, GraphError, describe
from ..grammar import ast
from ..limits import Limits, current_limits
from ..targets import kind_of, path_arg
from .container import Buffer, Member, check_model_target, read_container, write_container
from ..tensors.dat import DatInfo, TensorValue, decode_tensor, encode_parts, info_fits
from .sniff import describe_file

if TYPE_CHECKING:  # pragma: no cover
    from ..interpreter.session import Session

__all__ = ["Model", "load", "save", "GRAPH_NNEF", "GRAPH_QUANT"]

GRAPH_NNEF = "graph.nnef"
GRAPH_QUANT = "graph.quant"


@dataclass
class Model:
    """An NNEF model in memory.

    ``document``: the parsed ``graph.nnef``; ``tensors``: label -> array (or
    :class:`~nnef_kv.tensors.blockquant.BlockQuantTensor`); ``quantization``: the parsed ``graph.quant``
    or None; ``source``: the path it was loaded from (for messages); ``text``/``quant_text``: the
    texts as read (None when built in code); ``resources``: other members, name -> bytes;
    ``tensor_info``: label -> the ``.dat`` encoding read (kept on save when it fits); ``limits``: the
    :class:`~nnef_kv.limits.Limits` given to :func:`load` (the defaults otherwise).

    Loaded arrays are read-only views into the archive's bytes (or memory map): copy before
    changing them in place, or assign a new array to ``tensors[label]``.
    """

    document: ast.Document
    tensors: dict[str, TensorValue] = field(default_factory=dict)
    quantization: ast.QuantDocument | None = None
    source: str | None = None
    text: str | None = None
    quant_text: str | None = None
    resources: dict[str, bytes] = field(default_factory=dict)
    tensor_info: dict[str, DatInfo] = field(default_factory=dict)
    limits: Limits = field(default_factory=current_limits, repr=False, compare=False)
    """The limits the model was loaded with; what graph building and running should apply to it too."""
    beside: dict[str, bytes] = field(default_factory=dict, repr=False, compare=False)
    """Files a front end asks to write beside the archive (a GGUF's ``tokenizer.json``); not members."""
    import_notes: list[str] = field(default_factory=list, repr=False, compare=False)
    """What a front end did that a user should know (types dequantized, defaults applied)."""

    # ------------------------------------------------------------------------------------------
    @classmethod
    def from_text(
        cls,
        text: str,
        tensors: dict[str, TensorValue] | None = None,
        quant_text: str | None = None,
        *,
        source: str | None = None,
    ) -> "Model":
        """A model from NNEF text (and optional graph.quant text) built in code."""
        from ..grammar import parse, parse_quant

        where = source or "<model>"
        doc = parse(text, filename=f"{where}/{GRAPH_NNEF}")
        quant = parse_quant(quant_text, filename=f"{where}/{GRAPH_QUANT}") if quant_text is not None else None
        return cls(document=doc, tensors=dict(tensors or {}), quantization=quant, source=source)

    @property
    def name(self) -> str:
        """What to call this model in messages."""
        return self.source or "<model>"

    def variable_labels(self) -> list[str]:
        """Labels of every ``variable(...)`` invocation with a literal label (graph and fragments), in order."""
        seen: dict[str, None] = {}
        doc = self.document
        bodies = [f.body for f in doc.fragments if f.body] + ([doc.graph.body] if doc.graph else [])
        for body in bodies:
            for inv in ast.invocations(body):
                if inv.name != "variable":
                    continue
                label = _label_of(inv)
                if label is not None:
                    seen.setdefault(label, None)
        return list(seen)

    def resolve_label(self, label: str) -> str | None:
        """The key of :attr:`tensors` that ``variable(label = label)`` reads, as tract looks it up."""
        if label in self.tensors:
            return label
        if label.startswith("/") and label[1:] in self.tensors:
            return label[1:]
        return None

    def tensor(self, label: str) -> TensorValue:
        """The tensor of a variable label; :class:`ArchiveError` naming the model and label if absent."""
        key = self.resolve_label(label)
        if key is None:
            raise ArchiveError(f"{self.name}: variable {label!r} has no tensor file ({label.lstrip('/')}.dat)")
        return self.tensors[key]

    def check_variables(self) -> None:
        """Every variable has its tensor, else :class:`ArchiveError` naming the model and the label."""
        missing = [lab for lab in self.variable_labels() if self.resolve_label(lab) is None]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ArchiveError(
                f"{self.name}: variable {missing[0]!r} has no tensor file ({missing[0].lstrip('/')}.dat){more}"
            )

    def load_submodel(self, label: str) -> "Model":
        """The model ``tract_core_submodel(label = ...)`` names: ``label.nnef.tgz`` / ``.nnef.tar`` or folder
        ``label/`` among this model's resources (or beside its source folder). ``label`` is a plain file
        name: no separator, no ``..``, no absolute path (it is resolved inside the model's folder)."""
        import shutil
        import tempfile

        if not isinstance(label, str) or not _plain_label(label):
            raise GraphError(f"sub-model label {label!r} is not a plain file name (no '/', '\\', '..' or "
                             f"absolute path)")

        resources: dict[str, bytes] = self.resources or {}
        tmp = Path(tempfile.mkdtemp(prefix="nnef-kv-submodel-"))
        try:
            for suffix in (".nnef.tgz", ".nnef.tar", ".nnef.tar.gz", ".tgz", ".tar"):
                if label + suffix in resources:
                    target = tmp / (label + suffix)
                    target.write_bytes(bytes(resources[label + suffix]))
                    return load(target)
            members = {k[len(label) + 1:]: v for k, v in resources.items() if k.startswith(label + "/")}
            if members:
                for name, data in members.items():
                    target = tmp / label / name
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(bytes(data))
                return load(tmp / label)
            source = self.source
            if source and Path(source).is_dir():
                for cand in (Path(source) / (label + ".nnef.tgz"), Path(source) / (label + ".nnef.tar"),
                             Path(source) / label):
                    if cand.exists():
                        return load(cand)
            raise ArchiveError(f"no sub-model '{label}' ({label}.nnef.tgz, {label}.nnef.tar or {label}/) in the model")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def session(self, state: Any = None, threads: int | None = None) -> "Session":
        """A runnable session of this model (see :mod:`nnef_kv.interpreter.session`; ``threads``: its
        ``threads``, None for the default policy)."""
        from ..interpreter.session import Session

        return Session(self, state=state, threads=threads)

    def nbytes(self) -> int:
        """Bytes held by the tensors."""
        return sum(int(getattr(t, "nbytes", 0)) for t in self.tensors.values())


# ----------------------------------------------------------------------------------------------
# AST walking
# ----------------------------------------------------------------------------------------------
def _label_of(inv: ast.Invocation) -> str | None:
    named = inv.named()
    value = named.get("label")
    if value is None:
        pos = inv.positional()
        value = pos[1] if len(pos) > 1 else None
    return value.value if isinstance(value, ast.StringLiteral) else None


# ----------------------------------------------------------------------------------------------
# load
# ----------------------------------------------------------------------------------------------
def _text(member: Member, where: str) -> str:
    try:
        return bytes(member.data).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ArchiveError(f"{where}/{member.name}: not valid UTF-8 ({e.reason} at byte {e.start})") from None


def load(path: str | os.PathLike, limits: Limits | None = None, *, check: bool = True) -> Model:
    """Load a model from a folder, ``.tar``, ``.tgz`` (``.nnef.tar``, ``.nnef.tgz``: any name).

    Nothing is extracted to disk; tensors are views into the mapped files where the container is
    not compressed. ``check`` verifies that every variable has its tensor.
    """
    where = path_arg(path, "nnef_kv.load", "the path of a model folder, .tar or .tgz")
    if limits is not None and not isinstance(limits, Limits):
        raise ArgumentError(f"nnef_kv.load: limits must be an nnef_kv.Limits, got {describe(limits)}")
    limits = limits or current_limits()
    if not os.path.lexists(where):
        raise ArchiveError(f"{where}: no such file or folder")
    if os.path.isfile(where):
        what = describe_file(where)
        if what is not None:
            raise ArchiveError(f"{where}: not an NNEF model archive: {what}")
    elif not os.path.isdir(where):
        kind = kind_of(where)
        raise ArchiveError(f"{where}: {'a ' if kind[0] not in 'aeiou' else 'an '}{kind}, not a model folder, .tar or "
                           f".tgz file")
    _, members = read_container(where, limits)
    by_name = {m.name: m for m in members}
    if GRAPH_NNEF not in by_name:
        held = [m.name for m in members if "/" not in m.name and m.name.endswith((".tgz", ".tar", ".tar.gz"))]
        if held and os.path.isdir(where):  # an export folder (torch-to-nnef: model.nnef.tgz beside its files)
            raise ArchiveError(f"{where}: no {GRAPH_NNEF} in the folder; it holds the archive {held[0]}: pass that "
                               f"({os.path.join(where, held[0])})")
        raise ArchiveError(f"{where}: no {GRAPH_NNEF} in the model")
    # sub-model folders: ``x/graph.nnef`` two levels deep, as tract detects them (tract then moves
    # every id starting with ``x`` into the sub-model; nnef-kv takes the folder ``x/`` only)
    submodels = {
        m.name.split("/")[0] + "/"
        for m in members
        if m.name.count("/") == 1 and m.name.endswith("/" + GRAPH_NNEF)
    }

    from ..grammar import parse, parse_quant

    text = _text(by_name[GRAPH_NNEF], where)
    document = parse(text, filename=f"{where}/{GRAPH_NNEF}", limits=limits)
    quant_text = quantization = None
    if GRAPH_QUANT in by_name:
        quant_text = _text(by_name[GRAPH_QUANT], where)
        quantization = parse_quant(quant_text, filename=f"{where}/{GRAPH_QUANT}", limits=limits)

    tensors: dict[str, TensorValue] = {}
    infos: dict[str, DatInfo] = {}
    resources: dict[str, bytes] = {}
    for m in members:
        if m.name in (GRAPH_NNEF, GRAPH_QUANT):
            continue
        if m.name.endswith(".dat") and not any(m.name.startswith(s) for s in submodels):
            label = m.name[: -len(".dat")]
            tensors[label], infos[label] = decode_tensor(m.data, name=f"{where}/{m.name}", limits=limits)
            continue
        resources[m.name] = bytes(m.data)
    model = Model(
        document=document,
        tensors=tensors,
        quantization=quantization,
        source=where,
        text=text,
        quant_text=quant_text,
        resources=resources,
        tensor_info=infos,
        limits=limits,
    )
    if check:
        model.check_variables()
    return model


# ----------------------------------------------------------------------------------------------
# save
# ----------------------------------------------------------------------------------------------
def model_members(model: Model, where: str = "<model>") -> dict[str, list[Buffer]]:
    """Every member :func:`save` writes: name -> buffers."""
    from ..grammar import dump, dump_quant

    members: dict[str, list[Buffer]] = {GRAPH_NNEF: [dump(model.document).encode("utf-8")]}
    if model.quantization is not None:
        members[GRAPH_QUANT] = [dump_quant(model.quantization).encode("utf-8")]
    for label, value in model.tensors.items():
        name = label.lstrip("/") + ".dat"
        if name in members:
            raise ArchiveError(f"{where}: two tensors are stored as {name!r}")
        info = model.tensor_info.get(label)
        if info is not None and not info_fits(info, value):
            info = None
        members[name] = encode_parts(value, info, name=f"{where}/{name}")
    for name, data in model.resources.items():
        if name in members:
            raise ArchiveError(f"{where}: resource {name!r} collides with a graph file or a tensor")
        members[name] = [data]
    return members


def save(model: Model, path: str | os.PathLike) -> Path:
    """Write ``model`` to a folder, ``.tar`` or ``.tgz``/``.tar.gz`` (chosen from the suffix).

    Reproducible: the same model gives the same bytes. The target appears only complete. A folder is
    written for a name without a suffix or an existing model folder; any other suffix, a non-empty folder
    that is not a model, a regular file where the folder would go, a FIFO or device are refused
    (:class:`~nnef_kv.errors.OutputError`, :func:`nnef_kv.io.container.check_model_target`): nothing is
    deleted or replaced then.
    """
    where = path_arg(path, "nnef_kv.save", "the path to write (a folder, .tar, .tgz or .tar.gz)")
    if not isinstance(model, Model):
        raise ArgumentError(f"nnef_kv.save: expected an nnef_kv.Model to save, got {describe(model)}")
    check_model_target(where, probe=False)  # refused before anything is encoded
    members = model_members(model, where)
    write_container(where, members)
    return Path(where)


def _plain_label(label: str) -> bool:
    """A sub-model label usable as one file name inside the model's folder: letters, digits, ``_.-``, not
    ``.`` and without ``..`` (so no absolute path, no separator, no way out of the folder)."""
    return bool(re.fullmatch(r"[A-Za-z0-9_.\-]+", label)) and label != "." and ".." not in label
