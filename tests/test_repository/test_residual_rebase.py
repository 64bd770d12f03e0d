"""A rebased commit's restore residual matches the tensors the rebase gave it.

A transaction that inherits its parent and writes with ``residual=True`` inherits the
parent's residual entries for the tensors it left alone. When it loses the race and commits
with ``rebase=True``, those tensors come from the new head instead: their residual entries
must come from the head too (an entry of the old parent would XOR the wrong stored bits).
And ``verify`` checks every kept residual against its version's stored tensors, so a
mismatch is reported, not found first by an exact restore.
"""

from __future__ import annotations

import json

import numpy as np

import inshrink_store as ins
from inshrink_store.layout import residual_path
from inshrink_store.manifest import canonical_json, content_id
from inshrink_store.torch import load_state
from tests.test_repository._quantized_residuals import QC, quiet_quantizer, seeded  # noqa: F401 - an autouse fixture
from tests.test_repository.test_residual import _publish


def _raced(url: str) -> tuple[ins.Repository, dict[str, np.ndarray], ins.SnapshotInfo, ins.SnapshotInfo]:
    """base {a0, b0}; the winner changes a (a1) and commits first; the loser, opened on
    base, changes b (b1) and commits with rebase=True. Both handles write residuals."""
    repo = ins.open(url, create=True)
    repo.save({"a": seeded(0), "b": seeded(1)}, quantize=QC, exact_resume=4)
    loser = repo.transaction("main")
    loser.write({"b": seeded(3)}, quantize=QC, residual=True)
    other = ins.open(url)  # a handle of its own, like another process
    with other.transaction("main") as winner_tx:
        winner_tx.write({"a": seeded(2)}, quantize=QC, residual=True)
        winner = winner_tx.commit(message="winner", keep_residual=4)
    rebased = loser.commit(message="loser", rebase=True, keep_residual=4)
    assert rebased.parent == winner.id
    return ins.open(url), {"a": seeded(2), "b": seeded(3)}, winner, rebased


def test_a_rebased_commit_takes_the_heads_residual_for_the_heads_tensors(memory_url: str) -> None:
    repo, expected, winner, rebased = _raced(memory_url)
    for exact in (True, None):
        state = load_state(repo, rebased.id, exact=exact)
        for path, values in expected.items():
            assert state[path].numpy().tobytes() == values.tobytes(), (exact, path)
    residual = repo.residual(rebased.id)
    assert residual is not None and sorted(residual.arrays) == ["a", "b"]
    head_residual = repo.residual(winner.id)
    assert head_residual is not None and residual.arrays["a"] == head_residual.arrays["a"]
    assert repo.verify().ok


def test_verify_reports_a_residual_that_does_not_match_its_versionsseeded(memory_url: str) -> None:
    """A forged version: the head's tree with a residual whose entry for ``a`` is the base
    version's (a valid document whose pieces all decode, but for other stored bits)."""
    repo, _expected, winner, rebased = _raced(memory_url)
    base = repo.snapshot(winner.parent or "")
    doc = json.loads(repo._storage.read(residual_path(rebased.metadata["residual"]["id"])))
    doc["arrays"]["a"] = json.loads(repo._storage.read(residual_path(base.metadata["residual"]["id"])))[
        "arrays"]["a"]
    data = canonical_json(doc)
    rid = content_id(data)
    repo._storage.write(residual_path(rid), data)
    forged = _publish(repo, {"residual": {**rebased.metadata["residual"], "id": rid}})
    report = ins.open(repo.url).verify()
    assert not report.ok
    (problem,) = report.problems
    assert problem.kind == "residual" and problem.id == rid
    assert problem.used_by == [(forged, "residual of a")]
    assert forged[:12] in problem.error and "'a'" in problem.error and rid in problem.error
