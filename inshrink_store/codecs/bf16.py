"""bfloat16 <-> float32 in numpy (numpy has no bfloat16): bit patterns carried as uint16.

float32 -> bfloat16 rounds to nearest, ties to even, like torch; NaN stays NaN (quiet
bit set), infinities stay infinite. bfloat16 -> float32 is exact.
"""

from __future__ import annotations

import numpy as np


def to_float32(bits: np.ndarray) -> np.ndarray:
    """uint16 bfloat16 bit patterns -> float32 values (exact)."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def from_float32(values: np.ndarray) -> np.ndarray:
    """float32 values -> uint16 bfloat16 bit patterns, round-to-nearest-even."""
    u = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        rounded[nan] = ((u[nan] >> 16) | np.uint32(0x0040)).astype(np.uint16)
    return rounded


def round_float32(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 precision, returned as float32."""
    return to_float32(from_float32(values))
