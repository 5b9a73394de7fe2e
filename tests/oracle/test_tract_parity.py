"""Issue 23.2: tract parity of tract's quantized KV ops (``--scheme tract``, ``tract-cache:8/4``).

The cause: nnef-kv reproduces tract's quantizers bit for bit on the same K/V (tested here on the K/V tract
itself computes inside a real decoder), but the K/V of the two engines differ by f32 noise (the RMS norm's
``mean_reduce`` and the projections accumulate in another order), which flips the codes lying at a rounding
boundary by one quantization step. Parity is therefore judged with the f32 tolerance plus a term derived from
those flips (``nnef_kv/validate/parity.py``), which must still catch a wrong quantizer.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import nnef_kv
from nnef_kv.kv import tract_dyn_cache as T
from nnef_kv.kv.common import round_half_away
from nnef_kv.kv.tract_dyn_cache import TractQuantizedDynKvCache, flip_at_boundary
from nnef_kv.kv.tract_fused import TractQuantizedKvSdpa
from nnef_kv.validate import parity
from nnef_kv.validate.results import ParityResult, ValidateOptions

from conftest import FIXTURES, REPO, requires_shared, requires_tract
from tract_oracle import TractOracleDynCache, TractOracleSdpa, assert_close

TRAINED = REPO / "tests" / "fixtures" / "trained_llama" / "model.nnef.tgz"
TEXT = REPO.parent / "shared" / "data" / "wikitext2" / "wiki.test.raw.part1"


def _ids(n: int) -> list[int]:
    """The trained decoders' tokenizer is one id per byte."""
    return list(TEXT.read_bytes()[:n]) if TEXT.is_file() else [(i * 37 + 11) % 256 for i in range(n)]


# ------------------------------------------------------------------------------------------------ the margin
@pytest.mark.parametrize("levels", [15.0, 255.0])
def test_flip_margin_covers_every_code_the_noise_can_flip(levels: float) -> None:
    """Perturb x (and with it lo, hi) by at most eps: every code that changes lies within the 4 eps / step
    the margin flags, and is then the flagged code's other neighbour; margin 0 changes nothing."""
    rng = np.random.default_rng(0)
    lv = np.float32(levels)
    changed = flagged = 0
    for eps in (1e-6, 1e-5, 1e-4):
        x = rng.normal(size=(400, 32)).astype(np.float32)
        noisy = (x + rng.uniform(-eps, eps, size=x.shape)).astype(np.float32)

        def codes(a: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            lo = a.min(axis=1, keepdims=True)
            step = ((a.max(axis=1, keepdims=True) - lo) / lv).astype(np.float32)
            r = (a - lo) / step
            return r, np.clip(round_half_away(r), 0, lv), step

        r, q, step = codes(x)
        _, qn, _ = codes(noisy)
        moved, n = flip_at_boundary(r, q, step, eps)
        near = moved != q
        assert n == int(near.sum())
        diff = qn != q
        assert not np.any(diff & ~near), f"eps {eps}: a code flipped outside the margin"
        np.testing.assert_array_equal(np.clip(moved, 0, lv)[diff], qn[diff])
        changed += int(diff.sum())
        flagged += n
        same, zero = flip_at_boundary(r, q, step, 0.0)
        assert zero == 0 and same is q
    assert 0 < changed <= flagged  # the noise did flip codes, all of them flagged


def test_flip_margin_zero_is_tract_bit_for_bit() -> None:
    rng = np.random.default_rng(1)
    a, b = TractQuantizedDynKvCache(bits=4, per_channel=1), TractQuantizedDynKvCache(bits=4, per_channel=1)
    b.flip_margin = 0.0
    for s in (40, 1, 1, 30):
        x = rng.normal(size=(1, 2, s, 8)).astype(np.float32)
        np.testing.assert_array_equal(a(x), b(x))
    c = TractQuantizedDynKvCache(bits=4, per_channel=1)
    c.flip_margin = 1e-2
    for s in (40, 1, 1, 30):
        c(rng.normal(size=(1, 2, s, 8)).astype(np.float32))
    assert c.flips > 0


# ------------------------------------------------------------------------------- codes on a decoder's own K/V
def _tract_outputs(model, names: list[str], calls: list[list[int]]) -> dict[str, list[np.ndarray]]:
    """Tensors ``names`` of ``model`` as tract computes them, call by call (made extra graph outputs)."""
    from nnef_kv import tract_driver
    from nnef_kv.validate.decode import InterpreterDecoder

    sig = InterpreterDecoder(model).sig
    drv = tract_driver.Decoder(parity._with_outputs(model, names),
                               dataclasses.replace(sig, output_names=list(sig.output_names) + names))
    got: dict[str, list[np.ndarray]] = {k: [] for k in names}
    for part in calls:
        out = drv(np.asarray(part, np.int64))
        for k in names:
            got[k].append(np.asarray(out[k]))
    return got


def _calls() -> list[list[int]]:
    ids = _ids(80)
    return [ids[:64]] + [[t] for t in ids[64:]]


def _cases():
    yield "trained_llama", TRAINED
    yield "llama_default", FIXTURES / "exports" / "llama_default" / "model.nnef.tgz"


@requires_tract
@requires_shared
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("name,path", list(_cases()))
def test_dyn_cache_bit_exact_on_the_kv_tract_computes(name: str, path, bits: int) -> None:
    """tract's K/V of every layer of a real decoder (prefill of 64, then one-token calls), fed to the op
    alone in tract and in nnef-kv: identical outputs at every call, so identical codes and params."""
    from nnef_kv.converters import convert

    model = convert(nnef_kv.load(path), scheme="tract-cache", bits=bits)[0]
    found = parity.kv_inputs(model.document)
    assert len(found) >= 4
    per_channel = {}
    for a in model.document.graph.body:
        if getattr(a.rhs, "name", "") == parity.QUANTIZED_TRACT_OPS[0]:
            per_channel[a.rhs.positional()[0].name] = int(a.rhs.named()["per_channel"].value)
    kv = _tract_outputs(model, list(per_channel), _calls())
    for x, parts in kv.items():
        b, h, _, d = parts[0].shape
        ours = TractQuantizedDynKvCache(bits=bits, per_channel=per_channel[x])
        theirs = TractOracleDynCache(b, h, d, bits, bool(per_channel[x]))
        for i, part in enumerate(parts):
            np.testing.assert_array_equal(ours(part), theirs(part), err_msg=f"{name} {x} call {i}")
        assert ours.packed.len > 0


@requires_tract
def test_fused_op_on_the_kv_tract_computes() -> None:
    """The fused op alone on a real decoder's q/K/V (tract's): within the f32 tolerance of tract at every
    call (its softmax is flash-style in f32 blocks, not bit for bit)."""
    from nnef_kv.converters import convert

    model = convert(nnef_kv.load(TRAINED), scheme="tract")[0]
    ops = [a.rhs for a in model.document.graph.body if getattr(a.rhs, "name", "") == parity.QUANTIZED_TRACT_OPS[1]]
    assert len(ops) == 4
    names = list(dict.fromkeys(x.name for rhs in ops for x in rhs.positional()[:3]))
    got = _tract_outputs(model, names, _calls())
    for rhs in ops:
        q, k, v = (x.name for x in rhs.positional()[:3])
        scale = float(rhs.named()["scale"].value)
        b, hq, _, d = got[q][0].shape
        ours, theirs = TractQuantizedKvSdpa(scale=scale), TractOracleSdpa(b, hq, got[k][0].shape[1], d, scale)
        for i, (qq, kk, vv) in enumerate(zip(got[q], got[k], got[v])):
            assert_close(ours(qq, kk, vv), theirs(qq, kk, vv), what=f"{q} call {i}")


# ------------------------------------------------------------------------------------ the derived tolerance
def _validate(model, ref, eval_tokens: int, **kw):
    from nnef_kv.text import TokenSource
    from nnef_kv.validate.runner import validate_model

    src = TokenSource(ids=_ids(4000), option="--ids", description="wikitext bytes")
    return validate_model(model, ref, src, ValidateOptions(contexts=[128], eval_tokens=eval_tokens, windows=1, **kw))


@requires_tract
def test_parity_with_the_flip_term_passes_tract_and_fails_wrong_quantizers(monkeypatch) -> None:
    """trained_llama, tract-cache:8, context 128: nnef-kv and tract agree within the f32 tolerance plus the
    derived flip term, a term larger than the f32 tolerance (one code flipped at a rounding boundary moves
    the logits more than summation order does); a quantizer off by one level, or with 3 sink tokens instead
    of 4, is a mismatch under the same derivation, and compare says "no".

    Whether tract's own run lands beyond the f32 tolerance depends on the BLAS kernels of the CPU (which
    codes the engines' ~6e-6 K/V noise happens to flip): 0.0158 on issue 23's machine, 3.4e-5 on an AMD
    EPYC with OpenBLAS 0.3.31's Haswell kernels; so it is not asserted."""
    from nnef_kv.converters import convert
    from nnef_kv.validate.compare import CompareOptions, _tract_of

    ref = nnef_kv.load(TRAINED)
    model = convert(ref, scheme="tract-cache", bits=8)[0]
    p = _validate(model, ref, 128).parity
    scale = p.max_abs / p.max_rel
    f32 = 1e-4 + 1e-3 * scale
    assert p.status == "ok", p
    assert p.atol > 1e-4 and "quantized-cache term" in p.reason and "boundary codes flipped" in p.reason, p
    term = p.atol - 1e-4
    assert term > f32 and p.max_abs <= f32 + term  # the f32 tolerance alone would not cover a flipped code
    assert _tract_of(type("R", (), {"parity": p})(), model, CompareOptions())[0] is True

    orig = TractQuantizedDynKvCache.__init__

    def off_by_one_level(self, *a, **k):
        orig(self, *a, **k)
        self.levels = np.float32(self.levels - 1)

    monkeypatch.setattr(TractQuantizedDynKvCache, "__init__", off_by_one_level)
    bad = _validate(model, ref, 128).parity
    assert bad.status == "mismatch" and bad.max_abs > 2 * (bad.atol + bad.rtol * scale), bad
    cell = _tract_of(type("R", (), {"parity": bad})(), model, CompareOptions())
    assert cell[0] is False and "logits differ" in cell[1]
    monkeypatch.setattr(TractQuantizedDynKvCache, "__init__", orig)
    monkeypatch.setattr(T, "SINK_TOKENS", 3)
    assert _validate(model, ref, 128).parity.status == "mismatch"


def test_a_user_tolerance_is_taken_as_given() -> None:
    """--parity-atol / --parity-rtol: no derived term is added (nothing is run either)."""
    from nnef_kv.validate.runner import _parity_tolerance

    sentinel = object()  # would fail if the probe were used
    assert _parity_tolerance(ValidateOptions(parity_atol=1e-6), "float32", sentinel) == (1e-6, 1e-3, "")
    assert _parity_tolerance(ValidateOptions(parity_rtol=0.0), "float32", sentinel) == (1e-4, 0.0, "")
    assert _parity_tolerance(ValidateOptions(), "float32") == (1e-4, 1e-3, "")


def test_compare_never_shows_a_mismatch_as_yes() -> None:
    from nnef_kv.validate.compare import CompareOptions, _tract_of

    rep = type("R", (), {"parity": ParityResult("mismatch", "max |logits - tract| = 13 > 0.0001 + 0.001 * 20",
                                                max_abs=13.0, atol=1e-4, rtol=1e-3)})()
    ok, detail = _tract_of(rep, None, CompareOptions())
    assert ok is False and "13" in detail


@requires_tract
def test_parity_tokens_limit_what_tract_runs() -> None:
    """``parity_tokens``: tract (and the flip term's runs) cover the first window's first N predictions only;
    the f32 archive agrees there as on the whole window."""
    ref = nnef_kv.load(TRAINED)
    p = _validate(ref, ref, 64, parity_tokens=16).parity
    assert p.status == "ok" and p.calls == 16, p
    assert _validate(ref, ref, 64).parity.calls == 64
    with pytest.raises(nnef_kv.InputError, match="parity_tokens 0: must be an integer >= 1"):
        ValidateOptions(parity_tokens=0).check()
