"""Every checkpoint Lightning keeps is a version in the branch's history (issue 43, item 1).

``inshrink log`` on a user's Lightning store listed 2 of 6 kept checkpoints: each epoch saved
its top-k file, then ``last.ckpt`` on top of it; the next ``last.ckpt`` moved its tag and the
gc collected the old one from the middle of the branch, cutting the history there, so
``inshrink diff STORE main~2 main`` failed. ``last.ckpt`` is now a ref: a version off the
branch head (on its own side branch, so its restore residual is kept), never on the branch.
Skipped without Lightning.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("lightning")
torch = pytest.importorskip("torch")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

import inshrink_store as ins  # noqa: E402
from inshrink_store.lightning import InshrinkCheckpointIO, tag_for  # noqa: E402
from tests._cli_helpers import run  # noqa: E402
from tests.test_lightning import EPOCHS, fit  # noqa: E402


def test_log_lists_every_kept_checkpoint_and_last_is_a_ref(tmp_path: Path) -> None:
    url = str(tmp_path / "store")
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, monitor="val/loss", save_last=True)
    io = InshrinkCheckpointIO(url)
    trainer = fit(tmp_path / "run", io, [checkpoints])
    repo = ins.open(url)
    kept = sorted(checkpoints.best_k_models)
    assert len(kept) == EPOCHS
    history = repo.log("main")
    assert sorted(s.metadata["lightning"]["path"] for s in history) == kept  # all, and only them
    assert [s.step for s in history] == sorted((s.step for s in history), reverse=True)

    logged = json.loads(run("log", url, "--json").stdout)
    assert len(logged) == EPOCHS
    assert run("diff", url, "main~2", "main").exit_code == 0
    assert run("diff", url, f"main~{EPOCHS - 1}", "main", "--values").exit_code == 0
    rows = json.loads(run("du", url, "--json").stdout)
    assert len(rows) == EPOCHS

    last = repo.tags()[tag_for(checkpoints.last_model_path)]
    assert last not in {s.id for s in history}  # a ref, not a version of the branch
    assert repo.snapshot(last).parent == history[0].id  # off the newest kept checkpoint
    assert repo.snapshot(last).step == history[0].step
    weights = io.load_checkpoint(checkpoints.last_model_path)["state_dict"]
    assert all(torch.equal(weights[k], v) for k, v in trainer.lightning_module.state_dict().items())
    assert run("verify", url).exit_code == 0
    assert len(repo.tags()) == EPOCHS + 1


def test_top_k_removals_keep_the_kept_ones_in_the_history(tmp_path: Path) -> None:
    """save_top_k=2 by a metric: the removed ones go, the kept ones stay in main's history."""
    url = str(tmp_path / "store")
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=2, monitor="val/loss", save_last=True)
    fit(tmp_path / "run", InshrinkCheckpointIO(url), [checkpoints])
    repo = ins.open(url)
    paths = {s.metadata["lightning"]["path"] for s in repo.log("main")}
    assert set(checkpoints.best_k_models) <= paths
    assert run("verify", url).exit_code == 0
