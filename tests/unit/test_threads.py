"""The thread policy (issue 26.1): BLAS held at one thread while a session runs, the session's own split only
for large products, the default and the ``--threads`` option."""
from __future__ import annotations

import numpy as np
import pytest

import nnef_kv
from nnef_kv.errors import InputError
from nnef_kv.interpreter.plan import parallel
from nnef_kv.interpreter.session import Session
from nnef_kv.io.archive import Model

TEXT = """version 1.0;
graph g(x) -> (y)
{{
  x = external<scalar>(shape = [1, S, {k}]);
  w = variable<scalar>(label = 'w', shape = [1, {n}, {k}]);
  y = matmul(x, w, transposeA = false, transposeB = true);
}}
"""


def _model(k: int, n: int, seed: int = 0) -> tuple[Model, np.ndarray]:
    w = np.random.default_rng(seed).standard_normal((1, n, k)).astype(np.float32)
    return Model(nnef_kv.parse(TEXT.format(k=k, n=n)), {"w": w}), w


def _splits() -> int:
    return parallel.SPLITTER.split + parallel.SPLITTER.paused


def test_split_worth_is_one_thread_for_small_products() -> None:
    assert not parallel.split_worth(1, 64, 64)  # 16 KB weight
    assert not parallel.split_worth(1, 256, 320)  # 320 KB weight but 82k multiply-adds
    assert parallel.split_worth(7, 256, 320)
    assert parallel.split_worth(1, 576, 49152)  # an LM head step
    assert not parallel.split_worth(512, 576, 16)  # too narrow for two 16-column halves


def test_small_product_runs_on_the_calling_thread_even_with_threads_2() -> None:
    model, w = _model(64, 64)
    s = Session(model, threads=2)
    before = _splits()
    x = np.ones((1, 3, 64), np.float32)
    y = s.run({"x": x})["y"]
    assert _splits() == before
    np.testing.assert_allclose(y, x @ w[0].T, rtol=1e-5)


def test_large_product_is_split_with_threads_2_not_with_threads_1() -> None:
    model, w = _model(256, 1024)
    x = np.random.default_rng(1).standard_normal((1, 8, 256)).astype(np.float32)
    before = _splits()
    Session(model, threads=1).run({"x": x})
    assert _splits() == before
    y = Session(model, threads=2).run({"x": x})["y"]
    assert _splits() == before + 1
    exact = x.astype(np.float64) @ w[0].T.astype(np.float64)
    bound = 256 * np.finfo(np.float32).eps * (np.abs(x).astype(np.float64) @ np.abs(w[0]).T)
    assert np.all(np.abs(y - exact) <= bound)


@pytest.mark.skipif(not parallel.BLAS.available, reason="threadpoolctl finds no BLAS library")
def test_blas_is_held_at_one_thread_during_a_run_and_given_back() -> None:
    from threadpoolctl import threadpool_limits

    model, _ = _model(64, 64)
    seen: list[list[int]] = []
    with threadpool_limits(limits=2, user_api="blas"):
        outside = parallel.BLAS.counts()
        for threads in (1, 2):
            Session(model, threads=threads).run({"x": np.ones((1, 2, 64), np.float32)}, capture="y",
                                                 capture_map=lambda a: seen.append(parallel.BLAS.counts()) or a)
        assert parallel.BLAS.counts() == outside
    assert seen == [[1] * len(outside)] * 2
    # re-entrant: an inner hold does not give the threads back before the outer one ends
    with threadpool_limits(limits=2, user_api="blas"):
        with parallel.BLAS:
            with parallel.BLAS:
                pass
            assert set(parallel.BLAS.counts()) == {1}
        assert parallel.BLAS.counts() == outside


def test_default_threads_and_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = _model(64, 64)
    monkeypatch.delenv(parallel.THREADS_ENV, raising=False)
    assert parallel.default_threads() == min(2, parallel.usable_cpus())
    assert Session(model).threads == parallel.default_threads()
    monkeypatch.setenv(parallel.THREADS_ENV, "1")
    assert Session(model).threads == 1
    assert Session(model, threads=2).threads == 2  # an explicit value wins
    monkeypatch.setenv(parallel.THREADS_ENV, "two")
    with pytest.raises(InputError, match="NNEF_KV_THREADS='two'"):
        Session(model)
    monkeypatch.delenv(parallel.THREADS_ENV)
    for bad in (0, -1, True, "2", 1.5):
        with pytest.raises(InputError, match="threads must be an integer >= 1"):
            Session(model, threads=bad)


def test_cli_threads_option(tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from nnef_kv import cli
    from nnef_kv.cli.threads import THREADED_COMMANDS

    monkeypatch.delenv(parallel.THREADS_ENV, raising=False)
    text = TEXT.format(k=8, n=4).replace("[1, S, 8]", "[1, 2, 8]")
    folder = tmp_path / "m"
    nnef_kv.save(nnef_kv.Model.from_text(text, {"w": np.ones((1, 4, 8), np.float32)}), folder)
    npz = tmp_path / "in.npz"
    np.savez(npz, x=np.ones((1, 2, 8), np.float32))
    seen: list[int] = []
    real = Session.__init__

    def spy(self, *a, **k):  # type: ignore[no-untyped-def]
        real(self, *a, **k)
        seen.append(self.threads)

    monkeypatch.setattr(Session, "__init__", spy)
    assert cli.main(["run", str(folder), "--inputs", str(npz), "--threads", "1"]) == 0
    assert seen and set(seen) == {1}
    assert parallel.THREADS_ENV not in __import__("os").environ  # put back after the command
    capsys.readouterr()
    assert cli.main(["run", str(folder), "--inputs", str(npz), "--threads", "0"]) == 2
    assert "--threads 0: must be an integer >= 1" in capsys.readouterr().err
    for command in THREADED_COMMANDS:
        with pytest.raises(SystemExit):
            cli.build_parser().parse_args([command, "--help"])
        assert "--threads N" in capsys.readouterr().out


def test_default_threads_step_back_to_one_while_other_processes_hold_the_cpus(monkeypatch: pytest.MonkeyPatch
                                                                               ) -> None:
    monkeypatch.delenv(parallel.THREADS_ENV, raising=False)
    monkeypatch.setattr(parallel, "usable_cpus", lambda: 2)
    watch = parallel.LoadWatch(interval=0.0)
    monkeypatch.setattr(parallel, "LOAD", watch)
    model, _ = _model(256, 1024)
    x = np.ones((1, 8, 256), np.float32)
    auto, forced = Session(model), Session(model, threads=2)
    assert auto.auto_threads and not forced.auto_threads and auto.threads == 2
    load = [3.0]
    monkeypatch.setattr(parallel.os, "getloadavg", lambda: (load[0], load[0], load[0]))
    before = _splits()
    auto.run({"x": x})  # others hold the second CPU: one thread
    # others = load - this process's own busy threads, which building the model may have kept near 2: what must
    # hold is that the estimate is past the step-back threshold (cpus - 2 + 0.5)
    assert _splits() == before and watch.others >= 0.5
    forced.run({"x": x})  # an explicit threads=2 is what the user asked for
    assert _splits() == before + 1
    load[0] = 0.0
    auto.run({"x": x})  # the machine is quiet again: two threads
    assert _splits() == before + 2
    assert parallel.run_threads(2, auto=False) == 2 and parallel.run_threads(1, auto=True) == 1


@pytest.mark.parametrize("rows", [2, 8])
def test_results_are_the_same_bits_on_one_thread_two_threads_and_paused(monkeypatch: pytest.MonkeyPatch,
                                                                       rows: int) -> None:
    # rows x 576 x 960 by a transposed weight. A few rows run on the numba kernel (each output one dot product,
    # however the outputs are split); more rows on BLAS, which rounds the whole product and its halves
    # differently: always the halves
    from nnef_kv.kernels.gemv import MAX_ROWS, rows_by_t

    model, w = _model(576, 960, seed=3)
    x = np.random.default_rng(4).standard_normal((1, rows, 576)).astype(np.float32)
    whole = x[0] @ w[0].T
    if rows <= MAX_ROWS and parallel.gemv_on():
        expected = np.empty_like(whole)
        rows_by_t(x[0], w[0], expected, 0, 960)
    else:
        expected = parallel.halves(x[0], w[0].T)
    monkeypatch.setattr(parallel, "MIN_ROWS_SPLIT_BYTES", 0)  # split the few-row product too (an LM head's size)
    before = _splits()
    one = Session(model, threads=1).run({"x": x})["y"]
    two = Session(model, threads=2).run({"x": x})["y"]
    assert _splits() == before + 1  # the threads=2 run split it
    np.testing.assert_array_equal(one[0], expected)
    np.testing.assert_array_equal(two, one)
    monkeypatch.setattr(parallel.SPLITTER, "_skip", 5)  # paused: the caller computes both halves itself
    np.testing.assert_array_equal(Session(model, threads=2).run({"x": x})["y"], one)
    np.testing.assert_allclose(one[0], whole, rtol=1e-4, atol=1e-4)


def test_a_decode_product_is_split_only_from_an_lm_head_s_size(monkeypatch: pytest.MonkeyPatch) -> None:
    # with the numba few-row kernel one core streams a layer's weight about as fast as two: only a weight of
    # MIN_ROWS_SPLIT_BYTES or more (an LM head) is split for a one-row product
    if not parallel.gemv_on():
        pytest.skip("numba is off: few-row products are BLAS's, split by split_worth")
    x = np.random.default_rng(2).standard_normal((1, 1, 576)).astype(np.float32)
    model, w = _model(576, 1536)  # 3.5 MB
    before = _splits()
    y = Session(model, threads=2).run({"x": x})["y"]
    assert _splits() == before
    np.testing.assert_allclose(y[0], x[0] @ w[0].T, rtol=1e-4, atol=1e-4)
    monkeypatch.setattr(parallel, "MIN_ROWS_SPLIT_BYTES", w.nbytes)
    assert np.array_equal(Session(model, threads=2).run({"x": x})["y"], y)  # split now: the same bits
    assert _splits() == before + 1
