"""PlanSet, CandidatePlanner and the ratio estimator against what the store really writes."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any, cast

import numpy as np
import pytest

import inshrink_store as ins
from inshrink_store import object_format
from inshrink_store.dtypes import float32_to_bf16
from inshrink_store.errors import FormatError
from inshrink_store.plans import ArrayPlan
from inshrink_store.policy import PlanSet, QuantConfig, StatePlanner
from inshrink_store.policy.candidates import CandidatePlanner, Candidates
from inshrink_store.policy.ratio import RatioEstimator, lossless_bytes, quantized_bytes

CONFIG = QuantConfig(bins=8, prune=0.2, protect=0.005)


def _state(seed: int = 0) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {
        "model/a.weight": (rng.standard_normal((256, 512)) * 0.02).astype(np.float32),
        "model/b.weight": (rng.standard_normal((300, 200)) * 0.05).astype(np.float16),
        "model/c.weight": float32_to_bf16((rng.standard_normal((128, 300)) * 0.1).astype(np.float32)),
        "model/a.bias": rng.standard_normal(512).astype(np.float32),
        "model/steps": np.arange(7, dtype=np.int64),
        "optimizer/m": (rng.standard_normal((64, 96)) * 1e-3).astype(np.float32),
    }
    dtypes = {"model/a.weight": "F32", "model/b.weight": "F16", "model/c.weight": "BF16", "model/a.bias": "F32",
              "model/steps": "I64", "optimizer/m": "F32"}
    return tensors, dtypes


def _stored_chunk_bytes(repo: Any, snapshot: str, prefix: str = "model/") -> int:
    """Bytes of the chunk objects the store keeps for tensors under ``prefix`` (headers excluded)."""
    reader = repo.checkout(snapshot)
    objects = reader.view.objects
    return sum(objects.stored_size(oid) - object_format.HEADER_SIZE
               for path, info in reader.arrays().items() if path.startswith(prefix)
               for key, oid in info.chunk_ids.items() if key != "zarr.json")


def test_plan_set_is_immutable() -> None:
    tensors, dtypes = _state()
    made = CandidatePlanner(CONFIG).plan(tensors, dtypes, {})
    source: dict[str, ArrayPlan] = dict(made)
    copy = PlanSet(CONFIG, source, 1, 1)
    source.clear()  # the caller's dict is copied, not shared
    assert len(copy) == len(made) == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(made, "config", None)  # noqa: B010 - a plain assignment would not type-check
    with pytest.raises(TypeError):
        cast(Any, made.plans)["model/a.weight"] = made["model/a.weight"]  # a read-only view
    with pytest.raises(ValueError, match="read-only"):
        made["model/a.weight"].values[0, 0] = 1.0  # values are shared by every reader
    assert made.with_plans({"x": made["model/a.weight"]}) is not made and "x" not in made


def test_candidate_planner_is_a_repository_planner_that_stores_what_state_planner_stores() -> None:
    tensors, dtypes = _state()
    repo = ins.open(f"memory://cand-{uuid.uuid4().hex}", create=True)
    lazy = repo.save(tensors, dtypes=dtypes, quantize=StatePlanner(CONFIG), branch="lazy")
    whole = repo.save(tensors, dtypes=dtypes, quantize=CandidatePlanner(CONFIG), branch="whole")
    made = CandidatePlanner(CONFIG).plan(tensors, dtypes, {})
    fixed = repo.save(tensors, dtypes=dtypes, quantize=made, branch="fixed")  # a PlanSet is written as made
    ids = [{p: dict(a.chunk_ids) for p, a in repo.checkout(s.id).arrays().items()} for s in (lazy, whole, fixed)]
    assert ids[0] == ids[1] == ids[2]
    assert sorted(made) == ["model/a.weight", "model/b.weight", "model/c.weight"]
    assert made.config == CONFIG and made.logical_bytes == sum(
        a.nbytes for p, a in tensors.items() if p.startswith("model/"))


def test_candidates_keep_the_latest_plan_sets_and_every_ratio() -> None:
    tensors, dtypes = _state()
    candidates = Candidates(tensors, dtypes, {}, keep=1)
    configs = [QuantConfig(bins=b) for b in (4, 8, 16)]
    ratios = [candidates.ratio(c) for c in configs]
    assert ratios[0] > ratios[1] > ratios[2] > 1  # fewer levels, fewer bytes
    measured = [candidates.measured_ratio(c) for c in configs]  # each planned; only one held
    first = candidates.plans(configs[0])  # evicted, planned again: the same plans
    assert candidates.measured_ratio(configs[0]) == measured[0] and candidates.ratio(configs[0]) == ratios[0]
    assert CandidatePlanner(configs[0]).plan(tensors, dtypes, {}).ratio == measured[0]
    assert all(abs(r / m - 1) < 0.1 for r, m in zip(ratios, measured, strict=True))  # the estimate is close
    with pytest.raises(FormatError, match="measured_ratio"):
        _ = first.ratio  # a candidate's plans are not encoded
    assert candidates.metrics_available == ("magnitude",)
    with pytest.raises(FormatError, match="keep"):
        Candidates(tensors, dtypes, {}, keep=0)


def test_ratio_estimate_matches_the_bytes_of_a_lossless_save() -> None:
    tensors, dtypes = _state()
    repo = ins.open(f"memory://ratio-{uuid.uuid4().hex}", create=True)
    info = repo.save(tensors, dtypes=dtypes)
    estimator = RatioEstimator(tensors, dtypes=dtypes)
    stored = _stored_chunk_bytes(repo, info.id)
    assert estimator.stored_bytes({}) == stored  # the writer's own codec, chunk by chunk: exact
    assert estimator.ratio({}) == pytest.approx(estimator.logical_bytes / stored)


def test_ratio_estimate_matches_the_bytes_of_a_quantized_save() -> None:
    tensors, dtypes = _state()
    repo = ins.open(f"memory://ratio-{uuid.uuid4().hex}", create=True)
    made = CandidatePlanner(CONFIG).plan(tensors, dtypes, {})
    info = repo.save(tensors, dtypes=dtypes, quantize=made)
    stored = _stored_chunk_bytes(repo, info.id)
    assert made.stored_bytes == pytest.approx(stored, rel=0.03)
    assert made.ratio == pytest.approx(made.logical_bytes / stored, rel=0.03)
    assert made.ratio > 3  # quantized weights really are small


def test_a_big_lossless_array_is_measured_chunk_by_chunk_with_padded_edges() -> None:
    rng = np.random.default_rng(1)
    array = (rng.standard_normal((1500, 900)) * 10).astype(np.float16)  # several chunks, a short last one
    repo = ins.open(f"memory://ratio-{uuid.uuid4().hex}", create=True)
    info = repo.save({"t": array})
    assert lossless_bytes(array) == _stored_chunk_bytes(repo, info.id, prefix="t")
    assert lossless_bytes(np.zeros((0, 3), np.float32)) == 0


def test_quantized_bytes_refuses_a_lossless_plan() -> None:
    with pytest.raises(FormatError, match="inshrink.nuq"):
        quantized_bytes(ArrayPlan(np.zeros(3, np.float32), object()))
