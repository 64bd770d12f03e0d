"""CUDA training state at the entry points: the Checkpointer's pinned staging, its saves and
restores, ``save_state``/``load_state`` and DCP with CUDA tensors. Skipped without a CUDA
device (torch's; CuPy is not needed here)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

import inshrink_store as ins  # noqa: E402
from inshrink_store.torch import Checkpointer, load_state, save_state  # noqa: E402
from inshrink_store.torch.staging import HostStaging  # noqa: E402

pytestmark = pytest.mark.gpu


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 64)).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optimizer


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    g = torch.Generator(device="cuda").manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(64, 256, device="cuda", generator=g)
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_staging_copies_into_pinned_buffers_reused_across_saves_and_ordered_before_later_updates():
    x = torch.randn(1 << 22, device="cuda")
    expected = x.clone()
    staging = HostStaging()
    copied, staged = staging.copy({"x": x, "tied": x})
    x.add_(1.0)  # enqueued after the copy on the same stream: must not reach it
    staged.wait()
    assert copied["x"].is_pinned() and copied["tied"] is copied["x"]
    assert torch.equal(copied["x"], expected.cpu())
    again, staged = staging.copy({"x": x, "tied": x})
    staged.wait()
    assert again["x"].data_ptr() == copied["x"].data_ptr()  # the same pinned buffer, reused
    assert torch.equal(again["x"], (expected + 1.0).cpu())


def test_a_lossless_checkpointer_restores_a_cuda_run_bit_exactly(tmp_path):
    model, optimizer = _model()
    _train(model, optimizer, 5)
    repo = ins.open(str(tmp_path / "store"), create=True)
    with Checkpointer(repo, model, optimizer, lossless=True) as ck:
        ck.save(5)
        _train(model, optimizer, 1, seed=2)  # the loop goes on while the save runs
        ck.wait()
    saved = load_state(repo, "main")
    other, other_opt = _model()
    _train(other, other_opt, 5)  # the same first 5 steps: what the version must hold
    for name, value in other.state_dict().items():
        assert torch.equal(saved["model"][name], value.cpu()), name
    fresh, fresh_opt = _model()
    with Checkpointer(repo, fresh, fresh_opt, lossless=True) as ck:
        assert ck.restore() == 5
    for name, value in other.state_dict().items():
        got = fresh.state_dict()[name]
        assert got.is_cuda and torch.equal(got, value), name


def test_a_compressed_checkpointer_saves_a_cuda_model_and_restores_exactly(tmp_path):
    model, optimizer = _model()
    _train(model, optimizer, 20)
    x = torch.randn(256, 256, device="cuda", generator=torch.Generator(device="cuda").manual_seed(9))

    def evaluate(m: torch.nn.Module) -> float:
        with torch.no_grad():
            return float(m(x).pow(2).mean())

    repo = ins.open(str(tmp_path / "store"), create=True)
    with Checkpointer(repo, model, optimizer, eval_fn=evaluate, higher_is_better=False) as ck:
        ck.save(20)
        ck.wait()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    fresh, fresh_opt = _model()
    with Checkpointer(repo, fresh, fresh_opt, eval_fn=evaluate, higher_is_better=False) as ck:
        assert ck.restore() == 20
        assert ck.restored_exact
    for name, value in expected.items():
        assert torch.equal(fresh.state_dict()[name], value), name


def test_save_state_and_load_state_take_and_give_cuda_tensors(tmp_path):
    model, optimizer = _model()
    _train(model, optimizer, 2)
    repo = ins.open(str(tmp_path / "store"), create=True)
    save_state(repo, {"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    back = load_state(repo, "main", map_location="cuda")
    for name, value in model.state_dict().items():
        assert back["model"][name].is_cuda and torch.equal(back["model"][name], value), name


SINGLE_PROCESS = "ignore:torch.distributed is disabled:UserWarning"  # DCP without a process group


@pytest.mark.filterwarnings(SINGLE_PROCESS)
def test_dcp_saves_and_loads_cuda_tensors(tmp_path):
    import torch.distributed.checkpoint as dcp

    from inshrink_store.torch.dcp import InshrinkStorageReader, InshrinkStorageWriter

    model, optimizer = _model()
    _train(model, optimizer, 2)
    url = str(tmp_path / "dcp")
    ins.open(url, create=True)
    dcp.save({"model": model.state_dict()}, storage_writer=InshrinkStorageWriter(url))
    fresh, _ = _model()
    target = {"model": fresh.state_dict()}
    dcp.load(target, storage_reader=InshrinkStorageReader(url))
    for name, value in model.state_dict().items():
        assert target["model"][name].is_cuda and torch.equal(target["model"][name], value), name


@pytest.mark.filterwarnings(SINGLE_PROCESS)
def test_dcp_async_save_of_cuda_tensors_commits_what_was_staged(tmp_path):
    import torch.distributed.checkpoint as dcp

    from inshrink_store.torch.dcp import InshrinkStorageReader, InshrinkStorageWriter

    model, optimizer = _model()
    _train(model, optimizer, 2)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    url = str(tmp_path / "dcp")
    ins.open(url, create=True)
    future = dcp.async_save({"model": model.state_dict()}, storage_writer=InshrinkStorageWriter(url, step=2))
    _train(model, optimizer, 1, seed=3)  # the loop goes on: the version holds the state at the save
    future.result()
    fresh, _ = _model()
    target = {"model": fresh.state_dict()}
    dcp.load(target, storage_reader=InshrinkStorageReader(url))
    for name, value in expected.items():
        assert torch.equal(target["model"][name], value), name


def test_the_arena_holds_every_dtype_and_follows_a_changed_layout():
    state = {"w": torch.randn(33, 7, device="cuda", dtype=torch.bfloat16),
             "step": torch.tensor(5, device="cuda"), "mask": torch.rand(13, device="cuda") > 0.5,
             "empty": torch.empty(0, 4, device="cuda"), "cpu": torch.arange(3), "n": 2}
    staging = HostStaging()
    copied, staged = staging.copy(state)
    staged.wait()
    for name in ("w", "step", "mask", "empty"):
        assert copied[name].dtype == state[name].dtype and torch.equal(copied[name], state[name].cpu()), name
    assert copied["cpu"] is not state["cpu"] and copied["n"] == 2
    state["extra"] = torch.ones(5, device="cuda", dtype=torch.float64)  # a new tensor: a new arena
    again, staged = staging.copy(state)
    staged.wait()
    assert torch.equal(again["extra"], torch.ones(5, dtype=torch.float64))
    assert torch.equal(again["w"], state["w"].cpu())
