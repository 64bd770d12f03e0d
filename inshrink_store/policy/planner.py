"""From a configuration to per-tensor storage plans the repository writes (ArrayPlan), lazily.
Layer: refs, history and policy (the policy imports neither sibling), below ``parts``.

Chooses which tensors are quantized (floating, >= 2-D, >= ``min_numel`` elements, under
``model/`` when the state has a model part: optimizer state stays lossless by default),
fetches each tensor's previous codebook from the parent version's zarr.json (not from
process memory, so imports and resumed runs continue the codebook), and returns the
snapped values with an ``inshrink.nuq`` serializer at tolerance 0. Plans are made when
the writer asks for them, one tensor at a time, so a save never holds the quantized model.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from inshrink_store import dtypes as dtype_registry
from inshrink_store.codecs.nuq import NUQZarrCodec
from inshrink_store.dtypes import QUANTIZABLE_NAMES
from inshrink_store.plans import ArrayPlan
from inshrink_store.policy.partition import (
    PartitionCache,
    QuantizedTensor,
    StateQuantizer,
    TensorInput,
    layer_type,
)
from inshrink_store.policy.settings import QuantSettings


def eligible(tensors: Mapping[str, np.ndarray], dtypes: Mapping[str, str], min_numel: int,
             scope: str | None = None) -> list[str]:
    """Sorted paths a planner quantizes: quantizable dtype, >= 2-D, >= ``min_numel`` elements,
    under ``scope`` (None: ``model/`` when the state has one, else everything)."""
    if scope is None:
        scope = "model/" if any(p.startswith("model/") for p in tensors) else ""
    return sorted(
        p for p, a in tensors.items()
        if p.startswith(scope) and dtypes.get(p) in QUANTIZABLE_NAMES and a.ndim >= 2
        and a.size >= min_numel
    )


def tensor_inputs(paths: list[str], tensors: Mapping[str, np.ndarray], dtypes: Mapping[str, str],
                  previous: Mapping[str, dict[str, Any]], sensitivity: Mapping[str, np.ndarray],
                  module_kinds: Mapping[str, str]) -> dict[str, TensorInput]:
    """What the quantizer needs per path: float32 values (read in place when already float32,
    not copied for the whole model), layer type, sensitivity and the previous codebook."""
    inputs = {}
    for path in paths:
        prev = previous.get(path, {}).get("codec", {}).get("codebook")
        inputs[path] = TensorInput(
            values=dtype_registry.get(dtypes[path]).to_float32(tensors[path]), dtype=dtypes[path],
            layer_type=layer_type(tensors[path].shape, module_kinds.get(path)),
            sensitivity=sensitivity.get(path),
            previous_codebook=tuple(prev) if prev else None,
        )
    return inputs


def array_plan(q: QuantizedTensor, dtype: str, protected_dtype: str) -> ArrayPlan:
    """One quantized tensor as the writer stores it: values narrowed to the tensor's carrier
    and a tolerance-0 nuq serializer (naming the element dtype when the carrier is bits)."""
    entry = dtype_registry.get(dtype)
    codec = NUQZarrCodec(codebook=q.codebook, tolerance=0.0, protected_dtype=protected_dtype,
                         dtype=entry.codec_name if entry.carried_as_bits else None, scales=q.scales)
    return ArrayPlan(entry.from_float32(q.values), codec, q.stats)


class LazyPlans(Mapping[str, ArrayPlan]):
    """Plans computed when the writer asks for one (it asks once per tensor, in order),
    so only the tensor being written has its quantized copy in memory."""

    def __init__(self, quantizer: StateQuantizer, dtypes: Mapping[str, str], protected_dtype: str,
                 stats: dict[str, Any]) -> None:
        self._q, self._dtypes, self._protected, self._stats = quantizer, dtypes, protected_dtype, stats

    def __getitem__(self, path: str) -> ArrayPlan:
        if path not in self._q.chosen:
            raise KeyError(path)
        q = self._q.quantize(path)
        self._stats[path] = q.stats  # error figures are computed when the plan is written
        return array_plan(q, self._dtypes[path], self._protected)

    def __iter__(self) -> Iterator[str]:
        return iter(self._q.names)

    def __len__(self) -> int:
        return len(self._q.names)

    def __contains__(self, path: object) -> bool:
        return path in self._q.chosen


class StatePlanner:
    """Implements the repository's ``Planner`` protocol for one configuration."""

    def __init__(self, config: QuantSettings, sensitivity: Mapping[str, np.ndarray] | None = None,
                 module_kinds: Mapping[str, str] | None = None, scope: str | None = None,
                 cache: PartitionCache | None = None) -> None:
        self.config = config
        #: shared by the planners of one checkpoint's candidate configs (see PartitionCache)
        self.cache = cache
        self.sensitivity = dict(sensitivity or {})
        self.module_kinds = dict(module_kinds or {})
        self.scope = scope
        self.results: dict[str, Any] = {}

    def eligible(self, tensors: Mapping[str, np.ndarray], dtypes: Mapping[str, str]) -> list[str]:
        return eligible(tensors, dtypes, self.config.min_numel, self.scope)

    def plan(self, tensors: Mapping[str, np.ndarray], dtypes: Mapping[str, str],
             previous: Mapping[str, dict[str, Any]]) -> Mapping[str, ArrayPlan]:
        inputs = tensor_inputs(self.eligible(tensors, dtypes), tensors, dtypes, previous,
                               self.sensitivity, self.module_kinds)
        self.results = {}  # path -> quantization stats, filled as tensors are written
        return LazyPlans(StateQuantizer(inputs, self.config, cache=self.cache), dtypes,
                         self.config.protected_dtype, self.results)
