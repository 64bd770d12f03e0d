"""The configuration search against brute force on synthetic monotone cubes.

A cube is drawn as the most general monotone feasibility: a point is feasible iff it is
at most as aggressive as one of a few random generator points (per metric; zero
generators = nothing feasible). The ratio is 32/bins-like, grows with pruning, falls
with protection, plus a random monotone perturbation and a per-metric factor.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import product
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inshrink_store.errors import FormatError
from inshrink_store.policy.search import SearchPoint, SearchResult, SearchSpace, Trial, search

SPACE = SearchSpace()
ALL = SPACE.points()
indices = st.tuples(*[st.integers(0, n - 1) for n in SPACE.shape])


@dataclass
class Cube:
    generators: dict[str, list[tuple[int, int, int]]]
    perturb: list[list[float]]
    metric_factor: dict[str, float]
    ratio_calls: list[SearchPoint] = field(default_factory=list)
    feasible_calls: list[SearchPoint] = field(default_factory=list)

    def true_ratio(self, p: SearchPoint) -> float:
        i = SPACE.index(p)
        base = 32 / p.bins / (1 - p.prune) * (1 - 10 * p.protect)
        return base * self.metric_factor[p.prune_metric] + sum(self.perturb[k][i[k]] for k in range(3))

    def true_feasible(self, p: SearchPoint) -> bool:
        i = SPACE.index(p)
        return any(all(a <= b for a, b in zip(i, g, strict=True)) for g in self.generators[p.prune_metric])

    def measure_ratio(self, p: SearchPoint) -> float:
        self.ratio_calls.append(p)
        return self.true_ratio(p)

    def is_feasible(self, p: SearchPoint) -> tuple[bool, float]:
        self.feasible_calls.append(p)
        quality = sum(all(a <= b for a, b in zip(SPACE.index(p), g, strict=True))
                      for g in self.generators[p.prune_metric])
        return quality >= 1, float(quality)

    def optimum(self, points: list[SearchPoint] = ALL) -> float | None:
        ok = [self.true_ratio(p) for p in points if self.true_feasible(p)]
        return max(ok) if ok else None


def _increasing(n: int) -> st.SearchStrategy[list[float]]:
    return st.lists(st.floats(0, 0.3), min_size=n, max_size=n).map(sorted)


cubes = st.builds(
    Cube,
    generators=st.fixed_dictionaries({m: st.lists(indices, max_size=6) for m in SPACE.metrics}),
    perturb=st.tuples(*[_increasing(n) for n in SPACE.shape]).map(list),
    metric_factor=st.fixed_dictionaries({m: st.floats(0.95, 1.05) for m in SPACE.metrics}),
)


def _run(cube: Cube, **kwargs: Any) -> SearchResult:
    return search(cube.measure_ratio, cube.is_feasible, **kwargs)


def _assert_honest(result: SearchResult, cube: Cube) -> None:
    """Each callback ran once per point, and every trial matches the callbacks."""
    assert len(set(cube.feasible_calls)) == len(cube.feasible_calls) == result.evaluations
    assert len(set(cube.ratio_calls)) == len(cube.ratio_calls) == len(result.trials)
    for t in result.trials:
        assert t.ratio == cube.true_ratio(t.point)
        assert t.feasible in (None, cube.true_feasible(t.point))
    if result.best is not None:  # the answer was really evaluated, not only inferred
        assert any(t.point == result.best and t.feasible for t in result.trials)


def _neighbourhood(prev: SearchPoint) -> list[SearchPoint]:
    p = SPACE.index(prev)
    steps = product((p[0] - 1, p[0]), (p[1] - 1, p[1]), (p[2] - 1, p[2]))
    return [SPACE.point(i, prev.prune_metric) for i in steps if min(i) >= 0]


def test_space_defaults_and_order() -> None:
    assert len(SPACE) == len(ALL) == len(set(ALL)) == 216
    assert SPACE.point((0, 0, 0), "magnitude") == SearchPoint(32, 0.0, "magnitude", 0.01)
    assert SPACE.point((5, 5, 2), "sensitivity") == SearchPoint(4, 0.5, "sensitivity", 0.0005)
    assert all(SPACE.point(SPACE.index(p), p.prune_metric) == p for p in ALL)


@settings(max_examples=50, deadline=None)
@given(cube=cubes)
def test_full_search_finds_the_brute_force_optimum_in_few_evaluations(cube: Cube) -> None:
    result = _run(cube)
    optimum = cube.optimum()
    assert result.mode == "full"
    if optimum is None:
        assert result.best is None
    else:
        assert result.best is not None and cube.true_feasible(result.best)
        assert cube.true_ratio(result.best) == optimum
    _assert_honest(result, cube)
    assert result.evaluations <= 60 < len(ALL)  # measured: at most 40 over 2000 random cubes


@settings(max_examples=30, deadline=None)
@given(cube=cubes, noise=st.lists(st.floats(0, 5), min_size=len(ALL), max_size=len(ALL)))
def test_non_monotone_ratio_still_returns_the_best_evaluated_feasible_point(
        cube: Cube, noise: list[float]) -> None:
    jitter = dict(zip(ALL, noise, strict=True))
    result = search(lambda p: cube.measure_ratio(p) + jitter[p], cube.is_feasible)
    feasible = [t for t in result.trials if t.feasible]
    if result.best is None:
        assert not feasible and cube.optimum() is None
    else:
        assert cube.true_feasible(result.best)
        best_trial = next(t for t in result.trials if t.point == result.best)
        assert best_trial.ratio == max(t.ratio for t in feasible)


@settings(max_examples=50, deadline=None)
@given(cube=cubes, prev=indices, metric=st.sampled_from(SPACE.metrics))
def test_neighbourhood_is_never_more_aggressive_and_falls_back_to_the_full_search(
        cube: Cube, prev: tuple[int, int, int], metric: str) -> None:
    previous = SPACE.point(prev, metric)
    other = [SPACE.point(prev, m) for m in SPACE.metrics if m != metric]
    result = _run(cube, previous=previous)
    _assert_honest(result, cube)
    candidates = _neighbourhood(previous) + [
        o for o in other if cube.true_ratio(o) > cube.true_ratio(previous)]
    if result.mode == "neighbourhood":
        assert result.best in candidates and cube.true_feasible(result.best)
        b = SPACE.index(result.best)
        assert all(x <= y for x, y in zip(b, prev, strict=True))
        assert cube.true_ratio(result.best) == cube.optimum(candidates)
        assert result.evaluations <= len(candidates)
    else:
        assert result.mode == "fallback"
        assert not any(cube.true_feasible(c) for c in candidates)
        optimum = cube.optimum()
        assert (result.best is None) == (optimum is None)
        if result.best is not None:
            assert cube.true_ratio(result.best) == optimum


def test_infeasible_neighbourhood_falls_back_to_the_whole_cube() -> None:
    # only bins 32 with heavy pruning holds; previous asks for fewer bins and no pruning
    cube = Cube({"magnitude": [(0, 5, 2)], "sensitivity": []}, [[0.0] * n for n in SPACE.shape],
                dict.fromkeys(SPACE.metrics, 1.0))
    previous = SearchPoint(8, 0.0, "magnitude", 0.01)
    result = _run(cube, previous=previous)
    assert result.mode == "fallback"
    assert result.best == SearchPoint(32, 0.5, "magnitude", 0.0005)
    evaluated = [t.point for t in result.trials if t.feasible is not None]
    assert evaluated[0] == previous  # the neighbourhood's highest ratio comes first
    assert set(_neighbourhood(previous)) <= set(evaluated)


def test_feasible_previous_costs_one_evaluation_and_two_ratios() -> None:
    cube = Cube({m: [(5, 5, 2)] for m in SPACE.metrics}, [[0.0] * n for n in SPACE.shape],
                {"magnitude": 1.0, "sensitivity": 0.99})
    previous = SearchPoint(6, 0.3, "magnitude", 0.005)
    result = _run(cube, previous=previous)
    assert (result.mode, result.best, result.evaluations) == ("neighbourhood", previous, 1)
    # the points behind the previous one are never even measured while it holds
    assert set(cube.ratio_calls) == {previous, SearchPoint(6, 0.3, "sensitivity", 0.005)}


def test_other_metric_is_taken_when_it_measures_higher_and_holds() -> None:
    cube = Cube({m: [(5, 5, 2)] for m in SPACE.metrics}, [[0.0] * n for n in SPACE.shape],
                {"magnitude": 1.0, "sensitivity": 1.02})
    previous = SearchPoint(6, 0.3, "magnitude", 0.005)
    result = _run(cube, previous=previous)
    assert result.best == SearchPoint(6, 0.3, "sensitivity", 0.005)
    only_magnitude = _run(cube, previous=previous, metrics_available=("magnitude",))
    assert only_magnitude.best == previous


@settings(max_examples=20, deadline=None)
@given(cube=cubes)
def test_unavailable_metric_is_never_tried(cube: Cube) -> None:
    result = _run(cube, previous=SPACE.point((2, 2, 1), "sensitivity"), metrics_available=("magnitude",))
    assert {p.prune_metric for p in cube.ratio_calls + cube.feasible_calls} == {"magnitude"}
    assert result.best is None or result.best.prune_metric == "magnitude"


def test_nothing_feasible_gives_none() -> None:
    cube = Cube({m: [] for m in SPACE.metrics}, [[0.0] * n for n in SPACE.shape], dict.fromkeys(SPACE.metrics, 1.0))
    full = _run(cube)
    assert full.best is None and full.mode == "full"
    assert full.evaluations == len(SPACE.metrics)  # the least aggressive corner of each metric decides
    fallback = _run(cube, previous=SearchPoint(16, 0.0, "magnitude", 0.005))
    assert fallback.best is None and fallback.mode == "fallback"


@settings(max_examples=25, deadline=None)
@given(cube=cubes, prev=st.none() | indices)
def test_deterministic(cube: Cube, prev: tuple[int, int, int] | None) -> None:
    previous = None if prev is None else SPACE.point(prev, "magnitude")
    first = _run(cube, previous=previous)
    calls = list(cube.feasible_calls)
    cube.feasible_calls.clear()
    cube.ratio_calls.clear()
    second = _run(cube, previous=previous)
    assert first == second and calls == cube.feasible_calls


@dataclass(frozen=True)
class _Axes:
    """Not a QuantConfig: any object with the four axes (and more) will do."""

    bins: int
    prune: float
    prune_metric: str
    protect: float
    min_numel: int


def test_previous_may_be_any_config_with_the_four_axes() -> None:
    cube = Cube({m: [(5, 5, 2)] for m in SPACE.metrics}, [[0.0] * n for n in SPACE.shape],
                dict.fromkeys(SPACE.metrics, 1.0))
    config = _Axes(bins=16, prune=0.2, prune_metric="magnitude", protect=0.005, min_numel=4096)
    result = search(cube.measure_ratio, cube.is_feasible, previous=config)
    assert result.best == SearchPoint(16, 0.2, "magnitude", 0.005)


@settings(max_examples=50, deadline=None)
@given(point=st.sampled_from(ALL))
def test_point_json_round_trip(point: SearchPoint) -> None:
    assert SearchPoint.from_dict(json.loads(json.dumps(point.to_dict()))) == point
    assert SPACE.point(SPACE.index(point), point.prune_metric) == point
    scalars: list[Any] = [np.int64(point.bins), np.float64(point.prune), point.prune_metric,
                          np.float32(point.protect)]
    from_numpy = SearchPoint(*scalars)
    assert all(type(v) in (int, float, str) for v in from_numpy.to_dict().values())
    assert from_numpy.bins == point.bins and from_numpy.prune == point.prune


@settings(max_examples=20, deadline=None)
@given(cube=cubes)
def test_result_json_round_trip(cube: Cube) -> None:
    result = _run(cube)
    data = json.loads(json.dumps(result.to_dict()))
    assert data["evaluations"] == result.evaluations
    assert SearchResult.from_dict(data) == result
    assert all(Trial.from_dict(t) == r for t, r in zip(data["trials"], result.trials, strict=True))


@pytest.mark.parametrize("make", [
    lambda: SearchPoint(1, 0.0, "magnitude", 0.01),
    lambda: SearchPoint(8, 1.0, "magnitude", 0.01),
    lambda: SearchPoint(8, 0.1, "hessian", 0.01),
    lambda: SearchPoint.from_dict({"bins": 8, "prune": 0.1, "prune_metric": "magnitude"}),
    lambda: SearchSpace(bins=(8, 8)),
    lambda: SearchSpace(prune=()),
])
def test_invalid_points_and_spaces_are_rejected(make: Callable[[], object]) -> None:
    with pytest.raises(FormatError, match="Expected"):
        make()


def test_previous_off_the_axes_and_no_usable_metric_are_rejected() -> None:
    cube = Cube({m: [] for m in SPACE.metrics}, [[0.0] * n for n in SPACE.shape], dict.fromkeys(SPACE.metrics, 1.0))
    with pytest.raises(FormatError, match="Expected a point on the axes"):
        _run(cube, previous=SearchPoint(10, 0.0, "magnitude", 0.01))
    with pytest.raises(FormatError, match="Expected metrics_available"):
        _run(cube, metrics_available=("hessian",))


@settings(max_examples=50, deadline=None)
@given(cube=cubes, budget=st.integers(1, 12), with_previous=st.booleans(), start=indices)
def test_an_evaluation_budget_caps_eval_calls_and_keeps_the_best_evaluated(
    cube: Cube, budget: int, with_previous: bool, start: tuple[int, int, int]
) -> None:
    """max_evaluations: is_feasible runs at most that often; the answer is the feasible point
    with the highest ratio among those evaluated (None when none was feasible), and a budget
    the search never reaches changes nothing."""
    previous = SPACE.point(start, "magnitude") if with_previous else None
    unlimited = _run(Cube(cube.generators, cube.perturb, cube.metric_factor), previous=previous)
    result = _run(cube, previous=previous, max_evaluations=budget)
    _assert_honest(result, cube)
    assert result.evaluations <= budget
    if unlimited.evaluations <= budget:
        assert (result.best, result.mode) == (unlimited.best, unlimited.mode)
    else:
        assert result.mode == "budget"
        feasible = [t for t in result.trials if t.feasible]
        best = max(feasible, key=lambda t: t.ratio, default=None)
        assert result.best == (None if best is None else best.point) or (
            best is not None and cube.true_ratio(result.best) == best.ratio)
    roundtrip = SearchResult.from_dict(json.loads(json.dumps(result.to_dict())))
    assert roundtrip.mode == result.mode and roundtrip.best == result.best


def test_a_bad_evaluation_budget_is_refused() -> None:
    cube = Cube({m: [] for m in SPACE.metrics}, [[0.0] * n for n in SPACE.shape], dict.fromkeys(SPACE.metrics, 1.0))
    for bad in (0, -1, 2.5, True):
        with pytest.raises(FormatError, match="max_evaluations"):
            _run(cube, max_evaluations=bad)
