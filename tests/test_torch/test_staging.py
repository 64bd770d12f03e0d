"""The state copy a background save starts from (``inshrink_store.torch.staging``), on the CPU.

The CUDA half (pinned buffers, copies enqueued on the loop's stream, buffers reused across
saves) is in ``tests/test_gpu/test_cuda_entry_points.py``; here the contract every device
shares: the copy is taken at the save, later in-place updates do not reach it, a tensor
shared under two names stays one tensor, and plain values are deep copies."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from inshrink_store.torch.staging import HostStaging  # noqa: E402
from tests.test_torch.fake_device import FakeDevice  # noqa: E402


def _state() -> dict:
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied, as a language model's embedding and head
    model = torch.nn.Sequential(emb, head)
    return {"model": model.state_dict(), "extra": {"epoch": 3, "order": [1, 2], "rng": torch.arange(5)}}


def test_the_copy_is_taken_at_the_save_and_later_updates_do_not_reach_it():
    state = _state()
    copied, staged = HostStaging().copy(state)
    staged.wait()
    before = state["model"]["0.weight"].clone()
    state["model"]["0.weight"].add_(1.0)  # the loop's next optimizer step, in place
    state["extra"]["order"].append(3)
    assert torch.equal(copied["model"]["0.weight"], before)
    assert copied["extra"]["order"] == [1, 2] and copied["extra"]["epoch"] == 3
    assert torch.equal(copied["extra"]["rng"], torch.arange(5))


def test_a_tensor_shared_under_two_names_is_copied_once():
    state = _state()
    assert state["model"]["0.weight"].data_ptr() == state["model"]["1.weight"].data_ptr()
    copied, _ = HostStaging().copy(state)
    assert copied["model"]["0.weight"] is copied["model"]["1.weight"]
    assert copied["model"]["0.weight"].data_ptr() != state["model"]["0.weight"].data_ptr()


def test_equal_values_in_two_tensors_stay_two_tensors():
    a, b = torch.ones(3), torch.ones(3)
    copied, _ = HostStaging().copy({"a": a, "b": b, "view": a[1:]})
    assert copied["a"] is not copied["b"]
    assert copied["view"] is not copied["a"] and copied["view"].shape == (2,)


def test_without_cuda_tensors_there_is_nothing_to_wait_for():
    copied, staged = HostStaging().copy({"w": torch.zeros(2), "n": None, "t": (1, torch.ones(1))})
    assert staged.events == []
    staged.wait()
    assert copied["n"] is None and isinstance(copied["t"], tuple) and torch.equal(copied["t"][1], torch.ones(1))


def test_a_later_copy_reuses_the_host_buffers_and_still_takes_the_new_values():
    """CPU tensors land in the previous save's buffers (no fresh allocation to fault in), each
    with this save's values; a tensor whose shape changed, or a new one, gets a new buffer."""
    staging = HostStaging()
    state = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(3), "ids": torch.arange(4)}
    first, _ = staging.copy(state)
    kept = {k: v.data_ptr() for k, v in first.items()}
    state["w"].add_(1.0)
    state["b"] = torch.ones(4)  # its shape changed
    second, _ = staging.copy(state)
    assert second["w"].data_ptr() == kept["w"] and second["ids"].data_ptr() == kept["ids"]
    assert second["b"].data_ptr() != kept["b"] and torch.equal(second["b"], torch.ones(4))
    assert torch.equal(second["w"], torch.arange(6.0).reshape(2, 3) + 1.0)
    state["w"].add_(1.0)  # the loop goes on: the copy keeps the save's values
    assert torch.equal(second["w"], torch.arange(6.0).reshape(2, 3) + 1.0)
    tied = _state()
    a, _ = staging.copy(tied)
    b, _ = staging.copy(tied)
    assert b["model"]["0.weight"] is b["model"]["1.weight"]
    assert b["model"]["0.weight"].data_ptr() == a["model"]["0.weight"].data_ptr()


def _loop_state() -> dict:
    return {"w": torch.arange(8.0), "m": torch.ones(2, 3), "step": torch.tensor(4), "lr": 0.1}


def test_the_first_save_clones_on_the_device_and_allocates_the_arena_in_the_background():
    """The loop's thread never page-locks the arena: the first stage clones, the background
    save's wait() allocates the arena and copies the clones into it, with the staged values."""
    device = FakeDevice()
    staging = HostStaging(_device=device)
    state = _loop_state()
    staged = staging.stage(state, busy=False)
    assert staged is not None and staged.mode == "device" and device.arenas == 0
    state["w"].add_(1.0)  # the loop's next step, before the background save runs
    state["m"].mul_(2.0)
    copied = staged.wait()
    assert device.arenas == 1 and device.copied_after == [2]
    assert torch.equal(copied["w"], torch.arange(8.0)) and torch.equal(copied["m"], torch.ones(2, 3))
    assert int(copied["step"]) == 4 and copied["lr"] == 0.1
    assert staged.wait() is copied  # a second wait gives the same state
    again = staging.stage(state, busy=False)  # the arena exists and no save runs: straight into it
    assert again is not None and again.mode == "host"
    assert again.wait()["w"].data_ptr() == copied["w"].data_ptr() and device.arenas == 1
    assert torch.equal(again.wait()["w"], torch.arange(8.0) + 1.0)


def _first_save(staging: HostStaging, state: Any) -> Any:
    """What the first (not busy) save of ``state`` staged, waited for."""
    first = staging.stage(state, busy=False)
    assert first is not None
    return first.wait()


def test_a_busy_save_stages_on_the_device_when_there_is_room_and_says_so_when_there_is_none():
    device = FakeDevice()
    staging = HostStaging(_device=device)
    state = _loop_state()
    _first_save(staging, state)
    busy = staging.stage(state, busy=True)
    assert busy is not None and busy.mode == "device"
    device.room_bytes = 8 * 4 + 6 * 4 - 1  # one byte short of the clones
    assert staging.stage(state, busy=True) is None  # the caller waits for the running save
    assert HostStaging(on_device=False, _device=device).stage(state, busy=True) is None
    off = HostStaging(on_device=False, _device=FakeDevice())
    first_off = off.stage(state, busy=False)
    assert first_off is not None and first_off.mode == "host"


def test_a_busy_save_never_writes_the_buffers_the_running_save_reads():
    """The running save's copy (arena views and reused host buffers) keeps its values while
    the next save is staged and the loop goes on; the queued one gets its own values."""
    staging = HostStaging(_device=FakeDevice())
    state = _loop_state()
    running = _first_save(staging, state)
    state["w"].add_(1.0)
    state["step"].add_(1)
    queued = staging.stage(state, busy=True)
    assert queued is not None
    assert torch.equal(running["w"], torch.arange(8.0)) and int(running["step"]) == 4
    # the running save ends; only then does the queued one's background copy write the arena
    copied = queued.wait()
    assert int(copied["step"]) == 5 and copied["step"].data_ptr() != running["step"].data_ptr()
    assert torch.equal(copied["w"], torch.arange(8.0) + 1.0)


def test_a_tied_tensor_is_cloned_once_on_the_device_and_keeps_one_host_copy():
    device = FakeDevice()
    staging = HostStaging(_device=device)
    tied = _state()
    staged = staging.stage(tied, busy=False)
    assert staged is not None
    copied = staged.wait()
    assert copied["model"]["0.weight"] is copied["model"]["1.weight"]
    assert device.copied_after == [1]  # the embedding once; the int rng tensor is not the device's
    assert torch.equal(copied["extra"]["rng"], torch.arange(5))


def test_clones_that_run_out_of_memory_fall_back_to_the_arena_or_to_waiting():
    """The room check reads the device's free memory; a cap it cannot see (another process,
    a per-process memory fraction) makes a clone fail: the first save then copies straight
    into the arena, and a busy one says it must wait, instead of failing the save."""
    device = FakeDevice(clones_fail=True)
    staging = HostStaging(_device=device)
    state = _loop_state()
    first = staging.stage(state, busy=False)
    assert first is not None and first.mode == "host" and device.arenas == 1
    assert torch.equal(first.wait()["w"], torch.arange(8.0))
    assert staging.stage(state, busy=True) is None
