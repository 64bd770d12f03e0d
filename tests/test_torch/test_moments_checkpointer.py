"""The Checkpointer stores Adam's moments lossy by default: a restored run trains on like the
original, the live optimizer is never touched, and anything not Adam-shaped stays exact."""

from __future__ import annotations

import dataclasses
import logging
import uuid
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import inshrink_store as ins  # noqa: E402
from inshrink_store.policy import QuantConfig, SearchPolicy  # noqa: E402
from inshrink_store.policy.moments import (  # noqa: E402
    ROLLBACK_MOMENTS,
    AdamHyper,
    MomentPolicy,
    MomentRecord,
    compare,
    update,
)
from inshrink_store.torch import Checkpointer  # noqa: E402
from tests.test_torch._lossy import SaysLossy  # noqa: E402

LOGGER = "inshrink_store.torch.checkpointer"
X = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
Y = torch.randint(0, 10, (256,), generator=torch.Generator().manual_seed(1))
ADAMS = {
    "Adam": lambda params: torch.optim.Adam(params, lr=1e-3, betas=(0.85, 0.995), eps=1e-7),
    "AdamW": lambda params: torch.optim.AdamW(params, lr=2e-3, weight_decay=0.05),
}


@pytest.fixture
def url() -> str:
    return f"memory://moments-{uuid.uuid4().hex}"


def _model(seed: int) -> Any:
    """64 -> 128 -> 10: the first layer's moments (8192 elements) are big enough to compress,
    the second's (1280) and the biases are not."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def _train(model: Any, opt: Any, steps: int) -> float:
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(X), Y)
        loss.backward()
        opt.step()
    with torch.no_grad():
        return float(torch.nn.functional.cross_entropy(model(X), Y))


def _checkpointer(repo: Any, model: Any, opt: Any, **kwargs: Any) -> Checkpointer:
    """A Checkpointer whose restores return the stored (lossy) moments: these tests are about
    what the store keeps for history, so the exact-resume residual is off unless asked for."""
    kwargs.setdefault("exact_resume", 0)
    return SaysLossy(repo, model, opt, background=False, **kwargs)


def _clone_state(opt: Any) -> dict[int, dict[str, Any]]:
    return {i: {k: t.clone() for k, t in s.items()} for i, s in opt.state_dict()["state"].items()}


def _assert_state_equal(got: dict[int, dict[str, Any]], expected: dict[int, dict[str, Any]],
                        keys: tuple[str, ...] | None = None) -> None:
    assert sorted(got) == sorted(expected)
    for i, entry in expected.items():
        assert sorted(got[i]) == sorted(entry)
        for name, t in entry.items():
            if keys is None or name in keys:
                assert got[i][name].dtype == t.dtype and torch.equal(got[i][name], t), (i, name)


def _restored(repo: Any, make_opt: Any, **kwargs: Any) -> tuple[Any, Any]:
    """A fresh model and optimizer (other weights, no state) restored from ``repo``."""
    model = _model(seed=99)
    opt = make_opt(model.parameters())
    _checkpointer(repo, model, opt, **kwargs).restore()
    return model, opt


@pytest.mark.parametrize("name", sorted(ADAMS))
def test_default_save_compresses_the_big_moments_and_training_goes_on(url: str, name: str) -> None:
    make_opt = ADAMS[name]
    model = _model(seed=0)
    opt = make_opt(model.parameters())
    _train(model, opt, 30)
    repo = ins.open(url, create=True)
    ck = _checkpointer(repo, model, opt)
    live = _clone_state(opt)
    live_groups = opt.state_dict()["param_groups"]
    info = ck.save(30)
    _assert_state_equal(_clone_state(opt), live)  # the save only read the live optimizer
    assert opt.state_dict()["param_groups"] == live_groups

    metadata = repo.snapshot(info.id).metadata
    assert repo.log()[0].metadata == metadata
    record = MomentRecord.from_dict(metadata["moments"])
    assert record.policy == MomentPolicy() and record.skipped is None
    big = record.tensors["optimizer/state/0"]
    assert big.storage == "quantized" and big.attempts >= 1
    assert big.update_cosine is not None and big.update_cosine >= MomentPolicy().min_update_cosine
    assert big.update_rel_error is not None and big.update_rel_error <= MomentPolicy().max_update_error
    for small in ("optimizer/state/1", "optimizer/state/3"):  # the biases
        assert record.tensors[small].storage == "lossless" and "fewer than" in str(record.tensors[small].reason)
    assert record.tensors["optimizer/state/2"].storage == "quantized"  # 1280 elements: past min_numel 1024

    model2, opt2 = _restored(repo, make_opt)
    got = _clone_state(opt2)
    assert opt2.state_dict()["param_groups"] == live_groups
    for group, expected in zip(opt2.param_groups, opt.param_groups, strict=True):
        for key in ("lr", "betas", "eps", "weight_decay", "amsgrad"):
            assert group[key] == expected[key], key
    _assert_state_equal(got, live, keys=("step",))
    for i, entry in live.items():
        assert got[i]["exp_avg"].shape == entry["exp_avg"].shape
        v, v_live = got[i]["exp_avg_sq"], entry["exp_avg_sq"]
        assert (v >= 0).all() and (v[v_live > 0] > 0).all()
    for i in (0, 2):  # the pairs past min_numel
        assert not torch.equal(got[i]["exp_avg"], live[i]["exp_avg"]), "the big pairs were stored lossy"
    for i in (1, 3):  # the small pairs are exact
        assert torch.equal(got[i]["exp_avg"], live[i]["exp_avg"])
        assert torch.equal(got[i]["exp_avg_sq"], live[i]["exp_avg_sq"])

    reference = _train(model, opt, 20)  # the uninterrupted run
    resumed = _train(model2, opt2, 20)
    assert torch.isfinite(torch.tensor(resumed))
    assert abs(resumed - reference) <= 0.1 * abs(reference), (resumed, reference)


@pytest.mark.parametrize("name", sorted(ADAMS))
def test_optimizer_policy_lossless_restores_the_moments_bit_identical(url: str, name: str) -> None:
    make_opt = ADAMS[name]
    model = _model(seed=1)
    opt = make_opt(model.parameters())
    _train(model, opt, 25)
    repo = ins.open(url, create=True)
    info = _checkpointer(repo, model, opt, optimizer_policy="lossless").save(25)
    assert "moments" not in info.metadata
    live = _clone_state(opt)
    _, opt2 = _restored(repo, make_opt)
    _assert_state_equal(_clone_state(opt2), live)
    assert opt2.state_dict()["param_groups"] == opt.state_dict()["param_groups"]


def test_a_custom_moment_policy_is_used_and_recorded(url: str) -> None:
    model = _model(seed=2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    _train(model, opt, 25)
    repo = ins.open(url, create=True)
    custom = MomentPolicy(exp_avg_bins=8, exp_avg_sq_bins=8, prune=0.1, min_numel=1000)
    info = _checkpointer(repo, model, opt, policy=SearchPolicy(optimizer=custom)).save(25)
    record = MomentRecord.from_dict(info.metadata["moments"])
    assert record.policy == custom
    for prefix in ("optimizer/state/0", "optimizer/state/2"):  # 8192 and 1280 elements
        entry = record.tensors[prefix]
        assert entry.storage == "quantized"
        assert entry.exp_avg_levels is not None and entry.exp_avg_levels <= 8 * 4 + 1
    assert record.tensors["optimizer/state/1"].storage == "lossless"  # the 128 biases
    _, opt2 = _restored(repo, lambda p: torch.optim.Adam(p, lr=1e-3))
    assert torch.equal(opt2.state_dict()["state"][0]["step"], opt.state_dict()["state"][0]["step"])


def test_each_group_guards_with_its_own_betas_and_prunes_with_its_own_weights(url: str) -> None:
    """Two param groups in reverse layer order, each with its own betas and eps: the state
    numbers map to the right weights (joint pruning) and to the right hyperparameters (guard)."""
    model = _model(seed=5)
    opt = torch.optim.Adam([{"params": model[2].parameters(), "betas": (0.8, 0.99)},
                            {"params": model[0].parameters(), "betas": (0.5, 0.9), "eps": 1e-4}], lr=1e-2)
    _train(model, opt, 30)
    repo = ins.open(url, create=True)
    loose = MomentPolicy(min_update_cosine=0.0, max_update_error=10.0, min_numel=1000)
    policy = SearchPolicy(base=QuantConfig(prune=0.5), optimizer=loose)  # half the big weights pruned
    info = _checkpointer(repo, model, opt, policy=policy).save(30)
    record = MomentRecord.from_dict(info.metadata["moments"])
    reader = repo.checkout(info.id)
    live = opt.state_dict()
    # state 0, 1: model/2.weight, model/2.bias; state 2, 3: model/0.weight, model/0.bias
    for index, weight, (beta1, beta2), eps in ((0, "model/2.weight", (0.8, 0.99), 1e-8),
                                               (2, "model/0.weight", (0.5, 0.9), 1e-4)):
        prefix = f"optimizer/state/{index}"
        entry = record.tensors[prefix]
        assert entry.storage == "quantized" and entry.attempts == 1, entry
        m, v = reader.read(f"{prefix}/exp_avg"), reader.read(f"{prefix}/exp_avg_sq")
        exact = live["state"][index]
        h = AdamHyper(beta1, beta2, eps, float(exact["step"]))
        cosine, error = compare(update(exact["exp_avg"].numpy(), exact["exp_avg_sq"].numpy(), h), update(m, v, h))
        assert entry.update_cosine == pytest.approx(cosine, abs=1e-6)
        assert entry.update_rel_error == pytest.approx(error, abs=1e-6)
        w = reader.read(weight)
        if index == 2:  # the 8192-element weight is pruned, and its moments with it
            assert 0.4 < float((w == 0).mean()) < 0.6
            assert (m[w == 0] == 0).all()
    assert {p: r.storage for p, r in record.tensors.items()} == {
        "optimizer/state/0": "quantized", "optimizer/state/1": "lossless",
        "optimizer/state/2": "quantized", "optimizer/state/3": "lossless"}


def test_sgd_momentum_stays_lossless_and_is_reported_once(url: str, caplog: pytest.LogCaptureFixture) -> None:
    model = _model(seed=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    _train(model, opt, 10)
    repo = ins.open(url, create=True)
    ck = _checkpointer(repo, model, opt)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        first = ck.save(10)
        _train(model, opt, 5)
        ck.save(15)
    said = [r for r in caplog.records if r.name == LOGGER and "not Adam-shaped" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert "momentum_buffer" in said[0].getMessage()
    record = MomentRecord.from_dict(first.metadata["moments"])
    assert record.tensors == {} and record.skipped is not None and "momentum_buffer" in record.skipped

    live = _clone_state(opt)
    model2, opt2 = _restored(repo, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))
    _assert_state_equal(_clone_state(opt2), live)
    before = _train(model2, opt2, 0)
    after = _train(model2, opt2, 20)
    assert torch.isfinite(torch.tensor(after)) and after < before


def test_adamw_amsgrad_restores_with_max_exp_avg_sq_exact_and_trains(url: str) -> None:
    def make_opt(params: Any) -> Any:
        return torch.optim.AdamW(params, lr=2e-3, amsgrad=True)

    model = _model(seed=4)
    opt = make_opt(model.parameters())
    _train(model, opt, 30)
    repo = ins.open(url, create=True)
    info = _checkpointer(repo, model, opt).save(30)
    assert MomentRecord.from_dict(info.metadata["moments"]).tensors["optimizer/state/0"].storage == "quantized"
    live = _clone_state(opt)
    model2, opt2 = _restored(repo, make_opt)
    got = _clone_state(opt2)
    _assert_state_equal(got, live, keys=("step", "max_exp_avg_sq"))
    assert opt2.param_groups[0]["amsgrad"] is True
    reference = _train(model, opt, 20)
    resumed = _train(model2, opt2, 20)
    assert torch.isfinite(torch.tensor(resumed))
    assert abs(resumed - reference) <= 0.1 * abs(reference), (resumed, reference)


def test_with_exact_resume_the_default_moments_are_stored_for_rollbacks(url: str) -> None:
    """exact_resume >= 1: a restart resumes bit-exact from the newest version's residual, so
    the stored moments serve rollbacks only and the default MomentPolicy gives way to
    ROLLBACK_MOMENTS (the looser guard). exact_resume=0 restores the stored moments and keeps
    the strict one; so do history_moments=None and a moment policy of your own. The resume
    stays bit-exact."""
    model = _model(seed=3)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    _train(model, opt, 25)
    live = _clone_state(opt)
    repo = ins.open(url, create=True)
    custom = MomentPolicy(exp_avg_bins=8, exp_avg_sq_bins=8, prune=0.1)
    cases = [(1, SearchPolicy(), ROLLBACK_MOMENTS), (0, SearchPolicy(), MomentPolicy()),
             (1, SearchPolicy(history_moments=None), MomentPolicy()), (1, SearchPolicy(optimizer=custom), custom)]
    for n, (exact, policy, expected) in enumerate(cases):
        info = _checkpointer(repo, model, opt, exact_resume=exact, policy=policy, branch=f"case-{n}").save(25)
        assert MomentRecord.from_dict(info.metadata["moments"]).policy == expected, (exact, policy)
    assert ROLLBACK_MOMENTS.min_update_cosine < MomentPolicy().min_update_cosine
    model2 = _model(seed=99)
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-3)
    ck = _checkpointer(repo, model2, opt2, exact_resume=1, branch="case-0")
    ck.restore()
    assert ck.restored_exact
    _assert_state_equal(_clone_state(opt2), live)


def test_history_moments_is_checked_and_only_replaces_the_default() -> None:
    with pytest.raises(ins.FormatError, match="history_moments"):
        SearchPolicy(history_moments="loose")  # type: ignore[arg-type]
    assert SearchPolicy().for_history().optimizer == ROLLBACK_MOMENTS
    assert SearchPolicy(optimizer="compressed").for_history().optimizer == ROLLBACK_MOMENTS
    assert SearchPolicy(optimizer="lossless").for_history().optimizer is None  # lossless stays lossless
    assert SearchPolicy().resuming().optimizer == MomentPolicy()  # a lossy resume keeps the strict guard


def test_closed_loop_history_moments_are_coded_against_the_parent(url: str) -> None:
    """``history_moments`` with ``closed_loop=True`` is what the saves of an exact-resume run
    use: the second version's moments are closed-loop arrays (their record says how each was
    coded, a residual or a keyframe), where the default policy's ``closed_loop=False`` had
    been consulted instead and the opt-in was silently ignored."""
    model = _model(seed=5)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    repo = ins.open(url, create=True)
    policy = SearchPolicy(history_moments=dataclasses.replace(ROLLBACK_MOMENTS, closed_loop=True))
    ck = _checkpointer(repo, model, opt, exact_resume=1, policy=policy)
    for step in (20, 40):
        _train(model, opt, 20)
        info = ck.save(step)
    record = MomentRecord.from_dict(info.metadata["moments"])
    assert record.policy is not None and record.policy.closed_loop
    quantized = {p: r for p, r in record.tensors.items() if r.storage == "quantized"}
    assert quantized and all(r.exp_avg_sq_coding in ("keyframe", "residual", "unchanged") for r in quantized.values())
    reader = repo.checkout(info.id)
    for prefix in quantized:
        assert reader.arrays()[f"{prefix}/exp_avg_sq"].attributes["coding"] == "closed-loop"
    plain = _checkpointer(repo, model, opt, exact_resume=1, branch="open").save(40)
    assert all(r.exp_avg_sq_coding is None for r in MomentRecord.from_dict(plain.metadata["moments"]).tensors.values())
