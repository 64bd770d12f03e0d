"""Calibration: measure how much each tensor's error matters to a model's output, for the allocation.
Layer: torch, below Hugging Face and Lightning, above the facade (a client of the store).

``allocate(model, target_ratio=12, calibration=batch)`` is the allocation planner of
:class:`~inshrink_store.policy.Allocation` with per-tensor weights measured on ``batch``
(:mod:`inshrink_store.policy.sensitivity` says why weights matter on transformers and
how they are defined). What ``calibration`` may be:

- a **batch** the model takes (a tensor, a tuple or list of tensors passed positionally, or a
  dict passed as keyword arguments): with no ``loss``, the weights measure how much the
  *output* moves (the diagonal of ``J^T J``, from ``draws`` random projections of the output:
  for an encoder with no labels); with ``loss(output)`` a scalar, its diagonal Fisher.
- a **callable** ``calibration(model) -> scalar loss``: its squared gradients (the user's
  own loss over their own data).

The model's parameters and gradients are left as they were; nothing is written. Randomness
(the projections) is seeded, so the same model and batch give the same weights.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from inshrink_store.errors import InvalidInputError, require
from inshrink_store.policy import Allocation, AllocationPlanner, weights_from_fisher

if TYPE_CHECKING:
    import torch
else:
    torch = require("torch", "torch")  # a clear MissingDependencyError, not a bare ImportError

#: random output projections averaged for J^T J (the estimate's relative noise ~ 1/sqrt(draws))
DRAWS = 8


def _output_tensor(output: Any) -> torch.Tensor:
    """The tensor a model's output is judged by: itself, a Hugging Face output's
    ``last_hidden_state`` / ``logits``, or the first tensor of a tuple."""
    if isinstance(output, torch.Tensor):
        return output
    for name in ("last_hidden_state", "logits"):
        value = getattr(output, name, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise InvalidInputError(
        "Expected the model's output to be a tensor, a tuple starting with one, or an output with "
        f"last_hidden_state or logits, to calibrate on. Got {type(output).__name__} instead; pass "
        "calibration=lambda model: <a scalar loss> to say what the output is."
    )


def _run(model: torch.nn.Module, batch: Any) -> Any:
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def calibration_fisher(model: torch.nn.Module, calibration: Any, *, loss: Callable[[Any], torch.Tensor] | None = None,
                       draws: int = DRAWS, seed: int = 0) -> dict[str, np.ndarray]:
    """Diagonal Fisher (float64 numpy, shaped like each parameter) of every parameter with a
    gradient, from ``calibration`` (see the module doc). Parameters that got no gradient are
    left out."""
    if not isinstance(draws, int) or isinstance(draws, bool) or draws < 1:
        raise InvalidInputError(f"Expected draws to be an int >= 1. Got {draws!r} instead.")
    params = dict(model.named_parameters())
    saved = {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in params.items()}
    was_training = {m: m.training for m in model.modules()}
    fisher: dict[str, torch.Tensor] = {}
    try:
        model.eval()
        generator = torch.Generator().manual_seed(seed)
        passes = 1 if (callable(calibration) and not isinstance(calibration, torch.nn.Module)) or loss else draws
        for _ in range(passes):
            model.zero_grad(set_to_none=True)
            if callable(calibration) and not isinstance(calibration, torch.nn.Module):
                objective = calibration(model)
            else:
                output = _run(model, calibration)
                if loss is not None:
                    objective = loss(output)
                else:
                    out = _output_tensor(output).float()
                    r = torch.randn(out.shape, generator=generator).to(out.device)
                    objective = (out * r).sum()
            if not isinstance(objective, torch.Tensor) or objective.numel() != 1:
                raise InvalidInputError(
                    f"Expected the calibration loss to be a scalar tensor. Got {type(objective).__name__}"
                    f"{'' if not isinstance(objective, torch.Tensor) else ' of shape ' + str(tuple(objective.shape))} instead."
                )
            objective.backward()  # type: ignore[no-untyped-call]
            for n, p in params.items():
                if p.grad is not None:
                    g2 = p.grad.detach().double() ** 2
                    fisher[n] = fisher[n] + g2 if n in fisher else g2
    finally:
        model.zero_grad(set_to_none=True)
        for n, p in params.items():
            p.grad = saved[n]
        for m, mode in was_training.items():  # each submodule as it was (a frozen norm stays eval)
            m.training = mode
    return {n: (f / passes).cpu().numpy() for n, f in fisher.items()}


def calibration_weights(model: torch.nn.Module, calibration: Any, *, loss: Callable[[Any], torch.Tensor] | None = None,
                        prefix: str = "", draws: int = DRAWS, seed: int = 0) -> dict[str, float]:
    """Per-tensor allocation weights (``prefix + name`` -> weight, mean 1) of the model's
    parameters measured on ``calibration``: ``mean(w^2) * sum(F)`` (see
    :func:`~inshrink_store.policy.sensitivity.weights_from_fisher`). A parameter with no
    gradient gets the smallest weight (its error moved nothing we measured)."""
    fisher = calibration_fisher(model, calibration, loss=loss, draws=draws, seed=seed)
    tensors = {n: p.detach().float().cpu().numpy() for n, p in model.named_parameters()}
    full = {n: fisher.get(n, np.zeros(tensors[n].shape)) for n in tensors}
    return {prefix + n: w for n, w in weights_from_fisher(full, tensors).items()}


def calibration_hessians(model: torch.nn.Module, calibration: Any) -> dict[str, np.ndarray]:
    """``name.weight`` -> ``sum x x^T`` (float64 numpy, ``(in, in)``) over every input row each
    ``nn.Linear`` of the model saw in one forward pass on ``calibration`` (a batch, or a
    callable ``model -> loss``, whose forward pass is the one observed)."""
    sums: dict[str, torch.Tensor] = {}

    def observe(name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).double()
            sums[name] = sums[name] + x.T @ x if name in sums else x.T @ x
        return hook

    handles = [module.register_forward_hook(observe(f"{name}.weight"))
               for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]
    was_training = {m: m.training for m in model.modules()}
    try:
        model.eval()
        with torch.no_grad():
            if callable(calibration) and not isinstance(calibration, torch.nn.Module):
                calibration(model)
            else:
                _run(model, calibration)
    finally:
        for h in handles:
            h.remove()
        for m, mode in was_training.items():
            m.training = mode
    return {n: h.cpu().numpy() for n, h in sums.items()}


def allocate(model: torch.nn.Module, *, target_ratio: float | None = None, max_error: float | None = None,
             calibration: Any = None, loss: Callable[[Any], torch.Tensor] | None = None, prefix: str = "",
             compensate: bool = True, **options: Any) -> AllocationPlanner:
    """The planner of ``Allocation(target_ratio=..., **options)`` for this model's state dict
    saved under ``prefix`` (``""`` for ``repo.save(model.state_dict())``, ``"model/"`` for a
    Checkpointer-style state): weights from ``calibration`` when given, else each tensor's
    role (:func:`~inshrink_store.policy.sensitivity.role_weights`); module kinds from the
    model (embeddings are recognised by class). With ``calibration`` and ``compensate``, each
    ``nn.Linear`` weight is also rounded to minimise its output error on the calibration
    inputs (:mod:`inshrink_store.policy.compensation`): same bytes, better outputs."""
    spec = Allocation(target_ratio=target_ratio, max_error=max_error, **options)
    kinds = {f"{prefix}{module_name + '.' if module_name else ''}{param_name}": type(module).__name__
             for module_name, module in model.named_modules()
             for param_name, _ in module.named_parameters(recurse=False)}
    weights = None if calibration is None else calibration_weights(model, calibration, loss=loss, prefix=prefix)
    hessians = {} if calibration is None or not compensate else {
        prefix + n: h for n, h in calibration_hessians(model, calibration).items()}
    return AllocationPlanner(spec, module_kinds=kinds, weights=weights, hessians=hessians)
