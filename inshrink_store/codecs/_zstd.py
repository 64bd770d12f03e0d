"""Bounded zstd decompression: memory follows the real output, never a declared size.
Layer: codecs, storage and structure (siblings, none importing another), above the helpers.

A zstd frame may declare its content size, and ``ZstdDecompressor().decompress``
allocates that much up front (a corrupt or hostile frame declaring 10**18 bytes is a
``MemoryError``; a huge ``max_output_size`` an ``OverflowError``). Here the declared
size is checked against the caller's limit first, and against what the frame's own
length can hold at all (zstd's largest expansion, :data:`MAX_EXPANSION` per byte). A
frame that declares a size it plausibly holds (at most :data:`ONE_SHOT_RATIO` times its
length, or :data:`STEP`) is decompressed in one call (zstd checks the real size against
the declared one); any other in 1 MiB steps that stop as soon as the output passes the
limit, so that a few hostile bytes declaring hundreds of MiB never get them allocated.
"""

from __future__ import annotations

import threading
from typing import Any

import zstandard

from inshrink_store.errors import FormatError

#: zstd's largest expansion (a 3-byte RLE block header + 1 byte -> a 128 KiB block), rounded up
MAX_EXPANSION = 43690
STEP = 1 << 20
#: a frame declaring more than this many times its own length is decoded in steps, not in
#: one allocation of the declared size (real frames rarely compress 1000x: runs of zeros)
ONE_SHOT_RATIO = 1024
_local = threading.local()


#: levels whose compressor a thread keeps (their working memory is a few MiB; level 19 keeps
#: ~50 MiB, and a thread never gives it back)
CACHED_LEVELS = range(-7, 4)


def compress(data: Any, level: int) -> bytes:
    """One zstd frame of ``data`` at ``level``, by this thread's compressor for that level.

    Why: a plane's coder choice runs zstd several times (trials, the packed stream, the
    escapes), and making a compressor costs 8 us, most of a small chunk's zstd time. A
    compressor codes each call as a fresh frame (the same bytes as a new one); it is not
    thread-safe, hence one per thread. Slow levels get a fresh one each time (see
    :data:`CACHED_LEVELS`)."""
    if level not in CACHED_LEVELS:
        return zstandard.ZstdCompressor(level=level).compress(data)
    compressors: dict[int, zstandard.ZstdCompressor] | None = getattr(_local, "compressors", None)
    if compressors is None:
        compressors = _local.compressors = {}
    compressor = compressors.get(level)
    if compressor is None:
        compressor = compressors[level] = zstandard.ZstdCompressor(level=level)
    return compressor.compress(data)


def _decompressor() -> zstandard.ZstdDecompressor:
    """This thread's decompressor. Why: making one costs about 20 us (its context and
    workspace), paid by every plane of every link of a delta chain: 2-3 % of an ``export
    --all``'s CPU time on the CLI benchmark (issue 43, item 10). Each one-call
    ``decompress`` starts a fresh frame (the context is reset first), so the output is the
    same as a new decompressor's; not thread-safe, hence one per thread."""
    decompressor: zstandard.ZstdDecompressor | None = getattr(_local, "decompressor", None)
    if decompressor is None:
        decompressor = _local.decompressor = zstandard.ZstdDecompressor()
    return decompressor


#: a zstd block header: 3 bytes, little-endian: last-block bit, 2-bit type, 21-bit size
_BLOCK_RLE, _BLOCK_RESERVED = 1, 3
_CHECKSUM_FLAG = 0x04  # in the frame header descriptor (byte 4): a 4-byte checksum ends the frame


def _frame_length(body: bytes | memoryview, what: str) -> int:
    """Bytes of the zstd frame at the start of ``body``, from its block headers (a raw or
    compressed block holds its size in bytes, an RLE block one byte)."""
    view = memoryview(body).cast("B")
    try:
        at = zstandard.frame_header_size(view)
    except zstandard.ZstdError as exc:
        raise FormatError(f"Expected {what} to be a zstd frame. Got {exc} instead.") from None
    while True:
        if at + 3 > len(view):
            raise FormatError(f"Expected {what} to be a whole zstd frame. Got one cut short at byte {len(view)} instead.")
        header = int.from_bytes(view[at:at + 3], "little")
        kind, size = (header >> 1) & 3, header >> 3
        if kind == _BLOCK_RESERVED:
            raise FormatError(f"Expected {what} to be a valid zstd frame. Got a reserved block type at byte {at} instead.")
        at += 3 + (1 if kind == _BLOCK_RLE else size)
        if header & 1:  # the last block
            break
    if view[4] & _CHECKSUM_FLAG:
        at += 4
    if at > len(view):
        raise FormatError(f"Expected {what} to be a whole zstd frame. Got one cut short at byte {len(view)} instead.")
    return at


def decompress(body: bytes | memoryview, limit: int, what: str) -> bytes:
    """The content of the single zstd frame ``body``, at most ``limit`` bytes.

    Raises :class:`FormatError` naming ``what`` for an invalid frame, a declared content
    size above ``limit``, or output past ``limit``. Bytes after the first frame are ignored.
    """
    try:
        declared = zstandard.get_frame_parameters(body).content_size
    except zstandard.ZstdError as exc:
        raise FormatError(f"Expected {what} to be a zstd frame. Got {exc} instead.") from None
    known = declared != zstandard.CONTENTSIZE_UNKNOWN
    if known and declared > limit:
        raise FormatError(
            f"Expected {what} to declare at most {limit} bytes of content. "
            f"Got {declared} instead (corrupt or hostile frame)."
        )
    length = memoryview(body).nbytes
    if known and declared > length * MAX_EXPANSION:
        raise FormatError(
            f"Expected {what} to declare at most {length * MAX_EXPANSION} bytes of content, what "
            f"its {length} bytes can hold. Got {declared} instead (corrupt or hostile frame)."
        )
    if known and declared <= max(STEP, length * ONE_SHOT_RATIO):
        # the frame declares its size (every frame the store writes does) and it is within
        # the limit: one allocation of that size, and zstd fails a frame whose real content
        # differs from what it declares
        try:
            return _decompressor().decompress(body)
        except zstandard.ZstdError as exc:
            raise FormatError(f"Expected {what} to be a valid zstd frame. Got {exc} instead.") from None
    parts: list[bytes] = []
    total = 0
    # the first frame only (a reader would go on into whatever follows it), as in one call
    frame = memoryview(body)[: _frame_length(body, what)]
    try:
        with zstandard.ZstdDecompressor().stream_reader(frame, read_across_frames=False) as reader:
            while True:
                part = reader.read(min(STEP, limit - total + 1))
                if not part:
                    break
                total += len(part)
                if total > limit:
                    raise FormatError(
                        f"Expected {what} to decompress to at most {limit} bytes. "
                        "Got more instead (corrupt or hostile frame)."
                    )
                parts.append(part)
    except zstandard.ZstdError as exc:
        raise FormatError(f"Expected {what} to be a valid zstd frame. Got {exc} instead.") from None
    if known and total != declared:
        raise FormatError(f"Expected {what} to decompress to the {declared} bytes it declares. Got {total} instead.")
    return b"".join(parts)
