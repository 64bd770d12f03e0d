"""What a MomentPolicy needs to know about a torch optimizer beyond its tensors.
Layer: torch, below Hugging Face and Lightning, above the facade (a client of the store).

A state dict numbers parameters (``state[3]``) in the order of its ``param_groups``; joint
pruning needs the model path behind each number (only the live model and optimizer know
it), and the update guard needs each group's ``betas`` and ``eps`` (the state dict's
``param_groups`` carry them, so a saved file is enough).
"""

from __future__ import annotations

from collections.abc import Mapping
from numbers import Real
from typing import Any

from inshrink_store.errors import InvalidInputError
from inshrink_store.policy import AdamHyper


def param_paths(model: Any, optimizer: Any, prefix: str = "model/") -> dict[str, str]:
    """``optimizer/state/<i>`` -> ``model/<name>`` for every parameter the optimizer holds
    that is one of the model's (the numbering torch's ``Optimizer.state_dict`` uses)."""
    names = {id(p): name for name, p in model.named_parameters()}
    paths: dict[str, str] = {}
    index = 0
    for group in getattr(optimizer, "param_groups", []):
        for p in group.get("params", []):
            if id(p) in names:
                paths[f"optimizer/state/{index}"] = prefix + names[id(p)]
            index += 1
    return paths


def adam_hyper(optimizer_state: Any) -> dict[str, AdamHyper]:
    """``optimizer/state/<i>`` -> betas and eps of its group, from a state dict's
    ``param_groups`` (groups without two betas and an eps are left out: not Adam-like)."""
    if not isinstance(optimizer_state, Mapping):
        return {}
    out: dict[str, AdamHyper] = {}
    for group in optimizer_state.get("param_groups", []) or []:
        if not isinstance(group, Mapping):
            continue
        betas, eps = group.get("betas"), group.get("eps")
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(_real(b) for b in betas)
                and isinstance(eps, Real) and not isinstance(eps, bool)):
            continue
        beta1, beta2 = (float(b) for b in betas)
        for index in group.get("params", []) or []:
            if isinstance(index, int):
                out[f"optimizer/state/{index}"] = AdamHyper(beta1, beta2, float(eps))
    return out


def _real(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def load_optimizer_state(optimizer: Any, state: Mapping[str, Any], version: str) -> None:
    """``optimizer.load_state_dict(state)``, with the fix named when the shapes differ.

    Why: torch's own error ("loaded state dict has a different number of parameter groups")
    does not say which groups the version holds. A Hugging Face ``Trainer`` builds AdamW with
    two groups (weights with decay, biases and norms without), so a version its callback
    saved restores only into an optimizer built the same way."""
    saved = [len(g.get("params", [])) for g in state.get("param_groups", []) if isinstance(g, Mapping)]
    live = [len(g.get("params", [])) for g in getattr(optimizer, "param_groups", [])]
    if saved != live:
        raise InvalidInputError(
            f"Expected an optimizer with the parameter groups of version {version} ({len(saved)} group(s) "
            f"of {saved} parameters). Got {type(optimizer).__name__} with {len(live)} group(s) of {live} "
            "instead; build it with the same groups as the run that saved it (a Hugging Face Trainer's "
            "AdamW: trainer.create_optimizer(), or two groups, decay and no decay, in the Trainer's "
            "order), or restore the model alone (Checkpointer without an optimizer).")
    optimizer.load_state_dict(state)
