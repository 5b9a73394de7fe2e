"""The KV benchmarks run (small settings) and report what they claim; the memory targets hold."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_speed_benchmark_reports_interleaved_ratios(capsys):
    res = _load("kv_speed").main(["--repeat", "3", "--lengths", "128", "--bits", "8", "4"])
    row = res["rows"][128]
    for bits in (8, 4):
        r = row[f"kivi{bits}"]
        for key in ("ratio_best", "ratio_median", "cpu_ratio_best", "cpu_ratio_median", "ms_best"):
            assert np.isfinite(r[key]) and r[key] > 0, (bits, key, r)
    assert res["blas"] and all("architecture" in b for b in res["blas"])
    out = capsys.readouterr().out
    assert "BLAS" in out and "kivi4" in out


@pytest.mark.slow
def test_memory_benchmark_meets_the_targets():
    """T = 4096, D = 128, 8 kv heads, value_group 128: every array held counted (python
    benchmarks/kv_memory.py)."""
    rows = _load("kv_memory").main()
    assert rows["kivi 8-bit"]["x_vs_f32"] >= 3.5
    assert rows["kivi 4-bit"]["x_vs_f32"] >= 6.3
    assert rows["kivi 2-bit"]["x_vs_f32"] >= 10.3


@pytest.mark.slow
def test_memory_benchmark_window_rows_hold_the_window_only():
    """A Mistral-shaped layer with a 4096-token window at 32k tokens holds about the window: the f32 cache its
    4096 tokens + one page of 256 (python benchmarks/kv_memory.py --window)."""
    bench = _load("kv_memory")
    rows = bench.window_rows()
    per_token = 2 * bench.H * bench.D * 4
    assert rows["f32"][bench.WIN] == (bench.WIN + 256) * per_token
    for label in ("kivi 8-bit", "kivi 4-bit"):
        assert rows[label][0] > 7 * rows[label][bench.WIN]
        assert rows[label][bench.WIN] < rows["f32"][bench.WIN] / (3.5 if "8" in label else 6.3)
