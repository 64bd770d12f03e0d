"""Moment planning at less memory, same plans (issue 42, scale): the guard's work arrays in
their own dtype, v's importance squared where v is positive, refused attempts freed, and the
pairs planned at once bounded by the memory their guards need."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inshrink_store.policy import moments
from inshrink_store.policy.moment_codebooks import (
    _PreparedM,
    _weighted_buckets,
    quantize_exp_avg_sq,
    unique_inverse,
)


def _adam_like(seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    g = (rng.standard_t(3, n) * 1e-3).astype(np.float32)
    m = (0.1 * g).astype(np.float32)
    v = (1e-3 * g * g).astype(np.float32)
    v[:: 17] = 0.0
    m[:: 23] = 0.0
    return m, v


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 5000), drop_share=st.floats(0.0, 0.9))
def test_the_prepared_histogram_is_the_float64_one(seed: int, n: int, drop_share: float) -> None:
    """Values and importance kept in float32, keys in int32: the histogram its float64 copies gave."""
    m, v = _adam_like(seed, n)
    importance = (1.0 / (np.sqrt(np.maximum(v, 0) / 0.9) + 1e-8) ** 2).astype(np.float32)
    prepared = _PreparedM.of(m, importance)
    assert prepared.values.dtype == np.float32 and prepared.weights.dtype == np.float32
    drop = np.random.default_rng(seed + 1).random(n) < drop_share
    points, weights = prepared.histogram(drop)
    kept = ~drop[prepared.usable]
    wide = _weighted_buckets(prepared.keys[kept].astype(np.int64), prepared.buckets,
                             prepared.values[kept].astype(np.float64), prepared.weights[kept].astype(np.float64))
    np.testing.assert_array_equal(points, wide[0])
    np.testing.assert_array_equal(weights, wide[1])


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 5000), levels=st.sampled_from([4, 16, 64]))
def test_v_with_its_importance_root_is_v_with_the_squared_importance(seed: int, n: int, levels: int) -> None:
    m, v = _adam_like(seed, n)
    exact = (m / (np.sqrt(v) + 1e-8)).astype(np.float32)
    exact[:: 31] = np.inf  # a non-finite importance counts as 0 both ways
    by_root = quantize_exp_avg_sq(v, levels, "F32", importance_root=exact)
    with np.errstate(over="ignore"):
        by_square = quantize_exp_avg_sq(v, levels, "F32", importance=exact.astype(np.float64) ** 2)
    np.testing.assert_array_equal(by_root[0], by_square[0])
    np.testing.assert_array_equal(by_root[1], by_square[1])


@settings(max_examples=50, deadline=None)
@given(keys=st.lists(st.integers(-3000, 3000), min_size=1, max_size=400))
def test_unique_inverse_consuming_its_keys_gives_the_same_arrays(keys: list[int]) -> None:
    array = np.array(keys, np.int64)
    expected = np.unique(array, return_inverse=True)
    scratch = array.copy()
    uniq, inverse = unique_inverse(scratch, consume=True)
    np.testing.assert_array_equal(uniq, expected[0])
    np.testing.assert_array_equal(inverse, expected[1].ravel())
    kept = array.copy()
    unique_inverse(kept)  # without consume the caller's keys are left alone
    np.testing.assert_array_equal(kept, array)


def test_pairs_planned_at_once_stay_within_their_working_memory() -> None:
    memory = moments.WorkingMemory(1000)  # limit: 0.5 * 8 bytes * 1000 = 4000 bytes
    assert memory.limit == 4000
    peak: list[int] = []
    lock = threading.Lock()

    def pair(elements: int) -> None:
        with memory.hold(elements):
            with lock:
                peak.append(memory.used)
            time.sleep(0.01)

    sizes = [20, 30, 10, 1000, 25, 5]  # 1000 elements need more than the limit: it runs alone
    threads = [threading.Thread(target=pair, args=(n,)) for n in sizes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(peak) == len(sizes) and max(peak) <= memory.limit and memory.used == 0


def _state(pairs: int, n: int) -> tuple[dict[str, Any], dict[str, str], dict[str, str]]:
    tensors: dict[str, Any] = {}
    dtypes: dict[str, str] = {}
    params: dict[str, str] = {}
    for i in range(pairs):
        m, v = _adam_like(i, n + 997 * i)
        prefix = f"optimizer/state/{i}"
        tensors[f"{prefix}/exp_avg"], tensors[f"{prefix}/exp_avg_sq"] = m, v
        tensors[f"{prefix}/step"] = np.array(10.0, np.float32)
        dtypes.update({f"{prefix}/exp_avg": "F32", f"{prefix}/exp_avg_sq": "F32", f"{prefix}/step": "F32"})
        params[prefix] = f"model/w{i}"
    return tensors, dtypes, params


@pytest.mark.parametrize("threads", ["1", "4"])
def test_a_tight_memory_bound_changes_no_plan(monkeypatch: pytest.MonkeyPatch, threads: str) -> None:
    tensors, dtypes, params = _state(4, 6000)
    free = moments.MomentPolicy().plan(tensors, dtypes, {}, weights={}, params=params)
    monkeypatch.setenv("INSHRINK_WRITE_THREADS", threads)
    monkeypatch.setattr(moments, "MOMENT_WORKING_FRACTION", 1e-6)  # one pair at a time
    tight = moments.MomentPolicy().plan(tensors, dtypes, {}, weights={}, params=params)
    assert sorted(free) == sorted(tight) and len(free) == 8
    for path in free:
        np.testing.assert_array_equal(np.asarray(free[path].values), np.asarray(tight[path].values))
    assert free.record.to_dict() == tight.record.to_dict()
