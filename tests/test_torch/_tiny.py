"""The tiny model and training step the Checkpointer's branch, retention and two-writer
tests share: a Linear(8, 4) with Adam, seeded, and one step on random inputs."""

from __future__ import annotations

from typing import Any

import torch


def tiny_model(seed: int = 0) -> tuple[Any, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train_step(model: Any, opt: Any) -> None:
    opt.zero_grad()
    model(torch.randn(16, 8)).pow(2).mean().backward()
    opt.step()
