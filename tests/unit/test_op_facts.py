"""Every op fact lives in the registry (issue 24 item 3): the sets of op names tools need (graph inputs,
views, pass-throughs, softmaxes, gathers, fresh results, shape-memo ops, ...) are facts declared by the
ops (``registry.FACTS``, :func:`nnef_kv.core.registry.declare`) and asked of the registry
(``catalog.ops_having``). No module outside the op families writes a collection of two or more
registered op names, except the one attention recognizer's patterns marked ``# op pattern`` (the arithmetic an
attention's scores may go through; allowed in ``nnef_kv/interpreter/plan/recognize.py`` only) and words that
merely coincide with op names (``# not op names``)."""
from __future__ import annotations

import ast

import pytest

from nnef_kv.interpreter import catalog
from nnef_kv.core.registry import FACTS, GraphError, Primitive

from conftest import REPO

OP_MODULES = ("nnef_kv/interpreter/ops/", "nnef_kv/core/registry.py")
MARKS = ("# op pattern", "# not op names")
#: the one module whose lines may carry ``# op pattern``: the attention recognizer (issue 24 item 2)
RECOGNIZER = "nnef_kv/interpreter/plan/recognize.py"


def literal_op_collections(names: set[str]) -> list[str]:
    found = []
    for path in sorted((REPO / "nnef_kv").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith(OP_MODULES):
            continue
        text = path.read_text()
        lines = text.split("\n")
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, (ast.Set, ast.List, ast.Tuple, ast.Dict)):
                continue
            elts = node.keys if isinstance(node, ast.Dict) else node.elts
            hits = [e.value for e in elts if isinstance(e, ast.Constant) and e.value in names]
            if len(hits) >= 2 and not lines[node.lineno - 1].rstrip().endswith(MARKS):
                found.append(f"{rel}:{node.lineno}: {hits}")
    return found


def test_no_literal_collection_of_op_names_outside_the_op_modules():
    names = set(catalog.ops_with())
    assert len(names) > 150
    assert literal_op_collections(names) == []


def test_op_patterns_live_in_the_one_recognizer():
    """A recognizer's arithmetic is marked ``# op pattern`` in the attention recognizer only: no other module
    matches attentions by op names."""
    marked = sorted(path.relative_to(REPO).as_posix() for path in (REPO / "nnef_kv").rglob("*.py")
                    if "# op pattern" in path.read_text())
    assert marked == [RECOGNIZER]


def test_the_scan_finds_a_literal_list(tmp_path, monkeypatch):
    """The check itself: a module holding ("reshape", "squeeze") is reported."""
    import test_op_facts as me

    fake = tmp_path / "nnef_kv" / "x"
    fake.mkdir(parents=True)
    (fake / "bad.py").write_text('VIEWS = ("reshape", "squeeze")\nOK = ("reshape", "squeeze")  # op pattern\n')
    monkeypatch.setattr(me, "REPO", tmp_path)
    assert literal_op_collections({"reshape", "squeeze"}) == ["nnef_kv/x/bad.py:1: ['reshape', 'squeeze']"]


def test_facts_are_the_sets_the_tools_used():
    """What each fact holds today (the literal sets they replaced, unchanged but for the softmax the
    converter now shares with validation, and the unregistered name ``cast`` dropped)."""
    have = catalog.ops_having
    assert have("input") == {"external", "tract_core_external"}
    assert have("view") == {"reshape", "squeeze", "unsqueeze"}
    assert have("passthrough") == {"copy", "tract_core_cast"}
    assert have("softmax") == {"softmax", "tract_core_softmax"}
    assert have("gather") == {"gather", "tract_core_gather"}
    assert have("kv_expand") == {"unsqueeze", "tile", "tract_core_broadcast", "reshape"}
    assert len(have("memo")) == 34 and {"tract_core_shape_of", "concat", "select"} <= have("memo")
    assert catalog.lookup("div").scalar(1.0, 0.0) is None and catalog.lookup("rsqrt").scalar(4.0) == 0.5
    with pytest.raises(KeyError, match="not a fact"):
        have("views")
    with pytest.raises(GraphError, match="fact 'shiny' is not one of"):
        Primitive(signature="fragment f(x: tensor<scalar>) -> (y: tensor<scalar>);", registry="nnef", name="f",
                  facts=frozenset({"shiny"}))
    assert set(FACTS) >= {"input", "view", "memo", "fresh"}
