"""Retention keeps the k best versions by a metric (issue 33 item 4), as Orbax and Lightning do,
beside the newest ``max_to_keep`` and every ``keep_every_n_steps``-th: each best version holds a
``best-<step>`` tag, a version that drops out of the top k loses it (so gc collects it), and a
version without the metric is never best."""

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

#: (step, val_loss or None: saved without it); min-best 2 at the end: steps 4 and 5; the newest is 6
LOSSES: list[tuple[int, float | None]] = [(1, 0.9), (2, 0.5), (3, None), (4, 0.3), (5, 0.4), (6, 0.8)]


def _model() -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _step(model: Any, opt: Any) -> None:
    opt.zero_grad()
    model(torch.randn(16, 8)).pow(2).mean().backward()
    opt.step()


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


def test_the_k_best_by_a_metric_survive_gc_beside_the_newest(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    repo = ins.open(url, create=True)
    saved = _run(repo, Retention(max_to_keep=1, keep_best=2, metric="val_loss", mode="min"), LOSSES)
    assert _steps(repo) == {4, 5, 6}  # steps 1 and 2 were best once, then lost their tags
    tags = repo.tags()
    assert sorted(tags) == ["best-4", "best-5"]
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
    assert sorted(repo.tags()) == ["best-2", "keep-3"] and _steps(repo) == {2, 3, 4}
    _run(repo, retention, [(5, 0.6), (6, 0.9), (7, None)])  # restarted: 0.6 < 0.7 is not best, 0.9 is
    assert sorted(repo.tags()) == ["best-6", "keep-3", "keep-6"] and _steps(repo) == {3, 6, 7}


def test_best_tags_off_main_name_the_branch_and_other_branches_keep_theirs(tmp_path: Path) -> None:
    repo = ins.open(str(tmp_path / "store"), create=True)
    retention = Retention(max_to_keep=1, keep_best=1, metric="val_loss")
    _run(repo, retention, [(1, 0.5), (2, 0.9)])
    _run(repo, retention, [(1, 0.4), (2, 0.1), (3, 0.2)], branch="exp")
    assert sorted(repo.tags()) == ["best-1", "best-exp-2"]


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
    assert Retention(2, keep_best=1, metric="m").best_tag_for(10) == "best-10"
    assert Retention(2, keep_best=1, metric="m").best_tag_for(10, "exp") == "best-exp-10"


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
    assert {e["step"]: e["tags"] for e in entries} == {6: [], 5: ["best-5"], 4: ["best-4"]}
