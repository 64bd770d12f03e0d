"""Issue 41 item 3: every commit is a compare-and-swap on the branch head, so two writers on
one branch, a restore of an older version and another process's gc never lose a version."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import inshrink_store as ins  # noqa: E402
from inshrink_store.torch import Checkpointer, load_state  # noqa: E402
from tests.test_torch._tiny import tiny_model, train_step  # noqa: E402

_model, _step = tiny_model, train_step


def _saved(ck: Checkpointer, step: int) -> Any:
    _step(ck.model, ck.optimizer)
    info = ck.save(step)
    return ck.wait() or info


def _readable(repo: Any, snapshot_id: str) -> bool:
    try:
        load_state(repo, snapshot_id)
    except ins.InshrinkError:
        return False
    return True


def test_two_checkpointers_on_one_branch_lose_no_version() -> None:
    """A0, B0, A1 with max_to_keep=2: A1 used to commit on A0, dropping B0 from the branch;
    retention deleted it and every later save of B raised NotFoundError."""
    repo = ins.open(f"memory://two-writers-{uuid.uuid4().hex}", create=True)
    a = Checkpointer(repo, *_model(0), lossless=True, max_to_keep=2, background=False)
    b = Checkpointer(repo, *_model(1), lossless=True, max_to_keep=2, background=False)
    with a, b:
        a0 = _saved(a, 0)
        b0 = _saved(b, 100)
        assert b0.parent == a0.id  # a fresh Checkpointer continues the head it finds
        with pytest.raises(ins.ConflictError) as raised:
            _saved(a, 1)
        message = str(raised.value)
        assert a0.id[:12] in message and b0.id[:12] in message and "restore" in message
        assert repo.resolve("main") == b0.id and _readable(repo, b0.id)
        b1 = _saved(b, 101)  # the writer that still holds the head goes on
        assert b1.parent == b0.id
        b2 = _saved(b, 102)
        assert _readable(repo, b1.id) and _readable(repo, b2.id)
        with pytest.raises(ins.ConflictError):  # still stale: refused again, never a NotFoundError
            _saved(a, 2)
        assert a.restore() == 102  # the fix the message names: continue from the head
        a3 = _saved(a, 103)
        assert a3.parent == b2.id
    assert [i.step for i in repo.log()] == [103, 102]
    assert repo.verify().problems == []


def test_two_background_checkpointers_report_the_conflict() -> None:
    repo = ins.open(f"memory://two-writers-bg-{uuid.uuid4().hex}", create=True)
    with Checkpointer(repo, *_model(0), lossless=True, max_to_keep=2) as a, \
            Checkpointer(repo, *_model(1), lossless=True, max_to_keep=2) as b:
        a0 = _saved(a, 0)
        b0 = _saved(b, 100)
        with pytest.raises(ins.BackgroundSaveError) as raised:
            _saved(a, 1)
        assert isinstance(raised.value.__cause__, ins.ConflictError)
        assert a0.id[:12] in str(raised.value.__cause__) and b0.id[:12] in str(raised.value.__cause__)
        b1 = _saved(b, 101)
    assert [i.id for i in repo.log()] == [b1.id, b0.id]


def test_a_save_after_restoring_an_older_version_keeps_the_replaced_head() -> None:
    """restore("main~2") then save: the new head's parent is the restored version and the
    head it replaces stays reachable (as branch ``main.replaced-<id12>``), with its history,
    whatever retention keeps of main."""
    repo = ins.open(f"memory://rollback-{uuid.uuid4().hex}", create=True)
    with Checkpointer(repo, *_model(0), lossless=True, max_to_keep=3, background=False) as ck:
        saved = [_saved(ck, step) for step in range(4)]
        assert ck.restore("main~2") == 1
        after = _saved(ck, 10)
        after2 = _saved(ck, 11)
    assert after.parent == saved[1].id and after2.parent == after.id
    kept = f"main.replaced-{saved[3].id[:12]}"
    assert repo.branches() == {"main": after2.id, kept: saved[3].id}
    for info in saved[2:]:  # both versions after the restored one: told committed, kept
        assert _readable(repo, info.id), info.step
    assert ck.last_gc is not None  # retention ran after each save
    assert [i.step for i in repo.log()][:3] == [11, 10, 1]
    assert repo.verify().problems == []


def test_restoring_the_head_replaces_nothing() -> None:
    repo = ins.open(f"memory://restore-head-{uuid.uuid4().hex}", create=True)
    with Checkpointer(repo, *_model(0), lossless=True, background=False) as ck:
        first = _saved(ck, 0)
    with Checkpointer(repo, *_model(1), lossless=True, background=False) as ck:
        ck.restore()
        second = _saved(ck, 1)
    assert second.parent == first.id and repo.branches() == {"main": second.id}


def test_a_writer_that_commits_after_a_restore_is_a_conflict() -> None:
    """The restore fixes which head the next save replaces: another writer's commit in
    between is refused, not overwritten."""
    repo = ins.open(f"memory://restore-race-{uuid.uuid4().hex}", create=True)
    with Checkpointer(repo, *_model(0), lossless=True, background=False) as ck:
        for step in range(3):
            _saved(ck, step)
        ck.restore("main~1")
        other = repo.save({"w": np.ones(3, np.float32)}, message="someone else")
        with pytest.raises(ins.ConflictError, match=other.id[:12]):
            _saved(ck, 10)
    assert repo.resolve("main") == other.id and "main.replaced" not in " ".join(repo.branches())


def _gc_in_another_process(url: str) -> None:
    done = subprocess.run([sys.executable, "-m", "inshrink_store._cli", "gc", url, "--keep-last", "1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_restored_version_collected_by_another_process_does_not_stop_saves(tmp_path: Path) -> None:
    """restore("main~2"), then `inshrink gc --keep-last 1` elsewhere: every save used to raise
    NotFoundError naming the restored snapshot. The save now goes on top of the head (the
    only version the restore would have replaced) and says so in the log."""
    url = str(tmp_path / "store")
    repo = ins.open(url, create=True)
    with Checkpointer(repo, *_model(0), lossless=True, background=False) as ck:
        saved = [_saved(ck, step) for step in range(4)]
        ck.restore("main~2")
        restored_state = {k: v.clone() for k, v in ck.model.state_dict().items()}
        _gc_in_another_process(url)
        assert saved[1].id not in ins.open(url).snapshot_ids()
        ck.model.load_state_dict(restored_state)
        first = ck.save(10)
        second = _saved(ck, 11)
    assert first.parent == saved[3].id and second.parent == first.id
    for k, v in load_state(repo, first.id)["model"].items():
        assert torch.equal(v, restored_state[k]), k
    assert repo.verify().problems == []


def test_repo_save_on_an_older_parent_keeps_the_head_or_rebases() -> None:
    repo = ins.open(f"memory://repo-save-{uuid.uuid4().hex}", create=True)
    infos = [repo.save({"w": np.full(3, i, np.float32)}, step=i) for i in range(3)]
    # an expected head that moved: refused, naming both heads, nothing written
    before = set(repo.snapshot_ids())
    with pytest.raises(ins.ConflictError) as raised:
        repo.save({"w": np.zeros(3, np.float32)}, expect_head=infos[1].id)
    assert infos[1].id[:12] in str(raised.value) and infos[2].id[:12] in str(raised.value)
    assert set(repo.snapshot_ids()) == before
    with pytest.raises(ins.ConflictError, match="not to exist"):
        repo.save({"w": np.zeros(3, np.float32)}, expect_head=None)
    # rebase=True goes on top of the head instead
    rebased = repo.save({"w": np.zeros(3, np.float32)}, parent=infos[0].id, rebase=True)
    assert rebased.parent == infos[2].id and repo.branches() == {"main": rebased.id}
    # a commit on an older parent keeps the head it replaces under a branch
    rolled = repo.save({"w": np.ones(3, np.float32)}, parent=infos[0].id, expect_head=rebased.id)
    assert rolled.parent == infos[0].id
    assert repo.branches() == {"main": rolled.id, f"main.replaced-{rebased.id[:12]}": rebased.id}
    # a fork to a new branch replaces nothing
    forked = repo.save({"w": np.ones(3, np.float32)}, branch="fork", parent=infos[2].id, expect_head=None)
    assert forked.parent == infos[2].id and "fork.replaced" not in " ".join(repo.branches())
    repo.gc(keep_last=1)
    assert np.array_equal(repo.load(rebased.id)["w"], np.zeros(3, np.float32))
