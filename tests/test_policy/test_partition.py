"""Prune / protect / quantize on whole states, and the QuantConfig contract."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inshrink_store.errors import FormatError
from inshrink_store.policy import QuantConfig, TensorInput, layer_type, quantize_state
from inshrink_store.policy.partition import fit_codebook


def _state(seed: int, n: int = 3, shape=(64, 128)):
    rng = np.random.default_rng(seed)
    return {f"w{i}": TensorInput((rng.standard_normal(shape) * 0.02 * (i + 1)).astype(np.float32), "F32")
            for i in range(n)}


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 1000), bins=st.sampled_from([4, 8, 16, 32]),
       prune=st.sampled_from([0.0, 0.1, 0.3, 0.5]), protect=st.sampled_from([0.0005, 0.005, 0.01]))
def test_values_are_centres_zero_or_protected_and_fractions_hold(seed, bins, prune, protect):
    config = QuantConfig(bins=bins, prune=prune, protect=protect)
    state = _state(seed)
    out = quantize_state(state, config)
    total_pruned = 0.0
    for name, q in out.items():
        w = state[name].values
        centres = set(np.float32(q.codebook).tolist())
        assert len(q.codebook) <= bins and list(q.codebook) == sorted(q.codebook)
        if prune > 0:
            assert 0.0 in centres
        quantized = np.isin(q.values, list(centres))
        # anything not a centre is a protected value, rounded to bfloat16
        assert quantized.sum() >= w.size * (1 - 2 * protect) - 1
        assert q.stats["protected_fraction"] <= 2 * protect + 1 / w.size
        total_pruned += q.stats["pruned_fraction"] * w.size
    total = sum(t.values.size for t in state.values())
    # one pooled threshold: the fraction holds over the layer type, within the sketch's resolution
    assert abs(total_pruned / total - prune) <= 0.03


def test_pruning_threshold_is_pooled_per_layer_type():
    rng = np.random.default_rng(0)
    small = TensorInput((rng.standard_normal((64, 64)) * 0.001).astype(np.float32), "F32", "linear")
    large = TensorInput((rng.standard_normal((64, 64)) * 1.0).astype(np.float32), "F32", "linear")
    out = quantize_state({"small": small, "large": large}, QuantConfig(prune=0.5, protect=0.0005))
    # pooled: the small-magnitude tensor takes almost all the pruning
    assert out["small"].stats["pruned_fraction"] > 0.9 and out["large"].stats["pruned_fraction"] < 0.1


def test_sensitivity_top_is_protected():
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((64, 64)) * 0.02).astype(np.float32)
    sens = np.zeros_like(w)
    sens[3, 5] = 100.0  # a small weight the model is very sensitive to
    w[3, 5] = 1e-4
    out = quantize_state({"w": TensorInput(w, "F32", sensitivity=sens)}, QuantConfig(prune=0.5, protect=0.0005))
    assert out["w"].values[3, 5] == pytest.approx(1e-4, rel=1e-2)


def test_deterministic():
    a = quantize_state(_state(3), QuantConfig(prune=0.2))
    b = quantize_state(_state(3), QuantConfig(prune=0.2))
    assert all(np.array_equal(a[k].values, b[k].values) and a[k].codebook == b[k].codebook for k in a)


def test_codebook_reuse_small_drift_and_refit_after_a_shift():
    rng = np.random.default_rng(2)
    w = rng.standard_normal(50_000) * 0.02
    first, _ = fit_codebook(w, 16, include_zero=True)
    again, reused = fit_codebook(w + rng.standard_normal(w.size) * 1e-4, 16, include_zero=True,
                                 previous=tuple(first))
    assert reused and np.array_equal(again, first)
    shifted, reused = fit_codebook(w * 5 + 0.3, 16, include_zero=True, previous=tuple(first))
    assert not reused


def test_layer_type_from_module_kind_or_shape():
    assert layer_type((10, 4), "Embedding") == "embedding"
    assert layer_type((8, 3, 3, 3), "Conv2d") == "conv"
    assert layer_type((8,), "LayerNorm") == "norm"
    assert layer_type((10, 4)) == "linear" and layer_type((8, 3, 3, 3)) == "conv"


def test_embeddings_use_embedding_bins():
    w = (np.random.default_rng(0).standard_normal((100, 64)) * 0.1).astype(np.float32)
    out = quantize_state({"e": TensorInput(w, "F32", "embedding")}, QuantConfig(bins=4, embedding_bins=32))
    assert len(out["e"].codebook) == 32


def test_config_json_round_trip_and_validation():
    config = QuantConfig(bins=8, prune=0.3, prune_metric="sensitivity", protect=0.01)
    assert QuantConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    for bad in ({"bins": 1}, {"prune": 1.5}, {"prune_metric": "random"}, {"protect": -0.1},
                {"protected_dtype": "float16"}):
        with pytest.raises(FormatError):
            QuantConfig(**bad)
    with pytest.raises(FormatError):
        QuantConfig.from_dict({"bins": 8, "colour": "red"})


def test_mismatched_sensitivity_shape_names_the_tensor():
    w = np.zeros((8, 8), np.float32)
    with pytest.raises(FormatError, match="'w'"):
        quantize_state({"w": TensorInput(w, "F32", sensitivity=np.zeros(3))}, QuantConfig())
