"""Closed-loop versions of the model's weights: each a quantized residual against what the
store holds for the previous version.
Layer: refs, history and policy (the policy imports neither sibling), below ``parts``.

Why: quantizing every version's weights afresh (open loop) hands a lossy restore the full
quantization error of a few levels, and restores add it up. Here a float32 weight tensor
whose parent version holds a closed-loop reconstruction ``R_{t-1}`` is searched, quantized
and stored as ``r_t = Q(W_t - R_{t-1})``, and the version's value is ``R_t = R_{t-1} + r_t``:
the search judges its tolerance on ``R_t`` itself (what a restore returns), a restore is
within one residual's error of the weights, and the error does not accumulate over versions
or restores. The residual of one checkpoint interval is small, so its levels sit at a fine
absolute resolution for few bits, and the exact-resume residual (the true bits against
``R_t``) differs from the weights only in low mantissa bits.

How it is stored: the array is an ordinary float32 array (zarr's ``bytes`` alone) holding
``R_t``; each chunk's object is coded by the object store's coder 4 (``codecs/closed_loop``)
from the quantized residual this module hands it, as a delta on the parent version's chunk.
A chain ends at a keyframe: the weights themselves quantized with the same configuration,
written when the tensor has no closed-loop parent, its shape changed, or the parent's chunk
chain reached the store's keyframe interval. What decides is the stored objects' own
depths, read from their headers, so imports, forks and restores continue correctly.

Deterministic: the residual is a float32 subtraction, the quantizer is the store's (seeded
from the data), and the reconstruction one float32 addition per element, which every
reader repeats bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash
from zarr.codecs import BytesCodec

from inshrink_store.cas import ClosedLoopCoding, ObjectStore
from inshrink_store.codecs import closed_loop
from inshrink_store.codecs.nuq import NUQZarrCodec, quantizer
from inshrink_store.errors import InshrinkError
from inshrink_store.index import METADATA_KEY
from inshrink_store.plans import ArrayPlan
from inshrink_store.writer import chunk_bytes

#: ``attributes.inshrink.coding`` of a closed-loop array
CODING = "closed-loop"
_F32 = np.dtype("<f4")


def source_digest(values: np.ndarray) -> str:
    """xxh3-128 of a tensor's true float32 bits and shape (``attributes.inshrink.source``): a
    tensor saved again unchanged (a frozen layer) keeps its parent's reconstruction as it is."""
    h = xxhash.xxh3_128(repr(tuple(values.shape)).encode())
    h.update(np.ascontiguousarray(values, _F32).reshape(-1).view(np.uint8).data)
    return h.hexdigest()


def _finite(values: np.ndarray) -> bool:
    """Whether every element is finite: a float32 tensor's float64 sum cannot overflow, and
    any NaN or inf makes it non-finite (one pass, no boolean temporary of the tensor's size)."""
    return bool(np.isfinite(np.sum(values, dtype=np.float64)))


@dataclass(frozen=True)
class Base:
    """The parent version's closed-loop array of one tensor: its stored values (the
    reconstruction), the deepest chain among its chunk objects, and its source digest."""

    values: np.ndarray
    depth: int
    source: str | None


def parent_bases(reader: Any, paths: list[str], tensors: Mapping[str, np.ndarray]) -> dict[str, Base]:
    """The closed-loop arrays of ``reader``'s version (a SnapshotReader, or None) among
    ``paths`` with the same shape as this version's tensor; an unreadable one is left out
    (that tensor gets a keyframe, which is always correct)."""
    if reader is None:
        return {}
    objects: ObjectStore = reader.view.objects
    out = {}
    for path in paths:
        try:
            info = reader.index.array(path)
            if info is None or info.attributes.get("coding") != CODING or tuple(info.shape) != tensors[path].shape \
                    or info.dtype != "F32":
                continue
            depths = [objects.header(oid).depth for key, oid in info.chunk_ids.items() if key != METADATA_KEY]
            values = np.asarray(reader.read(path), _F32)
        except InshrinkError:
            continue
        source = info.attributes.get("source")
        out[path] = Base(values, max(depths, default=0), source if isinstance(source, str) else None)
    return out


class ClosedLoop:
    """One save's closed-loop coding: which tensors are residuals against which bases."""

    def __init__(self, paths: Iterable[str], bases: Mapping[str, Base], tensors: Mapping[str, np.ndarray],
                 keyframe_interval: int) -> None:
        #: the tensors stored closed-loop when the search quantizes them (keyframe or residual)
        self.paths = frozenset(paths)
        self._tensors, self._interval = tensors, keyframe_interval
        #: every closed-loop parent array of the tensors (an unchanged tensor keeps its own,
        #: whatever its chain's depth: nothing is coded)
        self.all_bases = dict(bases)
        #: path -> base, for the tensors stored as residuals (their parent's chain has room)
        #: (a tensor with NaN or inf, now or in its base, gets a keyframe: inf - inf is NaN, so a
        #: residual would turn an inf weight into NaN; a keyframe protects the values as they are)
        self.bases = {p: b for p, b in bases.items() if b.depth + 1 < keyframe_interval
                      and _finite(b.values) and _finite(np.asarray(tensors[p]))}
        self.sources = {p: source_digest(np.asarray(tensors[p], _F32)) for p in bases}
        #: tensors whose true bits are their parent's: the parent's reconstruction is kept
        self.unchanged = {p for p, b in bases.items() if b.source is not None and b.source == self.sources[p]}

    def keyframes(self) -> ClosedLoop:
        """This save with every tensor a keyframe (no residual, no parent's reconstruction
        kept): what the Checkpointer searches when no residual meets the tolerance, because
        the parents' reconstructions (a frozen tensor keeps its keyframe's) used it up."""
        return ClosedLoop(self.paths, {}, self._tensors, self._interval)

    def search_arrays(self, tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """What the search quantizes: each residual tensor's ``W - R_{t-1}``, the rest as they are."""
        out = dict(tensors)
        for path, base in self.bases.items():
            with np.errstate(over="ignore", invalid="ignore"):
                out[path] = np.asarray(tensors[path], _F32) - base.values
        return out

    def plans(self, inner: Mapping[str, ArrayPlan], tensors: Mapping[str, np.ndarray]) -> ClosedLoopPlans:
        """``inner`` (the search's plans, made on :meth:`search_arrays`) as the versions to store."""
        return ClosedLoopPlans(self, inner, tensors)


class ClosedLoopPlans(Mapping[str, ArrayPlan]):
    """Plans whose float32 quantized tensors become closed-loop arrays (others pass through),
    handed to ``repo.save(quantize=...)`` as they are."""

    def __init__(self, loop: ClosedLoop, inner: Mapping[str, ArrayPlan], tensors: Mapping[str, np.ndarray]) -> None:
        self._loop, self._inner, self._tensors = loop, inner, tensors
        self.config = getattr(inner, "config", None)

    def __iter__(self) -> Iterator[str]:
        return iter(self._inner)

    def __len__(self) -> int:
        return len(self._inner)

    def __contains__(self, path: object) -> bool:
        return path in self._inner

    def __getitem__(self, path: str) -> ArrayPlan:
        loop = self._loop
        tensor = self._tensors.get(path)
        if path in loop.unchanged and path in self._inner and tensor is not None \
                and np.asarray(tensor).dtype == _F32:
            # a frozen tensor: the parent's objects, nothing coded, and its plan never read (a
            # streamed plan is then never made: see inshrink_store.policy.streaming)
            kept = loop.all_bases[path]
            return ArrayPlan(kept.values, BytesCodec(), {"coding": CODING, "source": loop.sources[path],
                                                          "unchanged": True},
                             pruned=np.ones(kept.values.shape, bool))
        plan = self._inner[path]
        codec = plan.serializer
        if path not in loop.paths or not isinstance(codec, NUQZarrCodec) or codec.dtype is not None \
                or tensor is None \
                or np.asarray(plan.values).dtype != _F32 or np.asarray(tensor).dtype != _F32:
            return plan  # not a float32 weight: stored as planned
        base = loop.bases.get(path)
        source = loop.sources.get(path) or source_digest(np.asarray(tensor, _F32))
        attributes = {**plan.attributes, "coding": CODING, "source": source}
        q_values = np.asarray(plan.values, _F32)
        values = closed_loop.reconstruct(base.values, q_values) if base is not None else q_values
        q = quantizer(codec.codebook, 0.0, codec.protected_dtype, "float32")
        centres = np.asarray(q.centres, _F32)
        residual = base is not None

        def coder(coords: tuple[int, ...], chunk_shape: tuple[int, ...]) -> ClosedLoopCoding:
            payload = q.encode(chunk_bytes(q_values, chunk_shape, coords).view(_F32))
            return ClosedLoopCoding(closed_loop.encode(payload, centres), residual)

        with np.errstate(over="ignore", invalid="ignore"):
            w = np.asarray(tensor, np.float64)
            norm = float(np.linalg.norm(w))
            error = float(np.linalg.norm(values.astype(np.float64) - w)) / norm if norm > 0 else 0.0
        attributes.update(closed_loop_residual=residual, reconstruction_rel_error=round(error, 8)
                          if np.isfinite(error) else None)
        return ArrayPlan(values, BytesCodec(), attributes,
                         pruned=(q_values == 0) if residual else None, object_coder=coder)

