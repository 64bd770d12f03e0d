"""InshrinkCallback: a Hugging Face Trainer's saves become versions of a store, and a run
that crashed and resumed from the store is the uninterrupted run, loss for loss and weight
for weight (lossless, and compressed from the newest version's restore residual).

A tiny GPT-2 (2 layers, hidden 32) built from its config, 32 synthetic sequences, 2 epochs
of 4 steps, a save every 2 steps, dropout on: the RNG states matter. One torch thread.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import inshrink_store as ins  # noqa: E402
from inshrink_store.errors import InvalidInputError, MissingDependencyError, NotFoundError  # noqa: E402
from inshrink_store.hf import InshrinkCallback  # noqa: E402
from inshrink_store.torch import load_state, save_state  # noqa: E402


class CrashError(Exception):
    """The simulated failure."""


class CrashAt(transformers.TrainerCallback):
    """Raises at the end of step ``step``, before that step's logging and save."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            raise CrashError(self.step)


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tiny matrices: more threads only contend (a loaded 2-core machine runs 5x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_trainer(out: Path, callbacks: list[Any]) -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": x, "labels": x} for x in ids]
    args = transformers.TrainingArguments(
        output_dir=str(out), use_cpu=True, report_to=[], per_device_train_batch_size=8, num_train_epochs=2,
        save_steps=2, save_total_limit=1, save_only_model=True, logging_steps=1, learning_rate=1e-2, seed=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
    return trainer


def crash(out: Path, callback: InshrinkCallback, at: int, resume: str | None = None) -> None:
    trainer = make_trainer(out, [callback, CrashAt(at)])
    with pytest.raises(CrashError):
        trainer.train(resume_from_checkpoint=resume)
    callback.close()  # the process goes on: let the save in flight finish, as a real run's would have


def losses(trainer: Any) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def same_weights(a: Any, b: Any) -> bool:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Any:
    trainer = make_trainer(tmp_path_factory.mktemp("uninterrupted"), [])
    trainer.train()
    return trainer


def test_lossless_run_crashed_twice_and_resumed_equals_uninterrupted(tmp_path: Path, uninterrupted: Any) -> None:
    url = str(tmp_path / "store")
    crash(tmp_path / "a", InshrinkCallback(url, lossless=True), at=5)   # saved steps 2 and 4
    repo = ins.open(url)
    assert [info.step for info in repo.log()] == [4, 2]

    second = InshrinkCallback(url, lossless=True)
    folder = second.resume_path()                       # step 4: the end of epoch 1
    assert folder is not None and sorted(os.listdir(folder)) == ["model.safetensors", "trainer_state.json"]
    crash(tmp_path / "b", second, at=7, resume=folder)  # saved step 6, mid-epoch
    assert not os.path.exists(folder), "the folder goes once the Trainer has read it"

    third = InshrinkCallback(url, lossless=True)
    resumed = make_trainer(tmp_path / "c", [third])
    resumed.train(resume_from_checkpoint=third.resume_path())   # from step 6 to the end

    assert same_weights(resumed, uninterrupted)
    assert losses(resumed) == losses(uninterrupted) and len(losses(resumed)) == 8
    head = repo.log()[0]
    assert head.step == 8 and head.metrics["loss"] == losses(uninterrupted)[-1]
    saved = json.loads(load_state(repo, prefix="extra/trainer_state"))
    assert saved["global_step"] == 8 and saved["epoch"] == 2.0
    assert [e["loss"] for e in saved["log_history"] if "loss" in e] == losses(uninterrupted)
    arrays = {"/".join(name.split("/")[:2]) if name.startswith("extra/") else name.split("/")[0]
              for name in repo.checkout("main").names()}
    assert arrays == {"model", "optimizer", "extra/rng"}   # tensors; the rest is JSON, never a pickle


def test_compressed_resume_from_newest_version_is_bit_exact(tmp_path: Path, uninterrupted: Any) -> None:
    url = f"memory://hf-compressed-{tmp_path.name}"
    with pytest.warns(UserWarning, match="no eval_fn"):
        crash(tmp_path / "a", InshrinkCallback(url), at=3)   # saved step 2, quantized
    repo = ins.open(url)
    assert repo.log()[0].metadata["quantization"]["config"] is not None

    callback = InshrinkCallback(url)
    resumed = make_trainer(tmp_path / "b", [callback])
    with pytest.warns(UserWarning, match="no eval_fn"):
        resumed.train(resume_from_checkpoint=callback.resume_path())
    assert callback.checkpointer is not None and callback.checkpointer.restored_exact is True
    assert same_weights(resumed, uninterrupted)
    assert losses(resumed) == losses(uninterrupted)

    armed = InshrinkCallback(url, lossless=True)
    folder = armed.resume_path("main~1")
    with pytest.raises(InvalidInputError, match="resume_from_checkpoint"):
        make_trainer(tmp_path / "c", [armed]).train()     # the folder was not passed on
    assert folder is not None and not os.path.exists(folder)


def test_resume_from_checkpoint_true_resumes_from_the_newest_version(tmp_path: Path, uninterrupted: Any) -> None:
    """Issue 43, item 11: ``train(resume_from_checkpoint=True)``, as with the Trainer's own
    folders: the callback, made with the Trainer, puts the newest version where the Trainer
    looks (a ``checkpoint-N`` folder in ``output_dir``, gone once read)."""
    url = f"memory://hf-true-{tmp_path.name}"
    crash(tmp_path / "a", InshrinkCallback(url, lossless=True), at=7)   # saved steps 2, 4 and 6
    callback = InshrinkCallback(url, lossless=True)
    resumed = make_trainer(tmp_path / "b", [callback])
    resumed.train(resume_from_checkpoint=True)                        # from step 6 to the end
    assert same_weights(resumed, uninterrupted)
    assert losses(resumed) == losses(uninterrupted)
    assert "checkpoint-6" not in os.listdir(tmp_path / "b"), "the folder goes once the Trainer has read it"
    assert ins.open(url).log()[0].step == 8

    fresh = InshrinkCallback(url, lossless=True)                      # a store with versions, no resume:
    trainer = make_trainer(tmp_path / "c", [fresh])
    assert os.listdir(tmp_path / "c") == ["checkpoint-8"]
    trainer.train()                                                   # a fresh start, as the Trainer's
    assert same_weights(trainer, uninterrupted)
    assert fresh.checkpointer is not None and fresh.checkpointer.restored_exact is None   # nothing restored


def checkpoint_folders(out: Path) -> list[str]:
    return sorted(name for name in os.listdir(out) if name.startswith("checkpoint-")) if out.exists() else []


def test_the_trainer_writes_no_checkpoint_folders_and_a_killed_run_resumes_bit_exact(
        tmp_path: Path, uninterrupted: Any) -> None:
    """Issue 43 (HF deliverable): the callback takes the Trainer's saves (after the step's log
    and evaluation, as the Trainer's own save), so no checkpoint-N folder is written; the
    version's trainer_state.json is the one the Trainer writes, and a run killed and resumed
    is the uninterrupted run."""
    url = f"memory://hf-nofolders-{tmp_path.name}"
    crash(tmp_path / "a", InshrinkCallback(url, lossless=True), at=5)   # saved steps 2 and 4
    assert checkpoint_folders(tmp_path / "a") == []
    callback = InshrinkCallback(url, lossless=True)
    resumed = make_trainer(tmp_path / "b", [callback])
    resumed.train(resume_from_checkpoint=True)
    assert checkpoint_folders(tmp_path / "b") == []
    assert same_weights(resumed, uninterrupted) and losses(resumed) == losses(uninterrupted)
    repo = ins.open(url)
    assert [info.step for info in repo.log()] == [8, 6, 4, 2]
    assert repo.log()[0].metrics["loss"] == losses(uninterrupted)[-1]   # the step's log, attached
    # the uninterrupted run's own (last) folder: the stored state is the one the Trainer writes
    folder = Path(uninterrupted.args.output_dir) / "checkpoint-8"
    theirs = json.loads((folder / "trainer_state.json").read_text())
    ours = json.loads(load_state(repo, prefix="extra/trainer_state"))
    assert ours == theirs


def test_an_evaluation_at_the_save_step_is_in_the_version(tmp_path: Path) -> None:
    url = f"memory://hf-eval-{tmp_path.name}"
    trainer = make_trainer(tmp_path / "a", [InshrinkCallback(url, lossless=True)])
    trainer.args.eval_strategy = "steps"
    trainer.args.eval_steps = 4
    trainer.eval_dataset = trainer.train_dataset[:8]
    trainer.train()
    assert checkpoint_folders(tmp_path / "a") == []
    repo = ins.open(url)
    assert [sorted(k for k in info.metrics if k.startswith("eval_")) != [] for info in repo.log()] == \
        [True, False, True, False]                                      # steps 8, 6, 4, 2
    saved = json.loads(load_state(repo, "main~1", prefix="extra/trainer_state"))
    assert any("eval_loss" in entry for entry in saved["log_history"])


def test_best_model_tracking_keeps_the_trainers_folders_and_says_so(tmp_path: Path) -> None:
    url = f"memory://hf-best-{tmp_path.name}"
    callback = InshrinkCallback(url, lossless=True)
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16,
                                     bos_token_id=0, eos_token_id=0)
    ids = torch.randint(0, 64, (16, 16), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": x, "labels": x} for x in ids]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "a"), use_cpu=True, report_to=[], per_device_train_batch_size=8, max_steps=4,
        save_steps=2, eval_strategy="steps", eval_steps=2, load_best_model_at_end=True, save_only_model=True,
        disable_tqdm=True)
    with pytest.warns(UserWarning, match="load_best_model_at_end"):
        trainer = transformers.Trainer(model=transformers.GPT2LMHeadModel(config), args=args, train_dataset=data,
                                       eval_dataset=data[:8], callbacks=[callback])
    trainer.train()
    assert checkpoint_folders(tmp_path / "a") != []                      # the Trainer's own, as warned
    assert [info.step for info in ins.open(url).log()] == [4, 2]         # and every save a version


def test_a_stateful_callback_of_the_users_leaves_the_saves_to_the_trainer(tmp_path: Path) -> None:
    class Stateful(transformers.TrainerCallback, transformers.trainer_callback.ExportableState):
        def state(self) -> dict[str, Any]:
            return {"args": {}, "attributes": {}}

    url = f"memory://hf-stateful-{tmp_path.name}"
    trainer = make_trainer(tmp_path / "a", [InshrinkCallback(url, lossless=True), Stateful()])
    with pytest.warns(UserWarning, match="Stateful"):
        trainer.train()
    assert checkpoint_folders(tmp_path / "a") == ["checkpoint-8"]     # the Trainer's own (save_total_limit=1)
    assert [info.step for info in ins.open(url).log()] == [8, 6, 4, 2]


def test_resume_path_without_a_version_or_trainer_state(tmp_path: Path) -> None:
    callback = InshrinkCallback(f"memory://hf-empty-{tmp_path.name}")
    assert callback.resume_path() is None                   # a fresh start: train(resume_from_checkpoint=None)
    save_state(callback.repo, {"model": {"w": torch.zeros(2)}}, step=1)
    with pytest.raises(NotFoundError, match="extra/trainer_state"):
        callback.resume_path()
    with pytest.raises(NotFoundError):
        callback.resume_path("no-such-tag")


def test_options_are_checked_at_construction(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="optimizer"):
        InshrinkCallback(f"memory://hf-opts-{tmp_path.name}", optimizer=None)
    with pytest.raises(InvalidInputError, match="rng"):
        InshrinkCallback(f"memory://hf-opts-{tmp_path.name}", extra_state={"rng": object()})


def test_bad_option_combinations_are_refused_when_the_callback_is_made(tmp_path: Path) -> None:
    """Issue 43, item 5: the Checkpointer's own checks, at construction, not at train time."""
    from inshrink_store.errors import FormatError
    from inshrink_store.torch import Retention

    url = f"memory://hf-combos-{tmp_path.name}"
    with pytest.raises(InvalidInputError, match="lossless=True alone"):
        InshrinkCallback(url, lossless=True, eval_fn=lambda model: 0.0)
    with pytest.raises(InvalidInputError, match="lossless=True alone"):
        InshrinkCallback(url, lossless=True, tolerance=0.01)
    with pytest.raises(InvalidInputError, match="background=True with on_busy='skip'"):
        InshrinkCallback(url, on_busy="skip", background=False)
    with pytest.raises(InvalidInputError, match="exact_resume"):
        InshrinkCallback(url, exact_resume=-1)
    with pytest.raises(InvalidInputError, match="retention=Retention"):
        InshrinkCallback(url, retention=Retention(max_to_keep=2), max_to_keep=3)
    with pytest.raises(FormatError, match="every"):
        InshrinkCallback(url, every="often")
    with pytest.raises(InvalidInputError, match="extra_state"):
        InshrinkCallback(url, extra_state={"mine": object()})   # gives no state
    InshrinkCallback(url, lossless=True, max_to_keep=2, on_busy="skip")   # a good combination passes


def test_missing_transformers_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)   # import transformers -> ImportError
    monkeypatch.delitem(sys.modules, "inshrink_store.hf")
    with pytest.raises(MissingDependencyError, match=r"inshrink-store\[hf\]"):
        import inshrink_store.hf  # noqa: F401
