"""The method: sketch, approximate k-means, prune/protect/quantize, configuration search.

numpy only here (a CuPy path plugs in below the same functions through their ``xp``
argument); this layer decides *what* to store, the repository below decides *how*.
"""

from inshrink_store.policy.config import BINS, EMBEDDING_BINS, METRICS, PROTECT, PRUNE, QuantConfig
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
from inshrink_store.policy.sketch import LogSketch

__all__ = [
    "BINS", "EMBEDDING_BINS", "LAYER_TYPES", "METRICS", "PROTECT", "PRUNE", "LogSketch", "QuantConfig",
    "QuantizedTensor", "StatePlanner", "TensorInput", "fit_codebook", "is_quantizable", "layer_type",
    "prune_thresholds", "quantize_state", "quantize_tensor", "weighted_kmeans",
]
