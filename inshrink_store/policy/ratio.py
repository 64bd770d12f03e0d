"""How many bytes a state's tensors take in the store: the one ratio estimate the search uses.

The search ranks candidate configurations by measured compression ratio, so the
measurement encodes each tensor the way the store does:

- a lossless tensor with the writer's own codec settings
  (:func:`inshrink_store.writer.lossless_codecs`: Blosc zstd with byte shuffle), chunk by
  chunk on the writer's chunk grid (edge chunks padded with the fill value, as zarr writes
  them); the store keeps those chunk objects as they are;
- a quantized tensor as its ``inshrink.nuq`` payload compressed with zstd at the object
  store's level (:data:`inshrink_store.cas.ZSTD_LEVEL`), encoded whole. A tensor of more
  than one chunk (over 1 Mi float32 elements) costs the store a few hundred more bytes
  per chunk; the whole-tensor payload keeps every candidate measured alike, which is all
  the ranking needs.

Not counted: object headers, zarr.json documents and deltas against the parent version
(a search measures keyframes). Lossless sizes do not depend on the configuration, so they
are measured once per state and shared by every candidate.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from itertools import product

import numcodecs
import numpy as np
import zstandard

from inshrink_store.cas import ZSTD_LEVEL
from inshrink_store.codecs.nuq import NUQ, NUQZarrCodec
from inshrink_store.errors import FormatError
from inshrink_store.writer import ArrayPlan, default_chunks, lossless_codecs

_SHUFFLE = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}


def _blosc(array: np.ndarray) -> numcodecs.Blosc:
    """The numcodecs Blosc that zarr runs for the writer's lossless codec of ``array``."""
    (codec,) = lossless_codecs(array)["compressors"]
    config = codec.to_dict()["configuration"]
    return numcodecs.Blosc(cname=config["cname"], clevel=config["clevel"],
                           shuffle=_SHUFFLE[config["shuffle"]], blocksize=config.get("blocksize", 0),
                           typesize=config["typesize"])


def _chunks(array: np.ndarray) -> Iterable[np.ndarray]:
    """The array's chunks on the writer's grid, edge chunks padded with 0 (the fill value)."""
    shape = default_chunks(array.shape, array.dtype.itemsize)
    grid = [range(0, max(n, 1), c) for n, c in zip(array.shape, shape, strict=True)]
    for corner in product(*grid):
        part = array[tuple(slice(s, s + c) for s, c in zip(corner, shape, strict=True))]
        if part.shape != shape:
            padded = np.zeros(shape, array.dtype)
            padded[tuple(slice(0, n) for n in part.shape)] = part
            part = padded
        yield part


def lossless_bytes(array: np.ndarray) -> int:
    """Bytes the writer's lossless chunks of ``array`` take (nothing for an empty array)."""
    if array.size == 0:
        return 0
    blosc = _blosc(array)
    little = array.dtype.newbyteorder("<")  # zarr's bytes codec writes little-endian
    return sum(len(blosc.encode(np.ascontiguousarray(chunk, little).tobytes())) for chunk in _chunks(array))


def quantized_bytes(plan: ArrayPlan) -> int:
    """Bytes the object store keeps for a quantized plan: its nuq payload, zstd-compressed."""
    codec = plan.serializer
    if not isinstance(codec, NUQZarrCodec):
        raise FormatError(
            f"Expected a quantized plan with an inshrink.nuq serializer. Got {type(codec).__name__} "
            "instead; measure lossless tensors with lossless_bytes()."
        )
    payload = NUQ(codec.codebook, codec.tolerance, codec.protected_dtype,
                  codec.dtype or str(plan.values.dtype)).encode(plan.values)
    return len(zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(payload))


class RatioEstimator:
    """Logical / stored bytes of the tensors under ``scope``, for any set of plans.

    ``tensors`` are the carried arrays of one state (bfloat16 as uint16 bits). Lossless
    sizes are measured on first use and kept: they are the same for every candidate.
    """

    def __init__(self, tensors: Mapping[str, np.ndarray], scope: str = "model/") -> None:
        self.tensors = tensors
        self.paths = [p for p in tensors if p.startswith(scope)]
        self.logical_bytes = sum(tensors[p].nbytes for p in self.paths)
        self._lossless: dict[str, int] = {}

    def stored_bytes(self, plans: Mapping[str, ArrayPlan]) -> int:
        """Bytes the store would keep for these tensors, those in ``plans`` quantized."""
        return sum(quantized_bytes(plans[p]) if p in plans else self._lossless_bytes(p) for p in self.paths)

    def ratio(self, plans: Mapping[str, ArrayPlan]) -> float:
        """Logical / stored bytes (see :func:`ratio_of`)."""
        return ratio_of(self.logical_bytes, self.stored_bytes(plans))

    def _lossless_bytes(self, path: str) -> int:
        if path not in self._lossless:
            self._lossless[path] = lossless_bytes(self.tensors[path])
        return self._lossless[path]


def ratio_of(logical_bytes: int, stored_bytes: int) -> float:
    """Logical / stored bytes, stored counted as at least one (an empty scope is 0.0, not a crash)."""
    return logical_bytes / max(stored_bytes, 1)


