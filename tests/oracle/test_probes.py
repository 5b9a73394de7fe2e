"""Every syntax probe of shared/conformance/probes against an explicit expectation table.

Rule: nnef-kv accepts what tract or Khronos parses; where they read the same text differently it reads
it as tract does. The table below is the expectation; it is cross-checked against both tools' verdicts
recorded in PROBES.json, and every deviation from "accept iff one tool accepts" is listed with a reason.
"""
from __future__ import annotations

import json
import math

import pytest

from conftest import CONFORMANCE, requires_shared
from nnef_kv.errors import NnefSyntaxError
from nnef_kv.grammar import ast as A
from nnef_kv.grammar import dump, dump_quant, parse, parse_quant

PROBES = CONFORMANCE / "probes"

ACCEPT, REJECT = "accept", "reject"

# probe -> verdict of nnef-kv's parser
EXPECTED = {
    "ext_space_separated": ACCEPT,
    "ext_comma_list": ACCEPT,
    "ext_unknown": ACCEPT,
    "fragment_without_khr": ACCEPT,
    "fragment_with_khr": ACCEPT,
    "operator_expr_without_khr": ACCEPT,
    "extended_identifier": ACCEPT,
    "extended_identifier_single_quote": ACCEPT,
    "inf_literal": ACCEPT,
    "identifier_prefix_inf": ACCEPT,
    "identifier_prefix_true": ACCEPT,
    "identifier_prefix_false_bare": ACCEPT,
    "keyword_as_identifier": ACCEPT,
    "string_escapes": ACCEPT,
    "string_other_quote_inside": ACCEPT,
    "string_unicode": ACCEPT,
    "properties_fragment": ACCEPT,
    "empty_param_list": ACCEPT,
    "empty_fragment_body": ACCEPT,
    "unary_minus_identifier": ACCEPT,
    "unary_not": ACCEPT,
    "unary_minus_scope": ACCEPT,
    "sub_left_assoc": ACCEPT,
    "pow_assoc": ACCEPT,
    "mul_over_add": ACCEPT,
    "and_or_expr": ACCEPT,
    "in_operator": ACCEPT,
    "if_else_expr": ACCEPT,
    "comprehension": ACCEPT,
    "comprehension_filter": ACCEPT,
    "builtin_length_of": ACCEPT,
    "numeric_uppercase_E": ACCEPT,
    "numeric_exponent": ACCEPT,
    "numeric_trailing_dot": ACCEPT,
    "numeric_leading_dot": REJECT,
    "nested_array_literal": ACCEPT,
    "reassign_identifier": ACCEPT,
    "positional_after_named": ACCEPT,
    "named_args_any_order": ACCEPT,
    "tuple_lvalue_no_parens": ACCEPT,
    "tuple_lvalue_parens": ACCEPT,
    "split_stdlib": ACCEPT,
    "array_lvalue": ACCEPT,
    "subscript_range": ACCEPT,
    "subscript_single": ACCEPT,
    "symbol_declared": ACCEPT,
    "symbol_undeclared": ACCEPT,
    "tract_assert": ACCEPT,
    "tract_core_external": ACCEPT,
    "generic_external_integer": ACCEPT,
    "graph_param_not_external": ACCEPT,
    "jinja_expression": REJECT,
    "jinja_comment_trap": ACCEPT,
    "comment_eof_no_newline": ACCEPT,
    "crlf_line_endings": ACCEPT,
    "hash_in_string": ACCEPT,
    "version_2": ACCEPT,
    "version_integer": ACCEPT,
    "tensor_unbound_type": ACCEPT,
    "array_of_array_type": ACCEPT,
    "tuple_array_type_default": ACCEPT,
    "external_in_fragment": ACCEPT,
    "trailing_garbage": REJECT,
    "neg_literal_pow": ACCEPT,
    "attribute_positional": ACCEPT,
    "empty_graph_params": ACCEPT,
    "constant_op": ACCEPT,
    "quant_file_basic": ACCEPT,
    "quant_file_single_quote_key": ACCEPT,
    "quant_file_extended_id": ACCEPT,
    "quant_file_comment": ACCEPT,
}

# Both tools reject these documents, but not for their syntax: nnef-kv accepts them (syntax-valid).
SYNTAX_VALID_BUT_REJECTED = {
    "string_other_quote_inside": "Khronos reads 'i\"j' (it fails on the tract_registry extension); tract forbids it",
    "unary_not": "tract fails at evaluation (unary on a tensor), Khronos at type checking",
    "tensor_unbound_type": "Khronos parses tensor<> and fails at type checking",
}

# Expected error position (line, column) of the rejected probes.
REJECT_AT = {"numeric_leading_dot": (7, 14), "jinja_expression": (7, 14), "trailing_garbage": (10, 1)}


def _load() -> list[dict]:
    return json.loads((PROBES / "PROBES.json").read_text(encoding="utf-8"))["probes"]


def _rhs(doc: A.Document, lhs: str) -> A.Expr:
    assert doc.graph is not None
    found = [a.rhs for a in doc.graph.body if a.lhs == A.Identifier(lhs)]
    assert found, f"no assignment to {lhs}"
    return found[-1]


def I(name: str) -> A.Identifier:  # noqa: E743 - short helper
    return A.Identifier(name)


def S(v: float) -> A.ScalarLiteral:
    return A.ScalarLiteral(v)


def N(v: int) -> A.IntegerLiteral:
    return A.IntegerLiteral(v)


def B(op: str, a: A.Expr, b: A.Expr) -> A.BinaryExpr:
    return A.BinaryExpr(op, a, b)


def call(name: str, *pos: A.Expr, generic: str | None = None, **named: A.Expr) -> A.Invocation:
    args = tuple(A.Argument(None, p) for p in pos) + tuple(A.Argument(k, v) for k, v in named.items())
    return A.Invocation(name, A.PrimitiveType(generic) if generic else None, args)


def _props(doc: A.Document) -> dict:
    frag = next(f for f in doc.fragments if f.name == "tract_core_properties")
    assert frag.body is not None
    arr = frag.body[0].rhs
    assert isinstance(arr, A.ArrayExpr)
    out = {}
    for item in arr.items:
        assert isinstance(item, A.TupleExpr)
        key, value = item.items
        out[key.value] = value  # type: ignore[union-attr]
    return out


def _check_divergent(name: str, doc: A.Document) -> None:
    """The AST of probes whose reading matters (tools disagree, or precedence/lexing is pinned)."""
    if name == "unary_minus_scope":  # tract: -1.0 is a literal, so (-1.0) + 3.0 (Khronos: -(1.0 + 3.0))
        assert _rhs(doc, "y") == call("add", I("x"), B("+", S(-1.0), S(3.0)))
    elif name == "neg_literal_pow":  # tract: (-2.0) ^ 2.0 = 4 (Khronos: -(2.0 ^ 2.0))
        assert _rhs(doc, "y") == call("add", call("mul", I("x"), S(0.0)), B("^", S(-2.0), S(2.0)))
    elif name == "unary_minus_identifier":
        assert _rhs(doc, "y") == A.UnaryExpr("-", I("x"))
    elif name == "unary_not":
        assert _rhs(doc, "y") == A.UnaryExpr("!", I("b"))
    elif name == "pow_assoc":  # left-associative in both tools: (2^3)^2
        assert _rhs(doc, "y").args[1].value == B("^", B("^", S(2.0), S(3.0)), S(2.0))  # type: ignore[union-attr]
    elif name == "sub_left_assoc":
        assert _rhs(doc, "y").args[1].value == B("-", B("-", S(2.0), S(1.0)), S(1.0))  # type: ignore[union-attr]
    elif name == "mul_over_add":
        assert _rhs(doc, "y").args[1].value == B("+", S(1.0), B("*", S(2.0), S(3.0)))  # type: ignore[union-attr]
    elif name == "and_or_expr":  # && and || share one level, left-associative
        assert _rhs(doc, "c") == B(
            "||", B("&&", A.LogicalLiteral(True), A.LogicalLiteral(False)), A.LogicalLiteral(True)
        )
    elif name == "in_operator":
        assert _rhs(doc, "c") == B("in", N(1), A.ArrayExpr((N(1), N(2))))
    elif name == "if_else_expr":
        assert _rhs(doc, "y") == A.IfElseExpr(A.LogicalLiteral(True), I("x"), I("x"))
    elif name == "comprehension_filter":
        rhs = _rhs(doc, "a")
        assert rhs == A.Comprehension(
            (A.ComprehensionIterator(I("i"), A.ArrayExpr((N(1), N(2), N(3)))),), B(">", I("i"), N(1)), I("i")
        )
    elif name == "inf_literal":
        assert _rhs(doc, "a") == call("max", I("x"), S(-math.inf))
        assert _rhs(doc, "y") == call("min", I("a"), S(math.inf))
    elif name in ("identifier_prefix_inf", "identifier_prefix_true"):
        ident = "info" if name.endswith("inf") else "true_x"
        assert _rhs(doc, "y") == call("add", I(ident), I("x"))
    elif name == "identifier_prefix_false_bare":
        assert _rhs(doc, "y") == I("falsey")
    elif name == "keyword_as_identifier":
        assert _rhs(doc, "y") == call("add", I("scalar"), I("x"))
    elif name == "extended_identifier":
        assert doc.graph is not None and doc.graph.inputs == ("in.put",) and doc.graph.outputs == ("out/put",)
        assert _rhs(doc, "out/put") == call("mul", I("in.put"), S(2.0))
    elif name == "string_escapes":  # tract: backslash escapes any character, \n is the letter n
        assert {k: v.value for k, v in _props(doc).items()} == {"dq": 'a"b', "sq": "c'd", "bs": "e\\f", "n": "gnh"}
    elif name == "string_other_quote_inside":
        assert _props(doc)["mixed"] == A.StringLiteral('i"j')
    elif name == "string_unicode":
        assert _props(doc)["k"] == A.StringLiteral("café µs")
    elif name == "hash_in_string":
        assert _props(doc)["k"] == A.StringLiteral("a#b")
    elif name == "numeric_uppercase_E":  # Khronos: scalar; tract parses, then fails on "1E0"
        assert _rhs(doc, "y") == call("mul", I("x"), S(1.0))
    elif name == "numeric_trailing_dot":
        assert _rhs(doc, "y") == call("mul", I("x"), S(2.0))
    elif name == "ext_space_separated":
        assert doc.extensions == (A.Extension("tract_registry", "tract_core"),)
    elif name == "ext_comma_list":
        (ext,) = doc.extensions
        assert ext.names() == ("KHR_enable_fragment_definitions", "KHR_enable_operator_expressions")
    elif name == "ext_unknown":
        assert doc.extensions == (A.Extension("foo_bar", "baz 1 + 2"),)
    elif name == "tract_assert":
        assert doc.extensions == (A.Extension("tract_symbol", "S"), A.Extension("tract_assert", "S >= 1"))
    elif name == "version_2":
        assert doc.version == "2.0"
    elif name == "version_integer":
        assert doc.version == "1"
    elif name == "tensor_unbound_type":
        assert doc.fragments[0].params[0].type == A.TensorType(None)
    elif name == "array_of_array_type":
        p = doc.fragments[0].params[1]
        assert p.type == A.ArrayType(A.ArrayType(A.PrimitiveType("integer")))
        assert p.default == A.ArrayExpr((A.ArrayExpr((N(1),)),))
    elif name == "tuple_array_type_default":
        p = doc.fragments[0].params[1]
        assert p.type == A.ArrayType(A.TupleType((A.PrimitiveType("integer"), A.PrimitiveType("integer"))))
    elif name in ("tuple_lvalue_parens", "tuple_lvalue_no_parens"):
        assert doc.graph is not None
        assert doc.graph.body[1].lhs == A.TupleExpr((I("m"), I("v")))
    elif name == "array_lvalue":
        assert doc.graph is not None and doc.graph.body[1].lhs == A.ArrayExpr((I("a"), I("b")))
    elif name == "empty_graph_params":
        assert doc.graph is not None and doc.graph.inputs == ()
        assert _rhs(doc, "y") == A.ArrayExpr((A.ArrayExpr((S(1.0), S(2.0))),))
    elif name == "symbol_declared":
        assert _rhs(doc, "x") == call("external", generic="scalar", shape=A.ArrayExpr((B("+", I("S"), N(1)), N(2))))
    elif name == "subscript_range":
        assert _rhs(doc, "t") == A.SliceExpr(I("s"), N(1), None)


def _quant_keys(name: str) -> list[str]:
    return [e.tensor for e in parse_quant((PROBES / name / "graph.quant").read_text(encoding="utf-8")).entries]


@requires_shared
def test_table_covers_every_probe_and_matches_the_tools() -> None:
    probes = _load()
    assert {p["probe"] for p in probes} == set(EXPECTED), "expectation table out of date with PROBES.json"
    for p in probes:
        either = bool(p["tract_loads"] or p["khronos_parses"])
        verdict = EXPECTED[p["probe"]] == ACCEPT
        if verdict != either:
            assert p["probe"] in SYNTAX_VALID_BUT_REJECTED, (
                f"{p['probe']}: table says {EXPECTED[p['probe']]}, tools: {either}"
            )
            assert verdict, "only rejections by both tools for non-syntax reasons may be accepted"
    # the ones both tools reject for their syntax are rejected
    assert {k for k, v in EXPECTED.items() if v == REJECT} == set(REJECT_AT)


@requires_shared
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_probe(name: str) -> None:
    folder = PROBES / name
    text = (folder / "graph.nnef").read_text(encoding="utf-8")
    if EXPECTED[name] == REJECT:
        for fast in (True, False):
            with pytest.raises(NnefSyntaxError) as info:
                parse(text, fast=fast)
            assert (info.value.line, info.value.column) == REJECT_AT[name]
            assert str(info.value).startswith(f"graph.nnef:{REJECT_AT[name][0]}:{REJECT_AT[name][1]}: expected ")
        return
    doc = parse(text)
    assert doc == parse(text, fast=False)
    _check_divergent(name, doc)
    assert parse(dump(doc)) == doc
    quant = folder / "graph.quant"
    if quant.exists():
        q = parse_quant(quant.read_text(encoding="utf-8"))
        assert q.entries and parse_quant(dump_quant(q)) == q


@requires_shared
def test_quant_probe_keys() -> None:
    assert _quant_keys("quant_file_basic") == ["x", "y"]
    assert _quant_keys("quant_file_single_quote_key") == ["x"]
    assert _quant_keys("quant_file_extended_id") == ["x.in"]
    basic = parse_quant((PROBES / "quant_file_basic" / "graph.quant").read_text(encoding="utf-8"))
    y = basic.by_tensor()["y"]
    assert y.op == "zero_point_linear_quantize"
    assert y.named() == {
        "scale": A.ScalarLiteral(0.5),
        "zero_point": A.IntegerLiteral(0),
        "bits": A.IntegerLiteral(8),
        "signed": A.LogicalLiteral(False),
    }
