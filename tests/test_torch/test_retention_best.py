"""Retention keeps the k best versions by a metric (issue 33 item 4), as Orbax and Lightning do,
beside the newest ``max_to_keep`` and every ``keep_every_n_steps``-th: each best version holds a
``best-<step>-<id8>`` tag, a version that drops out of the top k loses it (so gc collects it), and
a version without the metric is never best."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import inshrink_store as ins  # noqa: E402
from inshrink_store.errors import InvalidInputError  # noqa: E402
from inshrink_store.torch import Checkpointer, Retention, load_state  # noqa: E402
from tests._cli_helpers import run  # noqa: E402
from tests.test_torch._tiny import tiny_model, train_step  # noqa: E402

#: (step, val_loss or None: saved without it); min-best 2 at the end: steps 4 and 5; the newest is 6
LOSSES: list[tuple[int, float | None]] = [(1, 0.9), (2, 0.5), (3, None), (4, 0.3), (5, 0.4), (6, 0.8)]


_model, _step = tiny_model, train_step


def _run(repo: Any, retention: Retention, losses: list[tuple[int, float | None]],
         branch: str = "main") -> dict[int, dict[str, Any]]:
    """Save one version per (step, loss); returns each step's model state."""
    model, opt = _model()
    saved = {}
    with Checkpointer(repo, model, opt, lossless=True, retention=retention, branch=branch) as ck:
        for step, loss in losses:
            _step(model, opt)
            metrics = {"acc": 0.5} if loss is None else {"val_loss": loss, "acc": 0.5}
            ck.save(step, metrics=metrics)
            saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
    return saved


def _steps(repo: Any) -> set[int | None]:
    return {repo.snapshot(sid).step for sid in repo.snapshot_ids()}


def _tag_names(repo: Any) -> list[str]:
    """The store's tags, a best tag's ``<id8>`` (checked against its version) written ``<id>``."""
    names = []
    for name, sid in repo.tags().items():
        if name.startswith("best-"):
            assert name.endswith(f"-{sid[:8]}"), (name, sid)
            name = f"{name[:-8]}<id>"
        names.append(name)
    return sorted(names)


def test_the_k_best_by_a_metric_survive_gc_beside_the_newest(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    repo = ins.open(url, create=True)
    saved = _run(repo, Retention(max_to_keep=1, keep_best=2, metric="val_loss", mode="min"), LOSSES)
    assert _steps(repo) == {4, 5, 6}  # steps 1 and 2 were best once, then lost their tags
    assert _tag_names(repo) == ["best-4-<id>", "best-5-<id>"]
    for sid in repo.snapshot_ids():
        step = repo.snapshot(sid).step
        state = load_state(ins.open(url), sid)
        for k, v in saved[step].items():
            assert torch.equal(state["model"][k], v), (step, k)
    assert repo.verify().problems == []


def test_mode_max_a_restart_and_keep_every_n_steps(tmp_path: Path) -> None:
    """``mode="max"`` keeps the highest; a new Checkpointer on the same branch ranks against the
    best tags already there; keep tags and best tags keep versions side by side."""
    repo = ins.open(str(tmp_path / "store"), create=True)
    retention = Retention(max_to_keep=1, keep_every_n_steps=3, keep_best=1, metric="val_loss", mode="max")
    _run(repo, retention, [(1, 0.2), (2, 0.7), (3, 0.1), (4, 0.5)])
    assert _tag_names(repo) == ["best-2-<id>", "keep-3"] and _steps(repo) == {2, 3, 4}
    _run(repo, retention, [(5, 0.6), (6, 0.9), (7, None)])  # restarted: 0.6 < 0.7 is not best, 0.9 is
    assert _tag_names(repo) == ["best-6-<id>", "keep-3", "keep-6"] and _steps(repo) == {3, 6, 7}


def test_best_tags_off_main_name_the_branch_and_other_branches_keep_theirs(tmp_path: Path) -> None:
    repo = ins.open(str(tmp_path / "store"), create=True)
    retention = Retention(max_to_keep=1, keep_best=1, metric="val_loss")
    _run(repo, retention, [(1, 0.5), (2, 0.9)])
    _run(repo, retention, [(1, 0.4), (2, 0.1), (3, 0.2)], branch="exp")
    assert _tag_names(repo) == ["best-1-<id>", "best-exp-2-<id>"]


def test_keep_best_arguments_are_checked() -> None:
    with pytest.raises(InvalidInputError, match="keep_best to be an int >= 1"):
        Retention(max_to_keep=1, keep_best=0, metric="val_loss")
    with pytest.raises(InvalidInputError, match="metric with keep_best"):
        Retention(max_to_keep=1, keep_best=2)
    with pytest.raises(InvalidInputError, match="keep_best with metric"):
        Retention(max_to_keep=1, metric="val_loss")
    with pytest.raises(InvalidInputError, match="metric to be a non-empty str"):
        Retention(max_to_keep=1, keep_best=2, metric=3)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="mode to be 'min' or 'max'"):
        Retention(max_to_keep=1, keep_best=2, metric="val_loss", mode="lowest")
    sid = "0123456789abcdef0123456789abcdef"
    assert Retention(2, keep_best=1, metric="m").best_tag_for(10, sid) == "best-10-01234567"
    assert Retention(2, keep_best=1, metric="m").best_tag_for(10, sid, "exp") == "best-exp-10-01234567"
    assert Retention(2, keep_best=1, metric="m").best_tag_for(None, sid) == "best-none-01234567"


def test_log_marks_the_kept_versions(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    repo = ins.open(url, create=True)
    _run(repo, Retention(max_to_keep=1, keep_best=2, metric="val_loss", mode="min"), LOSSES)
    table = run("log", url)
    assert table.exit_code == 0, table.output
    rows = [line.split() for line in table.output.splitlines()]
    lines = {cells[1]: " ".join(cells) for cells in rows if len(cells) > 1 and re.fullmatch("[0-9a-f]{12}", cells[1])}
    marked = {sid[:12]: name for name, sid in repo.tags().items()}
    assert set(marked) <= set(lines) and len(marked) == 2
    for short, name in marked.items():
        assert name in lines[short]
    entries = json.loads(run("log", url, "--json").output)
    assert {e["step"]: e["tags"] for e in entries} == {
        e["step"]: [f"best-{e['step']}-{e['id'][:8]}"] if e["step"] in (4, 5) else [] for e in entries}
    assert sorted(e["step"] for e in entries) == [4, 5, 6]


def _save_all(repo: Any, retention: Retention, saves: list[tuple[Any, float | None]], *,
              restore: str | None = None, first: bool = False) -> None:
    """One Checkpointer (restored from ``restore`` first when given) saving each (step, loss)."""
    model, opt = _model()
    with Checkpointer(repo, model, opt, lossless=True, retention=retention) as ck:
        if restore is not None:
            ck.restore(restore)
        for step, loss in saves:
            _step(model, opt)
            ck.save(step, metrics={"acc": 0.5} if loss is None else {"loss": loss, "acc": 0.5})


def _by_loss(repo: Any) -> dict[float | None, str]:
    """The surviving versions, by their stored loss."""
    return {repo.snapshot(sid).metrics.get("loss"): sid for sid in repo.snapshot_ids()}


def _best(repo: Any) -> dict[str, str]:
    return {name: sid for name, sid in repo.tags().items() if name.startswith("best-")}


def test_a_rollback_and_retrain_over_the_same_steps_keeps_the_better_old_version(tmp_path: Path) -> None:
    """Best tags are named per version: a version saved again at a step of an earlier best does
    not take that version's tag, so the better old version (off the head's history since the
    rollback) keeps its tag and survives gc."""
    repo = ins.open(str(tmp_path / "store"), create=True)
    retention = Retention(max_to_keep=1, keep_best=2, metric="loss")
    _save_all(repo, retention, [(4, 0.10), (5, 0.5), (6, 0.09)])
    [four] = [name for name in _best(repo) if name.startswith("best-4")]
    _save_all(repo, retention, [(5, 0.3), (6, 0.095)], restore=four)
    versions = _by_loss(repo)
    assert set(versions) == {0.09, 0.095}  # 0.10 and 0.3 dropped out of the 2 best, 0.5 long ago
    assert sorted(_best(repo).values()) == sorted(versions.values())
    for name, sid in _best(repo).items():
        assert name == f"best-{repo.snapshot(sid).step}-{sid[:8]}"
    assert repo.verify().problems == []


def test_versions_saved_without_a_step_are_ranked_by_their_id(tmp_path: Path) -> None:
    repo = ins.open(str(tmp_path / "store"), create=True)
    _save_all(repo, Retention(max_to_keep=1, keep_best=1, metric="loss"), [(None, 0.5), (None, 0.2), (None, 0.9)])
    versions = _by_loss(repo)
    assert set(versions) == {0.2, 0.9}  # the best and the newest
    assert _best(repo) == {f"best-none-{versions[0.2][:8]}": versions[0.2]}


def test_tags_made_by_hand_are_never_ranked_or_deleted(tmp_path: Path) -> None:
    repo = ins.open(str(tmp_path / "store"), create=True)
    retention = Retention(max_to_keep=1, keep_best=1, metric="loss")
    _save_all(repo, retention, [(1, 0.5), (2, 0.9)])
    head = repo.branches()["main"]
    wrong = ("0" if head[0] != "0" else "1") + head[1:8]  # named like a best tag, not for this version
    hand = {"best-100": head, f"best-2-{wrong}": head, "best": head}
    for name, sid in hand.items():
        repo.tag(name, sid)
    _save_all(repo, retention, [(3, 0.1), (4, 0.2)])
    tags = repo.tags()
    assert {name: tags.get(name) for name in hand} == hand
    ours = {name: sid for name, sid in _best(repo).items() if name not in hand}
    assert list(ours.values()) == [_by_loss(repo)[0.1]]


def test_a_best_version_left_untagged_by_a_crash_is_tagged_by_the_next_run(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The process died between the commit of a best version and its tag: the restarted run
    ranks the branch's recent versions before its first gc, so that version is not collected."""
    repo = ins.open(str(tmp_path / "store"), create=True)
    retention = Retention(max_to_keep=1, keep_best=1, metric="loss")
    _save_all(repo, retention, [(1, 0.5)])
    with monkeypatch.context() as patched:  # the crash: committed, never tagged
        patched.setattr(Checkpointer, "_retain", lambda self, info: None)
        _save_all(repo, retention, [(2, 0.1)])
    assert len(_best(repo)) == 1 and _by_loss(repo)[0.1] not in _best(repo).values()
    _save_all(repo, retention, [(3, 0.6), (4, 0.7)], restore="main")
    versions = _by_loss(repo)
    assert set(versions) == {0.1, 0.7}
    assert list(_best(repo).values()) == [versions[0.1]]


def test_old_style_best_tags_are_ranked_and_left_in_place(tmp_path: Path) -> None:
    """``best-<step>`` tags from before per-version names: a restarted run ranks them, so a
    worse version is not tagged; they are never deleted (it cannot tell them from yours)."""
    repo = ins.open(str(tmp_path / "store"), create=True)
    retention = Retention(max_to_keep=1, keep_best=1, metric="loss")
    _save_all(repo, retention, [(1, 0.5), (2, 0.2)])
    for name, sid in _best(repo).items():  # as earlier today's Retention named them
        repo.delete_tag(name)
        repo.tag(f"best-{repo.snapshot(sid).step}", sid)
    _save_all(repo, retention, [(3, 0.4)], restore="main")
    versions = _by_loss(repo)
    assert _best(repo) == {"best-2": versions[0.2]} and set(versions) == {0.2, 0.4}
    _save_all(repo, retention, [(4, 0.1), (5, 0.3)], restore="main")
    versions = _by_loss(repo)
    assert _best(repo) == {"best-2": versions[0.2], f"best-4-{versions[0.1][:8]}": versions[0.1]}
    assert set(versions) == {0.1, 0.2, 0.3}
