"""From a QuantConfig to per-tensor storage plans the repository writes (ArrayPlan).

Chooses which tensors are quantized (floating, >= 2-D, >= ``min_numel`` elements, under
``model/`` when the state has a model part: optimizer state stays lossless by default),
fetches each tensor's previous codebook from the parent version's zarr.json (not from
process memory, so imports and resumed runs continue the codebook), and returns the
snapped values with an ``inshrink.nuq`` serializer at tolerance 0.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from inshrink_store.arrays import ArrayPlan
from inshrink_store.codecs import bf16
from inshrink_store.codecs.nuq import NUQZarrCodec
from inshrink_store.policy.config import QuantConfig
from inshrink_store.policy.partition import PartitionCache, StateQuantizer, TensorInput, layer_type

QUANTIZABLE = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def _widen(array: np.ndarray, dtype: str) -> np.ndarray:
    # copy=False: float32 tensors are read in place, not duplicated for the whole model
    return bf16.to_float32(array) if dtype == "BF16" else array.astype(np.float32, copy=False)


def _narrow(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return bf16.from_float32(values)
    return values.astype(np.float16 if dtype == "F16" else np.float32, copy=False)


class _LazyPlans(Mapping[str, ArrayPlan]):
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
        dtype = self._dtypes[path]
        codec = NUQZarrCodec(codebook=q.codebook, tolerance=0.0, protected_dtype=self._protected,
                             dtype="bfloat16" if dtype == "BF16" else None)
        return ArrayPlan(_narrow(q.values, dtype), codec, q.stats)

    def __iter__(self) -> Iterator[str]:
        return iter(self._q.names)

    def __len__(self) -> int:
        return len(self._q.names)

    def __contains__(self, path: object) -> bool:
        return path in self._q.chosen


class StatePlanner:
    """Implements the repository's ``Planner`` protocol for one configuration."""

    def __init__(self, config: QuantConfig, sensitivity: Mapping[str, np.ndarray] | None = None,
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
        scope = self.scope
        if scope is None:
            scope = "model/" if any(p.startswith("model/") for p in tensors) else ""
        return sorted(
            p for p, a in tensors.items()
            if p.startswith(scope) and dtypes.get(p) in QUANTIZABLE and a.ndim >= 2
            and a.size >= self.config.min_numel
        )

    def plan(self, tensors: Mapping[str, np.ndarray], dtypes: Mapping[str, str],
             previous: Mapping[str, dict[str, Any]]) -> Mapping[str, ArrayPlan]:
        inputs = {}
        for path in self.eligible(tensors, dtypes):
            prev = previous.get(path, {}).get("codec", {}).get("codebook")
            inputs[path] = TensorInput(
                values=_widen(tensors[path], dtypes[path]), dtype=dtypes[path],
                layer_type=layer_type(tensors[path].shape, self.module_kinds.get(path)),
                sensitivity=self.sensitivity.get(path),
                previous_codebook=tuple(prev) if prev else None,
            )
        self.results = {}  # path -> quantization stats, filled as tensors are written
        return _LazyPlans(StateQuantizer(inputs, self.config, cache=self.cache), dtypes, self.config.protected_dtype, self.results)
