"""A model's plan: its graph built (document, tensors, graph.quant, sub-models through the model's
``load_submodel``) under the model's limits, then planned; cached on the model object.

The model is :class:`nnef_kv.io.archive.Model`, the one model type; the archives are a floor above the
interpreter, so what the planner reads of it is declared here (:class:`PlannedModel`)."""
from __future__ import annotations

import hashlib
from typing import Any, Mapping, Protocol

from ...errors import GraphError, LimitError, NnefKvError
from ...grammar import ast
from ...grammar.printer import expr_text
from ...limits import Limits, using_limits
from ...tensors.pages import trim_heap
from ..builder import GraphBuilder
from .core import Plan, build_plan

__all__ = ["get_plan", "PlannedModel"]


class PlannedModel(Protocol):
    """What the planner and the session read of a model (:class:`nnef_kv.io.archive.Model` has it all)."""

    document: ast.Document
    tensors: Mapping[str, Any]
    quantization: ast.QuantDocument | None
    source: str | None
    limits: Limits

    def load_submodel(self, label: str) -> "PlannedModel": ...


def get_plan(model: PlannedModel, prepare_weights: bool = True) -> Plan:
    """The model's plan, built on first use and cached on the model object (rebuilt if its document changed).
    ``prepare_weights=False``: a plan leaving the weights as the archive holds them (a check's, see
    :func:`~.core.unprepared_weights`), built anew and not cached."""
    cached = getattr(model, "__dict__", {}).get("_nnef_kv_plan")
    if prepare_weights and cached is not None and cached[0] is model.document:
        return cached[1]
    source = model.source
    filename = f"{source}/graph.nnef" if source else "graph.nnef"
    limits = model.limits
    builder: GraphBuilder | None = None
    try:
        with using_limits(limits):  # the model's limits (given to load) bound the build, sub-models included
            builder = GraphBuilder(model.document, model.tensors, model.quantization, filename,
                                   model.load_submodel)
            plan = build_plan(builder.build(), prepare_weights=prepare_weights)
    except NnefKvError:
        raise
    except Exception as exc:  # noqa: BLE001 - a builder bug: still an nnef-kv error naming what was built
        st = builder.statement if builder is not None else None
        what = ""
        if st is not None:
            text = f"{expr_text(st.lhs)} = {expr_text(st.rhs)}"
            text = " ".join(text.split())
            what = f" while building {builder.loc(st.pos)}: '{text[:120] + '...' if len(text) > 120 else text}'"
        detail = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
        kind = LimitError if isinstance(exc, MemoryError) else GraphError
        raise kind(f"{filename}: cannot build the graph{what}: {detail}") from exc
    # identity for saved state: the document (structure, literals) as well as the nodes and attributes
    plan.fingerprint = hashlib.sha256((plan.fingerprint + repr(model.document)).encode()).hexdigest()
    if not prepare_weights:
        return plan
    trim_heap()  # the weights' temporaries (repacked one by one, then side by side) leave the process
    try:
        object.__setattr__(model, "_nnef_kv_plan", (model.document, plan))
    except (AttributeError, TypeError):
        pass
    return plan
