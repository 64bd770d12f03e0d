"""Restoring a version into an optimizer built with other parameter groups names the fix
(issue 43, item 7: a Hugging Face Trainer's two-group AdamW restored into a user's one-group
AdamW failed with torch's bare "different number of parameter groups")."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import inshrink_store as ins  # noqa: E402
from inshrink_store.errors import InvalidInputError  # noqa: E402
from inshrink_store.torch import Checkpointer  # noqa: E402


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))


def _two_groups(model: torch.nn.Module) -> torch.optim.Optimizer:
    """The Trainer's shape: weights with decay, biases and norms without."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and p.dim() > 1)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}])


def _saved(url: str) -> str:
    model = _model()
    optimizer = _two_groups(model)
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    with Checkpointer(ins.open(url, create=True), model, optimizer, lossless=True) as ck:
        ck.save(1)
    return url


def test_restoring_into_other_parameter_groups_names_both_shapes_and_the_fix(memory_url: str) -> None:
    url = _saved(memory_url)
    model = _model()
    one_group = torch.optim.AdamW(model.parameters())
    expected = r"2 group\(s\) of \[2, 4\].*1 group\(s\) of \[6\].*create_optimizer"
    with Checkpointer(ins.open(url), model, one_group, lossless=True) as ck, \
            pytest.raises(InvalidInputError, match=expected):
        ck.restore()


def test_the_same_groups_restore(memory_url: str) -> None:
    url = _saved(memory_url)
    model = _model()
    optimizer = _two_groups(model)
    with Checkpointer(ins.open(url), model, optimizer, lossless=True) as ck:
        assert ck.restore() == 1
    assert optimizer.state_dict()["param_groups"][0]["weight_decay"] == 0.01
    assert len(optimizer.state) == 6
