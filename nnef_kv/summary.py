"""A graph summary of a model archive: what ``nnef-kv inspect`` prints.

Works on the AST and the tensors alone (no planning), so it also describes archives that nnef-kv
cannot run.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .grammar import ast


def _inputs() -> frozenset[str]:
    """The ops declaring graph inputs (the ``input`` fact)."""
    from .interpreter.catalog import ops_having

    return ops_having("input")

def kv_ops() -> dict[str, str]:
    """Ops that hold a KV cache in the session (registered with role ``kv-cache`` or ``attention+kv``),
    with their registered one-line description."""
    from .interpreter.catalog import PRIMITIVES, lookup

    lookup("add")  # loads every op family
    return {name: p.describe for name, p in PRIMITIVES.items() if p.role in ("kv-cache", "attention+kv")}



def _lhs_names(lhs: Any) -> list[str]:
    if isinstance(lhs, ast.Identifier):
        return [lhs.name]
    if isinstance(lhs, (ast.TupleExpr, ast.ArrayExpr)):
        return [n for item in lhs.items for n in _lhs_names(item)]
    return []


def _text(expr: Any) -> str:
    from .grammar import printer

    return printer.dump_expr(expr) if hasattr(printer, "dump_expr") else repr(expr)


@dataclass
class TensorDecl:
    name: str
    dtype: str
    shape: str


@dataclass
class Summary:
    source: str
    graph_name: str
    inputs: list[TensorDecl]
    outputs: list[str]
    extensions: list[str]
    op_counts: Counter
    fragments: list[str]
    n_variables: int
    parameter_bytes: int
    kv_caches: list[tuple[str, str, str]] = field(default_factory=list)  # (node, op, description)
    explicit_cache_inputs: list[str] = field(default_factory=list)

    def to_text(self) -> str:
        lines = [f"model {self.source}", f"graph {self.graph_name}"]
        if self.extensions:
            lines.append("extensions: " + "; ".join(self.extensions))
        lines.append(f"inputs ({len(self.inputs)}):")
        lines += [f"  {t.name}: {t.dtype} {t.shape}" for t in self.inputs]
        lines.append(f"outputs ({len(self.outputs)}): " + ", ".join(self.outputs))
        total = sum(self.op_counts.values())
        lines.append(f"operations: {total} invocations of {len(self.op_counts)} ops")
        for op, n in sorted(self.op_counts.items(), key=lambda kv: (-kv[1], kv[0])):
            lines.append(f"  {n:6d}  {op}")
        if self.fragments:
            lines.append("fragments defined: " + ", ".join(self.fragments))
        lines.append(f"parameters: {self.n_variables} tensors, {self.parameter_bytes:,} bytes")
        if self.kv_caches:
            lines.append("KV caches held by the session:")
            lines += [f"  {node}: {op} ({desc})" for node, op, desc in self.kv_caches]
        elif self.explicit_cache_inputs:
            lines.append("KV cache: explicit graph inputs/outputs (the caller owns it): "
                         + ", ".join(self.explicit_cache_inputs))
        else:
            lines.append("KV cache: none found")
        return "\n".join(lines)


def _nbytes(t: Any) -> int:
    if isinstance(t, np.ndarray):
        return int(t.nbytes)
    n = getattr(t, "nbytes", None)
    return int(n) if isinstance(n, (int, np.integer)) else 0


def summarize(model: Any) -> Summary:
    """Summarize a loaded :class:`nnef_kv.Model`."""
    doc: ast.Document = model.document
    g = doc.graph
    counts: Counter = Counter()
    kv: list[tuple[str, str, str]] = []
    kv_described = kv_ops()
    decls: dict[str, TensorDecl] = {}
    if g is not None:
        for stmt in g.body:
            names = _lhs_names(stmt.lhs)
            for inv in ast.invocations(stmt.rhs):
                counts[inv.name] += 1
                if inv.name in kv_described:
                    settings = ", ".join(
                        f"{a.name} = {_text(a.value)}" for a in inv.args
                        if a.name is not None and a.name not in ("past_sequence_shape", "input_sequence_shape")
                    )
                    desc = kv_described[inv.name] + (f"; {settings}" if settings else "")
                    kv.append((names[0] if names else "?", inv.name, desc))
            rhs = stmt.rhs
            if isinstance(rhs, ast.Invocation) and rhs.name in _inputs() and names:
                named = rhs.named()
                shape = named.get("shape") or (rhs.positional()[0] if rhs.positional() else None)
                if rhs.name == "external":
                    gen = rhs.generic
                    dtype = {"integer": "i64", "logical": "bool", "scalar": "f32"}.get(
                        getattr(gen, "name", "scalar"), "f32")
                else:
                    dt = named.get("datum_type")
                    dtype = str(getattr(dt, "value", "?")).lower()
                decls[names[0]] = TensorDecl(names[0], dtype, _text(shape) if shape is not None else "?")
    inputs = [decls.get(n, TensorDecl(n, "?", "?")) for n in (g.inputs if g else ())]
    cache_inputs = [t.name for t in inputs if "cache" in t.name.lower() or "past" in t.name.lower()]
    tensors = getattr(model, "tensors", {}) or {}
    return Summary(
        source=str(getattr(model, "source", None) or "<in memory>"),
        graph_name=g.name if g else "<no graph>",
        inputs=inputs,
        outputs=list(g.outputs) if g else [],
        extensions=[f"{e.name} {e.argument}".strip() for e in doc.extensions],
        op_counts=counts,
        fragments=[f.name for f in doc.fragments],
        n_variables=len(tensors),
        parameter_bytes=sum(_nbytes(t) for t in tensors.values()),
        kv_caches=kv,
        explicit_cache_inputs=cache_inputs,
    )
