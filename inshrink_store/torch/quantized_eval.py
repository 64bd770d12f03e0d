"""torch layer: a candidate's model, as a version would store it, judged on the model's device.

The Checkpointer's search scores candidates with the user's ``eval_fn``
(:class:`QuantizedEval`), and its ``probe=`` check compares the stored model's output on a
batch with the saved one's (:func:`probe_similarity`); both load a candidate's planned values
into a scratch copy of the model (:func:`_with_plans`) and put the saved weights back after.

Why a module of its own: this is the only part of a save that runs the user's model (and so
their device and their code); the Checkpointer hands it copies and reads back numbers. The
DistributedCheckpointer's rank 0 scores its candidates with the same evaluator.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from inshrink_store.errors import InvalidInputError
from inshrink_store.policy import PlanSet
from inshrink_store.torch.tensors import array_to_tensor, torch


def _with_plans(originals: dict[str, Any], plans: Mapping[str, Any], dtypes: dict[str, str]) -> dict[str, Any]:
    """The model's state dict ``originals`` with the planned values of its tensors in
    (``model/<name>`` plans; the optimizer's are left out): the model as a version stores it."""
    state = dict(originals)
    for path in plans:
        if path.startswith("model/"):  # tested before the plan is read: a save's plans are made when read
            name = path[len("model/"):]
            state[name] = array_to_tensor(plans[path].values, dtypes[path]).reshape(originals[name].shape)
    return state


def _model_output(model: Any, probe: Any) -> Any:
    """The first tensor of ``model``'s output on ``probe`` (a tensor, a tuple, a dict; the
    output a tensor, a tuple or list, a mapping or a ``ModelOutput``), as float64 on the host."""
    with torch.no_grad():
        if isinstance(probe, Mapping):
            out = model(**probe)
        elif isinstance(probe, (tuple, list)):
            out = model(*probe)
        else:
            out = model(probe)
    while not torch.is_tensor(out):
        if isinstance(out, Mapping) and out:
            out = next(iter(out.values()))
        elif isinstance(out, (tuple, list)) and out:
            out = out[0]
        else:
            raise InvalidInputError(
                f"Expected the model's output on the probe batch to hold a tensor. Got {type(out).__name__} instead.")
    return out.detach().to("cpu", torch.float64)


def probe_similarity(model: Any, probe: Any, dtypes: dict[str, str], originals: dict[str, Any],
                      plans: Mapping[str, Any] | None) -> dict[str, float]:
    """How close the stored model's output on ``probe`` is to the saved one's: per sample
    (the output's first axis) cosine, its mean and lowest, and the relative error overall.
    ``model`` is the scratch copy holding the saved weights; they are put back afterwards."""
    was_training = model.training
    model.eval()
    try:
        live = _model_output(model, probe)
        if plans:
            model.load_state_dict(_with_plans(originals, plans, dtypes))
        try:
            stored = _model_output(model, probe)
        finally:
            if plans:
                model.load_state_dict(originals)
    finally:
        model.train(was_training)
    a, b = live.reshape(live.shape[0] if live.ndim else 1, -1), stored.reshape(stored.shape[0] if stored.ndim else 1, -1)
    cos = torch.nn.functional.cosine_similarity(a, b, dim=1, eps=1e-30)
    norm = float(torch.linalg.vector_norm(a))
    error = float(torch.linalg.vector_norm(b - a)) / norm if norm > 0 else 0.0
    return {"cosine_mean": round(float(cos.mean()), 6), "cosine_min": round(float(cos.min()), 6),
            "rel_error": round(error, 6)}



class QuantizedEval:
    """``eval_fn`` on a scratch copy of the model, on the model's own device, with a
    candidate's values loaded.

    Why the model's device: an ``eval_fn`` feeds the model tensors where the user's model
    lives (a CUDA model gets CUDA batches), and scoring a large model on the CPU takes seconds
    per candidate. Why a copy: the loop trains the live model while the search runs in the
    background. ``evaluate(None)`` scores the copy as it is (the baseline); after every
    candidate the saved weights (``originals``, the host copy the save already made, so the
    device holds one extra model, not two) are put back, even when ``eval_fn`` raises."""

    def __init__(self, eval_fn: Callable[[Any], float], model: Any, dtypes: dict[str, str],
                 originals: dict[str, Any], stored: Callable[[PlanSet], Mapping[str, Any]] | None = None) -> None:
        self.eval_fn, self.model, self.dtypes, self.originals = eval_fn, model, dtypes, originals
        #: a candidate's plans -> the plans as stored (closed-loop: residuals become reconstructions)
        self.stored = stored
        #: wall seconds spent in ``eval_fn`` (values loaded in and out included), and its calls
        self.seconds = 0.0
        self.calls = 0

    def __call__(self, plans: PlanSet | None) -> float:
        start = time.perf_counter()
        try:
            return self._evaluate(plans)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1

    def _evaluate(self, plans: PlanSet | None) -> float:
        if plans is None:
            return float(self.eval_fn(self.model))
        self.model.load_state_dict(_with_plans(self.originals, plans if self.stored is None else self.stored(plans),
                                               self.dtypes))
        try:
            return float(self.eval_fn(self.model))
        finally:
            self.model.load_state_dict(self.originals)
