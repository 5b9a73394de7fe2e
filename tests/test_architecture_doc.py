"""docs/architecture.md says where things live: every path and module it names exists, and its layer list
is the one tests/test_layering.py enforces."""
from __future__ import annotations

import importlib
import re

import pytest

from conftest import REPO
from test_layering import LAYERS

DOC = REPO / "docs" / "architecture.md"
TEXT = DOC.read_text()
#: backquoted paths: `nnef_kv/...`, `tests/...`, `benchmarks/...`, and package-relative ones (`converters/schemes.py`)
PATHS = sorted(set(re.findall(r"`((?:nnef_kv|tests|benchmarks|tools)/[\w/.]+?)/?`", TEXT)))
_PACKAGES = "kv|converters|validate|interpreter|plan|io|grammar|kernels|core|tensors"
RELATIVE = sorted(set(re.findall(rf"`((?:{_PACKAGES})/[\w/]+\.py)", TEXT)))
MODULES = sorted(set(re.findall(r"`(nnef_kv(?:\.\w+)+)`", TEXT)))


def test_the_doc_names_something() -> None:
    assert len(PATHS) > 30 and MODULES and len(RELATIVE) > 5


@pytest.mark.parametrize("path", PATHS)
def test_named_path_exists(path: str) -> None:
    assert (REPO / path).exists(), path


@pytest.mark.parametrize("path", RELATIVE)
def test_package_relative_path_exists(path: str) -> None:
    roots = [REPO / "nnef_kv", REPO / "nnef_kv" / "interpreter"]
    assert any((r / path).exists() for r in roots), path


@pytest.mark.parametrize("name", MODULES)
def test_named_module_imports(name: str) -> None:
    importlib.import_module(name)


def test_layer_list_is_the_enforced_one() -> None:
    block = re.search(r"```layers\n(.*?)```", TEXT, re.S)
    assert block is not None
    rows = [line.split() for line in block.group(1).strip().splitlines()]
    assert [int(r[0]) for r in rows] == list(range(len(LAYERS)))
    assert [tuple(r[1:]) for r in rows] == LAYERS
    for layer in LAYERS:
        for name in layer:
            if name != "nnef_kv.__main__":  # importing it runs the CLI
                importlib.import_module(name)
