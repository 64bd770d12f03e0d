"""A candidate's stored bytes estimated from its sketches, without quantizing the model.

Why: the search ranks every configuration it looks at by compression ratio, but it
evaluates only a few of them. Measuring a ratio used to mean quantizing the whole model,
encoding it and compressing it; that was most of the search's time. Everything the
stored size depends on is already known once a tensor's masks are counted and its rest
sketched (a :class:`~inshrink_store.policy.partition.Part`, shared by every configuration
with the same protect / prune / metric):

- how many level ids take each value: the rest's sketch buckets assigned to the nearest
  centre of the codebook fitted to that sketch, every pruned element on the 0.0 centre,
  every protected one on the protected id;
- what the store's coder makes of ids with those frequencies: measured, not modelled.
  A sample of at most :data:`SAMPLE` ids with the same frequencies (exact counts, a
  permutation seeded from the counts) is coded by the very function that codes a stored
  keyframe (:func:`inshrink_store.cas.keyframe_body`), so the estimate follows the coder,
  its zstd level and its nibble packing. Level ids of real weights are close to
  independent for the coder (shuffling them changes zstd's output by under 0.1 %);
- the protected words are coded too (the part keeps them: they are few): the top values by
  magnitude are far from random bytes, and where they share a zstd block with the ids they
  cost more than alone (see :func:`coded_bytes`).

What it does not see: the previous codebook (a reused codebook differs a little from the
fresh fit assumed here) and the sketch's bucket width (1 %: values near a midpoint may land
on the other side). ``tests/test_policy/test_estimate.py`` bounds the error against the
measured bytes; ``python benchmarks/bench_search.py`` reports it on its workloads. Same
input, same estimate: nothing depends on threads or on earlier calls.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np
import zstandard

from inshrink_store.cas import ZSTD_LEVEL, keyframe_body
from inshrink_store.codecs import _payload
from inshrink_store.codecs.nuq import nearest_index
from inshrink_store.policy.partition import Part

#: ids coded per sample: large enough that the coder's per-frame costs and its block
#: statistics are those of a big tensor (64 Ki ids were within 2.5 % of the 2 M ids they
#: stood for; 16 Ki ids up to 8 % off), small enough to code in well under a millisecond
SAMPLE = 1 << 16
#: ids of one zstd block (128 KiB): up to this many, the ids and the protected words that
#: follow them share a block and its Huffman table
BLOCK_IDS = 1 << 17


def level_counts(part: Part, codebook: np.ndarray) -> np.ndarray:
    """How many of the part's elements take each id: one count per centre (the rest by its
    sketch, the pruned on the centre nearest 0.0), then the protected count (id ``K``)."""
    centres = np.asarray(codebook, np.float64).astype(np.float32)
    reps, counts = part.sketch.histogram()
    per_level = np.zeros(centres.size, np.int64)
    if reps.size:
        ids = nearest_index(reps.astype(np.float32), centres)
        per_level += np.bincount(ids, weights=counts, minlength=centres.size).astype(np.int64)
    if part.pruned:
        per_level[int(nearest_index(np.zeros(1, np.float32), centres)[0])] += part.pruned
    return np.append(per_level, part.protected)


def _sample_counts(counts: np.ndarray, size: int) -> tuple[int, ...]:
    """``counts`` scaled to sum to ``size`` (largest remainders, ties to the lower id)."""
    total = int(counts.sum())
    exact = counts.astype(np.float64) * size / total
    scaled = np.floor(exact).astype(np.int64)
    short = size - int(scaled.sum())
    if short:
        order = np.lexsort((np.arange(counts.size), -(exact - scaled)))
        scaled[order[:short]] += 1
    return tuple(int(c) for c in scaled)


def _evenly(words: np.ndarray, count: int) -> np.ndarray:
    """``count`` of ``words`` taken at evenly spaced positions (all of them when count >= size)."""
    if count >= words.size:
        return words
    return words[np.linspace(0, words.size - 1, count).astype(np.int64)] if count else words[:0]


def _coded_sample_bytes(scaled: tuple[int, ...], words: np.ndarray | None, protected_dtype: str) -> int:
    """Bytes of the keyframe coder on a payload whose ids have exactly the counts ``scaled``
    (the last one the protected id), in an order drawn from a generator seeded with the
    counts (the same counts always give the same bytes), followed by as many of ``words``
    as there are protected ids (None: the ids alone)."""
    levels = len(scaled)
    width = _payload.id_width_for(levels)
    ids = np.repeat(np.arange(levels, dtype=_payload.id_dtype(width)), scaled)
    seed = int.from_bytes(hashlib.blake2b(np.asarray(scaled, np.int64).tobytes(), digest_size=8).digest(), "little")
    np.random.default_rng(seed).shuffle(ids)
    tail = b""
    if words is not None:
        kept = _evenly(words, scaled[-1])
        if kept.size < scaled[-1]:  # fewer words than protected ids (a part without them): zeros
            kept = np.concatenate([kept, np.zeros(scaled[-1] - kept.size, words.dtype)])
        tail = kept.astype(kept.dtype.newbyteorder("<")).tobytes()
    header = _payload.HEADER.pack(_payload.MAGIC, _payload.VERSION, width, _payload.PROTECTED_CODES[protected_dtype],
                                  0, ids.size, levels, 0 if words is None else scaled[-1])
    return len(keyframe_body(header + ids.tobytes() + tail)[1])


def _words_bytes(words: np.ndarray) -> int:
    """The protected words as the coder codes them in blocks of their own (zstd, or raw)."""
    raw = words.astype(words.dtype.newbyteorder("<")).tobytes()
    return min(len(raw), len(zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(raw))) if raw else 0


def coded_bytes(counts: np.ndarray, words: np.ndarray | None = None, protected_dtype: str = "bfloat16") -> int:
    """Bytes the store's keyframe coder takes for a payload whose ids have these per-id
    ``counts`` (the last is the protected id) and whose protected values are ``words``.

    The payload holds the ids, then the words. Up to :data:`BLOCK_IDS` ids, the coder sees
    both in one block, where the words' bytes disturb the ids' Huffman table: a sample of
    at most :data:`SAMPLE` ids with evenly chosen words is coded as one payload (exactly
    the payload's size when it is that small) and scaled. Beyond it, the ids fill blocks
    of their own: the ids' sample is coded alone and scaled, and the words are coded
    apart, every one of them (they are few)."""
    counts = np.asarray(counts, np.int64)
    words = np.zeros(0, np.uint16) if words is None else np.asarray(words)
    total = int(counts.sum())
    if total == 0:
        return _payload.HEADER_SIZE
    size = min(total, SAMPLE)
    scaled = _sample_counts(counts, size)
    if total <= BLOCK_IDS:
        coded = _coded_sample_bytes(scaled, words, protected_dtype)
        return coded if size == total else math.ceil(coded * total / size)
    return math.ceil(_coded_sample_bytes(scaled, None, protected_dtype) * total / size) + _words_bytes(words)


def estimated_bytes(part: Part, codebook: np.ndarray) -> int:
    """Estimated bytes the store keeps for one tensor quantized onto ``codebook`` (a keyframe)."""
    return coded_bytes(level_counts(part, codebook), part.protected_words, part.protected_dtype)
