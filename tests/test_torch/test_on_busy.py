"""``on_busy``: what ``Checkpointer.save`` does while the previous background save still runs.

The background save is held by an ``eval_fn`` that blocks on an event, so "still running" is a
state the test controls, not a race: no wall-clock assertion below can fail under load (a
thread found still blocked is blocked; the only timeouts stop hangs).
"""

from __future__ import annotations

import gc
import logging
import threading
import uuid
import weakref
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import inshrink_store as ins  # noqa: E402
from inshrink_store.errors import InvalidInputError  # noqa: E402
from inshrink_store.policy import SearchPolicy  # noqa: E402
from inshrink_store.policy.search import SearchSpace  # noqa: E402
from inshrink_store.torch import Checkpointer  # noqa: E402
from inshrink_store.torch import checkpointer as checkpointer_module  # noqa: E402
from inshrink_store.torch.staging import HostStaging  # noqa: E402
from tests.test_torch.fake_device import FakeDevice  # noqa: E402

HANG = 60.0  # seconds: only stops a hang


class _Held:
    """An ``eval_fn`` whose calls block until :meth:`release` (then return a constant)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self._go = threading.Event()

    def __call__(self, model: Any) -> float:
        self.entered.set()
        assert self._go.wait(HANG), "the test never released the save"
        return 1.0

    def release(self) -> None:
        self._go.set()


def _held_checkpointer(on_busy: Any = "wait") -> tuple[Checkpointer, _Held, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 2))
    repo = ins.open(f"memory://busy-{uuid.uuid4().hex}", create=True)
    held = _Held()
    policy = SearchPolicy(tolerance=0.05, space=SearchSpace(bins=(16,), prune=(0.0,), protect=(0.005,)))
    ck = Checkpointer(repo, model, eval_fn=held, policy=policy, on_busy=on_busy)
    return ck, held, repo


def test_skip_returns_at_once_and_records_the_skipped_step(caplog: pytest.LogCaptureFixture) -> None:
    ck, held, repo = _held_checkpointer("skip")
    try:
        first = ck.save(10)
        assert held.entered.wait(HANG)  # the background save is inside eval_fn: running
        with caplog.at_level(logging.WARNING, logger="inshrink_store.torch.checkpointer"):
            second = ck.save(20)  # would block forever under "wait": the save is held
        assert second is first  # the running save's Future
        assert ck.skipped == [20]
        lines = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
        assert len(lines) == 1 and "step 20" in lines[0] and "step 10" in lines[0], lines
    finally:
        held.release()
    assert isinstance(second, Future) and second.result(HANG).step == 10
    ck.save(30)  # not busy any more: taken
    ck.close()
    assert [info.step for info in repo.log()] == [30, 10]
    assert ck.skipped == [20]


def _blocks_until_released(ck: Checkpointer, held: _Held, step: int, why: str) -> None:
    """``ck.save(step)`` on a thread: still inside ``save`` 0.3 s later (the running save is
    held), returned once the held save is released."""
    done = threading.Event()
    thread = threading.Thread(target=lambda: (ck.save(step), done.set()))
    thread.start()
    try:
        assert not done.wait(0.3), why
    finally:
        held.release()
    thread.join(HANG)
    assert done.is_set()


def test_wait_still_waits_for_the_running_save() -> None:
    ck, held, repo = _held_checkpointer()  # the default
    assert ck.on_busy == "wait"
    ck.save(10)
    assert held.entered.wait(HANG)
    _blocks_until_released(ck, held, 20, "save returned while the previous save was still running")
    ck.close()
    assert [info.step for info in repo.log()] == [20, 10]
    assert ck.skipped == []


def test_wait_stages_one_save_on_the_device_behind_the_running_one() -> None:
    """With room on the device for a copy of the state (device mode, staging.py), the next
    save is cloned and queued behind the running one instead of waiting for it; one more
    waits. Each version holds the weights of its own step, though training changed them in
    place while the earlier saves ran."""
    ck, held, repo = _held_checkpointer()
    ck._staging = HostStaging(_device=FakeDevice())  # every float tensor plays a CUDA tensor
    weight = ck.model[0].weight
    ck.save(10)
    assert held.entered.wait(HANG)  # the first save runs, held
    with torch.no_grad():
        weight.add_(1.0)
    at_20 = weight.detach().clone()
    second = ck.save(20)  # returns: staged on the device, queued behind step 10's save
    assert isinstance(second, Future) and not second.done()
    with torch.no_grad():
        weight.add_(1.0)
    at_30 = weight.detach().clone()
    _blocks_until_released(ck, held, 30, "a second save was queued behind the running and the queued one")
    ck.close()
    assert [info.step for info in repo.log()] == [30, 20, 10]
    snap = repo.snapshot(repo.log()[1].id)
    assert snap.step == 20
    stored_20 = ins.torch.load_state(repo, snap.id)["model"]["0.weight"]
    stored_30 = ins.torch.load_state(repo, repo.log()[0].id)["model"]["0.weight"]
    # quantized (16 levels), so near their own step's weights, 1.0 away from the other's
    assert (stored_20 - at_20).abs().max() < 0.2 and (stored_20 - at_30).abs().min() > 0.5
    assert (stored_30 - at_30).abs().max() < 0.2


def test_without_room_on_the_device_wait_waits_as_before() -> None:
    ck, held, repo = _held_checkpointer()
    ck._staging = HostStaging(_device=FakeDevice(room=0))
    ck.save(10)
    assert held.entered.wait(HANG)
    _blocks_until_released(ck, held, 20, "save returned while the running save held the only copy's buffers")
    ck.close()
    assert [info.step for info in repo.log()] == [20, 10]


def test_copy_s_is_the_copy_not_the_wait_for_the_running_save(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU save while the previous one runs waits for it (no device copy to queue); its
    ``copy_s`` in :attr:`timings` is the loop's copy, as before issue 46 item 2, not the wait.
    The clock is the test's: the wait "takes" 1000 s."""
    ck, held, _ = _held_checkpointer()
    clock = [0.0]
    monkeypatch.setattr(checkpointer_module, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    ck.save(10)
    assert held.entered.wait(HANG)
    waits = ck.wait

    def long_wait() -> Any:
        clock[0] += 1000.0
        held.release()
        return waits()

    monkeypatch.setattr(ck, "wait", long_wait)
    ck.save(20)  # waits inside, for step 10's commit
    monkeypatch.setattr(ck, "wait", waits)
    ck.close()
    assert [t["copy_s"] for t in ck.timings] == [0.0, 0.0]


def test_a_run_that_never_calls_wait_keeps_no_committed_save() -> None:
    """The HF callback and most loops call wait() only at the end: the Checkpointer keeps the
    Futures of the saves still running or queued (and failures, for wait() to raise), not one
    per committed save for the whole run; wait() still gives the last save's version."""
    model = torch.nn.Linear(4, 2)
    repo = ins.open(f"memory://busy-{uuid.uuid4().hex}", create=True)
    ck = Checkpointer(repo, model, lossless=True)
    first = ck.save(1)
    assert isinstance(first, Future) and first.result(HANG).step == 1
    committed = weakref.ref(first)
    del first
    for step in (2, 3):
        later = ck.save(step)
        assert isinstance(later, Future) and later.result(HANG).step == step
    del later
    gc.collect()
    assert committed() is None, "the Checkpointer still holds the Future of a committed save"
    info = ck.wait()
    assert info is not None and info.step == 3
    ck.close()


@pytest.mark.parametrize("bad", ["never", "Skip", None, True, 1])
def test_a_bad_on_busy_is_refused(bad: Any) -> None:
    model = torch.nn.Linear(4, 2)
    repo = ins.open(f"memory://busy-{uuid.uuid4().hex}", create=True)
    with pytest.raises(InvalidInputError, match=r"Expected on_busy to be 'wait' .* or 'skip'"):
        Checkpointer(repo, model, lossless=True, on_busy=bad)


def test_skip_needs_a_background_save() -> None:
    model = torch.nn.Linear(4, 2)
    repo = ins.open(f"memory://busy-{uuid.uuid4().hex}", create=True)
    with pytest.raises(InvalidInputError, match="background=True with on_busy='skip'"):
        Checkpointer(repo, model, lossless=True, background=False, on_busy="skip")


def test_the_hf_callback_passes_on_busy_through(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from inshrink_store.hf import InshrinkCallback

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 32, (8, 8), generator=torch.Generator().manual_seed(1))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=4, num_train_epochs=1,
        save_steps=1, save_only_model=True, learning_rate=1e-2, seed=0, disable_tqdm=True)
    callback = InshrinkCallback(f"memory://busy-hf-{uuid.uuid4().hex}", lossless=True, on_busy="skip")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=[{"input_ids": x, "labels": x} for x in ids],
                                   callbacks=[callback])
    trainer.train()
    assert callback.checkpointer is not None and callback.checkpointer.on_busy == "skip"
    # the run's last save (step 2) is never skipped: the callback waits for step 1's first
    assert [info.step for info in callback.repo.log()] == [2, 1]
