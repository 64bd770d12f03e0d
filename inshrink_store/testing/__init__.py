"""Test helpers that ship with inshrink-store: hypothesis strategies, a codec checker and a
storage that fails on purpose.
Layer: none: test helpers outside the layers, importing only ``dtypes``, ``codecs``,
``storage`` and ``errors``.

Use them to property-test the project's codecs and your own
(``docs/guides/testing-your-codec.md``)::

    from hypothesis import given
    from inshrink_store.testing import check_codec_roundtrip, float_arrays

    @given(float_arrays(dtypes=("float32",), allow_special=False))
    def test_my_codec(sample):
        check_codec_roundtrip(MyCodec(), sample.array, max_abs_error=1e-3)

Only the strategies need hypothesis (a test dependency, not a runtime one), so they
are imported on first use; ``check_codec_roundtrip`` needs numpy and numcodecs only.

:class:`FlakyStorage` wraps a store's storage and fails chosen or random reads, writes,
listings and deletes, transiently or for good, so you can check that your setup loses no
committed version when storage hiccups (``inshrink_store.Repository(FlakyStorage(...))``;
see :mod:`inshrink_store.testing.flaky`).
"""

from __future__ import annotations

from typing import Any

from inshrink_store.testing.flaky import (
    FaultRule,
    FaultStats,
    FlakyStorage,
    InjectedFault,
    InjectedOSError,
    InjectedStorageError,
)
from inshrink_store.testing.roundtrip import check_codec_roundtrip

__all__ = ["FaultRule", "FaultStats", "FlakyStorage", "FloatSample", "InjectedFault", "InjectedOSError",
           "InjectedStorageError", "check_codec_roundtrip", "codebooks", "float_arrays", "nuq_configs"]
_STRATEGIES = ("FloatSample", "codebooks", "float_arrays", "nuq_configs")


def __getattr__(name: str) -> Any:
    if name in _STRATEGIES:
        from inshrink_store.testing import strategies

        return getattr(strategies, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
