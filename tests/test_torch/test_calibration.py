"""Calibration: a model's diagonal Fisher and the allocation weights measured from it, and the
planner that saves with them."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import inshrink_store as ins  # noqa: E402
from inshrink_store.errors import InvalidInputError  # noqa: E402
from inshrink_store.policy import AllocationPlanner  # noqa: E402
from inshrink_store.policy.sensitivity import ROLE_WEIGHTS  # noqa: E402
from inshrink_store.torch import allocate, calibration_fisher, calibration_weights  # noqa: E402


def _sequential(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 50, (8, 5), generator=torch.Generator().manual_seed(seed))


class TwoBranch(nn.Module):
    """``query(x) + value(x)``: both branches see the same input and reach the output alike,
    so the one with the larger weights moves the output more under the same relative error."""

    def __init__(self, seed: int = 0, value_scale: float = 1.0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.query = nn.Linear(16, 16, bias=False)
        self.value = nn.Linear(16, 16, bias=False)
        with torch.no_grad():
            self.value.weight.mul_(value_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.query(x) + self.value(x)


class Keywords(nn.Module):
    """Takes keyword arguments and returns a tuple (the output first), as many models do."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, dict]:
        return self.proj(x) * scale, {"aux": None}


def _snapshot(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    return {n: (p.detach().clone(), None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}


def _assert_unchanged(model: nn.Module, before: dict[str, tuple[torch.Tensor, torch.Tensor | None]]) -> None:
    for n, p in model.named_parameters():
        value, grad = before[n]
        assert torch.equal(p.detach(), value), n
        if grad is None:
            assert p.grad is None, n
        else:
            assert p.grad is not None and torch.equal(p.grad, grad), n


def test_fisher_is_non_negative_float64_shaped_like_each_parameter() -> None:
    model = _sequential()
    fisher = calibration_fisher(model, _tokens())
    params = dict(model.named_parameters())
    assert set(fisher) == set(params)
    for n, f in fisher.items():
        assert isinstance(f, np.ndarray) and f.dtype == np.float64
        assert f.shape == tuple(params[n].shape), n
        assert np.all(np.isfinite(f)) and np.all(f >= 0), n
    assert fisher["3.weight"].sum() > 0 and fisher["1.weight"].sum() > 0
    # rows of tokens the batch never used got no gradient
    used = np.unique(_tokens().numpy())
    unused = np.setdiff1d(np.arange(50), used)
    assert np.all(fisher["0.weight"][unused] == 0)
    assert np.all(fisher["0.weight"][used].sum(axis=1) > 0)


@pytest.mark.parametrize("training", [True, False])
def test_parameters_grads_and_mode_are_left_as_they_were(training: bool) -> None:
    model = _sequential()
    model.train(training)
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            if i % 2 == 0:
                p.grad = torch.full_like(p, 3.0 + i)  # some grads set, others None
    before = _snapshot(model)
    assert any(g is None for _, g in before.values()) and any(g is not None for _, g in before.values())
    calibration_fisher(model, _tokens())
    _assert_unchanged(model, before)
    assert model.training is training
    assert all(m.training is training for m in model.modules())
    calibration_weights(model, _tokens(), loss=lambda out: out.square().mean())
    calibration_weights(model, lambda m: m(_tokens()).square().mean())
    _assert_unchanged(model, before)
    assert model.training is training


def test_a_grad_is_restored_as_a_copy_not_zeroed_or_accumulated_into() -> None:
    model = _sequential()
    grad = torch.full_like(model[1].weight, 0.5)
    model[1].weight.grad = grad
    calibration_fisher(model, _tokens())
    assert torch.equal(model[1].weight.grad, torch.full_like(grad, 0.5))
    assert torch.equal(grad, torch.full_like(grad, 0.5))


def test_a_submodule_in_eval_mode_stays_in_eval_mode() -> None:
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 32), nn.Dropout(0.5), nn.Linear(32, 4))
    model.train()
    model[2].eval()
    calibration_fisher(model, _tokens())
    assert model.training and not model[2].training


def test_the_same_model_and_batch_give_the_same_weights() -> None:
    a = calibration_weights(_sequential(), _tokens())
    b = calibration_weights(_sequential(), _tokens())
    assert a == b
    assert calibration_weights(_sequential(), _tokens(), seed=0) == a
    fa, fb = calibration_fisher(_sequential(), _tokens()), calibration_fisher(_sequential(), _tokens())
    assert all(np.array_equal(fa[n], fb[n]) for n in fa)
    # the global torch RNG neither drives the draws nor is consumed by them
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    assert calibration_weights(_sequential(), _tokens()) == a
    torch.manual_seed(123)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_weights_have_mean_one_and_are_finite_and_positive() -> None:
    model = _sequential()
    for weights in (calibration_weights(model, _tokens()),
                    calibration_weights(model, _tokens(), loss=lambda out: out.logsumexp(-1).mean()),
                    calibration_weights(model, lambda m: m(_tokens())[..., 0].mean())):
        assert set(weights) == {n for n, _ in model.named_parameters()}
        assert all(w > 0 and math.isfinite(w) for w in weights.values())
        assert sum(weights.values()) / len(weights) == pytest.approx(1.0, rel=1e-6)


def test_a_callable_and_a_loss_measure_the_same_thing() -> None:
    model = _sequential()
    tokens = _tokens()

    def loss(out: torch.Tensor) -> torch.Tensor:
        return out.square().mean()

    by_loss = calibration_fisher(model, tokens, loss=loss)
    by_callable = calibration_fisher(model, lambda m: loss(m(tokens)))
    assert set(by_loss) == set(by_callable)
    for n in by_loss:
        np.testing.assert_allclose(by_loss[n], by_callable[n], rtol=1e-12, atol=0)
    # one pass: the squared gradient of that loss itself
    model.zero_grad(set_to_none=True)
    loss(model(tokens)).backward()
    for n, p in model.named_parameters():
        np.testing.assert_allclose(by_loss[n], p.grad.double().square().numpy(), rtol=1e-12, atol=0)
    model.zero_grad(set_to_none=True)


def test_a_keyword_batch_and_a_tuple_output_are_taken() -> None:
    model = Keywords()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    fisher = calibration_fisher(model, {"x": x, "scale": 2.0})
    assert set(fisher) == {"proj.weight", "proj.bias"}
    positional = calibration_fisher(model, (x, 2.0))
    for n in fisher:
        np.testing.assert_array_equal(fisher[n], positional[n])


@pytest.mark.parametrize("how", ["loss", "callable"])
def test_a_loss_that_is_not_a_scalar_is_refused_and_the_model_left_alone(how: str) -> None:
    model = _sequential()
    model.train()
    model[1].weight.grad = torch.ones_like(model[1].weight)
    before = _snapshot(model)
    with pytest.raises(InvalidInputError, match="scalar"):
        if how == "loss":
            calibration_fisher(model, _tokens(), loss=lambda out: out)
        else:
            calibration_fisher(model, lambda m: m(_tokens()).sum(-1))
    _assert_unchanged(model, before)
    assert model.training
    with pytest.raises(InvalidInputError, match="scalar"):
        calibration_fisher(model, lambda m: 1.0)  # not a tensor at all
    with pytest.raises(InvalidInputError):
        allocate(model, target_ratio=4, calibration=_tokens(), loss=lambda out: out.mean(-1))


@pytest.mark.parametrize("draws", [0, -1, 1.5, True])
def test_bad_draws_are_refused(draws: object) -> None:
    with pytest.raises(InvalidInputError, match="draws"):
        calibration_fisher(_sequential(), _tokens(), draws=draws)  # type: ignore[arg-type]


def test_the_branch_the_output_depends_on_most_gets_the_largest_weight() -> None:
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(0))
    even = calibration_weights(TwoBranch(value_scale=1.0), x)
    assert set(even) == {"query.weight", "value.weight"}
    assert 0.3 < even["value.weight"] / even["query.weight"] < 3.0  # alike, up to their random init
    skewed = calibration_weights(TwoBranch(value_scale=10.0), x)
    assert max(skewed, key=skewed.__getitem__) == "value.weight"
    # the same gradients, 100x the mean square: about 100x the weight (relative to the even case)
    ratio = (skewed["value.weight"] / skewed["query.weight"]) / (even["value.weight"] / even["query.weight"])
    assert ratio == pytest.approx(100.0, rel=0.05)
    assert sum(skewed.values()) / 2 == pytest.approx(1.0)


def test_a_frozen_parameter_gets_no_fisher_and_the_smallest_weight() -> None:
    model = _sequential()
    model[1].weight.requires_grad_(False)
    fisher = calibration_fisher(model, _tokens())
    assert "1.weight" not in fisher
    weights = calibration_weights(model, _tokens())
    assert weights["1.weight"] == min(weights.values()) and 0 < weights["1.weight"] < 1e-3
    assert model[1].weight.grad is None


@pytest.mark.parametrize("prefix", ["", "model/"])
def test_allocate_returns_a_planner_that_saves_the_state_and_reads_back(prefix: str, memory_url: str) -> None:
    model = _sequential()
    before = _snapshot(model)
    planner = allocate(model, target_ratio=4, calibration=_tokens(), prefix=prefix, min_numel=256)
    _assert_unchanged(model, before)
    assert isinstance(planner, AllocationPlanner)
    assert planner.allocation.target_ratio == 4 and planner.allocation.min_numel == 256
    names = {prefix + n for n, _ in model.named_parameters()}
    assert planner.weights is not None and set(planner.weights) == names
    assert planner.weights == calibration_weights(model, _tokens(), prefix=prefix)
    assert planner.module_kinds[f"{prefix}0.weight"] == "Embedding"
    assert planner.module_kinds[f"{prefix}1.weight"] == "Linear"
    state = {prefix + n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    repo = ins.init(memory_url)
    info = repo.save(state, quantize=planner)
    assert planner.decision is not None
    priced = set(planner.decision.levels)
    assert priced == {f"{prefix}0.weight", f"{prefix}1.weight"}  # the 2-D tensors of >= 256 elements
    assert any(lv is not None for lv in planner.decision.levels.values())
    back = repo.load(info.id)
    assert set(back) == set(state)
    for name, value in state.items():
        assert back[name].shape == value.shape and back[name].dtype == value.dtype, name
        if name not in priced or planner.decision.levels[name] is None:
            np.testing.assert_array_equal(back[name], value)
        else:
            rel = np.linalg.norm(back[name] - value) / np.linalg.norm(value)
            assert rel < 0.5, name
    # the loaded state goes back into the model
    model.load_state_dict({n[len(prefix):]: torch.from_numpy(np.array(v)) for n, v in back.items()})


def test_allocate_without_calibration_prices_tensors_by_their_role() -> None:
    planner = allocate(TwoBranch(), target_ratio=8, prefix="model/")
    assert planner.weights is None
    paths = {"model/query.weight": None, "model/value.weight": None}
    assert planner.weights_for(paths) == {"model/query.weight": ROLE_WEIGHTS["attention.query_key"],
                                          "model/value.weight": ROLE_WEIGHTS["attention.value"]}
    seq = allocate(_sequential(), max_error=0.05)
    assert seq.allocation.max_error == 0.05
    assert seq.weights_for({"0.weight": None, "1.weight": None}) == {"0.weight": ROLE_WEIGHTS["embedding"],
                                                                     "1.weight": 1.0}


_CALIBRATED_SAVE = """
import hashlib, sys
import numpy as np, torch
import inshrink_store as ins
from inshrink_store.torch import allocate
torch.set_num_threads(int(sys.argv[1]))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Embedding(1000, 64), torch.nn.Linear(64, 512), torch.nn.GELU(),
                            torch.nn.Linear(512, 64))
planner = allocate(model, target_ratio=10, calibration=torch.randint(0, 1000, (32, 64)))
repo = ins.init("memory://calibrated")
info = repo.save({k: v.detach().numpy() for k, v in model.state_dict().items()}, quantize=planner)
assert any(r.get("compensated") for r in planner.results.values())
print(repo.snapshot(info.id).root)
"""


def test_a_calibrated_save_is_the_same_version_whatever_the_thread_counts() -> None:
    """Same input, same bytes: the calibration's forward and backward passes (torch), the
    Hessians' inverses (LAPACK) and the writer run on 1 or 2 threads each, in fresh processes,
    and the version's root tree (its whole content) is the same."""
    import os
    import subprocess
    import sys

    ids = set()
    for threads in ("1", "2"):
        env = dict(os.environ, OMP_NUM_THREADS=threads, OPENBLAS_NUM_THREADS=threads, MKL_NUM_THREADS=threads,
                   INSHRINK_WRITE_THREADS=threads)
        out = subprocess.run([sys.executable, "-c", _CALIBRATED_SAVE, threads], env=env, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        ids.add(out.stdout.strip().splitlines()[-1])
    assert len(ids) == 1, ids
