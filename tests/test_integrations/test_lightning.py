"""InshrinkCheckpointIO: Lightning's checkpoints as store versions (issue 33 item 1).

A run that crashes at epoch 3 and resumes from what ModelCheckpoint saved ends with the
weights, Adam state and LR of an uninterrupted run, bit for bit, whether the saves are
synchronous, on the IO's own thread, or behind Lightning's AsyncCheckpointIO; save_top_k's
removals leave exactly the checkpoints ModelCheckpoint keeps, a store that verifies, and every
kept checkpoint loadable. Skipped without Lightning (``pip install 'inshrink-store[lightning]'``).
"""

from __future__ import annotations

import importlib
import math
import re
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("lightning")
torch = pytest.importorskip("torch")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import inshrink_store as ins  # noqa: E402
from inshrink_store.errors import (  # noqa: E402
    BackgroundSaveError,
    FormatError,
    InvalidInputError,
    MissingDependencyError,
    NotFoundError,
)
from inshrink_store.lightning import InshrinkCheckpointIO, tag_for  # noqa: E402
from inshrink_store.policy import QuantConfig  # noqa: E402

EPOCHS, CRASH_AT = 4, 3


class Regression(pl.LightningModule):
    """A linear model on synthetic data with Adam and StepLR: small, deterministic (no
    dropout, no shuffling), so two runs of the same epochs give the same bits."""

    def __init__(self) -> None:
        super().__init__()
        self.save_hyperparameters({"lr": 0.05, "sizes": (8, 1), "note": None})
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(8, 1)

    def training_step(self, batch: Any, index: int) -> Any:
        x, y = batch
        return torch.nn.functional.mse_loss(self.linear(x), y)

    def validation_step(self, batch: Any, index: int) -> None:
        x, y = batch
        self.log("val/loss", torch.nn.functional.mse_loss(self.linear(x), y))  # '/' in the state's keys

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=0.05)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)]


class Crash(Callback):
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == CRASH_AT:
            raise RuntimeError("simulated crash")


def loader() -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=generator)
    y = x @ torch.randn(8, 1, generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=16)


def fit(root: Path, plugin: Any, callbacks: list[Any], ckpt_path: str | None = None) -> pl.Trainer:
    trainer = pl.Trainer(max_epochs=EPOCHS, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=root, callbacks=callbacks,
                         plugins=[plugin] if plugin is not None else None,
                         enable_checkpointing=plugin is not None)
    trainer.fit(Regression(), loader(), loader(), ckpt_path=ckpt_path)
    return trainer


def checkpoint_callback() -> ModelCheckpoint:
    return ModelCheckpoint(save_top_k=2, monitor="val/loss", every_n_epochs=1, save_last=True)


def final_state(trainer: pl.Trainer) -> dict[str, Any]:
    return {"weights": trainer.lightning_module.state_dict(), "optimizer": trainer.optimizers[0].state_dict(),
            "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict()}


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Equal values of equal types, tensors bit for bit (dtype included), NaN equal to NaN."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.bfloat16 else a,
                           b.view(torch.uint8) if b.dtype == torch.bfloat16 else b), where
        return
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict)), f"{where}: {type(a)} {type(b)}"
    if isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}/{i}")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert a == b and (not isinstance(a, float) or math.copysign(1, a) == math.copysign(1, b)), where


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return final_state(fit(tmp_path_factory.mktemp("uninterrupted"), None, []))


def plugin_for(mode: str, store: Path) -> Any:
    if mode == "async-wrapper":
        return AsyncCheckpointIO(InshrinkCheckpointIO(str(store)))
    return InshrinkCheckpointIO(str(store), background=mode == "background")


# the resumed run's ModelCheckpoint finds the crashed run's pointer files in its directory, as
# any resumed Lightning run finds its checkpoints there; Lightning warns about that
@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty:UserWarning")
@pytest.mark.parametrize("mode, resume", [("sync", "top-k path"), ("background", "last"), ("async-wrapper", "last")])
def test_resume_after_a_crash_equals_the_uninterrupted_run(tmp_path: Path, uninterrupted: dict[str, Any],
                                                           mode: str, resume: str) -> None:
    store = tmp_path / "store"
    crashed = checkpoint_callback()
    with pytest.raises(RuntimeError, match="simulated crash"):
        fit(tmp_path, plugin_for(mode, store), [crashed, Crash()])
    assert len(crashed.best_k_models) == 2  # epochs 0..2 saved, the worst one removed already
    ckpt_path = "last" if resume == "last" else max(crashed.best_k_models, key=_epoch)
    assert _epoch(ckpt_path if resume != "last" else crashed.last_model_path) in (CRASH_AT - 1, -1)

    kept = checkpoint_callback()
    trainer = fit(tmp_path, plugin_for(mode, store), [kept], ckpt_path=ckpt_path)

    assert_same(final_state(trainer), uninterrupted)
    resumed_from = [] if resume == "last" else [ckpt_path]  # ModelCheckpoint never removes it
    check_store(store, kept, resumed_from, wrapped=mode == "async-wrapper")


def check_store(store: Path, callback: ModelCheckpoint, also: list[str], *, wrapped: bool) -> None:
    """What save_top_k removed is gone, what it keeps loads, and no object is missing."""
    repo = ins.open(str(store))
    paths = sorted({*callback.best_k_models, callback.last_model_path, *also})
    expected = {tag_for(p) for p in paths}
    tags = {t: sid for t, sid in repo.tags().items() if t.startswith("ckpt-")}
    if not wrapped:
        assert set(tags) == expected
        assert sorted(repo.snapshot_ids()) == sorted(set(tags.values()))  # the head is last.ckpt's version
    else:  # AsyncCheckpointIO removes at once, saves later: an overtaken removal keeps its version
        assert set(tags) >= expected
    assert sorted(p.name for p in Path(callback.dirpath).iterdir()) == sorted(Path(p).name for p in paths)
    assert repo.verify().problems == []
    io = InshrinkCheckpointIO(repo)
    for path in paths:
        loaded = io.load_checkpoint(path)
        if "step=" in path:
            assert loaded["global_step"] == _step(path)
        else:
            assert loaded["epoch"] == EPOCHS - 1
        assert isinstance(loaded["state_dict"], OrderedDict)
        assert wrapped or hasattr(loaded["state_dict"], "_metadata")  # AsyncCheckpointIO's copy drops it
        assert loaded["optimizer_states"][0]["param_groups"][0]["betas"] == (0.9, 0.999)


def _epoch(path: str) -> int:
    found = re.search(r"epoch=(\d+)", path)
    return int(found.group(1)) if found else -1


def _step(path: str) -> int:
    found = re.search(r"step=(\d+)", path)
    assert found
    return int(found.group(1))


def tricky_checkpoint() -> dict[str, Any]:
    weight = torch.randn(4, 3)
    state_dict: Any = OrderedDict([("linear.weight", weight), ("head.weight", weight)])  # tied
    state_dict._metadata = OrderedDict([("", {"version": 1}), ("linear", {"version": 2})])
    return {
        "state_dict": state_dict,
        "epoch": 7, "global_step": 2**70, "pytorch-lightning_version": "2.6.6",
        "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(4, 3)}},
                              "param_groups": [{"betas": (0.9, 0.999), "params": [0], "foreach": None}]}],
        "callbacks": {"ModelCheckpoint{'monitor': 'val/loss'}": {"best_k_models": {"/runs/a=1.ckpt": torch.tensor(0.5)}},
                      "odd keys": {"": 1, ".": 2, "..": 3, "__x": 4, "%y": 5, "zarr.json": 6, "a\\b": 7}},
        "hyper_parameters": {"nan": float("nan"), "neg_zero": -0.0, "inf": float("inf"), "flag": True,
                             "nested": [(1, "a"), [None, 2.5]], "bf16": torch.ones(3, dtype=torch.bfloat16)},
    }


def test_a_checkpoint_comes_back_exactly_as_saved(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    io = InshrinkCheckpointIO(str(tmp_path / "store"))
    saved = tricky_checkpoint()
    path = tmp_path / "ckpt" / "epoch=7.ckpt"
    io.save_checkpoint(saved, path)
    loaded = io.load_checkpoint(path)
    assert_same(loaded, saved)
    assert loaded["state_dict"]._metadata == saved["state_dict"]._metadata
    assert loaded["state_dict"]["linear.weight"] is loaded["state_dict"]["head.weight"]  # still tied
    monkeypatch.chdir(tmp_path)
    assert io.load_checkpoint("ckpt/epoch=7.ckpt")["epoch"] == 7  # relative: the same checkpoint
    assert io.find("main") == io.find(path)  # a ref of the store works as a ckpt_path too


def test_removal_keeps_objects_other_versions_share(tmp_path: Path) -> None:
    io = InshrinkCheckpointIO(str(tmp_path / "store"))
    same = {"state_dict": {"w": torch.arange(4096, dtype=torch.float32).reshape(64, 64)}, "epoch": 0}
    for name in ("a.ckpt", "b.ckpt", "c.ckpt"):  # one weight stored once (content-addressed)
        io.save_checkpoint(same, tmp_path / name)
    io.remove_checkpoint(tmp_path / "a.ckpt")
    io.remove_checkpoint(tmp_path / "never-saved.ckpt")  # nothing to remove: no error
    repo = io.repo
    assert repo.verify().problems == []
    assert len(repo.snapshot_ids()) == 2 and io.last_gc is not None
    assert not (tmp_path / "a.ckpt").exists()
    assert_same(io.load_checkpoint(tmp_path / "b.ckpt"), same)
    with pytest.raises(NotFoundError, match="Expected a checkpoint saved at"):
        io.load_checkpoint(tmp_path / "a.ckpt")


def test_a_path_saved_again_leaves_at_most_two_old_versions(tmp_path: Path) -> None:
    """last.ckpt on a plateau (no top-k save, so no removal): its old versions are collected
    by the second save after them, without waiting for a removal or the end of fit."""
    io = InshrinkCheckpointIO(str(tmp_path / "store"))
    for epoch in range(6):
        io.save_checkpoint({"state_dict": {"w": torch.full((8,), float(epoch))}, "epoch": epoch},
                           tmp_path / "last.ckpt")
        assert len(io.repo.snapshot_ids()) <= 3
    io.teardown()
    assert len(io.repo.snapshot_ids()) == 1 and io.repo.verify().problems == []
    assert io.load_checkpoint(tmp_path / "last.ckpt")["epoch"] == 5


def test_gc_collects_only_what_the_plugin_wrote(tmp_path: Path) -> None:
    """Versions already on the branch (an imported base model, the user's own saves, one made
    between checkpoints) are never the plugin's to collect: only its own removed or superseded
    checkpoints go, whatever save_top_k and the default branch."""
    store = tmp_path / "store"
    repo = ins.open(str(store), create=True)
    base: dict[str, np.ndarray] = {"w": np.arange(4096, dtype=np.float32).reshape(64, 64),
                                   "b": np.ones(7, dtype=np.float32)}
    mine: dict[str, np.ndarray] = {"w": base["w"] * 2, "note": np.arange(5, dtype=np.int64)}
    plain = [repo.save(base, message="base model").id, repo.save(mine, message="my save").id]

    callback = ModelCheckpoint(save_top_k=1, monitor="val/loss", every_n_epochs=1)
    fit(tmp_path, InshrinkCheckpointIO(str(store)), [callback])  # branch="main", the default

    repo = ins.open(str(store))
    ids = set(repo.snapshot_ids())
    kept = {sid for t, sid in repo.tags().items() if t.startswith("ckpt-")}
    assert set(plain) <= ids
    assert ids == {*plain, *kept}  # the plugin's removed checkpoints (EPOCHS - 1 of them) are gone
    assert len(kept) == 1 and tag_for(callback.best_model_path) in repo.tags()
    for sid, arrays in zip(plain, (base, mine), strict=True):
        loaded = repo.load(sid)
        assert set(loaded) == set(arrays) and all(np.array_equal(loaded[k], arrays[k]) for k in arrays)
    assert repo.verify().ok

    # a plain version saved on top of the plugin's, then a removal: still kept, and so are the
    # older plain ones, below a history whose plugin versions are gone
    later = repo.save(mine, message="after training").id
    io = InshrinkCheckpointIO(str(store))
    io.save_checkpoint({"state_dict": {"w": torch.zeros(3)}, "epoch": 9}, tmp_path / "extra.ckpt")
    io.remove_checkpoint(callback.best_model_path)
    io.remove_checkpoint(tmp_path / "extra.ckpt")
    ids = set(repo.snapshot_ids())
    assert {*plain, later} <= ids and len(ids) == 4  # and the head, the last save
    assert all(np.array_equal(repo.load(later)[k], mine[k]) for k in mine)
    assert repo.verify().ok


def test_compressed_weights_and_exact_newest(tmp_path: Path) -> None:
    """quantize=QuantConfig: state_dict weights quantized, everything else exact; the newest
    version keeps its restore residual (exact_resume=1), so resuming from it is bit-exact."""
    io = InshrinkCheckpointIO(str(tmp_path / "store"), quantize=QuantConfig(bins=16))
    generator = torch.Generator().manual_seed(0)
    saved = []
    for epoch in range(2):
        weight = torch.randn(128, 64, generator=generator)
        saved.append({"state_dict": {"w": weight, "b": torch.randn(64, generator=generator)},
                      "optimizer_states": [{"state": {0: {"exp_avg": weight * 0.1}}}], "epoch": epoch})
        io.save_checkpoint(saved[-1], tmp_path / f"epoch={epoch}.ckpt")
    io.teardown()  # its gc drops the residuals outside the newest exact_resume versions
    assert_same(io.load_checkpoint(tmp_path / "epoch=1.ckpt"), saved[1])
    old = io.load_checkpoint(tmp_path / "epoch=0.ckpt")
    error = (old["state_dict"]["w"] - saved[0]["state_dict"]["w"]).norm() / saved[0]["state_dict"]["w"].norm()
    assert 0 < error < 0.2
    assert_same(old["optimizer_states"], saved[0]["optimizer_states"])
    assert_same(old["state_dict"]["b"], saved[0]["state_dict"]["b"])  # 1-D: lossless


def test_errors_say_what_to_do(tmp_path: Path) -> None:
    io = InshrinkCheckpointIO(str(tmp_path / "store"))
    torch.save({"state_dict": {}}, tmp_path / "plain.ckpt")
    with pytest.raises(FormatError, match="Got another file there instead"):
        io.load_checkpoint(tmp_path / "plain.ckpt")
    with pytest.raises(InvalidInputError, match="Expected quantize"):
        InshrinkCheckpointIO(str(tmp_path / "store"), quantize=16)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="Expected storage_options"):
        io.save_checkpoint({"epoch": 0}, tmp_path / "x.ckpt", storage_options={"compress": True})
    with pytest.raises(FormatError, match="no pickle"):
        io.save_checkpoint({"hyper_parameters": {"path": Path("x")}}, tmp_path / "x.ckpt")

    background = InshrinkCheckpointIO(str(tmp_path / "store"), background=True)
    (tmp_path / "blocker").write_text("a file where a folder must be")
    background.save_checkpoint({"epoch": 1}, tmp_path / "blocker" / "x.ckpt")
    with pytest.raises(BackgroundSaveError, match="background checkpoint save"):
        background.teardown()


def test_without_lightning_the_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "inshrink_store.lightning")
    for name in [m for m in sys.modules if m == "lightning" or m.startswith("lightning.")]:
        monkeypatch.setitem(sys.modules, name, None)  # an import of it now fails
    with pytest.raises(MissingDependencyError, match=r"inshrink-store\[lightning\]"):
        importlib.import_module("inshrink_store.lightning")
