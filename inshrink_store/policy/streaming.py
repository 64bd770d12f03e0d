"""A decision's plans made as the writer reads them: one tensor planned, encoded and freed at a time.
Layer: refs, history and policy (the policy imports neither sibling), below ``parts``.

Why: a search needs every tensor's *estimated* error and ratio for a candidate (sketches and
samples, see :mod:`inshrink_store.policy.candidates`), never every tensor's quantized values at
once. Planning the chosen configuration for the whole state before writing it held a
float32 copy of every quantized tensor and every compressed moment (about the state's size
again) until the version was written: on a 503 M-parameter state with AdamW, 2.2x the state
beyond the live model. Here the writer asks for one path at a time
(:func:`~inshrink_store.writer.write_arrays` reads ``plans.get(path)`` on its threads), the plan
is made then, and nothing keeps it once its chunks are encoded.

- :class:`StreamedPlanSet`: a :class:`PlanSet` over mappings that make their plans when read.
- :class:`WeightStream`: the model's plans under one configuration, from the same
  :class:`~inshrink_store.policy.partition.StateQuantizer` the search estimated with (the
  same plans as :meth:`Candidates.plans <inshrink_store.policy.candidates.Candidates.plans>`,
  bit for bit). It keeps, per weight that has Adam moments, the packed mask of where its
  update was dropped (a bit per element), which is all the moments' joint pruning reads.
- :class:`MomentStream`: each Adam pair planned by the policy's own ``plan`` on that pair
  alone when the writer reaches it (pairs are planned independently, so the plans are the
  ones of planning all pairs together), the pairs planned at once bounded by the same working
  memory as :func:`~inshrink_store.policy.moments.plan_moments`; :attr:`MomentStream.record`
  is complete once every pair was written.

Deterministic: which thread plans a tensor never changes its plan; a path read twice (a
retried commit) is planned again, to the same values.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from inshrink_store.plans import ArrayPlan
from inshrink_store.policy.moments import (
    M_KEY,
    V_KEY,
    AdamHyper,
    MomentPolicy,
    MomentRecord,
    MomentTensorRecord,
    WorkingMemory,
    adam_pairs,
)
from inshrink_store.policy.partition import StateQuantizer
from inshrink_store.policy.planner import array_plan
from inshrink_store.policy.plans import PlanSet


@dataclass(frozen=True, eq=False)
class StreamedPlanSet(PlanSet):
    """A :class:`PlanSet` whose plans come from ``sources`` (mappings that may make a plan
    when it is read); a path in several takes the last one's, as :meth:`PlanSet.with_plans`
    lets the added plans win. ``config`` and the byte counts describe the model's scope."""

    sources: tuple[Mapping[str, ArrayPlan], ...] = ()

    def __getitem__(self, path: str) -> ArrayPlan:
        for source in reversed(self.sources):
            if path in source:
                return source[path]
        raise KeyError(path)

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys(path for source in self.sources for path in source))

    def __len__(self) -> int:
        return len(dict.fromkeys(path for source in self.sources for path in source))

    def __contains__(self, path: object) -> bool:
        return any(path in source for source in self.sources)

    def with_plans(self, extra: Mapping[str, ArrayPlan]) -> StreamedPlanSet:
        return StreamedPlanSet(self.config, {}, self.logical_bytes, self.stored_bytes, (*self.sources, extra))


@dataclass(frozen=True)
class _Pruned:
    """What the moments' joint pruning reads of a weight's plan: ``pruned`` (``values`` absent)."""

    pruned: np.ndarray
    values: None = None


class WeightStream(Mapping[str, ArrayPlan]):
    """The plans of ``quantizer``'s tensors, each made when read (see the module docstring).

    ``masked``: the weights whose moments are planned jointly; for each, the first plan made
    leaves where its update was dropped (the plan's ``pruned`` mask, else where its value is
    0: what :func:`~inshrink_store.policy.moments.plan_moments` reads of a weight's plan),
    packed to a bit per element. :meth:`pruned` gives it back (planning the weight if no
    reader has yet). ``only``: plan just these of the quantizer's tensors (a candidate's
    tensors that a closed-loop save keeps from its parent, planned only if read)."""

    def __init__(self, quantizer: StateQuantizer, dtypes: Mapping[str, str], protected_dtype: str,
                 masked: frozenset[str] = frozenset(), only: frozenset[str] | None = None) -> None:
        self._q, self._dtypes, self._protected = quantizer, dtypes, protected_dtype
        #: the paths this stream plans: ``quantizer``'s, or those of them in ``only``
        self._names = [p for p in quantizer.names if only is None or p in only]
        self._chosen = frozenset(self._names)
        self._masks: dict[str, tuple[np.ndarray, tuple[int, ...]]] = {}
        self._locks = {path: threading.Lock() for path in masked if path in self._chosen}

    def __getitem__(self, path: str) -> ArrayPlan:
        if path not in self._chosen:
            raise KeyError(path)
        lock = self._locks.get(path)
        if lock is None:
            return self._make(path)
        with lock:  # a moment pair asking for this mask waits for the plan being made
            return self._make(path)

    def _make(self, path: str) -> ArrayPlan:
        plan = array_plan(self._q.quantize(path), self._dtypes[path], self._protected)
        if path in self._locks and path not in self._masks:
            values = np.asarray(plan.values)
            mask = plan.pruned if plan.pruned is not None and np.shape(plan.pruned) == values.shape else values == 0
            self._masks[path] = (np.packbits(np.asarray(mask, bool).ravel()), values.shape)
        return plan

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, path: object) -> bool:
        return path in self._chosen

    def pruned(self, path: str) -> np.ndarray:
        """Where weight ``path``'s update was dropped (``path`` in ``masked`` and planned here)."""
        with self._locks[path]:
            if path not in self._masks:
                self._make(path)  # not read yet: planned for its mask, the plan dropped
            packed, shape = self._masks[path]
        size = int(np.prod(shape))
        return np.unpackbits(packed, count=size).view(bool).reshape(shape)


class _Masks(Mapping[str, Any]):
    """The ``weights`` a moment pair is planned with: path -> its dropped-update mask."""

    def __init__(self, weights: WeightStream, paths: frozenset[str]) -> None:
        self._weights, self._paths = weights, paths

    def __getitem__(self, path: str) -> _Pruned:
        if path not in self._paths:
            raise KeyError(path)
        return _Pruned(self._weights.pruned(path))

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._paths))

    def __len__(self) -> int:
        return len(self._paths)

    def __contains__(self, path: object) -> bool:
        return path in self._paths


PlanPair = Callable[[Mapping[str, np.ndarray], Mapping[str, Any]], Any]


class MomentStream(Mapping[str, ArrayPlan]):
    """The plans of a :class:`~inshrink_store.policy.moments.MomentPolicy` for the Adam pairs of
    ``tensors`` (the ``optimizer/`` tensors), one pair made when the writer reads its ``exp_avg``
    or ``exp_avg_sq`` (the other plan waits for its own read, then is dropped).

    ``weights`` / ``params``: the model's plans (a :class:`WeightStream` gives its masks) and
    state prefix -> model path, for the joint pruning; ``previous`` and ``hyper`` as :meth:`MomentPolicy.plan` takes them. Pairs
    smaller than the policy's ``min_numel`` are decided at once (they stay lossless); a pair
    the guard refuses has no plan (``KeyError``: the writer stores it lossless)."""

    def __init__(self, policy: MomentPolicy, tensors: Mapping[str, np.ndarray], dtypes: Mapping[str, str],
                 previous: Mapping[str, dict[str, Any]], *, weights: Mapping[str, Any] | None,
                 params: Mapping[str, str], hyper: Mapping[str, AdamHyper]) -> None:
        self._policy, self._tensors, self._dtypes, self._previous = policy, tensors, dtypes, previous
        self._params, self._hyper = params, hyper
        self._pairs = adam_pairs(tensors, dtypes)
        self._weights: Mapping[str, Any] = weights if weights is not None else {}
        if isinstance(weights, WeightStream):  # masks, not plans: a weight's plan is not made twice
            self._weights = _Masks(weights, frozenset(p for p in params.values() if p in weights))
        by_prefix: dict[str, dict[str, np.ndarray]] = {}
        for path, array in tensors.items():
            by_prefix.setdefault(path.rsplit("/", 1)[0], {})[path] = array
        self._members = {prefix: by_prefix.get(prefix, {}) for prefix in self._pairs}
        self._records: dict[str, MomentTensorRecord] = {}
        self._pending: dict[str, ArrayPlan] = {}
        #: per pair, the paths planned with the other one and not read yet
        self._owed: dict[str, set[str]] = {}
        self._locks = {prefix: threading.Lock() for prefix in self._pairs}
        self._budget = WorkingMemory(sum(tensors[f"{p}/{M_KEY}"].size for p in self._pairs))
        self._owner: dict[str, str] = {}
        self._skipped: str | None = None
        if not self._pairs:  # nothing Adam-shaped: the policy's own record says why
            self._skipped = policy.plan(tensors, dtypes, previous).record.skipped
        for prefix in self._pairs:
            if tensors[f"{prefix}/{M_KEY}"].size < policy.min_numel:
                self._plan_pair(prefix)
            else:
                self._owner[f"{prefix}/{M_KEY}"] = self._owner[f"{prefix}/{V_KEY}"] = prefix

    def _plan_pair(self, prefix: str) -> dict[str, ArrayPlan]:
        size = self._tensors[f"{prefix}/{M_KEY}"].size
        with self._budget.hold(size):
            made = self._policy.plan(self._members[prefix], self._dtypes, self._previous, weights=self._weights,
                                     params={prefix: self._params[prefix]} if prefix in self._params else {},
                                     hyper=self._hyper)
        self._records[prefix] = made.record.tensors[prefix]
        return dict(made)

    def __getitem__(self, path: str) -> ArrayPlan:
        prefix = self._owner.get(path)
        if prefix is None:
            raise KeyError(path)
        lock = self._locks[prefix]
        if not lock.acquire(blocking=False):
            # the pair's other tensor is being planned on another writer thread (the writer reads
            # a pair's two paths one after the other): plan a later pair meanwhile, not idle
            self._plan_ahead(prefix)
            lock.acquire()
        try:
            owed = self._owed.get(prefix, set())
            if path in owed:  # planned with its pair's other tensor: handed over once, then dropped
                owed.discard(path)
                plan = self._pending.pop(path, None)
            else:
                made = self._plan_pair(prefix)
                plan = made.pop(path, None)
                self._pending.update(made)
                self._owed[prefix] = {f"{prefix}/{M_KEY}", f"{prefix}/{V_KEY}"} - {path}
        finally:
            lock.release()
        if plan is None:
            raise KeyError(path)  # the guard kept this pair lossless
        return plan

    def _plan_ahead(self, after: str) -> None:
        """Plan the first pair after ``after`` that no thread has planned or is planning; its
        plans wait for the writer's reads (the same plans whichever thread makes them)."""
        streamed = [p for p in self._pairs if p in self._owner.values()]
        for prefix in streamed[streamed.index(after) + 1:]:
            lock = self._locks[prefix]
            if prefix in self._owed or not lock.acquire(blocking=False):
                continue
            try:
                if prefix in self._owed:
                    continue
                self._pending.update(self._plan_pair(prefix))
                self._owed[prefix] = {f"{prefix}/{M_KEY}", f"{prefix}/{V_KEY}"}
            finally:
                lock.release()
            return

    def __iter__(self) -> Iterator[str]:
        return iter(self._owner)

    def __len__(self) -> int:
        return len(self._owner)

    def __contains__(self, path: object) -> bool:
        return path in self._owner

    @property
    def record(self) -> MomentRecord:
        """Each pair's outcome (a pair not read yet is planned now for it)."""
        for prefix in self._pairs:
            if prefix not in self._records:
                with self._locks[prefix]:
                    if prefix not in self._records:
                        self._plan_pair(prefix)
        return MomentRecord(self._policy, {p: self._records[p] for p in self._pairs}, self._skipped)
