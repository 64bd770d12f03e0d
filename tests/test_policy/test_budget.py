"""The budgeted search (issue 42): a bounded number of evaluations per save, candidates ranked
by a predictor of their quality drop, and only a confirmed candidate ever chosen.

Synthetic cubes stand in for a model: every point has a ratio and a predicted error that grow
with aggressiveness, and a true relative drop that is the error times a model-specific
factor, bent and jittered per point so the predictor's line is only an approximation.
"""

from __future__ import annotations

import math
from itertools import product
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inshrink_store.errors import FormatError
from inshrink_store.policy import QuantizationRecord, SearchPolicy
from inshrink_store.policy.budgeted_search import (
    PREDICTOR_WINDOW,
    RECENCY,
    QualityPredictor,
    SaveBudget,
    budgeted_search,
)
from inshrink_store.policy.candidates import Candidates
from inshrink_store.policy.search import SearchPoint, SearchResult, SearchSpace
from inshrink_store.policy.search_policy import MAX_EVALS

SPACE = SearchSpace()


class Cube:
    """A synthetic model: ratio and predicted error per point, and its true drop."""

    def __init__(self, seed: int, k: float, bend: float, jitter: float) -> None:
        rng = np.random.default_rng(seed)
        self.k, self.bend = k, bend
        self.noise = {p: 1.0 + jitter * float(rng.uniform(-1, 1)) for p in SPACE.points()}
        self.metric_factor = {"magnitude": 1.0, "sensitivity": float(rng.uniform(0.6, 1.2))}
        self.calls: list[SearchPoint] = []

    def ratio(self, p: SearchPoint) -> float:
        sens = 1.03 if p.prune_metric == "sensitivity" else 1.0
        return sens * (32 / p.bins) / (1 - p.prune) * (1 - 10 * p.protect)

    def error(self, p: SearchPoint) -> float:
        return self.metric_factor[p.prune_metric] * (2.0 / p.bins ** 2 + p.prune ** 2 * 0.05
                                                     + (0.01 - p.protect) * 0.01)

    def drop(self, p: SearchPoint) -> float:
        e = self.error(p)
        return self.k * e * (1 + self.bend * e) * self.noise[p]

    def evaluate(self, tolerance: float) -> Any:
        def run(p: SearchPoint) -> tuple[bool, float, float]:
            self.calls.append(p)
            d = self.drop(p)
            return d <= tolerance, 1.0 - d, d
        return run


def _search(cube: Cube, budget: SaveBudget, predictor: QualityPredictor, tolerance: float = 0.05,
            previous: SearchPoint | None = None) -> SearchResult:
    if budget.baseline is None:
        budget.baseline = budget.call(lambda: 1.0)
    evaluate = cube.evaluate(tolerance)
    return budgeted_search(cube.ratio, cube.error, lambda p: _counted(budget, evaluate, p),
                           predictor=predictor, tolerance=tolerance, budget=budget,
                           start_error=cube.error(SearchPoint(16, 0.0, "magnitude", 0.005)), previous=previous,
                           space=SPACE)


def _counted(budget: SaveBudget, evaluate: Any, p: SearchPoint) -> tuple[bool, float, float]:
    out: list[tuple[bool, float, float]] = []
    budget.call(lambda: (out.append(evaluate(p)), 0.0)[1])
    return out[0]


def _optimum(cube: Cube, tolerance: float) -> float:
    return max((cube.ratio(p) for p in SPACE.points() if cube.drop(p) <= tolerance), default=0.0)


cubes = st.builds(Cube, seed=st.integers(0, 2**16), k=st.floats(0.2, 20.0), bend=st.floats(0.0, 30.0),
                  jitter=st.floats(0.0, 0.3))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cube=cubes, later_saves=st.integers(1, 4), tolerance=st.sampled_from([0.01, 0.05, 0.2]))
def test_the_call_budget_holds_and_only_confirmed_points_are_chosen(cube: Cube, later_saves: int,
                                                                   tolerance: float) -> None:
    predictor = QualityPredictor()
    previous = None
    for save in range(1 + later_saves):
        cube.calls.clear()
        first = save == 0
        budget = SaveBudget(8 if first else 3, kind="first" if first else "later")
        result = _search(cube, budget, predictor, tolerance, previous)
        assert budget.calls <= (8 if first else 3)  # the baseline's call included
        assert result.budget is not None and result.budget.calls == budget.calls
        assert result.evaluations == len(cube.calls) == budget.calls - 1  # each point evaluated once
        if result.best is not None:
            chosen = next(t for t in result.trials if t.point == result.best)
            assert chosen.feasible is True  # confirmed, never inferred or predicted
            assert cube.drop(result.best) <= tolerance
        previous = result.best or previous
        # a later save needs an evaluation of the run to predict from
        cube.k *= 1.1  # the model grows more sensitive as it trains


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cube=cubes)
def test_a_first_save_finds_most_of_the_optimum(cube: Cube) -> None:
    """Within its 7 candidate evaluations the first save brackets the threshold: on a cube
    whose drop follows the error up to a bend and 30 % jitter it stays close to the best
    ratio an unlimited search could confirm."""
    budget = SaveBudget(8)
    result = _search(cube, budget, QualityPredictor())
    best = _optimum(cube, 0.05)
    if best == 0.0:
        assert result.best is None
        return
    assert result.best is not None
    assert cube.ratio(result.best) >= 0.5 * best


def test_the_predictor_ranks_by_a_line_through_the_run_s_evaluations() -> None:
    p = QualityPredictor()
    assert p.slope is None and p.threshold(0.05) == math.inf and p.predict(1.0) is None
    p.begin(SaveBudget(8))
    p.add(0.01, 0.02)
    p.add(0.02, 0.04)
    assert p.slope == pytest.approx(2.0)
    assert p.threshold(0.05) == pytest.approx(0.025)
    assert p.predict(0.03) == pytest.approx(0.06)
    p.add(0.001, -0.5)  # noise below the baseline counts as no drop
    assert p.slope == pytest.approx((0.01 * 0.02 + 0.02 * 0.04) / (0.01**2 + 0.02**2 + 0.001**2))
    for i in range(PREDICTOR_WINDOW + 3):
        p.add(1.0 + i, 0.0)
    assert len(p.points) == PREDICTOR_WINDOW  # the newest evaluations only


def test_the_predictor_weighs_the_newest_save_most() -> None:
    """A model grows touchier as it trains: an evaluation of this save outweighs one of the
    save before by RECENCY, so the fit follows the newest slope; a second search of the same
    save (keyframes after residuals) does not age the save's own evaluations."""
    p = QualityPredictor()
    p.begin(SaveBudget(8))
    p.add(0.01, 0.01)  # slope 1
    budget = SaveBudget(3, kind="later")
    p.begin(budget)
    p.add(0.01, 0.10)  # slope 10
    w = 1 / RECENCY
    assert p.slope == pytest.approx((w * 0.01 * 0.01 + 0.01 * 0.10) / (w * 0.01**2 + 0.01**2))
    assert p.slope > 5.5  # nearer the newest save's 10 than the plain mean
    before = p.slope
    p.begin(budget)  # the same save again
    assert p.slope == before


def test_an_exact_predictor_confirms_the_optimum_at_once_on_a_later_save() -> None:
    """With a drop exactly proportional to the error, the first save's evaluations fit the line,
    and a later save's first candidate is the optimum."""
    cube = Cube(seed=0, k=2.0, bend=0.0, jitter=0.0)
    predictor = QualityPredictor()
    first = _search(cube, SaveBudget(8), predictor)
    assert first.best is not None and cube.ratio(first.best) == _optimum(cube, 0.05)
    cube.calls.clear()
    later = _search(cube, SaveBudget(3, kind="later"), predictor, previous=None)
    assert later.best is not None and cube.ratio(later.best) == _optimum(cube, 0.05)
    assert later.evaluations <= 2 and later.budget is not None  # the fit's candidate, then one more aggressive try


def test_when_the_budget_runs_out_before_a_confirmation_nothing_is_chosen() -> None:
    cube = Cube(seed=1, k=1e6, bend=0.0, jitter=0.0)  # every candidate breaks the tolerance
    budget = SaveBudget(3)
    result = _search(cube, budget, QualityPredictor())
    assert result.best is None
    assert budget.calls == 3 and result.budget is not None and result.budget.stopped == "calls"
    assert all(t.feasible is False for t in result.trials if t.feasible is not None)


def test_a_refusal_of_the_safest_point_ends_the_search_with_nothing() -> None:
    """With budget to spare, the search narrows down to the least-error point; when even that
    is refused, nothing is chosen (the caller stores lossless) and the budget is not all spent."""
    cube = Cube(seed=1, k=1e6, bend=0.0, jitter=0.0)
    budget = SaveBudget(20)
    result = _search(cube, budget, QualityPredictor())
    assert result.best is None and result.budget is not None and result.budget.stopped == "converged"
    safest = min(SPACE.points(), key=cube.error)
    assert any(t.point == safest and t.feasible is False for t in result.trials)
    assert budget.calls < 20


def test_same_inputs_same_decisions() -> None:
    def run() -> list[Any]:
        cube = Cube(seed=7, k=30.0, bend=5.0, jitter=0.2)
        predictor = QualityPredictor()
        out = []
        previous = None
        for n in (8, 3, 3):
            result = _search(cube, SaveBudget(n), predictor, previous=previous)
            out.append(result.to_dict() | {"budget": None})  # seconds are wall clock
            previous = result.best or previous
        return out

    assert run() == run()


def test_the_record_says_how_the_budget_was_spent() -> None:
    cube = Cube(seed=3, k=20.0, bend=2.0, jitter=0.1)
    result = _search(cube, SaveBudget(8), QualityPredictor())
    data = result.to_dict()
    assert data["mode"] == "predicted"
    assert set(data["budget"]) == {"kind", "max_evals", "max_seconds", "calls", "before", "seconds", "stopped"}
    assert data["budget"]["calls"] == data["evaluations"] + 1 and data["budget"]["max_evals"] == 8
    evaluated = [t for t in data["trials"] if t["feasible"] is not None]
    assert all("error" in t for t in evaluated)
    assert sum("predicted" not in t for t in evaluated) <= 1  # all but the first: there was a fit
    back = SearchResult.from_dict(data)
    assert back == result
    old = {k: v for k, v in data.items() if k != "budget"}  # a record written before budgets
    assert SearchResult.from_dict(old).budget is None


def _state(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"model/a.weight": rng.standard_normal((128, 128), dtype=np.float32),
            "model/b.weight": rng.standard_normal((64, 96), dtype=np.float32)}


def _quality_of(state: dict[str, np.ndarray]) -> Any:
    calls: list[Any] = []

    def quality(plans: Any) -> float:
        calls.append(plans)
        if plans is None:
            return 1.0
        errs = [np.linalg.norm(plans[p].values - state[p]) / np.linalg.norm(state[p]) for p in plans]
        return 1.0 - float(np.sqrt(np.mean(np.square(errs))))

    quality.calls = calls  # type: ignore[attr-defined]
    return quality


def test_decide_spends_at_most_the_default_budget_and_records_it() -> None:
    state = _state()
    dtypes = dict.fromkeys(state, "F32")
    policy = SearchPolicy(tolerance=0.05, optimizer=None, max_evals=MAX_EVALS)
    assert policy.max_evals == (8, 3) and policy.budgeted
    predictor = QualityPredictor()
    quality = _quality_of(state)
    first = policy.decide(Candidates(state, dtypes, {}), quality, predictor=predictor)
    assert len(quality.calls) <= 8
    record = QuantizationRecord.from_dict(first.record.to_dict())
    assert record.search is not None and record.search.budget is not None
    assert record.search.budget.kind == "first" and record.search.budget.calls == len(quality.calls)
    assert first.record.config is not None
    # a later save of the same run (the state moved a little)
    moved = {p: v + np.float32(0.01) * _state(1)[p] for p, v in state.items()}
    quality = _quality_of(moved)
    later = policy.decide(Candidates(moved, dtypes, {}), quality, previous=first.record.config, predictor=predictor)
    assert len(quality.calls) <= 3
    assert later.record.search is not None and later.record.search.budget is not None
    assert later.record.search.budget.kind == "later"
    if later.record.config is not None:
        q = quality(later.plans)  # what is stored is what was confirmed
        assert policy.within(q, 1.0)


def test_a_restored_record_feeds_the_predictor() -> None:
    state = _state()
    dtypes = dict.fromkeys(state, "F32")
    policy = SearchPolicy(tolerance=0.05, optimizer=None, max_evals=MAX_EVALS)
    first = policy.decide(Candidates(state, dtypes, {}), _quality_of(state))
    predictor = QualityPredictor()
    policy.recall(QuantizationRecord.from_dict(first.record.to_dict()), predictor)
    assert first.record.search is not None
    assert len(predictor.points) == first.record.search.evaluations > 0


def test_predicted_error_grows_with_aggressiveness_and_uses_the_reference() -> None:
    state = _state()
    dtypes = dict.fromkeys(state, "F32")
    c = Candidates(state, dtypes, {})
    policy = SearchPolicy()
    errors = [c.predicted_error(policy.config(SearchPoint(b, pr, "magnitude", 0.005)))
              for b, pr in product((32, 16, 8, 4), (0.0, 0.3))]
    assert all(e > 0 for e in errors)
    assert errors[0] < errors[2] < errors[4] < errors[6]  # fewer levels, more error
    assert errors[0] < errors[1]  # pruning adds error
    # the same residuals against larger live weights: a smaller relative error
    bigger = {p: 10 * v for p, v in state.items()}
    against = Candidates(state, dtypes, {}, reference=bigger)
    config = policy.config(SearchPoint(16, 0.0, "magnitude", 0.005))
    assert against.predicted_error(config) == pytest.approx(c.predicted_error(config) / 100, rel=1e-6)


@pytest.mark.parametrize("bad", [1, 0, (8,), (8, 1), "8", True, (8, 3, 1)])
def test_bad_max_evals_are_refused(bad: Any) -> None:
    with pytest.raises(FormatError, match="max_evals"):
        SearchPolicy(max_evals=bad)


@pytest.mark.parametrize("bad", [0, -1.0, "1", True])
def test_bad_max_seconds_are_refused(bad: Any) -> None:
    with pytest.raises(FormatError, match="max_seconds"):
        SearchPolicy(max_seconds=bad)


def test_max_evals_forms() -> None:
    assert SearchPolicy(max_evals=5).max_evals == (5, 5)
    assert SearchPolicy(max_evals=(10, 2)).max_evals == (10, 2)
    assert SearchPolicy().budgeted and SearchPolicy().max_evals == MAX_EVALS  # the default
    assert not SearchPolicy(max_evals=None).budgeted
    assert not SearchPolicy(max_evaluations=4).budgeted  # the exhaustive search's cap selects it
    budget = SearchPolicy(max_evals=(10, 2)).save_budget(first=False)
    assert budget.max_evals == 2 and budget.kind == "later"
    SearchPolicy(max_evals=(10, 2)).widen_for_keyframes(budget)  # a keyframe within a later save
    assert budget.max_evals == 10 and budget.kind == "keyframe"
    unbounded = SearchPolicy(max_evals=None).save_budget(first=False)
    SearchPolicy(max_evals=None).widen_for_keyframes(unbounded)
    assert unbounded.max_evals is None


def test_the_safe_fallback_is_tried_before_nothing_is_chosen() -> None:
    """Predicted errors need not be monotone: here the least aggressive point's error is just
    above a refused point's, so the bracket closes below it. With calls left, the search still
    evaluates it (the safe fallback) before reporting nothing confirmed, and stores it."""
    space = SearchSpace(bins=(16, 32), prune=(0.0, 0.1), metrics=("magnitude",), protect=(0.01, 0.0005))
    safest = SearchPoint(32, 0.0, "magnitude", 0.01)

    def error(p: SearchPoint) -> float:
        return 1.0 if p == safest else 0.9 + 0.01 * (32 / p.bins) + p.prune + (0.01 - p.protect)

    calls: list[SearchPoint] = []

    def evaluate(p: SearchPoint) -> tuple[bool, float, float]:
        calls.append(p)
        ok = p == safest
        return ok, 1.0 if ok else 0.0, 0.0 if ok else 1.0

    budget = SaveBudget(8)
    budget.baseline = budget.call(lambda: 1.0)
    result = budgeted_search(lambda p: 32 / p.bins / (1 - p.prune), error, evaluate, predictor=QualityPredictor(),
                             tolerance=0.05, budget=budget, start_error=0.95, space=space,
                             metrics_available=("magnitude",))
    assert result.best == safest and calls[-1] == safest and calls.count(safest) == 1
    assert budget.calls <= 8


class _Drifted(Cube):
    """The same cube one save later: every ratio and every error moved by one factor, and
    every estimate counted."""

    def __init__(self, ratio_by: float, error_by: float) -> None:
        super().__init__(seed=5, k=8.0, bend=1.0, jitter=0.0)
        self.ratio_by, self.error_by = ratio_by, error_by
        self.estimated: list[SearchPoint] = []

    def ratio(self, p: SearchPoint) -> float:
        self.estimated.append(p)
        return self.ratio_by * super().ratio(p)

    def error(self, p: SearchPoint) -> float:
        return self.error_by * super().error(p)


@pytest.mark.parametrize(("ratio_by", "error_by"), [(1.0, 1.0), (1.1, 1.3), (0.9, 0.8)])
def test_a_later_save_ranks_by_the_previous_save_s_estimates_and_estimates_afresh_what_it_evaluates(
        ratio_by: float, error_by: float) -> None:
    """A later save's box is ranked by the estimates the run already has (scaled by the drift at
    the previous point): it chooses what estimating the whole box chooses when the drift is the
    same everywhere, estimates a fraction of the box, and every evaluated or recorded figure is
    this save's own estimate."""
    first_cube = _Drifted(1.0, 1.0)
    predictor = QualityPredictor()
    first = _search(first_cube, SaveBudget(8), predictor)
    assert first.best is not None

    def later(carry: bool) -> tuple[SearchResult, _Drifted]:
        cube = _Drifted(ratio_by, error_by)
        p = QualityPredictor()
        p.points, p.save = list(predictor.points), predictor.save
        if carry:
            p.estimates = {k: (dict(r), dict(e)) for k, (r, e) in predictor.estimates.items()}
        return _search(cube, SaveBudget(3, kind="later"), p, previous=first.best), cube

    lazy, lazy_cube = later(carry=True)
    full, full_cube = later(carry=False)
    assert lazy.best == full.best
    assert len(set(lazy_cube.estimated)) < len(set(full_cube.estimated)) / 2
    assert set(lazy_cube.estimated) >= {first.best, *(t.point for t in lazy.trials if t.feasible is not None)}
    for t in lazy.trials:  # the record holds only this save's estimates
        assert t.ratio == pytest.approx(lazy_cube.ratio(t.point))
        assert t.error == pytest.approx(lazy_cube.error(t.point))


def test_a_keyframe_search_of_a_later_save_does_not_rank_by_the_earlier_estimates() -> None:
    """Without a previous point (a keyframe within a later save, a new space) the whole cube is
    estimated afresh, as on a first save."""
    cube = _Drifted(1.0, 1.0)
    predictor = QualityPredictor()
    _search(cube, SaveBudget(8), predictor)
    fresh = _Drifted(2.0, 1.0)
    again = _search(fresh, SaveBudget(8, kind="keyframe"), predictor, previous=None)
    assert all(t.ratio == pytest.approx(fresh.ratio(t.point)) for t in again.trials)


def test_a_later_save_with_a_fit_never_estimates_the_start_error() -> None:
    """The start error (the base configuration's estimate, a codebook fit per tensor) only
    seeds a search that has no fit yet: a later save asks for it lazily and, with a fit, never."""
    cube = Cube(seed=2, k=4.0, bend=0.0, jitter=0.0)
    predictor = QualityPredictor()
    asked: list[int] = []

    def start() -> float:
        asked.append(1)
        return cube.error(SearchPoint(16, 0.0, "magnitude", 0.005))

    evaluate = cube.evaluate(0.05)
    first_budget = SaveBudget(8)
    first_budget.baseline = first_budget.call(lambda: 1.0)
    first = budgeted_search(cube.ratio, cube.error, lambda p: _counted(first_budget, evaluate, p),
                            predictor=predictor, tolerance=0.05, budget=first_budget, start_error=start, space=SPACE)
    assert asked and first.best is not None and predictor.slope is not None
    asked.clear()
    later_budget = SaveBudget(3, kind="later")
    later_budget.baseline = later_budget.call(lambda: 1.0)
    budgeted_search(cube.ratio, cube.error, lambda p: _counted(later_budget, evaluate, p), predictor=predictor,
                    tolerance=0.05, budget=later_budget, start_error=start, previous=first.best, space=SPACE)
    assert asked == []
