"""The method: sketch, approximate k-means, prune/protect/quantize, configuration search.

numpy only here (a CuPy path plugs in below the same functions); this layer decides
*what* to store, the repository below decides *how*.
"""

from inshrink_store.policy.config import BINS, METRICS, PROTECT, PRUNE, QuantConfig
from inshrink_store.policy.kmeans import weighted_kmeans
from inshrink_store.policy.partition import (
    QuantizedTensor,
    TensorInput,
    fit_codebook,
    layer_type,
    quantize_state,
    quantize_tensor,
)
from inshrink_store.policy.planner import StatePlanner
from inshrink_store.policy.sketch import LogSketch

__all__ = [
    "BINS", "METRICS", "PROTECT", "PRUNE", "LogSketch", "QuantConfig", "QuantizedTensor",
    "StatePlanner", "TensorInput", "fit_codebook", "layer_type", "quantize_state", "quantize_tensor",
    "weighted_kmeans",
]
