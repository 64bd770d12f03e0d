"""PlanSet: one configuration's plans for one state, made once, with what was measured.
Layer: refs, history and policy (the policy imports neither sibling), below ``parts``.

The search quantizes a candidate, measures its stored size, maybe evaluates it, and
writes the winner; all of these read the same plans. A PlanSet carries them together
with the configuration and the measurement as one immutable value, so nothing is
attached to planners after the fact and no reader can change what another one sees.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from inshrink_store.errors import FormatError
from inshrink_store.plans import ArrayPlan
from inshrink_store.policy.config import QuantConfig
from inshrink_store.policy.ratio import ratio_of


@dataclass(frozen=True, eq=False)
class PlanSet(Mapping[str, ArrayPlan]):
    """A read-only mapping path -> :class:`ArrayPlan`, plus ``config`` (None: lossless) and
    the bytes the planned tensors take: ``logical_bytes``, and ``stored_bytes`` as the store
    writes them (see :mod:`inshrink_store.policy.ratio`), or None when the plans were made
    without encoding them (a search's candidates, whose ratios are estimated).

    Plans made during a search are written as they are: ``repo.save(tensors, quantize=plan_set)``.
    """

    config: QuantConfig | None
    plans: Mapping[str, ArrayPlan] = field(default_factory=dict)
    logical_bytes: int = 0
    #: None when the plans were made without encoding them (a search's candidates)
    stored_bytes: int | None = 0

    def __post_init__(self) -> None:
        # a private copy behind a read-only view: the caller's dict may change, this may not
        object.__setattr__(self, "plans", MappingProxyType(dict(self.plans)))

    @property
    def ratio(self) -> float:
        """Logical / stored bytes of the planned scope (an error when they were not measured)."""
        if self.stored_bytes is None:
            raise FormatError(
                "Expected a PlanSet whose stored bytes were measured. Got one planned without encoding "
                "(a search candidate) instead; ask Candidates.measured_ratio(config) for its ratio.")
        return ratio_of(self.logical_bytes, self.stored_bytes)

    def __getitem__(self, path: str) -> ArrayPlan:
        return self.plans[path]

    def __iter__(self) -> Iterator[str]:
        return iter(self.plans)

    def __len__(self) -> int:
        return len(self.plans)

    def __contains__(self, path: object) -> bool:
        return path in self.plans

    # identity, not Mapping's item comparison: plans hold arrays, which do not compare to a bool
    def __eq__(self, other: object) -> bool:
        return self is other

    __hash__ = object.__hash__

    def with_plans(self, extra: Mapping[str, ArrayPlan]) -> PlanSet:
        """A new PlanSet with ``extra`` plans added (e.g. the optimizer's); the configuration
        and the measurement still describe this set's own scope."""
        return PlanSet(self.config, {**self.plans, **extra}, self.logical_bytes, self.stored_bytes)
