"""One rank's part of a DCP save (:mod:`inshrink_store.torch.dcp`).
Layer: torch, below Hugging Face and Lightning, above the facade (a client of the store).

What the coordinator hands every rank (:class:`RankSetup`: the parent, and with quantization
which tensors and their previous codebooks), and the rank's write (:class:`RankWrite`).

With quantization, each rank sketches its shards of the tensors to quantize and the sketches
are gathered over the process group (JSON in uint8 tensors,
:mod:`~inshrink_store.torch.dcp_comm`), so every shard of a tensor gets one codebook and one
set of thresholds (:mod:`~inshrink_store.policy.shard_quant`). Then the rank writes its shards
as arrays (:mod:`~inshrink_store.rank_writer`), in batches of about
:data:`WRITE_BATCH_BYTES`, and returns DCP's ``WriteResult``\\ s holding each array's zarr.json
and chunk ids as JSON-native data.
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from inshrink_store import dtypes as dtype_registry
from inshrink_store.errors import InvalidInputError
from inshrink_store.plans import ArrayPlan
from inshrink_store.policy import (
    LogSketch,
    QuantConfig,
    ShardQuantization,
    ShardTarget,
    decide_shards,
    merge_sketches,
    shard_plan,
    shard_targets,
    sketch_from_json,
    sketch_to_json,
)
from inshrink_store.rank_writer import RankArrays
from inshrink_store.torch.dcp_comm import gather_json
from inshrink_store.torch.dcp_format import bytes_path, plain_value, shard_path
from inshrink_store.torch.tensors import TORCH_DTYPES, infer_module_kinds, tensor_to_array, torch

if TYPE_CHECKING:
    import torch as _torch

__all__ = ["WRITE_BATCH_BYTES", "RankSetup", "RankWrite", "quantize_targets"]

#: bytes of shards a rank turns into arrays per step (bounds device -> host copies held at once)
WRITE_BATCH_BYTES = 256 << 20


@dataclass(frozen=True)
class RankSetup:
    """What the coordinator hands every rank in its plan (``SavePlan.storage_data``)."""

    parent: str | None
    world: int
    quantize: QuantConfig | None
    targets: Mapping[str, ShardTarget] | None

    def to_dict(self) -> dict[str, Any]:
        return {"parent": self.parent, "world": self.world,
                "quantize": None if self.quantize is None else self.quantize.to_dict(),
                "targets": None if self.targets is None else {f: t.to_dict() for f, t in self.targets.items()}}

    @classmethod
    def from_plan(cls, plan: SavePlan) -> RankSetup:
        data = plan.storage_data
        if not isinstance(data, dict) or "parent" not in data:
            raise InvalidInputError(
                "Expected a plan prepared by InshrinkStorageWriter.prepare_global_plan. Got storage_data "
                f"{data!r:.80} instead: pass the same kind of storage_writer on every rank.")
        quantize = None if data["quantize"] is None else QuantConfig.from_dict(data["quantize"])
        targets = None if data["targets"] is None else {
            f: ShardTarget.from_dict(t) for f, t in data["targets"].items()}
        return cls(data["parent"], int(data["world"]), quantize, targets)


def quantize_targets(plans: Sequence[SavePlan], config: QuantConfig,
                     codebooks: Mapping[str, tuple[float, ...]]) -> dict[str, ShardTarget]:
    """The tensors to quantize, as the global plan shows them, with their previous codebooks."""
    tensors = {item.index.fqn: (TORCH_DTYPES[item.tensor_data.properties.dtype], tuple(item.tensor_data.size))
               for plan in plans for item in plan.items if item.tensor_data is not None}
    kinds = infer_module_kinds({fqn: np.empty((0,) * len(size)) for fqn, (_, size) in tensors.items()})
    return shard_targets(tensors, config, codebooks, kinds)


class _ShardPlans(Mapping[str, ArrayPlan]):
    """Quantized shards' plans, made when the writer asks (one shard in memory at a time)."""

    def __init__(self, arrays: Mapping[str, np.ndarray], dtypes: Mapping[str, str],
                 decisions: Mapping[str, ShardQuantization], config: QuantConfig) -> None:
        self._arrays, self._dtypes, self._decisions, self._config = arrays, dtypes, decisions, config

    def __getitem__(self, path: str) -> ArrayPlan:
        q, dtype = self._decisions[path], self._dtypes[path]
        values = dtype_registry.get(dtype).to_float32(self._arrays[path])
        return shard_plan(values, q, dtype, self._config)

    def __iter__(self) -> Iterator[str]:
        return iter(self._decisions)

    def __len__(self) -> int:
        return len(self._decisions)


class RankWrite:
    """One rank's part of a save: quantization decisions, then its shards as arrays."""

    def __init__(self, arrays: RankArrays, setup: RankSetup, planner: SavePlanner, process_group: Any) -> None:
        self.arrays, self.setup, self.planner, self.process_group = arrays, setup, planner, process_group

    def run(self, items: Sequence[WriteItem]) -> list[WriteResult]:
        tensors = [i for i in items if i.type != WriteItemType.BYTE_IO]
        decisions = self._decisions(tensors)
        for batch in _batches(tensors):
            self._write_tensors(batch, decisions)
        values = {item.index: self._value(item) for item in items if item.type == WriteItemType.BYTE_IO}
        results = []
        for item in items:
            if item.type == WriteItemType.BYTE_IO:
                data = values[item.index]
                if "array" in data:
                    data = {**data, "node": self.arrays.node(data["array"])}
                results.append(WriteResult(item.index, 0, data))
                continue
            path = shard_path(item.index.fqn, _offsets(item))
            data = {"array": path, "node": self.arrays.node(path)}
            if item.index.fqn in decisions:
                data["quantization"] = decisions[item.index.fqn].to_dict()
            results.append(WriteResult(item.index, item.tensor_storage_size() or 0, data))
        return results

    def _array(self, item: WriteItem) -> tuple[np.ndarray, str]:
        # a tensor item (bytes items are written apart): resolve_data gives its tensor
        return tensor_to_array(cast("_torch.Tensor", self.planner.resolve_data(item)), item.index.fqn, copy=False)

    def _decisions(self, tensors: Sequence[WriteItem]) -> dict[str, ShardQuantization]:
        """With quantization on: sketch this rank's shards, gather every rank's sketches, and
        decide each tensor this rank holds. Every rank takes part, holding shards or not."""
        setup = self.setup
        if not setup.targets or setup.quantize is None:
            return {}  # the same on every rank: the coordinator decided it
        targets = setup.targets
        mine = [item for item in tensors if item.index.fqn in targets]

        def sketch() -> dict[str, Any]:
            sketches: dict[str, Any] = {}
            for item in mine:
                array, name = self._array(item)
                local = LogSketch.from_values(dtype_registry.get(name).to_float32(array))
                fqn = item.index.fqn
                sketches[fqn] = sketches[fqn].merge(local) if fqn in sketches else local
            return {fqn: sketch_to_json(s) for fqn, s in sorted(sketches.items())}

        gathered = gather_json("sketch its shards of the tensors to quantize", sketch, self.process_group)
        if len(gathered) != setup.world:
            raise InvalidInputError(
                f"Expected the quantization exchange to reach the {setup.world} ranks of dcp.save. Got "
                f"{len(gathered)} instead: pass dcp.save's process_group to InshrinkStorageWriter(process_group=...).")
        merged = merge_sketches(
            {f: sketch_from_json(s) for f, s in ranks.items()} for ranks in gathered)
        return decide_shards(targets, merged, setup.quantize, {item.index.fqn for item in mine})

    def _write_tensors(self, items: Sequence[WriteItem], decisions: Mapping[str, ShardQuantization]) -> None:
        arrays, dtypes, by_path = {}, {}, {}
        for item in items:
            path = shard_path(item.index.fqn, _offsets(item))
            arrays[path], dtypes[path] = self._array(item)
            if item.index.fqn in decisions:
                by_path[path] = decisions[item.index.fqn]
        plans = None
        if by_path:
            assert self.setup.quantize is not None
            plans = _ShardPlans(arrays, dtypes, by_path, self.setup.quantize)
        self.arrays.write(arrays, dtypes, plans)

    def _value(self, item: WriteItem) -> dict[str, Any]:
        """A non-tensor value: inline JSON when plain, else its torch.save bytes as an array.
        Either way it must load with ``weights_only=True``, so what is stored always reads back."""
        fqn = item.index.fqn
        data = self.planner.resolve_data(item)
        raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
        try:
            value = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except Exception as exc:  # torch's unpickler refuses code with several error types
            raise InvalidInputError(
                f"Expected state value {fqn!r} to load with torch.load(weights_only=True) (tensors, containers and "
                f"plain Python values). Got {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} "
                "instead; inshrink-store never stores what only pickle can read: convert it.") from None
        skeleton = plain_value(value)
        if skeleton is not None:
            return {"value": skeleton}
        path = bytes_path(fqn)
        self.arrays.write({path: np.frombuffer(raw, np.uint8)}, {path: "U8"})
        return {"array": path}


def _offsets(item: WriteItem) -> tuple[int, ...]:
    assert item.tensor_data is not None
    return tuple(int(o) for o in item.tensor_data.chunk.offsets)


def _batches(items: Sequence[WriteItem]) -> Iterator[list[WriteItem]]:
    """Items in plan order, in groups of about :data:`WRITE_BATCH_BYTES`."""
    batch: list[WriteItem] = []
    size = 0
    for item in items:
        batch.append(item)
        size += item.tensor_storage_size() or 0
        if size >= WRITE_BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch
