"""Prune / protect / quantize a whole state: ALGORITHM.md §1 on numpy arrays.
Layer: refs, history and policy (the policy imports neither sibling), below ``parts``.

Protect the union of the top ``protect`` fraction by magnitude and by sensitivity
(``|g*w|``), prune the lowest ``prune`` fraction by one metric with one threshold
pooled per layer type (merged log-space sketches of every tensor of that type), and
snap the rest onto a per-tensor codebook fitted by approximate k-means over the
sketch of the rest. The output values contain only codebook centres, 0.0 (a centre
when pruning) and protected values rounded to the protected dtype, so the
``inshrink.nuq`` codec with tolerance 0 stores them exactly.

Codebook stability is the biggest lever on delta size (ALGORITHM.md §2): a tensor's
previous codebook is reused unchanged while its squared error on the quantized
(non-protected, non-pruned) values is within ``codebook_reuse_tolerance`` x a fresh
fit's; otherwise the codebook is refitted warm-started from it. Layer types come from
module classes or shapes, never from parameter names.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
from numpy.typing import ArrayLike

from inshrink_store import dtypes as dtype_registry
from inshrink_store.codecs import _zstd
from inshrink_store.codecs.nuq import protected_values
from inshrink_store.dtypes import FLOAT_NAMES
from inshrink_store.errors import FormatError
from inshrink_store.object_format import ZSTD_LEVEL
from inshrink_store.parallel import map_in_order, write_threads
from inshrink_store.policy.codebook_choice import choose_codebook
from inshrink_store.policy.kmeans import fit_codebook
from inshrink_store.policy.protection import (
    TAIL_FRACTION,
    protected_mask,
    protected_positions,
    top_tail,
)
from inshrink_store.policy.settings import QuantSettings
from inshrink_store.policy.sketch import BLOCK, KeyedValues, LogSketch
from inshrink_store.policy.snapping import error_stats, snap_pruned

__all__ = [
    "LAYER_TYPES", "Part", "QuantizedTensor", "TensorInput", "fit_codebook", "is_quantizable", "layer_type",
    "fresh_codebook", "part_key", "protected_mask", "protected_positions", "protected_words", "prune_thresholds", "quantize_state",
    "quantize_tensor", "sample_index", "tensor_part",
]

LAYER_TYPES = ("linear", "conv", "embedding", "norm", "other")


def sum_of_products(a: np.ndarray, b: np.ndarray) -> float:
    """Sum of products on this thread. Not ``np.dot``: BLAS splits long vectors over its own
    threads, so the sum's rounding (and every decision made on it) would depend on how many
    there are, and idle BLAS threads spin on the cores the writer's threads need."""
    return float(np.einsum("i,i->", a, b))


def _inferred_dtype(values: np.ndarray) -> str:
    """The logical name of an undeclared float array (``F32``...), else numpy's name:
    a non-float tensor is never quantized, so its name only has to be informative."""
    try:
        entry = dtype_registry.of_array(values)
    except FormatError:  # complex, object...: not a dtype the store knows
        return values.dtype.name
    return entry.name if entry.is_float else values.dtype.name


def layer_type(shape: tuple[int, ...], module_kind: str | None = None) -> str:
    """Layer type from the owning module's class name when known, else from the shape.

    ``"Embedding"``/``"EmbeddingBag"`` -> embedding, ``"*Norm*"`` -> norm, ``"Conv*"`` ->
    conv (but a 2-D weight, e.g. GPT-2's ``Conv1D``, is a linear layer), ``"*Linear*"``
    and attention -> linear. Without a kind: 2-D linear, 3..5-D conv, 1-D norm/bias.
    """
    ndim = len(tuple(shape))
    if module_kind:
        kind = module_kind.lower()
        if "embedding" in kind:
            return "embedding"
        if "norm" in kind:
            return "norm"
        if kind.startswith("conv") or kind.startswith("lazyconv"):
            return "linear" if ndim == 2 else "conv"
        if "linear" in kind or "attention" in kind or kind == "bilinear":
            return "linear"
        return "other"
    if ndim == 2:
        return "linear"
    if 3 <= ndim <= 5:
        return "conv"
    return "norm" if ndim <= 1 else "other"


@dataclass(frozen=True)
class TensorInput:
    """One tensor to quantize.

    ``values``: the tensor as numpy (bfloat16 tensors widened to float32 with
    ``dtype="BF16"``); ``dtype``: ``F32``/``F16``/``BF16``/``F64``, inferred from
    ``values`` when omitted; ``layer_type``: one of :data:`LAYER_TYPES`, from the shape
    when omitted; ``sensitivity``: ``|g*w|`` scores shaped like ``values``;
    ``previous_codebook``: the previous version's codebook of this tensor.
    """

    values: np.ndarray
    dtype: str | None = None
    layer_type: str | None = None
    sensitivity: np.ndarray | None = None
    previous_codebook: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        values = np.asarray(self.values)
        object.__setattr__(self, "values", values)
        if self.dtype is None:
            object.__setattr__(self, "dtype", _inferred_dtype(values))
        if self.layer_type is None:
            object.__setattr__(self, "layer_type", layer_type(values.shape))
        if self.layer_type not in LAYER_TYPES:
            raise FormatError(
                f"Expected a layer type in {LAYER_TYPES}. Got {self.layer_type!r} instead; "
                "use layer_type(shape, module_kind) to derive it."
            )
        if self.dtype in FLOAT_NAMES and not np.issubdtype(values.dtype, np.floating):
            raise FormatError(
                f"Expected floating values for dtype {self.dtype}. Got {values.dtype} instead; "
                "pass bfloat16 tensors widened to float32."
            )


@dataclass(frozen=True)
class QuantizedTensor:
    """``values``: float32, same shape, only centres / 0.0 / protected values;
    ``codebook``: sorted centres, each exact in the tensor's dtype; ``stats``: levels,
    pruned_fraction, protected_fraction, rel_l2_error, max_abs_error, codebook_reused,
    layer_type, prune_threshold; ``scales``: one per column when the codebook is of
    normalised values (:mod:`inshrink_store.policy.channels`), else None."""

    values: np.ndarray
    codebook: tuple[float, ...]
    stats: Mapping[str, Any] = field(default_factory=dict)
    scales: tuple[float, ...] | None = None


def is_quantizable(t: TensorInput, config: QuantSettings) -> bool:
    """Floating, at least 2-D and at least ``min_numel`` elements; the rest stays lossless."""
    return t.dtype in FLOAT_NAMES and t.values.ndim >= 2 and t.values.size >= config.min_numel


def _as_float32(t: TensorInput) -> np.ndarray:
    return np.ascontiguousarray(t.values, dtype=np.float32)


def _metric(t: TensorInput, config: QuantSettings) -> str:
    """The prune metric used for ``t``: sensitivity only when asked for and available."""
    return "sensitivity" if config.prune_metric == "sensitivity" and t.sensitivity is not None else "magnitude"


def _prune_scores(t: TensorInput, metric: str) -> np.ndarray:
    """Scores whose lowest values are pruned; NaN scores are never pruned (NaN <= x is false)."""
    scores: np.ndarray = t.sensitivity if metric == "sensitivity" and t.sensitivity is not None else t.values
    return scores


def _at_most(scores: np.ndarray, threshold: float) -> np.ndarray:
    """``(np.abs(scores) <= threshold).ravel()``, blockwise: the magnitudes go through one small
    scratch buffer, not a temporary the size of the tensor."""
    flat = np.asarray(scores).reshape(-1)
    out = np.empty(flat.size, bool)
    scratch = np.empty(min(flat.size, BLOCK), flat.dtype)
    for s in range(0, flat.size, BLOCK):
        block = flat[s:s + BLOCK]
        magnitudes = np.abs(block, out=scratch[:block.size])
        np.less_equal(magnitudes, threshold, out=out[s:s + BLOCK])
    return out


def prune_thresholds(tensors: Mapping[str, TensorInput], config: QuantSettings,
                     cache: PartitionCache | None = None) -> dict[tuple[str, str], float]:
    """One threshold per (layer type, metric) from the merged sketches of all its tensors:
    the pooled ``prune`` quantile of the scores (tensors without sensitivity pool apart,
    by magnitude, so magnitudes and ``|g*w|`` never share a scale). The score sketches do
    not depend on the prune fraction, so a ``cache`` shares them across configurations."""
    if config.prune <= 0:
        return {}
    pools: dict[tuple[str, str], list[str]] = {}
    for name in sorted(tensors):
        pools.setdefault((str(tensors[name].layer_type), _metric(tensors[name], config)), []).append(name)

    def score_sketch(name: str, metric: str) -> LogSketch:
        t = tensors[name]
        source = t.sensitivity if metric == "sensitivity" else t.values

        def build() -> LogSketch:
            if cache is not None and metric != "sensitivity" and np.asarray(source).dtype == np.float32:
                return cache.values_sketch(name, _as_float32(t)).magnitudes()  # the values parts sketch
            return LogSketch.from_values(source).magnitudes()

        return cache.sketch(("scores", name, metric), build) if cache is not None else build()

    def pool(key: tuple[str, str]) -> LogSketch:
        merged = score_sketch(pools[key][0], key[1])
        for name in pools[key][1:]:
            merged = merged.merge(score_sketch(name, key[1]))
        return merged

    if cache is not None:  # the first configuration sketches every tensor's scores: on the writer's threads
        wanted = [(name, key[1]) for key, names in pools.items() for name in names]
        map_in_order(lambda item: score_sketch(*item), wanted, write_threads(), "inshrink-scores")
    pooled = {key: (cache.sketch(("pooled", *key, tuple(names)), lambda key=key: pool(key)) if cache is not None
                    else pool(key)) for key, names in pools.items()}
    return {key: s.quantile(config.prune) for key, s in sorted(pooled.items()) if s.count}


@dataclass(frozen=True)
class Part:
    """What one tensor's masks leave under one protect / prune / metric: the sketch of the
    rest (the values a codebook quantizes) and how many elements are protected and pruned.
    Enough to fit the codebook and to estimate the stored bytes without quantizing
    (:mod:`inshrink_store.policy.estimate`)."""

    sketch: LogSketch
    protected: int
    pruned: int
    size: int
    #: the dtype the protected values are stored as, and all of them zstd-coded alone, as a
    #: keyframe codes them when they fill blocks of their own (raw when that is smaller)
    protected_dtype: str = "bfloat16"
    protected_bytes: int = 0


def protected_words(w: np.ndarray, protected: np.ndarray, protected_dtype: str) -> np.ndarray:
    """The protected elements' words in ``protected_dtype``, in element order (a gather of few)."""
    return np.ascontiguousarray(dtype_registry.by_codec_name(protected_dtype).from_float32(w[protected]))


def coded_words_bytes(words: np.ndarray) -> int:
    """Words zstd-coded alone at the store's level (raw when that is smaller)."""
    raw = words.astype(words.dtype.newbyteorder("<")).tobytes()
    return min(len(raw), len(_zstd.compress(raw, ZSTD_LEVEL))) if raw else 0


class PartitionCache:
    """Parts (sketches of the quantized rest and their counts) and codebooks, shared by
    several configurations of one state.

    The search quantizes the same tensors under many configurations; those with the same
    protect / prune / metric have the same rest, hence the same sketch, the costliest
    step of fitting a codebook. Only sketches, counts and codebooks are kept (a few KB
    each), never masks or values, so a cache costs no model-sized memory. Results are
    identical with or without one. Keep one per checkpoint (keys are tensor names).

    Besides, per tensor and protect fraction, the flat positions of its protected elements
    (:meth:`positions`: a percent or two of its elements, found once instead of a selection
    and three passes over the tensor for every configuration), per layer type the pooled
    sketch of the prune scores (:func:`prune_thresholds`), and per tensor sketched more than
    once its sketch codes (:meth:`values_sketch`: 2 bytes an element, so that every further
    sketch of a part of it is a bincount), and the pieces of its default sample
    (:meth:`sample_piece`: the estimates of every configuration read the same elements)."""

    def __init__(self) -> None:
        self._sketches: dict[tuple[Any, ...], LogSketch] = {}
        self._parts: dict[tuple[Any, ...], Part] = {}
        self._codebooks: dict[tuple[Any, ...], Any] = {}
        self._positions: dict[tuple[Any, ...], np.ndarray] = {}
        self._keyed: dict[str, KeyedValues | None] = {}
        self._samples: dict[tuple[Any, ...], np.ndarray] = {}
        self._tails: dict[tuple[Any, ...], np.ndarray] = {}

    def values_sketch(self, name: str, values: np.ndarray, mask: np.ndarray | None = None) -> LogSketch:
        """``LogSketch.from_values(values, mask=mask)`` of tensor ``name``'s float32 ``values``
        (always the same array for one name): the first sketch directly, later ones from the
        tensor's :class:`~inshrink_store.policy.sketch.KeyedValues`, made at the second."""
        if name not in self._keyed:
            self._keyed[name] = None
            return LogSketch.from_values(values, mask=mask)
        keyed = self._keyed[name]
        if keyed is None:
            keyed = self._keyed[name] = KeyedValues(values)
        return keyed.sketch(mask)

    def sample_piece(self, key: tuple[Any, ...], build: Any) -> np.ndarray:
        """A piece of a tensor's default sample (its index, values, protected flags, prune
        scores), read-only, found once."""
        if key not in self._samples:
            piece = build()
            piece.flags.writeable = False
            self._samples[key] = piece
        return self._samples[key]

    def positions(self, key: tuple[Any, ...], build: Any) -> np.ndarray:
        """Sorted flat positions (read-only), e.g. a tensor's protected elements."""
        if key not in self._positions:
            found = build()
            found.flags.writeable = False
            self._positions[key] = found
        return self._positions[key]

    def sketch(self, key: tuple[Any, ...], build: Any) -> LogSketch:
        if key not in self._sketches:
            self._sketches[key] = build()
        return self._sketches[key]

    def unprotected_sketch(self, key: tuple[Any, ...], values: np.ndarray, protected: np.ndarray) -> LogSketch:
        """:meth:`sketch` under ``key`` of the ``values`` outside ``protected`` (the mask is
        inverted only when the sketch is made, not on a hit)."""
        return self.sketch(key, lambda: LogSketch.from_values(values, mask=~protected))

    def part(self, key: tuple[Any, ...], build: Any) -> Part:
        if key not in self._parts:
            self._parts[key] = build()
        return self._parts[key]

    def top_cut(self, name: str, which: str, array: np.ndarray, count: int) -> Any:
        """``protection.top_cut`` of tensor ``name``'s ``which`` source (its values or
        sensitivity), from one selection per source: the largest ``TAIL_FRACTION`` of
        ``|array|`` (``count`` at least), sorted, serves every protect fraction a search tries
        (a selection of the whole tensor per fraction was a third of a later save's search)."""
        key = ("tail", name, which)
        tail = self._tails.get(key)
        if tail is None or tail.size < count:
            tail = self._tails[key] = top_tail(array, max(count, math.ceil(TAIL_FRACTION * array.size)))
        return tail[count - 1]

    def codebook(self, key: tuple[Any, ...], build: Any) -> Any:
        """A fitted codebook (and whether it reused the previous one), or another small value
        (a protection cut), a few floats each."""
        if key not in self._codebooks:
            self._codebooks[key] = build()
        return self._codebooks[key]


def _protected_positions(w: np.ndarray, t: TensorInput, config: QuantSettings, cache: PartitionCache | None,
                         name: str | None) -> np.ndarray:
    """Sorted flat positions of :func:`protected_mask` (with ``cache`` and ``name``, found once
    per protect fraction: the fraction and the tensor fix them)."""
    def build() -> np.ndarray:
        return protected_positions(w, t.sensitivity, config.protect, cache=cache, name=name)

    if cache is None or name is None:
        return build()
    return cache.positions(("protected", name, config.protect), build)


def _masks(w: np.ndarray, t: TensorInput, config: QuantSettings, prune_threshold: float | None,
           cache: PartitionCache | None = None, name: str | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """The protected positions (sorted, flat) and the pruned mask (flat; None: nothing pruned):
    the scores at or below the threshold, less the protected."""
    protected = _protected_positions(w, t, config, cache, name)
    if prune_threshold is None:
        return protected, None
    pruned = _at_most(_prune_scores(t, _metric(t, config)), prune_threshold)
    pruned[protected] = False
    return protected, pruned


def _rest(size: int, protected: np.ndarray, pruned: np.ndarray | None) -> np.ndarray:
    """The flat mask of the quantized rest: neither protected nor pruned."""
    rest = np.ones(size, bool) if pruned is None else ~pruned
    rest[protected] = False
    return rest


def part_key(name: str, t: TensorInput, config: QuantSettings,
             prune_threshold: float | None) -> tuple[Any, ...]:
    """The cache key of a tensor's :class:`Part`: the rest is fixed by protect / threshold / metric
    (the protected dtype is the part's last field: only its ``protected_bytes`` depend on it)."""
    return (name, config.protect, prune_threshold, _metric(t, config) if prune_threshold is not None else None)


def _new_part(w: np.ndarray, protected: np.ndarray, pruned: np.ndarray | None, sketch: LogSketch,
              protected_dtype: str) -> Part:
    """``protected``: sorted flat positions; ``pruned``: a flat mask (None: none pruned)."""
    words = protected_words(w.reshape(-1), protected, protected_dtype)
    return Part(sketch, int(words.size), 0 if pruned is None else _count(pruned), int(w.size), protected_dtype,
                coded_words_bytes(words))


def _count(mask: np.ndarray) -> int:
    return int(np.count_nonzero(mask))


def tensor_part(t: TensorInput, config: QuantSettings, prune_threshold: float | None = None, *,
                cache: PartitionCache | None = None, name: str | None = None) -> Part:
    """The tensor's :class:`Part` under ``config``: its masks are computed, counted and
    sketched, then dropped (with ``cache`` and ``name``, once per protect / prune / metric)."""
    def build() -> Part:
        w = _as_float32(t)
        protected, pruned = _masks(w, t, config, prune_threshold, cache, name)
        rest = _rest(w.size, protected, pruned)
        if cache is not None and name is not None:
            sketch = cache.sketch(part_key(name, t, config, prune_threshold),
                                  lambda: cache.values_sketch(name, w, rest))
        else:
            sketch = LogSketch.from_values(w, mask=rest)
        return _new_part(w, protected, pruned, sketch, config.protected_dtype)

    if cache is None or name is None:
        return build()
    return cache.part((*part_key(name, t, config, prune_threshold), config.protected_dtype), build)


def fresh_codebook(part: Part, levels: int, include_zero: bool, dtype: str, *,
                   cache: PartitionCache | None = None, key: tuple[Any, ...] | None = None) -> np.ndarray:
    """The codebook fitted afresh to a part's sketch (no previous codebook): what a tensor
    gets without history, and what the byte estimate of a candidate assumes. With ``cache``
    and the part's ``key``, fitted once per part and level count."""
    def fit() -> np.ndarray:
        return fit_codebook(None, levels, include_zero=include_zero, sketch=part.sketch, dtype=dtype)

    if cache is None or key is None:
        return fit()
    return cast(np.ndarray, cache.codebook((*key, levels, include_zero, dtype, "fresh"), fit))


def quantize_tensor(t: TensorInput, config: QuantSettings, prune_threshold: float | None = None,
                    previous: ArrayLike | None = None, *, cache: PartitionCache | None = None,
                    name: str | None = None) -> QuantizedTensor:
    """Quantize one tensor; ``prune_threshold`` is its layer type's pooled threshold.

    With ``cache`` (and the tensor's ``name`` as its key), the rest's sketch and counts
    (its :class:`Part`) and the fitted codebooks are reused across configurations with the
    same protect / prune / metric."""
    w = _as_float32(t)
    dtype = str(t.dtype)
    include_zero = config.prune > 0
    prev = previous if previous is not None else t.previous_codebook
    levels = config.levels_for(str(t.layer_type))

    if cache is not None and name is not None:
        # with the part and codebook cached (every configuration after the first with this
        # protect / prune / metric), the pruned mask is never made whole: snap_pruned finds it
        # block by block, in cache-sized scratch
        protected = _protected_positions(w, t, config, cache, name)
        pruned = None
        key = part_key(name, t, config, prune_threshold)

        def build() -> Part:
            _, mask = _masks(w, t, config, prune_threshold, cache, name)
            return _new_part(w, protected, mask, cache.sketch(key, lambda: cache.values_sketch(
                name, w, _rest(w.size, protected, mask))), config.protected_dtype)

        part = cache.part((*key, config.protected_dtype), build)
        fresh = fresh_codebook(part, levels, include_zero, dtype, cache=cache, key=key)
        prev_key = None if prev is None else tuple(float(c) for c in np.asarray(prev, np.float64).ravel())
        centres, reused = cache.codebook(
            (*key, levels, include_zero, dtype, prev_key, config.codebook_reuse_tolerance),
            lambda: choose_codebook(w, None, levels, include_zero, dtype, prev, config.codebook_reuse_tolerance,
                                     sketch=part.sketch, fresh=fresh))
    else:
        protected, pruned = _masks(w, t, config, prune_threshold, cache, name)
        centres, reused = choose_codebook(w, _rest(w.size, protected, pruned), levels, include_zero, dtype, prev,
                                           config.codebook_reuse_tolerance)
    scores = None if prune_threshold is None else _prune_scores(t, _metric(t, config))
    out, pruned_count = snap_pruned(w, centres, protected, pruned, scores, prune_threshold)
    flat = out.reshape(-1)
    if protected.size:
        kept = w.reshape(-1)[protected]
        # the values the codec stores: rounded to the protected dtype and the tensor's own, a
        # finite value never rounded to infinity (bfloat16 rounds float32's largest and
        # float16's 65504 past their range: the codec would have stored the infinity planned)
        element = dtype_registry.get(dtype).codec_name or "float32"  # F64: its float32 values
        rounded = protected_values(kept, element, config.protected_dtype)
        flat[protected] = np.where(np.isfinite(kept), rounded, kept)  # NaN / Inf left alone
    n = max(w.size, 1)
    stats = _Stats({
        "levels": int(centres.size),
        "pruned_fraction": float(pruned_count) / n,
        "protected_fraction": float(protected.size) / n,
        "rel_l2_error": None,
        "max_abs_error": None,
        "codebook_reused": bool(reused),
        "layer_type": str(t.layer_type),
        "prune_threshold": None if prune_threshold is None else float(prune_threshold),
    }, w, out)
    return QuantizedTensor(out, tuple(float(c) for c in centres), stats)


class _Stats(Mapping[str, Any]):
    """A tensor's quantization statistics, with the error figures computed on first read.

    The error statistics are a full float64 pass over the tensor; a search quantizes many
    candidates whose statistics nobody reads, so they are computed only for the one that
    is written (or whenever a caller asks)."""

    _ERRORS = ("rel_l2_error", "max_abs_error")

    def __init__(self, base: dict[str, Any], w: np.ndarray, out: np.ndarray) -> None:
        self._data = base
        # both arrays are dropped once the figures are computed (they pin a model-sized copy)
        self._arrays: tuple[np.ndarray, np.ndarray] | None = (w, out)

    def _fill(self) -> None:
        if self._arrays is not None:
            self._data["rel_l2_error"], self._data["max_abs_error"] = error_stats(*self._arrays)
            self._arrays = None

    def __getitem__(self, key: str) -> Any:
        if key in self._ERRORS:
            self._fill()
        return self._data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __eq__(self, other: object) -> bool:
        return dict(self.items()) == (dict(other.items()) if isinstance(other, Mapping) else other)

    def __repr__(self) -> str:
        return repr(dict(self.items()))


def quantize_state(tensors: Mapping[str, TensorInput], config: QuantSettings,
                   previous: Mapping[str, Any] | None = None) -> dict[str, QuantizedTensor]:
    """Quantize every quantizable tensor (see :func:`is_quantizable`; others are left out
    of the result and stay lossless) with prune thresholds pooled per layer type.

    ``previous`` maps names to the previous version's codebooks; it overrides
    ``TensorInput.previous_codebook``. All results are held at once; a writer that
    wants one tensor in memory at a time uses :class:`StateQuantizer` instead.
    """
    plan = StateQuantizer(tensors, config, previous)
    return {name: plan.quantize(name) for name in plan.names}


#: elements of a tensor the byte estimate quantizes for real: :data:`SAMPLE_BLOCKS` evenly
#: spaced runs of contiguous elements (runs, not scattered elements: pruning by sensitivity
#: zeroes whole rows and columns, and the coder's matches depend on that layout)
SAMPLE_SIZE = 1 << 16
SAMPLE_BLOCKS = 16


def sample_index(size: int, sample: int = SAMPLE_SIZE, blocks: int = SAMPLE_BLOCKS) -> np.ndarray:
    """Flat indices of ``blocks`` evenly spaced runs of ``sample // blocks`` contiguous
    elements (every index when ``size <= sample``), ascending."""
    if size <= sample:
        return np.arange(size)
    run = sample // blocks
    starts = np.linspace(0, size - run, blocks).astype(np.int64)
    return (starts[:, None] + np.arange(run)[None, :]).ravel()


@dataclass(frozen=True)
class TensorSample:
    """A sample of one tensor's elements with the masks the tensor's own masks give them:
    ``values`` (float32), ``protected`` and ``pruned`` at each sampled element, and ``size``,
    the whole tensor's element count."""

    values: np.ndarray
    protected: np.ndarray
    pruned: np.ndarray
    size: int


class StateQuantizer:
    """The pooled (whole-state) half of quantization done up front, the per-tensor half
    on demand: validates inputs and computes prune thresholds per layer type, then
    :meth:`quantize` does one tensor. Same results as :func:`quantize_state`, but a
    writer can quantize, encode and drop tensors one by one (peak memory of one tensor,
    not of the model)."""

    def __init__(self, tensors: Mapping[str, TensorInput], config: QuantSettings,
                 previous: Mapping[str, Any] | None = None, cache: PartitionCache | None = None) -> None:
        for name, t in tensors.items():
            if t.sensitivity is not None and np.shape(t.sensitivity) != t.values.shape:
                raise FormatError(
                    f"Expected sensitivity of tensor {name!r} to have shape {t.values.shape}. "
                    f"Got {np.shape(t.sensitivity)} instead; pass |g*w| per element or None."
                )
        self.config = config
        self.chosen = {name: tensors[name] for name in sorted(tensors) if is_quantizable(tensors[name], config)}
        self.cache = cache
        self.thresholds = prune_thresholds(self.chosen, config, cache)
        self.previous = dict(previous or {})

    @property
    def names(self) -> list[str]:
        """The tensors that will be quantized, sorted."""
        return list(self.chosen)

    def quantize(self, name: str) -> QuantizedTensor:
        return quantize_tensor(self.chosen[name], self.config, self.threshold(name), self.previous.get(name),
                               cache=self.cache, name=name)

    def threshold(self, name: str) -> float | None:
        """The pooled prune threshold of ``name``'s layer type and metric (None: no pruning)."""
        t = self.chosen[name]
        return self.thresholds.get((str(t.layer_type), _metric(t, self.config)))

    def part(self, name: str) -> Part:
        """``name``'s :class:`Part` under this configuration (cached when the quantizer has a cache)."""
        return tensor_part(self.chosen[name], self.config, self.threshold(name), cache=self.cache, name=name)

    def sample(self, name: str, index: np.ndarray | None = None) -> TensorSample:
        """``name``'s elements at ``index`` (default :func:`sample_index`) with the masks
        :func:`quantize_tensor` gives them: the same cuts (found on the whole tensor, cached)
        and the same threshold, compared element by element as there."""
        t = self.chosen[name]
        w = _as_float32(t)
        threshold = self.threshold(name)
        metric = _metric(t, self.config)
        if index is None and self.cache is not None:
            # the default sample's gathers and its protected flags depend on the tensor and the
            # protect fraction alone: shared by every configuration (read-only, a few hundred KB)
            cache = self.cache
            index = cache.sample_piece(("index", name), lambda: sample_index(w.size))
            values = cache.sample_piece(("values", name), lambda: w.ravel()[index])
            protected = cache.sample_piece(("protected", name, self.config.protect), lambda: protected_mask(
                w, t.sensitivity, self.config.protect, cache=cache, name=name, at=index))
            scores_at = None if threshold is None else cache.sample_piece(
                ("scores", name, metric), lambda: np.asarray(_prune_scores(t, metric)).ravel()[index])
        else:
            index = sample_index(w.size) if index is None else index
            values = w.ravel()[index]
            protected = protected_mask(w, t.sensitivity, self.config.protect, cache=self.cache, name=name, at=index)
            scores_at = None if threshold is None else np.asarray(_prune_scores(t, metric)).ravel()[index]
        pruned = np.zeros(values.size, bool)
        if threshold is not None and scores_at is not None:
            pruned = (np.abs(scores_at) <= threshold) & ~protected
        return TensorSample(values, protected, pruned, int(w.size))

    def fresh_codebook(self, name: str) -> np.ndarray:
        """The codebook ``name`` gets fitted afresh under this configuration (see :func:`fresh_codebook`)."""
        t = self.chosen[name]
        threshold = self.threshold(name)
        key = part_key(name, t, self.config, threshold)
        return fresh_codebook(self.part(name), self.config.levels_for(str(t.layer_type)), self.config.prune > 0,
                              str(t.dtype), cache=self.cache, key=key)
