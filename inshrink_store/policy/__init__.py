"""The method: sketch, approximate k-means, prune/protect/quantize, configuration search.
Layer: refs, history and policy (the policy imports neither sibling), below ``parts``.

numpy only here (a CuPy path plugs in below the same functions through their ``xp``
argument); this layer decides *what* to store, the repository below decides *how*.
"""

from inshrink_store.policy.allocation import Allocation, AllocationDecision, AllocationPlanner
from inshrink_store.policy.candidates import CandidatePlanner, Candidates
from inshrink_store.policy.config import (
    BINS,
    DEFAULT_CONFIG,
    EMBEDDING_BINS,
    METRICS,
    PROTECT,
    PRUNE,
    QuantConfig,
)
from inshrink_store.policy.kmeans import fit_codebook, weighted_kmeans
from inshrink_store.policy.partition import (
    LAYER_TYPES,
    QuantizedTensor,
    TensorInput,
    is_quantizable,
    layer_type,
    prune_thresholds,
    quantize_state,
    quantize_tensor,
)
from inshrink_store.policy.planner import StatePlanner
from inshrink_store.policy.plans import PlanSet
from inshrink_store.policy.ratio import RatioEstimator
from inshrink_store.policy.record import QuantizationRecord
from inshrink_store.policy.search import SearchPoint, SearchResult, SearchSpace
from inshrink_store.policy.search_policy import Decision, SearchPolicy
from inshrink_store.policy.settings import QuantSettings
from inshrink_store.policy.sketch import LogSketch

__all__ = [
    "Allocation", "AllocationDecision", "AllocationPlanner", "BINS", "DEFAULT_CONFIG", "EMBEDDING_BINS", "LAYER_TYPES", "METRICS", "PROTECT", "PRUNE", "CandidatePlanner",
    "Candidates", "Decision", "LogSketch", "PlanSet", "QuantConfig", "QuantSettings", "QuantizationRecord",
    "QuantizedTensor", "RatioEstimator", "SearchPoint", "SearchPolicy", "SearchResult", "SearchSpace",
    "StatePlanner", "TensorInput", "fit_codebook", "is_quantizable", "layer_type", "prune_thresholds",
    "quantize_state", "quantize_tensor", "weighted_kmeans",
]
