"""InshrinkSearch: Lightning checkpoints searched with an eval_fn, as the Checkpointer's are
(issue 43, what was left of the Lightning plugin: it stored a fixed QuantConfig and had no
search, since a CheckpointIO never sees the module).

A small model trained by Lightning with the search on stores quantized versions whose stored
weights keep eval_fn within the tolerance, and a run that fails and restarts from "last" ends
bit-exact where an uninterrupted one ends. Bad options are refused when the callback is made,
and the callback without the plugin (or beside a fixed quantize=) when the Trainer sets up.
Skipped without Lightning (``pip install 'inshrink-store[lightning]'``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")
torch = pytest.importorskip("torch")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import inshrink_store as ins  # noqa: E402
from inshrink_store.errors import FormatError, InvalidInputError  # noqa: E402
from inshrink_store.lightning import InshrinkCheckpointIO, InshrinkSearch  # noqa: E402
from inshrink_store.policy import QuantConfig, SearchPolicy  # noqa: E402
from inshrink_store.torch import load_state  # noqa: E402

EPOCHS, FAIL_AT, TOLERANCE = 4, 2, 0.05


class Wide(pl.LightningModule):
    """Two linear layers (8,192 and 64 weights: the first is what a search quantizes) on
    synthetic data, Adam and StepLR; deterministic, so two runs of the same epochs agree."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.hidden = torch.nn.Linear(64, 128)
        self.out = torch.nn.Linear(128, 1)

    def forward(self, x: Any) -> Any:
        return self.out(torch.tanh(self.hidden(x)))

    def training_step(self, batch: Any, index: int) -> Any:
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: Any, index: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)]


def _data(seed: int) -> tuple[Any, Any]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(128, 64, generator=generator)
    return x, torch.tanh(x[:, :8]).sum(1, keepdim=True)


HELD_OUT = _data(2)


def held_out_loss(model: Any) -> float:
    """The eval_fn: the model's loss on a held-out batch (lower is better)."""
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(HELD_OUT[0]), HELD_OUT[1]))


class FailAt(Callback):
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch == FAIL_AT:
            raise RuntimeError("simulated failure")


def _fit(root: Path, plugins: list[Any] | None, callbacks: list[Any], ckpt_path: str | None = None) -> pl.Trainer:
    x, y = _data(1)
    data = DataLoader(TensorDataset(x, y), batch_size=32)
    trainer = pl.Trainer(max_epochs=EPOCHS, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=root,
                         plugins=plugins, callbacks=callbacks, enable_checkpointing=bool(plugins))
    trainer.fit(Wide(), data, data, ckpt_path=ckpt_path)
    return trainer


def _search() -> InshrinkSearch:
    return InshrinkSearch(held_out_loss, tolerance=TOLERANCE, higher_is_better=False)


def _checkpoints() -> ModelCheckpoint:
    return ModelCheckpoint(save_top_k=-1, every_n_epochs=1, save_last=True)


# the restart's ModelCheckpoint finds the failed run's pointer files, as any resumed run finds its
# checkpoints; Lightning warns about that
@pytest.mark.filterwarnings("ignore:Checkpoint directory .* exists and is not empty:UserWarning")
def test_the_search_stores_quantized_weights_within_tolerance_and_a_restart_resumes_bit_exact(tmp_path: Path) -> None:
    store = str(tmp_path / "store")
    with pytest.raises(RuntimeError, match="simulated failure"):
        _fit(tmp_path, [InshrinkCheckpointIO(store)], [_checkpoints(), _search(), FailAt()])
    resumed = _fit(tmp_path, [InshrinkCheckpointIO(store)], [_checkpoints(), _search()], ckpt_path="last")
    uninterrupted = _fit(tmp_path / "plain", None, [])
    for name, value in uninterrupted.lightning_module.state_dict().items():
        assert torch.equal(resumed.lightning_module.state_dict()[name], value), name
    assert str(resumed.optimizers[0].state_dict()) == str(uninterrupted.optimizers[0].state_dict())

    repo = ins.open(store)
    versions = repo.log("main")
    assert len(versions) == EPOCHS
    quantized = 0
    for info in versions:
        record = info.metadata["quantization"]
        assert record["tolerance"] == TOLERANCE and record["search"] is not None
        if record["config"] is None:
            continue  # nothing within tolerance: stored lossless
        quantized += 1
        model = Wide()
        model.load_state_dict(load_state(repo, info.id, prefix="state_dict", exact=False))  # what is stored
        stored = held_out_loss(model)
        # within tolerance of the saved weights' quality, which the search measured first
        assert stored <= record["baseline_quality"] * (1 + TOLERANCE) + 1e-9, info.step
        chosen = [t for t in record["search"]["trials"] if t["point"] == record["search"]["best"]]
        if chosen and chosen[-1]["quality"] is not None:  # evaluated, not inferred: the stored weights scored
            assert chosen[-1]["feasible"] and chosen[-1]["quality"] == pytest.approx(stored, rel=1e-6)
    newest = versions[0]  # it keeps its restore residual: the saved weights, exactly
    model.load_state_dict(load_state(repo, newest.id, prefix="state_dict", exact=True))
    assert held_out_loss(model) == pytest.approx(newest.metadata["quantization"]["baseline_quality"], rel=1e-6)
    assert quantized >= 1


def test_without_the_plugin_or_beside_a_fixed_quantize_the_trainer_refuses_at_setup(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match=r"plugins=\[InshrinkCheckpointIO\(url\)\]"):
        _fit(tmp_path, None, [_search()])
    io = InshrinkCheckpointIO(str(tmp_path / "store"), quantize=QuantConfig(bins=16))
    with pytest.raises(InvalidInputError, match="without quantize= beside InshrinkSearch"):
        _fit(tmp_path, [io], [_checkpoints(), _search()])
    assert not ins.open(str(tmp_path / "store"), create=True).branches()  # nothing was saved


def test_bad_options_are_refused_when_the_callback_is_made() -> None:
    with pytest.raises(InvalidInputError, match="Expected eval_fn to be a function"):
        InshrinkSearch(0.05)  # type: ignore[arg-type]  # tolerance passed as eval_fn
    with pytest.raises(FormatError, match="either policy= or the keywords"):
        InshrinkSearch(held_out_loss, policy=SearchPolicy(), tolerance=0.1)
    with pytest.raises(InvalidInputError, match="optimizer_policy"):
        InshrinkSearch(held_out_loss, optimizer_policy="lossless")
    with pytest.raises((FormatError, InvalidInputError, TypeError, ValueError)):
        InshrinkSearch(held_out_loss, tolerance=-1.0)
    search = _search()
    assert search.policy.optimizer is None and search.policy.tolerance == TOLERANCE


def test_a_save_before_the_trainer_set_the_callback_up_says_so(tmp_path: Path) -> None:
    io = InshrinkCheckpointIO(str(tmp_path / "store"))
    io.attach_search(_search())
    assert io.exact_resume == 1  # quantized versions: the newest resumes bit-exact
    with pytest.raises(InvalidInputError, match="set up by the Trainer"):
        io.save_checkpoint({"state_dict": {"w": torch.zeros(64, 64)}}, tmp_path / "x.ckpt")


@pytest.mark.parametrize("background", [False, True])
def test_a_save_searches_on_a_copy_of_the_module_in_the_background_too(tmp_path: Path, background: bool) -> None:
    """The plugin alone (no Trainer): the callback's setup attaches it, a save is searched on
    a copy made at the save (training may change the live module meanwhile), and the same
    weights saved again (last.ckpt after the top-k file) reuse that search."""
    from types import SimpleNamespace

    io = InshrinkCheckpointIO(str(tmp_path / "store"), background=background)
    module, search = Wide(), _search()
    search.setup(SimpleNamespace(strategy=SimpleNamespace(checkpoint_io=io)), module, "fit")
    calls: list[int] = []
    original = search.eval_fn
    search.eval_fn = lambda model: calls.append(1) or original(model)  # type: ignore[assignment]
    saved = {k: v.clone() for k, v in module.state_dict().items()}
    io.save_checkpoint({"state_dict": module.state_dict(), "epoch": 0, "global_step": 1}, tmp_path / "a.ckpt")
    with torch.no_grad():
        module.hidden.weight.add_(1.0)  # the loop goes on training the live module
    io._drain()  # the background save's search is done
    searched = len(calls)
    io.save_checkpoint({"state_dict": saved, "epoch": 0, "global_step": 1}, tmp_path / "last.ckpt")
    io.teardown()
    assert searched >= 2 and len(calls) == searched  # the same weights again: no second search
    repo = ins.open(str(tmp_path / "store"))
    for tag in ("a.ckpt", "last.ckpt"):
        sid = io.find(tmp_path / tag)
        record = repo.snapshot(sid).metadata["quantization"]
        assert record["config"] is not None
        stored = Wide()
        stored.load_state_dict(load_state(repo, sid, prefix="state_dict", exact=False))
        assert held_out_loss(stored) <= record["baseline_quality"] * (1 + TOLERANCE) + 1e-9
        exact = load_state(repo, sid, prefix="state_dict", exact=True)
        assert all(torch.equal(exact[k], saved[k]) for k in saved)  # the newest of each branch: exact
