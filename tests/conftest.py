"""Shared test fixtures: where ../shared is, and skips when an optional peer is absent."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from nnef_kv import tract_driver

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
CONFORMANCE = SHARED / "conformance"
FIXTURES = SHARED / "fixtures"
DOCS = SHARED / "docs"

HAVE_TRACT = tract_driver.available()
HAVE_KHRONOS_NNEF = importlib.util.find_spec("nnef") is not None

requires_shared = pytest.mark.skipif(not SHARED.is_dir(), reason=f"shared material not found at {SHARED}")
requires_tract = pytest.mark.skipif(
    not HAVE_TRACT, reason="the tract Python package is not installed (pip install -e '.[dev]')"
)
requires_khronos = pytest.mark.skipif(
    not HAVE_KHRONOS_NNEF, reason="the Khronos nnef package is not installed (pip install -e '.[dev]')"
)


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    if not SHARED.is_dir():
        pytest.skip(f"shared material not found at {SHARED}")
    return SHARED


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true", default=False,
                     help="fuzz targets run the 'long' hypothesis profile (10,000 examples each instead of 2,000)")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--long"):
        import os

        os.environ["NNEF_KV_FUZZ_PROFILE"] = "long"
