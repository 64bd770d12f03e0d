"""QuantSettings: what quantizing a state reads from a configuration, as a Protocol.
Layer: refs, history and policy (the policy imports neither sibling), below ``parts``.

The quantizing modules (``partition``, ``planner``) depend on these attributes only, not on
:class:`~inshrink_store.policy.config.QuantConfig`, so ``QuantConfig`` can be a repository
planner itself (its ``plan`` uses ``planner``) without an import cycle between the two.
"""

from __future__ import annotations

from typing import Protocol


class HasSearchAxes(Protocol):
    """Anything that names a point of the search cube, e.g. a ``QuantConfig``."""

    @property
    def bins(self) -> int: ...
    @property
    def prune(self) -> float: ...
    @property
    def prune_metric(self) -> str: ...
    @property
    def protect(self) -> float: ...


class QuantSettings(HasSearchAxes, Protocol):
    """The knobs of one configuration; :class:`QuantConfig` is the implementation."""

    @property
    def protected_dtype(self) -> str: ...
    @property
    def min_numel(self) -> int: ...
    @property
    def codebook_reuse_tolerance(self) -> float: ...

    def levels_for(self, layer_type: str) -> int: ...
