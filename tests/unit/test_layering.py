"""The package is layered: no import cycle, and no import going up the declared order.

Every module's imports are read from its source: top-level and inside functions, ``importlib.import_module``
of a literal name included; imports under ``if TYPE_CHECKING:`` (never run) and of optional dependencies
outside the package are ignored. A module may import its own layer and the layers below it."""
from __future__ import annotations

import ast
from pathlib import Path


from conftest import REPO

PACKAGE = REPO / "nnef_kv"

#: the floors, low to high: each a folder of the package (a subpackage) or, at the bottom, the few
#: single modules everything uses. A module belongs to the longest prefix listed.
LAYERS: list[tuple[str, ...]] = [
    ("nnef_kv._version", "nnef_kv.errors", "nnef_kv.limits", "nnef_kv.targets", "nnef_kv.atomic", "nnef_kv.progress"),
    ("nnef_kv.grammar",),  # text <-> AST
    ("nnef_kv.tensors",),  # a tensor's bytes: .dat, block-quantized tensors, mapped pages
    ("nnef_kv.core",),  # the op contract: registry, params, dtypes, coerce
    ("nnef_kv.kernels",),  # numba kernels of the weight products, each beside its NumPy reference
    ("nnef_kv.kv",),  # the KV states (KIVI with its kernels in kv/kivi/), each registered on its class
    ("nnef_kv.interpreter",),  # op families, graph, plan, session
    ("nnef_kv.io",),  # archives: containers, the Model, load / save
    ("nnef_kv.tract_driver", "nnef_kv.models", "nnef_kv.samples", "nnef_kv.text", "nnef_kv.summary"),
    ("nnef_kv.converters",),  # front ends, recognizers, schemes, rewrite passes
    ("nnef_kv.validate",),  # measuring, compare, auto-bits, reports
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


def floor_graph(g: dict[str, set[str]], layers: list[tuple[str, ...]] = LAYERS) -> dict[str, set[str]]:
    """The import graph between floors (a floor: the longest listed prefix a module belongs to)."""
    def floor(m: str) -> str:
        best = ""
        for row in layers:
            for pre in row:
                if (m == pre or m.startswith(pre + ".")) and len(pre) > len(best):
                    best = pre
        return best or m

    out: dict[str, set[str]] = {}
    for m, deps in g.items():
        out.setdefault(floor(m), set()).update(floor(d) for d in deps if floor(d) != floor(m))
    return out


def test_the_floors_are_folders() -> None:
    """Every floor but the bottom one (a few single modules) and the package itself is a folder."""
    for row in LAYERS[1:-1]:
        for name in row:
            path = PACKAGE.parent / name.replace(".", "/")
            single = name in ("nnef_kv.tract_driver", "nnef_kv.text", "nnef_kv.summary", "nnef_kv.__main__")
            assert (path / "__init__.py").is_file() or single and path.with_suffix(".py").is_file(), name
    assert len(LAYERS) <= 14
    assert cycles(floor_graph(graph())) == []


def test_a_fake_folder_cycle_fails(tmp_path) -> None:
    """Two folders importing each other (each module on its own acyclic) fail as a floor cycle and as an
    upward import, whichever order they are declared in."""
    pkg = tmp_path / "nnef_kv"
    for d in ("low", "high"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("def f():\n    from ..high import b\n")
    (pkg / "high" / "b.py").write_text("x = 1\n")
    (pkg / "high" / "c.py").write_text("from ..low import d\n")
    (pkg / "low" / "d.py").write_text("y = 2\n")
    g = graph(pkg)
    assert cycles(g) == []  # no module cycle
    for layers in ([("nnef_kv.low",), ("nnef_kv.high",), ("nnef_kv",)],
                   [("nnef_kv.high",), ("nnef_kv.low",), ("nnef_kv",)]):
        assert cycles(floor_graph(g, layers)) == [["nnef_kv.high", "nnef_kv.low"]]
        assert len(upward(g, layers)) == 1


#: modules above this many lines are reported (a warning in the test summary), not refused: a module is split
#: where its concepts part, not at a line count
LONG_MODULE = 620


def test_long_modules_are_reported() -> None:
    """Modules over :data:`LONG_MODULE` lines, op family files aside (one file registering a family of kernels),
    are named in one warning: a prompt to look for the concepts to split along, never a failure."""
    import warnings

    families = {"nnef_kv.interpreter.ops.nnef_std", "nnef_kv.interpreter.ops.tract_core",
                "nnef_kv.interpreter.ops.tract_transformers", "nnef_kv.kv.kivi._jit"}
    long = {m: len(p.read_text().splitlines()) for m, p in modules().items()}
    long = {m: n for m, n in long.items() if n > LONG_MODULE and m not in families}
    if long:
        warnings.warn("long modules: " + ", ".join(f"{m} ({n} lines)" for m, n in sorted(long.items())),
                      UserWarning)
    assert all(n < 4 * LONG_MODULE for n in long.values()), long  # a module this long is an accident
