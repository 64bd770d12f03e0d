"""Channel-scaled quantization: one codebook of normalised values, one scale per input channel.
Layer: refs, history and policy (the policy imports neither sibling), below ``parts``.

Why: a transformer's weight matrices (and its embedding table) hold input channels whose
norms differ by an order of magnitude or more: a few hidden dimensions carry most of the
activations' energy, and the rows that read or write them are large. One codebook for the
whole tensor then spends its levels on the wide channels and rounds the narrow ones to
almost nothing. Dividing every column by its root-mean-square first makes the columns
alike, so one small codebook fits all of them; each element reads back as
``centre * scale[column]``. On all-MiniLM-L6-v2, scaling columns this way raised the
sentence-embedding cosine of a uniform 8-level quantization from 0.74 to 0.85 for 0.02 more
bits per weight (the numbers are in ``docs/understanding/rate-distortion.md``).

The scales are part of the array's ``inshrink.nuq`` configuration (its zarr.json: one float32
per column, 4 bytes each), the chunks' payloads are unchanged. Whether a tensor is worth its
scales is the allocation's choice (:mod:`inshrink_store.policy.allocation`): it prices both
forms, metadata included, and keeps the cheaper one at equal error.

Protected values (the top ``protect`` fraction by normalised magnitude, and by sensitivity
when known) are stored as themselves, not scaled, exactly as the codec stores them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from inshrink_store.codecs.nuq import MAX_SCALES, nearest_index, protected_values
from inshrink_store.policy.partition import (
    PartitionCache,
    QuantizedTensor,
    TensorInput,
    quantize_tensor,
)
from inshrink_store.policy.settings import QuantSettings
from inshrink_store.policy.snapping import error_stats

#: the writer's chunks must keep a row whole: rows wider than this many bytes stay unscaled
MAX_ROW_BYTES = 1 << 22
#: a column this large times a normalised centre (tens at most) would overflow float32
MAX_SCALE = 1e30


def scalable(values: np.ndarray, dtype: str | None) -> bool:
    """Whether a tensor may be stored channel-scaled: float32 (the codec's scaled form is
    float32 only), 2-D (a Linear or Embedding weight: columns are input channels), at most
    :data:`~inshrink_store.codecs.nuq.MAX_SCALES` columns and rows the writer keeps whole.
    Its scales must also stay under :data:`MAX_SCALE` (checked where they are computed)."""
    return (dtype == "F32" and values.ndim == 2 and 1 <= values.shape[-1] <= MAX_SCALES
            and values.shape[-1] * 4 <= MAX_ROW_BYTES)


def channel_scales(values: np.ndarray) -> np.ndarray:
    """float32 root-mean-square of each column over its finite values (1.0 for a column with
    none or all zeros); sums in float64, in a fixed order: the same tensor, the same scales."""
    w = np.asarray(values, np.float32).reshape(-1, values.shape[-1])
    finite = np.isfinite(w)
    sq = np.where(finite, w.astype(np.float64) ** 2, 0.0).sum(axis=0)
    count = finite.sum(axis=0)
    rms = np.sqrt(sq / np.maximum(count, 1))
    with np.errstate(over="ignore"):
        s = rms.astype(np.float32)
    bad = ~(np.isfinite(s) & (s > 0) & (s >= np.finfo(np.float32).tiny))
    s[bad] = 1.0
    out: np.ndarray = s
    return out


def normalised(values: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 ``values / scales`` along the last axis (the codec's own division)."""
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        out: np.ndarray = (np.asarray(values, np.float32) / scales).astype(np.float32, copy=False)
    return out


def scaled_quantize(t: TensorInput, config: QuantSettings, *, cache: PartitionCache | None = None,
                    name: str | None = None) -> QuantizedTensor:
    """Quantize a :func:`scalable` tensor channel-scaled: the columns normalised by
    :func:`channel_scales`, a codebook fitted and protected values chosen on the normalised
    tensor (as :func:`~inshrink_store.policy.partition.quantize_tensor` does), then every
    unprotected element planned as ``float32(centre * scale)`` and every protected one as the
    codec stores its own value. The plan is exact for the codec at tolerance 0."""
    w = np.asarray(t.values, np.float32)
    scales = channel_scales(w)
    u = normalised(w, scales)
    inner = dataclasses.replace(t, values=u)
    q = quantize_tensor(inner, config, cache=cache, name=None if name is None else f"{name}#scaled")
    centres = np.asarray(q.codebook, np.float32)
    with np.errstate(over="ignore"):
        products = np.multiply(centres[None, :], scales[:, None], dtype=np.float32)
    if not (np.isfinite(products).all() and (np.diff(products, axis=1) > 0).all()):
        # the codec refuses scales that overflow or merge two centres: store it unscaled
        return quantize_tensor(t, config, cache=cache, name=name)
    planned_u = q.values.reshape(-1)
    ids = nearest_index(planned_u, centres)
    on_centre = np.isfinite(planned_u) & (centres[ids] == planned_u)
    columns = np.arange(w.size, dtype=np.intp) % w.shape[-1]
    with np.errstate(over="ignore"):
        out = np.multiply(centres[ids], scales[columns], dtype=np.float32)
    kept = np.flatnonzero(~on_centre | ~np.isfinite(out))
    if kept.size:
        original = w.reshape(-1)[kept]
        rounded = protected_values(original, "float32", config.protected_dtype)
        out[kept] = np.where(np.isfinite(original), rounded, original)
    out = out.reshape(w.shape)
    stats = dict(q.stats)
    stats["channel_scaled"] = True
    stats["protected_fraction"] = float(kept.size) / max(w.size, 1)
    errors = error_stats(w, out)
    stats["rel_l2_error"], stats["max_abs_error"] = errors
    return QuantizedTensor(out, tuple(float(c) for c in centres), stats,
                           scales=tuple(float(s) for s in scales))

