"""The ``inshrink.nuq`` configuration's values checked, one definition for the writer and
every reader: codebook, tolerance, dtype choices, channel scales.
Layer: codecs, storage and structure (siblings, none importing another), above the helpers.

Split out of :mod:`~inshrink_store.codecs.nuq` (the codec), which imports these checks.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from inshrink_store import dtypes
from inshrink_store.errors import FormatError

CODEC_ID = "inshrink.nuq"

#: the most scales a configuration may carry (one per element of the last axis; they live in
#: zarr.json, so a wider array stays unscaled)
MAX_SCALES = 65536


def tolerance_from_json(value: Any) -> float:
    if isinstance(value, str) and value == "inf":
        return math.inf
    if isinstance(value, bool) or not isinstance(value, int | float | np.floating | np.integer):
        raise FormatError(
            f"Expected tolerance as a number >= 0 or the string 'inf'. Got {value!r} instead."
        )
    tol = float(value)
    if not tol >= 0:
        raise FormatError(f"Expected tolerance >= 0 (or 'inf'). Got {value!r} instead.")
    return tol


def tolerance_to_json(value: float) -> float | str:
    return "inf" if math.isinf(value) else value


def check_scales(scales: tuple[float, ...], dtype: str) -> np.ndarray:
    """The scales as float32, after the checks the writer and every reader share: float32
    elements only, 1..MAX_SCALES numbers, each finite, > 0 and exactly a float32."""
    if dtype != "float32":
        raise FormatError(f"Expected scales only with dtype 'float32' in the {CODEC_ID} configuration. "
                          f"Got scales with dtype {dtype!r} instead.")
    if not 1 <= len(scales) <= MAX_SCALES:
        raise FormatError(f"Expected 1..{MAX_SCALES} scales in the {CODEC_ID} configuration. "
                          f"Got {len(scales)} instead.")
    s64 = np.asarray(scales, np.float64)
    with np.errstate(over="ignore"):
        s32 = s64.astype(np.float32)
    # normal float32 only: a subnormal scale rounds the scaled centres together
    bad = ~(np.isfinite(s32) & (s32 >= np.finfo(np.float32).tiny) & (s32.astype(np.float64) == s64))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise FormatError(f"Expected every scale of the {CODEC_ID} configuration to be a finite float32 "
                          f"> 0. Got scales[{i}] = {scales[i]!r} instead.")
    s32.setflags(write=False)
    return s32


def check_scaled_centres(centres: np.ndarray, scales: np.ndarray) -> None:
    """Every column's scaled centres (float32 products) finite and strictly ascending: two
    centres that one scale rounds together would make decoding then encoding move an id."""
    with np.errstate(over="ignore", invalid="ignore"):
        scaled = np.multiply(centres[None, :], scales[:, None], dtype=np.float32)
        ok = np.isfinite(scaled).all(axis=1) & (np.diff(scaled, axis=1) > 0).all(axis=1)
    if not ok.all():
        j = int(np.flatnonzero(~ok)[0])
        raise FormatError(
            f"Expected the codebook's centres times every scale to stay finite and distinct in float32. "
            f"Got scales[{j}] = {float(scales[j])!r}, which overflows or rounds two centres together, instead."
        )


def config_scales(values: Any) -> tuple[float, ...] | None:
    """The ``scales`` key from JSON or Python: None, or a tuple of floats (checked later)."""
    if values is None:
        return None
    ok = isinstance(values, list | tuple | np.ndarray)
    if ok and not isinstance(values, np.ndarray):
        ok = all(isinstance(c, int | float | np.integer | np.floating) and not isinstance(c, bool) for c in values)
    if not ok:
        raise FormatError(f"Expected scales as a list of numbers or null in the {CODEC_ID} configuration. "
                          f"Got {values!r:.80} instead.")
    try:
        return tuple(float(c) for c in np.asarray(values, np.float64).reshape(-1))
    except (OverflowError, TypeError, ValueError):
        raise FormatError(f"Expected scales as finite numbers in the {CODEC_ID} configuration. "
                          f"Got {values!r:.80} instead.") from None


_MAX_CENTRES = 65534
CONFIG_KEYS = ("codebook", "tolerance", "protected_dtype", "dtype", "scales")


def config_codebook(values: Any) -> tuple[float, ...]:
    ok = isinstance(values, list | tuple | np.ndarray) and len(values) <= _MAX_CENTRES
    if ok and not isinstance(values, np.ndarray):
        ok = all(
            isinstance(c, int | float | np.integer | np.floating) and not isinstance(c, bool)
            for c in values
        )
    try:
        codebook = tuple(float(c) for c in np.asarray(values).reshape(-1)) if ok else None
    except (OverflowError, TypeError, ValueError):
        codebook = None
    if codebook is None:
        raise FormatError(
            f"Expected codebook as a list of 1..{_MAX_CENTRES} numbers. "
            f"Got {values!r:.80} instead."
        )
    return short_codebook(codebook)


def short_codebook(codebook: tuple[float, ...]) -> tuple[float, ...]:
    """``codebook`` with each centre replaced by the shortest decimal of its float32 value
    wherever that decimal rounds to the same centre in every element dtype the codec takes
    (float32, float16, bfloat16; the centres the spec decodes with), else kept as it is.

    Why: a codebook is JSON text in zarr.json, and a float32 centre written as its float64
    value takes 17 digits (``-0.0015899459831416607``) where 8 or 9 name it
    (``-0.001589946``); codebooks were 44 % of the zstd-packed documents of a version of the
    evaluation's LM. Same centres, so the same payload bytes; readers parse any decimal. Made
    at construction, so the codec in memory holds what its zarr.json says and what a reader
    of it rebuilds (the function is idempotent)."""
    c64 = np.asarray(codebook, np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        c32 = c64.astype(np.float32)
    finite = np.isfinite(c32)
    if not finite.any():
        return codebook
    short = c64.copy()
    short[finite] = [float(str(x)) for x in c32[finite]]
    same = finite.copy()
    with np.errstate(over="ignore", invalid="ignore"):
        for name in dtypes.CODEC_NAMES:
            rounding = dtypes.by_codec_name(name).round_float32
            a, b = rounding(c64), rounding(short)
            same &= (a == b) | (np.isnan(a) & np.isnan(b))
    if same.all():
        return tuple(float(x) for x in short)
    return tuple(float(s) if ok else float(c) for s, c, ok in zip(short, c64, same, strict=True))


def config_choice(value: Any, name: str, allowed: tuple[str, ...], none_ok: bool = False) -> Any:
    if (value is None and none_ok) or (isinstance(value, str) and value in allowed):
        return value
    raise FormatError(
        f"Expected {name} in {allowed}{' or null' if none_ok else ''} in the {CODEC_ID} "
        f"configuration. Got {value!r:.80} instead."
    )
