"""The one dtype registry: every logical dtype the store knows, how zarr carries it, and how
it widens to and narrows from float32 (numpy only, so every layer may import it).

A *logical* dtype is what the tensor is (safetensors spelling: ``F32``, ``BF16``, ...); its
*carrier* is the numpy dtype that holds its bits in a zarr array. They differ only where
zarr v3 has no such type: bfloat16 travels as uint16 bit patterns. Adding a dtype (say a
float8) is one :class:`DType` entry here (plus its widen/narrow functions) and its tests;
the torch mapping lives beside the torch code (``inshrink_store.torch.tensors``).

bfloat16 is the upper half of a float32, so both directions are bit operations.
float32 -> bfloat16 rounds to nearest, ties to even (finite values past the largest
bfloat16 become infinite, as in IEEE and torch). NaN stays NaN with its sign and top
payload bits (torch canonicalises every NaN to 0x7FC0; keeping the bits lets a bfloat16
NaN survive a trip through float32 unchanged); the quiet bit is set only when the kept
bits alone would read as infinity. bfloat16 -> float32 is exact.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from inshrink_store.errors import InvalidInputError

_MANTISSA = np.uint16(0x007F)
_QUIET = np.uint16(0x0040)


def bf16_to_float32(bits: ArrayLike) -> np.ndarray:
    """uint16 bfloat16 bit patterns -> float32 values (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def float32_to_bf16(values: ArrayLike) -> np.ndarray:
    """float32 values -> uint16 bfloat16 bit patterns of the same shape, round-to-nearest-even."""
    f = np.asarray(values, dtype=np.float32)
    u = np.ascontiguousarray(f).view(np.uint32).reshape(-1)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if nan.any():
        top = (u[nan] >> 16).astype(np.uint16)
        top[(top & _MANTISSA) == 0] |= _QUIET  # payload only in the dropped bits: keep it a NaN
        rounded[nan] = top
    return rounded.reshape(f.shape)


def round_bf16(values: ArrayLike) -> np.ndarray:
    """float32 values rounded to bfloat16 precision, returned as float32."""
    return bf16_to_float32(float32_to_bf16(values))


def _cast(to: str) -> Callable[[ArrayLike], np.ndarray]:
    return lambda values: np.asarray(values).astype(to, copy=False)


@dataclass(frozen=True)
class DType:
    """One logical dtype.

    ``codec_name`` is the element dtype the ``inshrink.nuq`` codec calls it (``float32``,
    ``float16``, ``bfloat16``); None means the dtype is never quantized.
    """

    name: str
    carrier: np.dtype
    kind: str  # "float" | "int" | "uint" | "bool"
    codec_name: str | None = None
    widen: Callable[[ArrayLike], np.ndarray] = _cast("float32")
    narrow: Callable[[ArrayLike], np.ndarray] | None = None

    @property
    def is_float(self) -> bool:
        return self.kind == "float"

    @property
    def quantizable(self) -> bool:
        return self.codec_name is not None

    @property
    def carried_as_bits(self) -> bool:
        """A float dtype zarr cannot hold, so its carrier is an integer holding its bit patterns
        (bfloat16 as uint16): such arrays must be widened, never cast, to read their values."""
        return self.is_float and self.carrier.kind != "f"

    def to_float32(self, carried: ArrayLike) -> np.ndarray:
        """The carried array as float32 values (bfloat16 bits widened exactly)."""
        return np.asarray(self.widen(carried), dtype=np.float32)

    def from_float32(self, values: ArrayLike) -> np.ndarray:
        """float32 values narrowed to this dtype's carrier (rounded to nearest)."""
        narrow = self.narrow or _cast(self.carrier.name)
        return np.asarray(narrow(values))

    def round_float32(self, values: ArrayLike) -> np.ndarray:
        """float32 values rounded through this dtype, returned as float32."""
        return self.to_float32(self.from_float32(values))


REGISTRY: dict[str, DType] = {
    d.name: d for d in (
        DType("F64", np.dtype("float64"), "float", None),
        DType("F32", np.dtype("float32"), "float", "float32"),
        DType("F16", np.dtype("float16"), "float", "float16"),
        DType("BF16", np.dtype("uint16"), "float", "bfloat16", widen=bf16_to_float32, narrow=float32_to_bf16),
        DType("I64", np.dtype("int64"), "int"),
        DType("I32", np.dtype("int32"), "int"),
        DType("I16", np.dtype("int16"), "int"),
        DType("I8", np.dtype("int8"), "int"),
        DType("U64", np.dtype("uint64"), "uint"),
        DType("U32", np.dtype("uint32"), "uint"),
        DType("U16", np.dtype("uint16"), "uint"),
        DType("U8", np.dtype("uint8"), "uint"),
        DType("BOOL", np.dtype("bool"), "bool"),
    )
}


def _by_carrier(dtype: np.dtype) -> DType | None:
    """The logical dtype an undeclared array of numpy ``dtype`` is. Looked up in
    :data:`REGISTRY` on each call (13 entries), so adding an entry is all it takes; a dtype
    carried as bits (BF16) is never inferred: its carrier is also a plain integer."""
    return next((d for d in REGISTRY.values() if d.carrier == dtype and not d.carried_as_bits), None)


def _codec_names() -> dict[str, DType]:
    return {d.codec_name: d for d in REGISTRY.values() if d.codec_name is not None}


FLOAT_NAMES = tuple(n for n, d in REGISTRY.items() if d.is_float)
QUANTIZABLE_NAMES = tuple(n for n, d in REGISTRY.items() if d.quantizable)
#: what the nuq codec calls the quantizable dtypes, in registry order ("float32", "float16", ...)
CODEC_NAMES = tuple(d.codec_name for d in REGISTRY.values() if d.codec_name is not None)


def get(name: str, where: str = "") -> DType:
    """The registry entry for a logical dtype name; FormatError naming ``where`` otherwise."""
    found = REGISTRY.get(name) if isinstance(name, str) else None
    if found is None:
        at = f" for {where}" if where else ""
        raise InvalidInputError(f"Expected a dtype in {sorted(REGISTRY)}{at}. Got {name!r} instead.")
    return found


def by_codec_name(name: str) -> DType:
    """The entry the nuq codec calls ``name`` (``float32``, ``float16``, ``bfloat16``)."""
    found = _codec_names().get(name)
    if found is None:
        raise InvalidInputError(f"Expected a quantizable element dtype in {sorted(_codec_names())}. Got {name!r} instead.")
    return found


def of_array(array: np.ndarray, declared: str | None = None, path: str = "") -> DType:
    """The logical dtype of a tensor: ``declared`` (checked against the carrier), or
    inferred from the numpy dtype. BF16 must be declared and carried as uint16."""
    where = f"tensor {path!r}" if path else "a tensor"
    if declared is not None:
        entry = get(declared, where)
        if entry.carrier != array.dtype:
            raise InvalidInputError(
                f"Expected {where} declared {declared} to be carried as {entry.carrier}. "
                f"Got {array.dtype} instead."
            )
        return entry
    inferred = _by_carrier(array.dtype)
    if inferred is None:
        raise InvalidInputError(
            f"Expected {where} to have a dtype in {sorted(REGISTRY)}. Got numpy {array.dtype} instead; "
            "convert it first (bfloat16 bits: declare dtypes={path: 'BF16'} on a uint16 array)."
        )
    return inferred
