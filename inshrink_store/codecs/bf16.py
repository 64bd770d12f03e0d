"""bfloat16 <-> float32 in numpy (numpy has no bfloat16): bit patterns carried as uint16.

bfloat16 is the upper half of a float32, so both directions are bit operations.
float32 -> bfloat16 rounds to nearest, ties to even (finite values past the largest
bfloat16 become infinite, as in IEEE and torch). NaN stays NaN with its sign and top
payload bits (torch canonicalises every NaN to 0x7FC0; keeping the bits lets a
bfloat16 NaN survive a trip through float32 unchanged); the quiet bit is set only
when the kept bits alone would read as infinity. bfloat16 -> float32 is exact.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

_MANTISSA = np.uint16(0x007F)
_QUIET = np.uint16(0x0040)


def to_float32(bits: ArrayLike) -> np.ndarray:
    """uint16 bfloat16 bit patterns -> float32 values (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def from_float32(values: ArrayLike) -> np.ndarray:
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


def round_float32(values: ArrayLike) -> np.ndarray:
    """float32 values rounded to bfloat16 precision, returned as float32."""
    return to_float32(from_float32(values))

