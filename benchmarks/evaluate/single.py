"""One evaluation workload at full size, a few methods, and where the history's bytes go.

    python -m benchmarks.evaluate.single cnn                    # ours (closed-loop moments) and ours with open-loop moments
    python -m benchmarks.evaluate.single lm --methods ours,excp
    python -m benchmarks.evaluate.single transfer --quick       # the evaluation's tiny size (seconds)
    python -m benchmarks.evaluate.single cnn --rollback-at 0.5  # and a rollback to the run's middle version

Why: the whole evaluation (``python -m benchmarks evaluate --no-finetune``) runs every method,
ablation and sweep on three workloads, about 22 minutes on 2 cores; a change to how one part of
the state is stored needs its figures on one workload at a time. Each run here is the
evaluation's own (:func:`benchmarks.evaluate.experiment.run`: same schedule, 10 failures,
tolerance 5 %, the same reference), and the table adds the moments' ratio (``optimizer/``
tensors: Adam's moments and step counters) beside the weights and the history.

Methods: the keys of :data:`benchmarks.evaluate.plan.MAIN` plus ``ours-closed`` (the default with
closed-loop moments, ``MomentPolicy(closed_loop=True)``, opt-in), ``ours-open`` (the default with
``MomentPolicy(min_numel=4096)``: the moments as they were stored before ``min_numel`` 1024) and
``ours-history-closed`` (the default's history moments, :data:`ROLLBACK_MOMENTS`, closed loop),
``ours-loose`` (closed-loop moments with the guard loosened to :data:`LOOSE_MOMENTS`), ``ours-strict`` (every
version's moments under the strict guard a lossy resume keeps: ``history_moments=None``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import warnings
from typing import Any

from benchmarks.evaluate import metrics
from benchmarks.evaluate.experiment import RunResult, run
from benchmarks.evaluate.methods import Ours
from benchmarks.evaluate.plan import FAILURES, MAIN, TOLERANCE
from benchmarks.evaluate.workloads import Workload, cnn, lm, transfer
from inshrink_store.policy.moments import ROLLBACK_MOMENTS, MomentPolicy

#: a looser guard on the moments (the default: cosine 0.95, error 0.3): with an exact resume the
#: moments' stored values serve only rollbacks, which :mod:`benchmarks.evaluate.rollback` checks
LOOSE_MOMENTS = MomentPolicy(min_update_cosine=0.8, max_update_error=0.6, closed_loop=True)


def methods(rollback_at: float = 0.0) -> dict[str, Any]:
    """The methods by key, every exact-resume one of ours with the rollback check at ``rollback_at``."""
    out: dict[str, Any] = {k: dataclasses.replace(m, rollback_at=rollback_at) if isinstance(m, Ours) and
                           m.exact_resume else m for k, m in MAIN.items()}
    out["ours-closed"] = Ours("ours-closed", "ours, closed-loop moments (opt-in)",
                              moments=MomentPolicy(closed_loop=True), rollback_at=rollback_at)
    out["ours-open"] = Ours("ours-open", "ours, open-loop moments, min_numel 4096 (before this release)",
                            moments=MomentPolicy(closed_loop=False, min_numel=4096), rollback_at=rollback_at)
    out["ours-strict"] = Ours("ours-strict", "ours, moments under the strict guard (history_moments=None)",
                              history_moments=None, rollback_at=rollback_at)
    out["ours-history-closed"] = Ours("ours-history-closed", "ours, closed-loop history moments (opt-in)",
                                      history_moments=dataclasses.replace(ROLLBACK_MOMENTS, closed_loop=True),
                                      rollback_at=rollback_at)
    out["ours-loose"] = Ours("ours-loose", "ours, closed-loop moments guarded at cosine 0.8 / error 0.6",
                             moments=LOOSE_MOMENTS, rollback_at=rollback_at)
    return out


def workload(name: str, quick: bool) -> Workload:
    """The evaluation's workload ``name`` at its full size (or its ``--quick`` size)."""
    if quick:
        return {"cnn": lambda: cnn(24, 3), "lm": lambda: lm(24, 3),
                "transfer": lambda: transfer(24, 3, pretrain_steps=24)}[name]()
    return {"cnn": lambda: cnn(720, 24), "lm": lambda: lm(960, 24),
            "transfer": lambda: transfer(480, 24, pretrain_steps=960)}[name]()


def row(key: str, result: RunResult, reference: RunResult, metric: str) -> str:
    assert result.usage is not None
    usage = dataclasses.asdict(result.usage)
    r = metrics.ratios(usage)
    moments = usage.get("moments")
    m_ratio = f"{moments[0] / max(moments[1], 1):.1f}x" if moments else "-"
    change = metrics.change(reference.final[metric], result.final[metric], metric)
    return (f"| {key} | {result.restores} ({usage['exact_resumes']}) | {r['weights']:.1f}x | {m_ratio} | "
            f"{r['history']:.1f}x | {r['disk']:.1f}x | {result.final[metric]:.6g} | {change:+.2%} |")


def rollback_rows(checks: dict[str, Any], reference: RunResult, metric: str) -> list[str]:
    """The rollback checks' table: the final ``metric`` and, when that is not the loss (the CNN's
    accuracy moves in steps of one test image), the final test loss too."""
    shown = [metric] + (["loss"] if metric != "loss" and "loss" in reference.final else [])
    lines = ["| method | version (step) | moments | " + " | ".join(f"final {m} | change" for m in shown) + " |",
             "|---|---|---|" + "---|---|" * len(shown)]
    for key, check in checks.items():
        for variant in ("stored", "moments reset"):
            r = check[variant]
            cells = [f"{r['final'][m]:.6g} | {metrics.change(reference.final[m], r['final'][m], m):+.2%}" for m in shown]
            lines.append(f"| {key} | {check['version']} ({r['step']}) | {variant} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.evaluate.single", description=__doc__.split("\n\n")[0])
    parser.add_argument("workload", choices=("cnn", "lm", "transfer"))
    parser.add_argument("--methods", default="ours-closed,ours-open", help="comma-separated method keys")
    parser.add_argument("--quick", action="store_true", help="the evaluation's tiny size (2 failures)")
    parser.add_argument("--rollback-at", type=float, default=0.0, metavar="F",
                        help="after each of our exact-resume runs, restore the version at fraction F of the run "
                             "lossy, train on to the end and compare with the reference (0: off)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # as the evaluation: one core trains, the other runs the store's thread
    warnings.simplefilter("ignore", UserWarning)
    table = methods(args.rollback_at)
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
    checks: dict[str, Any] = {}
    for key in keys:
        t = time.perf_counter()
        result = run(w, table[key], failures, TOLERANCE, key)
        print(f"{key}: {time.perf_counter() - t:.0f} s, final {result.final}", file=sys.stderr, flush=True)
        lines.append(row(key, result, reference, w.metric))
        if result.usage is not None and result.usage.rollback:
            checks[key] = result.usage.rollback
    if checks:
        lines += ["", f"Rollbacks (restored lossy, trained on to step {w.steps}; change against training on from "
                  "the exact state, the reference):", "", *rollback_rows(checks, reference, w.metric)]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
