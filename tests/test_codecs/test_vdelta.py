"""Property tests of the inshrink.vdelta codec: exact inverse given the base, clear errors."""

from __future__ import annotations

import contextlib
import json
from importlib.metadata import entry_points

import numcodecs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inshrink_store.codecs import _payload
from inshrink_store.codecs import vdelta as vd
from inshrink_store.codecs.vdelta import VDelta, worth_delta
from inshrink_store.errors import FormatError, InshrinkError, IntegrityError

LEVEL_COUNTS = [1, 2, 5, 17, 33, 255, 256, 300, 1000, 65535]


def make_payload(levels: int, ids: np.ndarray, dtype: str, rng: np.random.Generator) -> bytes:
    count = int(np.count_nonzero(ids == levels - 1))
    if dtype == "bfloat16":
        prot = rng.integers(0, 2**16, count).astype(np.uint16)
    else:
        prot = rng.standard_normal(count).astype(np.float32)
    return _payload.pack(levels, ids, dtype, prot)


@st.composite
def payload_pairs(draw):
    """(current, base) payloads of equal length; level counts and widths may differ."""
    n = draw(st.integers(0, 300))
    b_prev = draw(st.sampled_from(LEVEL_COUNTS))
    b_cur = draw(st.sampled_from([b_prev, *LEVEL_COUNTS]))
    mode = draw(st.sampled_from(["random", "equal", "few-changes", "all-same"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    prev = rng.integers(0, b_prev, n)
    if mode == "random":
        cur = rng.integers(0, b_cur, n)
    elif mode == "all-same":
        cur = np.full(n, draw(st.integers(0, b_cur - 1)))
    else:
        cur = np.minimum(prev, b_cur - 1)
        if mode == "few-changes" and n:
            idx = rng.integers(0, n, max(1, n // 20))
            cur[idx] = rng.integers(0, b_cur, idx.size)
    dtypes = st.sampled_from(["bfloat16", "float32"])
    return make_payload(b_cur, cur, draw(dtypes), rng), make_payload(b_prev, prev, draw(dtypes), rng)


@settings(max_examples=50, deadline=None)
@given(pair=payload_pairs(), regroup=st.booleans(), level=st.sampled_from([1, 3, 9]))
def test_decode_inverts_encode_given_the_base(pair, regroup, level):
    cur, prev = pair
    codec = VDelta(level=level, regroup=regroup)
    delta = codec.encode(cur, base=prev)
    assert codec.decode(delta, base=prev) == cur
    assert VDelta(level=level, regroup=not regroup).decode(delta, base=prev) == cur  # self-describing


@settings(max_examples=25, deadline=None)
@given(pair=payload_pairs())
def test_encoding_is_deterministic_and_accepts_every_buffer_type(pair):
    cur, prev = pair
    codec = VDelta()
    delta = codec.encode(cur, base=prev)
    for wrap in (bytes, bytearray, memoryview, lambda b: np.frombuffer(b, np.uint8)):
        assert codec.encode(wrap(cur), base=wrap(prev)) == delta
        assert codec.decode(wrap(delta), base=wrap(prev)) == cur
    out = bytearray(len(cur))
    assert codec.decode(delta, base=prev, out=out) is out and bytes(out) == cur


@settings(max_examples=50, deadline=None)
@given(levels=st.sampled_from(LEVEL_COUNTS + [256, 257]), seed=st.integers(0, 2**32 - 1),
       n=st.integers(0, 500))
def test_mod_sub_matches_wide_integer_arithmetic(levels, seed, n):
    rng = np.random.default_rng(seed)
    dt = _payload.id_dtype(_payload.id_width_for(levels))
    a, b = rng.integers(0, levels, n).astype(dt), rng.integers(0, levels, n).astype(dt)
    got = vd.mod_sub(a, b, levels)
    assert got.dtype == vd.delta_dtype(levels)
    np.testing.assert_array_equal(got, (a.astype(np.int64) - b) % levels)


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 400), levels=st.sampled_from([2, 17, 300]),
       sparsity=st.sampled_from([0.0, 0.05, 1.0]))
def test_regroup_is_the_stable_sort_by_previous_id_and_ungroup_inverts_it(seed, n, levels, sparsity):
    rng = np.random.default_rng(seed)
    prev = rng.integers(0, levels, n).astype(vd.delta_dtype(levels))
    d = np.where(rng.random(n) < sparsity, rng.integers(0, levels, n), 0).astype(prev.dtype)
    grouped = vd.regroup(d, prev)
    order = sorted(range(n), key=lambda i: (prev[i], i))  # the definition, in plain Python
    np.testing.assert_array_equal(grouped, d[np.array(order, dtype=np.intp)])
    np.testing.assert_array_equal(vd.ungroup(grouped, prev), d)


def test_ids_are_compared_as_integers_when_the_level_count_changes():
    """Same integer ids under a larger B give an all-zero delta; the old protected id becomes a level."""
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 17, 1000).astype(np.uint8)
    base = make_payload(17, ids, "bfloat16", rng)  # id 16 is protected here
    cur = make_payload(33, ids, "float32", rng)  # ... and an ordinary level here (no protected)
    prev_p, cur_p = _payload.unpack(base), _payload.unpack(cur)
    assert not vd.delta_stream(prev_p.ids, cur_p.ids, 33, True).any()
    assert VDelta().decode(VDelta().encode(cur, base=base), base=base) == cur


def test_config_round_trips_through_json_and_the_registry():
    codec = VDelta(level=5, regroup=False)
    config = json.loads(json.dumps(codec.get_config()))
    assert config == {"id": "inshrink.vdelta", "coder": "zstd", "level": 5, "regroup": False}
    clone = numcodecs.get_codec(config)
    assert isinstance(clone, VDelta) and clone == codec
    old_style = numcodecs.get_codec({"id": "inshrink.vdelta", "level": 3, "regroup": True})
    assert old_style == VDelta()  # configs written before "coder" existed still load


def test_registered_at_import_and_through_the_entry_point():
    assert numcodecs.registry.codec_registry["inshrink.vdelta"] is VDelta
    points = {ep.name: ep.value for ep in entry_points(group="numcodecs.codecs")}
    assert points.get("inshrink.vdelta") == "inshrink_store.codecs.vdelta:VDelta"


@pytest.mark.parametrize("config", [{"coder": "lz4"}, {"level": 0}, {"level": 23}])
def test_bad_configurations_raise_format_errors(config):
    with pytest.raises(FormatError, match="Expected"):
        VDelta(**config)


def test_unchanged_ids_compress_to_almost_nothing_and_regrouping_helps_uneven_migrations():
    rng = np.random.default_rng(0)
    prev_ids = rng.integers(0, 16, 200_000).astype(np.uint8)
    prev = _payload.pack(17, prev_ids, "bfloat16", np.zeros(0, np.uint16))
    assert len(VDelta().encode(prev, base=prev)) < 200
    cur_ids = prev_ids.copy()
    busy = np.flatnonzero(prev_ids == 3)  # one bin migrates a lot, the rest are stable
    cur_ids[busy[: busy.size // 2]] = 4
    cur = _payload.pack(17, cur_ids, "bfloat16", np.zeros(0, np.uint16))
    grouped, plain = len(VDelta().encode(cur, base=prev)), len(VDelta(regroup=False).encode(cur, base=prev))
    assert grouped < plain


@settings(max_examples=50, deadline=None)
@given(delta_len=st.integers(0, 10**9), whole_len=st.integers(0, 10**9))
def test_worth_delta_is_the_eighty_percent_rule(delta_len, whole_len):
    assert worth_delta(delta_len, whole_len) == (delta_len * 5 < whole_len * 4)


def _pair() -> tuple[bytes, bytes]:
    base = _payload.pack(17, np.arange(100, dtype=np.uint8) % 16, "bfloat16", np.zeros(0, np.uint16))
    cur = _payload.pack(17, (np.arange(100, dtype=np.uint8) + 1) % 17, "bfloat16", np.arange(5, dtype=np.uint16))
    return cur, base


@settings(max_examples=50, deadline=None)
@given(cut=st.integers(0, 10_000))
def test_truncated_or_extended_deltas_raise_format_errors(cut):
    cur, base = _pair()
    delta = VDelta().encode(cur, base=base)
    bad = delta[: cut % len(delta)] if cut < 5000 else delta + bytes(cut % 7 + 1)
    with pytest.raises(FormatError, match="Expected"):
        VDelta().decode(bad, base=base)


# header offsets (see codecs/inshrink.vdelta/README.md) and a corrupt value for each
HEADER_CORRUPTIONS = {
    "magic": (0, b"NOPE"), "version": (4, b"\x02"), "flags": (5, b"\x04"), "coder": (6, b"\x07"),
    "protected dtype": (7, b"\x01"), "count": (8, (99).to_bytes(8, "little")),
    "current levels": (16, (0).to_bytes(4, "little")), "base levels": (20, (18).to_bytes(4, "little")),
    "protected count": (32, (4).to_bytes(8, "little")), "zstd length": (40, (1).to_bytes(8, "little")),
}


@pytest.mark.parametrize("field", sorted(HEADER_CORRUPTIONS))
def test_corrupt_header_fields_raise_format_errors_with_the_field_named(field):
    cur, base = _pair()
    delta = bytearray(VDelta().encode(cur, base=base))
    offset, value = HEADER_CORRUPTIONS[field]
    delta[offset:offset + len(value)] = value
    with pytest.raises(FormatError, match="Expected") as info:
        VDelta().decode(bytes(delta), base=base)
    assert "Got" in str(info.value)


def test_wrong_or_missing_base_is_detected():
    cur, base = _pair()
    delta = VDelta().encode(cur, base=base)
    other = _payload.pack(17, np.zeros(100, np.uint8), "bfloat16", np.zeros(0, np.uint16))
    with pytest.raises(IntegrityError, match="base"):
        VDelta().decode(delta, base=other)
    for call in (lambda: VDelta().decode(delta, base=None), lambda: VDelta().encode(cur)):
        with pytest.raises(FormatError, match="base="):
            call()
    with pytest.raises(FormatError, match="payload magic"):
        VDelta().encode(cur, base=b"x" * 40)


@settings(max_examples=50, deadline=None)
@given(position=st.integers(0, 10_000), bit=st.integers(0, 7))
def test_a_bit_flip_in_the_header_never_gives_a_different_payload_silently(position, bit):
    """Except the flags byte and B_cur: those the store's content hash catches (see README)."""
    cur, base = _pair()
    delta = bytearray(VDelta().encode(cur, base=base))
    position %= vd.HEADER_SIZE
    if position == 5 or 16 <= position < 20:
        return
    delta[position] ^= 1 << bit
    with contextlib.suppress(InshrinkError):
        assert VDelta().decode(bytes(delta), base=base) == cur


def test_mismatched_element_counts_raise():
    cur, base = _pair()
    short = _payload.pack(17, np.zeros(10, np.uint8), "bfloat16", np.zeros(0, np.uint16))
    with pytest.raises(FormatError, match="element counts"):
        VDelta().encode(cur, base=short)


def test_out_buffer_of_the_wrong_size_is_refused():
    cur, base = _pair()
    delta = VDelta().encode(cur, base=base)
    with pytest.raises(FormatError, match="out buffer"):
        VDelta().decode(delta, base=base, out=bytearray(len(cur) - 1))
