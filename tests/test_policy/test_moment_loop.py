"""Closed-loop Adam moments (issue 44, deliverable 1): each moment a quantized residual against
the previous version's stored values where that is cheaper and the guard passes the
reconstruction; keyframes where not; exact resume bit-exact; the record says what was done."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import inshrink_store as ins
from inshrink_store.policy import SearchPolicy
from inshrink_store.policy.closed_loop import CODING, Base, source_digest
from inshrink_store.policy.moment_loop import (
    LOOP_KEY,
    LoopEntry,
    reconstruct,
    residual_v,
    unchanged,
    usable,
)
from inshrink_store.policy.moments import (
    AdamHyper,
    MomentPolicy,
    MomentRecord,
    compare,
    update,
)
from inshrink_store.torch import Checkpointer
from inshrink_store.torch.tensors import load_state, state_to_arrays

PREFIX = "optimizer/state/0"
M, V = f"{PREFIX}/exp_avg", f"{PREFIX}/exp_avg_sq"


def _train(url: str, *, saves: int, moments: MomentPolicy | None = None, closed_loop: bool = True,
           seed: int = 0) -> tuple[Any, Any, Any]:
    """A small MLP (a 96 x 128 layer: moments past min_numel) trained with Adam, a version every
    10 steps; (repo, model, optimizer) afterwards."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(128, 96), torch.nn.Tanh(), torch.nn.Linear(96, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    x = torch.randn(256, 128)
    y = (x[:, :4] * 2).tanh()
    repo = ins.open(url, create=True)

    def evaluate(m: Any) -> float:
        with torch.no_grad():
            return float(((m(x) - y) ** 2).mean())

    policy = SearchPolicy(tolerance=0.05, higher_is_better=False,
                          optimizer=moments if moments is not None else MomentPolicy(closed_loop=True))
    with Checkpointer(repo, model, optimizer, eval_fn=evaluate, every=10, policy=policy,
                      closed_loop=closed_loop) as ck:
        for step in range(1, 10 * saves + 1):
            optimizer.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            ck.observe_gradients()
            optimizer.step()
            if step % 10 == 0:
                ck.save(step)
    return repo, model, optimizer


def _records(repo: Any) -> list[MomentRecord]:
    return [MomentRecord.from_dict(i.metadata["moments"]) for i in reversed(repo.log())]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: Any) -> tuple[Any, Any, Any]:
    return _train(str(tmp_path_factory.mktemp("loop") / "store"), saves=6)


def test_v_is_stored_as_a_residual_against_the_parents_stored_values(trained: Any) -> None:
    """Before closed-loop moments every version's v was coded on its own; now a later version's
    v is a coder-4 residual chained on its parent's array, and its record says so."""
    repo, _, _ = trained
    records = _records(repo)
    first = records[0].tensors[PREFIX]
    assert first.exp_avg_sq_coding == "keyframe" and first.exp_avg_coding == "keyframe"
    later = [r.tensors[PREFIX] for r in records[1:]]
    assert any(t.exp_avg_sq_coding == "residual" for t in later), [t.to_dict() for t in later]
    for t in later:
        if t.exp_avg_sq_coding == "residual":
            assert t.exp_avg_sq_kept_fraction is not None and 0 <= t.exp_avg_sq_kept_fraction <= 1
            assert t.residual_attempts is not None and t.residual_attempts >= 1
    head = repo.checkout("main")
    info = head.index.array(V)
    assert info is not None and info.attributes.get("coding") == CODING
    assert info.attributes.get("moment_coding") in ("keyframe", "residual", "unchanged")
    assert json.loads(json.dumps(repo.log()[0].metadata["moments"]))["version"] == 3


def test_the_guard_judges_the_reconstruction_a_lossy_restore_returns(trained: Any) -> None:
    """The recorded figures are those of the moments a lossy read hands the optimizer,
    compared with the exact ones the restore residual gives back, and they pass the guard."""
    repo, _, _ = trained
    policy = MomentPolicy(closed_loop=True)
    newest = repo.log()[0].id  # the one version that keeps its restore residual (the exact moments)
    for info in repo.log():
        lossy = state_to_arrays(load_state(repo, info.id, exact=False))[0]
        exact = state_to_arrays(load_state(repo, info.id, exact=True))[0] if info.id == newest else None
        record = MomentRecord.from_dict(info.metadata["moments"]).tensors[PREFIX]
        assert record.storage == "quantized"
        assert (lossy[V] >= 0).all() and ((lossy[V] > 0) | (lossy[M] == 0) | (lossy[V] == 0)).all()
        assert record.update_cosine is not None and record.update_cosine >= policy.min_update_cosine
        assert record.update_rel_error is not None and record.update_rel_error <= policy.max_update_error
        if exact is not None:
            h = AdamHyper(step=float(exact[f"{PREFIX}/step"]))
            cosine, error = compare(update(exact[M], exact[V], h), update(lossy[M], lossy[V], h))
            assert cosine == pytest.approx(record.update_cosine, abs=1e-5)
            assert error == pytest.approx(record.update_rel_error, abs=1e-5)


def test_exact_resume_is_bit_exact_and_every_version_reads_back(trained: Any, tmp_path: Any) -> None:
    repo, model, optimizer = trained
    state = load_state(repo, "main", exact=True)
    live = optimizer.state_dict()["state"]
    for key, value in live.items():
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state["optimizer"]["state"][key][name], value[name])
    fresh = torch.nn.Sequential(torch.nn.Linear(128, 96), torch.nn.Tanh(), torch.nn.Linear(96, 4))
    opt = torch.optim.Adam(fresh.parameters(), lr=3e-3)
    with Checkpointer(repo, fresh, opt) as ck:
        ck.restore("main")
        assert ck.restored_exact
    for info in repo.log():  # every committed version reads back in full, lossy
        arrays = state_to_arrays(load_state(repo, info.id, exact=False))[0]
        assert np.isfinite(arrays[V]).all()


def test_same_training_gives_the_same_bytes(tmp_path: Any) -> None:
    """Deterministic: two identical runs store the same moments (the same chunk objects, which
    are named by their bytes) and the same records."""
    a, _, _ = _train(str(tmp_path / "a"), saves=3)
    b, _, _ = _train(str(tmp_path / "b"), saves=3)
    for x, y in zip(a.log(), b.log(), strict=True):
        assert x.metadata["moments"] == y.metadata["moments"]
        for path in (M, V):
            assert a.checkout(x.id).index.chunk_ids(path) == b.checkout(y.id).index.chunk_ids(path)


def test_open_loop_moments_stay_as_they_were(tmp_path: Any) -> None:
    """The default ``MomentPolicy()`` (closed-loop moments are opt-in), ``MomentPolicy(closed_loop=False)``
    and ``Checkpointer(closed_loop=False)`` code every version's moments on their own: no coding
    fields, nuq arrays, as before."""
    for repo in (_train(str(tmp_path / "d"), saves=3, moments=MomentPolicy())[0],
                 _train(str(tmp_path / "p"), saves=3, moments=MomentPolicy(closed_loop=False))[0],
                 _train(str(tmp_path / "c"), saves=3, closed_loop=False,
                        moments=MomentPolicy(closed_loop=True))[0]):
        for record in _records(repo):
            t = record.tensors[PREFIX]
            assert t.exp_avg_coding is None and t.exp_avg_sq_coding is None
        info = repo.checkout("main").index.array(V)
        assert info is not None and info.attributes.get("coding") != CODING


# -- the keyframe rule ----------------------------------------------------------------------------
def _base(values: np.ndarray, depth: int = 0, source: str | None = None) -> Base:
    return Base(np.asarray(values, np.float32), depth, source)


def test_a_residual_needs_a_finite_parent_of_the_same_shape_with_room_in_its_chain() -> None:
    v = np.full((4, 8), 1e-4, np.float32)
    assert usable(LoopEntry(_base(v), 8), v) is not None
    assert usable(None, v) is None
    assert usable(LoopEntry(None, 8), v) is None
    assert usable(LoopEntry(_base(v, depth=7), 8), v) is None  # the chain is at the keyframe interval
    assert usable(LoopEntry(_base(np.ones((8, 4))), 8), v) is None  # another shape
    bad = v.copy()
    bad[0, 0] = np.nan
    assert usable(LoopEntry(_base(bad), 8), v) is None and usable(LoopEntry(_base(v), 8), bad) is None
    assert unchanged(LoopEntry(_base(v * 2, depth=7, source=source_digest(v)), 8), v) is not None
    assert unchanged(LoopEntry(_base(v, source=source_digest(v * 2)), 8), v) is None


def test_a_planner_given_no_parent_codes_keyframes_and_without_the_key_open_loop() -> None:
    rng = np.random.default_rng(1)
    m = (rng.standard_normal((64, 80)) * 1e-3).astype(np.float32)
    v = (rng.random((64, 80)) * 1e-6 + 1e-9).astype(np.float32)
    tensors, dtypes = {M: m, V: v}, {M: "F32", V: "F32"}
    policy = MomentPolicy(min_numel=64, closed_loop=True)
    loop = policy.plan(tensors, dtypes, {M: {LOOP_KEY: LoopEntry(None, 8)}, V: {LOOP_KEY: LoopEntry(None, 8)}})
    record = loop.record.tensors[PREFIX]
    assert (record.exp_avg_coding, record.exp_avg_sq_coding) == ("keyframe", "keyframe")
    assert loop[V].object_coder is not None and loop[V].attributes["coding"] == CODING
    plain = policy.plan(tensors, dtypes, {})
    assert plain.record.tensors[PREFIX].exp_avg_sq_coding is None and plain[V].object_coder is None
    # v's keyframe holds the open-loop values; m's may be a more aggressive keyframe, within the guard
    np.testing.assert_array_equal(loop[V].values, plain[V].values)
    h = AdamHyper()
    cosine, error = compare(update(m, v, h), update(loop[M].values, loop[V].values, h))
    assert (record.update_cosine, record.update_rel_error) == (round(cosine, 6), round(error, 6))
    assert cosine >= policy.min_update_cosine and error <= policy.max_update_error


# -- v's residual, property-tested ------------------------------------------------------------------
@st.composite
def v_cases(draw: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    seed = draw(st.integers(0, 2**32 - 1))
    n = draw(st.integers(1, 3000))
    rng = np.random.default_rng(seed)
    octaves = draw(st.floats(0.0, 40.0))
    base = np.exp2(-20 - rng.random(n) * octaves).astype(np.float32)
    change = draw(st.floats(0.0, 2.0))
    v = (base * np.exp2(rng.standard_normal(n) * change)).astype(np.float32)
    zeros = rng.random(n) < draw(st.floats(0.0, 0.3))
    v[zeros] = 0.0
    base[rng.random(n) < draw(st.floats(0.0, 0.3))] = 0.0
    m = (rng.standard_normal(n) * np.sqrt(v) * 0.3).astype(np.float32)
    m[v == 0] = 0.0
    return m, v, base


@settings(max_examples=60, deadline=None)
@given(case=v_cases(), kept=st.sampled_from([0.0, 0.6, 0.95]), levels=st.sampled_from([2, 8, 32]))
def test_vs_residual_keeps_v_valid_and_is_deterministic(case: Any, kept: float, levels: int) -> None:
    """Whatever the residual: the reconstruction is what coder 4 adds up, never below 0,
    positive wherever v is, each residual on the codebook or an exact (protected) residual,
    and the same input gives the same bits."""
    m, v, base = case
    before = (m.copy(), v.copy(), base.copy())
    coded = residual_v(v, base, m, (1.0, 1e-8), kept, levels)
    again = residual_v(v, base, m, (1.0, 1e-8), kept, levels)
    assert coded.q.tobytes() == again.q.tobytes() and coded.codebook.tobytes() == again.codebook.tobytes()
    np.testing.assert_array_equal(coded.values, reconstruct(base, coded.q))
    assert (coded.values >= 0).all()
    assert (coded.values[v > 0] > 0).all()
    on_levels = np.isin(coded.q, coded.codebook.astype(np.float32))
    exact_residual = coded.q == np.subtract(v, base, dtype=np.float32)
    assert (on_levels | exact_residual).all()
    for a, b in zip(before, (m, v, base), strict=True):
        np.testing.assert_array_equal(a, b)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_a_slowly_moving_v_codes_closer_than_its_open_loop_levels(seed: int) -> None:
    """v of beta2 ~ 0.999 over a checkpoint interval changes a few per cent: its residual with
    every entry coded moves the update far less than 16 log levels of v itself do."""
    from inshrink_store.policy.moment_codebooks import quantize_exp_avg_sq

    rng = np.random.default_rng(seed)
    base = np.exp2(-30 + rng.random(5000) * 20).astype(np.float32)
    v = (base * (1 + rng.standard_normal(5000) * 0.03)).astype(np.float32)
    m = (rng.standard_normal(5000) * np.sqrt(v)).astype(np.float32)
    h = AdamHyper()
    exact = update(m, v, h)
    closed = residual_v(v, base, m, (1.0, h.eps), 0.0, 16)
    opened, _ = quantize_exp_avg_sq(v, 16, "F32", importance_root=exact)
    assert compare(exact, update(m, closed.values, h))[1] < compare(exact, update(m, opened, h))[1]


def test_the_thread_count_does_not_change_closed_loop_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pairs are planned side by side on the writer's threads: 1 or 4 of them, the same residuals."""
    rng = np.random.default_rng(7)
    tensors: dict[str, np.ndarray] = {}
    previous: dict[str, dict[str, Any]] = {}
    for i in range(3):
        v0 = (rng.random((48, 64)) * 1e-5 + 1e-9).astype(np.float32)
        v = (v0 * (1 + rng.standard_normal(v0.shape) * 0.05)).clip(0).astype(np.float32)
        m = (rng.standard_normal(v.shape) * np.sqrt(v)).astype(np.float32)
        m0 = (m * 0.5).astype(np.float32)
        tensors |= {f"optimizer/state/{i}/exp_avg": m, f"optimizer/state/{i}/exp_avg_sq": v}
        previous |= {f"optimizer/state/{i}/exp_avg": {LOOP_KEY: LoopEntry(_base(m0), 8)},
                     f"optimizer/state/{i}/exp_avg_sq": {LOOP_KEY: LoopEntry(_base(v0), 8)}}
    dtypes = dict.fromkeys(tensors, "F32")
    made = []
    for threads in ("1", "4"):
        monkeypatch.setenv("INSHRINK_WRITE_THREADS", threads)
        plans = MomentPolicy(min_numel=64, closed_loop=True).plan(tensors, dtypes, previous)
        made.append((plans.record.to_dict(), {p: plans[p].values.tobytes() for p in sorted(plans)}))
    assert made[0] == made[1]
    assert any(t.get("exp_avg_sq_coding") == "residual" for t in made[0][0]["tensors"].values())
