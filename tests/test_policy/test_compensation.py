"""Error-compensating rounding: on the codebook, protected values kept, deterministic, lower output error."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import inshrink_store as ins
from inshrink_store.codecs.nuq import NUQ, nearest_index, protected_values
from inshrink_store.errors import FormatError
from inshrink_store.policy import Allocation, AllocationPlanner
from inshrink_store.policy.compensation import compensated_rounding, protected_positions


def _layer(seed: int, out: int = 48, inp: int = 32, rows: int = 400) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A weight, correlated inputs with unequal channel energies, and their second moment."""
    rng = np.random.default_rng(seed)
    w = rng.standard_t(4, (out, inp)).astype(np.float32) * 0.05
    mix = rng.standard_normal((inp, inp)) * 0.3 + np.eye(inp)
    x = rng.standard_normal((rows, inp)) @ mix * np.geomspace(0.1, 10, inp)
    return w, x, x.T @ x


def _nearest(w: np.ndarray, centres: np.ndarray) -> np.ndarray:
    return centres[nearest_index(w.ravel(), centres)].reshape(w.shape)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), levels=st.sampled_from([4, 6, 8, 16]), scaled=st.booleans())
def test_values_are_centres_or_the_planned_protected_ones_and_the_codec_stores_them(seed: int, levels: int,
                                                                                   scaled: bool) -> None:
    w, _, h = _layer(seed)
    rng = np.random.default_rng(seed + 1)
    scales = (np.abs(w).mean(axis=0) + 1e-3).astype(np.float32) if scaled else None
    unit = w / scales if scales is not None else w
    centres = np.unique(np.quantile(unit, np.linspace(0.02, 0.98, levels)).astype(np.float32))
    held = rng.random(w.shape) < 0.02
    # what protection planned there: values as the codec stores them (bfloat16)
    planned = np.where(held, protected_values(w + 1.0, "float32", "bfloat16"), 0.0).astype(np.float32)
    q = compensated_rounding(w, planned, centres, h, protected=held, scales=scales)
    assert q.dtype == np.float32 and q.shape == w.shape
    assert np.array_equal(q[held], planned[held])
    on = ~protected_positions(q, centres, scales)
    assert on[~held].all()
    codec = NUQ(centres.tolist(), tolerance=0, scales=None if scales is None else scales.tolist())
    assert np.array_equal(codec.decode(codec.encode(q)).reshape(q.shape).view(np.uint32), q.view(np.uint32))
    again = compensated_rounding(w, planned, centres, h, protected=held, scales=scales)
    assert np.array_equal(again.view(np.uint32), q.view(np.uint32))


@pytest.mark.parametrize("seed", range(6))
def test_the_output_error_is_lower_than_nearest_rounding(seed: int) -> None:
    w, x, h = _layer(seed)
    centres = np.unique(np.quantile(w, np.linspace(0.05, 0.95, 6)).astype(np.float32))
    plain = _nearest(w, centres)
    q = compensated_rounding(w, plain, centres, h)
    out_err = float(np.linalg.norm((w - q).astype(np.float64) @ x.T))
    plain_err = float(np.linalg.norm((w - plain).astype(np.float64) @ x.T))
    assert out_err < 0.9 * plain_err


def test_inputs_that_never_fire_do_not_break_it() -> None:
    w, _, h = _layer(3)
    h[:, 5] = h[5, :] = 0.0  # input 5 was always zero
    centres = np.linspace(-0.2, 0.2, 8, dtype=np.float32)
    q = compensated_rounding(w, w, centres, h)
    assert np.isin(q, centres).all()


@pytest.mark.parametrize("bad", ["shape", "nan", "1-d"])
def test_malformed_input_is_refused(bad: str) -> None:
    w, _, h = _layer(0)
    c = np.linspace(-1, 1, 4, dtype=np.float32)
    if bad == "shape":
        h = h[:-1, :-1]
    elif bad == "nan":
        h = h.copy()
        h[0, 0] = np.nan
    else:
        w = w[0]
    with pytest.raises(FormatError, match="Expected"):
        compensated_rounding(w, w, c, h)


def test_a_planner_with_hessians_saves_compensated_plans_that_read_back_exactly() -> None:
    w, x, h = _layer(7, out=256, inp=64, rows=2000)
    state = {"layer.weight": w}
    planner = AllocationPlanner(Allocation(target_ratio=6, min_numel=1024), hessians={"layer.weight": h})
    repo = ins.init("memory://compensation-save")
    info = repo.save(state, quantize=planner)
    back = np.asarray(repo.load(info.id)["layer.weight"])
    assert planner.results["layer.weight"]["compensated"] is True
    plain = AllocationPlanner(Allocation(target_ratio=6, min_numel=1024))
    other = ins.init("memory://compensation-plain")
    plain_back = np.asarray(other.load(other.save(state, quantize=plain).id)["layer.weight"])
    assert np.linalg.norm((w - back) @ x.T) < np.linalg.norm((w - plain_back) @ x.T)
