"""Printer: parse(dump(parse(text))) == parse(text) on the corpus, tract still loads printed models,
and parse(dump(ast)) == ast on generated ASTs."""
from __future__ import annotations

import io
import json
import math
import shutil
import tarfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import CONFORMANCE, requires_shared, requires_tract
from nnef_kv.grammar import ast as A
from nnef_kv import tract_driver
from nnef_kv.grammar import dump, dump_expr, dump_quant, parse, parse_quant
from test_grammar import corpus_files


# ------------------------------------------------------------------------------------------------
# corpus
# ------------------------------------------------------------------------------------------------
@requires_shared
def test_corpus_round_trip() -> None:
    n = 0
    for name, text in corpus_files():
        if name.endswith(".quant"):
            q = parse_quant(text, name)
            assert parse_quant(dump_quant(q)) == q, name
        else:
            doc = parse(text, name)
            printed = dump(doc)
            assert parse(printed) == doc, name
            assert dump(parse(printed)) == printed, f"{name}: printing is not idempotent"
        n += 1
    assert n > 100


_LOADERS = {"tract.nnef()", "tract.nnef().with_tract_transformers()", "tract.nnef().without_tract_core()",
            "tract.nnef().with_onnx()"}  # the manifest's loader chains, made by tract_driver.framework


def _rewrite(folder: Path) -> None:
    for g in folder.rglob("graph.nnef"):
        g.write_text(dump(parse(g.read_text(encoding="utf-8"))), encoding="utf-8")
    for q in folder.rglob("graph.quant"):
        q.write_text(dump_quant(parse_quant(q.read_text(encoding="utf-8"))), encoding="utf-8")


@requires_shared
@requires_tract
def test_tract_loads_printed_models(tmp_path: Path) -> None:
    """Every manifest case tract loads (folders and model.nnef.tgz) still loads once re-printed."""
    manifest = json.loads((CONFORMANCE / "MANIFEST.json").read_text(encoding="utf-8"))
    loaded = 0
    for k, case in enumerate(manifest):
        if not case.get("tract_python_loads") or case.get("python_loader") not in _LOADERS:
            continue
        src = CONFORMANCE / case["path"]
        dst = tmp_path / f"case{k}"
        if case.get("model") == ".":
            shutil.copytree(src, dst)
        elif str(case.get("model", "")).endswith((".tgz", ".tar")):
            dst.mkdir()
            with tarfile.open(fileobj=io.BytesIO((src / case["model"]).read_bytes()), mode="r:*") as tf:
                tf.extractall(dst, filter="data")
        else:
            continue
        _rewrite(dst)
        tract_driver.load(dst, case["python_loader"])
        loaded += 1
    assert loaded >= 60


# ------------------------------------------------------------------------------------------------
# printer rules
# ------------------------------------------------------------------------------------------------
def test_scalars_keep_their_type() -> None:
    for v in [1.0, -2.0, 0.5, 1e-06, 1e20, 123456789.0, 2.5e-300, math.inf, -math.inf, -0.0]:
        text = dump_expr(A.ScalarLiteral(v))
        assert "." in text or "e" in text or "inf" in text, text
        assert "E" not in text
    assert dump_expr(A.IntegerLiteral(-3)) == "-3"
    with pytest.raises(ValueError):
        dump_expr(A.ScalarLiteral(math.nan))


def test_identifiers_and_strings() -> None:
    assert dump_expr(A.Identifier("a.b")) == 'i"a.b"'
    assert dump_expr(A.Identifier("info")) == 'i"info"'  # tract's keyword-prefix trap
    assert dump_expr(A.Identifier("true")) == 'i"true"'
    assert dump_expr(A.Identifier("x_1")) == "x_1"
    assert dump_expr(A.StringLiteral("it's \"q\" \\")) == '"it\\\'s \\"q\\" \\\\"'
    assert dump_expr(A.ArrayExpr((A.Identifier("for"),))) == "[(for)]"


def test_expressions_are_parenthesised() -> None:
    e = A.BinaryExpr("+", A.UnaryExpr("-", A.Identifier("a")), A.ScalarLiteral(-1.0))
    assert dump_expr(e) == "((-(a)) + -1.0)"


def test_quant_identifier_values_round_trip() -> None:
    q = parse_quant('"x": op(a = falseinf, b = i"true", c = true, d = info);')
    assert [a.value for a in q.entries[0].args] == [
        A.Identifier("falseinf"),
        A.Identifier("true"),
        A.LogicalLiteral(True),
        A.Identifier("info"),
    ]
    assert parse_quant(dump_quant(q)) == q


def test_quant_printer() -> None:
    q = parse_quant(
        "'a.b': zero_point_linear_quantize(zero_point = 0, scale = 0.5, bits = 8, signed = false,)\n;\n# c\n"
        "\"x\": linear_quantize(min = -1.0 max = 1.0, bits = 8);"
    )
    assert dump_quant(q) == (
        'i"a.b": zero_point_linear_quantize(zero_point = 0, scale = 0.5, bits = 8, signed = false);\n'
        '"x": linear_quantize(min = -1.0, max = 1.0, bits = 8);\n'
    )


# ------------------------------------------------------------------------------------------------
# generated ASTs
# ------------------------------------------------------------------------------------------------
_plain = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,6}", fullmatch=True)
_odd = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=6)
_name = st.one_of(_plain, _plain, st.sampled_from(["for", "in", "if", "true", "info", "scalar", "graph"]), _odd)
_lit = st.one_of(
    st.integers(-(10**12), 10**12).map(A.IntegerLiteral),
    st.floats(allow_nan=False).map(A.ScalarLiteral),
    st.booleans().map(A.LogicalLiteral),
    st.text(max_size=8).map(A.StringLiteral),
)
_prim = st.sampled_from(["integer", "scalar", "logical", "string"]).map(A.PrimitiveType)


def _exprs() -> st.SearchStrategy:
    leaf = st.one_of(_lit, _name.map(A.Identifier))

    def extend(inner: st.SearchStrategy) -> st.SearchStrategy:
        args = st.lists(st.builds(A.Argument, st.one_of(st.none(), _name), inner), max_size=3).map(tuple)
        return st.one_of(
            st.lists(inner, max_size=3).map(lambda xs: A.ArrayExpr(tuple(xs))),
            st.lists(inner, min_size=2, max_size=3).map(lambda xs: A.TupleExpr(tuple(xs))),
            st.builds(A.UnaryExpr, st.sampled_from(["-", "+", "!"]), inner),
            st.builds(
                A.BinaryExpr,
                st.sampled_from(["+", "-", "*", "/", "^", "<", "<=", ">", ">=", "==", "!=", "&&", "||", "in"]),
                inner,
                inner,
            ),
            st.builds(A.IfElseExpr, inner, inner, inner),
            st.builds(A.Subscript, inner, inner),
            st.builds(A.SliceExpr, inner, st.one_of(st.none(), inner), st.one_of(st.none(), inner)),
            st.builds(A.Invocation, _name, st.one_of(st.none(), _prim), args),
            st.builds(
                A.Comprehension,
                st.lists(
                    st.builds(A.ComprehensionIterator, _name.map(A.Identifier), inner), min_size=1, max_size=2
                ).map(tuple),
                st.one_of(st.none(), inner),
                inner,
            ),
        )

    return st.recursive(leaf, extend, max_leaves=12)


def _types() -> st.SearchStrategy:
    base = st.one_of(_prim, st.one_of(st.none(), _prim).map(A.TensorType))
    return st.recursive(
        base,
        lambda inner: st.one_of(
            inner.map(A.ArrayType), st.lists(inner, max_size=3).map(lambda xs: A.TupleType(tuple(xs)))
        ),
        max_leaves=4,
    )


def _lhs() -> st.SearchStrategy:
    ident = _name.map(A.Identifier)
    return st.recursive(
        ident,
        lambda inner: st.one_of(
            st.lists(inner, max_size=3).map(lambda xs: A.ArrayExpr(tuple(xs))),
            st.lists(inner, max_size=3).map(lambda xs: A.TupleExpr(tuple(xs))),
        ),
        max_leaves=4,
    )


_literal_exprs = st.recursive(
    _lit, lambda inner: st.lists(inner, max_size=3).map(lambda xs: A.ArrayExpr(tuple(xs))), max_leaves=5
)
_assignments = st.lists(st.builds(A.Assignment, _lhs(), _exprs()), max_size=3).map(tuple)
_fragments = st.builds(
    A.FragmentDecl,
    _name,
    st.one_of(st.none(), st.builds(A.GenericDecl, st.one_of(st.none(), _prim))),
    st.lists(st.builds(A.Param, _name, _types(), st.one_of(st.none(), _literal_exprs)), max_size=3).map(tuple),
    st.lists(st.builds(A.Result, _name, _types()), max_size=2).map(tuple),
    st.one_of(st.none(), _assignments),
)
_ext_arg = st.sampled_from(["", "tract_core", "S >= 1", "🎯0", ", KHR_b", "tg: S==1"])
_docs = st.builds(
    A.Document,
    st.sampled_from(["1.0", "1", "2.0"]),
    st.lists(st.builds(A.Extension, _name, _ext_arg), max_size=2).map(tuple),
    st.lists(_fragments, max_size=2).map(tuple),
    st.one_of(
        st.none(),
        st.builds(
            A.GraphDecl,
            _name,
            st.lists(_name, max_size=2).map(tuple),
            st.lists(_name, max_size=2).map(tuple),
            _assignments,
        ),
    ),
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_docs)
def test_generated_documents_round_trip(doc: A.Document) -> None:
    text = dump(doc)
    assert parse(text) == doc, text
    assert parse(text, fast=False) == doc


_quant_value = st.one_of(_lit, _name.map(A.Identifier))


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.builds(
            A.QuantEntry,
            st.text(min_size=1, max_size=6),
            _plain,
            st.lists(st.builds(A.Argument, _plain, _quant_value), max_size=4).map(tuple),
        ),
        max_size=4,
    )
)
def test_generated_quant_round_trip(entries: list) -> None:
    doc = A.QuantDocument(tuple(entries))
    assert parse_quant(dump_quant(doc)) == doc

