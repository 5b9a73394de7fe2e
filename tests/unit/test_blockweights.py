"""Q4_0 / Q8_1 weights kept as blocks (interpreter/plan/blockweights.py): no dequantized copy held, the
products on kernels.blockquant, numerics those of the old dequantize-at-load path (bit for bit with the
NumPy reference, within f32 rounding with numba)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import nnef_kv
from conftest import FIXTURES, REPO
from nnef_kv.interpreter.plan import get_plan
from nnef_kv.interpreter.plan.blockweights import BlockLinear
from nnef_kv.interpreter.session import Session
from nnef_kv.tensors.blockquant import BlockQuantTensor
from nnef_kv.io.archive import Model
from nnef_kv.kernels import NO_NUMBA_ENV, numba_available
from nnef_kv.models import DecoderConfig, build_decoder
from nnef_kv.validate.decode import detect_signature

MIB = 1 << 20

#: with the numba kernels off or absent, block weights are dequantized once at plan time (their NumPy reference
#: would dequantize at every call): the tests of blocks kept as blocks need the kernels
needs_kernels = pytest.mark.skipif(not numba_available(), reason="numba off or absent: block weights are "
                                   "dequantized once at plan time (test_without_numba_weights_are_dequantized_once)")

CFG = DecoderConfig(cache="explicit", vocab=64, hidden=64, heads=4, kv_heads=2, head_dim=16, mlp=96, weights="q4_0")


def _decode(model, steps: int = 6) -> np.ndarray:
    s = Session(model)
    sig = detect_signature(s.plan)
    caches = sig.empty_caches()
    ids = np.arange(1, 10, dtype=np.int64)[None]
    out = []
    for _ in range(steps + 1):
        r = s.run({sig.ids_input: ids, **caches})
        caches = {i: r[o] for i, o in sig.cache_outputs.items()}
        lg = np.asarray(r[sig.logits_output]).reshape(-1, 64)[-1]
        out.append(lg)
        ids = np.array([[int(np.argmax(lg))]], np.int64)
    return np.stack(out)


@needs_kernels
def test_block_weights_are_kept_as_blocks_and_products_fused() -> None:
    model = build_decoder(CFG)
    plan = get_plan(model)
    assert plan.info["block_products"] == 7 * CFG.layers + 1  # q, k, v, o, gate, up, down a layer; LM head
    assert plan.info["fused_projections"] == 3 * CFG.layers  # k, v join q; up joins gate
    assert "dequantized_weights" not in plan.info
    blocks = [t for t in model.tensors.values() if isinstance(t, BlockQuantTensor)]
    assert len(blocks) == 7 * CFG.layers + 1
    # nothing the plan holds is a dequantized weight: its float arrays are the embedding, norms, tables
    n_q4 = min(t.size for t in blocks)
    big = [a for a in plan.base if isinstance(a, np.ndarray) and a.dtype == np.float32 and a.size >= n_q4]
    assert all(a.shape == (CFG.vocab, CFG.hidden) for a in big), [a.shape for a in big]
    kernels = [st for st in plan.steps if isinstance(getattr(st, "__self__", None), BlockLinear)]
    assert not kernels or all(k.__self__.packed.bits_per_weight == 4.5 for k in kernels)


def test_reference_path_is_the_old_dequantize_at_load_path_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the NumPy reference (numba forced off) the logits are exactly those of the same model with
    every Q4_0 weight dequantized to f32 up front (what the interpreter did before); with numba they
    differ by f32 rounding only."""
    model = build_decoder(CFG)
    f32 = Model(model.document, {k: (np.asarray(v) if isinstance(v, BlockQuantTensor) else v)
                                 for k, v in model.tensors.items()})
    monkeypatch.setenv(NO_NUMBA_ENV, "1")  # the f32 products on BLAS too (with numba: the few-row kernel)
    want = _decode(f32)
    np.testing.assert_array_equal(_decode(build_decoder(CFG)), want)
    monkeypatch.delenv(NO_NUMBA_ENV)
    got = _decode(build_decoder(CFG))
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


def test_a_gather_from_a_block_weight_reads_the_dequantized_values() -> None:
    """A Q4_0 embedding table (an op other than a product): dequantized for that step, as before."""
    rng = np.random.default_rng(0)
    table = BlockQuantTensor.quantize_q4_0(rng.standard_normal((16, 64)).astype(np.float32))
    text = """version 1.0;
extension tract_registry tract_core;
graph g(ids) -> (y, z)
{
    ids = tract_core_external(shape = [3], datum_type = 'i64');
    t = variable(label = 't', shape = [16, 64]);
    y = tract_core_gather(t, ids, axis = 0);
    z = linear(y, unsqueeze(t, axes = [0]), 0.0);
}
"""
    m = Model.from_text(text, {"t": table})
    plan = get_plan(m)
    assert plan.info.get("dequantized_weights", 0) >= 1
    assert plan.info.get("block_products", 0) == (1 if numba_available() else 0)
    ids = np.array([3, 0, 15], np.int64)
    out = Session(m).run({"ids": ids})
    deq = table.dequantize()
    np.testing.assert_array_equal(out["y"], deq[ids])
    np.testing.assert_allclose(out["z"], deq[ids] @ deq.T, rtol=1e-5, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("name", ["llama_q4", "qwen2_q4"])
def test_q4_exports_keep_their_blocks(name: str) -> None:
    """The torch-to-nnef Q4_0 exports: every weight product runs on the blocks, none is dequantized (their
    numerics against the exporter's test outputs and tract: tests/e2e/test_exports.py)."""
    path = FIXTURES / "exports" / name / "model.nnef.tgz"
    if not path.is_file():
        pytest.skip(f"{path} not found")
    plan = get_plan(nnef_kv.load(path))
    assert plan.info["block_products"] >= 7 * 2 and "dequantized_weights" not in plan.info


def test_without_numba_weights_are_dequantized_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """numba forced off: every block weight is dequantized once when the plan is built (no product on the
    blocks, whose reference would dequantize at every call), and the logits are the f32 model's bits."""
    monkeypatch.setenv(NO_NUMBA_ENV, "1")
    model = build_decoder(CFG)
    plan = get_plan(model)
    assert plan.info.get("block_products", 0) == 0
    assert plan.info["dequantized_weights"] >= 7 * CFG.layers + 1
    assert not [st for st in plan.steps if isinstance(getattr(st, "__self__", None), BlockLinear)]
    f32 = Model(model.document, {k: (np.asarray(v) if isinstance(v, BlockQuantTensor) else v)
                                 for k, v in model.tensors.items()})
    np.testing.assert_array_equal(_decode(model), _decode(f32))


def test_q4_archive_runs_without_numba_installed() -> None:
    """numba absent (its import blocked, not merely switched off): the Q4_0 decoder and a long KIVI cache
    still run, on the NumPy references."""
    code = """
import sys
sys.modules['numba'] = None  # 'import numba' raises ImportError
import numpy as np
from nnef_kv.kernels import numba_available
from nnef_kv.models import DecoderConfig, build_decoder
from nnef_kv.interpreter.session import Session
from nnef_kv.validate.decode import detect_signature
from nnef_kv.kv import KiviSdpa
assert not numba_available()
cfg = DecoderConfig(cache='explicit', vocab=64, hidden=64, heads=4, kv_heads=2, head_dim=16, mlp=96, weights='q4_0')
s = Session(build_decoder(cfg)); sig = detect_signature(s.plan)
r = s.run({sig.ids_input: np.arange(5)[None], **sig.empty_caches()})
assert np.isfinite(r[sig.logits_output]).all()
op = KiviSdpa(bits=4, residual=32)
rng = np.random.default_rng(0)
k = rng.standard_normal((1, 8, 2048, 64)).astype(np.float32)
op(rng.standard_normal((1, 8, 1, 64)).astype(np.float32), k, k)
out = op(*(rng.standard_normal((1, 8, 1, 64)).astype(np.float32) for _ in range(3)))
assert np.isfinite(out).all()
print('ok')
"""
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(REPO),
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert got.returncode == 0 and got.stdout.strip().endswith("ok"), got.stderr[-2000:]


@needs_kernels
def test_loading_a_q4_model_does_not_import_numba() -> None:
    """Block weights kept as blocks are decided at plan time without importing numba (it maps 64 MiB of
    numba and LLVM): a fresh process that loads and plans the Q4_0 decoder has not imported it; its first
    call does, and runs the products on the kernels."""
    code = """
import sys
import numpy as np
from nnef_kv.models import DecoderConfig, build_decoder
from nnef_kv.interpreter.session import Session
from nnef_kv.validate.decode import detect_signature
cfg = DecoderConfig(cache='explicit', vocab=64, hidden=64, heads=4, kv_heads=2, head_dim=16, mlp=96, weights='q4_0')
s = Session(build_decoder(cfg)); sig = detect_signature(s.plan)
assert s.plan.info['block_products'] > 0 and 'dequantized_weights' not in s.plan.info, s.plan.info
assert 'numba' not in sys.modules and 'llvmlite' not in sys.modules
r = s.run({sig.ids_input: np.arange(5)[None], **sig.empty_caches()})
assert np.isfinite(r[sig.logits_output]).all() and 'numba' in sys.modules
print('ok')
"""
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(REPO),
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert got.returncode == 0 and got.stdout.strip().endswith("ok"), got.stderr[-2000:]


TRIM_PROBE = """
import json, sys
import nnef_kv
import nnef_kv.interpreter.plan.compile as C
from nnef_kv.interpreter.session import Session
if sys.argv[2] == "off":
    C.trim_heap = lambda: False
def anon():
    return [int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("RssAnon")][0]
m = nnef_kv.load(sys.argv[1])
a0 = anon()
s = Session(m, threads=1)
print(json.dumps({"grew": anon() - a0}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status; glibc's malloc_trim")
@pytest.mark.skipif(not numba_available(), reason="without numba block weights are dequantized, not repacked")
def test_planning_q4_weights_holds_about_one_repacked_copy(tmp_path) -> None:
    """Planning repacks each Q4_0 weight, then puts q/k/v and gate/up side by side and drops the separate copies;
    glibc keeps freed blocks in its heap until trimmed, so the plan trims it (``tensors.pages.trim_heap``):
    the process grows by about the repacked weights (the same bytes as the archive's blocks), not by
    the blocks plus the dropped copies (1.9x the blocks measured without the trim)."""
    cfg = DecoderConfig(vocab=8192, hidden=1024, layers=4, heads=16, kv_heads=4, head_dim=64, mlp=4096,
                        cache="explicit", weights="q4_0", name="trim")
    model = build_decoder(cfg)
    blocks = sum(t.blocks.nbytes for t in model.tensors.values() if isinstance(t, BlockQuantTensor))
    path = str(nnef_kv.save(model, tmp_path / "q4.tar"))
    grew = {}
    # the trim's effect on the plan's temporaries in ordinary memory: with NNEF_KV_HUGE_PAGES=0 (by default the
    # kept codes go to huge-page mappings, and what the heap keeps is smaller)
    for mode, huge in (("on", "1"), ("on", "0"), ("off", "0")):
        done = subprocess.run([sys.executable, "-c", TRIM_PROBE, path, mode], capture_output=True, text=True,
                              timeout=300, env={**os.environ, "NNEF_KV_HUGE_PAGES": huge})
        assert done.returncode == 0, done.stderr
        grew[mode + huge] = json.loads(done.stdout.strip().splitlines()[-1])["grew"]
    assert grew["on1"] < 1.5 * blocks + 4 * MIB, (grew, blocks)
    assert grew["on0"] < 1.5 * blocks + 4 * MIB, (grew, blocks)
    assert grew["off0"] > grew["on0"] + 0.25 * blocks, (grew, blocks)  # the trim is what gives them back
