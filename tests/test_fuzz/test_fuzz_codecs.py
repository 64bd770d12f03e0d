"""Codec payloads (nuq decode, vdelta decode of mutated valid payloads, crafted header fields)
and codec configurations (random dicts to from_config / from_dict)."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from inshrink_store.codecs import _payload, vdelta
from inshrink_store.codecs.nuq import NUQ, NUQZarrCodec
from inshrink_store.codecs.vdelta import VDelta
from tests.test_fuzz._hostile import FAST, INTERESTING_INTS, JSON, SLOW, bounded, mutate_bytes

CODEC = NUQ([-1.0, -0.25, 0.0, 0.25, 1.0], protected_dtype="float32")
_rng = np.random.default_rng(5)
VALUES = _rng.standard_normal(3000).astype(np.float32)
VALUES[::97] = np.nan
PAYLOAD = CODEC.encode(VALUES)
CHANGED = VALUES.copy()
CHANGED[:200] *= 3
NEXT = CODEC.encode(CHANGED)
DELTA = VDelta().encode(NEXT, base=PAYLOAD)


def _fields(data: st.DataObject, raw: bytes, layout: struct.Struct) -> bytes:
    """Overwrite some header fields of ``raw`` with interesting or random integers."""
    buf = bytearray(raw)
    fields = list(layout.unpack_from(buf))
    for i in data.draw(st.lists(st.integers(1, len(fields) - 1), min_size=1, max_size=3)):
        size = struct.calcsize("<" + _codes(layout)[i])
        top = 2 ** (8 * size) - 1
        fields[i] = data.draw(st.one_of(INTERESTING_INTS.filter(lambda v, t=top: 0 <= v <= t),
                                        st.integers(0, top)))
    layout.pack_into(buf, 0, *fields)
    return bytes(buf)


def _codes(layout: struct.Struct) -> list[str]:
    out, count = [], ""
    for ch in layout.format.lstrip("<"):
        if ch.isdigit():
            count += ch
            continue
        out.append(count + ch)
        count = ""
    return out


def _nuq_decode(raw: bytes) -> None:
    with bounded():
        CODEC.decode(raw)
    with bounded():
        _payload.unpack(raw)


def _vdelta_decode(raw: bytes, base: bytes = PAYLOAD) -> None:
    with bounded() as outcome:
        out = VDelta().decode(raw, base=base)
    if outcome.error is None and raw == DELTA and base == PAYLOAD:
        assert out == NEXT


def _payloads(data: st.DataObject) -> None:
    which = data.draw(st.sampled_from(["nuq", "nuq-fields", "vdelta", "vdelta-fields", "base"]))
    if which == "nuq":
        _nuq_decode(mutate_bytes(PAYLOAD, data))
    elif which == "nuq-fields":
        _nuq_decode(_fields(data, PAYLOAD, _payload.HEADER))
    elif which == "vdelta":
        _vdelta_decode(mutate_bytes(DELTA, data))
    elif which == "vdelta-fields":
        _vdelta_decode(_fields(data, DELTA, vdelta.HEADER))
    else:
        _vdelta_decode(DELTA, mutate_bytes(PAYLOAD, data))


CONFIG_VALUES = st.one_of(
    JSON, st.lists(st.floats(allow_nan=True), max_size=6),
    st.sampled_from([[0.0, 1.0], "inf", "bfloat16", "float32", "float16", 3, True, None, "zstd"]),
)
NUQ_KEYS = st.sampled_from(["codebook", "tolerance", "protected_dtype", "dtype", "id", "bogus", ""])
VDELTA_KEYS = st.sampled_from(["coder", "level", "regroup", "id", "bogus"])


def _configs(data: st.DataObject) -> None:
    nuq = data.draw(st.dictionaries(NUQ_KEYS, CONFIG_VALUES, max_size=5), label="nuq config")
    with bounded():
        NUQ.from_config({**nuq, "id": "inshrink.nuq"})
    entry = data.draw(st.one_of(
        st.just({"name": "inshrink.nuq", "configuration": nuq}), JSON,
        st.fixed_dictionaries({"name": st.just("inshrink.nuq"), "configuration": JSON}),
    ), label="zarr entry")
    with bounded():
        NUQZarrCodec.from_dict(entry)  # type: ignore[arg-type]
    config = data.draw(st.dictionaries(VDELTA_KEYS, CONFIG_VALUES, max_size=4), label="vdelta config")
    with bounded():
        VDelta.from_config({**config, "id": "inshrink.vdelta"})


@FAST
@given(data=st.data())
def test_mutated_payloads(data: st.DataObject) -> None:
    _payloads(data)


@FAST
@given(data=st.data())
def test_random_configs(data: st.DataObject) -> None:
    _configs(data)


@pytest.mark.slow
@SLOW
@given(data=st.data())
def test_mutated_payloads_long(data: st.DataObject) -> None:
    _payloads(data)


@pytest.mark.slow
@SLOW
@given(data=st.data())
def test_random_configs_long(data: st.DataObject) -> None:
    _configs(data)


def test_the_unmutated_inputs_decode() -> None:
    _vdelta_decode(DELTA)
    assert VDelta().decode(DELTA, base=PAYLOAD) == NEXT
    np.testing.assert_array_equal(np.isnan(CODEC.decode(PAYLOAD)), np.isnan(VALUES))
