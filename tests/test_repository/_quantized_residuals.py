"""What the residual tests share: a small quantized configuration, its warnings kept quiet,
and seeded weight-like tensors (a residual exists only for a quantized tensor)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import numpy as np
import pytest

from inshrink_store.policy import QuantConfig

#: few levels and a low size floor, so small test tensors are quantized and get a residual
QC = QuantConfig(bins=4, min_numel=16)


@pytest.fixture(autouse=True)
def quiet_quantizer() -> Iterator[None]:
    """k-means on 16x16 tensors warns about empty clusters; nothing here depends on it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def seeded(seed: int, side: int = 16) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((side, side)).astype(np.float32)
