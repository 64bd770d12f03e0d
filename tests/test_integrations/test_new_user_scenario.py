"""A new user's scenario, end to end (issue 43, "Done when"): Lightning and the HF Trainer.

For each framework, following its guide (docs/guides/lightning.md, docs/guides/hugging-face.md)
with a tiny GPT-2 built from its config (nothing downloaded):

1. train with checkpoints into a local store, in a child process that is killed with SIGKILL
   once its second checkpoint is committed;
2. resume in a fresh process the documented way (Lightning: ``ckpt_path="last"``; HF:
   ``trainer.train(resume_from_checkpoint=True)``) and check that the resumed run ends with the
   weights of an uninterrupted run, bit for bit;
3. run the CLI as a user does, in subprocesses: ``inshrink log``, ``du``, ``diff URL main~1
   main``, ``export URL main out.safetensors`` and ``export URL main DIR --format hf``, whose
   folder ``from_pretrained`` loads with the trained weights;
4. compare the bytes on disk of the store with the framework's own checkpoints of the same
   schedule (the uninterrupted run: Lightning's ``.ckpt`` files from its default IO, the
   Trainer's ``checkpoint-N`` folders without the callback), printing both figures.

The file is also the child script: ``python tests/test_integrations/test_new_user_scenario.py lightning|hf ...``.
Skipped without Lightning or transformers (and accelerate for the Trainer). About 50 s on 2 cores
(4 training processes, 10 CLI runs): in the default suite.

What it found: ``export --format hf`` of a Lightning version wrote the LightningModule's keys
(``model.transformer...``), which ``from_pretrained`` did not load (it initialised every weight
at random); the export now writes the keys the config's model names.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # every model is built from a config
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
EPOCHS = 4          # Lightning: a checkpoint per epoch; HF: 2 epochs of 4 steps, a save every 2
KILL_AFTER = 2      # checkpoints committed before the SIGKILL
READY = "READY-TO-BE-KILLED"


def gpt2(dropout: float) -> Any:
    """A tiny GPT-2 (~120 k parameters), the same weights on every call."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=32,
                                     bos_token_id=0, eos_token_id=0, resid_pdrop=dropout,
                                     embd_pdrop=dropout, attn_pdrop=dropout)
    return transformers.GPT2LMHeadModel(config)


def token_ids() -> Any:
    return torch.randint(0, 256, (32, 32), generator=torch.Generator().manual_seed(1))


def wait_for_versions(url: str, count: int) -> None:
    """Until the store's main branch holds ``count`` versions (saves may commit in the background)."""
    import inshrink_store as ins

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if len(ins.open(url).log()) >= count:
                return
        except Exception:  # noqa: BLE001 - no branch yet
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{count} versions never appeared in {url}")


def hang(url: str) -> None:
    """Tell the parent the checkpoints are committed, then wait for its SIGKILL."""
    wait_for_versions(url, KILL_AFTER)
    print(READY, flush=True)
    time.sleep(600)


def save_weights(state_dict: Any, path: Path) -> None:
    torch.save({k: v.detach().clone() for k, v in state_dict.items()}, path)


# --- Lightning ------------------------------------------------------------------------------

def lightning_fit(root: Path, plugin: Any, ckpt_path: str | None = None, kill_after: bool = False) -> Any:
    """The guide's run with a GPT-2 inside a LightningModule: AdamW and StepLR, ModelCheckpoint
    keeping every epoch's checkpoint and last.ckpt. No dropout, no shuffling: Lightning does not
    restore the RNG states, so a resumed run is the uninterrupted one only where no RNG is drawn."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = gpt2(dropout=0.0)

        def training_step(self, batch: Any, index: int) -> Any:
            return self.model(input_ids=batch[0], labels=batch[0]).loss

        def validation_step(self, batch: Any, index: int) -> None:
            self.log("val_loss", self.model(input_ids=batch[0], labels=batch[0]).loss)

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
            return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)]

    class HangAtEpoch(Callback):
        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            if trainer.current_epoch == KILL_AFTER:
                hang(str(root / "store"))

    data = DataLoader(TensorDataset(token_ids()), batch_size=8)
    callbacks: list[Any] = [ModelCheckpoint(dirpath=root / "checkpoints", save_top_k=-1, save_last=True)]
    if kill_after:
        callbacks.append(HangAtEpoch())
    trainer = pl.Trainer(max_epochs=EPOCHS, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=root,
                         callbacks=callbacks, plugins=[plugin] if plugin is not None else None)
    module = LM()
    trainer.fit(module, data, data, ckpt_path=ckpt_path)
    return module


def lightning_child(root: Path, how: str) -> None:
    from inshrink_store.lightning import InshrinkCheckpointIO

    store = str(root / "store")
    if how == "killed":
        lightning_fit(root, InshrinkCheckpointIO(store), kill_after=True)
        raise AssertionError("the run was meant to be killed")
    module = lightning_fit(root, InshrinkCheckpointIO(store), ckpt_path="last")   # the guide's restart
    save_weights(module.model.state_dict(), root / "resumed.pt")


# --- Hugging Face Trainer ---------------------------------------------------------------------

def hf_trainer(out: Path, callbacks: list[Any]) -> Any:
    """The guide's run, a little larger: dropout on (the RNG states matter), 2 epochs of 4
    steps, a save every 2 steps; full checkpoints (optimizer, scheduler, RNG) where the Trainer
    writes its own folders, so they hold what a version holds."""
    args = transformers.TrainingArguments(
        output_dir=str(out), use_cpu=True, report_to=[], num_train_epochs=2, per_device_train_batch_size=8,
        save_steps=2, logging_steps=1, learning_rate=1e-2, seed=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=gpt2(dropout=0.1), args=args, callbacks=callbacks,
                                   train_dataset=[{"input_ids": x, "labels": x} for x in token_ids()])
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
    return trainer


def losses(trainer: Any) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def hf_child(root: Path, how: str) -> None:
    from inshrink_store.hf import InshrinkCallback

    store = str(root / "store")

    class HangAtStep(transformers.TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 2 * KILL_AFTER:    # the save at step 4 was asked for
                hang(store)

    if how == "killed":
        hf_trainer(root / "output", [InshrinkCallback(store, lossless=True), HangAtStep()]).train()
        raise AssertionError("the run was meant to be killed")
    trainer = hf_trainer(root / "output", [InshrinkCallback(store, lossless=True)])
    trainer.train(resume_from_checkpoint=True)          # the guide's restart: the store's newest version
    save_weights(trainer.model.state_dict(), root / "resumed.pt")
    (root / "losses.json").write_text(json.dumps(losses(trainer)))


# --- the parent: what the user sees ------------------------------------------------------------

def child_env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def run_child(framework: str, root: Path, how: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, __file__, framework, str(root), how], stdout=subprocess.PIPE,
                            text=True, env=child_env(), cwd=root)


def kill_then_resume(framework: str, root: Path) -> None:
    """The first run, SIGKILLed once its second checkpoint is committed; the restart in a new process."""
    root.mkdir(parents=True, exist_ok=True)
    with run_child(framework, root, "killed") as proc:
        assert proc.stdout is not None
        try:
            ready = any(line.strip() == READY for line in proc.stdout)   # stops reading at READY
            assert ready, f"the {framework} child ended before its checkpoints were committed"
        finally:
            proc.kill()                                  # SIGKILL
            proc.wait()
        assert proc.returncode == -9
    with run_child(framework, root, "resumed") as proc:
        proc.communicate(timeout=600)
        assert proc.returncode == 0, f"the resumed {framework} run failed"


def inshrink(*args: str) -> str:
    """The CLI a user runs, in a new process; its output, after checking it succeeded."""
    exe = shutil.which("inshrink")
    command = [exe] if exe else [sys.executable, "-m", "inshrink_store._cli"]
    proc = subprocess.run([*command, *args], capture_output=True, text=True, timeout=300, env=child_env())
    assert proc.returncode == 0, f"inshrink {' '.join(args)}: exit {proc.returncode}\n{proc.stderr}"
    return proc.stdout


def bytes_under(*paths: Path) -> int:
    return sum(f.stat().st_size for p in paths for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file())


def assert_same_weights(got: dict[str, Any], expected: dict[str, Any]) -> None:
    assert sorted(got) == sorted(expected)
    different = [k for k in expected if not torch.equal(got[k], expected[k])]
    assert different == [], f"not bit-identical: {different[:5]}"


def assert_exported(exported: dict[str, Any], expected: dict[str, Any], head: str) -> None:
    """The model's weights bit for bit, GPT-2's head (tied to the input embedding) written once."""
    assert set(exported) <= set(expected) and set(expected) - set(exported) <= {head}
    assert all(torch.equal(exported[k], expected[k]) for k in exported)


def check_cli(url: str, messages: list[str], out: Path) -> dict[str, Any]:
    """log, du, diff and export to .safetensors, as the user runs them; the exported tensors."""
    from safetensors.torch import load_file

    log = inshrink("log", url)
    print(log)
    for message in messages:
        assert message in log, f"{message!r} not in inshrink log"
    du = inshrink("du", url)
    print(du)
    assert "ratio" in du
    diff = inshrink("diff", url, "main~1", "main")
    print(diff)
    assert "changed" in diff and "transformer.h.0.attn.c_attn.weight" in diff
    print(inshrink("export", url, "main", str(out / "out.safetensors")))
    return load_file(str(out / "out.safetensors"))


def export_hf_and_load(url: str, out: Path, *options: str) -> dict[str, Any]:
    """``inshrink export URL main DIR --format hf``, then transformers' ``from_pretrained(DIR)``."""
    print(inshrink("export", url, "main", str(out / "exported"), "--format", "hf", *options))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out / "exported"))
    assert type(loaded) is transformers.GPT2LMHeadModel
    return dict(loaded.state_dict())


def report(framework: str, store: int, own: int) -> None:
    print(f"{framework}: store {store / 2**20:.2f} MiB, the framework's own checkpoints {own / 2**20:.2f} MiB, "
          f"{own / store:.2f}x")


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Any:
    """Tiny matrices: more threads only contend, and the children run with one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def lightning_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The killed run and its restart (in children), and the uninterrupted run with Lightning's
    default IO (here): the folder, and the uninterrupted run's final weights."""
    pytest.importorskip("lightning")
    tmp_path = tmp_path_factory.mktemp("lightning")
    kill_then_resume("lightning", tmp_path / "run")
    uninterrupted = lightning_fit(tmp_path / "own", None).model.state_dict()    # .ckpt files
    return tmp_path, dict(uninterrupted)


LIGHTNING_NAMES = [f"epoch={e}-step={4 * (e + 1)}.ckpt" for e in range(EPOCHS)]


def test_lightning_killed_resumed_logged_exported_and_smaller(lightning_run: tuple[Path, dict[str, Any]]) -> None:
    import inshrink_store as ins

    tmp_path, uninterrupted = lightning_run
    run, own = tmp_path / "run", tmp_path / "own"
    assert_same_weights(torch.load(run / "resumed.pt", weights_only=True), uninterrupted)

    url = str(run / "store")
    repo = ins.open(url)
    assert [s.step for s in repo.log()] == [16, 12, 8, 4]              # every kept checkpoint, in the history
    assert repo.verify().problems == []
    for folder in (own, run):
        assert sorted(p.name for p in (folder / "checkpoints").iterdir()) == sorted([*LIGHTNING_NAMES, "last.ckpt"])

    exported = check_cli(url, LIGHTNING_NAMES, tmp_path)
    # the state_dict alone, by its keys (the LightningModule's, "model." the attribute holding the GPT-2)
    assert_exported(exported, {f"model.{k}": v for k, v in uninterrupted.items()}, "model.lm_head.weight")

    store_bytes = bytes_under(run / "store", run / "checkpoints")       # the pointer files count too
    own_bytes = bytes_under(own / "checkpoints")
    report("Lightning", store_bytes, own_bytes)
    assert store_bytes < own_bytes


def test_lightning_export_format_hf_loads_in_from_pretrained(lightning_run: tuple[Path, dict[str, Any]]) -> None:
    tmp_path, uninterrupted = lightning_run
    config = tmp_path / "config"
    gpt2(dropout=0.0).config.save_pretrained(config)   # a Lightning version carries no HF config
    loaded = export_hf_and_load(str(tmp_path / "run" / "store"), tmp_path, "--config", str(config))
    assert_same_weights(loaded, uninterrupted)


def test_hf_trainer_killed_resumed_logged_exported_and_smaller(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    import inshrink_store as ins

    run = tmp_path / "run"
    kill_then_resume("hf", run)
    resumed = torch.load(run / "resumed.pt", weights_only=True)

    own = tmp_path / "own"
    trainer = hf_trainer(own, [])                                       # the Trainer's own folders
    trainer.train()
    uninterrupted = dict(trainer.model.state_dict())
    assert_same_weights(resumed, uninterrupted)
    assert json.loads((run / "losses.json").read_text()) == losses(trainer)

    url = str(run / "store")
    repo = ins.open(url)
    assert [s.step for s in repo.log()] == [8, 6, 4, 2]
    assert repo.verify().problems == []
    folders = sorted(p.name for p in own.iterdir() if p.name.startswith("checkpoint-"))
    assert folders == ["checkpoint-2", "checkpoint-4", "checkpoint-6", "checkpoint-8"]
    assert not any(p.name.startswith("checkpoint-") for p in (run / "output").iterdir()), \
        "with the callback the Trainer writes no folders of its own"

    exported = check_cli(url, [], tmp_path)
    assert_exported(exported, uninterrupted, "lm_head.weight")
    assert_same_weights(export_hf_and_load(url, tmp_path), uninterrupted)   # config.json from the version

    store_bytes = bytes_under(run / "store", run / "output")
    own_bytes = bytes_under(*(own / name for name in folders))
    report("HF Trainer", store_bytes, own_bytes)
    assert store_bytes < own_bytes


if __name__ == "__main__":  # the child: python tests/test_integrations/test_new_user_scenario.py FRAMEWORK ROOT killed|resumed
    torch.set_num_threads(1)
    framework, folder, how = sys.argv[1:4]
    (lightning_child if framework == "lightning" else hf_child)(Path(folder), how)
