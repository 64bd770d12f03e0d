"""One save's decision (issue 45, item 2): :class:`SaveDecider` decides closed loop or keyframe,
which space, and the keyframe fallback for every client, from the parent as data; the clients
build no search of their own."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inshrink_store.policy import (
    RESIDUAL_SPACE,
    ParentVersion,
    PlanSet,
    QuantizationRecord,
    SaveDecider,
    SaveRun,
    SaveState,
    SearchPoint,
    SearchPolicy,
    SearchSpace,
)
from inshrink_store.policy.closed_loop import Base, ClosedLoopPlans

ROOT = Path(__file__).resolve().parents[2]
PATH = "model/0.weight"


class Scores:
    """An evaluator: the unquantized model scores 1.0, a candidate ``quality``; counts calls."""

    def __init__(self, quality: float, stored: Any) -> None:
        self.quality, self.stored = quality, stored
        self.calls, self.seconds = 0, 0.0
        self.seen: list[Any] = []

    def __call__(self, plans: PlanSet | None) -> float:
        self.calls += 1
        self.seconds += 0.5
        if plans is None:
            return 1.0
        self.seen.append(self.stored(plans) if self.stored is not None else plans)
        return self.quality


def _state(seed: int = 0) -> SaveState:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((96, 96)) * 0.05).astype(np.float32)
    return SaveState({PATH: w}, {PATH: "F32"}, {PATH: "Linear"})


def _parent(state: SaveState) -> ParentVersion:
    """A closed-loop parent of every weight, a little off the live one (a residual to code)."""
    w = np.asarray(state.arrays[PATH])
    return ParentVersion(bases={PATH: Base((w * 0.99).astype(np.float32), depth=0, source=None)},
                         keyframe_interval=8)


def test_lossless_decides_nothing_and_reads_nothing() -> None:
    decider = SaveDecider(SearchPolicy(tolerance=0.03), closed_loop=True, lossless=True)
    run = SaveRun()
    outcome = decider.decide(_state(), _parent(_state()), run, lambda stored: Scores(1.0, stored))
    assert outcome.plans is None and outcome.evaluator is None and not outcome.fell_back
    assert outcome.decision.record == QuantizationRecord(None, 0.03, True)
    assert run.previous_space is None  # no search ran


def test_without_an_evaluator_the_base_is_stored_and_the_space_remembered() -> None:
    decider = SaveDecider(SearchPolicy())
    run = SaveRun()
    outcome = decider.decide(_state(), ParentVersion(), run)
    assert outcome.decision.record.config == SearchPolicy().base and outcome.plans is not None
    assert run.previous_space == SearchSpace()
    run.committed(outcome.decision.record)
    assert run.previous == SearchPolicy().base


def test_the_space_follows_residuals_resumes_and_the_user_s_choice() -> None:
    policy = SearchPolicy()
    assert SaveDecider(policy, closed_loop=True).search_policy(residual=True).space == RESIDUAL_SPACE
    assert SaveDecider(policy, closed_loop=True).search_policy(residual=False).space == SearchSpace()
    # a restart loads what is stored: the resume space, residual or not
    assert SaveDecider(policy, resume_space=True).search_policy(residual=True).space == policy.resume_space
    mine = SearchSpace(bins=(8,), prune=(0.5,), metrics=("magnitude",), protect=(0.005,))
    assert SaveDecider(SearchPolicy(space=mine), closed_loop=True).search_policy(residual=True).space == mine


def test_residuals_are_searched_against_the_parent_and_stored_closed_loop() -> None:
    state = _state()
    made: list[Scores] = []

    def evaluator(stored: Any) -> Scores:
        made.append(Scores(1.0, stored))
        return made[-1]

    outcome = SaveDecider(SearchPolicy(tolerance=0.05), closed_loop=True).decide(
        state, _parent(state), SaveRun(), evaluator)
    assert not outcome.fell_back and len(made) == 1
    assert isinstance(outcome.plans, ClosedLoopPlans)  # residuals turned into reconstructions
    assert made[0].stored is not None  # eval_fn judged what a restore returns
    point = outcome.decision.record.config
    assert point is not None and RESIDUAL_SPACE.index(SearchPoint.of(point)) is not None


def test_no_residual_within_tolerance_falls_back_to_keyframes_within_the_budget() -> None:
    """The first search's candidates all fail: keyframes are searched with the first save's
    count of calls, and the outcome counts both searches' calls."""
    state = _state()
    made: list[Scores] = []

    def evaluator(stored: Any) -> Scores:
        made.append(Scores(0.0 if not made else 1.0, stored))  # residuals fail, keyframes pass
        return made[-1]

    run = SaveRun(previous=None)
    run.predictor.add(0.01, 0.001)  # a run under way: a later save's budget
    policy = SearchPolicy(tolerance=0.05)
    outcome = SaveDecider(policy, closed_loop=True).decide(state, _parent(state), run, evaluator)
    assert outcome.fell_back and len(made) == 2
    record = outcome.decision.record
    assert record.config is not None  # a keyframe met the tolerance
    assert record.search is not None and record.search.budget is not None
    assert record.search.budget.kind == "keyframe"
    # the second evaluator carries both searches' calls and seconds, as the save's budget counts them
    assert outcome.evaluator is made[1] and made[0].calls > 0
    assert outcome.evaluator.calls == record.search.budget.calls > made[0].calls
    assert outcome.evaluator.seconds == 0.5 * outcome.evaluator.calls
    assert run.previous_space == SearchSpace()  # the keyframe's space


@pytest.mark.parametrize("first_space", [None, SearchSpace()])
def test_a_run_s_predictor_and_previous_point_carry_to_the_next_save(first_space: SearchSpace | None) -> None:
    state = _state()
    run = SaveRun(previous_space=first_space)
    decider = SaveDecider(SearchPolicy(tolerance=0.05))
    first = decider.decide(state, ParentVersion(), run, lambda stored: Scores(1.0, stored))
    run.committed(first.decision.record)
    fitted = len(run.predictor.points)
    assert fitted > 0  # the first save's evaluations rank the next one's candidates
    second = decider.decide(_state(1), ParentVersion(), run, lambda stored: Scores(1.0, stored))
    assert second.decision.record.search is not None
    assert second.decision.record.search.budget is not None and second.decision.record.search.budget.kind == "later"
    again = SaveRun()
    again.restored(first.decision.record, decider.policy)  # a restore refills the fit
    assert len(again.predictor.points) == fitted and again.previous == first.decision.record.config


def _names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    found |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    return found


def test_the_clients_decide_through_the_save_decider_only() -> None:
    """Before issue 45's item 2 the Checkpointer, the DistributedCheckpointer and Lightning's
    search each built Candidates and called SearchPolicy.decide, and the Checkpointer also the
    closed loop and the budget: three deciders of one save."""
    clients = [ROOT / "inshrink_store/torch/checkpointer.py", ROOT / "inshrink_store/torch/dcp_checkpointer.py",
               ROOT / "inshrink_store/lightning/search.py"]
    decision_parts = {"Candidates", "ClosedLoop", "parent_bases", "with_moment_bases", "SaveBudget",
                      "QualityPredictor", "RESIDUAL_SPACE"}
    for path in clients:
        names = _names(path)
        assert not names & decision_parts, (path.name, sorted(names & decision_parts))
        assert "SaveDecider" in names, path.name
