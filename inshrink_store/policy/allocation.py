"""Allocation: per-tensor codebook sizes chosen for a size target or an error target.
Layer: refs, history and policy (the policy imports neither sibling), below ``parts``.

``repo.save(state, quantize=Allocation(target_ratio=12))`` stores the tensors a
:class:`~inshrink_store.policy.config.QuantConfig` would quantize, each with the number of
levels that makes the whole model's error smallest for the bytes of ratio 12 (or, with
``max_error=E``, the fewest bytes whose root-mean-square relative error over the tensors is at
most ``E``). A tensor may also stay lossless when that is where its bytes do the most good.
How the choice is made: :mod:`inshrink_store.policy.rate_distortion`.

Like ``QuantConfig`` it is a frozen, JSON-native value (a version records it) and a
repository planner; :class:`AllocationPlanner` does the work and keeps what it decided
(``decision``) for reports.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from inshrink_store.errors import FormatError
from inshrink_store.parallel import map_in_order, write_threads
from inshrink_store.plans import ArrayPlan
from inshrink_store.policy.channels import (
    MAX_SCALE,
    channel_scales,
    normalised,
    scalable,
    scaled_quantize,
)
from inshrink_store.policy.compensation import compensated
from inshrink_store.policy.config import PROTECTED_DTYPES, QuantConfig
from inshrink_store.policy.partition import (
    PartitionCache,
    TensorInput,
    protected_mask,
    quantize_tensor,
)
from inshrink_store.policy.planner import array_plan, eligible, tensor_inputs
from inshrink_store.policy.plans import PlanSet
from inshrink_store.policy.rate_distortion import LADDER, Option, allocate, tensor_options
from inshrink_store.policy.ratio import RatioEstimator, ratio_of
from inshrink_store.policy.sensitivity import role_weights, weights_from_sensitivity


def _positive(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


@dataclass(frozen=True)
class Allocation:
    """Per-tensor levels for one target: ``target_ratio`` (logical / stored bytes of the
    planned tensors, e.g. 12.0) or ``max_error`` (root-mean-square over the quantized tensors
    of ``||w - q|| / ||w||``, e.g. 0.05). ``protect`` of each tensor's values by magnitude (and
    sensitivity, when known) are kept in ``protected_dtype``; ``levels`` is the ladder of
    codebook sizes priced per tensor; tensors that are 1-D or smaller than ``min_numel`` stay
    lossless. ``channel_scales``: 2-D float32 tensors are also priced with one scale per
    column (:mod:`~inshrink_store.policy.channels`), and keep that form where it is cheaper at
    equal error. No pruning: levels alone carry the trade-off."""

    target_ratio: float | None = None
    max_error: float | None = None
    protect: float = 0.005
    protected_dtype: str = "bfloat16"
    levels: tuple[int, ...] = LADDER
    min_numel: int = 4096
    codebook_reuse_tolerance: float = 1.10
    channel_scales: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "levels", tuple(self.levels))
        if (self.target_ratio is None) == (self.max_error is None):
            raise FormatError(
                "Expected exactly one of target_ratio and max_error in Allocation. Got "
                f"target_ratio={self.target_ratio!r}, max_error={self.max_error!r} instead; e.g. "
                "Allocation(target_ratio=12) or Allocation(max_error=0.05)."
            )
        checks = [
            (self.target_ratio is None or (_positive(self.target_ratio) and self.target_ratio >= 1),
             "target_ratio a number >= 1", self.target_ratio),
            (self.max_error is None or _positive(self.max_error), "max_error a number > 0", self.max_error),
            (isinstance(self.protect, (int, float)) and not isinstance(self.protect, bool)
             and 0.0 <= self.protect <= 0.5, "protect a fraction in [0, 0.5]", self.protect),
            (self.protected_dtype in PROTECTED_DTYPES, f"protected_dtype one of {PROTECTED_DTYPES}",
             self.protected_dtype),
            (len(self.levels) > 0 and all(isinstance(n, int) and not isinstance(n, bool) and 2 <= n <= 254
                                          for n in self.levels), "levels a non-empty tuple of ints in 2..254",
             self.levels),
            (isinstance(self.min_numel, int) and not isinstance(self.min_numel, bool) and self.min_numel >= 1,
             "min_numel an int >= 1", self.min_numel),
            (_positive(self.codebook_reuse_tolerance) and self.codebook_reuse_tolerance >= 1,
             "codebook_reuse_tolerance a number >= 1", self.codebook_reuse_tolerance),
            (isinstance(self.channel_scales, bool), "channel_scales true or false", self.channel_scales),
        ]
        for ok, what, got in checks:
            if not ok:
                raise FormatError(f"Expected {what} in Allocation. Got {got!r} instead.")

    def to_dict(self) -> dict[str, Any]:
        """JSON-native; ``from_dict(json.loads(json.dumps(d)))`` gives an equal value.
        ``channel_scales`` is written only when off: a record of the default then holds
        exactly the keys of releases before channel scales, which refuse unknown keys, so
        they still read every version made with the default."""
        data = asdict(self)
        data["levels"] = list(self.levels)
        if self.channel_scales:
            del data["channel_scales"]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Allocation:
        if not isinstance(data, Mapping):
            raise FormatError(f"Expected an Allocation dict. Got {type(data).__name__} instead.")
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise FormatError(
                f"Expected only Allocation fields {sorted(cls.__dataclass_fields__)}. Got unknown "
                f"{sorted(unknown)} instead; remove them."
            )
        values = dict(data)
        if "levels" in values:
            if not isinstance(values["levels"], (list, tuple)):
                raise FormatError(f"Expected Allocation levels as a list. Got {values['levels']!r} instead.")
            values["levels"] = tuple(values["levels"])
        return cls(**values)

    def config_for(self, levels: int) -> QuantConfig:
        """The one-tensor configuration of a tensor given ``levels`` centres."""
        return QuantConfig(bins=levels, embedding_bins=levels, prune=0.0, protect=self.protect,
                           protected_dtype=self.protected_dtype, min_numel=self.min_numel,
                           codebook_reuse_tolerance=self.codebook_reuse_tolerance)

    def plan(self, tensors: Mapping[str, Any], dtypes: Mapping[str, str],
             previous: Mapping[str, dict[str, Any]]) -> Mapping[str, ArrayPlan]:
        """Repository hook: ``repo.save(..., quantize=Allocation(target_ratio=12))``."""
        return AllocationPlanner(self).plan(tensors, dtypes, previous)


@dataclass(frozen=True)
class AllocationDecision:
    """What an allocation chose: levels per tensor (None: lossless), which tensors are stored
    channel-scaled, and the estimates it made them from: the ratio of the planned scope and
    the RMS relative error of the quantized ones."""

    levels: Mapping[str, int | None] = field(default_factory=dict)
    estimated_ratio: float = 0.0
    estimated_rms_error: float = 0.0
    scaled: frozenset[str] = frozenset()

    def to_dict(self) -> dict[str, Any]:
        return {"levels": dict(self.levels), "estimated_ratio": self.estimated_ratio,
                "estimated_rms_error": self.estimated_rms_error, "scaled": sorted(self.scaled)}


class _LazyPlans(Mapping[str, ArrayPlan]):
    """Each chosen tensor quantized when the writer asks for it (one in memory at a time)."""

    def __init__(self, planner: AllocationPlanner, inputs: Mapping[str, TensorInput],
                 levels: Mapping[str, int], dtypes: Mapping[str, str], scaled: frozenset[str] = frozenset()) -> None:
        self._planner, self._inputs, self._levels, self._dtypes = planner, inputs, levels, dtypes
        self._scaled = scaled

    def __getitem__(self, path: str) -> ArrayPlan:
        if path not in self._levels:
            raise KeyError(path)
        spec = self._planner.allocation
        quantize = scaled_quantize if path in self._scaled else quantize_tensor
        q = quantize(self._inputs[path], spec.config_for(self._levels[path]), cache=self._planner.cache, name=path)
        hessian = self._planner.hessians.get(path)
        if hessian is not None and q.values.ndim == 2 and hessian.shape == (q.values.shape[1],) * 2:
            q = compensated(q, self._inputs[path], hessian)
        self._planner.results[path] = q.stats
        return array_plan(q, self._dtypes[path], spec.protected_dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self._levels)

    def __len__(self) -> int:
        return len(self._levels)

    def __contains__(self, path: object) -> bool:
        return path in self._levels


class AllocationPlanner:
    """Implements the repository's ``Planner`` protocol for an :class:`Allocation`.

    ``sensitivity`` (``|g*w|`` per element) joins magnitude in choosing protected values, as
    in a configuration's save; ``scope`` is the planned prefix (None: ``model/`` when the state
    has one). After :meth:`plan`, ``decision`` says what was chosen and ``results`` holds each
    written tensor's quantization statistics."""

    def __init__(self, allocation: Allocation, sensitivity: Mapping[str, np.ndarray] | None = None,
                 module_kinds: Mapping[str, str] | None = None, scope: str | None = None,
                 weights: Mapping[str, float] | None = None,
                 importance: Mapping[str, np.ndarray] | None = None,
                 hessians: Mapping[str, np.ndarray] | None = None) -> None:
        self.allocation = allocation
        #: path -> per-element importance (a diagonal Fisher): errors priced by what they do
        self.importance = dict(importance or {})
        #: path -> a Linear weight's input second moment ``sum x x^T``: its rounding then
        #: minimises the output error (:mod:`inshrink_store.policy.compensation`)
        self.hessians = dict(hessians or {})
        self.sensitivity = dict(sensitivity or {})
        #: path -> how much its error matters to the output (None: measured from nothing,
        #: the role defaults of :mod:`inshrink_store.policy.sensitivity` apply)
        self.weights = None if weights is None else dict(weights)
        self.module_kinds = dict(module_kinds or {})
        self.scope = scope
        self.cache = PartitionCache()
        self.decision: AllocationDecision | None = None
        self.results: dict[str, Any] = {}

    def options(self, tensors: Mapping[str, np.ndarray], dtypes: Mapping[str, str],
                previous: Mapping[str, dict[str, Any]]) -> tuple[dict[str, TensorInput], dict[str, list[Option]],
                                                                 RatioEstimator, str]:
        """(inputs, options per tensor, the estimator of the scope, the scope) for a state."""
        spec = self.allocation
        scope = self.scope
        if scope is None:
            scope = "model/" if any(p.startswith("model/") for p in tensors) else ""
        paths = eligible(tensors, dtypes, spec.min_numel, scope)
        inputs = tensor_inputs(paths, tensors, dtypes, previous, self.sensitivity, self.module_kinds)
        estimator = RatioEstimator(tensors, scope, dtypes)

        def price(path: str) -> list[Option]:
            t = inputs[path]
            w = np.ascontiguousarray(t.values, np.float32)
            protected = protected_mask(w, t.sensitivity, spec.protect)
            # the same key quantize_tensor uses for the rest of an unpruned tensor: fitted once
            sketch = self.cache.unprotected_sketch((path, spec.protect, None, None), w, protected)
            options = tensor_options(w, dtype=str(t.dtype), protect=spec.protect,
                                     protected_dtype=spec.protected_dtype, sensitivity=t.sensitivity,
                                     ladder=spec.levels, lossless_bytes=estimator.lossless_bytes_of(path),
                                     sketch=sketch, protected=protected, importance=self.importance.get(path))
            scales = channel_scales(w) if spec.channel_scales and scalable(w, t.dtype) else None
            if scales is not None and float(scales.max()) <= MAX_SCALE:
                # the same tensor with its columns normalised: the allocation keeps whichever
                # form removes more cost per byte (scales included in the bytes)
                u = normalised(w, scales)
                kept = protected_mask(u, t.sensitivity, spec.protect)
                u_sketch = self.cache.unprotected_sketch((f"{path}#scaled", spec.protect, None, None), u, kept)
                options += tensor_options(u, dtype=str(t.dtype), protect=spec.protect,
                                          protected_dtype=spec.protected_dtype, ladder=spec.levels,
                                          sketch=u_sketch, protected=kept, column_scales=scales,
                                          importance=self.importance.get(path))
            return options

        priced = map_in_order(price, paths, write_threads(), "inshrink-allocate")
        return inputs, dict(zip(paths, priced, strict=True)), estimator, scope

    def plan(self, tensors: Mapping[str, np.ndarray], dtypes: Mapping[str, str],
             previous: Mapping[str, dict[str, Any]]) -> Mapping[str, ArrayPlan]:
        inputs, options, estimator, _ = self.options(tensors, dtypes, previous)
        self.decision = decide(self.allocation, options, estimator, self.weights_for(options))
        self.results = {}
        levels = {p: lv for p, lv in self.decision.levels.items() if lv is not None}
        return _LazyPlans(self, inputs, levels, dtypes, self.decision.scaled)

    def weights_for(self, options: Mapping[str, Any]) -> dict[str, float]:
        """The weight of every priced tensor: the given ones; else from the sensitivity
        scores when every priced tensor has them (the Checkpointer's gradient EMA); else the
        role defaults."""
        if self.weights is not None:
            return {p: self.weights.get(p, 1.0) for p in options}
        measured = weights_from_sensitivity(self.sensitivity, options) if self.sensitivity else None
        return measured if measured is not None else role_weights(options, self.module_kinds)

    def quantize(self, inputs: Mapping[str, TensorInput], levels: Mapping[str, int],
                 dtypes: Mapping[str, str], scaled: frozenset[str] = frozenset()) -> dict[str, ArrayPlan]:
        """Every chosen tensor quantized now (a search evaluates them all at once)."""
        plans = _LazyPlans(self, inputs, levels, dtypes, scaled)
        return {p: plans[p] for p in plans}


def decide(spec: Allocation, options: Mapping[str, list[Option]], estimator: RatioEstimator,
           weights: Mapping[str, float] | None = None) -> AllocationDecision:
    """The levels ``spec`` gets from priced ``options`` (tensors the estimator's scope holds
    but ``options`` does not stay lossless and count as fixed bytes), each tensor's cost
    scaled by its weight (none: all alike)."""
    fixed = sum(estimator.lossless_bytes_of(p) for p in estimator.paths if p not in options)
    if spec.max_error is not None:
        chosen = allocate(options, max_mean_sq_error=spec.max_error ** 2, weights=weights)
    else:
        target = float(spec.target_ratio or 1.0)  # one of the two is set (checked at construction)
        chosen = allocate(options, budget_bytes=estimator.logical_bytes / target - fixed, weights=weights)
    quantized = [o for o in chosen.values() if o.levels is not None]
    stored = fixed + sum(o.stored_bytes for o in chosen.values())
    rms = math.sqrt(sum(o.sq_error for o in quantized) / len(quantized)) if quantized else 0.0
    return AllocationDecision({p: o.levels for p, o in chosen.items()},
                              ratio_of(estimator.logical_bytes, int(stored)), rms,
                              frozenset(p for p, o in chosen.items() if o.scaled and o.levels is not None))


#: the target ratios a search over allocations tries (SearchPolicy(allocation_ratios=...))
RATIOS = (4.0, 6.0, 8.0, 10.0, 12.0, 14.0, 16.0, 18.0, 20.0)


@dataclass(frozen=True)
class AllocationTrial:
    """One target a search tried: the ratio its allocation was estimated at and, when it was
    evaluated, the quality and whether it was within tolerance."""

    target_ratio: float
    ratio: float
    quality: float | None = None
    feasible: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"target_ratio": self.target_ratio, "ratio": self.ratio, "quality": self.quality,
                "feasible": self.feasible}

    @classmethod
    def from_dict(cls, data: Any) -> AllocationTrial:
        if not isinstance(data, Mapping) or set(data) != {"target_ratio", "ratio", "quality", "feasible"}:
            raise FormatError(
                "Expected an allocation trial {target_ratio, ratio, quality, feasible}. Got "
                f"{data!r} instead."
            )
        numbers = [data["target_ratio"], data["ratio"]] + ([] if data["quality"] is None else [data["quality"]])
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in numbers) or \
                not (data["feasible"] is None or isinstance(data["feasible"], bool)):
            raise FormatError(f"Expected numbers and a flag in an allocation trial. Got {dict(data)!r} instead.")
        return cls(float(data["target_ratio"]), float(data["ratio"]),
                   None if data["quality"] is None else float(data["quality"]), data["feasible"])


class AllocationCandidates:
    """One state's allocations by target ratio, for a search that moves that one knob: every
    tensor is priced once, then each target is an allocation (cheap) and its plans."""

    def __init__(self, base: Allocation, tensors: Mapping[str, np.ndarray], dtypes: Mapping[str, str],
                 previous: Mapping[str, dict[str, Any]], *, sensitivity: Mapping[str, np.ndarray] | None = None,
                 module_kinds: Mapping[str, str] | None = None, scope: str | None = None,
                 weights: Mapping[str, float] | None = None,
                 importance: Mapping[str, np.ndarray] | None = None,
                 hessians: Mapping[str, np.ndarray] | None = None) -> None:
        self.base, self.dtypes = base, dtypes
        self.planner = AllocationPlanner(base, sensitivity, module_kinds, scope, weights, importance, hessians)
        self.inputs, self.options, self.estimator, _ = self.planner.options(tensors, dtypes, previous)
        self.weights = self.planner.weights_for(self.options)

    def spec(self, target_ratio: float) -> Allocation:
        return dataclasses.replace(self.base, target_ratio=float(target_ratio), max_error=None)

    def decision(self, target_ratio: float) -> AllocationDecision:
        return decide(self.spec(target_ratio), self.options, self.estimator, self.weights)

    def plans(self, target_ratio: float) -> PlanSet:
        """The quantized plans of one target (values made now), measured by the estimate."""
        made = self.decision(target_ratio)
        levels = {p: lv for p, lv in made.levels.items() if lv is not None}
        plans = self.planner.quantize(self.inputs, levels, self.dtypes, made.scaled)
        stored = self.estimator.logical_bytes / made.estimated_ratio if made.estimated_ratio else 0
        return PlanSet(None, plans, self.estimator.logical_bytes, int(stored))
