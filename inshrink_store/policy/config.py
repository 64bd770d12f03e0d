"""QuantConfig: one point of the configuration cube (bins x prune x metric x protect).
Layer: refs, history and policy (the policy imports neither sibling), below ``parts``.

A frozen, JSON-native value: it is stored in each version's metadata (so a resumed
run or an import continues with the same settings) and it is the key the search
caches candidates by. Validation happens at construction, so a bad value fails where
it was written, not deep inside a save. It is also a repository planner
(``repo.save(..., quantize=QuantConfig(bins=16))``); the planner depends only on the
:class:`~inshrink_store.policy.settings.QuantSettings` protocol, so there is no cycle.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from inshrink_store import dtypes as dtype_registry
from inshrink_store.errors import FormatError
from inshrink_store.plans import ArrayPlan
from inshrink_store.policy.planner import StatePlanner

BINS = (4, 6, 8, 12, 16, 32)
EMBEDDING_BINS = (16, 32)
PRUNE = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5)
PROTECT = (0.0005, 0.005, 0.01)
METRICS = ("magnitude", "sensitivity")
#: what protected values may be kept as: the nuq codec names of bfloat16 and float32
PROTECTED_DTYPES = tuple(str(dtype_registry.get(name).codec_name) for name in ("BF16", "F32"))
MAX_LEVELS = 65534  # + the protected id = 65535 level ids, the most a uint16 payload holds
#: the most a configuration prunes: 0.99 (a closed-loop residual is mostly pruned; a tensor
#: keeps at least 1 % of its elements coded)
MAX_PRUNE = 0.99
_LEGACY = {"reuse_tolerance": "codebook_reuse_tolerance"}  # keys written by 0.1 pre-releases


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_fraction(v: Any, hi: float) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 <= v <= hi


@dataclass(frozen=True)
class QuantConfig:
    """How aggressively to quantize the model tensors of one checkpoint.

    ``bins`` codebook centres per tensor (embeddings use ``embedding_bins``; with
    pruning on, 0.0 is one of them); the lowest ``prune`` fraction by ``prune_metric``
    set to 0 with one threshold pooled per layer type; the top ``protect`` fraction by
    magnitude and (when gradients are known) by sensitivity kept in ``protected_dtype``.
    Tensors that are 1-D or smaller than ``min_numel`` stay lossless. A tensor's
    previous codebook is reused unchanged while its error is within
    ``codebook_reuse_tolerance`` x a fresh fit's (stable ids -> small deltas).
    """

    bins: int = 16
    prune: float = 0.0
    prune_metric: str = "magnitude"
    protect: float = 0.005
    protected_dtype: str = "bfloat16"
    embedding_bins: int = 16
    min_numel: int = 4096
    codebook_reuse_tolerance: float = 1.10

    def __post_init__(self) -> None:
        tol = self.codebook_reuse_tolerance
        checks = [
            (_is_int(self.bins) and 2 <= self.bins <= MAX_LEVELS, f"bins an int in 2..{MAX_LEVELS} "
             f"(usually one of {BINS})", self.bins),
            (_is_int(self.embedding_bins) and 2 <= self.embedding_bins <= MAX_LEVELS,
             f"embedding_bins an int in 2..{MAX_LEVELS} (usually one of {EMBEDDING_BINS})",
             self.embedding_bins),
            (_is_fraction(self.prune, MAX_PRUNE), f"prune a fraction in [0, {MAX_PRUNE}]", self.prune),
            (_is_fraction(self.protect, 0.5), "protect a fraction in [0, 0.5]", self.protect),
            (self.prune_metric in METRICS, f"prune_metric one of {METRICS}", self.prune_metric),
            (self.protected_dtype in PROTECTED_DTYPES, f"protected_dtype one of {PROTECTED_DTYPES}",
             self.protected_dtype),
            (_is_int(self.min_numel) and self.min_numel >= 1, "min_numel an int >= 1", self.min_numel),
            (isinstance(tol, (int, float)) and not isinstance(tol, bool) and math.isfinite(tol)
             and tol >= 1.0, "codebook_reuse_tolerance a finite number >= 1 (1.10 by default)", tol),
        ]
        for ok, what, got in checks:
            if not ok:
                raise FormatError(f"Expected {what} in QuantConfig. Got {got!r} instead.")

    @property
    def reuse_tolerance(self) -> float:
        """Alias of ``codebook_reuse_tolerance`` (the 0.1 pre-release name)."""
        return self.codebook_reuse_tolerance

    def levels_for(self, layer_type: str) -> int:
        """Codebook size for a layer type: ``embedding_bins`` for embeddings, else ``bins``."""
        return self.embedding_bins if layer_type == "embedding" else self.bins

    def to_dict(self) -> dict[str, Any]:
        """JSON-native dict; ``from_dict(json.loads(json.dumps(d)))`` gives an equal config."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> QuantConfig:
        if not isinstance(data, Mapping):
            raise FormatError(f"Expected a QuantConfig dict. Got {type(data).__name__} instead.")
        data = {_LEGACY.get(k, k): v for k, v in data.items()}
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise FormatError(
                f"Expected only QuantConfig fields {sorted(cls.__dataclass_fields__)}. "
                f"Got unknown {sorted(unknown)} instead; remove them."
            )
        return cls(**data)

    def plan(self, tensors: Mapping[str, Any], dtypes: Mapping[str, str],
             previous: Mapping[str, dict[str, Any]]) -> Mapping[str, ArrayPlan]:
        """Repository hook: ``repo.save(..., quantize=QuantConfig(...))``."""
        return StatePlanner(self).plan(tensors, dtypes, previous)


#: the Checkpointer's configuration when there is no eval function (conservative, see
#: docs/guides/training-loop.md), and the settings every search candidate starts from
DEFAULT_CONFIG = QuantConfig(bins=16, prune=0.0, protect=0.005)
