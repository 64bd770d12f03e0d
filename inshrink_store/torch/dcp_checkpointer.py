"""DistributedCheckpointer: the Checkpointer's decision with DCP's sharded writes, one call site.
Layer: torch, below Hugging Face and Lightning, above the facade (a client of the store).

In a DDP or FSDP loop every rank calls :meth:`DistributedCheckpointer.save` with the same
step. Rank 0 decides how to store the model: the configuration search of
:class:`~inshrink_store.policy.SearchPolicy` with ``eval_fn`` on ``eval_model`` (an
unsharded model that rank 0 holds: the DDP module, or for FSDP a CPU copy loaded from a
full state dict), the policy's ``base`` without ``eval_fn``, or nothing with
``lossless=True``. The decision travels to every rank as JSON, and every rank then runs
``dcp.save`` with an :class:`~inshrink_store.torch.dcp.InshrinkStorageWriter` quantizing
with it, writing its own shards; the version's ``metadata["quantization"]`` records the
decision as the Checkpointer's do. :meth:`restore` is ``dcp.load`` of a version (any world
size) and continues the search from its configuration and its recorded evaluations.

The decision is the Checkpointer's own, :class:`~inshrink_store.policy.SaveDecider` (issue 45:
one decision), with the closed loop off: the same budget, the run's predictor carried from save
to save, the same rule for where the neighbourhood search starts. Why no closed loop: its
residuals are coded per chunk against the parent's chunks and judged on the whole tensor's
reconstruction, while each rank writes its own shards with one configuration from the merged
sketches and has no residual coder (:mod:`inshrink_store.policy.save_decision` says more).

What the single-process Checkpointer does and this does not (yet): closed-loop residuals
(each version's weights are quantized afresh), the gradient EMA (pruning here is by
magnitude), compressed optimizer moments (optimizer state is stored exactly), restore
residuals (a restore gets the stored, quantized model weights; the search still runs in the
policy's ``space``, not its ``resume_space``, as it always has here), retention, background
saves (``dcp.async_save`` with the writer is the way to overlap).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, cast

from inshrink_store.errors import InvalidInputError
from inshrink_store.policy import (
    ParentVersion,
    QuantConfig,
    QuantizationRecord,
    SaveDecider,
    SaveRun,
    SaveState,
    SearchPolicy,
)
from inshrink_store.torch.dcp import InshrinkStorageReader, InshrinkStorageWriter
from inshrink_store.torch.dcp_comm import broadcast_json
from inshrink_store.torch.quantized_eval import QuantizedEval
from inshrink_store.torch.tensors import state_to_arrays, torch

if TYPE_CHECKING:
    import torch as _torch
    from torch.distributed import ProcessGroup

__all__ = ["DistributedCheckpointer"]


class DistributedCheckpointer:
    """Save and restore ``state`` (what you would pass to ``dcp.save``: ``{"model": ...,
    "optim": ...}``, Stateful objects welcome) as versions of ``branch`` at ``url``.

    The ``model`` part of ``state`` is what gets quantized (its FQNs ``model.*``), and
    ``eval_model`` must be the same model, unsharded, on rank 0 (other ranks may pass None).
    ``eval_fn(model) -> quality`` runs on rank 0 only. ``process_group``: the group to save
    over (None: the default group)."""

    def __init__(self, url: str, state: Mapping[str, Any], *, eval_fn: Callable[[Any], float] | None = None,
                 eval_model: _torch.nn.Module | None = None, policy: SearchPolicy | None = None, lossless: bool = False,
                 branch: str = "main", storage_options: Mapping[str, Any] | None = None,
                 process_group: ProcessGroup | None = None, gc_wait: float = 600.0) -> None:
        if not isinstance(state, Mapping):
            raise InvalidInputError(
                f"Expected state to be a dict such as {{'model': model, 'optim': optimizer}}. Got "
                f"{type(state).__name__} instead.")
        if lossless and (eval_fn is not None or policy is not None):
            raise InvalidInputError(
                "Expected lossless=True alone (no search). Got eval_fn or policy as well instead; drop one.")
        if eval_fn is not None and eval_model is None and _rank(process_group) == 0:
            raise InvalidInputError(
                "Expected eval_model (the unsharded model eval_fn scores) on rank 0 with eval_fn. Got None instead.")
        self.url, self.state, self.branch = url, state, branch
        self.eval_fn, self.eval_model, self.lossless = eval_fn, eval_model, lossless
        self.policy = policy if policy is not None else SearchPolicy()
        self.storage_options = dict(storage_options or {})
        self.process_group, self.gc_wait = process_group, gc_wait
        #: the decisions' memory from save to save: the last configuration, its space, the run's
        #: evaluations (rank 0's are the ones that count: it decides)
        self._run = SaveRun()
        #: the record of the last save's decision (every rank has it)
        self.last_record: QuantizationRecord | None = None

    def save(self, step: int, metrics: Mapping[str, float] | None = None, message: str | None = None) -> str:
        """Decide on rank 0, then every rank writes its shards; returns the new snapshot id on
        every rank. On failure nothing is committed and the writer lease is released."""
        record = QuantizationRecord.from_dict(
            broadcast_json("decide how to store the model", self._decide, self.process_group))
        writer = InshrinkStorageWriter(
            self.url, self.branch, quantize=record.config, storage_options=self.storage_options,
            message=message or f"step {step}", step=step, metrics=metrics,
            metadata={"quantization": record.to_dict()}, gc_wait=self.gc_wait, process_group=self.process_group)
        try:
            metadata = torch.distributed.checkpoint.save(dict(self.state), storage_writer=writer,
                                                         process_group=self.process_group)
        except BaseException:
            writer.abort()
            raise
        self._run.committed(record)
        self.last_record = record
        return str(metadata.storage_data["snapshot"])

    def restore(self, ref: str | None = None) -> int | None:
        """Load ``ref`` (default: the head of this checkpointer's ``branch``, which its saves
        continue) into ``state`` on every rank (resharded to this run's layout); returns its step."""
        reader = InshrinkStorageReader(self.url, self.branch if ref is None else ref,
                                       storage_options=self.storage_options)
        torch.distributed.checkpoint.load(dict(self.state), storage_reader=reader, process_group=self.process_group)
        info = reader.info
        recorded = info.metadata.get("quantization")
        self._run.restored(None if recorded is None else QuantizationRecord.from_dict(recorded), self.policy)
        return info.step

    @property
    def previous(self) -> QuantConfig | None:
        """The configuration of the last version saved or restored (continues the search)."""
        return self._run.previous

    @property
    def decider(self) -> SaveDecider:
        """The policy's decision of each save: the Checkpointer's, open loop (see the module's
        docstring), the optimizer's state exact, the policy's ``space`` searched."""
        return SaveDecider(dataclasses.replace(self.policy, optimizer=None), lossless=self.lossless)

    def _decide(self) -> dict[str, Any]:
        """Rank 0's decision as a JSON-native QuantizationRecord."""
        decider = self.decider
        if self.lossless or self.eval_fn is None:
            return decider.unsearched().to_dict()
        eval_fn = self.eval_fn
        # on its own device, where eval_fn's batches are; __init__ refused eval_fn without it on rank 0
        model = copy.deepcopy(cast("_torch.nn.Module", self.eval_model))
        state = model.state_dict()
        if any(type(t).__name__ in ("DTensor", "ShardedTensor") for t in state.values()):
            raise InvalidInputError(
                "Expected eval_model to be unsharded on rank 0 (plain tensors). Got a sharded model instead; for "
                "FSDP load a full state dict into a CPU copy of the model and pass that.")
        arrays, dtypes, _ = state_to_arrays({"model": state})
        kinds = {f"model/{name}.{p}": type(mod).__name__ for name, mod in model.named_modules()
                 for p, _ in mod.named_parameters(recurse=False)}
        originals = {name: tensor.detach().to("cpu", copy=True) for name, tensor in state.items()}
        # the parent's codebooks are the rank writers' to reuse: the decision reads nothing of it
        outcome = decider.decide(SaveState(arrays, dtypes, kinds), ParentVersion(), self._run,
                                 lambda stored: QuantizedEval(eval_fn, model, dtypes, originals, stored))
        return outcome.decision.record.to_dict()


def _rank(group: Any) -> int:
    dist = torch.distributed
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0
