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

from inshrink_store.cas import keyframe_body
from inshrink_store.codecs import _payload
from inshrink_store.codecs.nuq import nearest_index
from inshrink_store.policy.partition import Part, coded_words_bytes, evenly

#: ids coded per sample: large enough that the coder's per-frame costs and its block
#: statistics are those of a big tensor (64 Ki ids were within 2.5 % of the 2 M ids they
#: stood for; 16 Ki ids up to 8 % off), small enough to code in well under a millisecond
SAMPLE = 1 << 16
#: zstd's largest block (128 KiB): while the ids fit one, the protected words that follow
#: them share its Huffman table (ids packed two to a byte fit twice as many; not modelled)
BLOCK_BYTES = 1 << 17


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
        kept = evenly(words, scaled[-1])
        if kept.size < scaled[-1]:  # fewer words than protected ids (none given): zero words
            kept = np.concatenate([kept, np.zeros(scaled[-1] - kept.size, _payload.protected_word(protected_dtype))])
        tail = kept.astype(kept.dtype.newbyteorder("<")).tobytes()
    header = _payload.HEADER.pack(_payload.MAGIC, _payload.VERSION, width, _payload.PROTECTED_CODES[protected_dtype],
                                  0, ids.size, levels, 0 if words is None else scaled[-1])
    return len(keyframe_body(header + ids.tobytes() + tail)[1])


def coded_bytes(counts: np.ndarray, words: np.ndarray | None = None, protected_dtype: str = "bfloat16",
                words_bytes: int | None = None) -> int:
    """Bytes the store's keyframe coder takes for a payload whose ids have these per-id
    ``counts`` (the last is the protected id) and whose protected values are ``words``
    (``words_bytes``: all of them coded alone, when ``words`` are only a sample of them).

    The payload holds the ids, then the words. While the ids fit one zstd block
    (:data:`BLOCK_BYTES`), the coder sees both in one block, where the words' bytes disturb
    the ids' Huffman table: a sample of at most :data:`SAMPLE` ids with evenly chosen words
    is coded as one payload (exactly the payload's size when it is that small) and scaled.
    Beyond it, the ids fill blocks of their own: the ids' sample is coded alone and scaled,
    and the words are coded apart."""
    counts = np.asarray(counts, np.int64)
    words = np.zeros(0, _payload.protected_word(protected_dtype)) if words is None else np.asarray(words)
    total = int(counts.sum())
    if total == 0:
        return _payload.HEADER_SIZE
    size = min(total, SAMPLE)
    scaled = _sample_counts(counts, size)
    if total * _payload.id_width_for(len(counts)) <= BLOCK_BYTES:
        coded = _coded_sample_bytes(scaled, words, protected_dtype)
        return coded if size == total else math.ceil(coded * total / size)
    apart = coded_words_bytes(words) if words_bytes is None else words_bytes
    return math.ceil(_coded_sample_bytes(scaled, None, protected_dtype) * total / size) + apart


def estimated_bytes(part: Part, codebook: np.ndarray) -> int:
    """Estimated bytes the store keeps for one tensor quantized onto ``codebook`` (a keyframe)."""
    return coded_bytes(level_counts(part, codebook), part.protected_words, part.protected_dtype, part.protected_bytes)
