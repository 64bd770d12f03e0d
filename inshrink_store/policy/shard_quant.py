"""One codebook and one set of thresholds per tensor, however it is sharded over ranks.
Layer: refs, history and policy (the policy imports neither sibling), below ``parts``; the
distributed save (``torch/dcp_rank``) takes it through the policy's entry, ``inshrink_store.policy``.

``repo.save`` quantizes tensors it holds whole (:mod:`inshrink_store.policy.partition`):
exact top-``protect`` protection, prune thresholds pooled per layer type, a codebook fitted
on the log-space sketch of the rest. Under DCP each rank holds only shards. Sketches merge
by adding counts (the merged sketch of the shards *is* the sketch of the whole tensor), so
each rank sketches its shards, the sketches are gathered once, and every rank derives the
same decisions from the same merged sketches:

- **protect**: the magnitude cut at quantile ``1 - protect`` of the tensor's merged ``|w|``
  sketch (within the sketch's relative error ``alpha`` of the exact top-k cut), plus every
  NaN and infinity;
- **prune**: one threshold per layer type, the ``prune`` quantile of the merged ``|w|`` of all
  its tensors, as ``repo.save`` pools them (by magnitude: DCP has no gradients);
- **codebook**: fitted on the merged sketch restricted to the buckets strictly between the
  two cuts (the rest); the previous version's codebook is kept while its error on that
  sketch is within ``codebook_reuse_tolerance`` of a fresh fit's (stable ids, small deltas).

Everything here is deterministic numpy over integer counts (no merge order changes a count;
k-means seeds from a hash of its input), so every rank holding a shard of a tensor computes
the same codebook with no further exchange; the coordinator checks that they did.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from inshrink_store import dtypes as dtype_registry
from inshrink_store.codecs.nuq import nearest_index, short_codebook
from inshrink_store.dtypes import QUANTIZABLE_NAMES
from inshrink_store.errors import FormatError
from inshrink_store.plans import ArrayPlan
from inshrink_store.policy.config import QuantConfig
from inshrink_store.policy.kmeans import assign, fit_codebook, through_dtype
from inshrink_store.policy.partition import QuantizedTensor, layer_type, sum_of_products
from inshrink_store.policy.planner import array_plan
from inshrink_store.policy.sketch import LogSketch

#: tensors under this FQN prefix are quantized when the state has any (as ``model/`` for repo.save)
MODEL_PREFIX = "model."


# -- sketches as JSON ------------------------------------------------------------------------------
def sketch_to_json(sketch: LogSketch) -> dict[str, Any]:
    """A sketch as JSON-native lists of integer keys and counts (exact: nothing is rounded)."""
    return {"alpha": sketch.alpha, "pos": [sketch.pos_keys.tolist(), sketch.pos_counts.tolist()],
            "neg": [sketch.neg_keys.tolist(), sketch.neg_counts.tolist()],
            "zero": int(sketch.zero_count), "nonfinite": int(sketch.nonfinite_count)}


def sketch_from_json(doc: Mapping[str, Any]) -> LogSketch:
    """Inverse of :func:`sketch_to_json`."""
    def store(pair: Any) -> tuple[np.ndarray, np.ndarray]:
        keys, counts = np.asarray(pair[0], np.int64), np.asarray(pair[1], np.int64)
        if keys.shape != counts.shape or keys.ndim != 1:
            raise FormatError(f"Expected a sketch store of equal-length keys and counts. Got {pair!r:.80} instead.")
        return keys, counts

    (pk, pc), (nk, nc) = store(doc["pos"]), store(doc["neg"])
    return LogSketch(float(doc["alpha"]), pk, pc, nk, nc, int(doc["zero"]), int(doc["nonfinite"]))


def merge_sketches(per_rank: Iterable[Mapping[str, LogSketch]]) -> dict[str, LogSketch]:
    """FQN -> the merged sketch of every rank's shards of that tensor."""
    merged: dict[str, LogSketch] = {}
    for sketches in per_rank:
        for fqn, sketch in sorted(sketches.items()):
            merged[fqn] = merged[fqn].merge(sketch) if fqn in merged else sketch
    return merged


# -- what the coordinator decides from the plans ------------------------------------------------------
@dataclass(frozen=True)
class ShardTarget:
    """A tensor to quantize as the global plan shows it: logical dtype, layer type (from its
    global shape), codebook size, and the previous version's codebook (None: none)."""

    dtype: str
    layer_type: str
    levels: int
    previous: tuple[float, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "layer_type": self.layer_type, "levels": self.levels,
                "previous": None if self.previous is None else list(self.previous)}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> ShardTarget:
        previous = doc.get("previous")
        return cls(str(doc["dtype"]), str(doc["layer_type"]), int(doc["levels"]),
                   None if previous is None else tuple(float(c) for c in previous))


def shard_targets(tensors: Mapping[str, tuple[str, tuple[int, ...]]], config: QuantConfig,
                  previous: Mapping[str, tuple[float, ...]] | None = None,
                  module_kinds: Mapping[str, str] | None = None) -> dict[str, ShardTarget]:
    """The tensors to quantize, FQN -> :class:`ShardTarget`, from FQN -> (logical dtype, global
    shape): quantizable dtype, at least 2-D, at least ``min_numel`` elements, under ``model.``
    when the state has a model part (optimizer state stays lossless), as repo.save chooses."""
    scope = MODEL_PREFIX if any(f.startswith(MODEL_PREFIX) for f in tensors) else ""
    kinds, previous = module_kinds or {}, previous or {}
    chosen: dict[str, ShardTarget] = {}
    for fqn, (dtype, size) in sorted(tensors.items()):
        if fqn.startswith(scope) and dtype in QUANTIZABLE_NAMES and len(size) >= 2 and math.prod(size) >= config.min_numel:
            kind = layer_type(size, kinds.get(fqn))
            chosen[fqn] = ShardTarget(dtype, kind, config.levels_for(kind), previous.get(fqn))
    return chosen


# -- what every rank derives from the merged sketches -------------------------------------------------
@dataclass(frozen=True)
class ShardQuantization:
    """How every shard of one tensor is quantized: one codebook, one protect cut (None: only
    non-finite values are protected), one prune threshold (None: no pruning)."""

    codebook: tuple[float, ...]
    protect_cut: float | None
    prune_threshold: float | None
    layer_type: str
    codebook_reused: bool

    def to_dict(self) -> dict[str, Any]:
        return {"codebook": list(self.codebook), "protect_cut": self.protect_cut,
                "prune_threshold": self.prune_threshold, "layer_type": self.layer_type,
                "codebook_reused": self.codebook_reused}


def prune_thresholds(chosen: Mapping[str, ShardTarget], sketches: Mapping[str, LogSketch],
                     config: QuantConfig) -> dict[str, float]:
    """Layer type -> the pooled ``prune`` quantile of ``|w|`` over all its tensors."""
    if config.prune <= 0:
        return {}
    pooled: dict[str, LogSketch] = {}
    for fqn in sorted(chosen):
        kind, sketch = chosen[fqn].layer_type, sketches[fqn].magnitudes()
        pooled[kind] = pooled[kind].merge(sketch) if kind in pooled else sketch
    return {kind: s.quantile(config.prune) for kind, s in sorted(pooled.items()) if s.count}


def _protect_cut(sketch: LogSketch, protect: float) -> float | None:
    return sketch.magnitudes().quantile(1.0 - protect) if protect > 0 and sketch.count else None


def _rest(sketch: LogSketch, cut: float | None, threshold: float | None) -> LogSketch:
    """The sketch of what is neither protected nor pruned: buckets strictly between the cuts."""
    def keep(keys: np.ndarray) -> np.ndarray:
        reps = sketch.representatives(keys)
        mask = np.ones(keys.size, bool)
        if cut is not None:
            mask &= reps < cut
        if threshold is not None:
            mask &= reps > threshold
        return mask

    pos, neg = keep(sketch.pos_keys), keep(sketch.neg_keys)
    zeros = sketch.zero_count if threshold is None and (cut is None or cut > 0) else 0
    return LogSketch(sketch.alpha, sketch.pos_keys[pos], sketch.pos_counts[pos], sketch.neg_keys[neg],
                     sketch.neg_counts[neg], zeros, 0)


def sketch_error(sketch: LogSketch, centres: np.ndarray) -> float:
    """Squared error of nearest-centre quantization over the sketch's bucket representatives:
    what a codebook costs on the values, within the sketch's relative error."""
    reps, counts = sketch.histogram()
    if reps.size == 0:
        return 0.0
    c = np.sort(np.asarray(centres, np.float64))
    d = reps - c[assign(reps, c)]
    return float(np.sum(counts * d * d))


def _usable(previous: tuple[float, ...] | None, dtype: str, include_zero: bool, sizes: set[int]) -> np.ndarray | None:
    """The previous codebook rounded through ``dtype``, if it could serve as this one."""
    if not previous:
        return None
    p = np.asarray(previous, np.float64)
    if not np.isfinite(p).all():
        return None
    p = np.unique(through_dtype(p, dtype)).astype(np.float64)
    return p if p.size in sizes and (not include_zero or 0.0 in p) else None


def _codebook(rest: LogSketch, target: ShardTarget, config: QuantConfig) -> tuple[np.ndarray, bool]:
    """A fresh fit, or the previous codebook while within tolerance of it, or a warm refit."""
    include_zero = config.prune > 0
    fresh = fit_codebook(None, target.levels, include_zero=include_zero, sketch=rest, dtype=target.dtype)
    prev = _usable(target.previous, target.dtype, include_zero, {fresh.size, target.levels})
    if prev is None:
        return fresh, False
    limit = config.codebook_reuse_tolerance * sketch_error(rest, fresh)
    if sketch_error(rest, prev) <= limit:
        return prev, True
    warm = fit_codebook(None, target.levels, include_zero=include_zero, sketch=rest, dtype=target.dtype,
                        previous=prev)
    return (warm if sketch_error(rest, warm) <= limit else fresh), False


def decide_shards(chosen: Mapping[str, ShardTarget], sketches: Mapping[str, LogSketch], config: QuantConfig,
                  wanted: Iterable[str]) -> dict[str, ShardQuantization]:
    """The quantization of each ``wanted`` tensor (a rank asks for those it holds shards of)
    from the merged sketches of *all* chosen tensors (prune thresholds pool over them)."""
    missing = sorted(set(chosen) - set(sketches))
    if missing:
        raise FormatError(f"Expected a sketch of every tensor to quantize. Got none for {missing[:5]} instead.")
    thresholds = prune_thresholds(chosen, sketches, config)
    out = {}
    for fqn in sorted(set(wanted)):
        target, sketch = chosen[fqn], sketches[fqn]
        cut, threshold = _protect_cut(sketch, config.protect), thresholds.get(target.layer_type)
        centres, reused = _codebook(_rest(sketch, cut, threshold), target, config)
        # the codebook as its shards' zarr.json spell it (the codec shortens it): one text in the DCP document and every shard
        out[fqn] = ShardQuantization(short_codebook(tuple(float(c) for c in centres)), cut, threshold,
                                     target.layer_type, reused)
    return out


# -- one shard --------------------------------------------------------------------------------------
def quantize_shard(values: np.ndarray, q: ShardQuantization, dtype: str, config: QuantConfig) -> QuantizedTensor:
    """One shard (float32 values) quantized with its tensor's shared decisions: protected
    values rounded to ``protected_dtype`` (NaN and infinities kept), pruned ones 0.0, the rest
    snapped to the nearest centre. The stats are this shard's."""
    w = np.ascontiguousarray(values, dtype=np.float32)
    magnitude = np.abs(w)
    protected = ~np.isfinite(w)
    if q.protect_cut is not None:
        protected |= (magnitude >= q.protect_cut) & (magnitude > 0)
    pruned = np.zeros(w.shape, bool) if q.prune_threshold is None else (magnitude <= q.prune_threshold) & ~protected
    del magnitude
    centres = np.asarray(q.codebook, np.float32)
    out = centres[nearest_index(w, centres)].reshape(w.shape)
    out[pruned] = 0.0
    if protected.any():
        kept = w[protected]
        keep_as = dtype_registry.by_codec_name(config.protected_dtype)
        rounded = keep_as.round_float32(kept) if keep_as.name == "BF16" else through_dtype(kept, dtype)
        out[protected] = np.where(np.isfinite(kept), rounded, kept)
    n = max(w.size, 1)
    rel, peak = _errors(w, out)
    stats = {"levels": len(q.codebook), "pruned_fraction": float(np.count_nonzero(pruned)) / n,
             "protected_fraction": float(np.count_nonzero(protected)) / n, "rel_l2_error": rel,
             "max_abs_error": peak, "codebook_reused": q.codebook_reused, "layer_type": q.layer_type,
             "prune_threshold": q.prune_threshold, "protect_cut": q.protect_cut}
    return QuantizedTensor(out, q.codebook, stats)


def shard_plan(values: np.ndarray, q: ShardQuantization, dtype: str, config: QuantConfig) -> ArrayPlan:
    """How one shard is stored: :func:`quantize_shard`'s values as the plan a writer takes (the
    protected values in ``config.protected_dtype``)."""
    return array_plan(quantize_shard(values, q, dtype, config), dtype, config.protected_dtype)


def _errors(w: np.ndarray, out: np.ndarray) -> tuple[float, float]:
    """(||w - out|| / ||w||, max |w - out|) over the finite elements of this shard."""
    finite = np.isfinite(w).ravel()
    a = w.ravel()[finite].astype(np.float64)
    d = a - out.ravel()[finite]
    den = sum_of_products(a, a)
    return (math.sqrt(sum_of_products(d, d) / den) if den > 0 else 0.0), float(np.abs(d).max(initial=0.0))
