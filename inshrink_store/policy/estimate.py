"""A candidate's stored bytes estimated from a sample of each tensor, without quantizing the model.
Layer: refs, history and policy (the policy imports neither sibling), below ``parts``.

Why: the search ranks every configuration it looks at by compression ratio, but it
evaluates only a few of them. Measuring a ratio used to mean quantizing the whole model,
encoding it and compressing it; that was most of the search's time. Per tensor the
estimate needs three things, each cheap once the tensor's part is known (a
:class:`~inshrink_store.policy.partition.Part`, shared by every configuration with the same
protect / prune / metric):

- the codebook: fitted afresh to the part's sketch, as a tensor without history gets it;
- the level ids of a sample: :data:`~inshrink_store.policy.partition.SAMPLE_BLOCKS` evenly
  spaced runs of contiguous elements, 64 Ki in all (the whole tensor when it is smaller),
  given the masks the whole tensor's own cuts and threshold give them
  (:meth:`~inshrink_store.policy.partition.StateQuantizer.sample`) and their nearest
  centres. Runs, because what the coder makes of ids depends on their layout: pruning by
  sensitivity zeroes whole rows and columns (a frozen layer's inputs, pixels that are
  always blank), and zstd codes those runs as matches. An earlier estimate coded ids drawn
  independently with the right frequencies: it was within 3 % on unstructured tensors but
  priced such tensors 20 % too high, and the search chose worse configurations for them;
- the bytes: the sample is coded by the very function that codes a stored keyframe
  (:func:`inshrink_store.object_format.keyframe_body`: zstd, nibble-packed ids when smaller) and
  scaled to the tensor. The payload holds the ids, then the protected words: while the ids
  fit one zstd block (:data:`BLOCK_BYTES`) the coder sees both in one block, where the
  words' bytes disturb the ids' Huffman table, so the sample is coded with its own words;
  beyond it the ids fill blocks of their own, and every protected word of the tensor,
  coded alone when the part was made, is added.

What it does not see: the previous codebook (a reused codebook differs a little from the
fresh fit assumed here), and structure longer than a run. ``tests/test_policy/test_estimate.py``
bounds the error against the measured bytes; ``python benchmarks/bench_search.py`` reports
it on its workloads. Same input, same estimate: nothing depends on threads or earlier calls.
"""

from __future__ import annotations

import math

import numpy as np

from inshrink_store import dtypes
from inshrink_store.codecs import _payload
from inshrink_store.codecs.nuq import nearest_index
from inshrink_store.object_format import keyframe_body
from inshrink_store.policy.partition import Part, TensorSample

#: zstd's largest block (128 KiB): while the ids fit one, the protected words that follow
#: them share its Huffman table (ids packed two to a byte fit twice as many; not modelled)
BLOCK_BYTES = 1 << 17


def sample_payload(sample: TensorSample, codebook: np.ndarray, protected_dtype: str, words: bool = True) -> bytes:
    """The quantized payload of the sampled elements on ``codebook``: nearest centre, the
    pruned on the centre nearest 0.0, the protected on the protected id, followed by their
    words in ``protected_dtype`` (``words=False``: the ids alone)."""
    centres = np.asarray(codebook, np.float64).astype(np.float32)
    levels = centres.size + 1
    width = _payload.id_width_for(levels)
    ids: np.ndarray = nearest_index(sample.values, centres).astype(_payload.id_dtype(width))  # numpy in, numpy out
    if sample.pruned.any():
        ids[sample.pruned] = nearest_index(np.zeros(1, np.float32), centres)[0]
    ids[sample.protected] = levels - 1
    kept = sample.values[sample.protected] if words else sample.values[:0]
    tail = dtypes.by_codec_name(protected_dtype).from_float32(kept)
    header = _payload.HEADER.pack(_payload.MAGIC, _payload.VERSION, width, _payload.PROTECTED_CODES[protected_dtype],
                                  0, ids.size, levels, int(kept.size))
    return header + ids.tobytes() + tail.astype(tail.dtype.newbyteorder("<")).tobytes()


def estimated_bytes(part: Part, codebook: np.ndarray, sample: TensorSample) -> int:
    """Estimated bytes the store keeps for one tensor quantized onto ``codebook`` (a keyframe)."""
    taken = sample.values.size
    if taken == 0:
        return _payload.HEADER_SIZE
    width = _payload.id_width_for(len(codebook) + 1)
    if sample.size * width <= BLOCK_BYTES or taken == sample.size:
        coded = len(keyframe_body(sample_payload(sample, codebook, part.protected_dtype))[1])
        return coded if taken == sample.size else math.ceil(coded * sample.size / taken)
    ids_alone = len(keyframe_body(sample_payload(sample, codebook, part.protected_dtype, words=False))[1])
    return math.ceil(ids_alone * sample.size / taken) + part.protected_bytes
