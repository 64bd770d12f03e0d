"""A user's script, as the README and the training-loop guide write it, checked by
``python -m mypy --strict tests/typing/user_script.py`` (.ci/run) so that an IDE and a
user's own type checker see the types the public API returns: each ``assert_type`` fails
the check if a result is ``Any`` or another type than documented. It also runs
(``python tests/typing/user_script.py``; tests/test_house/test_user_script.py runs it), so every
assertion holds at run time too.
"""

from __future__ import annotations

import tempfile
from concurrent.futures import Future
from typing import Any, assert_type

import numpy as np
import torch

import inshrink_store as ins
from inshrink_store import (
    DiffReport,
    GcReport,
    Repository,
    SnapshotInfo,
    SnapshotReader,
    TensorChange,
)
from inshrink_store.policy import QuantConfig
from inshrink_store.torch import Checkpointer, array_to_tensor, export_state, load_state, save_state


def numpy_versions(repo: Repository) -> None:
    w = np.random.default_rng(0).standard_normal((64, 64), dtype=np.float32)
    first = repo.save({"model/w": w}, message="step 0", step=0)
    assert_type(first, SnapshotInfo)
    second = repo.save({"model/w": w + 0.01}, message="step 1", step=1,
                       quantize=QuantConfig(bins=16, prune=0.1, protect=0.005))
    assert second.parent == first.id and second.step == 1

    snap = repo.checkout("main")
    assert_type(snap, SnapshotReader)
    assert snap["w"].shape == (64, 64)
    assert_type(snap.read("w"), np.ndarray)

    report = repo.diff("main~1", "main", values=True)
    assert_type(report, DiffReport)
    for change in report.tensors:
        assert_type(change, TensorChange)
        assert change.path == "model/w" and change.status == "changed"
        assert change.rel_l2_change is not None and change.rel_l2_change > 0

    history = repo.log("main")
    assert_type(history, list[SnapshotInfo])
    assert [info.step for info in history] == [1, 0]
    arrays = repo.load("main~1")
    assert_type(arrays, dict[str, np.ndarray])
    assert np.array_equal(arrays["model/w"], w)
    assert_type(repo.resolve("main"), str)
    assert_type(repo.branches(), dict[str, str])


def torch_state(repo: Repository) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    info = save_state(repo, {"model": model.state_dict(), "optimizer": opt.state_dict()}, step=100)
    assert_type(info, SnapshotInfo)
    state = load_state(repo, "main")
    assert_type(state, dict[str, Any])
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    exported = export_state(repo.checkout("main"))
    assert_type(exported, dict[str, Any])
    assert torch.equal(exported["0.weight"], model.state_dict()["0.weight"])
    assert_type(array_to_tensor(np.zeros(3, np.float32), "F32"), torch.Tensor)


def checkpointer(repo: Repository) -> None:
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    # foreground: save returns the SnapshotInfo itself
    with Checkpointer(repo, model, optimizer, lossless=True, background=False, branch="fg") as ck:
        saved = ck.save(10)
        assert_type(saved, SnapshotInfo | Future[SnapshotInfo])
        assert isinstance(saved, SnapshotInfo) and saved.step == 10
    # background (the default): save returns a Future of it
    with Checkpointer(repo, model, optimizer, lossless=True, branch="bg") as ck:
        pending = ck.save(20, metrics={"loss": 0.5})
        assert isinstance(pending, Future)
        done: SnapshotInfo = pending.result()
        assert done.step == 20
        last = ck.wait()
        assert_type(last, SnapshotInfo | None)
    # after a restart: new objects, the same store
    model2 = torch.nn.Linear(8, 2)
    ck2 = Checkpointer(repo, model2, torch.optim.SGD(model2.parameters(), lr=0.1), lossless=True, branch="bg")
    step = ck2.restore()
    assert_type(step, int | None)
    assert step == 20
    assert torch.equal(model2.weight, model.weight)
    assert_type(ck2.last_gc, GcReport | None)
    ck2.close()


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        repo = ins.open(f"{folder}/store", create=True)
        assert_type(repo, Repository)
        numpy_versions(repo)
        torch_state(repo)
        checkpointer(repo)


if __name__ == "__main__":
    main()
