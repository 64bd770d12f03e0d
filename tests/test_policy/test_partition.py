"""Prune / protect / quantize on whole states, codebook reuse, and the QuantConfig contract.

Tolerances stated and tested:
- protected fraction: at least round(protect n) / n and at most 2 round(protect n) / n
  (union of two top sets; continuous random data has no ties);
- pruned fraction, pooled over a layer type: within the mass of the one sketch bucket
  holding the pooled threshold (plus one element) of ``prune``, since the threshold is
  that bucket's representative; protected elements are never pruned.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inshrink_store import dtypes
from inshrink_store.codecs.nuq import nearest_index
from inshrink_store.errors import FormatError
from inshrink_store.policy import QuantConfig
from inshrink_store.policy.codebook_choice import sketch_sq_errors
from inshrink_store.policy.kmeans import fit_codebook
from inshrink_store.policy.partition import (
    PartitionCache,
    StateQuantizer,
    TensorInput,
    layer_type,
    protected_mask,
    prune_thresholds,
    quantize_state,
)
from inshrink_store.policy.sketch import LogSketch

SHAPES = [(64, 128), (32, 200), (8, 4, 3, 3, 4)]


def _state(seed: int, sensitivity: bool = False) -> dict[str, TensorInput]:
    rng = np.random.default_rng(seed)
    out = {}
    for i, shape in enumerate(SHAPES):
        w = (rng.standard_normal(shape) * 0.02 * (i + 1)).astype(np.float32)
        s = np.abs(w * rng.standard_normal(shape)).astype(np.float32) if sensitivity else None
        out[f"w{i}"] = TensorInput(w, "F32", sensitivity=s)
    return out


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 1000), bins=st.sampled_from([4, 6, 8, 16, 32]),
       prune=st.sampled_from([0.0, 0.1, 0.3, 0.5]), protect=st.sampled_from([0.0, 0.0005, 0.005, 0.01]),
       metric=st.sampled_from(["magnitude", "sensitivity"]), sens=st.booleans())
def test_values_are_centres_zero_or_protected_and_fractions_hold(seed, bins, prune, protect, metric, sens):
    config = QuantConfig(bins=bins, prune=prune, protect=protect, prune_metric=metric, min_numel=1024)
    state = _state(seed, sens)
    out = quantize_state(state, config)
    assert sorted(out) == sorted(state)
    for name, q in out.items():
        w = state[name].values
        book = np.asarray(q.codebook)
        assert 1 <= book.size <= bins and np.all(np.diff(book) > 0) and q.stats["levels"] == book.size
        assert prune == 0 or 0.0 in book  # pruning on: 0.0 is a centre
        assert np.array_equal(book.astype(np.float32).astype(np.float64), book)  # exact in F32
        on_centre = np.isin(q.values, book.astype(np.float32))
        protected = ~on_centre  # everything off the codebook is a bfloat16-rounded original
        assert np.array_equal(q.values[protected], dtypes.round_bf16(w[protected]))
        count = round(protect * w.size)
        n_prot = q.stats["protected_fraction"] * w.size
        assert count <= n_prot <= (2 if sens else 1) * count
        # the top |w| are protected whatever else happens
        # the top |w| and (when given) the top |g*w| are protected whatever else happens
        for scores in ([w] + ([state[name].sensitivity] if sens else [])):
            top = np.argsort(np.abs(scores).ravel())[w.size - count:]
            assert np.array_equal(q.values.ravel()[top], dtypes.round_bf16(w.ravel()[top]))
        assert q.stats["rel_l2_error"] == pytest.approx(
            np.linalg.norm((w - q.values).astype(np.float64)) / np.linalg.norm(w.astype(np.float64)), rel=1e-6)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 1000), prune=st.sampled_from([0.1, 0.2, 0.4, 0.5]),
       metric=st.sampled_from(["magnitude", "sensitivity"]))
def test_one_pooled_threshold_per_layer_type(seed, prune, metric):
    """Each layer type has one threshold: the quantile of all its tensors' scores together;
    every unprotected element at or below it is 0.0 in every tensor of the type, and the
    pooled count below it is within one sketch bucket's mass of ``prune``."""
    state = _state(seed, sensitivity=True)
    config = QuantConfig(prune=prune, prune_metric=metric, protect=0.005, min_numel=1024)
    out = quantize_state(state, config)
    thresholds = prune_thresholds(state, config)
    assert sorted(thresholds) == [("conv", metric), ("linear", metric)]
    for lt in ("linear", "conv"):
        names = [n for n, t in state.items() if t.layer_type == lt]
        scores = {n: np.abs(state[n].sensitivity if metric == "sensitivity" else state[n].values) for n in names}
        pooled = np.concatenate([scores[n].ravel() for n in names])
        sketch = LogSketch.from_values(pooled)
        t = thresholds[(lt, metric)]
        assert t == sketch.quantile(prune)  # merged per-tensor sketches == sketch of the pooled scores
        n_pruned = 0
        for n in names:
            assert out[n].stats["prune_threshold"] == t
            prot = protected_mask(state[n].values, state[n].sensitivity, config.protect)
            assert np.all(out[n].values[(scores[n] <= t) & ~prot] == 0.0)
            n_pruned += round(out[n].stats["pruned_fraction"] * scores[n].size)
        below = np.count_nonzero(pooled <= t)
        key = np.ceil(np.log2(t) / np.log2(sketch.gamma))
        slack = int(sketch.pos_counts[sketch.pos_keys == key].sum()) + 1
        assert abs(below - prune * pooled.size) <= slack
        assert n_pruned <= below


def test_pooling_makes_the_small_tensor_take_the_pruning():
    rng = np.random.default_rng(0)
    small = TensorInput((rng.standard_normal((64, 64)) * 0.001).astype(np.float32), "F32", "linear")
    large = TensorInput((rng.standard_normal((64, 64)) * 1.0).astype(np.float32), "F32", "linear")
    other = TensorInput((rng.standard_normal((64, 64)) * 1.0).astype(np.float32), "F32", "embedding")
    out = quantize_state({"small": small, "large": large, "emb": other}, QuantConfig(prune=0.5, protect=0.0005))
    assert out["small"].stats["pruned_fraction"] > 0.9 and out["large"].stats["pruned_fraction"] < 0.1
    assert 0.45 < out["emb"].stats["pruned_fraction"] < 0.55  # its own type, its own threshold


def test_sensitivity_top_is_protected_even_for_a_small_weight():
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((64, 64)) * 0.02).astype(np.float32)
    sens = rng.random((64, 64)).astype(np.float32) * 1e-3
    top = [(3, 5), (10, 11)]
    for i, j in top:
        sens[i, j] = 100.0  # small weights the model is very sensitive to
        w[i, j] = 1e-4
    out = quantize_state({"w": TensorInput(w, "F32", sensitivity=sens)},
                         QuantConfig(prune=0.5, protect=0.0005))
    for i, j in top:
        assert out["w"].values[i, j] == dtypes.round_bf16(np.float32([1e-4]))[0]


def test_skips_what_stays_lossless_and_keeps_nonfinite():
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((64, 64)) * 0.02).astype(np.float32)
    w[0, 0], w[1, 1], w[2, 2] = np.nan, np.inf, -np.inf
    state = {"w": TensorInput(w), "bias": TensorInput(np.ones(5000, np.float32)),
             "tiny": TensorInput(np.ones((4, 4), np.float32)), "ints": TensorInput(np.ones((64, 64), np.int64))}
    out = quantize_state(state, QuantConfig(min_numel=1000))
    assert list(out) == ["w"]
    v = out["w"].values
    assert np.isnan(v[0, 0]) and v[1, 1] == np.inf and v[2, 2] == -np.inf
    assert np.isfinite(out["w"].stats["rel_l2_error"])


def test_deterministic_and_dtype_exact_codebooks():
    a = quantize_state(_state(3, True), QuantConfig(prune=0.2, min_numel=1024))
    b = quantize_state(_state(3, True), QuantConfig(prune=0.2, min_numel=1024))
    assert all(np.array_equal(a[k].values, b[k].values) and a[k].codebook == b[k].codebook for k in a)
    w = (np.random.default_rng(4).standard_normal((64, 64)) * 0.02)
    for dtype, cast in (("F16", np.float16), ("BF16", None)):
        vals = w.astype(np.float16).astype(np.float32) if cast else dtypes.round_bf16(w.astype(np.float32))
        q = quantize_state({"w": TensorInput(vals, dtype)}, QuantConfig(bins=32))["w"]
        book = np.float32(q.codebook)
        through = book.astype(np.float16).astype(np.float32) if cast else dtypes.round_bf16(book)
        assert np.array_equal(through, book)


def _reuse(w0, w1, **kw):
    config = QuantConfig(bins=16, prune=0.2, protect=0.005, **kw)
    first = quantize_state({"w": TensorInput(w0)}, config)["w"]
    second = quantize_state({"w": TensorInput(w1)}, config, previous={"w": np.asarray(first.codebook)})["w"]
    return first, second


def _reuse_margin(state: dict[str, TensorInput], config: QuantConfig, previous: np.ndarray) -> tuple[float, float]:
    """(previous codebook's, fresh fit's) squared errors on the rest's sketch: the numbers the
    reuse test compares."""
    plan = StateQuantizer(state, config, {"w": previous})
    err_fresh, err_prev = sketch_sq_errors(plan.part("w").sketch, [plan.fresh_codebook("w"), previous])
    return err_prev, err_fresh


def _levelled(rng: np.random.Generator) -> np.ndarray:
    """Weights gathered round 15 levels 0.007 apart (spread 4e-4), a quarter held at exactly 0."""
    levels = np.array([-7, -6, -5, -4, -3, -2, -1, 1, 2, 3, 4, 5, 6, 7, 8], np.float64) * 0.007
    ids = rng.integers(0, 20, (256, 256))
    near = levels[np.maximum(ids - 5, 0)] + rng.standard_normal(ids.shape) * 4e-4
    return np.where(ids >= 5, near, 0.0).astype(np.float32)


def test_codebook_reused_after_small_drift_and_ids_mostly_unchanged():
    """A drift far smaller than the weights' structure keeps the codebook, with the margin shown.

    The reuse test compares the previous codebook's squared error with that of a fresh fit
    to the new values, and a fresh fit is one local optimum of k-means, drawn by starts
    seeded from a hash of the sketch. On unstructured (Gaussian) weights several optima lie
    within a few % of each other in the fit's weighted loss but up to 15 % apart in squared
    error, and a drift of 0.5 % moves the hash, so whether the first fit's optimum beats
    the second's within the 10 % tolerance is a draw: this test used to fit N(0, 0.02)
    weights with seed 2 and failed (0.2017 against 0.1746, 1.155x) or passed as the last
    bit of the bucket representatives fell, which np.power made depend on the CPU (Intel's
    SVML on AVX-512, the C library's pow elsewhere). Here the weights sit near 15 levels
    0.007 apart (as after a quantized save or quantization-aware training) and drift by
    1e-4, so every fit lands on the same levels, to within the sketch's 2 % buckets: the
    previous codebook's error is 1.030x a fresh fit's here, between 0.98x and 1.034x over
    40 seeds and 30 hashes perturbed by a last bit, asserted under 1.05x, well inside the
    1.10 tolerance, so reuse must happen. The Gaussian case is kept below as a test of the
    rule itself."""
    rng = np.random.default_rng(2)
    w = _levelled(rng)
    drift = np.where(w != 0, w + rng.standard_normal(w.shape) * 1e-4, 0.0).astype(np.float32)
    config = QuantConfig(bins=16, prune=0.2, protect=0.005)
    first, second = _reuse(w, drift)
    err_prev, err_fresh = _reuse_margin({"w": TensorInput(drift)}, config, np.asarray(first.codebook))
    assert err_prev <= 1.05 * err_fresh < config.codebook_reuse_tolerance * err_fresh
    assert second.stats["codebook_reused"] and second.codebook == first.codebook
    assert len(first.codebook) == 16 and 0.0 in first.codebook  # 15 levels and the pruned zeros
    book = np.float32(first.codebook)
    same = nearest_index(first.values, book) == nearest_index(second.values, book)
    assert same.mean() > 0.95
    # and the reused codebook is within the tolerance of a fresh fit's error
    fresh = quantize_state({"w": TensorInput(drift)}, QuantConfig(bins=16, prune=0.2))["w"]
    assert second.stats["rel_l2_error"] <= np.sqrt(1.10) * fresh.stats["rel_l2_error"] + 1e-6


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 16, 23])
def test_codebook_reuse_follows_the_rule_whichever_optimum_the_fits_land_in(seed: int) -> None:
    """Gaussian weights and a 0.5 % drift: the fresh fits of the two versions may land in
    different local optima, so reuse is not guaranteed (5 seeds of 0..39 are refitted when
    written, 16 and 23 among these, at 1.101x and 1.134x); the rule is. The previous codebook
    is reused exactly when its error is within the tolerance of a fresh fit's, and a
    codebook that is not reused is within the tolerance of a fresh fit's."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((256, 256)) * 0.02).astype(np.float32)
    drift = w + (rng.standard_normal(w.shape) * 1e-4).astype(np.float32)
    config = QuantConfig(bins=16, prune=0.2, protect=0.005)
    first, second = _reuse(w, drift)
    state = {"w": TensorInput(drift)}
    err_prev, err_fresh = _reuse_margin(state, config, np.asarray(first.codebook))
    tolerance = config.codebook_reuse_tolerance
    assert second.stats["codebook_reused"] == (err_prev <= tolerance * err_fresh)
    assert (second.codebook == first.codebook) == second.stats["codebook_reused"]
    sketch = StateQuantizer(state, config).part("w").sketch
    assert sketch_sq_errors(sketch, [np.array(second.codebook, np.float64)])[0] <= tolerance * err_fresh


def _irwin_hall(seed: int, shape: tuple[int, int]) -> np.ndarray:
    """Near-normal weights from sums of uniforms: IEEE arithmetic on random bits only, the same
    float32 values on every machine (no logarithm or exponential in their making)."""
    u = np.random.default_rng(seed).random((4, *shape))
    return ((u.sum(axis=0) - 2.0) * 0.02).astype(np.float32)


def test_codebooks_are_the_same_on_every_machine():
    """Same input, same codebook, whatever the CPU: pinned centres (float32 bits).

    Fitting uses IEEE-754 arithmetic only (sketch keys from a log2 that is exact enough
    for every float32, tested in tests/test_codecs/test_xp_path.py; bucket values by
    multiplication, :func:`inshrink_store.policy.sketch.gamma_powers`), so these bits are
    the same on every machine. Before, the bucket values came from np.power, whose last bit
    differs on a CPU with AVX-512; they seed k-means++ through a hash, so another machine
    fitted other centres (and stored other bytes) from the same tensor. A deliberate change
    to the fit changes these bits too: re-pin them then, and say so."""
    w = _irwin_hall(7, (128, 128))
    drift = w + (_irwin_hall(8, (128, 128)) * 0.005).astype(np.float32)
    first, second = _reuse(w, drift)
    assert [f"{np.float32(c).view(np.uint32).item():08x}" for c in first.codebook] == [
        "bce945f7", "bccb0f01", "bcab5986", "bc8dd9ea", "bc6861d6", "bc3757bd", "bc02d864", "bb98757d",
        "00000000", "3b9427d7", "3bfdc2c5", "3c382132", "3c722b1a", "3c983238", "3cbba0f7", "3ce2c9c3",
    ]
    assert second.stats["codebook_reused"] and second.codebook == first.codebook  # the same decision too


def test_codebook_refit_after_a_big_shift_and_tolerance_is_respected():
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((256, 256)) * 0.02).astype(np.float32)
    first, second = _reuse(w, w * 3 + np.float32(0.05))
    assert not second.stats["codebook_reused"] and second.codebook != first.codebook
    # a huge tolerance reuses anything of the right size
    _, lax = _reuse(w, w * 3 + np.float32(0.05), codebook_reuse_tolerance=1e9)
    assert lax.stats["codebook_reused"]
    # a codebook of another size is never reused
    other = quantize_state({"w": TensorInput(w)}, QuantConfig(bins=8, prune=0.2),
                           previous={"w": np.asarray(first.codebook)})["w"]
    assert not other.stats["codebook_reused"] and len(other.codebook) <= 8


def test_layer_type_from_module_kind_or_shape_never_names():
    assert layer_type((10, 4), "Embedding") == "embedding"
    assert layer_type((8, 3, 3, 3), "Conv2d") == "conv"
    assert layer_type((768, 2304), "Conv1D") == "linear"  # GPT-2's Conv1D is a linear layer
    assert layer_type((8,), "LayerNorm") == "norm" and layer_type((8,), "BatchNorm2d") == "norm"
    assert layer_type((8,), "LlamaRMSNorm") == "norm" and layer_type((8, 8), "Linear") == "linear"
    assert layer_type((8, 8), "Mystery") == "other"
    assert layer_type((10, 4)) == "linear" and layer_type((8, 3, 3, 3)) == "conv"
    assert layer_type((8,)) == "norm" and layer_type((2,) * 6) == "other"


def test_embeddings_use_embedding_bins():
    w = (np.random.default_rng(0).standard_normal((100, 64)) * 0.1).astype(np.float32)
    out = quantize_state({"e": TensorInput(w, "F32", "embedding")}, QuantConfig(bins=4, embedding_bins=32))
    assert len(out["e"].codebook) == 32


@settings(max_examples=40, deadline=None)
@given(bins=st.integers(2, 65534), prune=st.floats(0, 0.5), protect=st.floats(0, 0.5),
       metric=st.sampled_from(["magnitude", "sensitivity"]), pdt=st.sampled_from(["bfloat16", "float32"]),
       emb=st.sampled_from([16, 32]), min_numel=st.integers(1, 10**9), tol=st.floats(1, 100))
def test_config_json_round_trip(bins, prune, protect, metric, pdt, emb, min_numel, tol):
    config = QuantConfig(bins, prune, metric, protect, pdt, emb, min_numel, tol)
    assert QuantConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_config_validation_and_legacy_key():
    for bad in ({"bins": 1}, {"bins": 65535}, {"bins": 8.0}, {"bins": True}, {"prune": 0.995},
                {"prune": -0.1}, {"prune": float("nan")}, {"prune_metric": "random"}, {"protect": -0.1},
                {"protected_dtype": "float16"}, {"embedding_bins": 1}, {"min_numel": 0},
                {"codebook_reuse_tolerance": 0.9}, {"codebook_reuse_tolerance": float("inf")}):
        with pytest.raises(FormatError, match="Expected .* Got"):
            QuantConfig(**bad)
    with pytest.raises(FormatError, match="unknown"):
        QuantConfig.from_dict({"bins": 8, "colour": "red"})
    assert QuantConfig.from_dict({"reuse_tolerance": 1.3}).codebook_reuse_tolerance == 1.3


def test_mismatched_sensitivity_shape_names_the_tensor():
    w = np.zeros((8, 8), np.float32)
    with pytest.raises(FormatError, match="'w'.*shape"):
        quantize_state({"w": TensorInput(w, "F32", sensitivity=np.zeros(3))}, QuantConfig())
    with pytest.raises(FormatError, match="layer type"):
        TensorInput(w, "F32", "attention-ish")


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), prune=st.sampled_from([0.0, 0.3]), protect=st.sampled_from([0.0, 0.01]))
def test_partition_cache_changes_nothing(seed: int, prune: float, protect: float) -> None:
    """The search shares partitions and sketches across candidate configs; every
    config must still get exactly what it gets alone."""

    rng = np.random.default_rng(seed)
    tensors = {
        "a": TensorInput((rng.standard_t(4, (96, 80)) * 0.02).astype(np.float32)),
        "b": TensorInput((rng.standard_normal((64, 128)) * 0.05).astype(np.float32)),
    }
    cache = PartitionCache()
    configs = [(bins, p) for bins in (4, 8, 16) for p in (prune, 0.5)] * 2  # repeats hit the cache
    for bins, p in configs:
        config = QuantConfig(bins=bins, prune=p, protect=protect, min_numel=16)
        alone = quantize_state(tensors, config)
        shared = StateQuantizer(tensors, config, cache=cache)
        for name in shared.names:
            q = shared.quantize(name)
            assert q.codebook == alone[name].codebook
            assert q.values.tobytes() == alone[name].values.tobytes()
            assert q.stats == alone[name].stats


def _error_stats_float64(w: np.ndarray, out: np.ndarray) -> tuple[float, float]:
    """The reference: every element widened to float64 first, non-finite inputs dropped."""
    fin = np.isfinite(w)
    a, d = w[fin].astype(np.float64), w[fin].astype(np.float64) - out[fin]
    den = float(a @ a)
    return (float(np.sqrt(float(d @ d) / den)) if den > 0 else 0.0), float(np.abs(d).max(initial=0.0))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True), min_size=0, max_size=64),
       st.integers(0, 2**31 - 1))
def test_error_stats_match_a_float64_reference(values: list[float], seed: int) -> None:
    from inshrink_store.policy.snapping import error_stats

    w = np.array(values, np.float32)
    rng = np.random.default_rng(seed)
    out = np.where(np.isfinite(w), (w * rng.uniform(-1.0, 1.0, w.size)).astype(np.float32), w)
    with np.errstate(over="ignore"):
        rel, peak = error_stats(w, out)
        ref_rel, ref_peak = _error_stats_float64(w, out)
    assert peak == pytest.approx(ref_peak, rel=1e-6)
    if np.isfinite(ref_rel):
        assert rel == pytest.approx(ref_rel, rel=1e-6, abs=1e-12)


@settings(max_examples=40, deadline=None)
@given(family=st.sampled_from(["normal", "student", "laplace", "uniform"]), size=st.integers(2_000, 60_000),
       scale=st.floats(1e-4, 1e2), levels=st.sampled_from([4, 6, 8, 16, 32]), seed=st.integers(0, 2**16),
       shift=st.floats(0.8, 1.25))
def test_sketch_squared_errors_agree_with_the_values(family: str, size: int, scale: float, levels: int,
                                                     seed: int, shift: float) -> None:
    """The codebook-reuse test reads squared errors off the sketch: they must track the values'."""
    rng = np.random.default_rng(seed)
    draw = {"normal": rng.standard_normal, "student": lambda n: rng.standard_t(3, n),
            "laplace": lambda n: rng.laplace(size=n), "uniform": lambda n: rng.uniform(-1, 1, n)}[family]
    values = (draw(size) * scale).astype(np.float32)
    sketch = LogSketch.from_values(values)
    fresh = fit_codebook(values, levels, include_zero=False, sketch=sketch)
    moved = fresh * shift  # a previous codebook: the same levels, somewhat off
    for codebook, got in zip((fresh, moved), sketch_sq_errors(sketch, [fresh, moved]), strict=True):
        c = np.asarray(codebook, np.float32)
        exact = float(np.sum((values - c[nearest_index(values, c)]).astype(np.float64) ** 2))
        # heavy tails on 2 k values with 32 levels, few values a level: 7.2 % the worst of 1500
        # random draws (hypothesis found 6.3 %: student-t, seed 1021, 32 levels, moved x1.125)
        assert got == pytest.approx(exact, rel=0.10)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), prune=st.sampled_from([0.0, 0.3, 0.5]), protect=st.sampled_from([0.0005, 0.01]),
       metric=st.sampled_from(["magnitude", "sensitivity"]))
def test_a_search_cache_gives_the_same_parts_and_plans_as_none(seed: int, prune: float, protect: float,
                                                               metric: str) -> None:
    """Protection cuts, sketches, parts and codebooks reused from a cache change nothing."""
    rng = np.random.default_rng(seed)
    values = (rng.standard_t(4, size=(120, 90)) * 0.1).astype(np.float32)
    values[rng.random(values.shape) < 0.01] = 0.0
    t = TensorInput(values, sensitivity=np.abs(values * rng.standard_normal(values.shape).astype(np.float32)))
    config = QuantConfig(bins=8, prune=prune, prune_metric=metric, protect=protect, min_numel=1)
    cache = PartitionCache()
    for _ in range(2):  # the second time every cut, sketch and part comes from the cache
        cached = StateQuantizer({"w": t}, config, cache=cache)
        plain = StateQuantizer({"w": t}, config)
        a, b = cached.part("w"), plain.part("w")
        assert (a.protected, a.pruned, a.size) == (b.protected, b.pruned, b.size)
        assert (a.protected_dtype, a.protected_bytes) == (b.protected_dtype, b.protected_bytes)
        sa, sb = cached.sample("w"), plain.sample("w")
        assert np.array_equal(sa.protected, sb.protected) and np.array_equal(sa.pruned, sb.pruned)
        for field in ("pos_keys", "pos_counts", "neg_keys", "neg_counts", "zero_count", "nonfinite_count"):
            assert np.array_equal(getattr(a.sketch, field), getattr(b.sketch, field))
        assert np.array_equal(cached.quantize("w").values, plain.quantize("w").values)


@pytest.mark.parametrize("magnitude", [1e-16, 3e-15, 1e-14, 1e-30])
def test_sketch_squared_errors_of_values_far_below_every_centre(magnitude: float) -> None:
    """A bucket far narrower than its distance to the centre: the integral must not cancel."""
    values = (np.random.default_rng(0).uniform(0.5, 1.0, 1000) * magnitude).astype(np.float32)
    centres = np.array([-0.3, 0.7])
    c = centres.astype(np.float32)
    exact = float(np.sum((values - c[nearest_index(values, c)]).astype(np.float64) ** 2))
    assert sketch_sq_errors(LogSketch.from_values(values), [centres])[0] == pytest.approx(exact, rel=1e-6)


@settings(max_examples=60, deadline=None)
@given(bits=st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=300), data=st.data())
def test_zeroing_by_a_bitwise_and_is_the_boolean_store(bits, data):
    """``zero_where`` writes +0.0 where the mask is set and leaves every other word, NaN
    payloads and negative zeros included, as ``out[mask] = 0.0`` does."""
    from inshrink_store.policy.snapping import zero_where

    values = np.array(bits, np.uint32).view(np.float32)
    mask = data.draw(st.lists(st.booleans(), min_size=values.size, max_size=values.size))
    mask = np.array(mask, bool)
    expected, got = values.copy(), values.copy()
    expected[mask] = 0.0
    zero_where(got, mask)
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 1000), protect=st.sampled_from([0.0, 0.005, 0.01]),
       metric=st.sampled_from(["magnitude", "sensitivity"]))
def test_a_shared_cache_plans_zeros_denormals_and_nan_as_no_cache(seed, protect, metric):
    """Every configuration of one state planned through one cache (protected positions, sketch
    codes made at a tensor's second sketch, pooled thresholds) gives the bits each gets alone."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((64, 96)) * 0.05).astype(np.float32)
    w.ravel()[rng.integers(0, w.size, 300)] = 0.0
    w.ravel()[rng.integers(0, w.size, 20)] = np.float32(3e-39)  # denormals
    w.ravel()[rng.integers(0, w.size, 3)] = np.nan
    s = np.abs(w * rng.standard_normal(w.shape)).astype(np.float32)
    tensors = {"a": TensorInput(w, "F32", sensitivity=s), "b": TensorInput(w[::-1].copy(), "F32")}
    cache = PartitionCache()
    for bins, prune in [(4, 0.0), (8, 0.3), (16, 0.5), (8, 0.3), (6, 0.1)]:
        config = QuantConfig(bins=bins, prune=prune, protect=protect, prune_metric=metric, min_numel=1024)
        shared, alone = StateQuantizer(tensors, config, cache=cache), StateQuantizer(tensors, config)
        assert shared.thresholds == alone.thresholds
        for name in shared.names:
            a, b = shared.quantize(name), alone.quantize(name)
            assert np.array_equal(a.values.view(np.uint32), b.values.view(np.uint32))
            assert a.codebook == b.codebook and a.stats == b.stats
            pa, pb = shared.part(name), alone.part(name)
            assert (pa.protected, pa.pruned, pa.size, pa.protected_bytes) == (pb.protected, pb.pruned, pb.size,
                                                                               pb.protected_bytes)
            for field in ("pos_keys", "pos_counts", "neg_keys", "neg_counts", "zero_count", "nonfinite_count"):
                assert np.array_equal(getattr(pa.sketch, field), getattr(pb.sketch, field))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(0, 700), block=st.sampled_from([1, 7, 64, 1 << 16]),
       threshold=st.sampled_from([None, 0.0, 0.01, 0.05]))
def test_snapping_with_pruning_found_block_by_block_is_the_whole_mask_way(seed, n, block, threshold):
    """snap_pruned finding the pruned per block (|scores| <= threshold, protected kept) gives
    the bits and count of the whole-mask way: nearest centre everywhere, then out[pruned] = 0."""
    from inshrink_store.policy import snapping

    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(n) * 0.05).astype(np.float32)
    w[rng.integers(0, max(n, 1), n // 10)] = np.nan if n else 0.0
    scores = np.abs(w * rng.standard_normal(n)).astype(np.float32)
    scores[rng.integers(0, max(n, 1), n // 20)] = np.nan if n else 0.0
    protected = np.flatnonzero(rng.random(n) < 0.05)
    centres = np.sort(np.unique(np.concatenate([[0.0], rng.standard_normal(7) * 0.05])))
    c32 = centres.astype(np.float32)
    expected = c32[nearest_index(w, c32)] if n else np.zeros(0, np.float32)
    mask = np.zeros(n, bool)
    if threshold is not None:
        mask = np.abs(scores) <= threshold
        mask[protected] = False
        expected[mask] = 0.0
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(snapping, "SNAP_BLOCK", block)
        by_block = snapping.snap_pruned(w, centres, protected, None, None if threshold is None else scores, threshold)
        by_mask = snapping.snap_pruned(w, centres, protected, None if threshold is None else mask, None, None)
    for got, count in (by_block, by_mask):
        assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))
        assert count == int(np.count_nonzero(mask))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(0, 600), block=st.sampled_from([1, 13, 1 << 16]),
       fraction=st.sampled_from([0.0, 0.005, 0.05, 0.3]), half=st.booleans(), sens=st.booleans())
def test_protected_positions_block_by_block_are_the_masks(seed, n, block, fraction, half, sens):
    """The protected positions found block by block are ``flatnonzero`` of protected_mask:
    non-finite values, ties at the cuts, zeros, float16 values against float32 cuts."""
    from inshrink_store.policy import snapping
    from inshrink_store.policy.partition import protected_positions

    rng = np.random.default_rng(seed)
    w = (rng.standard_normal(n) * 0.05).astype(np.float16 if half else np.float32)
    w[rng.integers(0, max(n, 1), n // 8)] = 0.0 if n else 0.0
    if n > 5:
        w[:3] = [np.nan, np.inf, w[5]]  # a tie too
    s = np.abs(w.astype(np.float32) * rng.standard_normal(n)).astype(np.float32) if sens else None
    expected = np.flatnonzero(protected_mask(w, s, fraction))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(snapping, "SNAP_BLOCK", block)
        got = protected_positions(w, s, fraction)
        cached = protected_positions(w, s, fraction, cache=PartitionCache(), name="w")
    assert np.array_equal(got, expected) and np.array_equal(cached, expected) and got.dtype == np.intp


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(1, 3000), half=st.booleans(),
       counts=st.lists(st.integers(1, 3000), min_size=1, max_size=6))
def test_cached_cuts_from_one_sorted_tail_are_the_selection_s(seed: int, n: int, half: bool,
                                                              counts: list[int]) -> None:
    """Every protect fraction's cut read from the cache's sorted tail (grown when a count
    passes it) is the order statistic a selection of the whole tensor finds: NaN as 0, ties,
    zeros, float16 values."""
    from inshrink_store.policy.protection import top_cut

    rng = np.random.default_rng(seed)
    w = (rng.standard_t(3, n) * 0.05).astype(np.float16 if half else np.float32)
    w[rng.integers(0, n, n // 7)] = 0.0
    w[rng.integers(0, n, n // 50)] = np.nan
    w[rng.integers(0, n, n // 9)] = w[0]  # ties
    cache = PartitionCache()
    for count in counts:
        count = min(count, n)
        got = cache.top_cut("w", "values", w, count)
        expected = top_cut(w, count)
        assert np.float32(got).view(np.uint32) == np.float32(expected).view(np.uint32)
