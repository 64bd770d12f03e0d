"""Prune / protect / quantize a whole state: ALGORITHM.md §1 on numpy arrays.

Protect the union of the top ``protect`` fraction by magnitude and by sensitivity
(``|g*w|``), prune the lowest ``prune`` fraction by one metric with one threshold
pooled per layer type, and snap the rest onto a per-tensor codebook fitted by
approximate k-means over a log-space sketch. The output values contain only codebook
centres, 0.0 (a centre when pruning) and protected values rounded to the protected
dtype, so the ``inshrink.nuq`` codec with tolerance 0 stores them exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from inshrink_store.codecs import bf16
from inshrink_store.codecs.nuq import nearest_index
from inshrink_store.errors import FormatError
from inshrink_store.policy.config import QuantConfig
from inshrink_store.policy.kmeans import bucket_weights, weighted_kmeans
from inshrink_store.policy.kmeans import loss as kmeans_loss
from inshrink_store.policy.sketch import LogSketch

LAYER_TYPES = ("linear", "conv", "embedding", "norm", "other")
_KINDS = {"linear": "linear", "conv": "conv", "embedding": "embedding", "norm": "norm",
          "batchnorm": "norm", "layernorm": "norm", "groupnorm": "norm", "rmsnorm": "norm",
          "multiheadattention": "linear", "bilinear": "linear"}


def layer_type(shape: tuple[int, ...], module_kind: str | None = None) -> str:
    """From the module class when known (``"Conv2d"`` -> conv), else from the shape."""
    if module_kind:
        kind = module_kind.lower()
        for prefix, lt in _KINDS.items():
            if kind.startswith(prefix):
                return lt
        return "other"
    if len(shape) == 2:
        return "linear"
    if 3 <= len(shape) <= 5:
        return "conv"
    return "norm" if len(shape) == 1 else "other"


@dataclass(frozen=True)
class TensorInput:
    values: np.ndarray  # float32 (bf16/f16 widened)
    dtype: str  # "F32" | "F16" | "BF16"
    layer_type: str = "linear"
    sensitivity: np.ndarray | None = None
    previous_codebook: tuple[float, ...] | None = None


@dataclass(frozen=True)
class QuantizedTensor:
    values: np.ndarray  # float32, only centres / 0 / protected values
    codebook: tuple[float, ...]
    stats: Mapping[str, Any] = field(default_factory=dict)


def _through(values: np.ndarray, dtype: str) -> np.ndarray:
    """Round float32 values through a tensor dtype so equality survives the cast."""
    if dtype == "F16":
        return values.astype(np.float16).astype(np.float32)
    if dtype == "BF16":
        return bf16.round_float32(values.astype(np.float32))
    return values.astype(np.float32)


def _top_threshold(scores: np.ndarray, fraction: float) -> float:
    """Score above which about ``fraction`` of elements lie (exact, O(n) selection)."""
    n = scores.size
    count = int(round(fraction * n))
    if count <= 0:
        return np.inf
    return float(np.partition(scores.ravel(), n - count)[n - count])


def _protected_mask(t: TensorInput, config: QuantConfig) -> np.ndarray:
    mag = np.abs(t.values)
    mask = ~np.isfinite(t.values)
    mag = np.where(mask, 0, mag)
    if config.protect > 0:
        mask |= mag >= _top_threshold(mag, config.protect)
        if t.sensitivity is not None:
            sens = np.nan_to_num(np.abs(t.sensitivity), nan=0.0, posinf=0.0)
            mask |= sens >= _top_threshold(sens, config.protect)
    return mask


def _prune_scores(t: TensorInput, metric: str) -> np.ndarray:
    if metric == "sensitivity" and t.sensitivity is not None:
        return np.nan_to_num(np.abs(t.sensitivity), nan=np.inf)
    return np.nan_to_num(np.abs(t.values), nan=np.inf)


def pooled_prune_thresholds(tensors: Mapping[str, TensorInput], config: QuantConfig) -> dict[str, float]:
    """One threshold per layer type from merged sketches of every tensor of that type."""
    if config.prune <= 0:
        return {}
    sketches: dict[str, LogSketch] = {}
    for t in tensors.values():
        s = LogSketch.from_values(_prune_scores(t, config.prune_metric))
        sketches[t.layer_type] = sketches[t.layer_type].merge(s) if t.layer_type in sketches else s
    return {lt: s.quantile(config.prune) for lt, s in sketches.items() if s.count}


def _weighted_error(reps: np.ndarray, counts: np.ndarray, centres: np.ndarray) -> float:
    """The k-means objective itself (bucket weights W), so reuse is judged on what the fit optimises."""
    return kmeans_loss(reps, bucket_weights(reps, counts), centres)


def fit_codebook(values: np.ndarray, k: int, *, include_zero: bool, dtype: str = "F32",
                 previous: tuple[float, ...] | None = None, reuse_tolerance: float = 1.10) -> tuple[np.ndarray, bool]:
    """Sorted centres (exact in ``dtype``; 0.0 among them when ``include_zero``) and whether
    the previous codebook was reused unchanged.

    With a previous codebook of the same size, the fresh fit is warm-started from it
    (centres move as little as the data asks, so most level ids survive) and the previous
    one is kept outright while its loss is within ``reuse_tolerance`` x the refit's.
    """
    reps, counts = LogSketch.from_values(values).histogram()
    fit_k = k - 1 if include_zero else k
    prev = None
    if previous is not None and len(previous) == k:
        prev = np.unique(_through(np.asarray(previous, np.float32), dtype)).astype(np.float64)
        if prev.size != k or (include_zero and 0.0 not in prev):
            prev = None
    if reps.size == 0 or fit_k < 1:
        centres = np.zeros(1)
    else:
        init = None if prev is None else (prev[prev != 0.0] if include_zero else prev)
        centres = weighted_kmeans(reps, counts, fit_k, init=init)
    if include_zero:
        centres = np.union1d(centres, [0.0])
    fresh = np.unique(_through(centres.astype(np.float32), dtype))
    if prev is not None and reps.size:
        if _weighted_error(reps, counts, prev) <= reuse_tolerance * _weighted_error(reps, counts, fresh) + 1e-30:
            return prev, True
    return fresh, False


def quantize_tensor(t: TensorInput, config: QuantConfig, prune_threshold: float | None) -> QuantizedTensor:
    w = t.values
    protected = _protected_mask(t, config)
    pruned = np.zeros(w.shape, bool)
    if prune_threshold is not None:
        pruned = (_prune_scores(t, config.prune_metric) <= prune_threshold) & ~protected
    rest = ~(protected | pruned)
    bins = config.embedding_bins if t.layer_type == "embedding" else config.bins
    centres, reused = fit_codebook(w[rest], bins, include_zero=config.prune > 0, dtype=t.dtype,
                                   previous=t.previous_codebook, reuse_tolerance=config.reuse_tolerance)
    centres32 = centres.astype(np.float32)
    out = centres32.take(nearest_index(np.where(rest, w, 0).astype(np.float32).ravel(), centres32)).reshape(w.shape)
    out[pruned] = 0.0
    if protected.any():
        kept = w[protected]
        out[protected] = bf16.round_float32(kept) if config.protected_dtype == "bfloat16" else _through(kept, t.dtype)
    finite = np.isfinite(w)
    diff = np.where(finite, w - out, 0).astype(np.float64)
    norm = float(np.linalg.norm(np.where(finite, w, 0)))
    stats = {
        "levels": int(centres.size), "pruned_fraction": float(pruned.mean()) if w.size else 0.0,
        "protected_fraction": float(protected.mean()) if w.size else 0.0,
        "rel_l2_error": float(np.linalg.norm(diff) / norm) if norm > 0 else 0.0,
        "max_abs_error": float(np.abs(diff).max()) if w.size else 0.0,
        "codebook_reused": bool(reused), "layer_type": t.layer_type,
    }
    return QuantizedTensor(out, tuple(float(c) for c in centres), stats)


def quantize_state(tensors: Mapping[str, TensorInput], config: QuantConfig) -> dict[str, QuantizedTensor]:
    """Quantize every given tensor with prune thresholds pooled per layer type."""
    for name, t in tensors.items():
        if t.sensitivity is not None and t.sensitivity.shape != t.values.shape:
            raise FormatError(
                f"Expected sensitivity of tensor {name!r} to have shape {t.values.shape}. "
                f"Got {t.sensitivity.shape} instead."
            )
    thresholds = pooled_prune_thresholds(tensors, config)
    return {name: quantize_tensor(t, config, thresholds.get(t.layer_type)) for name, t in sorted(tensors.items())}
