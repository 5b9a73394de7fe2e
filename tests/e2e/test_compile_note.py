"""The first KIVI run on a machine (numba compiling the kernels, seconds to a minute) says so on stderr and its
compile time is left out of generate's tok/s (issue 23.11)."""
from __future__ import annotations

import time

import pytest

from nnef_kv import kernels


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(kernels, "numba_available", lambda: True)
    monkeypatch.setattr(kernels, "_cold", {})
    monkeypatch.setattr(kernels, "_compile_time", [0.0])
    said: list[str] = []
    monkeypatch.setattr(kernels, "on_compile", said.append)
    return said


def test_a_cold_cache_is_announced_once_and_its_first_calls_timed(fresh, monkeypatch) -> None:
    monkeypatch.setattr(kernels, "_no_fresh_index", lambda mod: True)
    a = kernels.Kernel(lambda x: -1.0, "math:sqrt")
    b = kernels.Kernel(lambda x: -1.0, "math:sqrt")
    assert a(4.0) == 2.0 and b(9.0) == 3.0 and a(16.0) == 4.0  # the "numba" side ran
    assert fresh == ["compiling kernels, once per machine"]  # once a process, whatever the kernels
    assert kernels.compile_seconds() > 0
    assert kernels.on_compile is None


def test_a_warm_cache_says_nothing(fresh, monkeypatch) -> None:
    monkeypatch.setattr(kernels, "_no_fresh_index", lambda mod: False)
    assert kernels.Kernel(lambda x: -1.0, "math:sqrt")(4.0) == 2.0
    assert fresh == [] and kernels.compile_seconds() == 0.0


def test_the_cache_index_is_judged_against_the_module_source(tmp_path, monkeypatch) -> None:
    import os
    import sys

    (tmp_path / "fake_jit_mod.py").write_text("def f(x):\n    return x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("fake_jit_mod", None)
    assert kernels._no_fresh_index("fake_jit_mod")  # no index at all
    (tmp_path / "__pycache__").mkdir()
    idx = tmp_path / "__pycache__" / "fake_jit_mod.f-1.py311.nbi"
    idx.write_bytes(b"")
    src = os.stat(tmp_path / "fake_jit_mod.py").st_mtime
    os.utime(idx, (src - 10, src - 10))
    assert kernels._no_fresh_index("fake_jit_mod")  # older than the source: numba recompiles
    os.utime(idx, (src + 10, src + 10))
    assert not kernels._no_fresh_index("fake_jit_mod")


def test_generate_leaves_compile_time_out_of_tok_s(tmp_path, monkeypatch) -> None:
    import nnef_kv
    from cli_world import run_cli
    from nnef_kv.cli import generate as cli  # the module whose _compiled generate calls
    from nnef_kv.models import DecoderConfig, build_decoder

    path = tmp_path / "m.nnef.tar"
    nnef_kv.save(build_decoder(DecoderConfig(vocab=256, hidden=16, layers=1, heads=2, kv_heads=1, head_dim=8,
                                             mlp=16, max_positions=16)), path)
    monkeypatch.setattr(cli, "_compiled", iter([0.0, 0.25]).__next__)  # 0.25 s compiled during the run
    t0 = time.perf_counter()
    rc, out, err = run_cli(["generate", str(path), "--prompt-ids", "1,2", "--max-new-tokens", "2"])
    total = time.perf_counter() - t0
    assert rc == 0, err
    line = err.strip().splitlines()[-1]
    assert "+ 0.2 s compiling kernels" in line, line
    seconds = float(line.split(" tokens in ")[1].split(" s ")[0])
    assert seconds <= max(total - 0.25, 0.0) + 0.01, (line, total)  # the decode's time without the compile
