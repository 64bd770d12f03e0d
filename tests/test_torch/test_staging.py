"""The state copy a background save starts from (``inshrink_store.torch.staging``), on the CPU.

The CUDA half (pinned buffers, copies enqueued on the loop's stream, buffers reused across
saves) is in ``tests/test_gpu/test_cuda_entry_points.py``; here the contract every device
shares: the copy is taken at the save, later in-place updates do not reach it, a tensor
shared under two names stays one tensor, and plain values are deep copies."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from inshrink_store.torch.staging import HostStaging  # noqa: E402


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
