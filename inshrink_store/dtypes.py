"""The one dtype registry: every logical dtype the store knows, how zarr carries it, and how
it widens to and narrows from float32 (numpy only, so every layer may import it).
Layer: helpers (``layout`` | ``dtypes`` | ``parallel``), above only ``errors``.

A *logical* dtype is what the tensor is (safetensors spelling: ``F32``, ``BF16``, ...); its
*carrier* is the numpy dtype that holds its bits in a zarr array. They differ only where
zarr v3 has no such type: bfloat16 travels as uint16 bit patterns, float8 (e4m3fn, e5m2) as
uint8 ones. Complex tensors are zarr's complex64/complex128; they have no float32 value to
widen to. Adding a dtype is one :class:`DType` entry here (plus its widen/narrow functions) and its tests;
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


def _minifloat_values(exp_bits: int, man_bits: int, ieee: bool) -> np.ndarray:
    """The value of each of the 256 bit patterns of an 8-bit float, as float32. ``ieee``: the
    top exponent holds infinity and NaN (float8_e5m2); otherwise only S.1111.111 is NaN
    and there is no infinity (float8_e4m3fn, the "fn" of finite)."""
    bits = np.arange(256)
    bias = (1 << (exp_bits - 1)) - 1
    e, m = (bits >> man_bits) & ((1 << exp_bits) - 1), bits & ((1 << man_bits) - 1)
    frac = m / float(1 << man_bits)
    magnitude = np.where(e == 0, frac * 2.0 ** (1 - bias), (1 + frac) * 2.0 ** (e - bias))
    top = e == (1 << exp_bits) - 1
    if ieee:
        magnitude = np.where(top, np.where(m == 0, np.inf, np.nan), magnitude)
    else:
        magnitude = np.where(top & (m == (1 << man_bits) - 1), np.nan, magnitude)
    return np.where(bits & 0x80, -magnitude, magnitude).astype(np.float32)


def _minifloat(exp_bits: int, man_bits: int, ieee: bool) -> tuple[Callable[[ArrayLike], np.ndarray],
                                                                   Callable[[ArrayLike], np.ndarray]]:
    """(widen, narrow) of an 8-bit float carried as uint8 bit patterns. Widening is a table
    lookup (exact). Narrowing rounds to nearest, ties to even, as torch converts: past the
    largest finite value float8_e5m2 rounds to infinity, float8_e4m3fn (which has none)
    saturates at ±448; NaN stays NaN with its sign."""
    table = _minifloat_values(exp_bits, man_bits, ieee)
    positive = table[:128]
    top = int(np.flatnonzero(np.isfinite(positive))[-1])  # the largest finite pattern
    # one more step past the largest finite value: where rounding to nearest overflows
    grid = np.append(positive[:top + 1].astype(np.float64), 2 * positive[top] - positive[top - 1])
    nan_bits = np.uint8(int(np.flatnonzero(np.isnan(positive))[-1]))

    def widen(bits: ArrayLike) -> np.ndarray:
        return table[np.asarray(bits, dtype=np.uint8)]

    def narrow(values: ArrayLike) -> np.ndarray:
        x = np.asarray(values, dtype=np.float32)
        a = np.abs(x.astype(np.float64)).reshape(-1)
        hi = np.clip(np.searchsorted(grid, a), 0, len(grid) - 1)  # NaN sorts last
        lo = np.maximum(hi - 1, 0)
        d_lo, d_hi = a - grid[lo], grid[hi] - a
        index = np.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, lo)
        index = np.where(a >= grid[-1], len(grid) - 1, index)  # at or past the overflow step
        if not ieee:  # saturate: the overflow step is the largest finite value
            index = np.minimum(index, top)
        out = index.astype(np.uint8)  # index top + 1 is the infinity pattern (e5m2)
        out[np.isnan(a)] = nan_bits
        out |= np.where(np.signbit(x.reshape(-1)), np.uint8(0x80), np.uint8(0))
        return out.reshape(x.shape)

    return widen, narrow


def _no_float32(name: str) -> Callable[[ArrayLike], np.ndarray]:
    def refuse(values: ArrayLike) -> np.ndarray:
        raise InvalidInputError(
            f"Expected a real dtype to read as float32. Got {name} instead: complex values have no "
            "float32 value; read the array as it is stored (SnapshotReader.read).")
    return refuse


@dataclass(frozen=True)
class DType:
    """One logical dtype.

    ``codec_name`` is the element dtype the ``inshrink.nuq`` codec calls it (``float32``,
    ``float16``, ``bfloat16``); None means the dtype is never quantized.
    """

    name: str
    carrier: np.dtype
    kind: str  # "float" | "int" | "uint" | "bool" | "complex"
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
        DType("F8_E4M3", np.dtype("uint8"), "float", None, *_minifloat(4, 3, ieee=False)),
        DType("F8_E5M2", np.dtype("uint8"), "float", None, *_minifloat(5, 2, ieee=True)),
        DType("C64", np.dtype("complex64"), "complex", None, _no_float32("C64")),
        DType("C128", np.dtype("complex128"), "complex", None, _no_float32("C128")),
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
