"""The configuration search for Lightning's checkpoints: :class:`InshrinkSearch`.
Layer: Lightning (the ``inshrink_store.lightning`` package), below the CLI, above Hugging Face
and ``torch``.

``Trainer(plugins=[InshrinkCheckpointIO(url)], callbacks=[InshrinkSearch(eval_fn, tolerance=0.01)])``
stores each checkpoint's model weights (``state_dict``) with the most aggressive configuration
whose ``eval_fn`` stays within the tolerance, as the :class:`~inshrink_store.torch.Checkpointer`
does (the same :class:`~inshrink_store.policy.SearchPolicy`, the same budget by default, each
save's neighbourhood search starting from the previous save's configuration), instead of the
fixed ``quantize=QuantConfig`` of the plugin alone.

Why a callback: a ``CheckpointIO`` is handed the checkpoint dict, never the LightningModule,
and the search scores candidates by running ``eval_fn`` on the model with their values. The
callback's ``setup`` hands the Trainer's module to the Trainer's ``InshrinkCheckpointIO``; each
save then copies the module (the scratch model the candidates are scored on, so training goes
on with the live one, also while a ``background=True`` save searches), searches over the
checkpoint's own ``state_dict`` tensors, and writes the plans it scored: what is stored is what
``eval_fn`` judged. The version's ``metadata["quantization"]`` holds the search's record, as a
Checkpointer version's does (``inshrink log`` shows it).

Each save's decision is the Checkpointer's (:class:`~inshrink_store.policy.SaveDecider`), open loop.
What the Checkpointer does and this does not: the gradient EMA (pruning here goes by
magnitude, as without ``observe_gradients``), closed-loop residuals (each version's weights are
quantized afresh, the paper's open loop) and compressed Adam moments (the optimizer's state stays
exact, as with the plugin's ``quantize=``).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import xxhash
from typing_extensions import Unpack

from inshrink_store.errors import InvalidInputError, require
from inshrink_store.policy import (
    ParentVersion,
    PlanSet,
    PolicyArgs,
    QuantizationRecord,
    SaveDecider,
    SaveRun,
    SaveState,
    SearchPolicy,
)
from inshrink_store.torch.checkpointer_options import CheckpointerOptions
from inshrink_store.torch.quantized_eval import QuantizedEval
from inshrink_store.torch.tensors import state_to_arrays

if TYPE_CHECKING:
    import torch
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.callbacks import Callback

    from inshrink_store.policy import QuantConfig
    from inshrink_store.repository import Repository
else:
    Callback = require("lightning.pytorch.callbacks", "lightning").Callback

__all__ = ["InshrinkSearch"]

#: where a Lightning checkpoint keeps the model's weights, and where the evaluator looks for them
_STATE_DICT, _MODEL = "state_dict/", "model/"



class SearchingPlugin(Protocol):
    """What :meth:`InshrinkSearch.attach` reads and sets on an ``InshrinkCheckpointIO``.

    A Protocol, not the class: ``inshrink_store.lightning`` imports this module, and naming
    the plugin here, even for the type checker alone, would import it back (a cycle)."""

    search: InshrinkSearch | None
    exact_resume: int

    @property
    def quantize(self) -> QuantConfig | None: ...

    @property
    def exact_resume_given(self) -> int | None: ...


class InshrinkSearch(Callback):
    """A Lightning ``Callback`` that makes the Trainer's
    :class:`~inshrink_store.lightning.InshrinkCheckpointIO` search each checkpoint's
    configuration with ``eval_fn(model) -> float`` (a quality of the LightningModule, e.g. a
    held-out loss with ``higher_is_better=False``), as ``Checkpointer(eval_fn=...)`` does.

    ``policy`` (a :class:`~inshrink_store.policy.SearchPolicy`), or the Checkpointer's 0.1
    keywords ``tolerance``, ``higher_is_better`` and ``space``, say what the search may do;
    they are checked here, when the callback is made, with the Checkpointer's own checks. The
    optimizer's state stays exact (the policy's ``optimizer`` is not used). A save with nothing
    within tolerance stores the weights lossless.

    The Trainer must save through an ``InshrinkCheckpointIO`` made without ``quantize=`` (the
    search decides it): ``setup`` raises an InvalidInputError naming the fix otherwise. The
    plugin's ``exact_resume`` defaults to 1 with a search: a resume from the newest version is
    bit-exact."""

    def __init__(self, eval_fn: Callable[[Any], float], *, policy: SearchPolicy | None = None,
                 **legacy: Unpack[PolicyArgs]) -> None:
        if not callable(eval_fn):
            raise InvalidInputError(
                f"Expected eval_fn to be a function of the model that returns its quality (a float). Got "
                f"{type(eval_fn).__name__} instead; e.g. InshrinkSearch(lambda model: held_out_loss(model), "
                "tolerance=0.01, higher_is_better=False).")
        if "optimizer_policy" in legacy:
            raise InvalidInputError(
                "Expected no optimizer_policy with InshrinkSearch. Got one instead: the optimizer's state of a "
                "Lightning checkpoint is stored exact; drop it.")
        options = CheckpointerOptions(eval_fn=eval_fn, policy=policy, legacy=dict(legacy))  # the Checkpointer's checks
        self.eval_fn = eval_fn
        #: the policy each save searches with (the optimizer's state is not its to store)
        self.policy: SearchPolicy = dataclasses.replace(options.resolved_policy, optimizer=None)
        #: the record of the last save's search (None before one)
        self.last_record: QuantizationRecord | None = None
        self._module: LightningModule | None = None
        #: what the decisions carry from save to save: the last configuration (where the next
        #: search starts) and the run's evaluations (which rank a budgeted search's candidates)
        self._run = SaveRun()
        #: (the weights' hash, plans, record) of the last search: a save of the same weights reuses them
        self._last: tuple[str, PlanSet | None, QuantizationRecord] | None = None

    # -- Lightning's hooks -----------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Hand the Trainer's module to the Trainer's InshrinkCheckpointIO (an InvalidInputError
        when the Trainer saves through another IO, or through one made with ``quantize=``)."""
        io = getattr(trainer.strategy, "checkpoint_io", None)
        inner = getattr(io, "checkpoint_io", None)  # Lightning's AsyncCheckpointIO wraps the plugin
        # the plugin is what takes a search (attach_search): the package imports this module, so
        # this module does not import the package back
        found = io if _takes_search(io) else inner if _takes_search(inner) else None
        if found is None:
            raise InvalidInputError(
                f"Expected the Trainer to save through an InshrinkCheckpointIO with InshrinkSearch in its callbacks. "
                f"Got {type(io).__name__} instead: add plugins=[InshrinkCheckpointIO(url)] to the Trainer, or drop "
                "InshrinkSearch.")
        found.attach_search(self)
        self._module = pl_module

    def attach(self, io: SearchingPlugin) -> None:
        """Become ``io``'s search (an InshrinkCheckpointIO), when it has no ``quantize=`` and no
        other search; with ``exact_resume`` left to its default, the newest version resumes
        bit-exact (1), as with ``quantize=``."""
        if io.quantize is not None:
            raise InvalidInputError(
                f"Expected InshrinkCheckpointIO without quantize= beside InshrinkSearch: the search picks each "
                f"save's configuration. Got quantize={io.quantize!r} as well instead; drop quantize=, or drop "
                "InshrinkSearch for a fixed configuration.")
        if io.search is not None and io.search is not self:
            raise InvalidInputError(
                "Expected one InshrinkSearch per InshrinkCheckpointIO. Got a second one instead; pass one callback.")
        io.search = self
        if io.exact_resume_given is None:
            io.exact_resume = 1

    # -- what the plugin asks ----------------------------------------------------------------------
    def scratch_model(self) -> LightningModule:
        """A copy of the module as it is now (the save's), which the candidates are scored on."""
        if self._module is None:
            raise InvalidInputError(
                "Expected InshrinkSearch to be set up by the Trainer before a save. Got a save without it instead: "
                "pass the callback to the Trainer that fits (Trainer(callbacks=[search], plugins=[io])).")
        return copy.deepcopy(self._module)

    def decide(self, checkpoint: Mapping[str, Any], names: Mapping[str, str], model: torch.nn.Module, repo: Repository,
               parent: str | None, exact_resume: int) -> tuple[PlanSet | None, QuantizationRecord]:
        """(the plans to write, the record for ``metadata["quantization"]``) of one save:
        ``checkpoint`` the dict as the plugin stores it (keys escaped), ``names`` each escaped
        ``state_dict`` key -> the module's own name, ``model`` the scratch copy holding the
        saved weights, ``parent`` the version the save's objects are coded against.

        Why the plans, not their configuration: the writer stores exactly what ``eval_fn``
        scored (with the parent's codebooks, as the writer would plan them). A save of the same
        weights as the last search's (``ModelCheckpoint``'s ``last.ckpt``, right after the
        top-k file of the same step) writes that search's plans: no second search."""
        arrays, dtypes, _ = state_to_arrays({"state_dict": checkpoint.get("state_dict") or {}}, copy=False)
        weights = _weights_hash(arrays)
        if self._last is not None and self._last[0] == weights:
            return self._last[1], self._last[2]
        kinds = {f"{_STATE_DICT}{name}.{p}": type(module).__name__ for name, module in model.named_modules()
                 for p, _ in module.named_parameters(recurse=False)}
        to_model = {path: _MODEL + names.get(path[len(_STATE_DICT):], path[len(_STATE_DICT):]) for path in arrays}
        originals = {name[len(_MODEL):]: _host(checkpoint["state_dict"][path[len(_STATE_DICT):]])
                     for path, name in to_model.items()}
        eval_fn, model_dtypes = self.eval_fn, {to_model[p]: d for p, d in dtypes.items()}
        # the Checkpointer's decision, open loop: without restore residuals a resume loads what
        # is stored, so the policy's resume space is searched
        decider = SaveDecider(self.policy, resume_space=not exact_resume)
        state = SaveState(arrays, dtypes, kinds, scope=_STATE_DICT)
        outcome = decider.decide(state, ParentVersion.read(repo, parent, decider, state), self._run,
                                 lambda _: QuantizedEval(eval_fn, model, model_dtypes, originals, lambda plans: {
                                     to_model[p]: plans[p] for p in plans if p in to_model}))
        decision = outcome.decision
        self._run.committed(decision.record)
        self.last_record = decision.record
        self._last = (weights, decision.plans, decision.record)
        return decision.plans, decision.record


def _weights_hash(arrays: Mapping[str, Any]) -> str:
    """One hash of every array's path, dtype, shape and bytes."""
    hasher = xxhash.xxh3_128()
    for path in sorted(arrays):
        array = np.ascontiguousarray(arrays[path])
        hasher.update(f"{path}:{array.dtype.str}:{array.shape};".encode())
        hasher.update(array.view(np.uint8).reshape(-1).data)
    return hasher.hexdigest()


def _host(tensor: Any) -> Any:
    """The saved value on the CPU, where the evaluator's originals are kept (a copy only off the CPU)."""
    return tensor.detach().to("cpu")


def _takes_search(io: Any) -> bool:
    """``io`` is an InshrinkCheckpointIO (the one plugin with ``attach_search``)."""
    return callable(getattr(io, "attach_search", None)) and type(io).__name__ == "InshrinkCheckpointIO"
