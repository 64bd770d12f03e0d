"""How much each tensor's quantization error matters to the model's output: allocation weights.
Layer: refs, history and policy (the policy imports neither sibling), below ``parts``.

The allocation (:mod:`inshrink_store.policy.rate_distortion`) spends bytes where they remove
the most *cost*; without weights every tensor's relative error counts alike. That tracks a
convolutional network (a layer's relative weight error becomes about the same relative
error of its output) but not a transformer: measured on all-MiniLM-L6-v2 (the numbers are in
``docs/understanding/rate-distortion.md``), the same 16-level codebook on every attention
value projection costs 17x the embedding cosine that it costs on the query projections, and
the allocation, blind to that, gave queries and keys the bits the values and MLPs needed.

Two sources of weights, both normalised so that their mean over the priced tensors is 1
(a weight says "this tensor's error is worth w times the average one"):

- **Measured** (:func:`weights_from_fisher`): a diagonal Fisher ``F`` per element (mean
  squared gradient of a loss; for an encoder with no loss, of random projections of its
  output, which is the diagonal of ``J^T J``). A tensor quantized with relative squared error
  ``e2`` moves each element by about ``sqrt(e2 * mean(w^2))`` (k-means noise is about even
  over the elements), so the expected change of the loss or output is
  ``e2 * mean(w^2) * sum(F)``: the weight is ``mean(w^2) * sum(F)``.
  The Checkpointer has a gradient EMA ``g`` and uses ``F = g^2``.
- **From sensitivity** (:func:`weights_from_sensitivity`): the Checkpointer's ``|g * w|``
  per element (``g`` its gradient EMA); the weight is ``sum((g * w)^2)``, the same expected
  change for an error proportional to each weight's size.
- **By role** (:func:`role_weights`), when nothing was measured: embeddings, attention
  query/key, value, output projections, MLP in and out, heads, each priced by the table
  :data:`ROLE_WEIGHTS`, measured on a pretrained transformer encoder. A tensor whose name
  says no role (a convolution, an LSTM) weighs 1, so convolutional models allocate as before.

Everything here is a pure function of its inputs (same state, same weights, same bytes).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping

import numpy as np

from inshrink_store.errors import FormatError

#: role -> relative weight of its relative squared error. Measured on all-MiniLM-L6-v2 (mean
#: over its 6 layers of mean(w^2) * sum(F), F the diagonal of J^T J of the mean-pooled
#: sentence embedding over 64 calibration sentences, each role's mean divided by the
#: weighted mean over all roles; rounded): see docs/understanding/rate-distortion.md.
ROLE_WEIGHTS: dict[str, float] = {
    "embedding": 1.0,
    "position": 0.18,
    "attention.query_key": 0.12,
    "attention.value": 2.0,
    "attention.output": 0.64,
    "mlp.in": 2.4,
    "mlp.out": 1.0,
    "head": 1.0,  # not measured (a sentence encoder has none): priced as the average tensor
}

# (role, pattern over the tensor's dotted path, lower-cased); the first match wins, so the
# specific names (an attention block's "output.dense") come before the generic ones
_ROLE_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (role, re.compile(pattern)) for role, pattern in (
        ("position", r"(position_embed|pos_embed|\bwpe\b|embed_positions)"),
        ("embedding", r"(word_embed|token_embed|tok_embed|embed_tokens|\bwte\b|shared\.weight|embeddings?\.weight$|token_type_embed)"),
        ("attention.query_key", r"(\bquery\b|\bkey\b|\bq_proj\b|\bk_proj\b|\bq_lin\b|\bk_lin\b|\bwq\b|\bwk\b|\bto_q\b|\bto_k\b)"),
        ("attention.value", r"(\bvalue\b|\bv_proj\b|\bv_lin\b|\bwv\b|\bto_v\b|\bc_attn\b|\bqkv\b|in_proj)"),
        ("attention.output", r"(attention\.output\.dense|\bo_proj\b|\bout_proj\b|\bout_lin\b|attn\.c_proj|attention\.wo\b|\bto_out\b)"),
        ("mlp.in", r"(intermediate\.dense|\bfc1\b|\bup_proj\b|\bgate_proj\b|\bc_fc\b|\blin1\b|\bw1\b|\bw3\b|\bwi\b|\bwi_[01]\b)"),
        ("mlp.out", r"(output\.dense|\bfc2\b|\bdown_proj\b|mlp\.c_proj|\blin2\b|\bw2\b|\bwo\b)"),
        ("head", r"(lm_head|\bclassifier\b|\bhead\b|\bcls\b|\bpooler\b)"),
    ))


def role_of(path: str, module_kind: str | None = None) -> str | None:
    """The transformer role a tensor's name (or its module's class, for ``Embedding``) says it
    plays, or None (a convolution, an LSTM, a name we do not know)."""
    name = path.lower().replace("/", ".")
    for role, pattern in _ROLE_PATTERNS:
        if pattern.search(name):
            return role
    if module_kind is not None and "embedding" in module_kind.lower():
        return "embedding"
    return None


def _normalised(raw: Mapping[str, float]) -> dict[str, float]:
    """Weights scaled to mean 1 (a floor of 1e-6 of the mean: a tensor the calibration never
    reached is still priced a little, never free)."""
    if not raw:
        return {}
    mean = sum(raw.values()) / len(raw)
    if not mean > 0 or not math.isfinite(mean):
        return dict.fromkeys(raw, 1.0)
    return {p: max(v / mean, 1e-6) for p, v in raw.items()}


def role_weights(paths: Iterable[str], module_kinds: Mapping[str, str] | None = None) -> dict[str, float]:
    """Each path's weight by its role (:data:`ROLE_WEIGHTS`; 1 without one). When no path has
    a role the weights are all 1: the allocation of a non-transformer is unchanged."""
    kinds = module_kinds or {}
    paths = list(paths)
    roles = {p: role_of(p, kinds.get(p)) for p in paths}
    return {p: (ROLE_WEIGHTS[r] if r is not None else 1.0) for p, r in roles.items()}


def weights_from_fisher(fisher: Mapping[str, np.ndarray], tensors: Mapping[str, np.ndarray],
                        paths: Iterable[str] | None = None, rows_seen: Mapping[str, float] | None = None) -> dict[str, float]:
    """Measured weights: ``mean(w^2) * sum(F)`` per tensor, normalised to mean 1 over
    ``paths`` (default: the paths of ``fisher``). ``fisher[p]`` is the diagonal Fisher (or
    ``J^T J``) of tensor ``p``, same shape as it. ``rows_seen``: for an embedding, the fraction
    of its rows the calibration used (a token it never saw has zero gradient, yet the next
    text will use it): its sum is divided by that fraction, as if every row were used alike."""
    paths = list(fisher) if paths is None else list(paths)
    raw = {}
    for p in paths:
        if p not in fisher:
            raise FormatError(f"Expected a Fisher diagonal for tensor {p!r}. Got none instead.")
        f, w = np.asarray(fisher[p], np.float64), np.asarray(tensors[p], np.float64)
        if f.shape != w.shape:
            raise FormatError(f"Expected the Fisher diagonal of tensor {p!r} to have its shape {w.shape}. "
                              f"Got {f.shape} instead.")
        if not np.all(np.isfinite(f)) or np.any(f < 0):
            raise FormatError(f"Expected a finite, non-negative Fisher diagonal for tensor {p!r}. Got "
                              "negative or non-finite entries instead.")
        seen = 1.0 if rows_seen is None else float(rows_seen.get(p, 1.0))
        finite = w[np.isfinite(w)]
        mean_sq = float(np.mean(finite * finite)) if finite.size else 0.0
        raw[p] = mean_sq * float(f.sum()) / max(seen, 1e-9)
    return _normalised(raw)


def weights_from_sensitivity(sensitivity: Mapping[str, np.ndarray], paths: Iterable[str]) -> dict[str, float] | None:
    """Weights ``sum(s^2)`` per tensor from ``|g * w|`` scores, normalised to mean 1; None
    when a path has no score (weights from two sources would not be comparable)."""
    raw = {}
    for p in paths:
        if p not in sensitivity:
            return None
        s = np.asarray(sensitivity[p], np.float64)
        total = float(np.einsum("i,i->", s.ravel(), s.ravel())) if s.size else 0.0
        if not math.isfinite(total):
            return None
        raw[p] = total
    return _normalised(raw)
