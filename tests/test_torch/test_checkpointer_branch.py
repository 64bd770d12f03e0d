"""A Checkpointer on a branch other than main restores, continues and retains that branch only."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import inshrink_store as ins  # noqa: E402
from inshrink_store.torch import Checkpointer  # noqa: E402
from tests.test_torch._tiny import tiny_model, train_step  # noqa: E402

_model, _step = tiny_model, train_step


def _state(model: Any) -> dict[str, Any]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _two_branches() -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """main: steps 1-3; runB: forked from main's head, steps 101-103. Returns the repo and
    the model state of each head."""
    repo = ins.open(f"memory://ck-branch-{uuid.uuid4().hex}", create=True)
    model, opt = _model(0)
    with Checkpointer(repo, model, opt, lossless=True) as ck:
        for step in (1, 2, 3):
            _step(model, opt)
            ck.save(step)
    on_main = _state(model)
    model, opt = _model(1)
    with Checkpointer(repo, model, opt, lossless=True, branch="runB") as ck:
        ck.restore("main")
        for step in (101, 102, 103):
            _step(model, opt)
            ck.save(step)
    return repo, on_main, _state(model)


def test_restore_defaults_to_the_checkpointers_branch_and_saves_continue_it() -> None:
    """Regression: restore() loaded main, so runB's next save was parented on main's history."""
    repo, on_main, on_run_b = _two_branches()
    main_head, run_b_head = repo.branches()["main"], repo.branches()["runB"]
    model, opt = _model(2)
    with Checkpointer(repo, model, opt, lossless=True, branch="runB") as ck:
        assert ck.restore() == 103
        for k, v in on_run_b.items():
            assert torch.equal(model.state_dict()[k], v), k
        assert any(not torch.equal(model.state_dict()[k], v) for k, v in on_main.items())
        _step(model, opt)
        ck.save(104)
        info = ck.wait()
    assert info.parent == run_b_head and repo.branches() == {"main": main_head, "runB": info.id}
    assert [i.step for i in repo.log("runB")] == [104, 103, 102, 101, 3, 2, 1]


def test_a_branch_that_does_not_exist_yet_is_named_on_restore() -> None:
    repo, _, _ = _two_branches()
    model, opt = _model(3)
    with (Checkpointer(repo, model, opt, lossless=True, branch="runC") as ck,
          pytest.raises(ins.NotFoundError, match=r"Expected branch 'runC' to have a version.*restore\('main'\)")):
        ck.restore()


def test_retention_on_a_branch_collects_only_that_branchs_older_versions() -> None:
    """Regression: retention ran the store-wide gc(keep_last=N), which also cut main's history."""
    repo, _, _ = _two_branches()
    main_ids = [i.id for i in repo.log("main")]
    model, opt = _model(4)
    with Checkpointer(repo, model, opt, lossless=True, branch="runB", max_to_keep=2, keep_every_n_steps=5,
                      background=False) as ck:
        ck.restore("runB")
        for step in (104, 105):
            _step(model, opt)
            ck.save(step)
    assert [i.id for i in repo.log("main")] == main_ids  # main: all 3 versions, more than max_to_keep
    assert {repo.snapshot(sid).step for sid in repo.snapshot_ids()} == {1, 2, 3, 104, 105}
    assert [i.step for i in repo.log("runB")] == [105, 104]  # its older ones went, per its policy
    assert repo.tags() == {"keep-runB-105": repo.branches()["runB"]}
    assert repo.verify().problems == []
