"""Two versions may share one restore residual document.

Documents are addressed by content, so two identical quantized saves write the same
residual id. gc keeps a document while *any* version using it keeps its residual (not just
the oldest one found walking down from the head), and verify checks the document against
every version that keeps it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import inshrink_store as ins
from inshrink_store.layout import residual_path
from inshrink_store.manifest import canonical_json, content_id
from tests.test_repository._quantized_residuals import QC, quiet_quantizer, seeded  # noqa: F401 - an autouse fixture
from tests.test_repository.test_residual import _publish


def _tensor(seed: int) -> np.ndarray:
    return seeded(seed, side=64)


def test_gc_keeps_the_heads_residual_when_an_older_version_shares_it(memory_url: str) -> None:
    repo = ins.open(memory_url, create=True)
    a = _tensor(0)
    first = repo.save({"a": a}, quantize=QC, exact_resume=2)
    head = repo.save({"a": a}, quantize=QC, exact_resume=2)
    rid = head.metadata["residual"]["id"]
    assert first.metadata["residual"]["id"] == rid  # the premise: one document, two versions
    report = repo.gc(keep_last=1)
    assert residual_path(rid) not in report.deleted["residuals"]
    assert repo._storage.exists(residual_path(rid))
    repo = ins.open(memory_url)
    assert repo.verify().ok
    from inshrink_store.torch import load_state  # torch only here: the rest runs without it

    state = load_state(repo, "main", exact=True)
    assert state["a"].numpy().tobytes() == a.tobytes()


def test_gc_residuals_keeps_a_document_shared_with_a_version_past_keep_newest(memory_url: str) -> None:
    """exact_resume=2 on three identical saves: the oldest drops its residual, the two newer
    keep the same document."""
    repo = ins.open(memory_url, create=True)
    a = _tensor(1)
    infos = [repo.save({"a": a}, quantize=QC, exact_resume=2) for _ in range(3)]
    rid = infos[-1].metadata["residual"]["id"]
    assert {i.metadata["residual"]["id"] for i in infos} == {rid}
    report = repo.gc_residuals()
    assert report.deleted["residuals"] == [] and report.deleted["objects"] == []
    assert repo.residual("main") is not None
    assert ins.open(memory_url).verify().ok


def test_the_checkpointer_keeps_the_residual_of_an_unchanged_state(memory_url: str) -> None:
    """max_to_keep < exact_resume and two saves of a state that did not change."""
    torch = pytest.importorskip("torch")
    from inshrink_store.torch import Checkpointer, load_state

    repo = ins.open(memory_url, create=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    with Checkpointer(repo, model, eval_fn=None, background=False, max_to_keep=1, exact_resume=2) as ck:
        with pytest.warns(UserWarning, match="no eval_fn"):   # with the first save
            ck.save(1)
        ck.save(2)
    repo = ins.open(memory_url)
    head = repo.snapshot("main")
    assert repo._storage.exists(residual_path(head.metadata["residual"]["id"]))
    assert repo.verify().ok
    state = load_state(repo, "main", exact=True)
    assert torch.equal(state["model"]["weight"], model.state_dict()["weight"])


def test_verify_checks_a_shared_document_against_every_version_keeping_it(memory_url: str) -> None:
    """A forged head: the second version's tree, naming the first version's document (valid
    for the first version, which keeps it too, but for other stored bits than the head's)."""
    repo = ins.open(memory_url, create=True)
    first = repo.save({"a": _tensor(2)}, quantize=QC, exact_resume=4)
    repo.save({"a": _tensor(3)}, quantize=QC, exact_resume=4)
    rid = first.metadata["residual"]["id"]
    forged = _publish(repo, {"residual": {**first.metadata["residual"], "keep_newest": 4}})
    report = ins.open(memory_url).verify()
    assert not report.ok
    (problem,) = report.problems
    assert problem.kind == "residual" and problem.id == rid
    assert problem.used_by == [(forged, "residual of a")]
    assert forged[:12] in problem.error and "'a'" in problem.error


def test_verify_names_every_version_of_an_unreadable_shared_document(memory_url: str) -> None:
    repo = ins.open(memory_url, create=True)
    a = _tensor(4)
    infos = [repo.save({"a": a}, quantize=QC, exact_resume=2) for _ in range(2)]
    rid = infos[-1].metadata["residual"]["id"]
    doc = json.loads(repo._storage.read(residual_path(rid)))
    doc["format"] = 99
    repo._storage.write(residual_path(rid), canonical_json(doc))  # same name, other bytes
    assert content_id(canonical_json(doc)) != rid
    report = ins.open(memory_url).verify()
    (problem,) = report.problems
    assert problem.kind == "residual" and problem.id == rid
    assert sorted(problem.used_by) == sorted((i.id, "restore residual") for i in infos)
