"""The configuration search on synthetic monotone cubes with a brute-force optimum."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from inshrink_store.policy import QuantConfig
from inshrink_store.policy.search import SearchSpace, search

SPACE = SearchSpace()


def synthetic(threshold: float, weights: tuple[float, float, float], metric_bonus: float):
    """Monotone quality and ratio: aggressiveness a = weighted axis indices; feasible iff a <= t."""
    def aggressiveness(c: QuantConfig) -> float:
        b, p, r = SPACE.index(c)
        return weights[0] * b + weights[1] * p + weights[2] * r + (metric_bonus if c.prune_metric == "sensitivity" else 0)

    def ratio(c: QuantConfig) -> float:
        b, p, r = SPACE.index(c)
        return 32 / c.bins * (1 + c.prune) * (1 + 0.01 * r) + 0.001 * b * p

    calls: list[QuantConfig] = []

    def feasible(c: QuantConfig) -> tuple[bool, float]:
        calls.append(c)
        return aggressiveness(c) <= threshold, -aggressiveness(c)

    return ratio, feasible, calls, aggressiveness


cubes = st.tuples(st.floats(-1, 12), st.tuples(*[st.floats(0.2, 2)] * 3), st.floats(-0.5, 0.5))


@settings(max_examples=40, deadline=None)
@given(cube=cubes)
def test_full_search_finds_the_brute_force_optimum_with_few_evaluations(cube):
    threshold, weights, bonus = cube
    ratio, feasible, calls, agg = synthetic(threshold, weights, bonus)
    result = search(ratio, feasible)
    every = [SPACE.point(i, m, QuantConfig()) for m in SPACE.metrics for i in SPACE.cube()]
    ok = [c for c in every if agg(c) <= threshold]
    if not ok:
        assert result.best is None
    else:
        assert result.best is not None and agg(result.best) <= threshold
        assert ratio(result.best) == max(ratio(c) for c in ok)
    assert len(calls) <= 80 < len(every)
    assert result.mode == "full"


@settings(max_examples=40, deadline=None)
@given(cube=cubes, prev=st.tuples(st.integers(0, 5), st.integers(0, 5), st.integers(0, 2)))
def test_neighbourhood_never_more_aggressive_and_falls_back(cube, prev):
    threshold, weights, bonus = cube
    ratio, feasible, _, agg = synthetic(threshold, weights, bonus)
    previous = SPACE.point(prev, "magnitude", QuantConfig())
    result = search(ratio, feasible, previous=previous)
    if result.mode == "neighbourhood":
        b, p, r = SPACE.index(result.best)
        assert b <= prev[0] and p <= prev[1] and r <= prev[2]
    else:
        assert result.mode == "fallback"
        near = [SPACE.point((b, p, r), m, QuantConfig()) for m in SPACE.metrics
                for b in (prev[0] - 1, prev[0]) for p in (prev[1] - 1, prev[1]) for r in (prev[2] - 1, prev[2])
                if min(b, p, r) >= 0]
        assert not any(agg(c) <= threshold and SPACE.index(c) <= prev for c in near if c.prune_metric == "magnitude")


def test_deterministic_and_json():
    ratio, feasible, _, _ = synthetic(5.0, (1.0, 1.0, 1.0), 0.2)
    a, b = search(ratio, feasible), search(ratio, feasible)
    assert a.to_dict() == b.to_dict()
    assert json.loads(json.dumps(a.to_dict()))["best"] == a.best.to_dict()
