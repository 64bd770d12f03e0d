"""The rollback check: restore an older version lossy, train on, compare with the exact state.

Why: with ``exact_resume`` on, a restart resumes bit-exact from the newest version's restore
residual, so the lossy values of every version (weights and Adam's moments) serve only what
older versions are for: rollbacks, evaluations and exports. Adam's moments are stored under a
guard on the update they drive; whether that guard is the right one is a question about
rollbacks, so the evaluation asks it: version ``k`` (older than the newest, so it has no
restore residual) is restored into a fresh process, trained on to the end on the same batches,
and its final quality compared with training on from the exact state at that step, which is
the uninterrupted reference (the default's resumes are bit-exact, so its run ends exactly
there). The same rollback with Adam's state dropped after the restore (what a checkpoint
without moments gives) shows how much the stored moments are worth.
"""

from __future__ import annotations

from typing import Any

import inshrink_store as ins
from benchmarks.evaluate.workloads import Workload, cosine
from inshrink_store.torch import Checkpointer


def version_index(checkpoints: int, at: float) -> int:
    """The 1-based version a rollback at fraction ``at`` of the run restores: never the newest."""
    return max(1, min(checkpoints - 1, round(at * checkpoints)))


def rollback(workload: Workload, url: str, k: int, reset_moments: bool = False) -> dict[str, Any]:
    """Restore the ``k``-th version (1-based) of ``url``'s main branch into a fresh process,
    train on to the end and give ``{"step", "exact", "final"}`` (``exact``: whether the
    restore was bit-exact, False for any version but the newest)."""
    import torch

    repo = ins.open(url)
    versions = list(reversed(repo.log()))
    info = versions[k - 1]
    model, optimizer = workload.fresh(1000 + k)
    scheduler = cosine(optimizer, workload.steps)
    with Checkpointer(repo, model, optimizer, extra_state={"scheduler": scheduler}, branch="rollback",
                      background=False) as ck:
        step = ck.restore(info.id) or 0
        exact = bool(ck.restored_exact)
    if reset_moments:
        optimizer.state.clear()
    while step < workload.steps:
        optimizer.zero_grad()
        workload.loss(model, *workload.batch(step)).backward()
        optimizer.step()
        scheduler.step()
        step += 1
    with torch.no_grad():
        final = workload.quality(model)
    return {"step": info.step, "exact": exact, "final": final}


def check(workload: Workload, url: str, at: float) -> dict[str, Any]:
    """The rollback at fraction ``at`` of the run, with the stored moments and with none."""
    k = version_index(workload.checkpoints, at)
    return {"version": k, "stored": rollback(workload, url, k),
            "moments reset": rollback(workload, url, k, reset_moments=True)}
