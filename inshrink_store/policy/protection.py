"""Which elements a plan protects: the top ``protect`` fraction by ``|w|`` and by ``|g*w|``,
and every non-finite value.
Layer: refs, history and policy (the policy imports neither sibling), below ``parts``.

A selection's cut (the count-th largest magnitude) is most of the cost, so a search's cache
keeps each source's largest magnitudes sorted once (:func:`top_tail`) and reads every protect
fraction's cut from them; the comparison against the cut is one pass, block by block.
Split out of :mod:`~inshrink_store.policy.partition`, which plans tensors with it.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from inshrink_store.policy import snapping
from inshrink_store.policy.sketch import BLOCK

__all__ = ["TAIL_FRACTION", "protected_mask", "protected_positions", "top_cut", "top_tail"]


class Cuts(Protocol):
    """Where a selection's cuts are kept (:class:`~inshrink_store.policy.partition.PartitionCache`)."""

    def top_cut(self, name: str, which: str, array: np.ndarray, count: int) -> Any: ...


def top_cut(values: np.ndarray, count: int) -> Any:
    """The ``count``-th largest ``|value|`` (NaN counted as 0). O(n) selection on one scratch
    copy, no full sort."""
    scratch = np.abs(np.asarray(values, np.float32 if values.dtype == np.float16 else None)).ravel()
    if not np.isfinite(scratch).all():
        scratch[np.isnan(scratch)] = 0.0  # NaN sorts last; it must not take a top slot
    kth = scratch.size - count
    scratch.partition(kth)
    return scratch[kth]


#: the share of a tensor's largest magnitudes :meth:`PartitionCache.top_cut` keeps sorted: every
#: protect fraction of the default search space (at most 1 %) from one selection
TAIL_FRACTION = 0.02


def top_tail(values: np.ndarray, count: int) -> np.ndarray:
    """The ``count`` largest ``|value|`` (NaN counted as 0), largest first: entry ``k - 1`` is
    :func:`top_cut` of ``k`` for every ``k <= count``, the same order statistic."""
    scratch = np.abs(np.asarray(values, np.float32 if values.dtype == np.float16 else None)).ravel()
    if not np.isfinite(scratch).all():
        scratch[np.isnan(scratch)] = 0.0
    count = min(count, scratch.size)
    kth = scratch.size - count
    scratch.partition(kth)
    tail = np.sort(scratch[kth:])[::-1].copy()
    tail.flags.writeable = False
    return tail


def top_mask(values: np.ndarray, count: int, out: np.ndarray, cut: Any = None) -> None:
    """Set ``out`` where ``|values|`` is among the ``count`` largest (ties at the cut
    included, zeros and NaN never); ``cut`` is :func:`top_cut` when already known. The
    comparison runs blockwise so the selection's scratch is the only full-size temporary."""
    if cut is None:
        cut = top_cut(values, count)
    flat, dst = values.ravel(), out.ravel()
    for s in range(0, flat.size, BLOCK):
        mag = np.abs(flat[s:s + BLOCK])
        dst[s:s + BLOCK] |= (mag > 0) if cut <= 0 else (mag >= cut)


def protected_mask(values: np.ndarray, sensitivity: np.ndarray | None, fraction: float, *,
                   cache: Cuts | None = None, name: str | None = None,
                   at: np.ndarray | None = None) -> np.ndarray:
    """Non-finite values, the top ``fraction`` by ``|w|`` and the top ``fraction`` by ``|s|``.
    With ``cache`` and the tensor's ``name``, each selection's cut is found once per
    fraction (it is most of the cost; the comparison is a pass). ``at``: only these flat
    positions (a 1-D mask of them), still judged against the whole tensor's cuts."""
    mask: np.ndarray = ~np.isfinite(values if at is None else values.ravel()[at])
    count = int(round(fraction * values.size))
    if count > 0:
        for which, source in (("values", values), ("sensitivity", sensitivity)):
            if source is None:
                continue
            array = np.asarray(source)
            cut = None
            if cache is not None and name is not None:
                cut = cache.top_cut(name, which, array, count)
            elif at is not None:
                cut = top_cut(array, count)  # on the whole tensor, not on the positions
            top_mask(array if at is None else array.ravel()[at], count, mask, cut)
    return mask


def protected_positions(values: np.ndarray, sensitivity: np.ndarray | None, fraction: float, *,
                        cache: Cuts | None = None, name: str | None = None) -> np.ndarray:
    """``np.flatnonzero(protected_mask(values, sensitivity, fraction, ...))``, found block by
    block against the same cuts: no mask of the tensor's size is made (the positions are a
    percent or two of it)."""
    flat = np.asarray(values).reshape(-1)
    count = int(round(fraction * flat.size))
    sources = []
    if count > 0:
        for which, source in (("values", values), ("sensitivity", sensitivity)):
            if source is None:
                continue
            array = np.asarray(source)
            cut = cache.top_cut(name, which, array, count) if cache is not None and name is not None \
                else top_cut(array, count)
            sources.append((array.reshape(-1), cut))
    found = [np.zeros(0, np.intp)]
    for s in range(0, flat.size, snapping.SNAP_BLOCK):
        e = min(s + snapping.SNAP_BLOCK, flat.size)
        mask = ~np.isfinite(flat[s:e])
        for array, cut in sources:  # as top_mask compares
            mag = np.abs(array[s:e])
            mask |= (mag > 0) if cut <= 0 else (mag >= cut)
        found.append(np.flatnonzero(mask) + s)
    return np.concatenate(found)
