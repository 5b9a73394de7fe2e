"""Shared test fixtures: where ../shared is, and skips when an optional peer is absent.

The tests are grouped in four folders: ``unit/`` (one module or layer of the package at a time, mirroring
it), ``properties/`` (invariants under generated or hostile inputs: hypothesis, fuzzing, differential
kernels, nothing lost), ``oracle/`` (against tract 0.23.9, the Khronos tools, llama.cpp's and HF's
references, the conformance cases) and ``e2e/`` (the command line, the real model, the exports and the
benchmarks' claims). Helpers (``cli_world``, ``gguf_world``, ``tract_oracle``) sit here, beside this file;
a test may import another folder's test module (the four folders are on ``sys.path``)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from nnef_kv import tract_driver

REPO = Path(__file__).resolve().parents[1]
GROUPS = ("unit", "properties", "oracle", "e2e")
for _group in GROUPS:
    _dir = str(Path(__file__).resolve().parent / _group)
    if _dir not in sys.path:
        sys.path.append(_dir)
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
try:  # imported here only to know (nnef_kv itself imports it lazily)
    import numba  # noqa: F401
except Exception:  # absent or broken: the numba half of the kernel tests is skipped
    HAVE_NUMBA = False
else:
    HAVE_NUMBA = True
requires_numba = pytest.mark.skipif(not HAVE_NUMBA, reason="numba is not installed")


@pytest.fixture(params=["numba", "fallback"])
def mode(request, monkeypatch):
    """Runs a kernel test with the numba kernels, then with the forced NumPy fallback (``NNEF_KV_NO_NUMBA=1``)."""
    from nnef_kv.kernels import NO_NUMBA_ENV, numba_available

    if request.param == "numba":
        if not HAVE_NUMBA:
            pytest.skip("numba is not installed")
        monkeypatch.delenv(NO_NUMBA_ENV, raising=False)
        assert numba_available()
    else:
        monkeypatch.setenv(NO_NUMBA_ENV, "1")
        assert not numba_available()
    return request.param


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


# ---------------------------------------------------------------------------------------------- skip summary
def skip_reason(report) -> str:
    lr = report.longrepr
    return str(lr[2]) if isinstance(lr, tuple) and len(lr) == 3 else str(lr)


def shared_skips(reports) -> list:
    """The skipped reports whose reason is ../shared (or a file in it) missing."""
    return [r for r in reports if str(SHARED) in skip_reason(r) or "shared material" in skip_reason(r)]


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """Every test skipped for want of ../shared in one line (where it was looked for, how many)."""
    n = len(shared_skips(terminalreporter.stats.get("skipped", [])))
    if n:
        terminalreporter.write_line(f"{n} test(s) skipped: ../shared (the team's read-only material) not found at "
                                    f"{SHARED}, or a file in it missing; every other test ran")
