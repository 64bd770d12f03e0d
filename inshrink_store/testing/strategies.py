"""Hypothesis strategies for tensors and codec configurations.

bfloat16 has no numpy dtype: such samples carry uint16 bit patterns and say
``dtype == "bfloat16"``; ``FloatSample.values`` gives them as float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from inshrink_store.codecs import bf16

_CARRIER = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}


@dataclass(frozen=True)
class FloatSample:
    """An array and its element type name (``array`` is uint16 bits for bfloat16)."""

    array: np.ndarray
    dtype: str

    @property
    def values(self) -> np.ndarray:
        return bf16.to_float32(self.array) if self.dtype == "bfloat16" else self.array.astype(np.float32)


def shapes(max_dims: int = 3, max_side: int = 17) -> st.SearchStrategy[tuple[int, ...]]:
    """Shapes including 0-d and empty ones."""
    return hnp.array_shapes(min_dims=0, max_dims=max_dims, min_side=0, max_side=max_side)


@st.composite
def float_arrays(draw, dtypes=("float32", "float16", "bfloat16"), allow_special: bool = True,
                 max_dims: int = 3, max_side: int = 17, scale: float = 1.0) -> FloatSample:
    """Float arrays of any listed dtype; with ``allow_special`` NaN, ±Inf and -0.0 appear."""
    dtype = draw(st.sampled_from(list(dtypes)))
    shape = draw(shapes(max_dims, max_side))
    width = 16 if dtype != "float32" else 32
    elements = st.floats(width=width, allow_nan=allow_special, allow_infinity=allow_special,
                         min_value=None if allow_special else -1e4 * scale,
                         max_value=None if allow_special else 1e4 * scale)
    if dtype == "bfloat16":
        values = draw(hnp.arrays(np.float32, shape, elements=st.floats(width=32, allow_nan=allow_special,
                                 allow_infinity=allow_special, min_value=None if allow_special else -1e4,
                                 max_value=None if allow_special else 1e4)))
        return FloatSample(bf16.from_float32(values), "bfloat16")
    return FloatSample(draw(hnp.arrays(_CARRIER[dtype], shape, elements=elements)), dtype)


@st.composite
def codebooks(draw, min_size: int = 1, max_size: int = 40, include_zero: bool | None = None) -> list[float]:
    """Strictly ascending float centres (distinct in float16, so any element dtype works)."""
    values = draw(st.lists(st.floats(-100, 100, width=16, allow_subnormal=False), min_size=min_size,
                           max_size=max_size, unique=True))
    if include_zero or (include_zero is None and draw(st.booleans())):
        values.append(0.0)
    centres = sorted({float(np.float16(v)) for v in values} | set())
    # keep only centres distinct after bfloat16 rounding too
    out: list[float] = []
    for c in centres:
        if not out or bf16.round_float32(np.float32([c]))[0] != bf16.round_float32(np.float32([out[-1]]))[0]:
            out.append(float(bf16.round_float32(np.float32([c]))[0]))
    return out or [0.0]


@st.composite
def nuq_configs(draw, dtype: str | None = None) -> dict:
    """Valid ``inshrink.nuq`` numcodecs configurations."""
    return {
        "id": "inshrink.nuq",
        "codebook": draw(codebooks()),
        "tolerance": draw(st.sampled_from([0.0, 0.01, 0.5, "inf"])),
        "protected_dtype": draw(st.sampled_from(["bfloat16", "float32"])),
        "dtype": dtype or draw(st.sampled_from(["float32", "float16", "bfloat16"])),
    }
