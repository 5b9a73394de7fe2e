"""Fuzzing (hypothesis): the NNEF parser, the graph.quant parser, the ``.dat`` reader, the archive reader,
``load`` + ``model.session()`` end to end, and the command line (generated argument lists for every subcommand,
section 7: only exit codes 0/1/2, no traceback, no "internal error", nothing damaged; ``NNEF_KV_FUZZ_TIMES=1``
prints the seconds spent per subcommand).

Property of every target: whatever the input (random bytes, mutated corpus files, grammar-aware generated
documents), the only exceptions that come out are :class:`nnef_kv.errors.NnefKvError` subclasses. Where a
call succeeds, a second property is checked when there is one (``parse(dump(doc)) == doc``, a decoded
tensor re-encodes to the same value).

Profiles: ``ci`` (default, 2,000 examples per target) and ``long`` (10,000 per target), chosen with the
environment variable ``NNEF_KV_FUZZ_PROFILE``::

    python -m pytest tests/properties/test_fuzz.py -q -s                           # ci profile, prints the counts
    NNEF_KV_FUZZ_PROFILE=long python -m pytest tests/properties/test_fuzz.py -q -s  # 10,000 per target
    python -m pytest tests/properties/test_fuzz.py --long -q -s                     # the same

The number of examples each target ran is printed at the end of the module (and written as JSON to
``$NNEF_KV_FUZZ_SUMMARY`` when that variable names a file). Memory-hungry targets run under a soft
address-space cap (:func:`memory_cap`) so a regression fails with MemoryError instead of eating the machine.
"""
from __future__ import annotations

import collections
import contextlib
import gzip
import io
import json
import os
import random
import resource
import struct
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import nnef_kv
from nnef_kv.errors import NnefKvError
from nnef_kv.tensors.dat import decode_tensor, encode_tensor
from nnef_kv.limits import Limits

from conftest import CONFORMANCE

# ------------------------------------------------------------------------------------------------
# profiles and counters
# ------------------------------------------------------------------------------------------------
_COMMON = dict(
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                           HealthCheck.large_base_example],
)
settings.register_profile("ci", max_examples=2000, **_COMMON)
settings.register_profile("long", max_examples=10000, **_COMMON)
PROFILE = os.environ.get("NNEF_KV_FUZZ_PROFILE", "ci")
if PROFILE not in ("ci", "long"):
    raise ValueError(f"NNEF_KV_FUZZ_PROFILE={PROFILE!r}: expected 'ci' or 'long'")
FUZZ = settings.get_profile(PROFILE)
MIN_EXAMPLES = FUZZ.max_examples

COUNTS: collections.Counter[str] = collections.Counter()

# A small model size bound for everything fuzzed: a mutated literal must not make us allocate gigabytes.
FUZZ_LIMITS = Limits(
    max_archive_bytes=64 << 20,
    max_tensor_bytes=16 << 20,
    max_members=1000,
    max_text_bytes=1 << 20,
    max_nesting=200,
    max_comprehension_items=100_000,
)


@pytest.fixture(scope="module", autouse=True)
def _report_counts(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    lines = [f"fuzz profile {PROFILE!r}: examples run per target"]
    lines += [f"  {name:28s} {n:7d}" for name, n in sorted(COUNTS.items())]
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capman = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capman is not None:
        with capman.global_and_fixture_disabled():
            reporter.write_line("")
            for line in lines:
                reporter.write_line(line)
    out = os.environ.get("NNEF_KV_FUZZ_SUMMARY")
    if out:
        Path(out).write_text(json.dumps({"profile": PROFILE, "counts": dict(COUNTS)}, indent=1))


def _count(target: str) -> None:
    COUNTS[target] += 1


def _check_count(target: str) -> None:
    """Each target ran at least the profile's number of examples (hypothesis may run a few more)."""
    assert COUNTS[target] >= MIN_EXAMPLES, f"{target}: only {COUNTS[target]} examples ran"


@contextlib.contextmanager
def memory_cap(extra: int = 3 << 30) -> Iterator[None]:
    """Soft RLIMIT_AS at the current address space + ``extra`` bytes, restored on exit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    try:
        with open("/proc/self/statm") as f:
            vm = int(f.read().split()[0]) * resource.getpagesize()
    except OSError:  # not Linux: no cap
        yield
        return
    cap = vm + extra
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def clean(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """``fn(...)``, or None when it raised one of nnef-kv's own errors; any other exception escapes."""
    try:
        return fn(*args, **kw)
    except NnefKvError as e:
        assert str(e).strip(), f"{type(e).__name__} with an empty message"
        return None


# ------------------------------------------------------------------------------------------------
# corpus
# ------------------------------------------------------------------------------------------------
def _files(pattern: str, max_size: int) -> list[bytes]:
    if not CONFORMANCE.is_dir():
        return []
    out = []
    for p in sorted(CONFORMANCE.rglob(pattern)):
        if p.is_file() and p.stat().st_size <= max_size and ".mako" not in p.name:
            out.append(p.read_bytes())
    return out


NNEF_CORPUS = list(dict.fromkeys(_files("*.nnef", 64 << 10)))  # distinct contents
QUANT_CORPUS = _files("*.quant", 64 << 10)
DAT_CORPUS = _files("*.dat", 64 << 10)
ARCHIVE_CORPUS = _files("*.tgz", 64 << 10) + _files("*.tar", 64 << 10)

# built-in seeds so every target fuzzes something even without the shared corpus
SEED_NNEF = b"""version 1.0;
extension tract_registry tract_core;
fragment f(a: tensor<scalar>, k: integer = 2) -> (b: tensor<scalar>) { b = mul(a, scalar(k)); }
graph g(x) -> (y, z) {
  x = external<scalar>(shape = [2, 3]);
  w = variable<scalar>(label = "w", shape = [2, 3]);
  t = [for i in [1, 2, 3] if i > 1 yield i * 2];
  y = add(f(x, k = 3), w);
  z = relu(-y[0:1] if true else y) ^ 2.0;
}
"""
SEED_QUANT = (b'"x": zero_point_linear_quantize(zero_point = 0, scale = 0.5, bits = 8, signed = false, '
              b'symmetric = false);\n')
NNEF_CORPUS.append(SEED_NNEF)
QUANT_CORPUS.append(SEED_QUANT)
DAT_CORPUS.append(encode_tensor(np.arange(6, dtype=np.float32).reshape(2, 3)))
DAT_CORPUS.append(encode_tensor(np.array([True, False, True])))
DAT_CORPUS.append(encode_tensor(np.array(["a", "bc"], dtype=object)))


def _small_cases(max_bytes: int = 1500) -> list[Path]:
    """Conformance folders small enough to load, plan and run thousands of times."""
    if not CONFORMANCE.is_dir():
        return []
    out = []
    for g in sorted(CONFORMANCE.glob("tract-harness/**/graph.nnef")):
        folder = g.parent
        files = [p for p in folder.iterdir() if p.is_file() and p.suffix != ".npz" and p.name != "expected"]
        if sum(p.stat().st_size for p in files) <= max_bytes:
            out.append(folder)
    return out


SMALL_CASES = _small_cases()


def _case_members(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())
            if p.is_file() and p.suffix != ".npz" and p.name != "expected"}


CASE_MEMBERS = [_case_members(f) for f in SMALL_CASES]

# ------------------------------------------------------------------------------------------------
# mutations
# ------------------------------------------------------------------------------------------------
INTERESTING_TOKENS = [
    b"(", b")", b"[", b"]", b"{", b"}", b"-", b"!", b",", b";", b":", b"=", b"<", b">", b"?", b"#", b'"', b"'",
    b"i\"", b"\\", b"\x00", b"\xff", b"\xe2\x80\xa8", b"\r", b"inf", b"-inf", b"nan", b"1e309", b"-0.0",
    b"99999999999999999999999", b"4294967296", b"-1", b"0", b"true", b"false", b"tensor<>", b"integer[]",
    b"for", b"yield", b"if", b"else", b"in", b"fragment", b"graph", b"version", b"extension", b"external",
    b"variable", b"tract_core_", b"[for i in [1, 2] yield i]", b"x", b"shape = []", b"(((", b"]]]",
]


def mutate(data: bytes, rng: random.Random, n: int) -> bytes:
    """``n`` mutations of ``data``: byte flips, truncations, inserted tokens, duplicated/deleted/swapped lines."""
    buf = bytearray(data)
    for _ in range(n):
        kind = rng.choice(MUTATIONS)
        size = len(buf)
        pos = rng.randrange(size) if size else 0
        if kind == "flip" and size:
            buf[pos] ^= 1 << rng.randrange(8)
        elif kind == "set" and size:
            buf[pos] = rng.choice([0, 0x7F, 0x80, 0xFF, ord('"'), ord("("), ord("["), ord("0"), ord(";")])
        elif kind == "truncate":
            del buf[pos:]
        elif kind == "insert":
            buf[pos:pos] = rng.randbytes(rng.randint(1, 8))
        elif kind == "delete":
            del buf[pos: pos + rng.randint(1, 16)]
        elif kind == "token":
            buf[pos:pos] = rng.choice(INTERESTING_TOKENS)
        elif kind == "repeat" and size:
            chunk = bytes(buf[pos: pos + rng.randint(1, 32)])
            buf[pos:pos] = chunk * rng.randint(1, 8)
        elif kind in ("dup_line", "del_line", "swap_lines"):
            lines = bytes(buf).split(b"\n")
            i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
            if kind == "dup_line":
                lines.insert(j, lines[i])
            elif kind == "del_line":
                del lines[i]
            else:
                lines[i], lines[j] = lines[j], lines[i]
            buf = bytearray(b"\n".join(lines))
    return bytes(buf)


MUTATIONS = ["flip", "set", "truncate", "insert", "delete", "dup_line", "del_line", "swap_lines", "repeat", "token"]


def mutated(corpus: list[bytes], max_mutations: int = 6) -> st.SearchStrategy[bytes]:
    """A corpus file with 1..max_mutations mutations. The mutations are driven by a seed drawn by
    hypothesis (cheap to generate; a failure prints the input itself)."""
    return st.builds(
        lambda i, seed, n: mutate(corpus[i], random.Random(seed), n),
        st.integers(0, len(corpus) - 1), st.integers(0, 2**32 - 1), st.integers(1, max_mutations),
    )


def as_text(b: bytes) -> str:
    """Bytes as text without losing any (invalid UTF-8 sequences become lone surrogates)."""
    return b.decode("utf-8", "surrogateescape")


# ------------------------------------------------------------------------------------------------
# grammar-aware generation of NNEF documents
# ------------------------------------------------------------------------------------------------
KEYWORDS = ["version", "extension", "fragment", "graph", "tensor", "integer", "scalar", "logical", "string",
            "true", "false", "for", "in", "if", "else", "yield", "length_of", "range_of", "shape_of"]
OPS = ["relu", "add", "sub", "mul", "div", "neg", "exp", "log", "abs", "sqrt", "max", "min", "select", "matmul",
       "reshape", "transpose", "concat", "slice", "squeeze", "unsqueeze", "sum_reduce", "mean_reduce", "softmax",
       "copy", "clamp", "pow", "tract_core_cast", "tract_core_range", "tile", "pad", "constant", "variable",
       "external", "conv", "box", "sigmoid", "tanh", "f", "undefined_op"]
NAMES = ["x", "y", "z", "a", "b", "w", "t", "i", "j", "k", "P", "S", "_", "x_1", "Tensor", "f"]
BIN = ["+", "-", "*", "/", "^", "<", "<=", ">", ">=", "==", "!=", "&&", "||", "in"]
TYPES = ["integer", "scalar", "logical", "string", "complex", "?", "tensor<scalar>", "tensor<integer>", "tensor<?>",
         "tensor<>"]
FLOATS = ["inf", "-inf", "1e309", "1e-400", "0.", ".5", "1E3", "-0.0", "1.0e+10", "0.0", "3.5", "-2.25", "1e-6"]
INTS = ["0", "1", "2", "3", "-1", "10", "2147483648", "4294967296", "9223372036854775808", "18446744073709551616",
        "1000000000000000000000000000000"]
STR_CHARS = ['a', 'b', ' ', "'", '\\\\', '\\"', '\\n', '\\t', '\\x41', '\\u00e9', 'é', '🎯', '#', '(']


class DocGen:
    """Grammar-aware generator of NNEF (and graph.quant) texts, driven by a seeded ``random.Random``:
    mostly valid documents with occasional invalid choices (keywords as names, bad types, odd numbers)."""

    def __init__(self, rng: random.Random, leaves: int = 12, tame: bool | None = None) -> None:
        self.r = rng
        self.budget = leaves
        # tame documents use plain names and ordinary literals, so that most of them parse and the
        # round trip parse(dump(doc)) == doc gets exercised; wild ones go everywhere
        self.tame = rng.random() < 0.5 if tame is None else tame

    def chance(self, p: float) -> bool:
        return self.r.random() < p

    def ident(self) -> str:
        r = self.r
        if self.tame:
            return r.choice(NAMES[:-2])
        k = r.random()
        name = r.choice(NAMES) if k < 0.7 else r.choice(KEYWORDS) if k < 0.8 else "".join(
            r.choice("abcxyz_019") for _ in range(r.randint(1, 6)))
        if self.chance(0.05):
            return 'i"' + name + "." + name + '"'
        return name

    def literal(self) -> str:
        r = self.r
        k = r.randrange(4)
        if self.tame and k in (0, 1):
            return str(r.randint(-3, 10)) if k == 0 else repr(round(r.uniform(-100, 100), r.randint(0, 6)))
        if k == 0:
            return r.choice(INTS) if self.chance(0.3) else str(r.randint(-3, 10))
        if k == 1:
            return r.choice(FLOATS) if self.chance(0.5) else repr(round(r.uniform(-100, 100), r.randint(0, 6)))
        if k == 2:
            return '"' + "".join(r.choice(STR_CHARS) for _ in range(r.randint(0, 6))) + '"'
        return r.choice(["true", "false"])

    def expr(self, depth: int = 0) -> str:
        r = self.r
        self.budget -= 1
        if self.budget <= 0 or depth > 6 or self.chance(0.3):
            return self.literal() if self.chance(0.5) else self.ident()
        k = r.randrange(11)
        e = lambda: self.expr(depth + 1)  # noqa: E731
        if k == 0:
            return f"{e()} {r.choice(BIN)} {e()}"
        if k == 1:
            return f"{r.choice(['-', '!', '+'])}{e()}"
        if k == 2:
            return f"({e()})"
        if k == 3:
            return "[" + ", ".join(e() for _ in range(r.randint(0, 4))) + "]"
        if k == 4:
            return "(" + ", ".join(e() for _ in range(r.randint(2, 3))) + ")"
        if k == 5:
            return f"{e()} if {e()} else {e()}"
        if k == 6:
            return f"{e()}[{e()}]"
        if k == 7:
            lo = e() if self.chance(0.7) else ""
            hi = e() if self.chance(0.7) else ""
            return f"{e()}[{lo}:{hi}]"
        if k == 8:
            its = ", ".join(f"{self.ident()} in {e()}" for _ in range(r.randint(1, 2)))
            cond = f" if {e()}" if self.chance(0.3) else ""
            return f"[for {its}{cond} yield {e()}]"
        generic = r.choice(["", "", "", "<scalar>", "<integer>", "<logical>", "<>", "<?>"])
        args = []
        for _ in range(r.randint(0, 4)):
            args.append(f"{self.ident()} = {e()}" if self.chance(0.4) else e())
        return f"{r.choice(OPS)}{generic}({', '.join(args)})"

    def type_spec(self, depth: int = 0) -> str:
        r = self.r
        k = r.random()
        if depth > 2 or k < 0.6:
            return r.choice(TYPES)
        if k < 0.8:
            return self.type_spec(depth + 1) + "[]"
        return "(" + ", ".join(self.type_spec(depth + 1) for _ in range(r.randint(1, 3))) + ")"

    def lvalue(self) -> str:
        r = self.r
        k = r.random()
        if k < 0.8:
            return self.ident()
        names = ", ".join(self.ident() for _ in range(r.randint(1, 3)))
        return f"({names})" if k < 0.9 else f"[{names}]" if k < 0.95 else names

    def assignment(self) -> str:
        self.budget = self.r.randint(1, 14)
        return f"  {self.lvalue()} = {self.expr()};"

    def fragment(self) -> str:
        r = self.r
        params = []
        for _ in range(r.randint(0, 3)):
            self.budget = 2
            default = f" = {self.literal()}" if self.chance(0.3) else ""
            params.append(f"{self.ident()}: {self.type_spec()}{default}")
        results = ", ".join(f"{self.ident()}: {self.type_spec()}" for _ in range(r.randint(1, 2)))
        body = (";" if self.chance(0.4)
                else " {\n" + "\n".join(self.assignment() for _ in range(r.randint(0, 3))) + "\n}")
        generic = r.choice(["", "", "<?>", "<? = scalar>"])
        return f"fragment {self.ident()}{generic}({', '.join(params)}) -> ({results}){body}"

    def extension(self) -> str:
        return self.r.choice(["extension KHR_enable_fragment_definitions, KHR_enable_operator_expressions;",
                              "extension tract_registry tract_core;", "extension tract_symbol S;",
                              "extension tract_assert S >= 0;", "extension tract_registry;",
                              f"extension {self.ident()};"])

    def graph(self) -> str:
        r = self.r
        ins = ", ".join(self.ident() for _ in range(r.randint(0, 3)))
        outs = ", ".join(self.ident() for _ in range(r.randint(1, 3)))
        body = "\n".join(self.assignment() for _ in range(r.randint(0, 6)))
        return f"graph {self.ident()}({ins}) -> ({outs}) {{\n{body}\n}}"

    def document(self) -> str:
        r = self.r
        if self.tame:
            return "version 1.0;\n" + "\n".join(
                [self.extension() for _ in range(r.randint(0, 2))] + [self.fragment() for _ in range(r.randint(0, 2))]
                + [self.graph()])
        parts = [r.choice(["version 1.0;"] * 6 + ["version 1.0 ;", "version 1;", "version 2.0;", "", "version 1.0"])]
        parts += [self.extension() for _ in range(r.randint(0, 3))]
        parts += [self.fragment() for _ in range(r.randint(0, 2))]
        if self.chance(0.8):
            parts.append(self.graph())
        sep = r.choice(["\n", "\n", " ", "\n# comment\n", "\r\n", "\t"])
        return sep.join(parts) + r.choice(["", "\n", "  # end"])

    def quant_document(self) -> str:
        r = self.r
        lines = []
        for _ in range(r.randint(0, 5)):
            key = r.choice([f'"{self.ident()}"', f"'{self.ident()}'", self.ident(), '"a\\"b"'])
            op = r.choice(["zero_point_linear_quantize", "linear_quantize", "min_max_linear_quantize", "q"])
            args = ", ".join(f"{r.choice(['zero_point', 'scale', 'bits', 'signed', 'symmetric', 'min', 'max', 'x'])}"
                             f" = {self.literal()}" for _ in range(r.randint(0, 6)))
            lines.append(f"{key}: {op}({args});")
        return "\n".join(lines)


SEEDS = st.integers(0, 2**64 - 1)
nnef_document = SEEDS.map(lambda seed: DocGen(random.Random(seed)).document())
quant_document = SEEDS.map(lambda seed: DocGen(random.Random(seed)).quant_document())


# ------------------------------------------------------------------------------------------------
# 1. the NNEF parser
# ------------------------------------------------------------------------------------------------
def _parse_and_roundtrip(text: str) -> Any:
    """The parsed document (None when refused), after checking ``parse(dump(doc)) == doc``."""
    doc = clean(nnef_kv.parse, text, filename="fuzz.nnef", limits=FUZZ_LIMITS)
    if doc is None:
        return None
    printed = nnef_kv.dump(doc)
    again = nnef_kv.parse(printed, filename="fuzz-dump.nnef")
    assert again == doc, f"parse(dump(doc)) != doc for:\n{text!r}\nprinted:\n{printed}"
    return doc


@FUZZ
@given(st.one_of(st.text(max_size=400), st.binary(max_size=400).map(as_text)))
def test_parse_random_text(text: str) -> None:
    _count("parse/random")
    clean(nnef_kv.parse, text, filename="fuzz.nnef", limits=FUZZ_LIMITS)


@FUZZ
@given(mutated(NNEF_CORPUS).map(as_text))
def test_parse_mutated_corpus(text: str) -> None:
    _count("parse/mutated")
    _parse_and_roundtrip(text)


@FUZZ
@given(nnef_document)
def test_parse_generated(text: str) -> None:
    _count("parse/generated")
    doc = _parse_and_roundtrip(text)
    if doc is not None and doc.graph is not None:  # and on to a session
        with memory_cap():
            _graph_session(doc)


def test_parse_counts() -> None:
    for t in ("parse/random", "parse/mutated", "parse/generated"):
        _check_count(t)


# ------------------------------------------------------------------------------------------------
# 2. the graph.quant parser
# ------------------------------------------------------------------------------------------------
def _quant_roundtrip(text: str) -> None:
    q = clean(nnef_kv.parse_quant, text, filename="fuzz.quant", limits=FUZZ_LIMITS)
    if q is None:
        return
    printed = nnef_kv.dump_quant(q)
    assert nnef_kv.parse_quant(printed, filename="fuzz-dump.quant") == q, f"quant round trip:\n{text!r}\n{printed}"


@FUZZ
@given(st.one_of(st.text(max_size=300), st.binary(max_size=300).map(as_text), mutated(QUANT_CORPUS).map(as_text),
                 quant_document))
def test_parse_quant(text: str) -> None:
    _count("parse_quant")
    _quant_roundtrip(text)


def test_parse_quant_count() -> None:
    _check_count("parse_quant")


# ------------------------------------------------------------------------------------------------
# 3. the .dat reader
# ------------------------------------------------------------------------------------------------
U32 = st.one_of(st.sampled_from([0, 1, 2, 3, 4, 5, 7, 8, 16, 31, 32, 33, 64, 128, 0x1000, 0x2040, 0x3040, 0x3080,
                                 0x3081, 0x5452, 0x7FFFFFFF, 0xFFFFFFFF]),
                st.integers(0, 0xFFFFFFFF))
ITEM_TYPES = st.one_of(
    st.sampled_from([0, 1, 2, 3, 4, 5, 0x5452_0000, 0x5452_0004, 0x5452_1000, 0x5452_2040, 0x5452_3040,
                     0x5452_3080, 0x5452_3081]),
    U32,
)


@st.composite
def dat_file(draw: st.DrawFn) -> bytes:
    """A header built field by field (often plausible, sometimes absurd) and a payload of any length."""
    rank = draw(st.one_of(st.integers(0, 4), U32))
    dims = draw(st.lists(st.one_of(st.integers(0, 5), U32), min_size=8, max_size=8))
    bits = draw(st.one_of(st.sampled_from([1, 8, 16, 32, 64, 128, 0xFFFFFFFF]), U32))
    count = 1
    for d in dims[: min(rank, 8)]:
        count *= d
    plausible = (count * bits + 7) // 8 if bits < 1024 else 0
    length = draw(st.one_of(st.just(plausible & 0xFFFFFFFF), U32))
    head = struct.pack("<2sBBII8III", b"\x4e\xef", draw(st.sampled_from([1, 1, 1, 2, 0])),
                       draw(st.integers(0, 255)), length, rank, *dims, bits, draw(ITEM_TYPES))
    head += draw(st.one_of(st.just(bytes(76)), st.binary(min_size=76, max_size=76)))
    payload_size = draw(st.one_of(st.just(min(length, 4096)), st.integers(0, 512)))
    payload = draw(st.binary(min_size=min(payload_size, 64), max_size=min(payload_size, 64)))
    payload = (payload * (payload_size // max(len(payload), 1) + 1))[:payload_size] if payload else bytes(payload_size)
    return head + payload


def _dat_roundtrip(blob: bytes) -> None:
    got = clean(nnef_kv.read_tensor, io.BytesIO(blob), with_info=True, limits=FUZZ_LIMITS)
    got2 = clean(decode_tensor, blob, name="fuzz.dat", limits=FUZZ_LIMITS)
    assert (got is None) == (got2 is None), "read_tensor(stream) and decode_tensor(bytes) disagree"
    if got2 is None:
        return
    value, info = got2
    again, _ = decode_tensor(encode_tensor(value, info), limits=FUZZ_LIMITS)
    if isinstance(value, np.ndarray):
        assert again.dtype == value.dtype and again.shape == value.shape
        if value.dtype.kind in "fcV":  # bit for bit (NaN payloads, -0.0), 0-d arrays included
            assert again.tobytes() == value.tobytes()
        else:
            assert np.array_equal(again, value)
    else:
        assert again.shape == value.shape and bytes(again.blocks) == bytes(value.blocks)


@FUZZ
@given(st.one_of(st.binary(max_size=300), mutated(DAT_CORPUS), dat_file()))
@example(blob=struct.pack("<2sBBII8III", b"\x4e\xef", 1, 0, 2, 0, *[0] * 8, 16, 0) + bytes(76) + bytes(2))  # 0-d f16
def test_read_tensor(blob: bytes) -> None:
    _count("read_tensor")
    with memory_cap():
        _dat_roundtrip(blob)


def test_read_tensor_count() -> None:
    _check_count("read_tensor")


# ------------------------------------------------------------------------------------------------
# 4. the archive reader (random / mutated / constructed tar and tgz files)
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fuzz_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="nnef-kv-fuzz-") as d:
        yield Path(d)


def _tar_bytes(members: dict[str, bytes], gz: bool = False) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
        for name, data in members.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    raw = buf.getvalue()
    return gzip.compress(raw, mtime=0) if gz else raw


MEMBER_NAMES = st.one_of(
    st.sampled_from(["graph.nnef", "graph.quant", "w.dat", "a/b.dat", "./graph.nnef", ".hidden/x.dat", "/abs.dat",
                     "../up.dat", "a/../b.dat", "sub/graph.nnef", "x.json", "", ".", "a//b.dat", "w.dat"]),
    st.text(alphabet="ab./_-\\:\x00é", min_size=1, max_size=12),
)
MEMBER_TYPES = st.sampled_from([tarfile.REGTYPE, tarfile.REGTYPE, tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE,
                                tarfile.LNKTYPE, tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE, tarfile.CONTTYPE,
                                b"x", b"g", b"L", b"S"])


@st.composite
def constructed_tar(draw: st.DrawFn) -> bytes:
    """A tar written member by member with hostile names, types, link targets and sizes."""
    buf = io.BytesIO()
    fmt = draw(st.sampled_from([tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT]))
    payloads = [SEED_NNEF, *DAT_CORPUS[-3:], b"", b"garbage"]
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for _ in range(draw(st.integers(0, 5))):
            name = draw(MEMBER_NAMES)
            ti = tarfile.TarInfo(name)
            ti.type = draw(MEMBER_TYPES)
            data = draw(st.sampled_from(payloads)) if ti.type in (tarfile.REGTYPE, tarfile.CONTTYPE) else b""
            ti.size = len(data)
            ti.linkname = draw(st.sampled_from(["", "graph.nnef", "/etc/passwd", "../x", "w.dat"]))
            try:
                tf.addfile(ti, io.BytesIO(data) if data else None)
            except (ValueError, tarfile.TarError, UnicodeError):
                continue  # tarfile cannot write it: not an input anyone can hand us
    raw = buf.getvalue()
    if draw(st.booleans()):  # lie about sizes / truncate after writing
        raw = draw(mutated([raw], max_mutations=2))
    return gzip.compress(raw, mtime=0) if draw(st.booleans()) else raw


@st.composite
def mutated_archive(draw: st.DrawFn) -> bytes:
    if ARCHIVE_CORPUS and draw(st.booleans()):
        return draw(mutated(ARCHIVE_CORPUS, max_mutations=3))
    members = draw(st.sampled_from(CASE_MEMBERS)) if CASE_MEMBERS else {"graph.nnef": SEED_NNEF}
    raw = _tar_bytes(members)
    gz = draw(st.booleans())
    raw = draw(mutated([raw], max_mutations=3))
    if gz:
        raw = gzip.compress(raw, mtime=0)
        if draw(st.booleans()):
            raw = draw(mutated([raw], max_mutations=2))
    return raw


@FUZZ
@given(blob=st.one_of(st.binary(max_size=2048), st.binary(max_size=64).map(lambda b: b"\x1f\x8b" + b),
                      mutated_archive(), constructed_tar()))
def test_load_archive(fuzz_dir: Path, blob: bytes) -> None:
    _count("load/archive")
    target = fuzz_dir / "model.nnef.tgz"
    target.write_bytes(blob)
    with memory_cap():
        model = clean(nnef_kv.load, target, limits=FUZZ_LIMITS, check=False)
    if model is not None:
        assert isinstance(model.document, nnef_kv.grammar.ast.Document)


def test_load_archive_count() -> None:
    _check_count("load/archive")


# ------------------------------------------------------------------------------------------------
# 5. load end to end, then make a session (and run it when the inputs are small and concrete)
# ------------------------------------------------------------------------------------------------
@st.composite
def mutated_case(draw: st.DrawFn) -> dict[str, bytes]:
    """A small conformance case with its graph.nnef (and sometimes a .dat or graph.quant) mutated."""
    members = dict(draw(st.sampled_from(CASE_MEMBERS)))
    victim = draw(st.sampled_from(sorted(members)))
    if victim == "graph.nnef" or draw(st.booleans()):
        victim = "graph.nnef"
    members[victim] = draw(mutated([members[victim]], max_mutations=3))
    if draw(st.integers(0, 9)) == 0:  # drop a member
        members.pop(draw(st.sampled_from(sorted(members))))
    return members


def _run_small(session: Any) -> None:
    """Run once on zeros when every input has a concrete, small shape."""
    rng = np.random.default_rng(0)
    feeds = {}
    for spec in session.plan.inputs:
        shape = spec.shape
        if not all(type(d) is int and 0 <= d <= 64 for d in shape) or int(np.prod(shape)) > 4096:
            return
        dt = np.dtype(spec.dtype)
        feeds[spec.name] = (rng.standard_normal(shape).astype(dt) if dt.kind == "f" else np.zeros(shape, dt))
    session.run(feeds)


# Crash sites already reported (exception type, file, function of the innermost nnef_kv frame), each pinned by
# a strict xfail test at the end of this module; the fuzzer keeps looking for new ones.
KNOWN_SESSION_BUGS: dict[tuple[str, str, str], str] = {}  # none open: add (type, file, function): test name


def _signature(exc: BaseException) -> tuple[str, str, str]:
    import traceback

    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f"{os.sep}nnef_kv{os.sep}" in f.filename]
    f = frames[-1] if frames else traceback.extract_tb(exc.__traceback__)[-1]
    return type(exc).__name__, os.path.basename(f.filename), f.name


def _load_and_session(path: Path) -> None:
    model = clean(nnef_kv.load, path, limits=FUZZ_LIMITS)
    if model is None:
        return
    try:
        session = clean(model.session)
        if session is None:
            return
        clean(_run_small, session)
    except NnefKvError:
        raise
    except Exception as exc:
        if _signature(exc) in KNOWN_SESSION_BUGS:
            return
        raise


@pytest.mark.skipif(not CASE_MEMBERS, reason=f"conformance corpus not found at {CONFORMANCE}")
@FUZZ
@given(members=mutated_case(), gz=st.booleans())
def test_load_session(fuzz_dir: Path, members: dict[str, bytes], gz: bool) -> None:
    _count("load+session")
    target = fuzz_dir / ("case.nnef.tgz" if gz else "case.nnef.tar")
    target.write_bytes(_tar_bytes(members, gz=gz))
    with memory_cap():
        _load_and_session(target)


@pytest.mark.skipif(not CASE_MEMBERS, reason=f"conformance corpus not found at {CONFORMANCE}")
def test_load_session_count() -> None:
    _check_count("load+session")


# ------------------------------------------------------------------------------------------------
# 6. grammar-aware generated graphs (well-formed op calls with odd arguments) -> session -> run
# ------------------------------------------------------------------------------------------------
class GraphGen:
    """Random graphs of real ops: inputs of small shapes, then statements calling unary/binary/shape ops on
    earlier names with random (often invalid) attributes and literals."""

    UNARY = ["relu", "exp", "log", "sqrt", "rsqrt", "neg", "abs", "sign", "sigmoid", "tanh", "floor", "ceil",
             "round", "not", "copy", "sin", "cos", "softplus", "elu", "tract_core_erf"]
    BINARY = ["add", "sub", "mul", "div", "pow", "max", "min", "lt", "gt", "eq", "ne", "and", "or"]

    def __init__(self, rng: random.Random) -> None:
        self.r = rng
        self.names: list[str] = []

    def dims(self, n: int | None = None) -> list[int]:
        r = self.r
        return [r.choice([1, 1, 2, 3, 4, 0]) for _ in range(r.randint(0, 4) if n is None else n)]

    def ints(self, lo: int = -3, hi: int = 4, n: int | None = None) -> str:
        count = self.r.randint(0, 4) if n is None else n
        return "[" + ", ".join(str(self.r.randint(lo, hi)) for _ in range(count)) + "]"

    def operand(self) -> str:
        r = self.r
        k = r.random()
        if k < 0.75 and self.names:
            return r.choice(self.names)
        if k < 0.85:
            return r.choice(["0.0", "1.0", "-1.0", "2", "inf", "-inf", "true", "0.5"])
        if k < 0.95:
            vals = ", ".join(r.choice(["1.0", "-2.0", "0.5", "3.0"]) for _ in range(r.randint(1, 4)))
            return f"[{vals}]" if r.random() < 0.7 else f"[[{vals}], [{vals}]]"
        return f"constant<scalar>(shape = {self.dims()}, value = [{r.choice(['1.0', '0.0', '2.5'])}])"

    def call(self) -> str:
        r = self.r
        a, b = self.operand(), self.operand()
        k = r.randrange(16)
        if k < 4:
            return f"{r.choice(self.UNARY)}({a})"
        if k < 8:
            return f"{r.choice(self.BINARY)}({a}, {b})"
        if k == 8:
            return f"reshape({a}, shape = {self.ints(-1, 4)})"
        if k == 9:
            return f"transpose({a}, axes = {self.ints(0, 3)})"
        if k == 10:
            return f"{r.choice(['squeeze', 'unsqueeze'])}({a}, axes = {self.ints(-2, 3)})"
        if k == 11:
            n = r.randint(0, 3)
            return (f"slice({a}, axes = {self.ints(0, 3, n)}, begin = {self.ints(-3, 3, n)}, "
                    f"end = {self.ints(-3, 5, n)}, stride = {self.ints(-2, 2, n)})")
        if k == 12:
            return f"concat([{a}, {b}], axis = {r.randint(-1, 3)})"
        if k == 13:
            op = r.choice(["sum_reduce", "mean_reduce", "max_reduce", "argmax_reduce", "softmax"])
            return f"{op}({a}, axes = {self.ints(-1, 3)})"
        if k == 14:
            ta, tb = r.choice(['true', 'false']), r.choice(['true', 'false'])
            return f"matmul({a}, {b}, transposeA = {ta}, transposeB = {tb})"
        op = r.choice(["pad", "tile", "cast", "gather", "clamp", "select", "range"])
        if op == "pad":
            pads = ", ".join(f"({r.randint(-1, 2)}, {r.randint(0, 2)})" for _ in range(r.randint(0, 3)))
            border = r.choice(['constant', 'reflect', 'replicate', 'edge'])
            return f"pad({a}, padding = [{pads}], border = \"{border}\")"
        if op == "tile":
            return f"tile({a}, repeats = {self.ints(0, 3)})"
        if op == "cast":
            return f"tract_core_cast({a}, to = \"{r.choice(['f32', 'f16', 'i64', 'i32', 'u8', 'bool', 'f64', 'x'])}\")"
        if op == "gather":
            return f"tract_core_gather({a}, {r.choice(['[0]', '[1, 0]', '[5]', '[-1]', b])}, axis = {r.randint(-1, 2)})"
        if op == "clamp":
            return f"clamp({a}, {b}, {self.operand()})"
        if op == "select":
            return f"select({self.operand()}, {a}, {b})"
        return f"tract_core_range({r.randint(-2, 3)}, {r.randint(-2, 6)}, {r.choice([1, 2, -1, 0])})"

    def graph(self) -> str:
        r = self.r
        ins = [f"i{k}" for k in range(r.randint(1, 2))]
        lines = [f"  {n} = external<scalar>(shape = {self.dims()});" for n in ins]
        self.names = list(ins)
        for k in range(r.randint(1, 6)):
            name = f"t{k}"
            lines.append(f"  {name} = {self.call()};")
            self.names.append(name)
        outs = sorted({r.choice(self.names[len(ins):]) for _ in range(r.randint(1, 2))})
        return ("version 1.0;\nextension tract_registry tract_core;\n"
                f"graph g({', '.join(ins)}) -> ({', '.join(outs)}) {{\n" + "\n".join(lines) + "\n}\n")


def _graph_session(text_or_doc: str | Any) -> None:
    """Parse (unless given a document), make a session, run it on small inputs: only nnef-kv errors, or a
    known crash signature (KNOWN_SESSION_BUGS)."""
    doc = (clean(nnef_kv.parse, text_or_doc, filename="gen.nnef", limits=FUZZ_LIMITS)
           if isinstance(text_or_doc, str) else text_or_doc)
    if doc is None:
        return
    model = nnef_kv.Model(document=doc, source="gen")
    try:
        session = clean(model.session)
        if session is not None:
            clean(_run_small, session)
    except NnefKvError:
        raise
    except Exception as exc:
        if _signature(exc) in KNOWN_SESSION_BUGS:
            return
        raise


@FUZZ
@given(SEEDS.map(lambda seed: GraphGen(random.Random(seed)).graph()))
def test_generated_graph_session(text: str) -> None:
    _count("graph+session")
    with memory_cap():
        _graph_session(text)


def test_generated_graph_session_count() -> None:
    _check_count("graph+session")


# ------------------------------------------------------------------------------------------------
# 7. the command line: generated argument lists for every subcommand (issue 13)
# ------------------------------------------------------------------------------------------------
# Paths of tests/cli_world.py's world (good and bad inputs, special files, every kind of output target) and
# values for every option, read from the parser itself (a subcommand added later is fuzzed too). The property:
# the exit code is 0, 1 or 2 (130 only if a Ctrl-C came), no traceback, no "internal error", a refusal is one
# line, and nothing changes where nothing may (World.damage: the inputs, special files, links, the precious
# folder, no temporary left). Every command runs under small limits, and the decoders hold 16 positions, so
# no example can do much work.
from cli_world import World, run_cli  # noqa: E402

CLI_LIMITS = ["--max-archive-bytes", str(64 << 20), "--max-tensor-bytes", str(16 << 20), "--max-members", "1000"]
IN_NAMES = ["f32.nnef.tar", "dyn.nnef.tar", "plain.nnef.tar", "undef", "badadd", "strop", "badreshape", "unknownop",
            "tokenizer.json", "junk.tgz", "empty", "m.onnx", "w.dat", "io.npz", "ids1.npz", "x.npz", "badkey.npz",
            "badstep.npz", "strexp.npz", "obj.npz", "arr.npy", "empty.npz", "trunc.npz", "text.npz", "huge.npz",
            "bomb.npz", "prompt.txt", "ids.txt", "bigid.txt", "hugeid.txt", "fifo", "chr", "link_f32.tar", "absent"]
OUT_NAMES = ["new.npz", "new.tgz", "new.tar", "newdir", "existing.npz", "existing.tgz", "model", "precious",
             "empty_dir", "fifo", "chr", "link_file.npz", "link_file.tgz", "link_fifo.npz", "link_fifo.tgz",
             "dangling.npz", "loop.npz", "file_parent", "file_parent/x.npz", "rdir", "ok.zip", "ok.nnef", "x.onnx",
             "deep/er/new.npz"]
INTS = ["-1", "0", "1", "2", "3", "4", "8", "15", "16", "17", "32", "256", "4096", "99999999999999999999",
        "9223372036854775808", "x", "", " 3", "1_0", "\u0663", "1e3", "0x10"]
FLOATS = ["0", "0.5", "1", "1.5", "-1", "nan", "inf", "-inf", "1e309", "1e-300", "x", ""]
TEXTS = ["", " ", "1,2,3", "1,300", "1,,2", "-3", "4,9", "8,4,2", "8,16", "99999999999999999999999", "hi",
         "We hold", "\u0663", "\x00", "1" * 300, "0,1"]
#: options never generated: --ray connects to (or starts) a Ray cluster, which is not the command line's to fuzz
CLI_NEVER = {"ray"}
CLI_WEIGHTS = {"demo": 1, "compare": 1}  # they build and measure several models even when small: drawn half as often
#: demo starts from a tiny decoder (the fuzzed options come after and override some); its integers stay small:
#: ``demo --layers 4096`` is slow work a user asked for, not a bug the fuzzer can find
DEMO_TINY = ["--layers", "1", "--hidden", "8", "--heads", "1", "--kv-heads", "1", "--head-dim", "2", "--mlp", "1",
             "--context", "8", "--eval-tokens", "2", "--bits", "8", "--no-tract"]
DEMO_INTS = ["-1", "0", "1", "2", "3", "8", "99999999999999999999", "x", "", " 3", "\u0663"]
#: options that lead a command to real work, drawn more often (a prompt for generate, token ids for validate)
CLI_LIKELY = {"generate": ("--prompt-ids", "--ids"), "validate": ("--ids", "--context"), "run": ("--steps",)}
GOOD_INPUTS = ["f32.nnef.tar", "dyn.nnef.tar", "plain.nnef.tar", "io.npz", "ids1.npz", "ids.txt", "prompt.txt"]


def _cli_actions() -> dict[str, tuple[list[Any], list[Any]]]:
    """subcommand -> (positional actions, optional actions) of nnef-kv's parser."""
    import argparse

    from nnef_kv.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    out = {}
    for name, sp in sub.choices.items():
        acts = [a for a in sp._actions if not isinstance(a, argparse._HelpAction)]
        out[name] = ([a for a in acts if not a.option_strings],
                     [a for a in acts if a.option_strings and a.dest not in CLI_NEVER])
    return out


CLI_ACTIONS = _cli_actions()
CLI_COMMANDS = [c for c in sorted(CLI_ACTIONS) for _ in range(CLI_WEIGHTS.get(c, 2))]


#: a command's starting options (the fuzzed ones come after and may override them): small work when valid
CLI_PREFIX = {"demo": DEMO_TINY, "validate": ["--eval-tokens", "4", "--context", "8"],
              "generate": ["--max-new-tokens", "4"],
              "compare": ["--schemes", "kivi:8", "--context", "8", "--eval-tokens", "2", "--no-tract", "--jobs", "1"]}
SANE_INTS, SANE_FLOATS, SANE_TEXTS = ["1", "2", "4", "8"], ["0", "0.5", "1", "2"], ["1,2,3", "8", "4", "5,9"]


@st.composite
def cli_argv(draw: st.DrawFn) -> list[str]:
    """``[limits..., COMMAND, positionals..., options...]`` with paths as ``{in}/NAME`` / ``{out}/NAME``: one example
    in three takes only sane values (so the happy paths run too), the others any value of the pools."""
    ins = st.sampled_from(IN_NAMES).map(lambda n: "{in}/" + n)
    outs = st.sampled_from(OUT_NAMES).map(lambda n: "{out}/" + n)
    good = st.sampled_from(GOOD_INPUTS).map(lambda n: "{in}/" + n)
    paths = st.one_of(ins, outs)
    sane = draw(st.sampled_from([False, False, True]))
    cmd = draw(st.sampled_from(CLI_COMMANDS))
    positional, optional = CLI_ACTIONS[cmd]
    argv = [*CLI_LIMITS]
    if not sane and draw(st.sampled_from([False] * 9 + [True])):
        argv += [draw(st.sampled_from(["--max-nesting", "--max-members", "--max-tensor-bytes"])),
                 draw(st.sampled_from(INTS))]
    argv += [cmd, *CLI_PREFIX.get(cmd, [])]
    for _ in positional:
        argv.append(draw(good if sane else st.one_of(good, ins, outs)))
    required = [a for a in optional if a.required]
    likely = [a for a in optional if any(o in CLI_LIKELY.get(cmd, ()) for o in a.option_strings)]
    chosen = required + (draw(st.lists(st.sampled_from(likely), max_size=1)) if likely else [])
    chosen += draw(st.lists(st.sampled_from(optional), max_size=2 if sane else 4)) if optional else []
    for act in chosen:
        argv.append(draw(st.sampled_from(act.option_strings)))
        if act.nargs == 0:
            continue
        if act.choices:
            argv.append(draw(st.sampled_from(list(act.choices) if sane else [*act.choices, "magic", ""])))
        elif act.type is int:
            argv.append(draw(st.sampled_from(SANE_INTS if sane else DEMO_INTS if cmd == "demo" else INTS)))
        elif act.type is float:
            argv.append(draw(st.sampled_from(SANE_FLOATS if sane else FLOATS)))
        elif act.dest in ("output", "report_dir", "save_dir"):  # a target: out/..., or the command's own input
            own = [a for a in argv if a.startswith("{in}/")] or ["{out}/new.npz"]
            argv.append(draw(outs if sane else st.one_of(outs, outs, st.sampled_from(own))))
        else:
            argv.append(draw(st.one_of(good, st.sampled_from(SANE_TEXTS)) if sane
                             else st.one_of(good, paths, st.sampled_from(TEXTS))))
    if not sane and draw(st.sampled_from([False] * 19 + [True])):
        argv.insert(draw(st.integers(0, len(argv))), draw(st.sampled_from(["--nope", "-", "--", "--debug", "-o"])))
    return argv


CLI_TIMES: dict[str, list[float]] = collections.defaultdict(list)


@pytest.fixture(scope="module")
def cli_world() -> Iterator[World]:
    with tempfile.TemporaryDirectory(prefix="nnef-kv-fuzz-cli-") as d:
        (Path(d) / "cwd").mkdir()
        yield World.make(Path(d))
    if os.environ.get("NNEF_KV_FUZZ_TIMES"):
        for k, v in sorted(CLI_TIMES.items()):
            print(f"cli {k:10s} n={len(v):5d} total={sum(v):7.1f}s max={max(v):6.2f}s")


@FUZZ
@given(argv=cli_argv())
def test_cli(cli_world: World, argv: list[str]) -> None:
    _count("cli")
    cli_world.reset_out()
    subs = cli_world.subs()
    args = [a.format(**subs) for a in argv]
    here = os.getcwd()
    os.chdir(cli_world.root / "cwd")  # a relative path a value names lands in the world, not in the repository
    try:
        with memory_cap():
            t0 = time.perf_counter()
            rc, out, err = run_cli(args)
            CLI_TIMES[next((a for a in argv if a in CLI_ACTIONS), "?")].append(time.perf_counter() - t0)
    finally:
        os.chdir(here)
    assert rc in (0, 1, 2), (rc, args, err[-500:])
    assert "internal error" not in err, (args, err[-800:])
    if "--debug" not in args:
        assert "Traceback" not in err, (args, err[-800:])
        if rc == 2:
            last = err.strip().splitlines()
            assert last and (last[-1].startswith("nnef-kv")), (args, err[-500:])
    assert cli_world.damage(args) == [], args


def test_an_output_folder_may_be_the_precious_one(cli_world: World) -> None:
    """Hypothesis's find of 2026-12-04: ``demo --save-dir {out}/precious`` adds its archives beside ``keep.txt``,
    as asked; the harness counts that as damage no more than ``--report-dir`` there, and still counts a
    ``keep.txt`` changed."""
    cli_world.reset_out()
    precious = cli_world.subs()["out"] + "/precious"
    args = ["demo", "--layers", "1", "--hidden", "8", "--heads", "1", "--kv-heads", "1", "--head-dim", "2", "--mlp",
            "1", "--context", "8", "--eval-tokens", "2", "--bits", "8", "--no-tract", "--save-dir", precious]
    rc, _, err = run_cli(args)
    assert rc == 0, err[-500:]
    assert sorted(os.listdir(precious)) == ["f32.nnef.tar", "keep.txt", "kivi8.nnef.tar"]
    assert cli_world.damage(args) == []
    (Path(precious) / "keep.txt").write_text("changed")
    assert cli_world.damage(args) == ["the precious folder changed"]
    cli_world.reset_out()


def test_cli_count() -> None:
    _check_count("cli")


# ------------------------------------------------------------------------------------------------
# the harness itself
# ------------------------------------------------------------------------------------------------
def test_mutator_changes_input() -> None:
    """The mutator is not a no-op (otherwise the mutated targets fuzz nothing)."""
    seen: set[bytes] = set()

    @settings(max_examples=50, database=None, deadline=None)
    @given(mutated([SEED_NNEF]))
    def collect(b: bytes) -> None:
        seen.add(b)

    collect()
    assert len(seen - {SEED_NNEF}) >= 25


def test_clean_lets_foreign_exceptions_through() -> None:
    """The property checker does not swallow bugs."""
    with pytest.raises(KeyError):
        clean(lambda: {}["x"])
    assert clean(lambda: (_ for _ in ()).throw(nnef_kv.ArchiveError("x: bad"))) is None


# ------------------------------------------------------------------------------------------------
# bugs found by the fuzzer, pinned (strict xfail: they fail loudly once fixed, then drop the marker
# and the matching skip in the fuzz target)
# ------------------------------------------------------------------------------------------------
def test_quant_identifier_value_roundtrip() -> None:
    """Found by the fuzzer (fixed in the grammar since): dump_quant prints ``falseinf`` as ``i"falseinf"``, which
    parse_quant must read back."""
    text = '"x": zero_point_linear_quantize(zero_point = 0, scale = 0.5, bits = 8, signed = falseinf);\n'
    q = nnef_kv.parse_quant(text)
    assert nnef_kv.parse_quant(nnef_kv.dump_quant(q)) == q


def test_ragged_array_literal_is_a_graph_error() -> None:
    from nnef_kv.io.archive import Model

    doc = nnef_kv.parse("version 1.0;\ngraph g(x) -> (y) { x = external<scalar>(shape = [2]); "
                        "y = add(x, [[1.0, 2.0], [3.0]]); }", filename="ragged.nnef")
    with pytest.raises(nnef_kv.GraphError, match="ragged|inhomogeneous|array"):
        Model(doc).session()


@pytest.mark.parametrize("entry", [
    '"y": zero_point_linear_quantize(zero_point = 0, bits = 8, signed = true, symmetric = false);',
    '"y": zero_point_linear_quantize(zero_point = 0, scale = "big", bits = 8, signed = true, symmetric = false);',
])
def test_incomplete_graph_quant_entry_is_a_graph_error(entry: str) -> None:
    model = nnef_kv.Model.from_text(
        "version 1.0;\ngraph g(x) -> (y) { x = external<scalar>(shape = [2]); y = relu(x); }",
        quant_text=entry + "\n", source="quant-case")
    with pytest.raises(nnef_kv.GraphError, match="scale|graph.quant"):
        model.session()


def test_non_string_datum_type_is_a_graph_error() -> None:
    from nnef_kv.io.archive import Model

    doc = nnef_kv.parse("version 1.0;\nextension tract_registry tract_core;\ngraph g(x) -> (y) {\n"
                        "  x = tract_core_external(shape = [2], datum_type = true);\n  y = relu(x);\n}\n")
    with pytest.raises(nnef_kv.GraphError, match="datum_type|true"):
        Model(doc).session()


def test_scan_body_result_never_assigned_is_a_graph_error() -> None:
    from nnef_kv.io.archive import Model

    text = """version 1.0;
extension tract_registry tract_core;
extension tract_symbol S;
fragment accumulate_body(x_t: tensor<scalar>, h_prev: tensor<scalar>) -> (h_next: tensor<scalar>) {
    other = add(x_t, h_prev);
}
graph g(input) -> (output) {
    input = external<scalar>(shape = [S, 4]);
    h0 = [[0.0, 0.0, 0.0, 0.0]];
    output = tract_core_scan(body = "accumulate_body", scan = [("x_t", input, 0, 1)], full = [],
                             state = [("h_prev", h0, "h_next")], output = [("h_next", "full", 0, 1)], skip = 0,
                             reset_every_turn = false, external_state = false);
}
"""
    with pytest.raises(nnef_kv.GraphError, match="h_next"):
        Model(nnef_kv.parse(text)).session()


@pytest.mark.parametrize("expr", ['-[[1.0, 2.0]]', '-"a"', '[1.0][0:"a"]', "length_of(1)", "range_of(1.5)", "1.5[0:1]",
                                  "[for i in 3 yield i]", "[for i in [1, 2], j in 3 yield i]"])
def test_ill_typed_attribute_expression_is_a_graph_error(expr: str) -> None:
    from nnef_kv.io.archive import Model

    doc = nnef_kv.parse(f"version 1.0;\ngraph g(x) -> (y) {{ x = external<scalar>(shape = [2]); y = add(x, {expr}); }}")
    with pytest.raises(nnef_kv.GraphError, match="evaluate|length_of|range_of|slice"):
        Model(doc).session()


def test_non_string_variable_label_is_a_graph_error() -> None:
    doc = nnef_kv.parse("version 1.0;\ngraph g(x) -> (y) { x = external<scalar>(shape = [2]); "
                        "w = variable<scalar>(label = true, shape = [2]); y = add(x, w); }")
    with pytest.raises(nnef_kv.GraphError, match="label"):
        nnef_kv.Model(document=doc).session()


@pytest.mark.parametrize("shape", ["[6.0]", "[-1]", '["a"]', "[[2]]", "true"])
def test_bad_constant_shape_is_a_graph_error(shape: str) -> None:
    doc = nnef_kv.parse("version 1.0;\ngraph g(x) -> (y) { x = external<scalar>(shape = [2]); "
                        f"c = constant<scalar>(shape = {shape}, value = [1.0]); y = add(x, c); }}")
    with pytest.raises(nnef_kv.GraphError, match="shape"):
        nnef_kv.Model(document=doc).session()
