"""What each codebook size would cost one tensor, in bytes and in error, and the cheapest mix.
Layer: refs, history and policy (the policy imports neither sibling), below ``parts``.

One configuration for the whole model spends the same levels on every tensor, although the
tensors differ: a wide convolution holds most of the bytes, a small projection holds few, and
their errors matter alike (a layer's relative weight error becomes about the same relative
error of its output). Per-tensor allocation prices every choice and spends bytes where they
buy the most error back:

- :func:`tensor_options` measures, for each codebook size of a ladder (and for storing the
  tensor lossless), the bytes the store would keep and the relative squared error
  ``||w - q||^2 / ||w||^2``. Codebooks are fitted the way a save fits them (the log-space
  sketch of the unprotected values, approximate k-means); bytes and error come from a
  deterministic sample of contiguous blocks (16 x 4096 elements, the whole tensor when
  smaller) whose level ids are coded the way the store codes a keyframe (zstd, ids two per
  byte when that is smaller): contexts survive in a contiguous block, so the estimate follows
  the real encoder, not an entropy formula.
- :func:`allocate` keeps each tensor's lower convex hull of (bytes, cost) and takes the
  steps up those hulls in order of cost removed per byte (a Lagrangian allocation: where it
  stops at the end of a step in that order, no other split of the same bytes has a smaller
  total cost) until a byte budget is spent or the mean relative squared error reaches a
  target.

The cost of an option is its relative squared error ``e2`` with a penalty for large errors,
``e2 * (1 + e2 / KNEE**2)``: adding errors up assumes each is small. Measured on CREPE (a
pretrained convolutional pitch tracker), plain ``e2`` sent its largest convolution to 3 levels
(relative error 0.64) at 18x and the embedding cosine fell from 0.997 to 0.925; with the
penalty the same budget keeps every tensor under ~0.35 and the cosine at 0.991. For the same
reason the ladder starts at 4 levels: 3 (a zero and one value of each sign) is pruning
without saying so, and is left to configurations that prune on purpose.

Everything is a function of the tensors alone (no randomness, no thread-count dependence),
so the same state always gets the same levels and the same bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from inshrink_store import dtypes as dtype_registry
from inshrink_store.codecs import _payload
from inshrink_store.codecs.nuq import nearest_index
from inshrink_store.errors import FormatError
from inshrink_store.object_format import keyframe_body
from inshrink_store.policy.kmeans import fit_codebook, through_dtype
from inshrink_store.policy.partition import protected_mask, sample_index, sum_of_products
from inshrink_store.policy.sketch import LogSketch

#: codebook sizes priced per tensor; the largest keeps ids one byte wide (254 + protected id)
LADDER = (4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 254)
#: relative error above which errors are priced more than their square (see the module doc)
KNEE = 0.3
SAMPLE_BLOCKS = 16
SAMPLE_BLOCK = 4096
#: per-chunk bytes the payload adds beyond ids and protected words (header, zarr framing)
_OVERHEAD = 64


@dataclass(frozen=True)
class Option:
    """One way to store a tensor: ``levels`` codebook centres (None: lossless), the bytes the
    store would keep and the relative squared error ``||w - q||^2 / ||w||^2`` (0 lossless);
    ``scaled``: the codebook is of channel-normalised values (:mod:`~inshrink_store.policy.channels`)."""

    levels: int | None
    stored_bytes: float
    sq_error: float
    scaled: bool = False


def sample_positions(size: int) -> np.ndarray:
    """Flat positions of the estimate's sample: 16 contiguous blocks of 4096 spread evenly
    over the tensor (every position when the tensor is smaller); the search's byte estimate
    samples the same way (:func:`~inshrink_store.policy.partition.sample_index`)."""
    return sample_index(size, SAMPLE_BLOCKS * SAMPLE_BLOCK, SAMPLE_BLOCKS)


def _protected_error(values: np.ndarray, protected: np.ndarray, dtype: str, protected_dtype: str) -> float:
    """Squared error of the protected (finite) values, rounded to what they are kept as."""
    kept = values[protected]
    kept = kept[np.isfinite(kept)].astype(np.float32)
    keep_as = dtype_registry.by_codec_name(protected_dtype)
    rounded = keep_as.round_float32(kept) if keep_as.name == "BF16" else through_dtype(kept, dtype)
    d = kept.astype(np.float64) - rounded
    return sum_of_products(d, d)


def tensor_options(values: np.ndarray, *, dtype: str = "F32", protect: float = 0.005,
                   protected_dtype: str = "bfloat16", sensitivity: np.ndarray | None = None,
                   ladder: Sequence[int] = LADDER, lossless_bytes: float | None = None,
                   sketch: LogSketch | None = None, protected: np.ndarray | None = None,
                   column_scales: np.ndarray | None = None, importance: np.ndarray | None = None) -> list[Option]:
    """Every option for one tensor (float32 ``values`` of logical ``dtype``), cheapest first.

    ``protect``: the fraction kept whole by magnitude (and by ``sensitivity`` when given), as
    a save protects them; ``lossless_bytes``: what the tensor costs lossless (adds that
    option; None leaves it out); ``sketch`` and ``protected``: the sketch of the unprotected
    values and the protected mask, when the caller made them already (the costly parts).
    ``column_scales``: ``values`` are channel-normalised (divided by these, one per column):
    the options are then of the scaled form, their errors in the tensor's own units and their
    bytes with the scales (4 bytes each, in the array's configuration). ``importance``: how
    much each element's error matters (shaped like the tensor, >= 0: a calibration's diagonal
    Fisher): the error is then ``sum(F * d^2) / sum(F * w^2)``, so two forms of the tensor are
    compared by what they do to the output, not by their plain weight error."""
    w = np.ascontiguousarray(values, np.float32)
    if w.size == 0:
        raise FormatError("Expected a non-empty tensor to price. Got an empty one instead.")
    flat = w.ravel()
    protected = (protected_mask(w, sensitivity, protect) if protected is None else protected).ravel()
    if sketch is None:
        sketch = LogSketch.from_values(w, mask=~protected.reshape(w.shape))
    positions = sample_positions(flat.size)
    # each element's error in the tensor's own units, times its importance, is what counts
    unit_all = None if importance is None else np.asarray(importance, np.float64).reshape(-1)
    if column_scales is not None:
        s2 = np.tile(np.asarray(column_scales, np.float64) ** 2, flat.size // len(column_scales))
        unit_all = s2 if unit_all is None else unit_all * s2
    metadata = 0 if column_scales is None else 4 * len(column_scales)
    if unit_all is None:
        unit = None
        finite = flat[np.isfinite(flat)].astype(np.float64)
        norm = sum_of_products(finite, finite)
    else:
        unit = unit_all[positions]
        finite_sq = np.where(np.isfinite(flat), flat.astype(np.float64) ** 2, 0.0)
        norm = sum_of_products(finite_sq, unit_all)
    x, kept = flat[positions], protected[positions]
    rest = ~kept
    scale = (flat.size - np.count_nonzero(protected)) / max(int(np.count_nonzero(rest)), 1)
    original = flat if column_scales is None else \
        (w * np.asarray(column_scales, np.float32)).astype(np.float32).ravel()
    prot_err = _protected_error(original, protected, dtype, protected_dtype)
    if importance is not None:  # its bfloat16 rounding, at the average importance
        prot_err *= float(np.mean(importance))
    prot_bytes = np.count_nonzero(protected) * _payload.PROTECTED_ITEMSIZE[protected_dtype]
    out = [] if lossless_bytes is None else [Option(None, float(lossless_bytes), 0.0)]
    for levels in ladder:
        centres = fit_codebook(None, int(levels), include_zero=False, sketch=sketch,
                               dtype=dtype).astype(np.float32)
        ids = nearest_index(x, centres)
        ids[kept] = centres.size  # the protected id, as in the payload
        d = x[rest].astype(np.float64) - centres[ids[rest]]
        sq_sum = sum_of_products(d, d) if unit is None else sum_of_products(d, d * unit[rest])
        sq = (sq_sum * scale + prot_err) / norm if norm > 0 else 0.0
        id_bytes = _coded_ids(ids, centres.size + 1) * flat.size / positions.size
        out.append(Option(int(levels), id_bytes + prot_bytes + 4 * centres.size + _OVERHEAD + metadata, sq,
                          column_scales is not None))
    return sorted(out, key=lambda o: (o.stored_bytes, o.sq_error))


def cost(o: Option) -> float:
    """What the allocation minimises for one option: ``e2 * (1 + e2 / KNEE**2)``."""
    return o.sq_error * (1.0 + o.sq_error / KNEE**2)


def _coded_ids(ids: np.ndarray, levels: int) -> int:
    """Bytes of byte-wide ids (``levels`` counting the protected id) as the store codes them in
    a keyframe (:func:`inshrink_store.object_format.keyframe_body`); the protected words are left out."""
    protected = np.zeros(int(np.count_nonzero(ids == levels - 1)), np.uint16)
    return len(keyframe_body(_payload.pack(levels, ids, "bfloat16", protected))[1])


def hull(options: Sequence[Option]) -> list[Option]:
    """The lower convex hull of (bytes, :func:`cost`), cheapest first: the options an optimal
    allocation can pick (any other is beaten by a mix of two neighbours)."""
    pts: list[Option] = []
    for o in sorted(options, key=lambda o: (o.stored_bytes, cost(o))):
        if pts and cost(o) >= cost(pts[-1]):
            continue  # more bytes for no less cost
        while len(pts) >= 2:
            a, b = pts[-2], pts[-1]
            # b is on or above the segment a-o: drop it
            if (cost(b) - cost(a)) * (o.stored_bytes - a.stored_bytes) >= \
                    (cost(o) - cost(a)) * (b.stored_bytes - a.stored_bytes):
                pts.pop()
            else:
                break
        pts.append(o)
    return pts


def check_weights(weights: Mapping[str, float] | None, options: Mapping[str, object]) -> dict[str, float]:
    """Every path of ``options`` with its weight (1 where ``weights`` has none); a weight that
    is not a finite number > 0 is refused, naming its tensor."""
    given = dict(weights or {})
    for name, w in given.items():
        if isinstance(w, bool) or not isinstance(w, (int, float, np.floating, np.integer)) or not (0 < float(w) < float("inf")):
            raise FormatError(f"Expected the weight of tensor {name!r} to be a finite number > 0. Got {w!r} instead.")
    return {name: float(given.get(name, 1.0)) for name in options}


def allocate(options: Mapping[str, Sequence[Option]], *, budget_bytes: float | None = None,
             max_mean_sq_error: float | None = None,
             weights: Mapping[str, float] | None = None) -> dict[str, Option]:
    """Each tensor's option for one target (exactly one): ``budget_bytes`` (summed over the
    tensors) or ``max_mean_sq_error`` (the mean relative squared error). The climb takes
    hull steps in order of cost removed per byte while they fit, so its total :func:`cost`
    is the least for the bytes it spends whenever it stops at the end of a step the order
    reached (a Lagrangian breakpoint); between breakpoints a step that does not fit is
    skipped with its tensor's later ones, and a different pair of steps could fit the
    remainder better (the loss is below one step's worth). When even the smallest options
    exceed the budget, they are returned (the caller reports the ratio it got).

    ``weights`` (path -> a number > 0, 1 for a path it leaves out): how much a unit of one
    tensor's cost matters to the model's output (:mod:`inshrink_store.policy.sensitivity`);
    the allocation then minimises the weighted sum. A weight scales a tensor's hull, never
    reshapes it, so only the order of the steps changes."""
    weight = check_weights(weights, options)
    if (budget_bytes is None) == (max_mean_sq_error is None):
        raise FormatError("Expected exactly one of budget_bytes and max_mean_sq_error. Got "
                          f"{budget_bytes!r} and {max_mean_sq_error!r} instead.")
    hulls = {name: hull(opts) for name, opts in sorted(options.items())}
    for name, h in hulls.items():
        if not h:
            raise FormatError(f"Expected at least one option for tensor {name!r}. Got none instead.")
    pick = dict.fromkeys(hulls, 0)
    steps = []  # (-(cost removed per byte), name, index it moves to): best first, ties by name
    for name, h in hulls.items():
        for i in range(1, len(h)):
            gain = weight[name] * (cost(h[i - 1]) - cost(h[i])) / max(h[i].stored_bytes - h[i - 1].stored_bytes, 1e-9)
            steps.append((-gain, name, i))
    steps.sort()
    total_bytes = sum(h[0].stored_bytes for h in hulls.values())
    total_err = sum(h[0].sq_error for h in hulls.values())
    count = len(hulls)
    stalled: set[str] = set()
    for _, name, i in steps:
        if max_mean_sq_error is not None and total_err / count <= max_mean_sq_error:
            break
        if name in stalled or pick[name] != i - 1:
            continue
        h = hulls[name]
        extra = h[i].stored_bytes - h[i - 1].stored_bytes
        if budget_bytes is not None and total_bytes + extra > budget_bytes:
            stalled.add(name)  # its later steps depend on this one
            continue
        pick[name] = i
        total_bytes += extra
        total_err += h[i].sq_error - h[i - 1].sq_error
    return {name: hulls[name][i] for name, i in pick.items()}
