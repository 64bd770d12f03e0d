"""DistributedCheckpointer.restore() defaults to its own branch, which its saves continue (as the
Checkpointer's does): restoring ``main`` under ``branch="runB"`` would parent runB's next
version on main's history."""

from __future__ import annotations

import pytest

import inshrink_store as ins

torch = pytest.importorskip("torch")
from inshrink_store.torch import DistributedCheckpointer  # noqa: E402

# one process, no process group: torch's DCP says it assumes a single process (as in test_dcp.py)
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def test_restore_defaults_to_the_checkpointers_branch(tmp_path: object) -> None:
    url = f"{tmp_path}/store"
    ins.open(url, create=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    DistributedCheckpointer(url, {"model": model.state_dict()}, lossless=True).save(step=1)
    with torch.no_grad():
        model.weight.add_(1.0)
    run_b = DistributedCheckpointer(url, {"model": model.state_dict()}, branch="runB", lossless=True)
    ins.open(url).create_branch("runB", "main")
    run_b.save(step=2)
    fresh = torch.nn.Linear(8, 4)
    restorer = DistributedCheckpointer(url, {"model": fresh.state_dict()}, branch="runB", lossless=True)
    assert restorer.restore() == 2
    torch.testing.assert_close(fresh.weight, model.weight, rtol=0, atol=0)
    assert ins.open(url).log("main")[0].step == 1
