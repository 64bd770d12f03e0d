"""QuantConfig: one point of the configuration cube (bins x prune x metric x protect)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from inshrink_store.errors import FormatError

BINS = (4, 6, 8, 12, 16, 32)
EMBEDDING_BINS = (16, 32)
PRUNE = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5)
PROTECT = (0.0005, 0.005, 0.01)
METRICS = ("magnitude", "sensitivity")


@dataclass(frozen=True)
class QuantConfig:
    """How aggressively to quantize the model tensors of one checkpoint.

    ``bins`` codebook centres per tensor (embeddings use ``embedding_bins``), the lowest
    ``prune`` fraction by ``prune_metric`` set to 0, the top ``protect`` fraction by
    magnitude and by sensitivity kept in ``protected_dtype``. Tensors that are 1-D or
    smaller than ``min_numel`` stay lossless. A previous codebook is reused while its
    error is within ``reuse_tolerance`` x a fresh fit's (stable ids -> small deltas).
    """

    bins: int = 16
    prune: float = 0.0
    prune_metric: str = "magnitude"
    protect: float = 0.005
    protected_dtype: str = "bfloat16"
    embedding_bins: int = 16
    min_numel: int = 4096
    reuse_tolerance: float = 1.10

    def __post_init__(self) -> None:
        checks = [
            (isinstance(self.bins, int) and 2 <= self.bins <= 65534, "bins in 2..65534", self.bins),
            (isinstance(self.embedding_bins, int) and 2 <= self.embedding_bins <= 65534,
             "embedding_bins in 2..65534", self.embedding_bins),
            (0.0 <= self.prune < 1.0, "prune in [0, 1)", self.prune),
            (0.0 <= self.protect < 1.0, "protect in [0, 1)", self.protect),
            (self.prune_metric in METRICS, f"prune_metric in {METRICS}", self.prune_metric),
            (self.protected_dtype in ("bfloat16", "float32"), "protected_dtype bfloat16 or float32",
             self.protected_dtype),
            (self.min_numel >= 1, "min_numel >= 1", self.min_numel),
            (self.reuse_tolerance >= 1.0, "reuse_tolerance >= 1", self.reuse_tolerance),
        ]
        for ok, what, got in checks:
            if not ok:
                raise FormatError(f"Expected {what} in QuantConfig. Got {got!r} instead.")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> QuantConfig:
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise FormatError(f"Expected QuantConfig fields. Got unknown {sorted(unknown)} instead.")
        return cls(**data)

    def plan(self, tensors: Mapping[str, Any], dtypes: Mapping[str, str],
             previous: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
        """Repository hook: ``repo.save(..., quantize=QuantConfig(...))``."""
        from inshrink_store.policy.planner import StatePlanner

        return StatePlanner(self).plan(tensors, dtypes, previous)
