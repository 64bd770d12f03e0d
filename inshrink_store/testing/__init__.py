"""Test helpers that ship with inshrink-store: hypothesis strategies and a codec checker.

Use them to property-test the project's codecs and your own::

    from hypothesis import given
    from inshrink_store.testing import check_codec_roundtrip, float_arrays

    @given(float_arrays(dtypes=("float32",)))
    def test_my_codec(sample):
        check_codec_roundtrip(MyCodec(), sample.array, max_abs_error=1e-3)

hypothesis is only imported by :mod:`inshrink_store.testing.strategies`.
"""

from inshrink_store.testing.roundtrip import check_codec_roundtrip

__all__ = ["check_codec_roundtrip", "codebooks", "float_arrays", "nuq_configs", "FloatSample"]


def __getattr__(name: str):  # strategies need hypothesis: import them lazily
    if name in ("codebooks", "float_arrays", "nuq_configs", "FloatSample"):
        from inshrink_store.testing import strategies

        return getattr(strategies, name)
    raise AttributeError(name)
