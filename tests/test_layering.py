"""The package is layered: no import cycle, and no import going up the declared order.

Every module's imports are read from its source: top-level and inside functions, ``importlib.import_module``
of a literal name included; imports under ``if TYPE_CHECKING:`` (never run) and of optional dependencies
outside the package are ignored. A module may import its own layer and the layers below it."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import REPO

PACKAGE = REPO / "nnef_kv"

#: low to high; a module belongs to the longest prefix listed (a package name covers its modules)
LAYERS: list[tuple[str, ...]] = [
    ("nnef_kv._version", "nnef_kv.errors", "nnef_kv.limits", "nnef_kv.targets", "nnef_kv.atomic", "nnef_kv.progress"),
    ("nnef_kv.grammar",),
    ("nnef_kv.io.dat", "nnef_kv.io.blockquant", "nnef_kv.io.container", "nnef_kv.io.npz", "nnef_kv.io.sniff"),
    ("nnef_kv.interpreter.registry", "nnef_kv.interpreter.params", "nnef_kv.interpreter.dtypes",
     "nnef_kv.interpreter.coerce"),
    ("nnef_kv.kv.common", "nnef_kv.kv.packing", "nnef_kv.kv.ggml"),
    ("nnef_kv.kernels",),
    ("nnef_kv.kv",),
    ("nnef_kv.interpreter.ops", "nnef_kv.kv.ops"),
    ("nnef_kv.interpreter.catalog",),
    ("nnef_kv.interpreter.values", "nnef_kv.interpreter.graph", "nnef_kv.interpreter.assertions",
     "nnef_kv.interpreter.attrs", "nnef_kv.interpreter.quant", "nnef_kv.interpreter.nested",
     "nnef_kv.interpreter.sources", "nnef_kv.interpreter.builder"),
    ("nnef_kv.interpreter.plan",),
    ("nnef_kv.interpreter.session", "nnef_kv.interpreter.check", "nnef_kv.interpreter"),
    ("nnef_kv.io.archive", "nnef_kv.io"),
    ("nnef_kv.tract_driver",),  # loads archives (io) into tract; used by validate
    ("nnef_kv.models", "nnef_kv.samples", "nnef_kv.text", "nnef_kv.summary"),
    ("nnef_kv.converters.graph_edit", "nnef_kv.converters.masks", "nnef_kv.converters.sinks",
     "nnef_kv.converters.folded", "nnef_kv.converters.attention", "nnef_kv.converters.caches",
     "nnef_kv.converters.exported"),
    ("nnef_kv.kv.schemes",),
    ("nnef_kv.converters.frontends",),
    ("nnef_kv.converters",),
    ("nnef_kv.validate",),
    ("nnef_kv.cli.args", "nnef_kv.cli.threads", "nnef_kv.cli.words", "nnef_kv.cli.measure"),  # the CLI's helpers
    ("nnef_kv.cli.inspect", "nnef_kv.cli.convert", "nnef_kv.cli.run", "nnef_kv.cli.generate", "nnef_kv.cli.validate",
     "nnef_kv.cli.demo", "nnef_kv.cli.compare"),  # one module per command
    ("nnef_kv.cli", "nnef_kv.__main__"),
    ("nnef_kv",),
]


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    out = {}
    for p in sorted(root.rglob("*.py")):
        parts = p.with_suffix("").relative_to(root.parent).parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for sub in node.body:
                for n in ast.walk(sub):
                    if hasattr(n, "lineno"):
                        lines.add(n.lineno)
    return lines


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports (resolved to the deepest known module)."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_lines(tree)
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: list[str] = []
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            targets += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[:len(pkg.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from pkg import x`: the submodule pkg.x when x is one, else a name of pkg itself
            targets += [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            targets.append(node.args[0].value)
    out = set()
    for t in targets:
        while t and t not in known:
            t = t.rpartition(".")[0]
        if t and t != name and t.startswith("nnef_kv"):
            out.add(t)
    return out


def graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    known = modules(root)
    g = {m: imports_of(m, p, known) for m, p in known.items()}
    # importing a package's submodule does not mean importing the package's __init__ beyond what it needs
    return g


def layer_of(name: str, layers: list[tuple[str, ...]] = LAYERS) -> int:
    best, where = -1, -1
    for i, prefixes in enumerate(layers):
        for pre in prefixes:
            if (name == pre or name.startswith(pre + ".")) and len(pre) > best:
                best, where = len(pre), i
    return where


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in g:
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in g:
                    continue
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(g[nxt]))))
                elif nxt in on:
                    low[v] = min(low[v], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def upward(g: dict[str, set[str]], layers: list[tuple[str, ...]] = LAYERS) -> list[str]:
    bad = []
    for m, deps in g.items():
        lm = layer_of(m, layers)
        for d in deps:
            ld = layer_of(d, layers)
            if ld > lm:
                bad.append(f"{m} (layer {lm}) imports {d} (layer {ld})")
    return sorted(bad)


def test_every_module_has_a_layer() -> None:
    missing = [m for m in modules() if layer_of(m) < 0]
    assert not missing, missing


def test_no_import_cycle() -> None:
    assert cycles(graph()) == []


def test_no_import_goes_up_the_layers() -> None:
    assert upward(graph()) == []


def test_the_checks_fail_on_a_fake_cycle_and_an_upward_import(tmp_path) -> None:
    pkg = tmp_path / "nnef_kv"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("def f():\n    from . import b\n")
    (pkg / "low" / "b.py").write_text("from .a import f\n")
    (pkg / "high.py").write_text("import importlib\nimportlib.import_module('nnef_kv.low.a')\n")
    (pkg / "low" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..high import x\n"
                                      "def g():\n    from .. import high\n")
    g = graph(pkg)
    assert g["nnef_kv.high"] == {"nnef_kv.low.a"}  # importlib.import_module of a literal counts
    assert cycles(g) == [["nnef_kv.low.a", "nnef_kv.low.b"]]
    layers = [("nnef_kv.low",), ("nnef_kv.high", "nnef_kv")]
    assert upward(g, layers) == ["nnef_kv.low.c (layer 0) imports nnef_kv.high (layer 1)"]  # TYPE_CHECKING ignored


@pytest.mark.parametrize("name", sorted(modules()))
def test_module_size(name) -> None:
    """No module over ~600 lines, except an op family's (one file registering a family of kernels)."""
    families = {"nnef_kv.interpreter.ops.nnef_std", "nnef_kv.interpreter.ops.tract_core",
                "nnef_kv.interpreter.ops.tract_transformers", "nnef_kv.kernels._kivi_jit"}
    n = len(modules()[name].read_text().splitlines())
    assert name in families or n <= 620, f"{name}: {n} lines"
