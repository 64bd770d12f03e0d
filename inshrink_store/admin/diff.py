"""diff: per-tensor changes between two versions, from their trees (values on request).
Layer: admin, below the facade (which delegates to it) and above the write session."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from inshrink_store import dtypes
from inshrink_store.layout import OBJECTS, object_path
from inshrink_store.parallel import map_in_order
from inshrink_store.parts import StoreParts
from inshrink_store.reader import SnapshotReader

Progress = Callable[[str, int, int], None]
_PARALLEL_REQUESTS = 8  # tensors compared at once on an object store (each read waits on requests)


@dataclass
class TensorChange:
    path: str
    status: str  # added | removed | changed | unchanged
    shape_a: tuple[int, ...] | None = None
    shape_b: tuple[int, ...] | None = None
    dtype_a: str | None = None
    dtype_b: str | None = None
    chunks_changed: int = 0
    chunks_total: int = 0
    new_bytes: int = 0
    storage_b: str | None = None
    max_abs_change: float | None = None
    rel_l2_change: float | None = None
    #: with ``values``, for integer, bool and byte tensors (an RNG state, a step counter) instead
    #: of the two figures above: whether any byte differs (their distances mean nothing)
    bytes_changed: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


@dataclass
class DiffReport:
    a: str
    b: str
    tensors: list[TensorChange]

    def by_status(self, status: str) -> list[TensorChange]:
        return [t for t in self.tensors if t.status == status]

    @property
    def new_bytes(self) -> int:
        return sum(t.new_bytes for t in self.tensors)

    def to_dict(self) -> dict[str, Any]:
        counts = {s: len(self.by_status(s)) for s in ("added", "removed", "changed", "unchanged")}
        return {"a": self.a, "b": self.b, "counts": counts, "new_bytes": self.new_bytes,
                "tensors": [t.to_dict() for t in self.tensors]}


def diff(parts: StoreParts, ref_a: str, ref_b: str, *, values: bool = False,
         progress: Progress | None = None) -> DiffReport:
    """Per-tensor changes between two versions, from their trees alone; ``values`` also
    reads every tensor both versions hold in one shape (``progress`` hears each one)."""
    a, b = parts.checkout(ref_a), parts.checkout(ref_b)
    infos_a, infos_b = a.arrays(), b.arrays()
    objects_a = {oid for info in infos_a.values() for oid in info.chunk_ids.values()}
    sizes = parts.storage.list(OBJECTS)
    out = []
    for path in sorted(set(infos_a) | set(infos_b)):
        ia, ib = infos_a.get(path), infos_b.get(path)
        change = TensorChange(path, "unchanged")
        if ia is not None:
            change.shape_a, change.dtype_a = ia.shape, ia.dtype
        if ib is not None:
            change.shape_b, change.dtype_b, change.storage_b = ib.shape, ib.dtype, ib.storage
            change.chunks_total = len(ib.chunk_ids)
            fresh = {o for o in ib.chunk_ids.values() if o not in objects_a}
            change.new_bytes = sum(sizes.get(object_path(o), 0) for o in fresh)
        if ia is None:
            change.status = "added"
        elif ib is None:
            change.status = "removed"
        else:
            differing = {k for k in set(ia.chunk_ids) | set(ib.chunk_ids)
                         if ia.chunk_ids.get(k) != ib.chunk_ids.get(k)}
            change.chunks_changed = len(differing)
            if differing or ia.shape != ib.shape or ia.dtype != ib.dtype:
                change.status = "changed"
        out.append(change)
    if values:
        both = [c for c in out if c.status in ("changed", "unchanged") and c.shape_a == c.shape_b]
        done = 0
        workers = _workers(parts)
        batch = 4 * workers
        for start in range(0, len(both), batch):  # tensors compared side by side; progress per batch
            chosen = both[start:start + batch]
            map_in_order(lambda change: _compare(a, b, change), chosen, workers, "inshrink-diff")
            if progress:
                for change in chosen:
                    done += 1
                    progress(change.path, done, len(both))
    return DiffReport(a.id, b.id, out)


def _compare(a: SnapshotReader, b: SnapshotReader, change: TensorChange) -> None:
    """Fill ``change``'s value figures: a's tensor is read before b's, so where b's chunk is a
    delta on a's, its base is decoded already (the object store's cache)."""
    other = None if change.status == "unchanged" else b  # an unchanged tensor has b's very chunks: read it once
    if _exact(change.dtype_a) and change.dtype_a == change.dtype_b:
        change.bytes_changed = other is not None and _bytes_differ(a, other, change.path)
    else:
        change.max_abs_change, change.rel_l2_change = _value_change(a, other, change.path)


def _workers(parts: StoreParts) -> int:
    """Tensors compared at once: the cores on a local disk or in memory, several requests at
    once on an object store (numpy, zstd and I/O release the GIL)."""
    storage = parts.storage
    local = not storage.is_remote
    return (os.cpu_count() or 1) if local else _PARALLEL_REQUESTS


def _exact(dtype: str | None) -> bool:
    """Integer, bool and byte dtypes: compared byte for byte, never by distance."""
    entry = dtypes.REGISTRY.get(dtype or "")
    return entry is not None and entry.kind in ("int", "uint", "bool")


def _bytes_differ(a: SnapshotReader, b: SnapshotReader, path: str) -> bool:
    return not np.array_equal(a.read(path, writable=False), b.read(path, writable=False))


def _value_change(a: SnapshotReader, b: SnapshotReader | None, path: str) -> tuple[float, float]:
    """(max |b - a|, ||b - a|| / ||a||); ``b`` None means b is a's very chunks: no change,
    nothing read.

    Elements equal in both (an inf that stays the same inf, a NaN that stays NaN) change by 0;
    an element that becomes or stops being inf or NaN (or flips the sign of an inf) changes
    without bound, so both figures are inf. ``||a||`` is over a's finite values. In float64,
    or complex128 where either side is complex: the modulus of the complex difference, never
    the real part alone (a cast to float drops the imaginary part)."""
    if b is None:
        return 0.0, 0.0
    raw_a, raw_b = a.read_float(path, writable=False), b.read_float(path, writable=False)  # only looked at
    if raw_a.size == 0:
        return 0.0, 0.0
    if not (np.iscomplexobj(raw_a) or np.iscomplexobj(raw_b)):
        return _real_change(raw_a, raw_b)
    wide = np.complex128
    va, vb = raw_a.astype(wide), raw_b.astype(wide)
    same = (va == vb) | (np.isnan(va) & np.isnan(vb))
    if not (np.isfinite(va[~same]).all() and np.isfinite(vb[~same]).all()):
        return math.inf, math.inf
    delta = np.abs(vb[~same] - va[~same])
    max_abs = float(delta.max()) if delta.size else 0.0
    norm = float(np.linalg.norm(va[np.isfinite(va)]))
    rel = float(np.linalg.norm(delta) / norm) if norm > 0 else (0.0 if max_abs == 0 else math.inf)
    return max_abs, rel


#: elements per block of :func:`_finite_change` (two float64 buffers of 512 KiB: they stay in
#: a core's cache while a block is subtracted, squared and summed)
_BLOCK = 1 << 16


def _real_change(raw_a: np.ndarray, raw_b: np.ndarray) -> tuple[float, float]:
    """:func:`_value_change` of two real tensors. A tensor of more than one block whose
    values are all finite takes :func:`_finite_change` (one pass, block by block); a small
    one, or one holding inf or NaN, the passes below."""
    if raw_a.size > _BLOCK:
        figures = _finite_change(raw_a.reshape(-1), raw_b.reshape(-1))
        if figures is not None:
            return figures
    return _masked_change(raw_a, raw_b)


def _finite_change(a: np.ndarray, b: np.ndarray) -> tuple[float, float] | None:
    """:func:`_masked_change`'s figures of two flat real tensors whose values are all finite,
    or None when a value is not (or a figure would overflow): those take the masked passes.

    Block by block, ``b - a`` in float64 (a widening to float64 is exact, so the difference is
    the very one the masked passes take, and an equal element's is 0: it adds nothing to the
    max or the sums); its largest magnitude, and the sums of its squares and of ``a``'s, in
    float64. A block whose largest ``|b - a|`` is not finite holds an inf or NaN on one side
    (or a float64 difference overflowed). The max is the same figure; the norms are the same
    sums added in another order (blocks, numpy's pairwise sums instead of BLAS's dot), so
    they may differ in the last bits. Why: the masked passes (masks, a boolean gather of both
    tensors, whole float64 copies) and BLAS's threads took more CPU than reading the tensors
    (issue 43, item 10). Each block of ``a`` is widened once and used for the difference
    and its squares (the same float64 values either way: 18 % less time than widening it
    for each)."""
    size = a.size
    delta = np.empty(min(size, _BLOCK), np.float64)
    wide = np.empty_like(delta)
    max_abs = squares_delta = squares_a = 0.0
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf, an overflow: found below, not warned
        for start in range(0, size, _BLOCK):
            stop = min(start + _BLOCK, size)
            d, w = delta[:stop - start], wide[:stop - start]
            np.copyto(w, a[start:stop])
            np.subtract(b[start:stop], w, out=d, dtype=np.float64)
            np.abs(d, out=d)
            top = float(d.max())
            if not math.isfinite(top):
                return None
            max_abs = max(max_abs, top)
            squares_delta += float(np.add.reduce(np.square(d, out=d)))
            squares_a += float(np.add.reduce(np.square(w, out=w)))
    if not (math.isfinite(squares_delta) and math.isfinite(squares_a)):
        return None
    norm = math.sqrt(squares_a)
    rel = math.sqrt(squares_delta) / norm if norm > 0 else (0.0 if max_abs == 0 else math.inf)
    return max_abs, rel


def _masked_change(raw_a: np.ndarray, raw_b: np.ndarray) -> tuple[float, float]:
    """:func:`_real_change` by masks, any values: which elements are equal is found in the
    tensors' own dtype (a widening to float64 is exact, so it keeps every equality and NaN),
    and only the elements that differ are widened (in the same order, so the sums are the very
    same as over whole widened tensors)."""
    same = raw_a == raw_b
    same |= np.isnan(raw_a) & np.isnan(raw_b)
    if same.all():
        changed_a = changed_b = np.empty(0, np.float64)
    else:
        differ = ~same
        changed_a, changed_b = raw_a[differ], raw_b[differ]
        if not (np.isfinite(changed_a).all() and np.isfinite(changed_b).all()):
            return math.inf, math.inf
        changed_a, changed_b = changed_a.astype(np.float64), changed_b.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):  # float64 values past 1e308 apart: inf, not a warning
        delta = np.abs(changed_b - changed_a)
        max_abs = float(delta.max()) if delta.size else 0.0
        finite = np.isfinite(raw_a)
        norm = float(np.linalg.norm((raw_a if finite.all() else raw_a[finite]).astype(np.float64).reshape(-1)))
        rel = float(np.linalg.norm(delta) / norm) if norm > 0 else (0.0 if max_abs == 0 else math.inf)
    return max_abs, rel
