"""Saves take plans: a planner is asked once, by the write session, and the writer only
ever sees path -> ArrayPlan (it never calls back up into the policy layer)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pytest

import inshrink_store as ins
from inshrink_store import session as session_module
from inshrink_store.errors import FormatError, InvalidInputError
from inshrink_store.plans import ArrayPlan, check_quantize
from inshrink_store.policy import QuantConfig, StatePlanner

CONFIG = QuantConfig(bins=8, min_numel=16)


def _tensors(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"model/w": rng.standard_normal((64, 32)).astype(np.float32),
            "model/b": rng.standard_normal(32).astype(np.float32)}


class _CountingPlanner:
    """A planner that records what it was handed."""

    def __init__(self) -> None:
        self.calls: list[tuple[set[str], dict[str, str], set[str]]] = []

    def plan(self, tensors: Mapping[str, np.ndarray], dtypes: Mapping[str, str],
             previous: Mapping[str, dict[str, Any]]) -> Mapping[str, ArrayPlan]:
        self.calls.append((set(tensors), dict(dtypes), set(previous)))
        return StatePlanner(CONFIG).plan(tensors, dtypes, previous)


def test_a_planner_is_asked_once_per_save_with_the_parents_codebooks() -> None:
    repo = ins.open("memory://plans-asked-once", create=True)
    planner = _CountingPlanner()
    first = repo.save(_tensors(0), quantize=planner)
    quantized = {p for p, a in repo.checkout(first.id).arrays().items() if a.storage == "quantized"}
    repo.save(_tensors(1), quantize=planner)
    assert len(planner.calls) == 2
    (first_paths, first_dtypes, first_previous), (_, _, second_previous) = planner.calls
    assert first_paths == {"model/w", "model/b"} and set(first_dtypes.values()) == {"F32"}
    assert first_previous == set()  # no parent
    assert second_previous == quantized == {"model/w"}  # the parent's quantized arrays (a bias stays lossless)


def test_plans_made_beforehand_are_written_as_they_are_without_reading_the_parent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    repo = ins.open("memory://plans-as-made", create=True)
    repo.save(_tensors(0), quantize=CONFIG)
    tensors = _tensors(1)
    plans = StatePlanner(CONFIG).plan(tensors, dict.fromkeys(tensors, "F32"), {})
    read: list[object] = []
    real = session_module.previous_codecs
    monkeypatch.setattr(session_module, "previous_codecs", lambda parent: read.append(parent) or real(parent))
    info = repo.save(tensors, quantize=plans)
    assert read == []  # the caller planned: the parent's codebooks are not read a second time
    reader = repo.checkout(info.id)
    assert set(plans) == {"model/w"}
    np.testing.assert_array_equal(reader.read("model/w"), plans["model/w"].values)
    np.testing.assert_array_equal(reader.read("model/b"), tensors["model/b"])  # not planned: lossless


def test_a_plan_for_a_tensor_not_being_written_is_refused_and_nothing_is_committed() -> None:
    repo = ins.open("memory://plans-unknown", create=True)
    tensors = _tensors(0)
    plans = dict(StatePlanner(CONFIG).plan(tensors, dict.fromkeys(tensors, "F32"), {}))
    with pytest.raises(FormatError, match="model/w"):
        repo.save({"model/b": tensors["model/b"]}, quantize=plans)
    assert repo.branches() == {}


@pytest.mark.parametrize("bad", [3, "bins=8", [("model/w", None)]])
def test_quantize_that_is_neither_plans_nor_a_planner_is_a_clear_error(bad: object) -> None:
    with pytest.raises(InvalidInputError, match="planner with a plan"):
        check_quantize(bad)
    repo = ins.open("memory://plans-bad", create=True)
    with pytest.raises(InvalidInputError, match="mapping of path -> ArrayPlan"):
        repo.save(_tensors(0), quantize=bad)  # type: ignore[arg-type]
    assert repo.branches() == {}
