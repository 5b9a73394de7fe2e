"""The KV caches of a graph without its attentions (scheme ``tract-cache``), and the exports that cannot run.

:func:`find_caches` finds each K and V cache (explicit ``concat([past_input, new], axis = 2)`` or tract's dyn
cache) whether or not :mod:`.attention` recognises the attention reading it, naming keys and values by use
(the scores product's second operand is K) or else by name; :func:`exporter_problems` the exports known not to
run (torch-to-nnef's baked query reshape), explained.
"""
from __future__ import annotations

from typing import Any

from ..errors import ConversionError
from ..grammar import ast as A
from ..interpreter.plan import recognize as R
from .attention import AttentionBlock, CacheSource, _Unnamed, cache_names, view_of
from .graph_edit import GraphEdit, static_value


_KEY_WORDS = ("key", "_k_", "k_cache", "keys")
_VALUE_WORDS = ("value", "_v_", "v_cache", "values")


def _role_by_name(*names: str | None) -> str:
    for nm in names:
        low = (nm or "").lower()
        if any(w in low for w in _KEY_WORDS):
            return "key"
        if any(w in low for w in _VALUE_WORDS):
            return "value"
    return ""


def find_caches(g: GraphEdit, blocks: list[AttentionBlock] | None = None) -> list[CacheSource]:
    """Every KV cache of the graph whatever the attention around it (the recognizer's
    :func:`~nnef_kv.interpreter.plan.recognize.find_caches`), each with its role (key / value) from the
    recognised attention, else from its names, else from how it is used."""
    known = {}
    for b in blocks or []:
        known[b.key.full] = "key"
        known[b.value.full] = "value"
    w = view_of(g)
    out: list[CacheSource] = []
    for c, by_use in R.find_caches(w):
        try:
            src = cache_names(g, w, c)
        except _Unnamed:  # a cache the graph body does not name: not one the converter can replace
            continue
        label = c.node.attrs.get("name")
        role = known.get(src.full) or _role_by_name(src.past, src.full, label if isinstance(label, str) else None) \
            or by_use
        if not role:
            raise ConversionError(f"{g.where}: cache '{src.full}' ({c.node.op}): cannot tell whether it holds keys or "
                                  f"values (from the attention, its names or its use)")
        src.role = role
        out.append(src)
    return out


def exporter_problems(g: GraphEdit) -> list[str]:
    """Known exporter bugs that make an archive unrunnable, one line each naming the node.

    * torch-to-nnef ``--reify-sdpa-operator`` with grouped-query attention reshapes the query to
      ``[B, Hkv, G*S, D]`` with ``G*S`` traced at ``S = 1``: the reshape's sequence entry is a literal while
      the cache axis is symbolic, so no call of another length can run (tract refuses to load it)."""
    out = []
    for n in [n for n in g.nodes if n.op == "tract_transformers_sdpa"]:
        q = n.arg_name("q")
        r = g.node(q)
        if r is None or r.op != "reshape":
            continue
        shape = r.arg("shape")
        if not isinstance(shape, A.ArrayExpr) or len(shape.items) != 4:
            continue
        seq = shape.items[2]
        lit = static_value(seq)
        symbolic_input = any(
            isinstance(d, A.Identifier) or not isinstance(static_value(d), int) for d in shape.items[:2]
        )
        if isinstance(lit, int) and not isinstance(lit, bool) and lit > 1 and symbolic_input:
            out.append(f"{g.where}: node '{r.name}' (reshape) fixes the sdpa query's sequence axis at {lit}: "
                       f"torch-to-nnef --reify-sdpa-operator with grouped-query attention bakes the traced S = 1 into "
                       f"this reshape; no other length runs; re-export without it")
    return out


def refuse_exporter_problems(model: Any, where: str) -> None:
    """Raise :class:`~nnef_kv.errors.GraphError` with the first of :func:`exporter_problems` of ``model`` (a model
    with a graph), the explanation ``inspect`` gives, before a command's work fails on it with a raw error."""
    from ..errors import GraphError

    if getattr(getattr(model, "document", None), "graph", None) is None:
        return
    problems = exporter_problems(GraphEdit(model.document, getattr(model, "tensors", {}) or {}, where))
    if problems:
        raise GraphError(problems[0])
