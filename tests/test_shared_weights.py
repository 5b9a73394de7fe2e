"""One copy of the weights (issue 26): ``validate`` gives the converted archive the reference's arrays after
checking they are equal, and the two sessions then hold one set of weights (the fused projections too)."""
from __future__ import annotations

import numpy as np
import pytest

import nnef_kv
from nnef_kv.models import DecoderConfig, build_decoder
from nnef_kv.validate import ValidateOptions, validate_model

CFG = DecoderConfig(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, mlp=128, seed=5)


@pytest.fixture(scope="module")
def source():
    from nnef_kv.text import byte_level_tokenizer, sample_text, token_source

    return token_source(prompt=sample_text()[:4000], tokenizer=byte_level_tokenizer())


@pytest.fixture()
def pair(tmp_path):
    """(f32 archive path, KIVI-4 archive path): two files, so each loads its own arrays."""
    from nnef_kv.converters import convert

    f32 = tmp_path / "f32.nnef.tar"
    nnef_kv.save(build_decoder(CFG), f32)
    kivi = tmp_path / "kivi4.nnef.tar"
    nnef_kv.save(convert(nnef_kv.load(f32), scheme="kivi", bits=4, key_group=16, value_group=8, residual=16)[0], kivi)
    return f32, kivi


def _roots(plan) -> dict[int, int]:
    """id -> bytes of the distinct arrays (their outermost ndarray) a plan holds as constants."""
    out: dict[int, int] = {}
    for x in plan.base:
        if isinstance(x, np.ndarray) and x.nbytes >= 4096:
            r = x
            while isinstance(r.base, np.ndarray):
                r = r.base
            out[id(r)] = r.nbytes
    return out


def _held(*models) -> int:
    """Bytes of the distinct arrays the models' plans hold (an array two plans share counted once)."""
    seen: dict[int, int] = {}
    for m in models:
        seen.update(_roots(m.session().plan))
    return sum(seen.values())


OPTS = dict(contexts=[64], eval_tokens=8, parity=False, round_trip=False)


def test_validate_gives_the_archive_the_references_arrays(pair, source) -> None:
    f32, kivi = pair
    ref, model = nnef_kv.load(f32), nnef_kv.load(kivi)
    before = {k: v for k, v in model.tensors.items()}
    assert not any(np.shares_memory(before[k], ref.tensors[k]) for k in before)  # two files, two copies
    rep = validate_model(model, ref, source, ValidateOptions(**OPTS))
    assert rep.contexts[0].summary()["tokens_reading_quantized"] > 0
    assert set(model.tensors) == set(before)
    for label, t in model.tensors.items():
        assert t is ref.tensors[label], label  # the very same objects: the archive's copy is released
        np.testing.assert_array_equal(t, before[label])
    # the sessions hold one set of weights: every large constant of the archive's plan is one of the reference's
    mine, theirs = _roots(model.session().plan), _roots(ref.session().plan)
    big = {i for i, n in mine.items() if n >= CFG.hidden * CFG.hidden * 4}
    assert big and big <= set(theirs)
    shared = _held(model, ref)

    ref2, model2 = nnef_kv.load(f32), nnef_kv.load(kivi)  # the same run, comparing nothing: two copies held
    validate_model(model2, ref2, source, ValidateOptions(**OPTS, allow_different_weights=True))
    assert not any(model2.tensors[k] is ref2.tensors[k] for k in model2.tensors)
    separate = _held(model2, ref2)
    weights = sum(t.nbytes for t in ref.tensors.values() if t.nbytes >= 4096)  # what _roots counts
    assert shared <= separate - weights, (shared, separate, weights)
    # and the figures are those of the unshared run
    rep2 = validate_model(nnef_kv.load(kivi), nnef_kv.load(f32), source, ValidateOptions(**OPTS))
    np.testing.assert_array_equal(rep2.contexts[0].archive.logits, rep.contexts[0].archive.logits)


def test_different_weights_are_refused_before_anything_is_shared(pair, source, tmp_path) -> None:
    f32, kivi = pair
    other = tmp_path / "other.nnef.tar"
    nnef_kv.save(build_decoder(DecoderConfig(**{**CFG.to_dict(), "seed": 6})), other)
    model, ref = nnef_kv.load(kivi), nnef_kv.load(other)
    before = dict(model.tensors)
    with pytest.raises(nnef_kv.InputError, match="not the same model as the archive"):
        validate_model(model, ref, source, ValidateOptions(**OPTS))
    assert all(model.tensors[k] is before[k] for k in before)  # nothing replaced


def test_one_changed_weight_is_refused(pair, source) -> None:
    f32, kivi = pair
    model, ref = nnef_kv.load(kivi), nnef_kv.load(f32)
    label = sorted(ref.tensors)[-1]
    changed = np.array(ref.tensors[label])
    changed.reshape(-1)[0] += 1.0
    ref.tensors[label] = changed
    with pytest.raises(nnef_kv.InputError, match=f"its tensor '{label}' differs"):
        validate_model(model, ref, source, ValidateOptions(**OPTS))
