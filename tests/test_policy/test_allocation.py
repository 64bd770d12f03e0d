"""Per-tensor allocation: pricing options, the hull, the Lagrangian climb, and saves that hit a target."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import inshrink_store as ins
from inshrink_store.errors import FormatError
from inshrink_store.policy import Allocation, AllocationPlanner, QuantConfig
from inshrink_store.policy.partition import TensorInput, quantize_tensor
from inshrink_store.policy.rate_distortion import KNEE, Option, allocate, cost, hull, tensor_options

# whole byte counts (as a real store has): sums are exact, whatever order they are added in
options = st.lists(st.builds(Option, st.one_of(st.none(), st.integers(2, 254)), st.integers(1, 10**6).map(float),
                             st.floats(0, 1)), min_size=1, max_size=8)


def _state(seed: int = 0) -> dict[str, np.ndarray]:
    """A big heavy-tailed tensor, a small Gaussian one and a bias (1-D: always lossless)."""
    rng = np.random.default_rng(seed)
    return {"model/big.weight": (rng.standard_t(4, (512, 256)) * 0.02).astype(np.float32),
            "model/small.weight": (rng.standard_normal((64, 128)) * 0.1).astype(np.float32),
            "model/big.bias": rng.standard_normal(512).astype(np.float32)}


def _ratio(repo: ins.Repository, snapshot: str, state: dict[str, np.ndarray]) -> float:
    return sum(a.nbytes for a in state.values()) / sum(repo.stored_bytes(snapshot).values())


@settings(max_examples=200, deadline=None)
@given(opts=options)
def test_hull_is_lower_convex_and_cheapest_first(opts: list[Option]) -> None:
    h = hull(opts)
    assert h and h[0].stored_bytes == min(o.stored_bytes for o in opts)
    for a, b in itertools.pairwise(h):
        assert a.stored_bytes < b.stored_bytes and cost(b) < cost(a)
    for a, b, c in zip(h, h[1:], h[2:], strict=False):  # slopes get flatter: convex
        s1 = (cost(a) - cost(b)) / (b.stored_bytes - a.stored_bytes)
        s2 = (cost(b) - cost(c)) / (c.stored_bytes - b.stored_bytes)
        assert s1 >= s2 - 1e-12 * max(1.0, s1)
    xs, ys = [p.stored_bytes for p in h], [cost(p) for p in h]
    for o in opts:  # every option lies on or above the hull (it is beaten by a mix of two)
        assert cost(o) >= float(np.interp(o.stored_bytes, xs, ys)) - 1e-9 * max(1.0, cost(o))


def test_cost_is_the_squared_error_while_small_and_more_past_the_knee() -> None:
    small, large = Option(8, 1.0, 1e-4), Option(4, 1.0, (2 * KNEE) ** 2)
    assert cost(small) == pytest.approx(small.sq_error, rel=1e-2)
    assert cost(large) == pytest.approx(5 * large.sq_error)


def _breakpoints(hulls: dict[str, list[Option]]) -> list[float]:
    """Total bytes after each step of the climb, in the order the climb takes them."""
    hulls = dict(sorted(hulls.items()))  # the climb's own order, so the sums round alike
    steps = sorted(((cost(h[i - 1]) - cost(h[i])) / max(h[i].stored_bytes - h[i - 1].stored_bytes, 1e-9), k, i)
                   for k, h in hulls.items() for i in range(1, len(h)))
    total = sum(h[0].stored_bytes for h in hulls.values())
    out = [total]
    for _, k, i in sorted(steps, key=lambda s: (-s[0], s[1], s[2])):
        total += hulls[k][i].stored_bytes - hulls[k][i - 1].stored_bytes
        out.append(total)
    return out


@settings(max_examples=150, deadline=None)
@given(tensors=st.dictionaries(st.sampled_from("abcd"), options, min_size=1, max_size=3),
       fraction=st.floats(0, 1), pick=st.integers(0, 100))
def test_allocation_spends_at_most_the_budget_and_is_optimal_at_its_breakpoints(
        tensors: dict[str, list[Option]], fraction: float, pick: int) -> None:
    hulls = {k: hull(v) for k, v in tensors.items()}
    low = sum(h[0].stored_bytes for h in hulls.values())
    high = sum(h[-1].stored_bytes for h in hulls.values())
    budget = low + fraction * (high - low)
    chosen = allocate(tensors, budget_bytes=budget)
    assert sum(o.stored_bytes for o in chosen.values()) <= budget * (1 + 1e-9)
    error = sum(cost(o) for o in chosen.values())
    everything = allocate(tensors, budget_bytes=high * (1 + 1e-9))  # room for every tensor's best
    assert all(everything[k] == h[-1] for k, h in hulls.items())
    assert sum(cost(o) for o in everything.values()) <= error + 1e-12
    # a budget at one of the climb's breakpoints: no way of storing the tensors (any options,
    # on the hull or not) within those bytes has less total error
    points = _breakpoints(hulls)
    at = points[pick % len(points)]  # exactly the climb's running total after some steps
    got = sum(cost(o) for o in allocate(tensors, budget_bytes=at).values())
    best = min(sum(cost(o) for o in combo) for combo in itertools.product(*tensors.values())
               if sum(o.stored_bytes for o in combo) <= at)
    assert got <= best + 1e-9 * max(1.0, best)


@settings(max_examples=100, deadline=None)
@given(tensors=st.dictionaries(st.sampled_from("abcd"), options, min_size=1, max_size=3),
       target=st.floats(0, 1))
def test_an_error_target_is_met_when_reachable(tensors: dict[str, list[Option]], target: float) -> None:
    chosen = allocate(tensors, max_mean_sq_error=target)
    reachable = sum(min(o.sq_error for o in v) for v in tensors.values()) / len(tensors)
    mean = sum(o.sq_error for o in chosen.values()) / len(chosen)
    assert mean <= target + 1e-12 or mean <= reachable + 1e-12


def test_allocate_needs_exactly_one_target() -> None:
    with pytest.raises(FormatError, match="exactly one"):
        allocate({"a": [Option(8, 10.0, 0.1)]})
    with pytest.raises(FormatError, match="exactly one"):
        allocate({"a": [Option(8, 10.0, 0.1)]}, budget_bytes=5, max_mean_sq_error=0.1)
    with pytest.raises(FormatError, match="'a'"):
        allocate({"a": []}, budget_bytes=5)


@pytest.mark.parametrize("levels", [4, 16, 64])
def test_option_estimates_follow_what_a_save_gets(levels: int, memory_url: str) -> None:
    """The priced bytes and error are within a few per cent of the real quantization's."""
    w = _state()["model/big.weight"]
    (opt,) = [o for o in tensor_options(w, ladder=(levels,)) if o.levels == levels]
    q = quantize_tensor(TensorInput(w), QuantConfig(bins=levels, protect=0.005))
    err = float(np.sum((q.values.astype(np.float64) - w) ** 2) / np.sum(w.astype(np.float64) ** 2))
    assert opt.sq_error == pytest.approx(err, rel=0.05)
    repo = ins.init(memory_url)
    info = repo.save({"w": w}, quantize=QuantConfig(bins=levels, protect=0.005, codebook_reuse_tolerance=1.0))
    actual = sum(repo.stored_bytes(info.id).values())
    assert opt.stored_bytes == pytest.approx(actual, rel=0.1)


def test_options_are_deterministic_and_priced_cheapest_first() -> None:
    w = _state()["model/small.weight"]
    a = tensor_options(w, lossless_bytes=float(w.nbytes))
    assert a == tensor_options(w.copy(), lossless_bytes=float(w.nbytes))
    assert [o.stored_bytes for o in a] == sorted(o.stored_bytes for o in a)
    assert any(o.levels is None and o.sq_error == 0.0 for o in a)
    quantized = {o.levels: o.sq_error for o in a if o.levels is not None}
    assert quantized[4] > quantized[16] > quantized[64]  # more levels, less error
    with pytest.raises(FormatError, match="non-empty"):
        tensor_options(np.zeros((0, 4), np.float32))


@settings(max_examples=100, deadline=None)
@given(spec=st.one_of(
    st.builds(Allocation, target_ratio=st.floats(1, 64), protect=st.sampled_from([0.0, 0.005, 0.5]),
              protected_dtype=st.sampled_from(["bfloat16", "float32"])),
    st.builds(Allocation, max_error=st.floats(1e-5, 2), levels=st.lists(st.integers(2, 254), min_size=1),
              min_numel=st.integers(1, 10**6), codebook_reuse_tolerance=st.floats(1, 3))))
def test_allocation_json_round_trip(spec: Allocation) -> None:
    assert Allocation.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


@pytest.mark.parametrize(("kwargs", "match"), [
    ({}, "exactly one"),
    ({"target_ratio": 8, "max_error": 0.1}, "exactly one"),
    ({"target_ratio": 0.5}, "target_ratio"),
    ({"target_ratio": math.inf}, "target_ratio"),
    ({"max_error": 0}, "max_error"),
    ({"max_error": 0.1, "levels": ()}, "levels"),
    ({"max_error": 0.1, "levels": (300,)}, "levels"),
    ({"max_error": 0.1, "protect": 0.9}, "protect"),
    ({"max_error": 0.1, "protected_dtype": "float16"}, "protected_dtype"),
    ({"max_error": 0.1, "min_numel": 0}, "min_numel"),
])
def test_bad_allocations_name_the_field(kwargs: dict, match: str) -> None:
    with pytest.raises(FormatError, match=match):
        Allocation(**kwargs)


def test_from_dict_rejects_unknown_fields_and_non_dicts() -> None:
    with pytest.raises(FormatError, match="unknown"):
        Allocation.from_dict({"target_ratio": 8, "bins": 16})
    with pytest.raises(FormatError, match="dict"):
        Allocation.from_dict([8])
    with pytest.raises(FormatError, match="levels"):
        Allocation.from_dict({"target_ratio": 8, "levels": "16"})


@pytest.mark.parametrize("target", [6.0, 12.0])
def test_a_save_lands_near_its_target_ratio_and_spends_levels_where_they_pay(target: float, memory_url: str) -> None:
    state = _state()
    repo = ins.init(memory_url)
    planner = AllocationPlanner(Allocation(target_ratio=target))
    info = repo.save(state, quantize=planner)
    assert _ratio(repo, info.id, state) == pytest.approx(target, rel=0.1)
    assert planner.decision is not None
    assert planner.decision.estimated_ratio == pytest.approx(target, rel=0.05)
    levels = planner.decision.levels
    assert set(levels) == {"model/big.weight", "model/small.weight"}
    # the small tensor's bytes are cheap: it never gets fewer levels than the big one
    small, big = levels["model/small.weight"], levels["model/big.weight"]
    assert small is None or (big is not None and small >= big)
    restored = repo.load(info.id)
    np.testing.assert_array_equal(restored["model/big.bias"], state["model/big.bias"])  # 1-D: lossless
    serializer = repo.checkout(info.id).group["model/big.weight"].metadata.codecs[0]
    assert len(serializer.codebook) == big  # the levels chosen are the levels stored


def test_an_error_target_bounds_the_error_a_save_gets(memory_url: str) -> None:
    state = _state(1)
    repo = ins.init(memory_url)
    info = repo.save(state, quantize=Allocation(max_error=0.03))
    restored = repo.load(info.id)
    errs = [np.linalg.norm(restored[p].astype(np.float64) - state[p]) / np.linalg.norm(state[p])
            for p in ("model/big.weight", "model/small.weight")]
    assert math.sqrt(np.mean(np.square(errs))) <= 0.03 * 1.1
    loose = repo.save(state, quantize=Allocation(max_error=0.3))
    assert _ratio(repo, loose.id, state) > _ratio(repo, info.id, state)


def test_same_state_same_bytes_whatever_the_thread_count(monkeypatch: pytest.MonkeyPatch, memory_url: str) -> None:
    state = _state(2)
    roots = []
    for threads in ("1", "2", "4"):
        monkeypatch.setenv("INSHRINK_WRITE_THREADS", threads)
        repo = ins.init(f"{memory_url}/threads-{threads}")
        roots.append(repo.save(state, quantize=Allocation(target_ratio=8)).root)
    assert len(set(roots)) == 1


def test_the_callers_arrays_are_never_modified(memory_url: str) -> None:
    state = _state(3)
    before = {k: v.copy() for k, v in state.items()}
    ins.init(memory_url).save(state, quantize=Allocation(target_ratio=10))
    for k, v in state.items():
        np.testing.assert_array_equal(v, before[k])


def test_an_allocation_search_bisects_to_the_largest_target_within_tolerance() -> None:
    """Quality = 1 - RMS relative error: the search must stop at the last target whose plans
    keep the error within the tolerance, evaluating about log2(targets) of them."""
    from inshrink_store.policy import SearchPolicy
    from inshrink_store.policy.candidates import Candidates

    state = _state(4)
    dtypes = dict.fromkeys(state, "F32")
    ratios = (2.0, 3.0, 4.0, 6.0, 8.0, 10.0, 12.0, 16.0)

    def quality(plans: object) -> float:
        if plans is None:
            return 1.0
        errs = [np.linalg.norm(plans[p].values - state[p]) / np.linalg.norm(state[p]) for p in plans]  # type: ignore[index, attr-defined]
        return 1.0 - float(np.sqrt(np.mean(np.square(errs))))

    policy = SearchPolicy(tolerance=0.1, allocation_ratios=ratios, optimizer=None)
    decision = policy.decide(Candidates(state, dtypes, {}), quality)
    trials = decision.record.allocation_search
    assert trials is not None and len(trials) <= math.ceil(math.log2(len(ratios) + 1))
    # brute force: every target's own error
    from inshrink_store.policy.allocation import AllocationCandidates
    pool = AllocationCandidates(policy.allocation_base(), state, dtypes, {})
    ok = [r for r in ratios if quality(pool.plans(r)) >= 0.9]
    assert ok == list(ratios[:len(ok)])  # error grows with the target: feasibility is a prefix
    assert decision.record.allocation is not None and decision.record.allocation.target_ratio == max(ok)
    assert decision.plans is not None and quality(decision.plans) >= 0.9


@pytest.mark.parametrize("case", ["bf16", "f16", "f64", "nan_inf", "zeros", "constant"])
@pytest.mark.parametrize("spec", [Allocation(target_ratio=8), Allocation(max_error=0.05)])
def test_awkward_tensors_save_and_read_back(case: str, spec: Allocation, memory_url: str) -> None:
    """Every float dtype, NaN/Inf, all-zero and constant tensors: saved, read back in their
    dtype, non-finite values kept where they were."""
    from inshrink_store.dtypes import float32_to_bf16

    rng = np.random.default_rng(5)
    w = rng.standard_normal((128, 64)).astype(np.float32)
    dtypes = None
    if case == "bf16":
        value, dtypes = float32_to_bf16(w), {"model/w": "BF16"}
    elif case == "f16":
        value = w.astype(np.float16)
    elif case == "f64":
        value = w.astype(np.float64)
    elif case == "nan_inf":
        value = w.copy()
        value[rng.random(w.shape) < 0.01] = np.nan
        value[0, :3] = [np.inf, -np.inf, np.nan]
    elif case == "zeros":
        value = np.zeros_like(w)
    else:
        value = np.full_like(w, 0.5)
    repo = ins.init(memory_url)
    info = repo.save({"model/w": value}, dtypes=dtypes, quantize=spec)
    back = repo.load(info.id)["model/w"]
    assert back.dtype == value.dtype and back.shape == value.shape
    if case == "nan_inf":
        np.testing.assert_array_equal(np.isnan(back), np.isnan(value))
        np.testing.assert_array_equal(back[np.isinf(value)], value[np.isinf(value)])
    if case in ("zeros", "constant"):
        np.testing.assert_array_equal(back, value)
