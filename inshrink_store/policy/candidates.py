"""The candidates of one checkpoint: each configuration's ratio, and its plans when asked.
Layer: refs, history and policy (the policy imports neither sibling), below ``parts``.

:class:`CandidatePlanner` quantizes every eligible tensor under one configuration at
once and returns a :class:`PlanSet` with its measured ratio; it is a repository planner
too. :class:`Candidates` serves a search over one state: it shares the sketches, counts
and codebooks of all configurations (a :class:`PartitionCache`), estimates each
configuration's ratio from them and a sample of each tensor without quantizing the model
(:mod:`inshrink_store.policy.estimate`), plans only the configurations the search
evaluates, keeps the most recent few PlanSets (each is a quantized copy of the model)
and remembers every ratio, so re-planning an evicted candidate is cheap and never
changes its answer.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np

from inshrink_store.codecs.nuq import nearest_index
from inshrink_store.errors import FormatError
from inshrink_store.parallel import map_in_order, write_threads
from inshrink_store.plans import ArrayPlan
from inshrink_store.policy.config import QuantConfig
from inshrink_store.policy.estimate import estimated_bytes
from inshrink_store.policy.moments import AdamHyper
from inshrink_store.policy.partition import (
    PartitionCache,
    StateQuantizer,
    TensorSample,
    sample_index,
)
from inshrink_store.policy.planner import array_plan, eligible, tensor_inputs
from inshrink_store.policy.plans import PlanSet
from inshrink_store.policy.ratio import RatioEstimator, ratio_of
from inshrink_store.policy.streaming import StreamedPlanSet, WeightStream

#: candidate plan sets held at once during a search (each about the model's size)
KEEP = 2


def _frozen(plan: ArrayPlan) -> ArrayPlan:
    """The plan with its freshly made values read-only: readers share them, none may write."""
    plan.values.flags.writeable = False
    return plan


def state_quantizer(config: QuantConfig, tensors: Mapping[str, np.ndarray], dtypes: Mapping[str, str],
                    previous: Mapping[str, dict[str, Any]], sensitivity: Mapping[str, np.ndarray],
                    module_kinds: Mapping[str, str], scope: str, cache: PartitionCache | None) -> StateQuantizer:
    """The quantizer of the eligible tensors under ``scope`` with ``config`` (nothing quantized yet)."""
    paths = eligible(tensors, dtypes, config.min_numel, scope)
    return StateQuantizer(tensor_inputs(paths, tensors, dtypes, previous, sensitivity, module_kinds), config,
                          cache=cache)


class CandidatePlanner:
    """Plans the tensors under ``scope`` with one configuration, all at once, and measures them.

    Unlike :class:`~inshrink_store.policy.planner.StatePlanner` (lazy, one tensor in memory
    at a time) the result holds every quantized tensor: a search reads it several times.
    ``estimator`` (built from the tensors when omitted) and ``cache`` are shared by the
    candidates of one state.
    """

    def __init__(self, config: QuantConfig, *, sensitivity: Mapping[str, np.ndarray] | None = None,
                 module_kinds: Mapping[str, str] | None = None, scope: str = "model/",
                 cache: PartitionCache | None = None, estimator: RatioEstimator | None = None,
                 measure: bool = True, skip: frozenset[str] = frozenset()) -> None:
        self.config, self.scope, self.cache, self.estimator = config, scope, cache, estimator
        #: tensors planned only when their plan is read (see :class:`Candidates`' ``skip``)
        self.skip = skip
        #: encode the plans to measure their stored bytes (False: ``stored_bytes`` is None)
        self.measure = measure
        self.sensitivity: Mapping[str, np.ndarray] = sensitivity or {}
        self.module_kinds: Mapping[str, str] = module_kinds or {}

    def plan(self, tensors: Mapping[str, np.ndarray], dtypes: Mapping[str, str],
             previous: Mapping[str, dict[str, Any]]) -> PlanSet:
        quantizer = state_quantizer(self.config, tensors, dtypes, previous, self.sensitivity, self.module_kinds,
                                    self.scope, self.cache)

        def one(path: str) -> ArrayPlan:
            return _frozen(array_plan(quantizer.quantize(path), dtypes[path], self.config.protected_dtype))

        # tensors on the writer's threads (numpy releases the GIL); each touches only its own
        # cache entries, and results come back by name: the same plans whatever the threads
        names = [name for name in quantizer.names if name not in self.skip]
        plans = dict(zip(names, map_in_order(one, names, write_threads(), "inshrink-plan"), strict=True))
        estimator = self.estimator or RatioEstimator(tensors, self.scope, dtypes)
        skipped = frozenset(quantizer.names) - set(names)
        made = PlanSet(self.config, plans, estimator.logical_bytes, None)
        if skipped:
            made = StreamedPlanSet(self.config, {}, estimator.logical_bytes, None, (
                made, WeightStream(quantizer, dtypes, self.config.protected_dtype, only=skipped)))
        if not self.measure:
            return made
        return dataclasses.replace(made, stored_bytes=estimator.stored_bytes(made))


class Candidates:
    """One state's candidate configurations (the search's view of the model).

    :meth:`ratio` is the estimate the search ranks by (nothing is quantized);
    :meth:`plans` quantizes a configuration (for an evaluation or the write) without
    encoding it; :meth:`measured_ratio` encodes one. ``keep`` PlanSets are held at once,
    least recently used evicted first; ratios are remembered for every configuration.
    :meth:`predicted_error` is the error a budgeted search ranks by, relative to
    ``reference`` (default: the tensors themselves; a closed-loop save passes the live weights,
    so a residual's error and a keyframe's are on one scale) and weighted by ``error_weights``
    (default: ``sensitivity``).
    """

    def __init__(self, tensors: Mapping[str, np.ndarray], dtypes: Mapping[str, str],
                 previous: Mapping[str, dict[str, Any]], *, sensitivity: Mapping[str, np.ndarray] | None = None,
                 module_kinds: Mapping[str, str] | None = None, scope: str = "model/", keep: int = KEEP,
                 optimizer_params: Mapping[str, str] | None = None,
                 optimizer_hyper: Mapping[str, AdamHyper] | None = None,
                 reference: Mapping[str, np.ndarray] | None = None,
                 error_weights: Mapping[str, np.ndarray] | None = None, skip: frozenset[str] = frozenset()) -> None:
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise FormatError(f"Expected keep to be an int >= 1 (PlanSets held at once). Got {keep!r} instead.")
        self.tensors, self.dtypes, self.previous = tensors, dtypes, previous
        self.sensitivity: Mapping[str, np.ndarray] = sensitivity or {}
        self.module_kinds: Mapping[str, str] = module_kinds or {}
        self.scope, self.keep = scope, keep
        #: optimizer state prefix (``optimizer/state/3``) -> the model path of its parameter, and
        #: prefix -> Adam's betas/eps: what a MomentPolicy needs beyond the tensors themselves
        self.optimizer_params: Mapping[str, str] = optimizer_params or {}
        self.optimizer_hyper: Mapping[str, AdamHyper] = optimizer_hyper or {}
        self.cache = PartitionCache()
        self.estimator = RatioEstimator(tensors, scope, dtypes)
        self._held: OrderedDict[QuantConfig, PlanSet] = OrderedDict()
        self._ratios: dict[QuantConfig, float] = {}
        self._measured: dict[QuantConfig, float] = {}
        self.reference: Mapping[str, np.ndarray] = reference if reference is not None else tensors
        self.error_weights: Mapping[str, np.ndarray] = (error_weights if error_weights is not None
                                                        else self.sensitivity)
        self._errors: dict[QuantConfig, float] = {}
        #: tensors whose plans are made only when read: a closed-loop save keeps a tensor that
        #: did not change from its parent and never reads its plan (a frozen layer is estimated
        #: with the others, never quantized)
        self.skip = frozenset(skip)

    @property
    def metrics_available(self) -> tuple[str, ...]:
        """Prune metrics the search may use: sensitivity only when gradients were observed."""
        return ("magnitude", "sensitivity") if self.sensitivity else ("magnitude",)

    def plans(self, config: QuantConfig) -> PlanSet:
        """The PlanSet of ``config`` (made now unless held), not encoded: ``stored_bytes`` is
        None (:meth:`measured_ratio` encodes it)."""
        if config in self._held:
            self._held.move_to_end(config)
            return self._held[config]
        planner = CandidatePlanner(config, sensitivity=self.sensitivity, module_kinds=self.module_kinds,
                                   scope=self.scope, cache=self.cache, estimator=self.estimator, measure=False,
                                   skip=self.skip)
        made = self._held[config] = planner.plan(self.tensors, self.dtypes, self.previous)
        while len(self._held) > self.keep:
            self._held.popitem(last=False)
        return made

    def held(self, config: QuantConfig) -> PlanSet | None:
        """The PlanSet of ``config`` when one is held (planned for an evaluation), else None:
        nothing is planned."""
        return self._held.get(config)

    def quantizer(self, config: QuantConfig) -> StateQuantizer:
        """The state's quantizer under ``config`` (thresholds pooled; nothing quantized yet)."""
        return state_quantizer(config, self.tensors, self.dtypes, self.previous, self.sensitivity, self.module_kinds,
                               self.scope, self.cache)

    def estimated_bytes(self, config: QuantConfig) -> int:
        """Bytes the scope's tensors would take under ``config``: the quantized tensors estimated
        from their parts and a sample of each (:func:`~inshrink_store.policy.estimate.estimated_bytes`),
        the others' lossless bytes measured."""
        quantizer = self.quantizer(config)

        def one(path: str) -> int:
            return estimated_bytes(quantizer.part(path), quantizer.fresh_codebook(path), quantizer.sample(path))

        quantized = sum(map_in_order(one, quantizer.names, write_threads(), "inshrink-estimate"))
        return quantized + sum(self.estimator.lossless_bytes_of(p) for p in self.estimator.paths
                               if p not in quantizer.chosen)

    def ratio(self, config: QuantConfig) -> float:
        """The estimated ratio of ``config`` (no tensor is quantized; remembered): what the
        search ranks candidates by."""
        if config not in self._ratios:
            self._ratios[config] = ratio_of(self.estimator.logical_bytes, self.estimated_bytes(config))
        return self._ratios[config]

    def measured_ratio(self, config: QuantConfig) -> float:
        """The ratio of ``config`` measured by encoding its plans as the store does (remembered)."""
        if config not in self._measured:
            made = self.plans(config)
            self._measured[config] = ratio_of(self.estimator.logical_bytes, self.estimator.stored_bytes(made))
        return self._measured[config]

    def predicted_error(self, config: QuantConfig) -> float:
        """The weighted reconstruction error of ``config`` (nothing quantized; remembered): per
        quantized tensor, on the same sample as :meth:`ratio` and its fresh codebook,
        ``sum(w * (q - x)**2) / sum(w * r**2)`` (``q`` the stored value: the nearest centre,
        0 where pruned, ``x`` where protected; ``r`` the reference, ``w`` the error weight,
        1 without one), then the mean over tensors: every layer counts alike."""
        if config not in self._errors:
            quantizer = self.quantizer(config)

            def one(path: str) -> float:
                return _sample_error(quantizer.sample(path), quantizer.fresh_codebook(path),
                                     self.reference.get(path), self.error_weights.get(path))

            errors = map_in_order(one, quantizer.names, write_threads(), "inshrink-error")
            self._errors[config] = float(np.mean(errors)) if errors else 0.0
        return self._errors[config]


def _sample_error(sample: TensorSample, codebook: np.ndarray, reference: np.ndarray | None,
                  weights: np.ndarray | None) -> float:
    """One tensor's relative squared error on its sample (see :meth:`Candidates.predicted_error`)."""
    x = sample.values.astype(np.float64)
    if x.size == 0:
        return 0.0
    centres = np.asarray(codebook, np.float64).astype(np.float32)
    q = centres[nearest_index(sample.values, centres)].astype(np.float64)
    q[sample.pruned] = 0.0
    q[sample.protected] = x[sample.protected]
    index = sample_index(sample.size)
    # gathered, then widened (exact either way): not a float64 copy of the whole tensor per call
    r = x if reference is None else np.asarray(np.asarray(reference).ravel()[index], np.float64)
    w = np.ones_like(x) if weights is None else np.abs(np.asarray(np.asarray(weights).ravel()[index], np.float64))
    den = float(np.sum(w * r * r))
    if den <= 0:
        w, den = np.ones_like(x), float(np.sum(r * r))
    return float(np.sum(w * (q - x) ** 2)) / den if den > 0 else 0.0
