"""CUDA state staged without holding the loop, and the frameworks' integrations on a GPU.

Staging (``inshrink_store.torch.staging``): the first save clones the state on the device and
the background save page-locks the arena; a save while another runs is cloned and queued
behind it; the values stored are the ones at each save, whatever the loop does afterwards.
Lightning's checkpoint IO and the HF Trainer's callback with a model on the GPU: the
version restores bit for bit, onto the GPU. Skipped without a CUDA device (torch's; CuPy is
not needed), Lightning's tests without Lightning, HF's without transformers and accelerate.
"""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

import inshrink_store as ins  # noqa: E402
from inshrink_store.torch import Checkpointer, load_state  # noqa: E402
from inshrink_store.torch.staging import HostStaging  # noqa: E402

pytestmark = pytest.mark.gpu
HANG = 120.0  # seconds: only stops a hang


def test_the_first_save_clones_on_the_device_and_the_background_pins_the_arena():
    x = torch.randn(1 << 22, device="cuda")
    m = torch.randn(1 << 20, device="cuda", dtype=torch.bfloat16)
    expected_x, expected_m = x.clone(), m.clone()
    staging = HostStaging()
    staged = staging.stage({"x": x, "tied": x, "m": m, "step": torch.tensor(3)}, busy=False)
    assert staged is not None and staged.mode == "device"
    x.add_(1.0)  # the loop's next step, enqueued after the clones on the same stream
    m.mul_(2)
    copied = staged.wait()  # the background save: arena, side-stream copies, clones freed
    assert copied["x"].is_pinned() and copied["tied"] is copied["x"] and copied["m"].is_pinned()
    assert torch.equal(copied["x"], expected_x.cpu()) and torch.equal(copied["m"], expected_m.cpu())
    assert int(copied["step"]) == 3
    again = staging.stage({"x": x, "tied": x, "m": m, "step": torch.tensor(4)}, busy=False)
    assert again is not None and again.mode == "host"  # the arena exists: straight into it
    second = again.wait()
    assert second["x"].data_ptr() == copied["x"].data_ptr()
    assert torch.equal(second["x"], (expected_x + 1.0).cpu())


def test_a_busy_save_is_cloned_and_never_touches_the_running_saves_buffers():
    x = torch.randn(1 << 20, device="cuda")
    staging = HostStaging()
    first = staging.stage({"x": x}, busy=False)
    assert first is not None
    running = first.wait()
    before = running["x"].clone()
    x.add_(1.0)
    queued = staging.stage({"x": x}, busy=True)
    assert queued is not None and queued.mode == "device"
    x.add_(1.0)
    torch.cuda.synchronize()
    assert torch.equal(running["x"], before)  # the running save's copy is untouched until it ends
    assert torch.equal(queued.wait()["x"], before + 1.0)


def test_without_room_on_the_device_a_busy_save_waits():
    class Full:
        holds = staticmethod(lambda t: bool(t.is_cuda))
        room = staticmethod(lambda device: 0)

    staging = HostStaging()
    staging._dev.room = Full.room  # no room for clones on this device
    assert staging.stage({"x": torch.ones(4, device="cuda")}, busy=True) is None
    staged = staging.stage({"x": torch.ones(4, device="cuda")}, busy=False)
    assert staged is not None and staged.mode == "host"
    assert torch.equal(staged.wait()["x"], torch.ones(4))


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 64)).cuda()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(64, 256, device="cuda", generator=g)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_a_lossless_checkpointer_queues_a_save_behind_a_running_one_and_stores_each_steps_state(tmp_path):
    model, optimizer = _model()
    _train(model, optimizer, 3, seed=1)
    repo = ins.open(str(tmp_path / "store"), create=True)
    ck = Checkpointer(repo, model, optimizer, lossless=True)
    gate, entered = threading.Event(), threading.Event()
    save = ck._save

    def held(job: Any) -> Any:  # the first background save waits for the test
        if not entered.is_set():
            entered.set()
            assert gate.wait(HANG)
        return save(job)

    ck._save = held  # type: ignore[method-assign]
    expected = {}
    try:
        ck.save(3)
        assert entered.wait(HANG)
        expected[3] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}  # not yet changed
        _train(model, optimizer, 2, seed=2)
        expected[5] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        queued = ck.save(5)  # cloned on the device and queued: returns while step 3's save is held
        assert not queued.done()
        _train(model, optimizer, 2, seed=3)  # in place, while both saves are pending
    finally:
        gate.set()
    ck.close()
    assert [info.step for info in repo.log()] == [5, 3]
    for info in repo.log():
        stored = load_state(repo, info.id)["model"]
        for name, value in expected[info.step].items():
            assert torch.equal(stored[name], value), (info.step, name)


# the frameworks' own notices on a GPU machine (dataloader workers, a checkpoint folder reused
# by the resumed run, accelerator hints) stay warnings here: these tests judge the restore
FRAMEWORK_NOTICES = "default::UserWarning"


@pytest.mark.filterwarnings(FRAMEWORK_NOTICES)
def test_lightning_on_a_gpu_saves_and_resumes_a_cuda_module_bit_exactly(tmp_path: Path):
    pl = pytest.importorskip("lightning.pytorch")
    from torch.utils.data import DataLoader, TensorDataset

    from inshrink_store.lightning import InshrinkCheckpointIO

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.linear = torch.nn.Linear(8, 1)

        def training_step(self, batch: Any, index: int) -> Any:
            x, y = batch
            return torch.nn.functional.mse_loss(self.linear(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=0.05)

    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    data = DataLoader(TensorDataset(x, x @ torch.randn(8, 1, generator=g)), batch_size=16)

    class Restored(pl.Callback):
        """At the start of training (after Lightning restored the checkpoint): the state on the GPU."""

        state: dict[str, Any] = {}
        exp_avg_on_gpu = False

        def on_train_start(self, trainer: Any, module: Any) -> None:
            Restored.state = {k: v.detach().clone() for k, v in module.state_dict().items()}
            Restored.exp_avg_on_gpu = trainer.optimizers[0].state_dict()["state"][0]["exp_avg"].is_cuda

    def trainer(epochs: int, io: Any, callbacks: list[Any]) -> Any:
        return pl.Trainer(max_epochs=epochs, accelerator="gpu", devices=1, logger=False, enable_progress_bar=False,
                          enable_model_summary=False, default_root_dir=tmp_path, plugins=[io],
                          callbacks=[pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ck", save_last=True), *callbacks])

    store = str(tmp_path / "store")
    module = Regression()
    trainer(2, InshrinkCheckpointIO(store), []).fit(module, data)
    saved = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}  # Lightning moved it back to the CPU
    trainer(3, InshrinkCheckpointIO(store), [Restored()]).fit(Regression(), data, ckpt_path="last")  # epoch 3 on
    assert Restored.state.keys() == saved.keys() and Restored.exp_avg_on_gpu
    for name, value in saved.items():
        got = Restored.state[name]
        assert got.is_cuda and torch.equal(got.cpu(), value), name


@pytest.mark.filterwarnings(FRAMEWORK_NOTICES)
def test_the_hf_trainer_on_a_gpu_checkpoints_through_the_callback_and_resumes_bit_exactly(tmp_path: Path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from inshrink_store.hf import InshrinkCallback

    def make(out: Path, callback: Any, steps: int) -> Any:
        torch.manual_seed(0)
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                         bos_token_id=0, eos_token_id=0)
        ids = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(1))
        args = transformers.TrainingArguments(
            output_dir=str(out), report_to=[], per_device_train_batch_size=8, max_steps=steps, save_steps=2,
            save_only_model=True, learning_rate=1e-2, seed=0, disable_tqdm=True)
        return transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=args,
                                    train_dataset=[{"input_ids": x, "labels": x} for x in ids],
                                    callbacks=[callback])

    url = str(tmp_path / f"store-{uuid.uuid4().hex[:6]}")
    first = InshrinkCallback(url, lossless=True)
    trained = make(tmp_path / "a", first, 2)
    trained.train()  # steps 1 and 2, the version of step 2 saved by the callback
    first.close()
    assert not list((tmp_path / "a").glob("checkpoint-*"))  # the callback, not the Trainer, checkpoints
    saved = {k: v.detach().clone() for k, v in trained.model.state_dict().items()}
    assert all(v.is_cuda for v in saved.values())
    class Restored(transformers.TrainerCallback):
        """After the callback's on_train_begin (which restores the version): the model's state."""

        state: dict[str, Any] = {}

        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            Restored.state = {k: v.detach().clone() for k, v in model.state_dict().items()}

    second = InshrinkCallback(url, lossless=True)
    resumed = make(tmp_path / "b", second, 3)
    resumed.add_callback(Restored())  # after the InshrinkCallback: sees what it restored
    resumed.train(resume_from_checkpoint=True)  # the newest version: step 2, then step 3
    second.close()
    assert resumed.state.global_step == 3
    got = Restored.state
    assert got.keys() == saved.keys()
    for name, value in saved.items():
        assert got[name].is_cuda and torch.equal(got[name], value), name
    assert [info.step for info in second.repo.log()][:2] == [3, 2]
