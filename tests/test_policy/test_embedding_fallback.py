"""When no point of the cube is feasible because the embedding table needs more levels, the
search tries again with 32 embedding levels instead of storing the whole model lossless."""

from __future__ import annotations

from typing import Any

import numpy as np

from inshrink_store.policy import QuantConfig, SearchPolicy
from inshrink_store.policy.candidates import Candidates
from inshrink_store.policy.search import SearchSpace

SPACE = SearchSpace(bins=(4, 8), prune=(0.0, 0.2), protect=(0.005,))


def _state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"model/emb.weight": rng.standard_normal((512, 32), dtype=np.float32),
            "model/proj.weight": rng.standard_normal((128, 64), dtype=np.float32)}


def _candidates(kinds: dict[str, str]) -> Candidates:
    state = _state()
    return Candidates(state, dict.fromkeys(state, "F32"), {}, module_kinds=kinds)


def _needs_wide_embeddings(plans: Any) -> float:
    """Quality 1 unless the embedding table is stored with fewer than 32 levels (a model whose
    embeddings are what the tolerance cannot afford); the other tensors may go as low as they like."""
    if plans is None:
        return 1.0
    return 1.0 if len(plans["model/emb.weight"].serializer.codebook) >= 32 else 0.0


def test_an_infeasible_cube_is_searched_again_with_wider_embeddings() -> None:
    policy = SearchPolicy(tolerance=0.05, space=SPACE, optimizer=None)
    decision = policy.decide(_candidates({"model/emb.weight": "Embedding", "model/proj.weight": "Linear"}),
                             _needs_wide_embeddings)
    record = decision.record
    assert record.config is not None and record.config.embedding_bins == 32
    assert record.search is not None and record.search.mode == "embeddings"
    assert decision.plans is not None and len(decision.plans["model/emb.weight"].serializer.codebook) == 32
    assert len(decision.plans["model/proj.weight"].serializer.codebook) <= 8  # the rest still compressed
    # the next checkpoint starts from the levels the embeddings needed: no failed search first
    again = policy.decide(_candidates({"model/emb.weight": "Embedding", "model/proj.weight": "Linear"}),
                          _needs_wide_embeddings, previous=record.config)
    assert again.record.search is not None and again.record.search.mode in ("neighbourhood", "predicted")  # budgeted: predicted
    assert again.record.config is not None and again.record.config.embedding_bins == 32


def test_without_an_embedding_table_nothing_feasible_is_still_lossless() -> None:
    policy = SearchPolicy(tolerance=0.05, space=SPACE, optimizer=None)
    decision = policy.decide(_candidates({"model/emb.weight": "Linear", "model/proj.weight": "Linear"}),
                             lambda plans: 1.0 if plans is None else 0.0)
    assert decision.record.config is None and decision.plans is None
    assert decision.record.search is not None and decision.record.search.mode in ("full", "predicted")  # budgeted: predicted


def test_the_second_search_keeps_to_the_evaluation_budget() -> None:
    calls: list[int] = []

    def evaluate(plans: Any) -> float:
        calls.append(1)
        return _needs_wide_embeddings(plans)

    policy = SearchPolicy(tolerance=0.05, space=SPACE, optimizer=None, max_evaluations=3)
    policy.decide(_candidates({"model/emb.weight": "Embedding", "model/proj.weight": "Linear"}), evaluate)
    assert len(calls) <= 3 + 1  # plus the unquantized baseline
    base = QuantConfig(embedding_bins=32)
    assert SearchPolicy(base=base).base_after(QuantConfig(embedding_bins=16)).embedding_bins == 32
