"""The Checkpointer's saves within the search budget ``max_evals=(8, 3)`` (issue 42): at most 8 ``eval_fn``
calls on the first save of a run and 3 on later ones, a restore that continues the run's fit
rather than searching afresh, a keyframe fallback inside the save's budget, and the record of
how each budget was spent in the version's metadata."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import inshrink_store as ins  # noqa: E402
from inshrink_store.policy import SearchPolicy  # noqa: E402
from inshrink_store.policy.search_policy import MAX_EVALS  # noqa: E402
from inshrink_store.torch import Checkpointer  # noqa: E402

BUDGETED = SearchPolicy(tolerance=0.02, max_evals=MAX_EVALS)


def _problem() -> tuple[Any, Any, Any, Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 32, generator=g)
    y = (x[:, :4].sum(1) > 0).long()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 2))
    return x, y, model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _train(model: Any, opt: Any, x: Any, y: Any, steps: int, ck: Checkpointer) -> None:
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        ck.observe_gradients()
        opt.step()


def _accuracy(x: Any, y: Any) -> Any:
    def fn(model: Any) -> float:
        with torch.no_grad():
            return float((model(x).argmax(1) == y).float().mean())
    return fn


def test_every_save_stays_within_the_default_budget_and_records_it() -> None:
    x, y, model, opt = _problem()
    repo = ins.open(f"memory://budget-{uuid.uuid4().hex}", create=True)
    with Checkpointer(repo, model, opt, eval_fn=_accuracy(x, y), policy=BUDGETED, background=False) as ck:
        for step in (10, 20, 30, 40):
            _train(model, opt, x, y, 10, ck)
            ck.save(step)
        calls = [int(t["evaluations"]) for t in ck.timings]
    assert calls[0] <= 8 and all(c <= 3 for c in calls[1:]), calls
    for info, spent in zip(reversed(repo.log()), calls, strict=True):
        q = info.metadata["quantization"]
        budget = q["search"]["budget"]
        assert budget["calls"] == spent  # the record counts what eval_fn really ran
        assert budget["kind"] == ("first" if info.step == 10 else "later")
        assert budget["max_evals"] == (8 if info.step == 10 else 3)
        if q["config"] is not None:  # stored quantized: a confirmed trial, within tolerance
            chosen = [t for t in q["search"]["trials"] if t["feasible"] and all(
                t["point"][k] == q["config"][k] for k in ("bins", "prune", "prune_metric", "protect"))]
            assert chosen and chosen[0]["quality"] >= q["baseline_quality"] * 0.98 - 1e-9


def test_a_restore_continues_within_the_later_budget() -> None:
    x, y, model, opt = _problem()
    repo = ins.open(f"memory://budget-{uuid.uuid4().hex}", create=True)
    with Checkpointer(repo, model, opt, eval_fn=_accuracy(x, y), policy=BUDGETED, background=False) as ck:
        _train(model, opt, x, y, 10, ck)
        ck.save(10)
    _, _, model2, opt2 = _problem()
    with Checkpointer(repo, model2, opt2, eval_fn=_accuracy(x, y), policy=BUDGETED, background=False) as ck2:
        ck2.restore()
        assert ck2._run.predictor.points  # the restored record's evaluations
        _train(model2, opt2, x, y, 10, ck2)
        info = ck2.save(20)
        assert ck2.timings[0]["evaluations"] <= 3
    assert info.metadata["quantization"]["search"]["budget"]["kind"] == "later"


def test_a_keyframe_fallback_stays_within_the_save_s_budget(caplog: pytest.LogCaptureFixture) -> None:
    """The second save refuses every candidate (eval_fn says only the unquantized model is
    good): the residuals fail, the keyframes are searched within the first save's count of
    calls (nothing near them was confirmed), and the version is stored lossless."""
    x, y, model, opt = _problem()
    repo = ins.open(f"memory://budget-{uuid.uuid4().hex}", create=True)
    live: dict[str, Any] = {}
    strict = {"on": False}

    def quality(m: Any) -> float:
        if not strict["on"]:
            return _accuracy(x, y)(m)
        same = all(torch.equal(v, live[k]) for k, v in m.state_dict().items())
        return 1.0 if same else 0.0

    with Checkpointer(repo, model, opt, eval_fn=quality, policy=BUDGETED, background=False) as ck:
        _train(model, opt, x, y, 10, ck)
        ck.save(10)
        _train(model, opt, x, y, 10, ck)
        strict["on"] = True
        live.update({k: v.clone() for k, v in model.state_dict().items()})
        with caplog.at_level("INFO", logger="inshrink_store.torch.checkpointer"):
            info = ck.save(20)
        assert ck.timings[1]["evaluations"] <= BUDGETED.max_evals[0]
    assert any("searched keyframes" in r.getMessage() for r in caplog.records)
    q = info.metadata["quantization"]
    assert q["config"] is None  # nothing confirmed: lossless, never an unconfirmed candidate
    spent = q["search"]["budget"]
    assert spent["kind"] == "keyframe" and spent["max_evals"] == BUDGETED.max_evals[0]
    assert spent["calls"] <= BUDGETED.max_evals[0] and spent["before"] >= 2
