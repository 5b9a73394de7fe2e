"""Parser: corpus, syntax points, errors, limits, and fast path == Lark (positions included)."""
from __future__ import annotations

import dataclasses
import io
import math
import random
import tarfile
import time
from typing import Any, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import CONFORMANCE, requires_shared
from nnef_kv.errors import LimitError, NnefKvError, NnefSyntaxError
from nnef_kv.grammar import ast as A
from nnef_kv.grammar import parse, parse_quant
from nnef_kv.limits import Limits


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
def same(a: Any, b: Any, path: str = "doc") -> None:
    """Structural equality *including* positions (the AST's == ignores them)."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, tuple):
        assert len(a) == len(b), f"{path}: {len(a)} != {len(b)} items"
        for k, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}[{k}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def corpus_files(suffixes: tuple[str, ...] = (".nnef", ".quant")) -> Iterator[tuple[str, str]]:
    """Every .nnef/.quant of the conformance corpus outside probes/, tar/tgz members included."""
    for p in sorted(CONFORMANCE.rglob("*")):
        rel = p.relative_to(CONFORMANCE)
        if "probes" in rel.parts or not p.is_file():
            continue
        if p.suffix in suffixes:
            yield str(rel), p.read_text(encoding="utf-8")
        elif p.name.endswith((".tgz", ".tar")):
            with tarfile.open(fileobj=io.BytesIO(p.read_bytes()), mode="r:*") as tf:
                for m in tf.getmembers():
                    if m.isfile() and m.name.endswith(tuple(f"graph{s}" for s in suffixes)):
                        data = tf.extractfile(m)
                        assert data is not None
                        yield f"{rel}!{m.name}", data.read().decode("utf-8")


def _corpus_ids() -> list[str]:
    return [n for n, _ in corpus_files((".nnef",))] if CONFORMANCE.is_dir() else []


def graph_doc(*stmts: str) -> str:
    return "version 1.0;\ngraph g(x) -> (y)\n{\n" + "".join(f"  {s}\n" for s in stmts) + "}\n"


def rhs(stmt: str) -> A.Expr:
    doc = parse(graph_doc(stmt))
    assert doc.graph is not None
    return doc.graph.body[0].rhs


def err(text: str, **kw: Any) -> NnefSyntaxError:
    with pytest.raises(NnefSyntaxError) as info:
        parse(text, **kw)
    return info.value


# ------------------------------------------------------------------------------------------------
# corpus
# ------------------------------------------------------------------------------------------------
@requires_shared
def test_corpus_has_files() -> None:
    names = [n for n, _ in corpus_files()]
    assert len(names) > 100
    assert any("!" in n for n in names), "tar/tgz members are read"
    assert any(n.endswith(".quant") for n in names)


@requires_shared
@pytest.mark.parametrize("name", _corpus_ids())
def test_corpus_fast_path_equals_lark(name: str) -> None:
    text = dict(corpus_files((".nnef",)))[name]
    fast = parse(text, name)
    slow = parse(text, name, fast=False)
    same(fast, slow)


@requires_shared
def test_corpus_quant_files_parse() -> None:
    n = 0
    for name, text in corpus_files((".quant",)):
        doc = parse_quant(text, name)
        assert doc.entries, name
        for e in doc.entries:
            assert e.op in ("zero_point_linear_quantize", "linear_quantize"), name
        n += 1
    assert n >= 5


@requires_shared
def test_fast_path_takes_most_statements_of_real_graphs() -> None:
    """The scanner (not Lark) must handle the bulk of tract-written bodies, or the speed is lost."""
    from nnef_kv.grammar import fastpath

    calls = {"lark": 0}
    original = fastpath._BodyScanner._lark_statement

    def counting(self: Any, p: int) -> Any:
        calls["lark"] += 1
        return original(self, p)

    total = 0
    fastpath._BodyScanner._lark_statement = counting  # type: ignore[method-assign]
    try:
        for name, text in corpus_files((".nnef",)):
            if "tract-python-written" in name:
                doc = parse(text, name)
                assert doc.graph is not None
                total += len(doc.graph.body)
    finally:
        fastpath._BodyScanner._lark_statement = original  # type: ignore[method-assign]
    assert total > 100
    assert calls["lark"] < total * 0.5, f"{calls['lark']} of {total} statements fell back to Lark"


# ------------------------------------------------------------------------------------------------
# document structure
# ------------------------------------------------------------------------------------------------
def test_single_fragment_declaration() -> None:
    doc = parse("fragment relu(x: tensor<scalar>) -> (y: tensor<scalar>);")
    assert doc.version is None and doc.graph is None
    (f,) = doc.fragments
    assert f == A.FragmentDecl(
        "relu",
        None,
        (A.Param("x", A.TensorType(A.PrimitiveType("scalar"))),),
        (A.Result("y", A.TensorType(A.PrimitiveType("scalar"))),),
        None,
    )
    assert f.pos == A.Pos(1, 1) and f.params[0].pos == A.Pos(1, 15)


def test_generic_fragment_with_defaults() -> None:
    doc = parse(
        "fragment reshape<? = scalar>( input: tensor<?>, shape: integer[], axis_start: integer = 0, "
        "axis_count: integer = -1, border: string = 'constant', p: (integer, integer)[] = [] ) "
        "-> ( output: tensor<?> );"
    )
    f = doc.fragments[0]
    assert f.generic == A.GenericDecl(A.PrimitiveType("scalar"))
    assert [p.default for p in f.params] == [
        None,
        None,
        A.IntegerLiteral(0),
        A.IntegerLiteral(-1),
        A.StringLiteral("constant"),
        A.ArrayExpr(()),
    ]
    assert parse("fragment f<?>(a: tensor<?>) -> (b: tensor<?>);").fragments[0].generic == A.GenericDecl(None)


def test_default_value_must_be_literal() -> None:
    e = err("fragment f(a: integer = b) -> (c: tensor<scalar>);", filename="lib.nnef")
    assert "literal" in e.message and e.filename == "lib.nnef" and e.line == 1


def test_fragment_only_file_with_extensions_and_empty_text() -> None:
    doc = parse("extension tract_registry tract_core;\nfragment f() -> (z: tensor<scalar>) { }")
    assert doc.version is None and doc.extensions == (A.Extension("tract_registry", "tract_core"),)
    assert doc.fragments[0].body == ()
    assert parse("") == A.Document(None)
    assert parse("# nothing\n") == A.Document(None)


def test_graph_needs_version() -> None:
    assert err("graph g() -> () {}").line == 1


def test_extension_forms() -> None:
    doc = parse(
        'version 1.0;\nextension tract_symbol 🎯0;\nextension tract_assert tg: S==1;\nextension i"odd;name" x;\n'
        'graph g() -> () {}'
    )
    assert [(x.name, x.argument) for x in doc.extensions] == [
        ("tract_symbol", "🎯0"),
        ("tract_assert", "tg: S==1"),
        ("odd;name", "x"),
    ]
    assert doc.extensions[1].pos == A.Pos(3, 1)


def test_keywords_are_identifiers_where_tract_allows() -> None:
    doc = parse(graph_doc("graph = copy(x);", "for = fragment(version, if = in, tensor);", "y = [format, scalar];"))
    assert doc.graph is not None
    assert doc.graph.body[1].rhs == A.Invocation(
        "fragment",
        None,
        (
            A.Argument(None, A.Identifier("version")),
            A.Argument("if", A.Identifier("in")),
            A.Argument(None, A.Identifier("tensor")),
        ),
    )


def test_literals() -> None:
    r = rhs("y = f(1, 1.5, 2., 1e3, 5E-1, -3, -0.25, -inf, inf, true, false, 'a', \"b\", i\"c\");")
    assert isinstance(r, A.Invocation)
    vals = [a.value for a in r.args]
    assert vals == [
        A.IntegerLiteral(1), A.ScalarLiteral(1.5), A.ScalarLiteral(2.0), A.ScalarLiteral(1000.0), A.ScalarLiteral(0.5),
        A.IntegerLiteral(-3), A.ScalarLiteral(-0.25), A.ScalarLiteral(-math.inf), A.ScalarLiteral(math.inf),
        A.LogicalLiteral(True), A.LogicalLiteral(False), A.StringLiteral("a"), A.StringLiteral("b"), A.Identifier("c"),
    ]
    assert isinstance(vals[2], A.ScalarLiteral) and isinstance(vals[0], A.IntegerLiteral)


def test_true_false_inf_as_names_where_tract_reads_names() -> None:
    r = rhs("y = true(inf = 1, false = x, x = info);")
    assert r == A.Invocation(
        "true",
        None,
        (
            A.Argument("inf", A.IntegerLiteral(1)),
            A.Argument("false", A.Identifier("x")),
            A.Argument("x", A.Identifier("info")),
        ),
    )


def test_operators_precedence_and_unary_scope() -> None:
    B, I = A.BinaryExpr, A.Identifier
    assert rhs("y = a + b * c ^ d;") == B("+", I("a"), B("*", I("b"), B("^", I("c"), I("d"))))
    assert rhs("y = a < b && c || d in e;") == B("in", B("||", B("&&", B("<", I("a"), I("b")), I("c")), I("d")), I("e"))
    assert rhs("y = -a + b;") == A.UnaryExpr("-", B("+", I("a"), I("b")))
    assert rhs("y = a * -b + c;") == B("*", I("a"), A.UnaryExpr("-", B("+", I("b"), I("c"))))
    assert rhs("y = a-1;") == B("-", I("a"), A.IntegerLiteral(1))
    assert rhs("y = a - -1;") == B("-", I("a"), A.IntegerLiteral(-1))
    assert rhs("y = - 1;") == A.UnaryExpr("-", A.IntegerLiteral(1))
    assert rhs("y = !a == +b;") == A.UnaryExpr("!", B("==", I("a"), A.UnaryExpr("+", I("b"))))
    assert rhs("y = a < b;") == B("<", I("a"), I("b"))
    assert rhs("y = a<scalar>(b);") == A.Invocation("a", A.PrimitiveType("scalar"), (A.Argument(None, I("b")),))


def test_if_else_chains_and_comprehensions() -> None:
    I = A.Identifier
    assert rhs("y = a if b else c if d else e;") == A.IfElseExpr(I("b"), I("a"), A.IfElseExpr(I("d"), I("c"), I("e")))
    r = rhs("y = [for i in a, (j, k) in b if i > 0 yield i * j];")
    assert isinstance(r, A.Comprehension)
    assert r.iterators[1].target == A.TupleExpr((I("j"), I("k")))
    assert r.condition == A.BinaryExpr(">", I("i"), A.IntegerLiteral(0))


def test_subscripts_tuples_lvalues() -> None:
    I = A.Identifier
    assert rhs("y = x[1:][0];") == A.Subscript(A.SliceExpr(I("x"), A.IntegerLiteral(1), None), A.IntegerLiteral(0))
    assert rhs("y = x[:];") == A.SliceExpr(I("x"), None, None)
    assert rhs("y = (a, (b));") == A.TupleExpr((I("a"), I("b")))
    assert rhs("y = ();") == A.TupleExpr(())
    doc = parse(graph_doc("a, [b, c] = f(x);", "(d) = g(x);"))
    assert doc.graph is not None
    assert doc.graph.body[0].lhs == A.TupleExpr((I("a"), A.ArrayExpr((I("b"), I("c")))))
    assert doc.graph.body[1].lhs == A.TupleExpr((I("d"),))  # tract: a parenthesised lvalue is a tuple


def test_strings_follow_tract_escapes_and_accept_other_quote() -> None:
    assert rhs(r"""y = f('it\'s', "a\\b", "it's", 'say "x"', "\q");""") == A.Invocation(
        "f", None, tuple(A.Argument(None, A.StringLiteral(v)) for v in ["it's", "a\\b", "it's", 'say "x"', "q"])
    )


def test_positions() -> None:
    text = ("version 1.0;\n\ngraph g(x) -> (y)\n{\n  x = external<scalar>(shape = [1, 2]);\n  y = add(x,\n"
            "     -2.0 * x);\n}\n")
    doc = parse(text)
    assert doc.graph is not None and doc.graph.pos == A.Pos(3, 1)
    a0, a1 = doc.graph.body
    assert a0.pos == A.Pos(5, 3) and a0.rhs.pos == A.Pos(5, 7)
    assert a0.rhs.generic.pos == A.Pos(5, 16)  # type: ignore[union-attr]
    arg = a0.rhs.args[0]  # type: ignore[union-attr]
    assert arg.pos == A.Pos(5, 24) and arg.value.pos == A.Pos(5, 32) and arg.value.items[1].pos == A.Pos(5, 36)
    assert a1.rhs.args[1].value.pos == A.Pos(7, 6)  # type: ignore[union-attr]
    same(doc, parse(text, fast=False))


def test_crlf_comments_and_tabs() -> None:
    text = ("version 1.0; # v\r\ngraph g(x) -> (y) # h\r\n{\t# c { ; }\r\n\tx = external(shape = [1]);\t# after\r\n"
            "  y = copy(x)\r\n  ;\r\n}\r\n# end")
    doc = parse(text)
    same(doc, parse(text, fast=False))
    assert doc.graph is not None and doc.graph.body[1].pos == A.Pos(5, 3)


# ------------------------------------------------------------------------------------------------
# errors and limits
# ------------------------------------------------------------------------------------------------
def test_error_message_format() -> None:
    text = graph_doc("x = external(shape = [1]);", "y = f(x;")
    for fast in (True, False):
        e = err(text, filename="model/graph.nnef", fast=fast)
        assert str(e) == "model/graph.nnef:5:10: expected ')' or ',' but found ';'"
        assert (e.filename, e.line, e.column, e.token, e.expected) == ("model/graph.nnef", 5, 10, "';'", ("')'", "','"))


@pytest.mark.parametrize(
    "text",
    [
        graph_doc("y = f(a b);"),
        graph_doc("y = f(a);", "z = 1.2.3;"),
        graph_doc("y = f(a)"),
        graph_doc("y = 'unterminated);"),
        graph_doc("y = f(a);") + "garbage",
        graph_doc("y = f(a);").rstrip("}\n"),
        "version 1.0;\ngraph g(x) -> (y\n{ y = x; }",
        "version 1.0;\nfragment f(a: tensor<>>) -> (b: scalar);\ngraph g() -> () {}",
        "version 1.0;\ngraph g() -> () { y = f(@); }",
        "version 1.0;\ngraph g() -> () { y = [for]; }",
        "\x00\x01",
        "version 1.0;\ngraph g() -> () { y = {{ 2 }}; }",
    ],
)
def test_errors_are_nnef_syntax_errors_and_fast_matches_lark(text: str) -> None:
    fast, slow = err(text), err(text, fast=False)
    assert str(fast) == str(slow)
    assert fast.line > 0 and fast.column > 0 and "but found" in fast.message


def test_deep_nesting_fails_quickly() -> None:
    for body in [
        "(" * 100_000 + "x" + ")" * 100_000,
        "-" * 100_000 + "x",
        "- " * 100_000 + "x",
        "[" * 100_000 + "]" * 100_000,
        "a" + "+a" * 20_000,
    ]:
        for fast in (True, False):
            t0 = time.perf_counter()
            e = err(graph_doc(f"y = {body};"), fast=fast)
            assert e.message == "nesting too deep"
            assert time.perf_counter() - t0 < 2.0


def test_nesting_limit_is_configurable() -> None:
    text = graph_doc("y = f(g(h([1])));")
    parse(text, limits=Limits(max_nesting=5))
    for fast in (True, False):
        assert err(text, limits=Limits(max_nesting=4), fast=fast).message == "nesting too deep"


def test_text_limit_and_type() -> None:
    with pytest.raises(LimitError):
        parse(graph_doc("y = x;"), limits=Limits(max_text_bytes=10))
    with pytest.raises(TypeError):
        parse(b"version 1.0;")  # type: ignore[arg-type]


def test_huge_integer_literal_is_a_syntax_error() -> None:
    for fast in (True, False):
        e = err(graph_doc("y = f(1" + "0" * 5000 + ");"), fast=fast)
        assert "invalid number literal" in e.message and e.line == 4


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(alphabet=st.sampled_from(list("()[]{}<>=;:,.-+*/^!&|#'\"\\ \n\tiax0159e_ifversiongraph")), max_size=80))
def test_garbage_raises_only_nnef_errors(body: str) -> None:
    for text in (body, graph_doc(body), "version 1.0;\n" + body):
        for fast in (True, False):
            try:
                parse(text, fast=fast)
            except NnefKvError:
                pass
    for text in (body, f'"x": {body}', f'"x": op({body});'):
        try:
            parse_quant(text)
        except NnefKvError:
            pass


@requires_shared
def test_mutated_corpus_errors_fast_equals_lark() -> None:
    """Delete/insert one character inside real graph bodies: same verdict and message both ways."""
    rng = random.Random(1234)
    texts = [t for n, t in corpus_files((".nnef",)) if "graph " in t and len(t) < 40_000][:30]
    checked = 0
    for text in texts:
        start = text.find("{", text.find("graph "))
        for _ in range(6):
            i = rng.randrange(start + 1, len(text))
            mutant = text[:i] + rng.choice(["", ";", "(", ")", ",", "x", "=", "[", "'", "#", "-"]) + text[i + 1 :]
            _check_fast_equals_lark(mutant)
            checked += 1
    assert checked >= 90


# ------------------------------------------------------------------------------------------------
# fast path == Lark on generated statements
# ------------------------------------------------------------------------------------------------
_names = st.sampled_from(
    ["x", "y1", "_t", "w_0", "true", "false", "inf", "info", "for", "if", "in", "scalar", "tensor", "graph"]
)
_nums = st.sampled_from(["0", "1", "-2", "12", "1.5", "-0.25", "2.", "1e3", "5E-1", "1.5e+2", "-inf", "007"])
_strs = st.sampled_from(["'a'", '"b c"', "''", "'a#b'", r"'x\'y'", "\"it's\"", "'é'"])
_ws = st.sampled_from(["", " ", "  ", "\t"])


@st.composite
def _value(draw: Any, depth: int = 0) -> str:
    kind = draw(st.integers(0, 6 if depth < 3 else 3))
    w = draw(_ws)
    if kind == 0:
        return draw(_names)
    if kind == 1:
        return draw(_nums)
    if kind == 2:
        return draw(_strs)
    if kind == 3:
        items = draw(st.lists(st.one_of(_names, _nums, _strs), max_size=4))
        return "[" + w + ("," + draw(_ws)).join(items) + w + "]"
    if kind == 4:
        return _invocation(draw, depth + 1)
    if kind == 5:
        return (
            draw(_value(depth + 1))
            + draw(st.sampled_from([" + ", "-", " * ", " < ", " == "]))
            + draw(_value(depth + 1))
        )
    return "(" + draw(_value(depth + 1)) + ")"


def _invocation(draw: Any, depth: int) -> str:
    name = draw(_names)
    generic = draw(st.sampled_from(["", "", "<scalar>", "< integer >"]))
    args = []
    for _ in range(draw(st.integers(0, 4))):
        v = draw(_value(depth))
        if draw(st.booleans()):
            v = draw(_names) + draw(_ws) + "=" + draw(_ws) + v
        args.append(v)
    w = draw(_ws)
    return f"{name}{generic}({w}" + ("," + draw(_ws)).join(args) + f"{w})"


@st.composite
def _statement(draw: Any) -> str:
    lhs = draw(st.sampled_from(["y", "out_1", "a, b", "[c]", "for", "true"]))
    sep = draw(_ws)
    return f"{lhs}{sep}={sep}{_invocation(draw, 0)}{draw(_ws)};"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_statement(), min_size=1, max_size=4), st.sampled_from(["\n  ", "\n\n", " ", "\n# c\n", "\r\n\t"]))
def test_fast_path_equals_lark_on_generated_statements(stmts: list[str], sep: str) -> None:
    _check_fast_equals_lark("version 1.0;\ngraph g(x) -> (y)\n{" + sep + sep.join(stmts) + "\n}\n")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_statement(), min_size=1, max_size=3))
def test_generic_scanner_equals_lark_without_shapes(stmts: list[str]) -> None:
    """The per-argument scanner (used when no statement shape applies) on its own."""
    from nnef_kv.grammar import fastpath

    original = fastpath._shape_of
    fastpath._shape_of = lambda skeleton: None  # type: ignore[assignment]
    try:
        _check_fast_equals_lark("version 1.0;\ngraph g(x) -> (y)\n{\n  " + "\n  ".join(stmts) + "\n}\n")
    finally:
        fastpath._shape_of = original  # type: ignore[assignment]


def _check_fast_equals_lark(text: str) -> None:
    results = []
    for fast in (True, False):
        try:
            results.append(parse(text, fast=fast))
        except NnefSyntaxError as e:
            results.append(str(e))
    if isinstance(results[0], str) or isinstance(results[1], str):
        assert results[0] == results[1]
    else:
        same(results[0], results[1])


def test_fast_path_is_taken_for_the_common_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    from nnef_kv.grammar import fastpath

    def boom(self: Any, p: int) -> Any:
        raise AssertionError(f"fell back to Lark at offset {p}")

    text = graph_doc(
        "x = external<scalar>(shape = [1, 64]);",
        "w = variable<scalar>(shape = [64, 64], label = 'layer/w');",
        "y = relu(add(matmul(x, w, transposeB = true), 0.5));",
        "z = f( a , [ ] , [true, inf, -1.5e3, \"s\"] , g() );",
    )
    expected = parse(text, fast=False)
    monkeypatch.setattr(fastpath._BodyScanner, "_lark_statement", boom)
    same(parse(text), expected)  # statement shapes
    monkeypatch.setattr(fastpath, "_shape_of", lambda skeleton: None)
    same(parse(text), expected)  # per-argument scanner


@requires_shared
def test_corpus_generic_scanner_equals_lark(monkeypatch: pytest.MonkeyPatch) -> None:
    from nnef_kv.grammar import fastpath

    monkeypatch.setattr(fastpath, "_shape_of", lambda skeleton: None)
    for name, text in corpus_files((".nnef",)):
        same(parse(text, name), parse(text, name, fast=False))


@requires_shared
def test_parse_is_thread_safe() -> None:
    """Per-thread parse context: concurrent parses give the same trees (positions included)."""
    from concurrent.futures import ThreadPoolExecutor

    docs = [(n, t) for n, t in corpus_files((".nnef",)) if "graph " in t][:24]
    expected = [parse(t, n, fast=False) for n, t in docs]

    def work(k: int) -> Any:
        name, text = docs[k % len(docs)]
        return parse(text, name, fast=bool(k % 2))

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(work, range(2 * len(docs))))
    for k, doc in enumerate(results):
        same(doc, expected[k % len(docs)])
