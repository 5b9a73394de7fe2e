"""O(1) checkpoint / rollback of the quantized KV caches (what makes a failed session run all-or-nothing).

Each state takes chunks of tokens; before some chunks a checkpoint is taken, the chunk (and sometimes a
second one) is pushed, then rolled back. The state must then equal, tensor for tensor, and answer
exactly like, a state that was only ever given the chunks that were kept."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nnef_kv.kv.kivi import KiviSdpa
from nnef_kv.kv.tract_dyn_cache import TractQuantizedDynKvCache
from nnef_kv.kv.tract_fused import TractQuantizedKvSdpa

B, HQ, HKV, D = 1, 4, 2, 16

FACTORIES: dict[str, Callable[[], Any]] = {
    "kivi-4bit": lambda: KiviSdpa(scale=0.25, bits=4, key_group=4, value_group=8, residual=4),
    "kivi-2bit-sinks-rotate": lambda: KiviSdpa(scale=0.25, bits=2, key_group=4, value_group=16, residual=2, sinks=3,
                                               rotate="kv"),
    "kivi-3bit-f32-params": lambda: KiviSdpa(scale=0.25, bits=3, key_group=8, value_group=8, residual=8,
                                             params="f32"),
    "tract-fused": lambda: TractQuantizedKvSdpa(scale=0.25),
    "tract-dyn-keys-4bit": lambda: TractQuantizedDynKvCache(bits=4, per_channel=1),
    "tract-dyn-values-8bit": lambda: TractQuantizedDynKvCache(bits=8, per_channel=0),
}


def push(state: Any, chunk: tuple[np.ndarray, np.ndarray, np.ndarray]) -> np.ndarray:
    q, k, v = chunk
    return state(k) if isinstance(state, TractQuantizedDynKvCache) else state(q, k, v)


def chunk(rng: np.random.Generator, n: int, outliers: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    q = rng.standard_normal((B, HQ, n, D)).astype(np.float32)
    k = rng.standard_normal((B, HKV, n, D)).astype(np.float32)
    v = rng.standard_normal((B, HKV, n, D)).astype(np.float32)
    if outliers and n:
        k[0, 0, 0, 3] = 40.0  # widens a channel's range (tract's running key range, KIVI groups)
        v[0, 1, -1, 5] = np.inf  # KIVI keeps non-finite values exactly in its side table
    return q, k, v


def assert_same_state(a: Any, b: Any) -> None:
    ta, tb = a.state_tensors(), b.state_tensors()
    assert ta.keys() == tb.keys()
    for name in ta:
        np.testing.assert_array_equal(ta[name], tb[name], err_msg=name)


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(sorted(FACTORIES)),
    seed=st.integers(0, 2**16),
    plan=st.lists(
        st.tuples(st.integers(1, 9) | st.integers(28, 40), st.sampled_from(["keep", "abort", "abort2"]), st.booleans()),
        min_size=1,
        max_size=10,
    ),
)
def test_rollback_restores_exactly(kind: str, seed: int, plan: list[tuple[int, str, bool]]) -> None:
    rng = np.random.default_rng(seed)
    state, ref = FACTORIES[kind](), FACTORIES[kind]()
    with np.errstate(all="ignore"):
        for n, what, outliers in plan:
            if what != "keep":
                mark = state.checkpoint()
                push(state, chunk(rng, n, outliers))
                if what == "abort2":
                    push(state, chunk(rng, 3, not outliers))
                state.rollback(mark)
                assert_same_state(state, ref)
            c = chunk(rng, n, outliers)
            np.testing.assert_array_equal(push(state, c), push(ref, c))
        assert_same_state(state, ref)
        c = chunk(rng, 1, False)
        np.testing.assert_array_equal(push(state, c), push(ref, c))


@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_rollback_of_the_first_run_empties_the_state(kind: str) -> None:
    state, fresh = FACTORIES[kind](), FACTORIES[kind]()
    rng = np.random.default_rng(1)
    with np.errstate(all="ignore"):  # the inf put in v: NaN outputs, as designed
        mark = state.checkpoint()
        push(state, chunk(rng, 5, True))
        state.rollback(mark)
        assert_same_state(state, fresh)
        c = chunk(rng, 2, False)
        np.testing.assert_array_equal(push(state, c), push(fresh, c))


@pytest.mark.parametrize("kind", sorted(FACTORIES))
@pytest.mark.parametrize("kept,aborted", [(30, 10), (35, 1), (4, 40), (0, 70)])
def test_rollback_across_a_block_boundary(kind: str, kept: int, aborted: int) -> None:
    """The aborted tokens complete a quantized block (tract's 32-token key block after 4 sinks, KIVI's
    groups and residual window): the blocks they made go, the window comes back as it was."""
    rng = np.random.default_rng(kept + aborted)
    state, ref = FACTORIES[kind](), FACTORIES[kind]()
    with np.errstate(all="ignore"):
        if kept:
            c = chunk(rng, kept, True)
            np.testing.assert_array_equal(push(state, c), push(ref, c))
        mark = state.checkpoint()
        push(state, chunk(rng, aborted, True))
        state.rollback(mark)
        assert_same_state(state, ref)
        for n in (10, 1):
            c = chunk(rng, n, False)
            np.testing.assert_array_equal(push(state, c), push(ref, c))
        assert_same_state(state, ref)
