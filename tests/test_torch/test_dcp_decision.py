"""The DistributedCheckpointer decides with the Checkpointer's SaveDecider (issue 45, item 2): open
loop, the policy's space, and the run's predictor carried from save to save and refilled by a
restore, where each save used to start a new one (a later save ranked its candidates without
the run's evaluations)."""

from __future__ import annotations

from typing import Any

import pytest

import inshrink_store as ins

torch = pytest.importorskip("torch")
from inshrink_store.policy import SaveDecider, SearchPolicy  # noqa: E402
from inshrink_store.torch import DistributedCheckpointer  # noqa: E402

# one process, no process group: torch's DCP says it assumes a single process (as in test_dcp.py)
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _quality(model: Any) -> float:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(128, 64, generator=g)
    with torch.no_grad():
        return -float(model(x).square().mean())


def test_the_run_s_evaluations_carry_to_the_next_save_and_through_a_restore(tmp_path: object) -> None:
    url = f"{tmp_path}/store"
    ins.open(url, create=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
    policy = SearchPolicy(tolerance=0.5, higher_is_better=True)
    ck = DistributedCheckpointer(url, {"model": model.state_dict()}, eval_fn=_quality, eval_model=model,
                                 policy=policy)
    decider = ck.decider
    assert isinstance(decider, SaveDecider) and not decider.closed_loop and not decider.resume_space
    assert decider.policy.optimizer is None  # the optimizer's state is stored exact
    first = ck.save(step=1)
    fitted = len(ck._run.predictor.points)
    assert fitted > 0 and ck.last_record is not None and ck.previous == ck.last_record.config
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)
    ck.save(step=2)
    record = ck.last_record
    assert record is not None and record.search is not None and record.search.budget is not None
    assert record.search.budget.kind == "later"
    assert len(ck._run.predictor.points) > fitted  # the second save's evaluations joined the first's
    fresh = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
    again = DistributedCheckpointer(url, {"model": fresh.state_dict()}, eval_fn=_quality, eval_model=fresh,
                                    policy=policy)
    assert again.restore(first) == 1
    assert len(again._run.predictor.points) == fitted  # the restored version's record refills the fit
