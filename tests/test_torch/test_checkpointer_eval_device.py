"""The compressed Checkpointer's ``eval_fn`` runs on a scratch copy of the model, on the model's
own device, and never touches the live model (issue 31, first deliverable).

The CUDA case is the one that failed (an ``eval_fn`` feeding CUDA batches got a CPU copy:
"Expected all tensors to be on the same device"); it runs where torch sees a GPU and is
skipped elsewhere. The rest holds on any device.
"""

from __future__ import annotations

import pytest

import inshrink_store as ins

torch = pytest.importorskip("torch")
from inshrink_store.errors import BackgroundSaveError  # noqa: E402
from inshrink_store.torch import Checkpointer  # noqa: E402


def _model(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 4)).to(device)


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: str) -> None:
    x = torch.randn(32, 64, device=device)
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _run(memory_url: str, device: str) -> tuple[list[torch.nn.Module], torch.nn.Module, dict[str, torch.Tensor]]:
    model = _model(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    batch = torch.randn(16, 64, device=device)
    seen: list[torch.nn.Module] = []

    def evaluate(candidate: torch.nn.Module) -> float:
        seen.append(candidate)
        with torch.no_grad():
            return candidate(batch).square().mean().item()  # batches where the user's model lives

    _train(model, optimizer, device)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with Checkpointer(ins.open(memory_url, create=True), model, optimizer, eval_fn=evaluate) as ck:
        ck.save(1)
    return seen, model, before


def test_eval_fn_gets_a_scratch_copy_on_the_models_device_and_the_live_model_is_untouched(memory_url: str) -> None:
    seen, model, before = _run(memory_url, "cpu")
    assert seen and all(candidate is not model for candidate in seen)
    device = next(model.parameters()).device
    assert all(p.device == device for candidate in seen for p in candidate.parameters())
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)


def test_the_scratch_copy_gets_its_weights_back_after_each_candidate(memory_url: str) -> None:
    """Every evaluation starts from the saved weights: a candidate's values never leak into the
    next candidate's model (each is the unquantized state with only its own tensors swapped)."""
    model = _model("cpu")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    _train(model, optimizer, "cpu")
    bias = model[0].bias.detach().clone()  # 1-D: stays lossless, so every candidate holds it exactly
    biases: list[torch.Tensor] = []

    def evaluate(candidate: torch.nn.Module) -> float:
        biases.append(candidate[0].bias.detach().clone())
        candidate[0].bias.data.add_(1.0)  # an eval_fn that scribbles on what it was given
        return 0.0

    with Checkpointer(ins.open(memory_url, create=True), model, optimizer, eval_fn=evaluate) as ck:
        ck.save(1)
    assert len(biases) >= 2
    for seen in biases[1:]:  # the baseline call scores the copy as it is; every candidate after it is reloaded
        torch.testing.assert_close(seen, bias, rtol=0, atol=0)


def test_an_eval_fn_that_raises_fails_the_save_and_leaves_the_live_model(memory_url: str) -> None:
    model = _model("cpu")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    _train(model, optimizer, "cpu")
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    calls = []

    def evaluate(candidate: torch.nn.Module) -> float:
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("evaluation failed")
        return 0.0

    repo = ins.open(memory_url, create=True)
    ck = Checkpointer(repo, model, optimizer, eval_fn=evaluate)
    ck.save(1)
    with pytest.raises(BackgroundSaveError, match=r"checkpoint of step 1 to commit"):
        ck.wait()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)
    assert "main" not in repo.branches()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_model_is_evaluated_on_its_gpu(memory_url: str) -> None:
    seen, model, _ = _run(memory_url, "cuda")
    assert seen and all(p.is_cuda for candidate in seen for p in candidate.parameters())


def test_one_scratch_copy_serves_every_save_with_that_saves_weights(memory_url: str) -> None:
    """The scratch copy is made with the Checkpointer (not in a save, where a deep copy held
    the loop), reused by later saves, and loaded with each save's own weights before its
    first evaluation: what one save's eval_fn scribbled never reaches the next. A model whose
    tensors change (a new buffer) gets a new copy."""
    model = _model("cpu")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    seen: list[tuple[torch.nn.Module, torch.Tensor]] = []

    def evaluate(candidate: torch.nn.Module) -> float:
        seen.append((candidate, candidate[0].bias.detach().clone()))
        candidate[0].bias.data.add_(100.0)  # scribbles on what it was given
        return 0.0

    repo = ins.open(memory_url, create=True)
    with Checkpointer(repo, model, optimizer, eval_fn=evaluate) as ck:
        made = ck._scratch
        assert made is not None and made[1] is not model  # made before any save
        live_biases = []
        for step in (1, 2):
            _train(model, optimizer, "cpu")
            live_biases.append(model[0].bias.detach().clone())
            start = len(seen)
            ck.save(step)
            ck.wait()
            first_candidate, first_bias = seen[start]
            assert first_candidate is made[1]  # the same copy, save after save
            torch.testing.assert_close(first_bias, live_biases[-1], rtol=0, atol=0)  # this save's weights
        model.register_buffer("count", torch.zeros(3))
        _train(model, optimizer, "cpu")
        start = len(seen)
        ck.save(3)
        ck.wait()
        assert seen[start][0] is not made[1] and hasattr(seen[start][0], "count")
    assert [info.step for info in repo.log()] == [3, 2, 1]
