"""MomentPolicy: Adam's moments stored lossy, each pair checked by the update it drives.

The moments are made the way Adam makes them (running averages of random gradients with a
spread of scales, some entries never seeing a gradient), in F32, F16 and BF16 (uint16 bit
patterns), so the properties below are about the data a Checkpointer really hands over.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import inshrink_store as ins
from inshrink_store import dtypes as dtype_registry
from inshrink_store.errors import FormatError
from inshrink_store.plans import ArrayPlan
from inshrink_store.policy.moments import (
    AdamHyper,
    MomentPlans,
    MomentPolicy,
    MomentRecord,
    MomentTensorRecord,
    compare,
    update,
)
from inshrink_store.policy.search_policy import SearchPolicy

PREFIX = "optimizer/state/0"
M_PATH, V_PATH, STEP_PATH = f"{PREFIX}/exp_avg", f"{PREFIX}/exp_avg_sq", f"{PREFIX}/step"
DTYPES = ("F32", "F16", "BF16")
#: a guard loose enough that typical moments are quantized, so the properties have plans to check
LOOSE = MomentPolicy(min_update_cosine=0.5, max_update_error=1.0, min_numel=256)
SHAPES = ((64, 64), (33, 130), (512,), (8, 8, 8))


def adam_moments(seed: int, shape: tuple[int, ...], dtype: str, *, steps: int = 12,
                 dead: float = 0.1, octaves: float = 8.0) -> tuple[np.ndarray, np.ndarray, int]:
    """(m, v, step) carried in ``dtype``: Adam's running averages of ``steps`` random
    gradients whose scale spans ``octaves``; a ``dead`` fraction never gets a gradient
    (m = v = 0, as in real Adam). F16 keeps its scales where v does not underflow, and any v
    the cast flushes to 0 has its m zeroed too, so v == 0 implies m == 0 as in Adam."""
    rng = np.random.default_rng(seed)
    n = math.prod(shape)
    low = -4.0 if dtype == "F16" else -12.0
    scale = np.exp2(rng.uniform(low, low + octaves, n)).astype(np.float32)
    scale[rng.random(n) < dead] = 0.0
    m, v = np.zeros(n, np.float32), np.zeros(n, np.float32)
    for _ in range(steps):
        g = (rng.standard_normal(n).astype(np.float32) + 0.3) * scale
        m = np.float32(0.9) * m + np.float32(0.1) * g
        v = np.float32(0.999) * v + np.float32(0.001) * g * g
    entry = dtype_registry.get(dtype)
    m_c, v_c = entry.from_float32(m), entry.from_float32(v)
    m_c[entry.to_float32(v_c) == 0] = entry.from_float32(np.float32(0.0))
    return m_c.reshape(shape), v_c.reshape(shape), steps


def state(m: np.ndarray, v: np.ndarray, step: int, dtype: str,
          **more: tuple[np.ndarray, str]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    arrays = {M_PATH: m, V_PATH: v, STEP_PATH: np.array(step, np.float32), **{p: a for p, (a, _) in more.items()}}
    dtypes = {M_PATH: dtype, V_PATH: dtype, STEP_PATH: "F32", **{p: d for p, (_, d) in more.items()}}
    return arrays, dtypes


def floats(carried: np.ndarray, dtype: str) -> np.ndarray:
    return dtype_registry.get(dtype).to_float32(carried)


def bits(a: np.ndarray) -> np.ndarray:
    """The raw bit patterns of an array (so NaN compares equal to the same NaN)."""
    a = np.ascontiguousarray(a)
    return a.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def non_finite(dtype: str) -> st.SearchStrategy[int]:
    """Bit patterns of +-Inf and of NaNs with any sign and payload (quiet or signalling) in ``dtype``."""
    width, mantissa = {"F32": (32, 23), "F16": (16, 10), "BF16": (16, 7)}[dtype]
    exponent = ((1 << (width - 1 - mantissa)) - 1) << mantissa
    sign = 1 << (width - 1)
    return st.builds(lambda negative, payload: (sign if negative else 0) | exponent | payload,
                     st.booleans(), st.one_of(st.just(0), st.just(1 << (mantissa - 1)),
                                              st.integers(1, (1 << mantissa) - 1)))


moments_cases = st.builds(
    lambda seed, shape, dtype, steps, dead, octaves: (adam_moments(seed, shape, dtype, steps=steps, dead=dead,
                                                                   octaves=octaves), dtype),
    seed=st.integers(0, 2**32 - 1), shape=st.sampled_from(SHAPES), dtype=st.sampled_from(DTYPES),
    steps=st.integers(1, 40), dead=st.sampled_from([0.0, 0.1, 0.5]), octaves=st.floats(0.0, 12.0))
policies = st.sampled_from([LOOSE, MomentPolicy(min_numel=256), MomentPolicy(exp_avg_bins=3, exp_avg_sq_bins=2,
                                                                             prune=0.9, min_numel=256)])


# -- what is stored -------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(case=moments_cases, policy=policies)
def test_stored_v_stays_positive_where_it_was_and_zero_where_it_was(case: Any, policy: MomentPolicy) -> None:
    (m, v, step), dtype = case
    arrays, dtypes = state(m, v, step, dtype)
    plans = policy.plan(arrays, dtypes, {})
    assert set(plans) <= {M_PATH, V_PATH} and (M_PATH in plans) == (V_PATH in plans)
    if V_PATH not in plans:
        assert plans.record.tensors[PREFIX].storage == "lossless"
        return
    v_in, v_q = floats(v, dtype), floats(plans[V_PATH].values, dtype)
    m_q = floats(plans[M_PATH].values, dtype)
    assert plans[V_PATH].values.dtype == v.dtype and plans[V_PATH].values.shape == v.shape
    assert (v_q >= 0).all()
    assert (v_q[v_in > 0] > 0).all(), "a positive v stored as 0 would blow up its update"
    assert (v_q[v_in == 0] == 0).all()
    assert not ((v_q == 0) & (m_q != 0)).any(), "stored v == 0 under a kept m"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=moments_cases, data=st.data())
def test_nan_and_inf_survive_exactly_and_the_repo_returns_the_plan_values(memory_url: str, case: Any,
                                                                          data: st.DataObject) -> None:
    (m, v, step), dtype = case
    m, v = m.copy(), v.copy()
    n = m.size
    specials = {}
    for name, target in (("m", m), ("v", v)):
        spots = data.draw(st.lists(st.tuples(st.integers(0, n - 1), non_finite(dtype)), max_size=6,
                                   unique_by=lambda t: t[0]), label=f"{name} specials")
        for i, pattern in spots:
            bits(target).reshape(-1)[i] = pattern
        specials[name] = [i for i, _ in spots]
    arrays, dtypes = state(m, v, step, dtype)
    plans = LOOSE.plan(arrays, dtypes, {})
    if M_PATH not in plans:
        assert plans.record.tensors[PREFIX].storage == "lossless"
    for path, original, where in ((M_PATH, m, specials["m"]), (V_PATH, v, specials["v"])):
        if path not in plans:
            continue
        stored = plans[path].values.reshape(-1)
        np.testing.assert_array_equal(bits(stored[where]), bits(original.reshape(-1)[where]))
        assert np.isfinite(floats(stored, dtype)).sum() == np.isfinite(floats(original, dtype)).sum()
    repo = ins.open(memory_url, create=True)
    info = repo.save(arrays, dtypes=dtypes, quantize=plans)
    reader = repo.checkout(info.id)
    for path in arrays:
        expected = plans[path].values if path in plans else arrays[path]
        got = reader.read(path)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        np.testing.assert_array_equal(bits(got), bits(expected))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_negative_zero_v_is_planned_as_the_store_will_read_it(memory_url: str, dtype: str) -> None:
    m, v, step = adam_moments(3, (64, 64), dtype, dead=0.2)
    v = v.copy()
    zeros = floats(v, dtype) == 0
    v[zeros] = dtype_registry.get(dtype).from_float32(np.float32(-0.0))  # -0.0 == 0: still "v == 0"
    arrays, dtypes = state(m, v, step, dtype)
    plans = LOOSE.plan(arrays, dtypes, {})
    assert V_PATH in plans
    repo = ins.open(memory_url, create=True)
    got = repo.checkout(repo.save(arrays, dtypes=dtypes, quantize=plans).id).read(V_PATH)
    np.testing.assert_array_equal(bits(got), bits(plans[V_PATH].values))


@pytest.mark.parametrize("dtype", DTYPES)
def test_typical_moments_are_quantized_by_the_default_policy_and_read_back_exactly(memory_url: str,
                                                                                   dtype: str) -> None:
    m, v, step = adam_moments(3, (64, 128), dtype, steps=20)
    arrays, dtypes = state(m, v, step, dtype)
    plans = MomentPolicy().plan(arrays, dtypes, {})
    record = plans.record.tensors[PREFIX]
    assert record.storage == "quantized" and set(plans) == {M_PATH, V_PATH}
    assert plans[M_PATH].values.dtype == m.dtype
    assert len(plans[M_PATH].serializer.codebook) <= 16 + 1
    repo = ins.open(memory_url, create=True)
    reader = repo.checkout(repo.save(arrays, dtypes=dtypes, quantize=plans).id)
    for path in (M_PATH, V_PATH):
        np.testing.assert_array_equal(bits(reader.read(path)), bits(plans[path].values))
    np.testing.assert_array_equal(reader.read(STEP_PATH), arrays[STEP_PATH])


# -- what is left alone -----------------------------------------------------------------------

@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), dtype=st.sampled_from(DTYPES))
def test_only_moment_pairs_under_optimizer_are_planned(seed: int, dtype: str) -> None:
    m, v, step = adam_moments(seed, (64, 64), dtype)
    rng = np.random.default_rng(seed)
    big = rng.standard_normal((64, 64)).astype(np.float32)
    arrays, dtypes = state(m, v, step, dtype, **{
        f"{PREFIX}/max_exp_avg_sq": (v, dtype),  # amsgrad's: not one of the pair
        f"{PREFIX}/momentum_buffer": (big, "F32"),
        "optimizer/state/1/exp_avg": (big, "F32"),  # no exp_avg_sq beside it
        "optimizer/state/2/exp_avg": (big, "F32"),
        "optimizer/state/2/exp_avg_sq": (big[:32] ** 2, "F32"),  # another shape
        "optimizer/state/3/exp_avg": (big, "F32"),
        "optimizer/state/3/exp_avg_sq": (dtype_registry.get("F16").from_float32(big ** 2), "F16"),  # mixed dtypes
        "optimizer/state/4/exp_avg": ((big * 100).astype(np.int32), "I32"),  # not a float
        "optimizer/state/4/exp_avg_sq": ((big * 100).astype(np.int32) ** 2, "I32"),
        "model/state/0/exp_avg": (big, "F32"),  # moment-shaped names under model/
        "model/state/0/exp_avg_sq": (big ** 2, "F32"),
        "model/w": (big, "F32"),
        "exp_avg": (big, "F32"),
    })
    before = {p: a.copy() for p, a in arrays.items()}
    plans = MomentPolicy().plan(arrays, dtypes, {})
    assert set(plans) <= {M_PATH, V_PATH}
    assert set(plans.record.tensors) == {PREFIX}
    for path, array in arrays.items():
        np.testing.assert_array_equal(bits(array), bits(before[path]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_pairs_under_min_numel_stay_lossless_with_a_reason(dtype: str) -> None:
    m, v, step = adam_moments(1, (63, 64), dtype)
    big_m, big_v, _ = adam_moments(2, (64, 64), dtype)
    arrays, dtypes = state(m, v, step, dtype, **{"optimizer/state/1/exp_avg": (big_m, dtype),
                                                 "optimizer/state/1/exp_avg_sq": (big_v, dtype)})
    plans = MomentPolicy(min_numel=4096).plan(arrays, dtypes, {})
    small = plans.record.tensors[PREFIX]
    assert small.storage == "lossless" and small.reason is not None and "4096" in small.reason
    assert M_PATH not in plans and V_PATH not in plans
    assert plans.record.tensors["optimizer/state/1"].storage == "quantized"
    assert set(plans) == {"optimizer/state/1/exp_avg", "optimizer/state/1/exp_avg_sq"}
    assert MomentPolicy(min_numel=63 * 64).plan(arrays, dtypes, {}).record.tensors[PREFIX].storage == "quantized"


def test_state_that_is_not_adam_shaped_is_skipped_and_says_why() -> None:
    buf = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    arrays = {"optimizer/state/0/momentum_buffer": buf, "model/w": buf}
    plans = MomentPolicy().plan(arrays, dict.fromkeys(arrays, "F32"), {})
    assert len(plans) == 0 and plans.record.tensors == {}
    assert plans.record.skipped is not None
    assert "momentum_buffer" in plans.record.skipped and "not Adam-shaped" in plans.record.skipped
    assert MomentRecord.from_dict(json.loads(json.dumps(plans.record.to_dict()))) == plans.record
    nothing = MomentPolicy().plan({"model/w": buf}, {"model/w": "F32"}, {})
    assert len(nothing) == 0 and nothing.record.skipped is None


# -- the guard --------------------------------------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(case=moments_cases, policy=policies, betas=st.sampled_from([(0.9, 0.999), (0.8, 0.99), (0.95, 0.95)]),
       eps=st.sampled_from([1e-8, 1e-6, 1e-3]))
def test_recorded_guard_figures_are_the_stored_update_and_within_bounds(case: Any, policy: MomentPolicy,
                                                                       betas: tuple[float, float],
                                                                       eps: float) -> None:
    (m, v, step), dtype = case
    arrays, dtypes = state(m, v, step, dtype)
    plans = policy.plan(arrays, dtypes, {}, hyper={PREFIX: AdamHyper(*betas, eps)})
    record = plans.record.tensors[PREFIX]
    if record.storage == "lossless":
        assert not plans and record.reason
        return
    h = AdamHyper(*betas, eps, float(step))
    exact = update(floats(m, dtype), floats(v, dtype), h)
    stored = update(floats(plans[M_PATH].values, dtype), floats(plans[V_PATH].values, dtype), h)
    cosine, error = compare(exact, stored)
    assert record.update_cosine == pytest.approx(cosine, abs=1e-6)
    assert record.update_rel_error == pytest.approx(error, abs=1e-6)
    assert record.update_cosine >= policy.min_update_cosine
    assert record.update_rel_error <= policy.max_update_error
    assert 1 <= record.attempts <= len(policy.attempts())
    assert record.exp_avg_levels == len(plans[M_PATH].serializer.codebook)
    assert record.exp_avg_sq_levels == len(plans[V_PATH].serializer.codebook)
    # pruned entries are stored as 0, and at least the attempt's fraction of the finite updates is pruned
    prune = policy.attempts()[record.attempts - 1][0]
    assert record.pruned_fraction is not None
    assert record.pruned_fraction <= float((floats(plans[M_PATH].values, dtype) == 0).mean()) + 1e-6
    # the fraction of non-zero m entries the pruning set to 0 (entries already 0 do not count)
    already_zero = int((m == 0).sum())
    assert record.pruned_fraction >= (int(prune * int(np.isfinite(exact).sum())) - already_zero) / m.size - 1e-6
    attributes = plans[M_PATH].attributes
    assert attributes["update_cosine"] == record.update_cosine and attributes["moment"] == "exp_avg"


@settings(max_examples=15, deadline=None)
@given(case=moments_cases)
def test_an_impossible_guard_keeps_every_pair_lossless_with_a_reason(case: Any) -> None:
    (m, v, step), dtype = case
    entry = dtype_registry.get(dtype)
    noise = np.random.default_rng(0).standard_normal(m.shape).astype(np.float32)
    m = entry.from_float32(floats(m, dtype) + noise)  # noisy, so no codebook reproduces it
    v = entry.from_float32(floats(v, dtype) + noise ** 2 + 1e-3)
    arrays, dtypes = state(m, v, step, dtype, **{"optimizer/state/1/exp_avg": (m[::-1].copy(), dtype),
                                                 "optimizer/state/1/exp_avg_sq": (v[::-1].copy(), dtype)})
    policy = MomentPolicy(min_update_cosine=1.0, max_update_error=0.0, min_numel=256)
    plans = policy.plan(arrays, dtypes, {})
    assert len(plans) == 0
    assert set(plans.record.tensors) == {PREFIX, "optimizer/state/1"}
    for record in plans.record.tensors.values():
        assert record.storage == "lossless" and record.reason and "drifted" in record.reason
        assert record.attempts == len(policy.attempts())


@settings(max_examples=20, deadline=None)
@given(case=moments_cases)
def test_a_stricter_guard_never_needs_fewer_attempts(case: Any) -> None:
    (m, v, step), dtype = case
    arrays, dtypes = state(m, v, step, dtype)
    ladder = [(0.5, 1.0), (0.9, 0.5), (0.95, 0.3), (0.99, 0.15), (0.999, 0.05)]
    attempts = []
    for cosine, error in ladder:
        record = MomentPolicy(min_update_cosine=cosine, max_update_error=error, min_numel=256).plan(
            arrays, dtypes, {}).record.tensors[PREFIX]
        attempts.append(record.attempts if record.storage == "quantized" else math.inf)
    assert attempts == sorted(attempts)


@pytest.mark.parametrize("dtype", DTYPES)
def test_moments_of_pruned_weights_are_kept_when_pruning_them_drifts(dtype: str) -> None:
    m, v, step = adam_moments(5, (64, 64), dtype, steps=20)
    arrays, dtypes = state(m, v, step, dtype)
    everywhere = {"model/w": ArrayPlan(np.zeros((64, 64), np.float32), None)}
    plans = MomentPolicy().plan(arrays, dtypes, {}, weights=everywhere, params={PREFIX: "model/w"})
    record = plans.record.tensors[PREFIX]
    assert record.storage == "quantized" and record.attempts > 1
    assert record.pruned_fraction is not None and record.pruned_fraction < 0.5
    assert (floats(plans[M_PATH].values, dtype) != 0).any()
    alone = MomentPolicy().plan(arrays, dtypes, {}).record.tensors[PREFIX]
    assert alone.attempts == 1, "without pruned weights the first attempt passes"
    # half the weights pruned: the first attempt drops their moments and may still pass
    half = np.zeros((64, 64), np.float32)
    half[:, ::2] = 1.0
    joint = MomentPolicy(min_update_cosine=-1.0, max_update_error=10.0).plan(
        arrays, dtypes, {}, weights={"model/w": ArrayPlan(half, None)}, params={PREFIX: "model/w"})
    assert joint.record.tensors[PREFIX].attempts == 1
    assert (floats(joint[M_PATH].values, dtype)[:, 1::2] == 0).all()


# -- ExCP's joint pruning of v ------------------------------------------------------------------

#: the ExCP setting with a guard loose enough that its first (joint) attempt often passes
LOOSE_EXCP = dataclasses.replace(MomentPolicy.excp(), min_update_cosine=0.3, max_update_error=1.5, min_numel=256)
W_PATH = "model/w"


def weight_plan(mask: np.ndarray, closed_loop: bool, seed: int = 0) -> ArrayPlan:
    """A weight plan that dropped the update at ``mask``: stored as 0 there (``pruned`` unset),
    or a closed-loop residual's (values never 0, the drop in ``pruned``)."""
    values = np.random.default_rng(seed).uniform(0.5, 1.5, mask.shape).astype(np.float32)
    if closed_loop:
        return ArrayPlan(values, None, pruned=mask.copy())
    values[mask] = 0.0
    return ArrayPlan(values, None)


def joint_plans(policy: MomentPolicy, m: np.ndarray, v: np.ndarray, step: int, dtype: str,
                plan: ArrayPlan) -> MomentPlans:
    arrays, dtypes = state(m, v, step, dtype)
    return policy.plan(arrays, dtypes, {}, weights={W_PATH: plan}, params={PREFIX: W_PATH})


def finite_mean(v: np.ndarray) -> float:
    return float(v[np.isfinite(v)].astype(np.float64).mean())


@settings(max_examples=40, deadline=None)
@given(case=moments_cases, pruned=st.sampled_from([0.05, 0.3, 0.8, 1.0]), closed_loop=st.booleans(),
       beta=st.sampled_from([0.5, 2.0, 1e3]), seed=st.integers(0, 2**16))
def test_v_is_pruned_only_with_its_m_where_the_weight_was_and_v_is_below_beta_mean(
        case: Any, pruned: float, closed_loop: bool, beta: float, seed: int) -> None:
    (m, v, step), dtype = case
    mask = np.random.default_rng(seed).random(m.shape) < pruned
    policy = dataclasses.replace(LOOSE_EXCP, joint_v_beta=beta)
    plans = joint_plans(policy, m, v, step, dtype, weight_plan(mask, closed_loop, seed))
    record = plans.record.tensors[PREFIX]
    if record.storage == "lossless":
        assert V_PATH not in plans and record.exp_avg_sq_pruned_fraction is None
        return
    m_in, v_in = floats(m, dtype), floats(v, dtype)
    m_q, v_q = floats(plans[M_PATH].values, dtype), floats(plans[V_PATH].values, dtype)
    v_pruned = (v_in > 0) & (v_q == 0)
    threshold = beta * finite_mean(v_in)
    assert not ((v_q == 0) & (m_q != 0)).any(), "stored v == 0 under a kept m"
    assert (m_q[v_pruned] == 0).all() and mask[v_pruned].all()
    assert (v_in[v_pruned].astype(np.float64) < threshold * (1 + 1e-9)).all()
    assert record.exp_avg_sq_pruned_fraction == pytest.approx(float(v_pruned.mean()), abs=1e-6)
    assert plans[V_PATH].attributes["pruned_fraction"] == record.exp_avg_sq_pruned_fraction
    if record.attempts > 1:  # the ladder gave up joint pruning: every positive v stays positive
        assert not v_pruned.any()
        return
    # the first attempt prunes exactly ExCP's mask (entries within rounding of the threshold either way)
    want = mask & np.isfinite(m_in) & (v_in > 0) & (v_in.astype(np.float64) < threshold)
    edge = np.abs(v_in.astype(np.float64) - threshold) <= 1e-9 * threshold
    np.testing.assert_array_equal(v_pruned[~edge], want[~edge])


@pytest.mark.parametrize("dtype", DTYPES)
def test_joint_v_pruning_happens_and_survivors_are_quantized_as_before(dtype: str) -> None:
    m, v, step = adam_moments(7, (64, 64), dtype, steps=20)
    mask = np.zeros((64, 64), bool)
    mask[:, ::4] = True
    plans = joint_plans(LOOSE_EXCP, m, v, step, dtype, weight_plan(mask, closed_loop=False))
    record = plans.record.tensors[PREFIX]
    assert record.storage == "quantized" and record.attempts == 1
    assert record.exp_avg_sq_pruned_fraction is not None and record.exp_avg_sq_pruned_fraction > 0.05
    v_in, v_q = floats(v, dtype), floats(plans[V_PATH].values, dtype)
    kept = (v_in > 0) & (v_q > 0)
    assert kept.any() and np.unique(v_q[kept]).size <= LOOSE_EXCP.exp_avg_sq_bins
    assert plans.record.to_dict()["version"] == 2
    off = joint_plans(dataclasses.replace(LOOSE_EXCP, joint_v_beta=None), m, v, step, dtype,
                      weight_plan(mask, closed_loop=False))
    assert off.record.tensors[PREFIX].exp_avg_sq_pruned_fraction is None
    assert (floats(off[V_PATH].values, dtype)[v_in > 0] > 0).all(), "no joint_v_beta: v is never pruned"


@settings(max_examples=15, deadline=None)
@given(case=moments_cases, seed=st.integers(0, 2**16))
def test_a_pruned_mask_is_preferred_to_zero_values_and_means_the_same(case: Any, seed: int) -> None:
    """Closed-loop residual plans say where the update was dropped in ``pruned``; a plan
    that stores the weight as 0 there gives the same moments, bit for bit; a ``pruned`` of
    another shape is ignored (``values == 0`` then)."""
    (m, v, step), dtype = case
    mask = np.random.default_rng(seed).random(m.shape) < 0.5
    zeros = joint_plans(LOOSE_EXCP, m, v, step, dtype, weight_plan(mask, closed_loop=False, seed=seed))
    closed = joint_plans(LOOSE_EXCP, m, v, step, dtype, weight_plan(mask, closed_loop=True, seed=seed))
    stored_zero = weight_plan(mask, closed_loop=False, seed=seed).values
    odd = joint_plans(LOOSE_EXCP, m, v, step, dtype, ArrayPlan(stored_zero, None, pruned=mask.reshape(-1)[:-1]))
    nothing = joint_plans(LOOSE_EXCP, m, v, step, dtype, weight_plan(np.zeros(m.shape, bool), closed_loop=True))
    for other in (closed, odd):
        assert other.record == zeros.record and set(other) == set(zeros)
        for path in zeros:
            np.testing.assert_array_equal(bits(other[path].values), bits(zeros[path].values))
    if mask.any() and zeros.record.tensors[PREFIX].attempts == 1:
        assert nothing.record != zeros.record, "a closed-loop plan's pruned mask was not used"


@settings(max_examples=15, deadline=None)
@given(case=moments_cases, closed_loop=st.booleans(), seed=st.integers(0, 2**16))
def test_joint_v_pruning_is_deterministic_and_leaves_the_input_alone(case: Any, closed_loop: bool,
                                                                    seed: int) -> None:
    (m, v, step), dtype = case
    mask = np.random.default_rng(seed).random(m.shape) < 0.4
    plan = weight_plan(mask, closed_loop, seed)
    before = (m.copy(), v.copy(), plan.values.copy(), mask.copy())
    first, second = (joint_plans(LOOSE_EXCP, m, v, step, dtype, plan) for _ in range(2))
    assert set(first) == set(second) and first.record == second.record
    for path in first:
        np.testing.assert_array_equal(bits(first[path].values), bits(second[path].values))
        assert first[path].serializer.to_dict() == second[path].serializer.to_dict()
        assert first[path].attributes == second[path].attributes
    for was, now in zip(before, (m, v, plan.values, mask), strict=True):
        np.testing.assert_array_equal(was, now)
    assert plan.pruned is None or np.array_equal(plan.pruned, mask)


@settings(max_examples=20, deadline=None)
@given(case=moments_cases)
def test_the_guard_still_rejects_joint_v_pruning_that_drifts_per_tensor(case: Any) -> None:
    """Every weight's update dropped and a beta so large that every v is below it: the joint
    attempt zeroes the whole update (cosine 0), so the guard moves that pair down the
    ladder, which gives up the joint pruning and with it every pruned v; a pair beside it
    without a weight is decided on its own."""
    (m, v, step), dtype = case
    exact = update(floats(m, dtype), floats(v, dtype), AdamHyper(step=float(step)))
    assume(bool((np.isfinite(exact) & (exact != 0)).any()))
    other = "optimizer/state/1"
    arrays, dtypes = state(m, v, step, dtype, **{f"{other}/exp_avg": (m, dtype), f"{other}/exp_avg_sq": (v, dtype),
                                                 f"{other}/step": (np.array(step, np.float32), "F32")})
    policy = dataclasses.replace(MomentPolicy.excp(), joint_v_beta=1e30, min_numel=256)
    everywhere = weight_plan(np.ones(m.shape, bool), closed_loop=True)
    plans = policy.plan(arrays, dtypes, {}, weights={W_PATH: everywhere}, params={PREFIX: W_PATH})
    record, beside = plans.record.tensors[PREFIX], plans.record.tensors[other]
    assert record.attempts > 1
    if record.storage == "quantized":
        assert record.exp_avg_sq_pruned_fraction == 0.0 and record.update_cosine is not None
        assert record.update_cosine >= policy.min_update_cosine
        v_in = floats(v, dtype)
        assert (floats(plans[V_PATH].values, dtype)[v_in > 0] > 0).all()
    # the pair without a weight has no joint attempt to make: its first is the other's second
    assert beside.storage == record.storage
    assert beside.attempts == (1 if record.attempts == 2 else record.attempts)
    for key in ("exp_avg", "exp_avg_sq"):
        assert (f"{PREFIX}/{key}" in plans) == (f"{other}/{key}" in plans)
        if f"{PREFIX}/{key}" in plans:
            np.testing.assert_array_equal(bits(plans[f"{PREFIX}/{key}"].values), bits(plans[f"{other}/{key}"].values))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_parents_v_codebook_is_reused_while_it_still_fits(dtype: str) -> None:
    m, v, step = adam_moments(6, (64, 64), dtype, steps=20)
    arrays, dtypes = state(m, v, step, dtype)
    first = LOOSE.plan(arrays, dtypes, {})
    parent = {V_PATH: {"codec": first[V_PATH].serializer.to_dict()["configuration"]}}
    codebook = np.asarray(first[V_PATH].serializer.codebook)
    entry = dtype_registry.get(dtype)

    def v_codebook(scale: float, previous: Any) -> np.ndarray:
        moved = entry.from_float32(floats(v, dtype) * np.float32(scale))
        plans = LOOSE.plan({**arrays, V_PATH: moved}, dtypes, previous)
        return np.asarray(plans[V_PATH].serializer.codebook)

    np.testing.assert_array_equal(v_codebook(1.01, parent), codebook)  # v moved a little: same centres
    far = v_codebook(2.0 ** 12, parent)  # v moved 12 octaves: a fresh fit
    assert not np.array_equal(far, codebook)
    np.testing.assert_array_equal(far, v_codebook(2.0 ** 12, {}))
    for junk in ("levels", [[1.0, 2.0], [3.0]], None, [-1.0, math.nan], list(range(1, 100))):
        got = v_codebook(1.01, {V_PATH: {"codec": {"codebook": junk}}})
        np.testing.assert_array_equal(got, v_codebook(1.01, {}))


# -- determinism and purity -----------------------------------------------------------------

@settings(max_examples=15, deadline=None)
@given(case=moments_cases)
def test_same_input_gives_the_same_plans_and_leaves_the_input_alone(case: Any) -> None:
    (m, v, step), dtype = case
    arrays, dtypes = state(m, v, step, dtype)
    before = {p: a.copy() for p, a in arrays.items()}
    first, second = (LOOSE.plan(arrays, dtypes, {}) for _ in range(2))
    assert set(first) == set(second)
    for path in first:
        np.testing.assert_array_equal(bits(first[path].values), bits(second[path].values))
        assert first[path].serializer.to_dict() == second[path].serializer.to_dict()
        assert first[path].attributes == second[path].attributes
    assert first.record == second.record
    for path, array in arrays.items():
        np.testing.assert_array_equal(bits(array), bits(before[path]))
        assert first.get(path) is None or first[path].values is not array


def test_moment_plans_are_written_as_made_without_planning_again() -> None:
    m, v, step = adam_moments(0, (64, 64), "F32")
    arrays, dtypes = state(m, v, step, "F32")
    plans = MomentPolicy().plan(arrays, dtypes, {})
    assert isinstance(plans, MomentPlans)
    assert not hasattr(plans, "plan")  # plans, not a planner: the writer never calls back up
    repo = ins.open("memory://moment-plans-as-made", create=True)
    reader = repo.checkout(repo.save(arrays, dtypes=dtypes, quantize=plans).id)
    for path, plan in plans.items():
        np.testing.assert_array_equal(reader.read(path), plan.values)


# -- configuration and record -----------------------------------------------------------------

#: the fields every MomentPolicy dict has had since version 1 of the moments record
OLD_FIELDS = {"exp_avg_bins", "exp_avg_sq_bins", "prune", "min_update_cosine", "max_update_error", "min_numel"}
old_policies = st.builds(
    MomentPolicy, exp_avg_bins=st.integers(3, 63), exp_avg_sq_bins=st.integers(2, 63),
    prune=st.one_of(st.floats(0.0, 0.95), st.just(0)), min_update_cosine=st.floats(-1.0, 1.0),
    max_update_error=st.floats(0.0, 1e6), min_numel=st.integers(1, 10**9))
positive = st.one_of(st.floats(1e-12, 1e6), st.integers(1, 100))
valid_policies = st.builds(
    lambda old, beta, alpha, loop: MomentPolicy(**{**old.to_dict(), "joint_v_beta": beta, "residual_alpha": alpha,
                                                   "closed_loop": loop}),
    old_policies, st.one_of(st.none(), positive), st.one_of(st.none(), positive), st.booleans())


@settings(max_examples=100, deadline=None)
@given(policy=valid_policies)
def test_policy_dict_round_trips_through_json(policy: MomentPolicy) -> None:
    data = json.loads(json.dumps(policy.to_dict()))
    assert MomentPolicy.from_dict(data) == policy
    unset = {k for k in ("joint_v_beta", "residual_alpha") if getattr(policy, k) is None}
    unset |= set() if policy.closed_loop else {"closed_loop"}  # written only when on (opt-in)
    assert set(data) == set(MomentPolicy.__dataclass_fields__) - unset
    for prune, m_levels, v_levels, _ in policy.attempts():
        assert 0 <= prune <= policy.prune and m_levels <= 255 and v_levels <= 255


@settings(max_examples=60, deadline=None)
@given(policy=old_policies)
def test_an_old_policy_dict_reads_as_it_did_and_is_written_back_unchanged(policy: MomentPolicy) -> None:
    """A dict with only the version-1 fields (what every earlier version wrote) reads as a
    policy without the ExCP fields, and such a policy writes exactly that dict again, so an
    older inshrink-store still reads what this one writes by default."""
    old = {k: v for k, v in policy.to_dict().items() if k in OLD_FIELDS}
    read = MomentPolicy.from_dict(json.loads(json.dumps(old)))
    assert read.joint_v_beta is None and read.residual_alpha is None
    assert read.to_dict() == old and set(read.to_dict()) == OLD_FIELDS


def test_the_default_policy_dict_is_the_one_version_1_wrote() -> None:
    assert MomentPolicy().to_dict() == {"exp_avg_bins": 16, "exp_avg_sq_bins": 16, "prune": 0.3,
                                        "min_update_cosine": 0.95, "max_update_error": 0.3, "min_numel": 1024}


def test_the_excp_setting_is_the_published_one() -> None:
    excp = MomentPolicy.excp()
    assert excp.residual_alpha == 5e-5 and excp.joint_v_beta == 2.0 and excp.prune == 0.0
    assert excp.exp_avg_bins == 16 and excp.exp_avg_sq_bins == 15  # 4-bit codes, 0 included
    assert (excp.min_update_cosine, excp.max_update_error) == (MomentPolicy().min_update_cosine,
                                                               MomentPolicy().max_update_error)
    assert MomentPolicy.from_dict(json.loads(json.dumps(excp.to_dict()))) == excp == MomentPolicy.excp()
    assert excp.attempts()[0][3] and not any(joint for *_, joint in excp.attempts()[1:])


INVALID = [
    ("exp_avg_bins", 2), ("exp_avg_bins", 64), ("exp_avg_bins", True), ("exp_avg_bins", 16.0), ("exp_avg_bins", "16"),
    ("exp_avg_sq_bins", 1), ("exp_avg_sq_bins", 64), ("exp_avg_sq_bins", False), ("exp_avg_sq_bins", None),
    ("prune", 0.96), ("prune", -0.1), ("prune", math.nan), ("prune", True), ("prune", "0.3"),
    ("min_update_cosine", 1.5), ("min_update_cosine", -1.01), ("min_update_cosine", math.nan),
    ("min_update_cosine", True),
    ("max_update_error", -0.1), ("max_update_error", math.inf), ("max_update_error", math.nan),
    ("max_update_error", False),
    ("min_numel", 0), ("min_numel", True), ("min_numel", 4096.0), ("min_numel", -1),
    ("joint_v_beta", 0), ("joint_v_beta", 0.0), ("joint_v_beta", -2.0), ("joint_v_beta", math.inf),
    ("joint_v_beta", math.nan), ("joint_v_beta", True), ("joint_v_beta", "2.0"), ("joint_v_beta", [2.0]),
    ("residual_alpha", 0.0), ("residual_alpha", -5e-5), ("residual_alpha", math.inf), ("residual_alpha", math.nan),
    ("residual_alpha", False), ("residual_alpha", "5e-5"),
]


@pytest.mark.parametrize(("name", "value"), INVALID)
def test_an_invalid_policy_field_is_a_format_error_naming_it(name: str, value: Any) -> None:
    with pytest.raises(FormatError, match=rf"\b{name}\b"):
        MomentPolicy(**{name: value})
    with pytest.raises(FormatError, match=rf"\b{name}\b"):
        MomentPolicy.from_dict({**MomentPolicy().to_dict(), name: value})


@settings(max_examples=50, deadline=None)
@given(name=st.sampled_from(["exp_avg_bins", "exp_avg_sq_bins"]),
       value=st.one_of(st.integers(max_value=1), st.integers(min_value=64)))
def test_bins_out_of_range_are_refused(name: str, value: int) -> None:
    if name == "exp_avg_sq_bins" and value == 2:
        return
    with pytest.raises(FormatError, match=name):
        MomentPolicy(**{name: value})


@pytest.mark.parametrize("data", [{"bins": 4}, {**MomentPolicy().to_dict(), "prune_metric": "magnitude"}])
def test_unknown_policy_keys_are_a_format_error_naming_them(data: dict[str, Any]) -> None:
    unknown = next(k for k in data if k not in MomentPolicy.__dataclass_fields__)
    with pytest.raises(FormatError, match=unknown):
        MomentPolicy.from_dict(data)


@pytest.mark.parametrize("data", [None, [], "policy", 3])
def test_a_policy_that_is_not_a_dict_is_a_format_error(data: Any) -> None:
    with pytest.raises(FormatError):
        MomentPolicy.from_dict(data)


small = st.one_of(st.none(), st.floats(-1.0, 1.0))
tensor_records = st.builds(
    MomentTensorRecord, storage=st.sampled_from(["quantized", "lossless"]), update_cosine=small,
    update_rel_error=st.one_of(st.none(), st.floats(0.0, 10.0)),
    exp_avg_levels=st.one_of(st.none(), st.integers(1, 255)), exp_avg_sq_levels=st.one_of(st.none(), st.integers(1, 255)),
    pruned_fraction=st.one_of(st.none(), st.floats(0.0, 1.0)), attempts=st.integers(0, 4),
    reason=st.one_of(st.none(), st.text(max_size=30)),
    exp_avg_sq_pruned_fraction=st.one_of(st.none(), st.floats(0.0, 1.0)),
    exp_avg_coding=st.one_of(st.none(), st.sampled_from(["keyframe", "residual", "unchanged"])),
    exp_avg_sq_kept_fraction=st.one_of(st.none(), st.floats(0.0, 1.0)),
    residual_attempts=st.one_of(st.none(), st.integers(0, 20)))
moment_records = st.builds(
    MomentRecord, policy=st.one_of(st.none(), valid_policies),
    tensors=st.dictionaries(st.integers(0, 99).map(lambda i: f"optimizer/state/{i}"), tensor_records, max_size=4),
    skipped=st.one_of(st.none(), st.text(max_size=30)))


@settings(max_examples=100, deadline=None)
@given(record=moment_records)
def test_record_dict_round_trips_through_json(record: MomentRecord) -> None:
    data = json.loads(json.dumps(record.to_dict()))
    excp = (record.policy is not None and (record.policy.joint_v_beta, record.policy.residual_alpha) != (None, None)
            or any(t.exp_avg_sq_pruned_fraction is not None for t in record.tensors.values()))
    loop = (record.policy is not None and record.policy.closed_loop) or any(
        (t.exp_avg_coding, t.exp_avg_sq_kept_fraction, t.residual_attempts) != (None, None, None)
        for t in record.tensors.values())
    assert data["version"] == (3 if loop else 2 if excp else 1), \
        "version 1 unless the record needs 2 or 3: older readers read it"
    assert MomentRecord.from_dict(data) == record
    summary = record.summary()
    assert summary["quantized"] + summary["lossless"] == len(record.tensors)


#: a record as version 1 wrote it (a Checkpointer's, before the ExCP fields)
OLD_RECORD = {"version": 1, "policy": {"exp_avg_bins": 16, "exp_avg_sq_bins": 16, "prune": 0.3,
                                       "min_update_cosine": 0.95, "max_update_error": 0.3, "min_numel": 4096},
              "tensors": {PREFIX: {"storage": "quantized", "update_cosine": 0.98, "update_rel_error": 0.12,
                                   "exp_avg_levels": 16, "exp_avg_sq_levels": 16, "pruned_fraction": 0.3,
                                   "attempts": 1},
                          "optimizer/state/1": {"storage": "lossless", "attempts": 0,
                                                "reason": "fewer than 4096 elements"}},
              "skipped": None}


def test_an_old_record_reads_and_writes_back_unchanged() -> None:
    record = MomentRecord.from_dict(json.loads(json.dumps(OLD_RECORD)))
    assert record.policy == MomentPolicy(min_numel=4096)  # the default then
    assert all(t.exp_avg_sq_pruned_fraction is None for t in record.tensors.values())
    assert record.to_dict() == OLD_RECORD


GOOD_ENTRY = {"storage": "quantized", "update_cosine": 0.99, "attempts": 1}


@pytest.mark.parametrize("data", [
    None, [], "moments", {"tensors": []}, {"tensors": None},
    {"version": 4, "tensors": {}}, {"version": "1", "tensors": {}}, {"version": True, "tensors": {}},
    {"tensors": {PREFIX: None}}, {"tensors": {PREFIX: {"storage": "lossy"}}}, {"tensors": {PREFIX: {}}},
    {"tensors": {PREFIX: GOOD_ENTRY}, "policy": {"bins": 4}},
    {"tensors": {PREFIX: GOOD_ENTRY}, "policy": {"prune": 2.0}},
    {"tensors": {PREFIX: GOOD_ENTRY}, "policy": "default"},
])
def test_a_malformed_record_is_a_format_error(data: Any) -> None:
    with pytest.raises(FormatError):
        MomentRecord.from_dict(data)


@pytest.mark.parametrize("entry", [
    {"storage": "quantized", "update_cosine": "high"},
    {"storage": "quantized", "attempts": "1"},
    {"storage": "quantized", "exp_avg_levels": [16]},
    {"storage": "quantized", "exp_avg_sq_pruned_fraction": 1.5},
    {"storage": "quantized", "exp_avg_sq_pruned_fraction": -0.1},
    {"storage": "quantized", "exp_avg_sq_pruned_fraction": "0.1"},
])
def test_an_entry_with_a_field_of_the_wrong_type_is_a_format_error(entry: dict[str, Any]) -> None:
    with pytest.raises(FormatError):
        MomentRecord.from_dict({"tensors": {PREFIX: entry}})


# -- SearchPolicy's optimizer field -------------------------------------------------------------

def test_search_policy_names_its_optimizer_policies() -> None:
    assert SearchPolicy(optimizer="lossless").optimizer is None
    assert SearchPolicy(optimizer=None).optimizer is None
    assert isinstance(SearchPolicy().optimizer, MomentPolicy)
    assert SearchPolicy(optimizer="compressed").optimizer == MomentPolicy()
    custom = MomentPolicy(exp_avg_bins=8)
    assert SearchPolicy(optimizer=custom).optimizer is custom
    assert SearchPolicy.from_args(optimizer_policy="lossless").optimizer is None
    for bogus in ("bogus", "Lossless", "", 3):
        with pytest.raises(FormatError, match="optimizer"):
            SearchPolicy(optimizer=bogus)


@settings(max_examples=80, deadline=None)
@given(keys=st.lists(st.integers(-(2**40), 2**40), max_size=300), spread=st.sampled_from([1, 10, 1000, 2**30]))
def test_unique_inverse_is_numpys_unique_whatever_the_span(keys: list[int], spread: int) -> None:
    """The counting path (small spans) and the sorting one give numpy's arrays exactly."""
    from inshrink_store.policy.moment_codebooks import unique_inverse

    array = np.asarray(keys, np.int64) % spread - spread // 2
    uniq, inverse = unique_inverse(array)
    want_uniq, want_inverse = np.unique(array, return_inverse=True)
    assert np.array_equal(uniq, want_uniq) and np.array_equal(inverse, want_inverse.ravel())
    assert uniq.dtype == np.int64 and inverse.shape == (array.size,)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 3000), scale=st.sampled_from([1e-12, 1e-6, 1.0, 1e6]),
       negatives=st.floats(0, 1))
def test_importance_histogram_orders_buckets_as_the_signed_keys_sort(seed: int, n: int, scale: float,
                                                                    negatives: float) -> None:
    """Buckets are numbered densely, in the order np.unique gave the signed keys: same points,
    same weights, same order (k-means++ seeds from that order)."""
    from inshrink_store.policy.moment_codebooks import LOG_RESOLUTION, _importance_histogram

    rng = np.random.default_rng(seed)
    values = rng.standard_t(3, n) * scale
    values[rng.random(n) < negatives] *= -1
    values = values[values != 0]
    weights = rng.uniform(0, 2, values.size)
    logs = np.log2(np.abs(values))
    signed = np.sign(values).astype(np.int64) * (np.round(logs * LOG_RESOLUTION).astype(np.int64) + (1 << 20))
    uniq, inverse = np.unique(signed, return_inverse=True)
    total = np.bincount(inverse.ravel(), weights=weights, minlength=uniq.size)
    centre = np.bincount(inverse.ravel(), weights=weights * values, minlength=uniq.size)
    keep = total > 0
    points, mass = _importance_histogram(values, weights)
    assert np.array_equal(points, centre[keep] / total[keep]) and np.array_equal(mass, total[keep])


def _reference_exp_avg(m: np.ndarray, drop: np.ndarray, levels: int, importance: np.ndarray) -> np.ndarray:
    """quantize_exp_avg as first written: a histogram by sorting the kept entries' signed keys."""
    from inshrink_store.policy.kmeans import through_dtype, weighted_kmeans
    from inshrink_store.policy.moment_codebooks import LOG_RESOLUTION, _snap

    keep = ~drop & np.isfinite(m) & (m != 0) & np.isfinite(importance) & (importance > 0)
    kept, w = m[keep].astype(np.float64), importance[keep].astype(np.float64)
    if kept.size == 0:
        codebook = np.zeros(1)
    else:
        signed = np.sign(kept).astype(np.int64) * (np.round(np.log2(np.abs(kept)) * LOG_RESOLUTION).astype(np.int64)
                                                   + (1 << 20))
        uniq, inverse = np.unique(signed, return_inverse=True)
        total = np.bincount(inverse.ravel(), weights=w, minlength=uniq.size)
        centre = np.bincount(inverse.ravel(), weights=w * kept, minlength=uniq.size)
        nonempty = total > 0
        centres = weighted_kmeans(centre[nonempty] / total[nonempty], total[nonempty], levels - 1, sigma=1.0)
        codebook = np.unique(through_dtype(centres, "F32").astype(np.float64))
    if not (codebook == 0.0).any():
        codebook = np.union1d(codebook, [0.0])
    out = _snap(m, codebook)
    out[drop & np.isfinite(m)] = 0.0
    return out


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(1, 4000), levels=st.sampled_from([3, 8, 16, 32]),
       dropped=st.floats(0, 1), special=st.booleans())
def test_exp_avg_quantized_with_a_prepared_m_equals_the_sorting_original(seed: int, n: int, levels: int,
                                                                         dropped: float, special: bool) -> None:
    """Every attempt of the guard shares one prepared m: it must store exactly what the first
    implementation (sorting each attempt's kept entries) stored, attempt after attempt."""
    from inshrink_store.policy.moment_codebooks import _PreparedM, quantize_exp_avg

    rng = np.random.default_rng(seed)
    m = (rng.standard_t(3, n) * 1e-3).astype(np.float32)
    importance = rng.uniform(0, 1e6, n).astype(np.float32)
    if special:
        m[rng.random(n) < 0.1] = 0.0
        m[rng.random(n) < 0.02] = np.nan
        importance[rng.random(n) < 0.05] = 0.0
    prepared = _PreparedM.of(m, importance)
    for attempt in range(2):
        drop = rng.random(n) < dropped / (attempt + 1)
        stored, _ = quantize_exp_avg(m, drop, levels, "F32", importance, prepared)
        assert np.array_equal(stored, _reference_exp_avg(m, drop, levels, importance), equal_nan=True)
