"""Weights-only tiers (issue 44, deliverable 5): ``Retention(max_to_keep=N, full_state_for_last=K)``
keeps the optimizer state of the K newest versions only. An older version among the N newest is
committed again without it on ``<branch>.weights-only`` (same weights, same chunk objects), and
only then does the gc drop the whole version; restoring its optimizer is refused, naming why."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
import warnings
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import inshrink_store as ins  # noqa: E402
from inshrink_store.errors import InvalidInputError, NotFoundError  # noqa: E402
from inshrink_store.torch import Checkpointer, Retention, load_state  # noqa: E402
from inshrink_store.torch import tiers as tiers_module  # noqa: E402
from inshrink_store.torch.tiers import tier_branch, weights_only_record  # noqa: E402
from tests._cli_helpers import run  # noqa: E402
from tests.conftest import _clear_memory  # noqa: E402
from tests.test_torch._tiny import tiny_model, train_step  # noqa: E402


def _saves(repo: ins.Repository, retention: Retention | None, steps: range, **kwargs: Any) -> dict[int, Any]:
    """One lossless version per step (a trained tiny model and Adam); each step's model and
    optimizer state as saved."""
    model, opt = tiny_model()
    saved = {}
    with Checkpointer(repo, model, opt, lossless=True, retention=retention, background=False, **kwargs) as ck:
        for step in steps:
            train_step(model, opt)
            ck.save(step)
            saved[step] = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                           "optimizer": opt.state_dict()["state"][0]["exp_avg"].clone(),
                           "chunks": {p: dict(a.chunk_ids) for p, a in repo.checkout(kwargs.get("branch", "main")).arrays().items()
                                      if p.startswith("model/")}}
    return saved


def _same_model(got: dict[str, Any], expected: dict[str, Any]) -> None:
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(got[key], value), key


def _store_bytes(root: Path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)


@pytest.mark.parametrize("bad", [0, -1, 4, True, 1.5, "2"])
def test_full_state_for_last_must_be_from_1_to_max_to_keep(bad: Any) -> None:
    with pytest.raises(InvalidInputError, match=r"full_state_for_last to be an int from 1 to max_to_keep=3"):
        Retention(max_to_keep=3, full_state_for_last=bad)


def test_full_state_for_last_in_range_is_taken() -> None:
    assert Retention(3, full_state_for_last=1).weights_only == 2
    assert Retention(3, full_state_for_last=3).weights_only == 0  # every kept version whole
    assert Retention(3).weights_only == 0 and Retention(3).full_state_for_last is None


def test_six_saves_keep_the_optimizer_of_the_two_newest_and_the_weights_of_the_rest(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    repo = ins.open(url, create=True)
    saved = _saves(repo, Retention(max_to_keep=6, full_state_for_last=2), range(1, 7))

    main, tier = repo.log("main"), repo.log("main.weights-only")
    assert [v.step for v in main] == [6, 5] and [v.step for v in tier] == [4, 3, 2, 1]
    assert {repo.snapshot(sid).step for sid in repo.snapshot_ids()} == {1, 2, 3, 4, 5, 6}
    assert repo.verify().problems == []

    # the newest: model and optimizer back exactly
    model, opt = tiny_model(seed=7)
    with Checkpointer(repo, model, opt, lossless=True) as ck:
        assert ck.restore() == 6
    _same_model(model.state_dict(), saved[6]["model"])
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], saved[6]["optimizer"])

    for version in tier:
        record = weights_only_record(version)
        assert record is not None and record["dropped"] == ["optimizer"] and record["full_state_for_last"] == 2
        assert version.step is not None
        # the weights are the same chunk objects as the version saved at that step
        assert {p: dict(a.chunk_ids) for p, a in repo.checkout(version.id).arrays().items()} == \
            saved[version.step]["chunks"]
        assert not any(p.startswith("optimizer") for p in repo.checkout(version.id).arrays())
        state = load_state(repo, version.id)
        assert sorted(state) == ["model"]
        _same_model(state["model"], saved[version.step]["model"])

    # an older one: the optimizer is refused, naming the version, K and the model-only restore
    old = "main.weights-only~1"
    model, opt = tiny_model(seed=7)
    with Checkpointer(repo, model, opt, lossless=True) as ck, pytest.raises(NotFoundError) as refused:
        ck.restore(old)
    message = str(refused.value)
    assert tier[1].id[:12] in message and "step 3" in message and "full_state_for_last=2" in message
    assert "Checkpointer(repo, model).restore('main.weights-only~1')" in message
    with pytest.raises(NotFoundError, match="full_state_for_last=2"):
        load_state(repo, old, prefix="optimizer/state")
    model, _ = tiny_model(seed=7)
    with Checkpointer(repo, model, lossless=True) as ck:  # model only: what the message says
        assert ck.restore(old) == 3
    _same_model(model.state_dict(), saved[3]["model"])


def test_the_tier_takes_fewer_bytes_on_disk_and_du_log_verify_work(tmp_path: Path) -> None:
    sizes = {}
    for name, retention in [("whole", Retention(max_to_keep=6)),
                            ("tiered", Retention(max_to_keep=6, full_state_for_last=2))]:
        url = str(tmp_path / name)
        _saves(ins.open(url, create=True, keyframe_interval=2), retention, range(1, 9))
        sizes[name] = _store_bytes(tmp_path / name)
        for command in ("verify", "du"):
            result = run(command, url)
            assert result.exit_code == 0, result.output
    assert sizes["tiered"] < sizes["whole"], sizes
    result = run("log", str(tmp_path / "tiered"), "--branch", "main.weights-only")
    assert result.exit_code == 0 and result.output.count("dropped (weights only)") == 4, result.output
    summary = ins.open(str(tmp_path / "tiered")).du_summary("main")
    assert summary.total == _store_bytes(tmp_path / "tiered")


class Crash(BaseException):
    """The process dying at that point (nothing catches it)."""


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_crash_around_the_weights_only_commit_loses_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              when: str) -> None:
    """Dying before the weights-only commit leaves the version whole (no gc ran); dying after it
    leaves both until the next run's gc. Either way every step reads back and verify passes, and
    the next run makes exactly one weights-only copy of each version."""
    url = str(tmp_path / "store")
    retention = Retention(max_to_keep=4, full_state_for_last=1)
    saved = _saves(ins.open(url, create=True), retention, range(1, 3))  # step 1 is weights-only now
    real = tiers_module.write_weights_only

    def dying(*args: Any, **kwargs: Any) -> Any:
        if when == "after":
            real(*args, **kwargs)
        raise Crash

    monkeypatch.setattr(tiers_module, "write_weights_only", dying)
    model, opt = tiny_model()
    ck = Checkpointer(ins.open(url), model, opt, lossless=True, retention=retention, background=False)
    ck.restore()
    train_step(model, opt)
    with pytest.raises(Crash):
        ck.save(3)  # committed, then died copying step 2
    saved[3] = {"model": {k: v.clone() for k, v in model.state_dict().items()}}
    repo = ins.open(url)
    assert repo.verify().problems == []
    whole = {v.step for v in repo.log("main")}
    assert whole == {1, 2, 3} - {1}  # step 2 is still whole: no gc ran
    assert "optimizer" in load_state(repo, [v.id for v in repo.log("main") if v.step == 2][0])
    monkeypatch.setattr(tiers_module, "write_weights_only", real)

    more = _saves(ins.open(url), retention, range(4, 5))
    repo = ins.open(url)
    assert [v.step for v in repo.log("main")] == [4]
    tier = repo.log("main.weights-only")
    assert [v.step for v in tier] == [3, 2, 1]  # one copy each, in step order
    assert repo.verify().problems == []
    for version in tier:
        assert version.step is not None
        expected = {**saved, **more}[version.step]["model"]
        _same_model(load_state(repo, version.id)["model"], expected)


def test_a_tagged_version_keeps_its_whole_state(tmp_path: Path) -> None:
    repo = ins.open(str(tmp_path / "store"), create=True)
    _saves(repo, Retention(max_to_keep=3, keep_every_n_steps=2, full_state_for_last=1), range(1, 6))
    assert sorted(repo.tags()) == ["keep-2", "keep-4"]
    for name in ("keep-2", "keep-4"):
        assert "optimizer" in load_state(repo, name)
    # step 5 whole; 4 tagged (whole, not copied); 3 and 1 weights-only (the tier branch keeps its
    # max_to_keep - K = 2 newest: a tagged version takes no place there); 2 tagged
    assert [v.step for v in repo.log("main.weights-only")] == [3, 1]
    assert [v.step for v in repo.log("main")] == [5, 4, 2]
    assert repo.verify().problems == []


def test_off_main_the_tier_branch_names_the_branch(tmp_path: Path) -> None:
    repo = ins.open(str(tmp_path / "store"), create=True)
    _saves(repo, Retention(max_to_keep=3, full_state_for_last=1), range(1, 4), branch="exp")
    assert tier_branch("exp") == "exp.weights-only" and len(tier_branch("x" * 128)) <= 128
    assert [v.step for v in repo.log("exp.weights-only")] == [2, 1]
    assert sorted(repo.branches()) == ["exp", "exp.weights-only"]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(max_to_keep=st.integers(1, 5), data=st.data())
def test_tiers_against_a_model_of_what_is_kept(max_to_keep: int, data: st.DataObject) -> None:
    """After n saves: the branch keeps min(n, K) whole versions, the tier branch the next
    min(n - K, N - K), each version's weights read back as saved, and nothing else is left."""
    full = data.draw(st.integers(1, max_to_keep), label="full_state_for_last")
    count = data.draw(st.integers(1, 7), label="saves")
    name = f"h2-tiers-{uuid.uuid4().hex}"
    try:
        repo = ins.open(f"memory://{name}", create=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            saved = _saves(repo, Retention(max_to_keep=max_to_keep, full_state_for_last=full), range(1, count + 1))
        steps = list(range(count, 0, -1))
        assert [v.step for v in repo.log("main")] == steps[:full]
        tier_steps = steps[full:max_to_keep]
        found = [v.step for v in repo.log("main.weights-only")] if repo.head("main.weights-only") else []
        assert found == tier_steps
        assert {repo.snapshot(s).step for s in repo.snapshot_ids()} == set(steps[:max_to_keep])
        for version in repo.log("main"):
            assert "optimizer" in load_state(repo, version.id)
        for step in tier_steps:
            version = repo.resolve(f"main.weights-only~{tier_steps.index(step)}")
            _same_model(load_state(repo, version)["model"], saved[step]["model"])
        assert repo.verify().problems == []
    finally:
        _clear_memory(name)


def test_a_failed_weights_only_commit_puts_the_gc_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A storage error copying a version is logged, never raised into the loop, and the gc
    waits: it would delete that version whole. The next save copies it and collects."""
    url = str(tmp_path / "store")
    retention = Retention(max_to_keep=3, full_state_for_last=1)
    real = tiers_module.write_weights_only

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise OSError("the disk said no")

    monkeypatch.setattr(tiers_module, "write_weights_only", failing)
    _saves(ins.open(url, create=True), retention, range(1, 4))
    repo = ins.open(url)
    assert [v.step for v in repo.log("main")] == [3, 2, 1] and repo.head("main.weights-only") is None
    assert "could not keep a version weights-only" in caplog.text and "the disk said no" in caplog.text
    monkeypatch.setattr(tiers_module, "write_weights_only", real)
    _saves(ins.open(url), retention, range(4, 5))
    assert [v.step for v in repo.log("main")] == [4]
    assert [v.step for v in repo.log("main.weights-only")] == [3, 2]
    assert repo.verify().problems == []


_DIES_MIDWAY = """
import os, sys
import inshrink_store as ins
from inshrink_store import refs
from inshrink_store.torch import Checkpointer, Retention
from tests.test_torch._tiny import tiny_model, train_step

real = refs.Refs.advance
def advance(self, branch, seq, snapshot_id, replaces=None):
    if branch.endswith(".weights-only") and seq == 1:
        os._exit(3)  # the copy of step 2 wrote its trees and snapshot, not its ref: the process dies
    return real(self, branch, seq, snapshot_id, replaces)
refs.Refs.advance = advance
model, opt = tiny_model()
retention = Retention(max_to_keep=4, full_state_for_last=1)
with Checkpointer(ins.open(sys.argv[1], create=True), model, opt, lossless=True, retention=retention,
                  background=False) as ck:
    for step in range(1, 4):
        train_step(model, opt)
        ck.save(step)
"""


def test_a_process_killed_inside_the_weights_only_commit_loses_nothing(tmp_path: Path) -> None:
    """The process dies inside the copy's commit (trees and snapshot written, no ref, its writer
    lease left behind): the version stays whole, verify passes, and the next run copies it,
    collects the dead commit's leftovers and the whole version."""
    url = str(tmp_path / "store")
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", _DIES_MIDWAY, url], cwd=root, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 3, done.stderr
    repo = ins.open(url)
    assert [v.step for v in repo.log("main")] == [3, 2]  # step 2 whole: its copy never published
    assert [v.step for v in repo.log("main.weights-only")] == [1]
    assert "optimizer" in load_state(repo, repo.log("main")[1].id)
    assert repo.verify().problems == []
    # steps 2 and 3, the copy of step 1 (step 1 itself went after it), and the dead copy of step 2,
    # which no ref names: the next run's gc collects it once the copy is made again
    assert len(repo.snapshot_ids()) == 4
    before = set(repo.snapshot_ids())
    _saves(ins.open(url), Retention(max_to_keep=4, full_state_for_last=1), range(4, 5))
    assert [v.step for v in repo.log("main")] == [4]
    assert [v.step for v in repo.log("main.weights-only")] == [3, 2, 1]
    assert repo.verify().problems == []
    kept = {v.id for v in repo.log("main")} | {v.id for v in repo.log("main.weights-only")}
    assert set(repo.snapshot_ids()) == kept and not (before - kept) & set(repo.snapshot_ids())
