"""One evaluation workload at full size, a few methods, and where the history's bytes go.

    python -m benchmarks.evaluate.single cnn                    # ours (closed-loop moments) and ours with open-loop moments
    python -m benchmarks.evaluate.single lm --methods ours,excp
    python -m benchmarks.evaluate.single transfer --quick       # the evaluation's tiny size (seconds)
    python -m benchmarks.evaluate.single cnn --rollback 12      # and a rollback to version 12 of each run

Why: the whole evaluation (``python -m benchmarks evaluate --no-finetune``) runs every method,
ablation and sweep on three workloads, about 22 minutes on 2 cores; a change to how one part of
the state is stored needs its figures on one workload at a time. Each run here is the
evaluation's own (:func:`benchmarks.evaluate.experiment.run`: same schedule, 10 failures,
tolerance 5 %, the same reference), and the table adds the moments' ratio (``optimizer/``
tensors: Adam's moments and step counters) beside the weights and the history.

Methods: the keys of :data:`benchmarks.evaluate.plan.MAIN` plus ``ours-open`` (the default with
``MomentPolicy(closed_loop=False)``: moments coded open loop, as before closed-loop moments).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import warnings
from typing import Any

import inshrink_store as ins
from benchmarks.evaluate import metrics
from benchmarks.evaluate.experiment import run
from benchmarks.evaluate.methods import Ours, OursRun, Usage
from benchmarks.evaluate.plan import FAILURES, MAIN, TOLERANCE
from benchmarks.evaluate.workloads import Workload, cnn, cosine, lm, transfer
from inshrink_store.policy.moments import MomentPolicy
from inshrink_store.torch import Checkpointer

#: bytes of the ``optimizer/`` tensors per run label: (logical, stored), filled by :class:`_Tapped`
MOMENT_BYTES: dict[str, tuple[int, int]] = {}


#: rollback checks per run label: variant -> {"step", "exact", "final"}, filled by :class:`_Tapped`
ROLLBACKS: dict[str, dict[str, dict[str, Any]]] = {}


def rollback(workload: Workload, url: str, k: int, reset_moments: bool = False) -> dict[str, Any]:
    """Restore the run's ``k``-th version (1-based; older than the newest, so it has no restore
    residual and restores lossy: the stored weights and moments) into a fresh process, train on
    to the end on the same batches, and give the final quality. Training on from the exact
    state at that step is the uninterrupted reference (its resumes are bit-exact), so the
    difference is what the stored version costs a rollback. ``reset_moments``: Adam's state is
    dropped after the restore (what a checkpoint without moments gives), for contrast."""
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


class _TappedRun(OursRun):
    def finish(self) -> Usage:
        usage = super().finish()
        rows = ins.open(self.url).du(prefix="optimizer/")
        MOMENT_BYTES[self.spec.key] = (sum(r.logical_bytes for r in rows), sum(r.new_stored_bytes for r in rows))
        k = getattr(self.spec, "rollback_k", 0)
        if k:
            ROLLBACKS[self.spec.key] = {"stored": rollback(self.workload, self.url, k),
                                        "moments reset": rollback(self.workload, self.url, k, reset_moments=True)}
        return usage


@dataclasses.dataclass(frozen=True)
class _Tapped(Ours):
    """An :class:`Ours` whose run also records the moments' bytes (``du(prefix="optimizer/")``)
    and, with ``rollback_k``, checks a rollback to that version (:func:`rollback`)."""

    rollback_k: int = 0

    def begin(self, workload: Workload, tolerance: float, workdir: Any) -> OursRun:
        return _TappedRun(self, workload, tolerance, str(workdir / self.key))


def methods(rollback_k: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = {k: (_Tapped(**{f.name: getattr(m, f.name) for f in dataclasses.fields(Ours)},
                                       rollback_k=rollback_k)
                               if isinstance(m, Ours) else m) for k, m in MAIN.items()}
    out["ours-open"] = _Tapped("ours-open", "ours, default, open-loop moments",
                               moments=MomentPolicy(closed_loop=False), rollback_k=rollback_k)
    return out


def workload(name: str, quick: bool) -> Workload:
    if quick:
        return {"cnn": lambda: cnn(24, 3), "lm": lambda: lm(24, 3),
                "transfer": lambda: transfer(24, 3, pretrain_steps=24)}[name]()
    return {"cnn": lambda: cnn(720, 24), "lm": lambda: lm(960, 24),
            "transfer": lambda: transfer(480, 24, pretrain_steps=960)}[name]()


def row(key: str, result: Any, reference: Any, metric: str) -> str:
    usage = dataclasses.asdict(result.usage)
    r = metrics.ratios(usage)
    moments = MOMENT_BYTES.get(key)
    m_ratio = f"{moments[0] / max(moments[1], 1):.1f}x" if moments else "-"
    change = metrics.change(reference.final[metric], result.final[metric], metric)
    return (f"| {key} | {result.restores} ({usage['exact_resumes']}) | {r['weights']:.1f}x | {m_ratio} | "
            f"{r['history']:.1f}x | {r['disk']:.1f}x | {result.final[metric]:.6g} | {change:+.2%} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.evaluate.single", description=__doc__.split("\n\n")[0])
    parser.add_argument("workload", choices=("cnn", "lm", "transfer"))
    parser.add_argument("--methods", default="ours,ours-open", help="comma-separated method keys")
    parser.add_argument("--quick", action="store_true", help="the evaluation's tiny size (2 failures)")
    parser.add_argument("--rollback", type=int, default=0, metavar="K",
                        help="after each of our runs, restore its K-th version lossy (1-based, older than the "
                             "newest), train on to the end and compare with the reference (0: off)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # as the evaluation: one core trains, the other runs the store's thread
    warnings.simplefilter("ignore", UserWarning)
    table = methods(args.rollback)
    keys = [k.strip() for k in args.methods.split(",") if k.strip()]
    unknown = [k for k in keys if k not in table]
    if unknown:
        parser.error(f"unknown methods {unknown}; choose from {sorted(table)}")
    w = workload(args.workload, args.quick)
    failures = 2 if args.quick else FAILURES
    t = time.perf_counter()
    reference = run(w, None, 0, TOLERANCE, "reference")
    print(f"reference: {time.perf_counter() - t:.0f} s, final {reference.final}", file=sys.stderr, flush=True)
    lines = [f"{w.title}: {w.steps} steps, {w.checkpoints} checkpoints, {failures} failures, tolerance {TOLERANCE}",
             "", f"| method | restores (bit-exact) | weights | moments | history | on disk | final {w.metric} | change |",
             "|---|---|---|---|---|---|---|---|",
             f"| reference | 0 | - | - | - | - | {reference.final[w.metric]:.6g} | - |"]
    for key in keys:
        t = time.perf_counter()
        result = run(w, table[key], failures, TOLERANCE, key)
        print(f"{key}: {time.perf_counter() - t:.0f} s, final {result.final}", file=sys.stderr, flush=True)
        lines.append(row(key, result, reference, w.metric))
    if ROLLBACKS:
        lines += ["", f"Rollback to version {args.rollback} (restored lossy, trained on to step {w.steps}):", "",
                  f"| method | restored | from step | final {w.metric} | change vs the exact state |", "|---|---|---|---|---|"]
        for key, variants in ROLLBACKS.items():
            for variant, r in variants.items():
                change = metrics.change(reference.final[w.metric], r["final"][w.metric], w.metric)
                lines.append(f"| {key} | {variant}{' (exact)' if r['exact'] else ''} | {r['step']} | "
                             f"{r['final'][w.metric]:.6g} | {change:+.2%} |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
