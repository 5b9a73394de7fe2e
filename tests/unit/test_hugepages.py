"""The weights' huge-page memory (nnef_kv/tensors/hugepages.py) and the plan's use of it (issue 26): aligned
arrays cut from shared chunks, a chunk freed with its last array, huge pages where the kernel gives them,
``NNEF_KV_HUGE_PAGES=0`` leaving the archive's arrays in the plan, and the copies shared between plans."""
from __future__ import annotations

import gc
import sys
import weakref

import numpy as np
import pytest

import nnef_kv
from nnef_kv.interpreter.plan import weights as W
from nnef_kv.interpreter.session import Session
from nnef_kv.kernels import numba_available
from nnef_kv.tensors import hugepages
from nnef_kv.tensors.pages import _mapping_of

TEXT = """version 1.0;
graph g(x, u) -> (y, z)
{
  x = external<scalar>(shape = [1, 256]);
  u = external<scalar>(shape = [1, 256]);
  a = variable<scalar>(label = 'a', shape = [1024, 256]);
  b = variable<scalar>(label = 'b', shape = [16, 256]);
  y = linear(x, a, 0.0);
  z = linear(u, b, 0.0);  # another input: not stacked with a
}
"""


def test_arrays_are_aligned_and_cut_from_one_chunk() -> None:
    a = hugepages.empty((100, 7), np.float32)
    b = hugepages.empty((3,), np.float64)
    assert a.flags.c_contiguous and a.flags.writeable and a.shape == (100, 7) and a.dtype == np.float32
    assert a.ctypes.data % hugepages.ALIGN == 0 and b.ctypes.data % hugepages.ALIGN == 0
    assert _mapping_of(a.base) is _mapping_of(b.base)  # the same chunk
    assert b.ctypes.data >= a.ctypes.data + a.nbytes
    a[:] = 1.5
    b[:] = 2.0
    assert float(a.sum()) == 1050.0 and float(b.sum()) == 6.0  # no overlap


def test_a_refused_mapping_gives_an_ordinary_array(monkeypatch) -> None:
    def refuse(*a, **k):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(hugepages, "_chunk", refuse)  # mmap.mmap refusing the mapping
    monkeypatch.setattr(hugepages, "_current", [None, 0, 0, 0])
    a = hugepages.empty((5, 3), np.float32)
    assert a.shape == (5, 3) and a.dtype == np.float32 and not hugepages.holds(a)


def test_a_large_array_gets_its_own_huge_page_aligned_chunk_freed_with_it() -> None:
    big = hugepages.empty((hugepages.CHUNK // 4 + 10,), np.float32)
    assert big.ctypes.data % hugepages.HUGE == 0
    mm = weakref.ref(_mapping_of(big.base))
    small = hugepages.empty((4,), np.float32)
    assert _mapping_of(small.base) is not mm()
    del big
    gc.collect()
    assert mm() is None


def test_a_chunk_lives_while_one_of_its_arrays_does() -> None:
    first = hugepages.empty((8,), np.float32)
    mm = weakref.ref(_mapping_of(first.base))
    second = hugepages.empty((8,), np.float32)
    del first
    gc.collect()
    assert mm() is not None  # second is in it
    second[:] = 3.0
    assert float(second.sum()) == 24.0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_the_kernel_backs_a_written_array_with_huge_pages() -> None:
    try:
        mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        pytest.skip("no transparent huge pages here")
    if "[never]" in mode:
        pytest.skip("transparent huge pages are off on this machine")
    a = hugepages.empty((hugepages.CHUNK // 4,), np.float32)
    a[:] = 1.0
    start = a.ctypes.data
    huge = None
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= start < hi
            elif inside and line.startswith("AnonHugePages:"):
                huge = int(line.split()[1]) * 1024
                break
    assert huge is not None and huge >= a.nbytes // 2, huge


def _model() -> nnef_kv.Model:
    rng = np.random.default_rng(0)
    return nnef_kv.Model.from_text(TEXT, {"a": rng.standard_normal((1024, 256)).astype(np.float32),
                                          "b": rng.standard_normal((16, 256)).astype(np.float32)})


def _planned_weights(session: Session) -> list[np.ndarray]:
    return [x for x in session.plan.base if isinstance(x, np.ndarray) and x.ndim == 2 and x.shape[0] == 256]


def test_the_plan_holds_large_weights_in_huge_pages_and_leaves_small_ones(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv(hugepages.ENV, raising=False)
    path = nnef_kv.save(_model(), tmp_path / "m.tar")
    model = nnef_kv.load(path)
    s = Session(model, threads=1)
    got = {w.shape[1]: w for w in _planned_weights(s)}
    a, b = got[1024], got[16]
    assert a.nbytes >= W.MIN_HUGE_BYTES and b.nbytes < W.MIN_HUGE_BYTES
    assert a.T.flags.c_contiguous and not a.flags.writeable
    assert _mapping_of(a.base) is not _mapping_of(model.tensors["a"].base)  # copied out of the archive
    assert _mapping_of(b.base) is _mapping_of(model.tensors["b"].base)  # small: the archive's own array
    np.testing.assert_array_equal(a, model.tensors["a"].T)
    x = np.random.default_rng(1).standard_normal((1, 256)).astype(np.float32)
    out = s.run({"x": x, "u": x})
    np.testing.assert_allclose(out["y"], x @ model.tensors["a"].T, rtol=1e-5, atol=1e-4)
    # another plan of the same loaded arrays shares the copy (validate's reference and converted sessions)
    twin = nnef_kv.Model(model.document, dict(model.tensors))
    other = {w.shape[1]: w for w in _planned_weights(Session(twin, threads=1))}
    assert other[1024] is a


def test_huge_pages_off_keeps_the_archive_s_arrays(monkeypatch, tmp_path) -> None:
    path = nnef_kv.save(_model(), tmp_path / "m.tar")
    monkeypatch.setenv(hugepages.ENV, "0")
    assert not hugepages.enabled()
    model = nnef_kv.load(path)
    s = Session(model, threads=1)
    a = {w.shape[1]: w for w in _planned_weights(s)}[1024]
    assert _mapping_of(a.base) is _mapping_of(model.tensors["a"].base)  # the transposed view, no copy


def test_an_in_memory_model_s_weights_are_not_copied(monkeypatch) -> None:
    # a model built in Python (or imported from a GGUF) holds its arrays itself: a copy would hold them twice
    monkeypatch.delenv(hugepages.ENV, raising=False)
    model = _model()
    a = {w.shape[1]: w for w in _planned_weights(Session(model, threads=1))}[1024]
    assert a.base is model.tensors["a"] or a.T is model.tensors["a"] or np.shares_memory(a, model.tensors["a"])


def test_a_tgz_member_is_inflated_into_huge_pages_and_planned_in_place(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv(hugepages.ENV, raising=False)
    path = nnef_kv.save(_model(), tmp_path / "m.tgz")
    model = nnef_kv.load(path)
    assert hugepages.holds(model.tensors["a"]) and not model.tensors["a"].flags.writeable
    assert not hugepages.holds(model.tensors["b"])  # 16 KiB: an ordinary buffer
    a = {w.shape[1]: w for w in _planned_weights(Session(model, threads=1))}[1024]
    assert np.shares_memory(a, model.tensors["a"])  # no copy
    monkeypatch.setenv(hugepages.ENV, "0")
    assert not hugepages.holds(nnef_kv.load(path).tensors["a"])


def _block_kernels(session: Session) -> list:
    from nnef_kv.interpreter.plan.blockweights import BlockLinear

    found = []
    for step in session.plan.steps:
        cells = [c.cell_contents for c in (getattr(step, "__closure__", None) or ())]
        for obj in cells + list(getattr(step, "__defaults__", None) or ()):
            if isinstance(obj, BlockLinear):
                found.append(obj)
    return found


@pytest.mark.skipif(not numba_available(), reason="without numba block weights are dequantized, not repacked")
def test_repacked_q4_0_weights_are_held_in_huge_pages(monkeypatch) -> None:
    from nnef_kv.models import DecoderConfig, build_decoder

    monkeypatch.delenv(hugepages.ENV, raising=False)
    cfg = DecoderConfig(vocab=256, hidden=512, layers=1, heads=8, kv_heads=8, head_dim=64, mlp=1536,
                        cache="explicit", weights="q4_0")
    kernels = _block_kernels(Session(build_decoder(cfg), threads=1))
    big = [k.packed for k in kernels if k.packed.codes.nbytes >= W.MIN_HUGE_BYTES]
    assert len(big) >= 3  # q|k|v and gate|up fused, down alone (o: 128 KiB of codes, under the threshold)
    assert all(hugepages.holds(p.codes) and hugepages.holds(p.scales) for p in big)
    monkeypatch.setenv(hugepages.ENV, "0")
    kernels = _block_kernels(Session(build_decoder(cfg), threads=1))
    assert kernels and not any(hugepages.holds(k.packed.codes) for k in kernels)
