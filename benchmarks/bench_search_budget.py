"""The budgeted search (the default) against the exhaustive one, on the evaluation's workloads.

Each of the evaluation's three workloads (a CNN, a character LM, a fine-tuned LM; see
``docs/evaluation.md``) is trained at full size with ten failures and exact resumes, once
checkpointed by ``SearchPolicy()`` (``max_evals=(8, 3)``) and once by
``SearchPolicy(max_evals=None)`` (the exhaustive search); everything else is the evaluation's
default method. Reported: the weights' ratio over every version, the final test quality, the
candidate evaluations over the run and the ``eval_fn`` calls of the first save and (median)
of the later ones. Runs go two at a time in separate processes (one torch thread each).

    python -m benchmarks search_budget            # full size (~10 min on 2 cores)
    python -m benchmarks search_budget --quick    # tiny runs, to check the harness
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

WORKLOADS = ("cnn", "lm", "transfer")
POLICIES = {"budgeted": "default", "exhaustive": None}


def _one(workload: str, policy: str, quick: bool) -> dict[str, Any]:
    """Train ``workload`` checkpointed with ``policy``; what its versions' records say."""
    import dataclasses
    import warnings

    import torch

    import inshrink_store as ins
    from benchmarks.evaluate import methods, plan, workloads
    from benchmarks.evaluate.experiment import run
    from inshrink_store.policy import SearchPolicy

    torch.set_num_threads(1)
    warnings.simplefilter("ignore", UserWarning)
    exhaustive = policy == "exhaustive"

    @dataclasses.dataclass(frozen=True)
    class Method(methods.Ours):
        def policy(self, tolerance: float, higher_is_better: bool) -> SearchPolicy:
            made = super().policy(tolerance, higher_is_better)
            return dataclasses.replace(made, max_evals=None) if exhaustive else made

    records: list[dict[str, Any]] = []
    finish = methods.OursRun.finish

    def keep_records(self: Any) -> Any:
        usage = finish(self)
        records.extend(i.metadata.get("quantization", {}) for i in reversed(ins.open(self.url).log()))
        return usage

    methods.OursRun.finish = keep_records  # type: ignore[method-assign]
    chosen = {w.name: w for w in workloads.all_workloads(quick, False, False)}[workload]
    t0 = time.perf_counter()
    result = run(chosen, Method("ours", policy), plan.FAILURES if not quick else 2, plan.TOLERANCE)
    wall = time.perf_counter() - t0
    usage = result.usage
    assert usage is not None
    logical = sum(v.logical_weights for v in usage.versions)
    stored = sum(v.stored_weights for v in usage.versions)
    searches = [r.get("search") or {} for r in records]
    calls = [(s.get("budget") or {}).get("calls") for s in searches]
    return {"workload": workload, "policy": policy, "weights_ratio": logical / stored, "final": result.final,
            "evaluations": sum(int(s.get("evaluations", 0)) for s in searches), "calls": calls,
            "settings": usage.settings, "wall_s": wall, "exact_resumes": usage.exact_resumes}


def run_all(quick: bool) -> list[dict[str, Any]]:
    jobs = [(w, p) for w in WORKLOADS for p in POLICIES]
    with ProcessPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(_one, w, p, quick) for w, p in jobs]
        return [f.result() for f in futures]


def _quality(final: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.4f}" for k, v in sorted(final.items()))


def to_markdown(results: list[dict[str, Any]], command: str) -> str:
    by = {(r["workload"], r["policy"]): r for r in results}
    lines = [f"`{command}`: each workload trained with " + ("two" if "--quick" in command else "ten") + " failures (exact resumes), checkpointed by the "
             "budgeted search (the default, `max_evals=(8, 3)`) and by the exhaustive one (`max_evals=None`).", "",
             "| workload | weights ratio, exhaustive | weights ratio, budgeted | final quality, exhaustive | "
             "final quality, budgeted | candidate evaluations, exhaustive / budgeted | budgeted calls: first save; "
             "later saves (median, max) |",
             "|---|---|---|---|---|---|---|"]
    for w in WORKLOADS:
        ex, bu = by[(w, "exhaustive")], by[(w, "budgeted")]
        later = [c for c in bu["calls"][1:] if c is not None]
        spread = f"{statistics.median(later):g}, {max(later)}" if later else "-"
        lines.append(f"| {w} | {ex['weights_ratio']:.1f}x | {bu['weights_ratio']:.1f}x | {_quality(ex['final'])} | "
                     f"{_quality(bu['final'])} | {ex['evaluations']} / {bu['evaluations']} | "
                     f"{bu['calls'][0]}; {spread} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny runs, to check the harness")
    args = parser.parse_args(argv)
    command = "python -m benchmarks search_budget" + (" --quick" if args.quick else "")
    print(to_markdown(run_all(args.quick), command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
