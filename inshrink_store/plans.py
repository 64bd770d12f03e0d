"""What a save is told to store lossy: one :class:`ArrayPlan` per tensor, and the planner protocol.

Layer: just above the object store (``cas``), below the writer. The writer, the write
session and the repository take *plans*, a mapping path -> :class:`ArrayPlan`, made before
anything is written; the policy layer (``inshrink_store.policy``) makes them. A
:class:`Planner` (``QuantConfig``, ``Allocation``, ``MomentPolicy``...) is the convenience
``Repository.save(quantize=...)`` and ``WriteSession.write(quantize=...)`` accept: the write
session asks it for plans once, with the parent version's codebooks
(:meth:`WriteSession.plan <inshrink_store.session.WriteSession.plan>`), and from then on
only plans travel down. Why: the writer never calls back up into a policy, and a caller that
already holds plans (the Checkpointer's search) hands them over as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from inshrink_store.errors import InvalidInputError

if TYPE_CHECKING:
    from inshrink_store.cas import ClosedLoopCoding

#: a closed-loop plan's coding of one chunk: (chunk coordinates, chunk shape) -> its coding
ObjectCoder = Callable[[tuple[int, ...], tuple[int, ...]], "ClosedLoopCoding"]


@dataclass(frozen=True)
class ArrayPlan:
    """How one tensor is stored lossy: the values to write and the zarr serializer.

    ``pruned``: where this version's weight update was dropped (a closed-loop residual's
    pruned elements keep the parent's value, so ``values == 0`` no longer says it); None when
    the plan does not know, and a reader then takes ``values == 0`` (a pruned weight).
    ``object_coder``: for arrays whose chunks the object store codes from a planner's own
    encoding (closed-loop residuals, :mod:`inshrink_store.policy.closed_loop`): chunk
    coordinates -> the chunk's coding; None for everything else."""

    values: np.ndarray
    serializer: Any
    attributes: Mapping[str, Any] = field(default_factory=dict)
    pruned: np.ndarray | None = None
    object_coder: ObjectCoder | None = None


@runtime_checkable
class Planner(Protocol):
    """Makes the plans of one save: ``tensors`` (path -> array), their logical ``dtypes``
    and ``previous`` (path -> the parent version's quantization codec and attributes, the
    codebooks a planner may reuse)."""

    def plan(
        self,
        tensors: Mapping[str, np.ndarray],
        dtypes: Mapping[str, str],
        previous: Mapping[str, dict[str, Any]],
    ) -> Mapping[str, ArrayPlan]: ...


#: what ``quantize=`` accepts: plans as made, or a planner that makes them for this save
Quantize = Planner | Mapping[str, ArrayPlan]


def check_quantize(quantize: Any) -> None:
    """Refuse a ``quantize=`` that is neither plans (a mapping) nor a planner, before anything
    is written."""
    if quantize is None or isinstance(quantize, Mapping) or callable(getattr(quantize, "plan", None)):
        return
    raise InvalidInputError(
        "Expected quantize to be a planner with a plan() method (e.g. inshrink_store.policy.QuantConfig(bins=16)), "
        f"a mapping of path -> ArrayPlan, or None. Got {quantize!r} instead."
    )
