"""A training process's state as flat arrays and back, for the baselines' stores.

The baselines work on numpy arrays named by path, the same paths the store uses
(``model/<name>``, ``optimizer/state/<i>/exp_avg``, ``extra/scheduler/...``), so that a
baseline and the Checkpointer see the same tensors. The structure around the tensors
(``param_groups``, the scheduler's counters) travels as JSON beside them: no pickle.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from inshrink_store.torch.optim import param_paths
from inshrink_store.torch.tensors import arrays_to_state, state_to_arrays


@dataclass(frozen=True)
class Captured:
    """One checkpoint's state: ``arrays`` (path -> numpy copy), their logical dtypes, the JSON
    ``skeleton`` that puts them back together, and ``params``: ``optimizer/state/<i>`` ->
    ``model/<name>`` (which moments belong to which weight)."""

    arrays: dict[str, np.ndarray]
    dtypes: dict[str, str]
    skeleton: Any
    params: dict[str, str]

    @property
    def skeleton_bytes(self) -> int:
        """What storing the structure costs (counted in every baseline's stored bytes)."""
        return len(json.dumps(self.skeleton, sort_keys=True).encode())

    def logical_bytes(self, prefix: str = "") -> int:
        return sum(a.nbytes for p, a in self.arrays.items() if p.startswith(prefix))


def capture(model: Any, optimizer: Any, scheduler: Any) -> Captured:
    """Copies of everything a resume needs, as a Checkpointer would save it."""
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "extra": {"scheduler": scheduler.state_dict()}}
    arrays, dtypes, skeleton = state_to_arrays(state, copy=True)
    return Captured(arrays, dtypes, skeleton, param_paths(model, optimizer))


def load(captured: Captured, arrays: dict[str, np.ndarray], model: Any, optimizer: Any, scheduler: Any) -> None:
    """Put ``arrays`` (a baseline's restored values) into a fresh process's objects."""
    state = arrays_to_state(arrays, captured.dtypes, captured.skeleton)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["extra"]["scheduler"])


def load_weights(model: Any, arrays: dict[str, np.ndarray], dtypes: dict[str, str]) -> None:
    """Only the ``model/`` arrays into ``model`` (to evaluate a candidate)."""
    import torch

    weights = {p[len("model/"):]: torch.from_numpy(np.ascontiguousarray(a))
               for p, a in arrays.items() if p.startswith("model/") and dtypes[p] == "F32"}
    model.load_state_dict(weights, strict=False)
