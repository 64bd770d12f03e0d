"""Hypothesis strategies for float tensors and ``inshrink.nuq`` configurations.
Layer: none: test helpers outside the layers, importing only ``dtypes`` and ``codecs``.

bfloat16 has no numpy dtype: such samples carry uint16 bit patterns and say
``dtype == "bfloat16"``; :attr:`FloatSample.values` gives any sample as float32.
Shapes include 0-d and empty arrays, and with ``allow_special`` the elements include
NaN (with varied payloads and signs), ±Inf, -0.0, subnormals and the largest
finite values: the inputs codecs get wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from inshrink_store import dtypes as registry
from inshrink_store.codecs import nuq
from inshrink_store.codecs._payload import PROTECTED_CODES

#: the element dtypes of the ``inshrink.nuq`` codec, as the dtype registry names them
ELEMENT_DTYPES = registry.CODEC_NAMES


@dataclass(frozen=True)
class FloatSample:
    """An array and its element type name; ``array`` holds uint16 bits when ``dtype`` is bfloat16."""

    array: np.ndarray
    dtype: str

    @property
    def values(self) -> np.ndarray:
        """The elements as float32 (exact for every element dtype)."""
        return registry.by_codec_name(self.dtype).to_float32(self.array).copy()


def shapes(max_dims: int = 3, max_side: int = 17) -> st.SearchStrategy[tuple[int, ...]]:
    """Array shapes, 0-d and empty ones included."""
    return hnp.array_shapes(min_dims=0, max_dims=max_dims, min_side=0, max_side=max_side)


def _elements(dtype: str, allow_special: bool, max_magnitude: float) -> st.SearchStrategy[float]:
    """Values hypothesis can draw: float16 for float16, else float32 (narrowed afterwards)."""
    carrier = registry.by_codec_name(dtype).carrier
    width: Literal[16, 32] = 16 if carrier.kind == "f" and carrier.itemsize == 2 else 32
    if allow_special:
        return st.floats(width=width)
    return st.floats(-max_magnitude, max_magnitude, width=width)


@st.composite
def float_arrays(draw: st.DrawFn, dtypes: tuple[str, ...] = ELEMENT_DTYPES,
                 allow_special: bool = True, max_dims: int = 3, max_side: int = 17,
                 max_magnitude: float = 1e4) -> FloatSample:
    """A :class:`FloatSample` of one of ``dtypes`` ("float32", "float16", "bfloat16").

    ``allow_special=False`` gives finite values within ±``max_magnitude`` only.
    """
    unknown = set(dtypes) - set(ELEMENT_DTYPES)
    if unknown or not dtypes:
        raise ValueError(f"Expected dtypes from {ELEMENT_DTYPES}. Got {tuple(dtypes)!r} instead.")
    dtype = draw(st.sampled_from(list(dtypes)))
    shape = draw(shapes(max_dims, max_side))
    elements = _elements(dtype, allow_special, max_magnitude)
    entry = registry.by_codec_name(dtype)
    if entry.carried_as_bits:  # float32 values rounded to it (the rounding keeps NaN bits)
        values = draw(hnp.arrays(np.float32, shape, elements=elements))
        bits = entry.from_float32(values).reshape(shape)
        if not allow_special:  # rounding up may step past the bound: one step toward zero
            bits = np.where(np.abs(entry.to_float32(bits)) > max_magnitude,
                            bits - entry.carrier.type(1), bits).astype(entry.carrier)
        return FloatSample(bits, dtype)
    carrier = entry.carrier.newbyteorder("<")
    return FloatSample(draw(hnp.arrays(carrier, shape, elements=elements)), dtype)


def _bfloat16(value: float) -> float:
    return float(registry.round_bf16(np.float32(value))) + 0.0  # -0.0 -> 0.0


@st.composite
def codebooks(draw: st.DrawFn, min_size: int = 1, max_size: int = 40,
              include_zero: bool | None = None, max_magnitude: float = 100.0) -> list[float]:
    """Strictly ascending centres, valid for every element dtype.

    Each centre is exactly representable in bfloat16 and float16 (normal range), so
    centres stay distinct whatever dtype they are rounded to. ``include_zero``: True
    forces 0.0 in (the policy layer's pruned weights), None lets hypothesis choose. Each
    centre is spelled as the codec spells it (:func:`~inshrink_store.codecs.nuq.short_codebook`:
    its fewest digits), so a codec built from these reports them unchanged.
    """
    centre = st.floats(-max_magnitude, max_magnitude, width=16, allow_subnormal=False).map(_bfloat16)
    values = set(draw(st.lists(centre, min_size=min_size, max_size=max_size, unique=True)))
    if include_zero or (include_zero is None and draw(st.booleans())):
        values.add(0.0)
    return list(nuq.short_codebook(tuple(sorted(values)) or (0.0,)))


@st.composite
def nuq_configs(draw: st.DrawFn, dtype: str | None = None,
                tolerances: tuple[float | str, ...] = (0.0, 0.01, 0.5, "inf")) -> dict[str, Any]:
    """Valid ``inshrink.nuq`` numcodecs configurations (``numcodecs.get_codec`` accepts them)."""
    return {
        "id": nuq.CODEC_ID,
        "codebook": draw(codebooks()),
        "tolerance": draw(st.sampled_from(list(tolerances))),
        "protected_dtype": draw(st.sampled_from(list(PROTECTED_CODES))),
        "dtype": dtype or draw(st.sampled_from(list(ELEMENT_DTYPES))),
    }
