"""``inshrink.nuq``: non-uniform quantization of a float chunk onto a sorted codebook.
Layer: codecs, storage and structure (siblings, none importing another), above the helpers.

Values equal to a centre take its id; other values take the nearest centre when
within ``tolerance`` and are *protected* otherwise (stored whole, bfloat16 by
default); NaN and ±Inf are always protected. The payload layout is
:mod:`inshrink_store.codecs._payload`; the codebook lives in the codec's
configuration (the array's zarr.json), so the codec is fully described by metadata.
With tolerance 0 (how the policy layer writes) the codec reproduces its input
(-0.0 reads back as the centre 0.0). Decoding then encoding again gives the same
bytes: the codec is a projection. Spec: ``codecs/inshrink.nuq/README.md``.

Speed: encoding works in cache-sized blocks and finds the nearest centre by
counting midpoints below each value (a few vectorised compares beat a binary
search up to ~64 centres); larger codebooks use ``np.searchsorted`` on the midpoints.

GPU: :class:`Quantizer` takes numpy or CuPy arrays (:mod:`inshrink_store.codecs._xp`). On a
device the level assignment is one fused kernel (:mod:`inshrink_store.codecs._gpu`); the
rest is this module's code on CuPy arrays: the rejected elements are found on the device,
settled on the host (they are few: rescue and protection are rare-path numpy code shared
by both), and the payload is assembled on the device, so only ids and protected values
cross to the host. The payload bytes are the same on both (``tests/test_gpu``).
"""

from __future__ import annotations

import asyncio
import functools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numcodecs.abc import Codec
from numcodecs.compat import ensure_contiguous_ndarray, ndarray_copy
from numcodecs.registry import register_codec
from zarr.abc.codec import ArrayBytesCodec
from zarr.core.array_spec import ArraySpec
from zarr.core.buffer import Buffer, NDBuffer
from zarr.registry import register_codec as register_zarr_codec

from inshrink_store import dtypes
from inshrink_store.codecs import _gpu, _payload, _quant_loops
from inshrink_store.codecs._config import check_config, named_configuration
from inshrink_store.codecs._nuq_config import (  # public here: the store, planning and tests read them
    CODEC_ID as CODEC_ID,
)
from inshrink_store.codecs._nuq_config import (
    CONFIG_KEYS,
    check_scaled_centres,
    check_scales,
    config_choice,
    config_codebook,
    config_scales,
    tolerance_from_json,
    tolerance_to_json,
)
from inshrink_store.codecs._nuq_config import (
    MAX_SCALES as MAX_SCALES,
)
from inshrink_store.codecs._nuq_config import (
    short_codebook as short_codebook,
)
from inshrink_store.codecs._xp import array_namespace, like, to_host
from inshrink_store.errors import FormatError

#: element dtypes the codec quantizes: every quantizable entry of the dtype registry
ELEMENT_DTYPES = dtypes.CODEC_NAMES
#: formats a protected value may be stored in (the payload's own table of word formats)
PROTECTED_DTYPES = tuple(_payload.PROTECTED_CODES)
_BLOCK = 1 << 16  # elements per encode block: x, ids and temporaries stay in L2
_COMPARE_LOOP_MAX = 64  # midpoints up to which counting compares beats searchsorted


def midpoints(centres: np.ndarray) -> np.ndarray:
    """float32 midpoints that separate neighbouring float32 centres exactly."""
    c = np.asarray(centres, dtype=np.float32)
    mids = ((c[:-1].astype(np.float64) + c[1:]) / 2).astype(np.float32)
    # a midpoint rounded up onto the upper centre would send that centre to its neighbour
    return np.where(mids >= c[1:], np.nextafter(c[1:], np.float32(-np.inf)), mids).astype(np.float32)


def _nearest_into(x: Any, mids: np.ndarray, out: Any, scratch: Any) -> None:
    """out[i] = number of midpoints strictly below x[i] (NaN -> 0 or len(mids); callers mask it).

    Array-library generic (``x``, ``out`` and ``scratch`` numpy or CuPy; ``mids`` on the host):
    the GPU's fused kernel computes the same count (``_gpu.assign_levels``)."""
    xp = array_namespace(x)
    if len(mids) <= _COMPARE_LOOP_MAX:
        out[...] = 0
        flags = scratch[: x.size]
        for m in mids:
            xp.greater(x, m, out=flags)
            xp.add(out, flags.view(np.uint8), out=out)
    else:
        out[...] = xp.searchsorted(like(mids, xp), x, side="left")


def _id_dtype_for(centres: int) -> np.dtype:
    return np.dtype(np.uint8 if centres <= 255 else np.uint16)


def nearest_index(x: Any, centres: Any) -> Any:
    """Index of the nearest centre for float32 ``x`` (ties to the lower one).

    uint8 for up to 255 centres, else uint16. NaN gets an arbitrary index: mask it. A CuPy
    ``x`` is assigned on its device by the fused kernel and gives a CuPy array.
    """
    xp = array_namespace(x)
    centres = to_host(centres)
    if xp is not np:
        flat = xp.ascontiguousarray(x, dtype=np.float32).reshape(-1)
        return _gpu.nearest_index(flat, midpoints(centres), _id_dtype_for(len(centres)))
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    mids = midpoints(centres)
    out = np.empty(x.size, _id_dtype_for(len(centres)))
    scratch = np.empty(min(x.size, _BLOCK), bool)
    for start in range(0, x.size, _BLOCK):
        _nearest_into(x[start : start + _BLOCK], mids, out[start : start + _BLOCK], scratch)
    return out


def _carrier(dtype: str) -> np.dtype[Any]:
    """The little-endian numpy dtype an element of ``dtype`` travels as (chunks are LE)."""
    return dtypes.by_codec_name(dtype).carrier.newbyteorder("<")


def _element_centres(codebook: tuple[float, ...], dtype: str) -> np.ndarray:
    """Centres as float32 after rounding through the element dtype.

    The float64 codebook goes to the element dtype in one rounding (float64 -> float16
    directly, not through float32: a double rounding could move a centre)."""
    c = np.asarray(codebook, dtype=np.float64)
    with np.errstate(over="ignore"):
        return dtypes.by_codec_name(dtype).round_float32(c)


@dataclass(frozen=True)
class Quantizer:
    """The codec's numerics, shared by the numcodecs and the zarr v3 front ends.

    Build it through :func:`quantizer` (cached): the lookup tables are computed once.
    """

    codebook: tuple[float, ...]
    tolerance: float
    protected_dtype: str
    dtype: str
    #: per-channel scales along the last axis (None: one codebook for every element)
    scales: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.dtype not in ELEMENT_DTYPES:
            raise FormatError(
                f"Expected dtype in {ELEMENT_DTYPES}. Got {self.dtype!r} instead; bfloat16 "
                "arrays are passed as uint16 bit patterns with dtype 'bfloat16'."
            )
        if self.protected_dtype not in _payload.PROTECTED_CODES:
            raise FormatError(
                "Expected protected_dtype 'bfloat16' or 'float32'. "
                f"Got {self.protected_dtype!r} instead."
            )
        k = len(self.codebook)
        if not 1 <= k <= 65534:
            raise FormatError(f"Expected 1..65534 codebook centres. Got {k} instead.")
        centres = _element_centres(self.codebook, self.dtype)
        # compared, not subtracted: the difference of centres near ±3.4e38 overflows float32
        if not np.all(np.isfinite(centres)) or np.any(centres[1:] <= centres[:-1]):
            shown = f"{list(self.codebook)[:8]}{'...' if k > 8 else ''}"
            raise FormatError(
                f"Expected finite, strictly ascending centres, still distinct after rounding to "
                f"{self.dtype}. Got {shown} instead; sort and deduplicate the codebook."
            )
        with np.errstate(over="ignore"):
            tol32 = np.float32(self.tolerance)
        element = dtypes.by_codec_name(self.dtype)
        table = np.zeros(self.levels, dtype=_carrier(self.dtype))
        table[:-1] = element.from_float32(centres)
        for name, value in (("centres", centres), ("mids", midpoints(centres)), ("table", table)):
            value.setflags(write=False)
            object.__setattr__(self, name, value)
        object.__setattr__(self, "tol32", None if np.isinf(tol32) else tol32)
        object.__setattr__(self, "element", element)
        object.__setattr__(self, "protected", dtypes.by_codec_name(self.protected_dtype))
        object.__setattr__(self, "id_dtype", _payload.id_dtype(_payload.id_width_for(self.levels)))
        object.__setattr__(self, "scale32", None if self.scales is None else check_scales(self.scales, self.dtype))
        if self.scale32 is not None:
            check_scaled_centres(centres, self.scale32)

    # lookup tables derived in __post_init__ (not part of the identity)
    centres: np.ndarray = field(init=False, repr=False, compare=False)
    mids: np.ndarray = field(init=False, repr=False, compare=False)
    table: np.ndarray = field(init=False, repr=False, compare=False)
    tol32: np.float32 | None = field(init=False, repr=False, compare=False)
    id_dtype: np.dtype = field(init=False, repr=False, compare=False)
    element: dtypes.DType = field(init=False, repr=False, compare=False)
    protected: dtypes.DType = field(init=False, repr=False, compare=False)
    scale32: np.ndarray | None = field(init=False, repr=False, compare=False)

    @property
    def levels(self) -> int:
        return len(self.codebook) + 1

    def values_of(self, carrier: np.ndarray) -> np.ndarray:
        """Element carrier (float32, float16, uint16 bfloat16 bits) -> float32 values."""
        return self.element.to_float32(carrier)

    # -- encode -----------------------------------------------------------------------

    def encode(self, carrier: Any) -> bytes:
        """The payload of a carrier array (numpy, or CuPy: computed on its device)."""
        return to_host(self.encode_array(carrier)).tobytes()

    def encode_array(self, carrier: Any) -> Any:
        """The payload as a uint8 array in the carrier's library: on a GPU it stays on the
        device (a zarr GPU buffer), only protected values having crossed to the host."""
        flat = carrier.reshape(-1)
        if self.scale32 is not None:
            # the scaled variant runs on the host (same bytes; its payload goes back to the
            # caller's library)
            return like(self._encode_scaled(to_host(flat)), array_namespace(flat))
        ids, ok = self._assign(flat)
        return self._finish(flat, ids, ok)

    # -- the channel-scaled variant (``scales``) ----------------------------------------

    def _rows(self, size: int) -> int:
        """Rows of a chunk of ``size`` elements: whole rows of ``len(scales)`` elements."""
        assert self.scale32 is not None
        width = self.scale32.size
        if size % width:
            raise FormatError(
                f"Expected whole rows of {width} elements (one per scale) in an {CODEC_ID} chunk with "
                f"scales. Got {size} elements instead: the chunk splits the array's last axis, or the "
                "scales do not belong to this array."
            )
        return size // width

    def scaled_centres(self, ids: np.ndarray, columns: np.ndarray) -> np.ndarray:
        """float32 ``centres[ids] * scales[columns]``: what a scaled level id decodes to (one
        IEEE float32 multiply, so numpy and a GPU give the same bits)."""
        assert self.scale32 is not None
        with np.errstate(over="ignore"):
            out: np.ndarray = np.multiply(self.centres.take(ids), self.scale32.take(columns), dtype=np.float32)
        return out

    def _encode_scaled(self, flat: np.ndarray) -> np.ndarray:
        """Scaled encode: each value divided by its column's scale takes the nearest centre,
        and keeps that id when ``centre * scale`` is within tolerance of the value (exactly
        equal at tolerance 0); a neighbouring centre is tried before protecting it, so a
        decoded chunk encodes to the same bytes (division and multiplication may each round)."""
        assert self.scale32 is not None
        x = self.values_of(flat)
        rows = self._rows(x.size)
        columns = np.tile(np.arange(self.scale32.size, dtype=np.intp), rows)
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            u = (x.reshape(rows, self.scale32.size) / self.scale32).reshape(-1)
        ids = nearest_index(u, self.centres).astype(self.id_dtype, copy=False)
        ok = self._scaled_ok(x, ids, columns)
        for step in (-1, 1):  # the other side of a midpoint the division rounded across
            miss = np.flatnonzero(~ok & np.isfinite(x))
            if not miss.size:
                break
            other = np.clip(ids[miss].astype(np.int64) + step, 0, self.centres.size - 1).astype(self.id_dtype)
            hit = self._scaled_ok(x[miss], other, columns[miss])
            ids[miss[hit]], ok[miss[hit]] = other[hit], True
        rejected = np.flatnonzero(~ok)
        words = self._protect(flat[rejected])
        if rejected.size and self.tol32 is not None:
            # a value stored protected that reads back on a scaled centre takes its id
            stored = self._stored_values(words)
            cols = columns[rejected]
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                near = nearest_index(stored / self.scale32.take(cols), self.centres).astype(self.id_dtype)
            back = np.isfinite(stored) & self._scaled_ok(stored, near, cols)
            ids[rejected[back]] = near[back]
            rejected, words = rejected[~back], words[~back]
        ids[rejected] = self.levels - 1
        payload: np.ndarray = _payload.assemble(self.levels, ids, self.protected_dtype, words)
        return payload

    def _scaled_ok(self, x: np.ndarray, ids: np.ndarray, columns: np.ndarray) -> np.ndarray:
        """Whether each finite x may take the scaled centre of ``ids`` (tolerance, float32)."""
        near = self.scaled_centres(ids, columns)
        ok: np.ndarray
        if self.tol32 is None:
            ok = np.isfinite(x) & np.isfinite(near)
        elif self.tol32 == 0:
            ok = np.isfinite(x) & (x == near)
        else:
            with np.errstate(invalid="ignore", over="ignore"):
                ok = np.isfinite(x) & (np.abs(x - near) <= self.tol32)
        return ok

    def _assign(self, flat: Any) -> tuple[Any, Any]:
        """Each element's nearest centre and whether it may take it (the bulk of the work):
        cache-sized numpy blocks on the host, one fused kernel on a device."""
        if array_namespace(flat) is not np:
            return _gpu.assign_levels(flat, self.dtype, self.mids, self.centres, self.tol32,
                                      self.id_dtype)
        ids = np.empty(flat.size, self.id_dtype)
        ok = np.empty(flat.size, bool)
        scratch = np.empty(min(flat.size, _BLOCK), bool)
        for start in range(0, flat.size, _BLOCK):
            x = self.values_of(flat[start : start + _BLOCK])
            _nearest_into(x, self.mids, ids[start : start + _BLOCK], scratch)
            self._accept(x, ids[start : start + _BLOCK], ok[start : start + _BLOCK])
        return ids, ok

    def _finish(self, flat: Any, ids: Any, ok: Any) -> Any:
        """Settle the rejected elements, patch their ids, assemble the payload (in the
        library of ``flat``; only the rejected elements visit the host)."""
        xp = array_namespace(flat)
        rejected = xp.flatnonzero(~ok)
        settled, words = self._settle(to_host(flat[rejected]))
        if settled.size:
            ids[rejected] = like(settled, xp)
        return _payload.assemble(self.levels, ids, self.protected_dtype, words)

    def _settle(self, carriers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rejected elements (host, element order) -> their final ids (a rescued centre, or
        the protected id B - 1) and the protected words of those left protected."""
        ids = np.full(carriers.size, self.levels - 1, self.id_dtype)
        if carriers.size and self.tol32 is not None:
            self._rescue(carriers, ids)
        return ids, self._protect(carriers[ids == self.levels - 1])

    def _accept(self, x: np.ndarray, idx: np.ndarray, ok: np.ndarray) -> None:
        """ok = x may take the id of its nearest centre ``idx``."""
        if self.tol32 is None:
            np.isfinite(x, out=ok)
            return
        near = self.centres.take(idx)
        if self.tol32 == 0:
            np.equal(x, near, out=ok)
            return
        with np.errstate(invalid="ignore", over="ignore"):
            np.subtract(x, near, out=near)
            np.abs(near, out=near)
        np.less_equal(near, self.tol32, out=ok)  # inf and NaN differences fail here

    def _rescue(self, carriers: np.ndarray, ids: np.ndarray) -> None:
        """Quantize a rejected finite value when the value it would be stored as is within
        tolerance of a centre: decoding then re-encoding must give the same bytes."""
        finite = np.flatnonzero(np.isfinite(self.values_of(carriers)))
        if not finite.size:
            return
        stored = self._stored_values(self._protect(carriers[finite]))
        idx = nearest_index(stored, self.centres).astype(self.id_dtype, copy=False)
        accept = np.empty(stored.size, bool)
        self._accept(stored, idx, accept)
        ids[finite[accept]] = idx[accept]

    def _protect(self, carrier: np.ndarray) -> np.ndarray:
        """Protected words for these elements: float32, or bfloat16 rounded to nearest with
        finite values kept finite (rounded toward zero where nearest would overflow).

        Words of the element's own dtype are its bits unchanged, so NaN payloads survive."""
        word = _payload.protected_word(self.protected_dtype)
        if self.protected_dtype == self.dtype:
            return carrier.astype(word)
        values = self.values_of(carrier)
        words = np.asarray(self.protected.from_float32(values)).astype(word, copy=False)
        if word.itemsize >= 4:  # float32 words hold every element value exactly
            return words
        overflow = np.isfinite(values) & ~np.isfinite(self._stored_values(words))
        # bit-pattern words are sign-magnitude: one step toward zero is the largest that fits
        words[overflow] -= word.type(1)
        return words

    def _stored_values(self, words: np.ndarray) -> np.ndarray:
        """float32 values that protected words decode to (in the element dtype's precision)."""
        return self.values_of(self._unprotect(words, self.protected_dtype))

    def protected_values(self, carrier: np.ndarray) -> np.ndarray:
        """float32 values these elements read back as when stored protected: finite ones stay
        finite (:meth:`_protect`'s step toward zero where bfloat16 rounding overflows).

        Why public: the policy layer plans protected values as the codec will store them, so
        its tolerance-0 encode stores them exactly; rounding them apart (to nearest, without
        the step) once planned ``inf`` for finite values near a dtype's largest."""
        return self._stored_values(self._protect(carrier))

    # -- decode -----------------------------------------------------------------------

    def decode(self, data: Any) -> Any:
        """Payload -> flat array of the element carrier dtype, in the library of ``data``
        (bytes and numpy arrays decode on the host, a CuPy array on its device)."""
        payload = _payload.unpack(data)
        if payload.levels != self.levels:
            raise FormatError(
                f"Expected a payload with {self.levels} levels (codebook of {len(self.codebook)} "
                f"centres + protected). Got {payload.levels} instead: the codec configuration "
                "does not belong to this chunk."
            )
        xp = array_namespace(payload.ids)
        loops = _quant_loops.for_bytes(int(payload.ids.size)) if xp is np and self.scale32 is None else None
        if loops is not None:  # one pass: each id's value, the protected ones in order
            out = np.empty(payload.ids.size, self.table.dtype)
            words = self._unprotect(payload.protected, payload.protected_dtype) if payload.protected.size \
                else self.table[:0]
            bits = np.dtype(f"u{out.itemsize}")  # values copied as bit patterns (NaN payloads, float16)
            loops.decode_ids(np.ascontiguousarray(payload.ids), self.table.view(bits), self.levels - 1,
                             np.ascontiguousarray(words).view(bits), out.view(bits))
            return out
        out = like(self.table, xp).take(payload.ids)
        if self.scale32 is not None:
            rows = self._rows(int(payload.ids.size))
            out = (out.reshape(rows, self.scale32.size) * like(self.scale32, xp)).reshape(-1)
        if payload.protected.size:
            out[payload.ids == self.levels - 1] = like(
                self._unprotect(payload.protected, payload.protected_dtype), xp
            )
        return out

    def _unprotect(self, words: np.ndarray, protected_dtype: str) -> np.ndarray:
        """Protected words -> element carrier: verbatim when the dtypes agree (NaN payloads
        kept), else widened exactly to float32 and rounded to nearest in the element dtype."""
        carrier = _carrier(self.dtype)
        if protected_dtype == self.dtype:
            return words.astype(carrier)
        values = dtypes.by_codec_name(protected_dtype).to_float32(words)
        with np.errstate(over="ignore"):
            return np.asarray(self.element.from_float32(values)).astype(carrier, copy=False)


@functools.lru_cache(maxsize=128)
def quantizer(codebook: tuple[float, ...], tolerance: float, protected_dtype: str,
              dtype: str, scales: tuple[float, ...] | None = None) -> Quantizer:
    """A validated, cached :class:`Quantizer` (FormatError for an invalid configuration)."""
    return Quantizer(codebook, tolerance, protected_dtype, dtype, scales)




def protected_values(values: np.ndarray, dtype: str, protected_dtype: str) -> np.ndarray:
    """float32 ``values`` of element ``dtype`` (its codec name) as the codec stores them
    protected in ``protected_dtype``: rounded to nearest, finite values kept finite.

    The words do not depend on the codebook, so any valid one does (a cached quantizer)."""
    q = quantizer((0.0,), 0.0, protected_dtype, dtype)
    with np.errstate(over="ignore"):
        carrier = np.asarray(q.element.from_float32(np.asarray(values, np.float32)))
    return q.protected_values(carrier.astype(_carrier(dtype), copy=False))


class NUQ(Codec):  # type: ignore[misc]  # numcodecs ships no types: its Codec is Any
    """numcodecs front end. Arrays of ``dtype`` bfloat16 are passed as uint16 bit patterns.

    ``tolerance`` is a number >= 0 or ``"inf"`` (JSON has no infinity; ``math.inf`` is
    accepted and written back as ``"inf"``).
    """

    codec_id = CODEC_ID

    def __init__(self, codebook: list[float] | tuple[float, ...], tolerance: float | str = 0.0,
                 protected_dtype: str = "bfloat16", dtype: str = "float32",
                 scales: list[float] | tuple[float, ...] | None = None) -> None:
        self.codebook = list(config_codebook(codebook))
        self.tolerance = tolerance_from_json(tolerance)
        self.protected_dtype = config_choice(protected_dtype, "protected_dtype", PROTECTED_DTYPES)
        self.dtype = config_choice(dtype, "dtype", ELEMENT_DTYPES)
        scaled = config_scales(scales)
        self.scales = None if scaled is None else list(scaled)
        self._q = quantizer(tuple(self.codebook), self.tolerance, protected_dtype, dtype, scaled)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> NUQ:
        """Build from ``get_config()`` output; an unknown key is a FormatError naming it."""
        kwargs = check_config(config, ("id", *CONFIG_KEYS), CODEC_ID)
        kwargs.pop("id", None)
        if "codebook" not in kwargs:
            raise FormatError(f"Expected a codebook in the {CODEC_ID} configuration. Got none instead.")
        return cls(**kwargs)

    def get_config(self) -> dict[str, Any]:
        config = {"id": CODEC_ID, "codebook": list(self.codebook),
                  "tolerance": tolerance_to_json(self.tolerance),
                  "protected_dtype": self.protected_dtype, "dtype": self.dtype}
        if self.scales is not None:
            config["scales"] = list(self.scales)
        return config

    def __repr__(self) -> str:
        return (f"NUQ(levels={len(self.codebook)}, tolerance={self.tolerance}, "
                f"protected_dtype={self.protected_dtype!r}, dtype={self.dtype!r})")

    def encode(self, buf: Any) -> bytes:
        if self.scales is not None and isinstance(buf, np.ndarray):
            buf = np.ascontiguousarray(buf)  # columns are the last axis in C order, not memory order
        arr = ensure_contiguous_ndarray(buf)
        carrier = _carrier(self.dtype)
        if arr.dtype != carrier:
            if arr.dtype.kind == "f":
                bits = f" to {carrier.name} {self.dtype} bits" if carrier.kind != "f" else ""
                raise FormatError(
                    f"Expected {self.dtype} values. Got a {arr.dtype.name} ({arr.dtype.str}) array "
                    f"instead; cast it first{bits}."
                )
            if arr.nbytes % carrier.itemsize:
                raise FormatError(
                    f"Expected a whole number of {carrier.itemsize}-byte {self.dtype} elements. "
                    f"Got {arr.nbytes} bytes instead."
                )
            arr = arr.reshape(-1).view(carrier)
        return self._q.encode(arr)

    def decode(self, buf: Any, out: Any = None) -> np.ndarray:
        values: np.ndarray = self._q.decode(ensure_contiguous_ndarray(buf))  # numpy in, numpy out
        if out is None:
            return values
        out_arr = ensure_contiguous_ndarray(out)
        if out_arr.nbytes != values.nbytes:
            raise FormatError(
                f"Expected an output buffer of {values.nbytes} bytes ({values.size} elements). "
                f"Got {out_arr.nbytes} bytes instead."
            )
        copied: np.ndarray = ndarray_copy(values, out)  # numcodecs ships no types
        return copied


register_codec(NUQ)


# -- zarr v3 front end -------------------------------------------------------------------


def _element_name(dtype: Any, configured: str | None) -> str:
    """The element dtype for a zarr array dtype (a ZDType) and the configured ``dtype``.

    A float array names its own dtype; an array of bit patterns (bfloat16 as uint16) must
    have its dtype configured, since uint16 alone is also a plain integer."""
    native = np.dtype(dtype.to_native_dtype())
    for entry in dtypes.REGISTRY.values():
        if entry.codec_name is None or entry.carrier != native:
            continue
        if configured == entry.codec_name or (configured is None and not entry.carried_as_bits):
            return entry.codec_name
    raise FormatError(
        "Expected a float32 or float16 array, or a uint16 array with \"dtype\": \"bfloat16\" in "
        f"the inshrink.nuq configuration. Got a {native} array with dtype={configured!r} instead."
    )


@dataclass(frozen=True)
class NUQZarrCodec(ArrayBytesCodec):
    """zarr v3 ``ArrayBytesCodec`` named ``inshrink.nuq``; the chunk's float dtype comes from the
    array (float32, float16), or ``dtype: "bfloat16"`` in the configuration for uint16 arrays."""

    is_fixed_size = False

    codebook: tuple[float, ...]
    tolerance: float = 0.0
    protected_dtype: str = "bfloat16"
    dtype: str | None = None
    scales: tuple[float, ...] | None = None

    def __init__(self, *, codebook: Any, tolerance: Any = 0.0, protected_dtype: str = "bfloat16",
                 dtype: str | None = None, scales: Any = None) -> None:
        object.__setattr__(self, "codebook", config_codebook(codebook))
        object.__setattr__(self, "tolerance", tolerance_from_json(tolerance))
        object.__setattr__(self, "protected_dtype",
                           config_choice(protected_dtype, "protected_dtype", PROTECTED_DTYPES))
        object.__setattr__(self, "dtype", config_choice(dtype, "dtype", ELEMENT_DTYPES, none_ok=True))
        object.__setattr__(self, "scales", config_scales(scales))
        quantizer(self.codebook, self.tolerance, protected_dtype, dtype or "float32", self.scales)  # validates

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NUQZarrCodec:
        """Build from zarr.json; an unknown configuration key is a FormatError naming it."""
        config = named_configuration(data, CODEC_ID)
        kwargs = check_config(config, CONFIG_KEYS, CODEC_ID)
        if "codebook" not in kwargs:
            raise FormatError(f"Expected a codebook in the {CODEC_ID} configuration. Got none instead.")
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        config: dict[str, Any] = {"codebook": list(self.codebook),
                                  "tolerance": tolerance_to_json(self.tolerance),
                                  "protected_dtype": self.protected_dtype}
        if self.dtype is not None:
            config["dtype"] = self.dtype
        if self.scales is not None:
            config["scales"] = list(self.scales)
        return {"name": CODEC_ID, "configuration": config}

    def validate(self, *, shape: Any, dtype: Any, chunk_grid: Any) -> None:
        element = _element_name(dtype, self.dtype)
        if self.scales is None:
            return
        quantizer(self.codebook, self.tolerance, self.protected_dtype, element, self.scales)  # float32 only
        chunks = getattr(chunk_grid, "chunk_shape", None)
        if len(shape) < 1 or shape[-1] != len(self.scales) or (chunks is not None and chunks[-1] != shape[-1]):
            raise FormatError(
                f"Expected an array whose last axis has one element per scale ({len(self.scales)}) and "
                f"chunks that keep that axis whole, for {CODEC_ID} with scales. Got shape {tuple(shape)} "
                f"and chunks {None if chunks is None else tuple(chunks)} instead."
            )

    def _quantizer(self, chunk_spec: ArraySpec) -> Quantizer:
        element = _element_name(chunk_spec.dtype, self.dtype)
        return quantizer(self.codebook, self.tolerance, self.protected_dtype, element, self.scales)

    async def _decode_single(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> NDBuffer:
        # on a worker thread, as zarr's Blosc codec does: numpy releases the GIL, so the
        # chunks of one read decode in parallel instead of one by one on zarr's event loop
        return await asyncio.to_thread(self._decode_sync, chunk_bytes, chunk_spec)

    async def _encode_single(self, chunk_array: NDBuffer, chunk_spec: ArraySpec) -> Buffer | None:
        return await asyncio.to_thread(self._encode_sync, chunk_array, chunk_spec)

    def _decode_sync(self, chunk_bytes: Buffer, chunk_spec: ArraySpec) -> NDBuffer:
        # as_array_like: a device array under zarr.config.enable_gpu(), decoded on the device
        values = self._quantizer(chunk_spec).decode(chunk_bytes.as_array_like())
        expected = math.prod(chunk_spec.shape)
        if values.size != expected:
            raise FormatError(
                f"Expected {expected} elements in a chunk of shape {chunk_spec.shape}. "
                f"Got {values.size} instead."
            )
        native = np.dtype(chunk_spec.dtype.to_native_dtype())
        return chunk_spec.prototype.nd_buffer.from_ndarray_like(
            values.view(native).reshape(chunk_spec.shape)
        )

    def _encode_sync(self, chunk_array: NDBuffer, chunk_spec: ArraySpec) -> Buffer:
        q = self._quantizer(chunk_spec)
        array = chunk_array.as_ndarray_like()  # a device array under zarr.config.enable_gpu()
        xp = array_namespace(array)
        carrier = xp.ascontiguousarray(array).view(_carrier(q.dtype))
        return chunk_spec.prototype.buffer.from_array_like(q.encode_array(carrier))

    def compute_encoded_size(self, input_byte_length: int, chunk_spec: ArraySpec) -> int:
        raise NotImplementedError("inshrink.nuq payloads are variable-size")


register_zarr_codec(CODEC_ID, NUQZarrCodec)
