"""torch layer: the ``extra_state`` objects a Checkpointer saves with every version.

An ``extra_state`` entry is anything that gives its state and takes it back:
``state_dict()``/``load_state_dict()`` (an LR scheduler, :class:`RNGState`) or
``get_state()``/``set_state()`` (a ``torch.Generator``). :func:`check_stateful` checks an entry
when the Checkpointer is made, :func:`state_of` reads it at each save and :func:`load_into`
puts a restored version's state back.

Why a module of its own: what such an object must offer, and :class:`RNGState` (the process's
random generators as one entry, tensors and scalars only, so stored without pickle), are one
job that neither the save nor the restore owns.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np

from inshrink_store.errors import FormatError, InvalidInputError
from inshrink_store.torch.tensors import torch

__all__ = ["RNGState"]


class RNGState:
    """The process's random number generators as one ``extra_state`` entry.

    ``state_dict()`` holds Python's ``random`` state, NumPy's global generator (the
    ``np.random.*`` functions), torch's CPU generator and, when CUDA is initialised, every
    CUDA device's: tensors, ints and floats only, so it is stored without pickle.
    ``load_state_dict`` puts them all back. A ``numpy.random.Generator`` of your own goes in
    ``extra=`` as ``rng.bit_generator.state`` (a dict of ints and strings)."""

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        legacy = np.random.get_state(legacy=False)
        assert isinstance(legacy, dict)
        state: dict[str, Any] = {
            "python": {"version": int(version), "internal": [int(v) for v in internal], "gauss": gauss},
            "numpy": {"bit_generator": str(legacy["bit_generator"]),
                      "key": torch.from_numpy(np.asarray(legacy["state"]["key"], dtype=np.int64)),
                      "pos": int(legacy["state"]["pos"]), "has_gauss": int(legacy["has_gauss"]),
                      "gauss": float(legacy["gauss"])},
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = list(torch.cuda.get_rng_state_all())
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        missing = [k for k in ("python", "numpy", "torch") if k not in state]
        if missing:
            raise FormatError(
                f"Expected an RNGState state dict with 'python', 'numpy' and 'torch'. Got keys "
                f"{sorted(state)} instead; it was not written by RNGState.state_dict().")
        py, npy = state["python"], state["numpy"]
        random.setstate((py["version"], tuple(py["internal"]), py["gauss"]))
        np.random.set_state({"bit_generator": npy["bit_generator"],
                             "state": {"key": npy["key"].numpy().astype(np.uint32), "pos": npy["pos"]},
                             "has_gauss": npy["has_gauss"], "gauss": npy["gauss"]})
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])


def check_stateful(name: Any, obj: Any) -> None:
    """An ``extra_state`` entry must be able to give its state and take it back."""
    if not isinstance(name, str):
        raise InvalidInputError(
            f"Expected extra_state names to be str. Got {type(name).__name__} {name!r} instead; "
            "e.g. extra_state={'scheduler': scheduler}.")
    pairs = (("state_dict", "load_state_dict"), ("get_state", "set_state"))
    if not any(callable(getattr(obj, a, None)) and callable(getattr(obj, b, None)) for a, b in pairs):
        raise InvalidInputError(
            f"Expected extra_state[{name!r}] to have state_dict()/load_state_dict() (a scheduler, "
            f"RNGState()) or get_state()/set_state() (a torch.Generator). Got {type(obj).__name__} "
            "instead; pass plain values with save(step, extra={...}) and read them back from ck.extra.")


def state_of(obj: Any) -> Any:
    return obj.state_dict() if callable(getattr(obj, "state_dict", None)) else obj.get_state()


def load_into(obj: Any, state: Any) -> None:
    if callable(getattr(obj, "load_state_dict", None)):
        obj.load_state_dict(state)
    else:
        obj.set_state(state)
