"""Every checkpoint Lightning keeps is a version in the branch's history (issue 43, item 1).

``inshrink log`` on a user's Lightning store listed 2 of 6 kept checkpoints: each epoch saved
its top-k file, then ``last.ckpt`` on top of it; the next ``last.ckpt`` moved its tag and the
gc collected the old one from the middle of the branch, cutting the history there, so
``inshrink diff STORE main~2 main`` failed. ``last.ckpt`` is now a ref: a version off the
branch head (on its own side branch, so its restore residual is kept), never on the branch.
A top-k checkpoint ``save_top_k`` evicts from the middle of the history (one older than others
it keeps) is removed by the plugin's gc like any other; ``log`` and ``main~N`` then go on past
it to the kept checkpoints below (through the branch's ref files), where they used to end.
Skipped without Lightning.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")
torch = pytest.importorskip("torch")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

import inshrink_store as ins  # noqa: E402
from inshrink_store.lightning import InshrinkCheckpointIO, tag_for  # noqa: E402
from tests._cli_helpers import run  # noqa: E402
from tests.test_integrations.test_lightning import EPOCHS, Regression, fit, loader  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


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
    rows = json.loads(run("du", url, "--json").stdout)["rows"]
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


#: val/loss by epoch: with save_top_k=3, epoch 3 evicts epoch 0 (the oldest), epoch 5 evicts
#: epoch 2 and epoch 7 evicts epoch 5 (both from the middle), epoch 6 evicts epoch 1; epoch 4
#: is never a top-k file. Kept: epochs 3, 6 and 7.
LOSSES = (5.0, 1.0, 3.0, 0.5, 4.0, 0.7, 0.2, 0.6)


class Scheduled(Regression):
    def validation_step(self, batch: Any, index: int) -> None:
        self.log("val/loss", torch.tensor(LOSSES[self.current_epoch]))


def inshrink(*args: str) -> subprocess.CompletedProcess[str]:
    """The CLI as a user runs it, in a new process."""
    return subprocess.run([sys.executable, "-m", "inshrink_store._cli", *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("background", [False, True])
def test_top_k_evicting_from_the_middle_keeps_every_kept_checkpoint_in_log(tmp_path: Path, background: bool) -> None:
    url = str(tmp_path / "store")
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=3, monitor="val/loss", save_last=True)
    io = InshrinkCheckpointIO(url, background=background)
    trainer = pl.Trainer(max_epochs=len(LOSSES), accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=tmp_path,
                         callbacks=[checkpoints], plugins=[io])
    trainer.fit(Scheduled(), loader(), loader())
    kept = sorted(checkpoints.best_k_models, key=lambda p: io.load_checkpoint(p)["global_step"], reverse=True)
    assert [io.load_checkpoint(p)["epoch"] for p in kept] == [7, 6, 3]  # the schedule did evict from the middle

    repo = ins.open(url)
    history = repo.log("main")
    assert [s.metadata["lightning"]["path"] for s in history] == kept  # all of them, in order, only them
    assert [repo.resolve(f"main~{n}") for n in range(3)] == [s.id for s in history]
    tags = repo.tags()
    assert [tags[tag_for(p)] for p in kept] == [s.id for s in history]
    assert len(tags) == len(kept) + 1  # and last.ckpt's
    last = tags[tag_for(checkpoints.last_model_path)]
    assert [s.id for s in repo.log(last)] == [last, *(s.id for s in history)]

    logged = inshrink("log", url, "--json")
    assert logged.returncode == 0, logged.stderr
    assert [e["metadata"]["lightning"]["path"] for e in json.loads(logged.stdout)] == kept
    for older in ("main~1", "main~2"):
        diff = inshrink("diff", url, older, "main", "--json")
        assert diff.returncode == 0, diff.stderr
        changed = {row["path"] for row in json.loads(diff.stdout)["tensors"] if row["status"] == "changed"}
        assert "state_dict/linear.weight" in changed  # two different checkpoints, not last.ckpt and its twin
    gone = inshrink("diff", url, "main~3", "main")
    assert gone.returncode != 0 and "history only 2 versions deep" in gone.stderr
    verified = inshrink("verify", url)
    assert verified.returncode == 0 and "4 versions" in verified.stdout, verified.stdout + verified.stderr
