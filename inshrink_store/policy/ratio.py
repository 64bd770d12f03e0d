"""How many bytes a state's tensors take in the store, measured by encoding them.
Layer: refs, history and policy (the policy imports neither sibling), below ``parts``.

The search ranks candidate configurations by ratios estimated without encoding
(:mod:`inshrink_store.policy.estimate`); this module is the measurement that the
estimate is checked against, the bytes of the tensors a search leaves lossless, and the
ratio of a planner used on its own. It encodes each tensor the way the store does:

- a lossless tensor by writing it the writer's own way (:func:`inshrink_store.writer.create_array`
  with :func:`inshrink_store.writer.lossless_codecs`: raw bits for float32, float16 and
  bfloat16, Blosc zstd + shuffle otherwise) into a zarr memory store, each chunk then
  coded as the object store codes a keyframe of it (:func:`inshrink_store.object_format.keyframe_body`:
  ``inshrink.bytegroup`` planes for raw floats): same codecs, chunk grid and padded edge
  chunks, so a change to the writer's codec choice changes the estimate with it;
- a quantized tensor as its ``inshrink.nuq`` payload coded the way the object store codes a
  keyframe (:func:`inshrink_store.object_format.keyframe_body`: zstd, with ids two per byte when that
  is smaller), encoded whole. A tensor of more
  than one chunk (over 1 Mi float32 elements) costs the store a few hundred more bytes
  per chunk; the whole-tensor payload keeps every candidate measured alike, which is all
  the ranking needs.

Not counted: object headers, zarr.json documents and deltas against the parent version
(a search measures keyframes). Lossless sizes do not depend on the configuration, so they
are measured once per state and shared by every candidate.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import zarr
from zarr.core.buffer import Buffer

from inshrink_store import dtypes
from inshrink_store.codecs.nuq import NUQ, NUQZarrCodec
from inshrink_store.errors import FormatError
from inshrink_store.index import METADATA_KEY
from inshrink_store.object_format import ELEMENTS, keyframe_body
from inshrink_store.plans import ArrayPlan
from inshrink_store.writer import create_array, lossless_codecs


def lossless_bytes(array: np.ndarray, dtype: str | None = None) -> int:
    """Bytes the writer's lossless chunks of ``array`` take (nothing for an empty array).

    ``dtype`` is the logical dtype (``"BF16"`` for uint16 bfloat16 bits; inferred when None)."""
    if array.size == 0:
        return 0
    written: dict[str, Buffer] = {}
    create_array(zarr.storage.MemoryStore(written), None, array, lossless_codecs(array, dtype))
    codec_name = dtypes.of_array(array, dtype).codec_name
    element = codec_name if codec_name in ELEMENTS and lossless_codecs(array, dtype)["compressors"] is None else None
    return sum(len(keyframe_body(value.to_bytes(), element)[1])
               for key, value in written.items() if not key.endswith(METADATA_KEY))


def quantized_bytes(plan: ArrayPlan) -> int:
    """Bytes the object store keeps for a quantized plan: its nuq payload, coded as a keyframe."""
    codec = plan.serializer
    if not isinstance(codec, NUQZarrCodec):
        raise FormatError(
            f"Expected a quantized plan with an inshrink.nuq serializer. Got {type(codec).__name__} "
            "instead; measure lossless tensors with lossless_bytes()."
        )
    payload = NUQ(codec.codebook, codec.tolerance, codec.protected_dtype,
                  codec.dtype or str(plan.values.dtype)).encode(plan.values)
    return len(keyframe_body(payload)[1])


class RatioEstimator:
    """Logical / stored bytes of the tensors under ``scope``, for any set of plans.

    ``tensors`` are the carried arrays of one state (bfloat16 as uint16 bits) and ``dtypes``
    their logical dtypes where the array cannot say (``"BF16"``). Lossless sizes are
    measured on first use and kept: they are the same for every candidate.
    """

    def __init__(self, tensors: Mapping[str, np.ndarray], scope: str = "model/",
                 dtypes: Mapping[str, str] | None = None) -> None:
        self.tensors = tensors
        self.dtypes: Mapping[str, str] = dtypes or {}
        self.paths = [p for p in tensors if p.startswith(scope)]
        self.logical_bytes = sum(tensors[p].nbytes for p in self.paths)
        self._lossless: dict[str, int] = {}

    def stored_bytes(self, plans: Mapping[str, ArrayPlan]) -> int:
        """Bytes the store would keep for these tensors, those in ``plans`` quantized."""
        return sum(quantized_bytes(plans[p]) if p in plans else self._lossless_bytes(p) for p in self.paths)

    def ratio(self, plans: Mapping[str, ArrayPlan]) -> float:
        """Logical / stored bytes (see :func:`ratio_of`)."""
        return ratio_of(self.logical_bytes, self.stored_bytes(plans))

    def lossless_bytes_of(self, path: str) -> int:
        """Bytes the writer's lossless chunks of one tensor take (measured once, then kept)."""
        return self._lossless_bytes(path)

    def _lossless_bytes(self, path: str) -> int:
        if path not in self._lossless:
            self._lossless[path] = lossless_bytes(self.tensors[path], self.dtypes.get(path))
        return self._lossless[path]


def ratio_of(logical_bytes: int, stored_bytes: int) -> float:
    """Logical / stored bytes, stored counted as at least one (an empty scope is 0.0, not a crash)."""
    return logical_bytes / max(stored_bytes, 1)


