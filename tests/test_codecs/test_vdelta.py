"""Property tests of the inshrink.vdelta codec: exact inverse given the base, clear errors."""

from __future__ import annotations

import json

import numcodecs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inshrink_store.codecs import _payload
from inshrink_store.codecs.vdelta import VDelta, worth_delta
from inshrink_store.errors import FormatError, IntegrityError


@st.composite
def payload_pairs(draw):
    """(current, base) payloads of equal length, level counts possibly different, uint8/uint16."""
    n = draw(st.integers(0, 300))
    b_prev = draw(st.sampled_from([1, 2, 5, 17, 33, 255, 256, 300, 1000]))
    b_cur = draw(st.sampled_from([b_prev, 2, 17, 256, 700]))
    mode = draw(st.sampled_from(["random", "equal", "few-changes", "all-same"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    prev = rng.integers(0, b_prev, n)
    if mode == "random":
        cur = rng.integers(0, b_cur, n)
    elif mode == "all-same":
        cur = np.full(n, b_cur - 1)
    else:
        cur = np.minimum(prev, b_cur - 1)
        if mode == "few-changes" and n:
            idx = rng.integers(0, n, max(1, n // 20))
            cur[idx] = rng.integers(0, b_cur, idx.size)
    pdt = draw(st.sampled_from(["bfloat16", "float32"]))
    def make(levels, ids, dtype):
        count = int(np.count_nonzero(ids == levels - 1))
        prot = rng.integers(0, 2**16, count).astype(np.uint16) if dtype == "bfloat16" else rng.standard_normal(count).astype(np.float32)
        return _payload.pack(levels, ids, dtype, prot)
    return make(b_cur, cur, pdt), make(b_prev, prev, draw(st.sampled_from(["bfloat16", "float32"])))


@settings(max_examples=60, deadline=None)
@given(pair=payload_pairs(), regroup=st.booleans())
def test_decode_inverts_encode_given_the_base(pair, regroup):
    cur, prev = pair
    codec = VDelta(regroup=regroup)
    delta = codec.encode(cur, base=prev)
    assert codec.decode(delta, base=prev) == cur
    assert codec.encode(cur, base=prev) == delta  # deterministic


def test_config_round_trip_through_json_and_registry():
    codec = VDelta(level=5, regroup=False)
    clone = numcodecs.get_codec(json.loads(json.dumps(codec.get_config())))
    assert isinstance(clone, VDelta) and clone.get_config() == codec.get_config()


def test_unchanged_ids_compress_to_almost_nothing_and_regrouping_helps_migrations():
    rng = np.random.default_rng(0)
    prev_ids = rng.integers(0, 16, 200_000).astype(np.uint8)
    prev = _payload.pack(17, prev_ids, "bfloat16", np.zeros(0, np.uint16))
    assert len(VDelta().encode(prev, base=prev)) < 200
    cur_ids = prev_ids.copy()
    busy = np.flatnonzero(prev_ids == 3)          # one bin migrates a lot, the rest are stable
    cur_ids[busy[: busy.size // 2]] = 4
    cur = _payload.pack(17, cur_ids, "bfloat16", np.zeros(0, np.uint16))
    grouped, plain = len(VDelta().encode(cur, base=prev)), len(VDelta(regroup=False).encode(cur, base=prev))
    assert grouped < plain
    assert worth_delta(grouped, 200_000 // 2)


def _pair():
    base = _payload.pack(17, np.arange(100, dtype=np.uint8) % 16, "bfloat16", np.zeros(0, np.uint16))
    cur = _payload.pack(17, (np.arange(100, dtype=np.uint8) + 1) % 17, "bfloat16", np.arange(5, dtype=np.uint16))
    return cur, base


def test_malformed_deltas_raise_clear_errors():
    cur, base = _pair()
    delta = VDelta().encode(cur, base=base)
    for bad in (delta[:20], delta[:-1], delta + b"x", b"NOPE" + delta[4:]):
        with pytest.raises(FormatError):
            VDelta().decode(bad, base=base)
    other = _payload.pack(17, np.zeros(100, np.uint8), "bfloat16", np.zeros(0, np.uint16))
    with pytest.raises(IntegrityError):
        VDelta().decode(delta, base=other)
    with pytest.raises(FormatError):
        VDelta().decode(delta, base=None)


def test_mismatched_element_counts_raise():
    cur, base = _pair()
    short = _payload.pack(17, np.zeros(10, np.uint8), "bfloat16", np.zeros(0, np.uint16))
    with pytest.raises(FormatError, match="element counts"):
        VDelta().encode(cur, base=short)
