"""The method: sketch, approximate k-means, prune/protect/quantize, configuration search.
Layer: refs, history and policy (the policy imports neither sibling), below ``parts``.

numpy only here (a CuPy path plugs in below the same functions through their ``xp``
argument); this layer decides *what* to store, the repository below decides *how*.

This package is the policy's one entry for the integrations (issue 45's second door): they
import what a save's decision needs from here, never from its modules (an import-linter
contract forbids them), so the modules can move without the clients knowing. A save's
decision is one call, :meth:`SaveDecider.decide` (:mod:`~inshrink_store.policy.save_decision`):
the clients no longer assemble it from the closed loop, the budget and the search themselves.

What no client needs is not re-exported here, so that this entry imports at most 12 of the
policy's modules (issue 45): the search's machinery (``candidates.Candidates``,
``candidates.CandidatePlanner``, ``ratio.RatioEstimator``), k-means (``kmeans``), the
per-tensor quantizer (``partition.quantize_tensor``, ``quantize_state``, ``TensorInput``, ...)
and ``settings.QuantSettings`` are imported from their modules.
"""

from inshrink_store.policy.allocation import Allocation, AllocationDecision, AllocationPlanner
from inshrink_store.policy.config import (
    BINS,
    DEFAULT_CONFIG,
    EMBEDDING_BINS,
    MAX_LEVELS,
    METRICS,
    PROTECT,
    PRUNE,
    QuantConfig,
)
from inshrink_store.policy.moments import (
    DEFAULT_MOMENTS,
    ROLLBACK_MOMENTS,
    AdamHyper,
    MomentPolicy,
    MomentRecord,
)
from inshrink_store.policy.planner import StatePlanner
from inshrink_store.policy.plans import PlanSet
from inshrink_store.policy.record import QuantizationRecord
from inshrink_store.policy.save_decision import (
    RESIDUAL_SPACE,
    ParentVersion,
    SaveDecider,
    SaveOutcome,
    SaveRun,
    SaveState,
)
from inshrink_store.policy.search import SearchPoint, SearchResult, SearchSpace
from inshrink_store.policy.search_policy import PolicyArgs, SearchPolicy
from inshrink_store.policy.sensitivity import weights_from_fisher
from inshrink_store.policy.shard_quant import (
    ShardQuantization,
    ShardTarget,
    decide_shards,
    merge_sketches,
    shard_plan,
    shard_targets,
    sketch_from_json,
    sketch_to_json,
)
from inshrink_store.policy.sketch import LogSketch

__all__ = [
    "Allocation", "AllocationDecision", "AllocationPlanner", "BINS", "DEFAULT_CONFIG", "EMBEDDING_BINS", "METRICS", "PROTECT",
    "PRUNE", "LogSketch", "PlanSet", "QuantConfig", "QuantizationRecord", "SearchPoint", "SearchPolicy", "SearchResult",
    "SearchSpace", "StatePlanner",
    # one save's decision (closed loop or keyframe, which space, the fallback), and what it is made of
    "RESIDUAL_SPACE", "ParentVersion", "SaveDecider", "SaveOutcome", "SaveRun", "SaveState",
    "MAX_LEVELS", "AdamHyper", "DEFAULT_MOMENTS", "ROLLBACK_MOMENTS", "MomentPolicy", "MomentRecord", "PolicyArgs",
    "weights_from_fisher",
    # a distributed save's decision: one codebook per tensor from the ranks' merged sketches
    "ShardQuantization", "ShardTarget", "decide_shards", "merge_sketches", "shard_plan", "shard_targets",
    "sketch_from_json", "sketch_to_json",
]
