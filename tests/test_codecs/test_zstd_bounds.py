"""Bounded zstd decompression: what a frame declares never sets what is allocated.

A stored tree, object or plane is a zstd frame whose header may declare its content size.
A few hostile bytes declaring hundreds of MiB must fail without that much memory being
taken (found by the slow manifest fuzzer: a 70-byte root tree allocated 286 MB), while
every real frame, however compressible, still decodes.
"""

from __future__ import annotations

import struct
import tracemalloc

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from inshrink_store.codecs import _zstd
from inshrink_store.errors import FormatError

LIMIT = 1 << 30  # the trees' limit: a generous one is where a declared size mattered


def _declaring(declared: int, content: bytes) -> bytes:
    """A frame of ``content`` whose header declares ``declared`` bytes of content."""
    frame = zstandard.ZstdCompressor(write_content_size=False, write_checksum=False).compress(content)
    fhd = frame[4]
    assert fhd & 0xE3 == 0  # no content size, not single-segment, no dictionary id
    return frame[:4] + bytes([fhd | 0xC0]) + frame[5:6] + struct.pack("<Q", declared) + frame[6:]


def _peak(call) -> tuple[BaseException | None, int]:
    tracemalloc.start()
    try:
        call()
        error = None
    except FormatError as exc:
        error = exc
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return error, peak


def test_a_size_no_frame_of_that_length_can_hold_is_refused_before_any_allocation():
    frame = _declaring(300 << 20, b"tree" * 10)
    assert len(frame) * _zstd.MAX_EXPANSION < 300 << 20
    error, peak = _peak(lambda: _zstd.decompress(frame, LIMIT, "root tree 1a2b"))
    assert error is not None and "root tree 1a2b" in str(error) and "can hold" in str(error)
    assert peak < 1 << 20


def test_a_plausible_but_false_size_is_decoded_in_steps_and_fails_small():
    """Random bytes stay about their own size in zstd; a header claiming 24 MiB of content
    (well within what the frame could hold) is read step by step and refused."""
    content = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    frame = _declaring(24 << 20, content)
    assert len(frame) * _zstd.ONE_SHOT_RATIO < 24 << 20 < len(frame) * _zstd.MAX_EXPANSION
    error, peak = _peak(lambda: _zstd.decompress(frame, LIMIT, "node tree 9f"))
    assert error is not None and "node tree 9f" in str(error)
    assert peak < 4 << 20  # not the 24 MiB declared


def test_a_frame_of_zeros_compressed_beyond_the_one_shot_ratio_still_decodes():
    content = bytes(12 << 20)
    frame = zstandard.ZstdCompressor(level=1).compress(content)
    assert len(frame) * _zstd.ONE_SHOT_RATIO < len(content)  # takes the stepped path
    assert _zstd.decompress(frame, LIMIT, "chunk") == content


@settings(max_examples=60, deadline=None)
@given(size=st.integers(0, 3 << 20), runs=st.integers(1, 64), seed=st.integers(0, 2**32 - 1),
       level=st.sampled_from([1, 3]), sized=st.booleans())
def test_any_real_frame_round_trips_within_its_limit(size, runs, seed, level, sized):
    """From incompressible to runs of a few values (ratios either side of ONE_SHOT_RATIO),
    with and without a declared size."""
    rng = np.random.default_rng(seed)
    content = np.repeat(rng.integers(0, 256, runs, dtype=np.uint8), -(-size // runs))[:size].tobytes()
    if seed % 2:
        content = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
    frame = zstandard.ZstdCompressor(level=level, write_content_size=sized).compress(content)
    assert _zstd.decompress(frame, max(size, 1), "plane") == content
    if size:
        with pytest.raises(FormatError, match="at most"):
            _zstd.decompress(frame, size - 1, "plane")


@pytest.mark.parametrize("sized", [True, False])
@pytest.mark.parametrize("after", [b"", b"garbage!", b"frame"])
def test_bytes_after_the_first_frame_are_ignored_on_either_path(sized, after):
    """A small frame is decoded in one call, a highly compressible one in steps: both read
    the first frame only, whatever follows it (garbage, another frame)."""
    if after == b"frame":
        after = zstandard.ZstdCompressor().compress(b"another frame")
    for content in (b"tree" * 100, bytes(12 << 20)):
        frame = zstandard.ZstdCompressor(write_content_size=sized, write_checksum=True).compress(content)
        assert _zstd.decompress(frame + after, LIMIT, "tree") == content


def test_a_frame_cut_short_is_a_format_error_naming_it():
    frame = zstandard.ZstdCompressor().compress(bytes(12 << 20))
    for cut in (len(frame) - 1, len(frame) - 5, 20):
        with pytest.raises(FormatError, match="chunk 7"):
            _zstd.decompress(frame[:cut], LIMIT, "chunk 7")


@settings(max_examples=40, deadline=None)
@given(frames=st.lists(st.tuples(st.binary(max_size=4096), st.sampled_from(["whole", "cut", "flipped", "garbage"]),
                                 st.integers(0, 2**32 - 1)), min_size=1, max_size=8))
def test_the_reused_decompressor_gives_what_a_fresh_one_gives_after_any_failure(frames):
    """Each thread keeps one decompressor (issue 43, item 10): any sequence of good and bad
    frames (cut short, a byte flipped, not zstd) decodes or fails exactly as with a new
    decompressor per frame, so a failed frame leaves nothing behind for the next."""
    for content, damage, seed in frames:
        frame = bytearray(zstandard.ZstdCompressor(level=1, write_checksum=True).compress(content))
        if damage == "cut":
            frame = frame[:max(1, seed % len(frame))]
        elif damage == "flipped":
            frame[seed % len(frame)] ^= 1 << (seed % 8)
        elif damage == "garbage":
            frame = bytearray(seed.to_bytes(4, "little")) + frame
        limit = max(len(content), 1)
        try:
            fresh = zstandard.ZstdDecompressor().decompress(bytes(frame))
        except zstandard.ZstdError:
            fresh = None
        try:
            got = _zstd.decompress(bytes(frame), limit, "plane")
        except FormatError:
            got = None
        if fresh is not None and len(fresh) <= limit:
            assert got == fresh
        if got is not None:
            assert got == content or damage != "whole"
    assert _zstd._decompressor() is _zstd._decompressor()  # noqa: SLF001 - one per thread


def test_threads_decode_side_by_side_with_their_own_decompressors():
    from concurrent.futures import ThreadPoolExecutor

    contents = [np.random.default_rng(i).integers(0, 4, 1 << 18, dtype=np.uint8).tobytes() for i in range(16)]
    frames = [zstandard.ZstdCompressor(level=1).compress(c) for c in contents]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda f: [_zstd.decompress(f, 1 << 18, "plane") for _ in range(20)], frames))
        ids = set(pool.map(lambda _: id(_zstd._decompressor()), range(64)))  # noqa: SLF001
    assert all(all(g == c for g in gs) for gs, c in zip(got, contents, strict=True))
    assert len(ids) <= 4
