"""What the evaluation runs: the methods, the ablations, the sweeps, and the order of runs.

Every run of one workload shares its checkpoint schedule (a version every ``every`` steps),
its failures (after the same checkpoints) and its tolerance, so the figures compare methods,
not set-ups. Results are plain JSON-native dicts (no pickle): ``evaluation.json`` keeps them
and the page and plots are made from it.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchmarks.evaluate import baselines
from benchmarks.evaluate.experiment import RunResult, run
from benchmarks.evaluate.methods import Baseline, Ours
from benchmarks.evaluate.workloads import Workload, parameters
from inshrink_store.policy.moments import MomentPolicy
from inshrink_store.policy.search import SearchSpace

TOLERANCE = 0.05  # the search's tolerance, relative: the library's default (and the paper's)
FAILURES = 10
#: the default run's rollback check restores the version at this fraction of the run (lossy)
ROLLBACK_AT = 0.5

#: the methods of the main table, every one with 10 failures; key -> method
MAIN: dict[str, Any] = {
    "ours": Ours("ours", "ours, default (exact resume)", rollback_at=ROLLBACK_AT),
    "ours-er0": Ours("ours-er0", "ours, exact_resume=0 (resume space)", exact_resume=0),
    "ours-paper": Ours("ours-paper", "ours, lossy resumes, full space (the paper's setting)", exact_resume=0,
                       paper_space=True),
    "int8": Baseline("int8", "int8 absmax", baselines.Int8Absmax),
    "cnr": Baseline("cnr", "uniform adaptive (Check-N-Run style)", baselines.UniformAdaptive),
    "qd": Baseline("qd", "entropy bits + mod-B delta (QD-Compressor style)", baselines.EntropyDelta),
    "lc": Baseline("lc", "exponent buckets (LC-Checkpoint style)", baselines.ExponentBuckets),
    "excp": Baseline("excp", "joint weight-moment pruning (ExCP style)", baselines.ExcpJoint),
}
SHORT_NAMES = {"cnn": "CNN", "lm": "LM", "transfer": "transfer", "finetune": "MiniLM"}
LOSSLESS_LABELS = {"ours": "ours, lossless (dedup + float codec + XOR against the parent)", "zipnn": "ZipNN", "zstd": "zstd-3"}

_PAPER = MAIN["ours-paper"]
#: ablations of the paper's setting (lossy resumes, so quality shows): key -> (method, the knob)
ABLATIONS: dict[str, tuple[Ours, str]] = {
    "no-regroup": (dataclasses.replace(_PAPER, key="no-regroup", label="no rearrangement", regroup=False),
                   "the store's delta codec with regrouping off (a private switch: no public option)"),
    "no-delta": (dataclasses.replace(_PAPER, key="no-delta", label="no delta", keyframe_interval=1),
                 "`ins.open(url, create=True, keyframe_interval=1)`: every version a keyframe"),
    "no-protect": (dataclasses.replace(_PAPER, key="no-protect", label="no protection",
                                       space=SearchSpace(protect=(0.0,))),
                   "`SearchSpace(protect=(0.0,))`"),
    "no-prune": (dataclasses.replace(_PAPER, key="no-prune", label="no pruning", space=SearchSpace(prune=(0.0,)),
                                     moments=MomentPolicy(prune=0.0)),
                 "`SearchSpace(prune=(0.0,))` and `MomentPolicy(prune=0.0)`"),
    "magnitude": (dataclasses.replace(_PAPER, key="magnitude", label="magnitude-only scores", gradients=False),
                  "no `observe_gradients()` calls: no sensitivity, so magnitude prunes and protects"),
}


@dataclass(frozen=True)
class Plan:
    """Sizes of one evaluation: the tolerances and restore counts swept, and which workloads
    get the ablations and the sweeps: the first N, so the fine-tune (last, and larger than the
    rest together) gets neither."""

    quick: bool
    tolerances: tuple[float, ...]
    restores: tuple[int, ...]
    failures: int
    ablation_workloads: int  # the first N workloads get the ablations
    sweep_workloads: int  # the first N workloads get the tolerance and restore sweeps

    @classmethod
    def make(cls, quick: bool) -> Plan:
        if quick:
            return cls(True, (0.01, TOLERANCE), (0, 1, 2), 2, 1, 1)
        return cls(False, (0.001, 0.01, TOLERANCE), (0, 1, 5, FAILURES, 20), FAILURES, 2, 3)


def _result(r: RunResult) -> dict[str, Any]:
    """A run as JSON-native data."""
    return dataclasses.asdict(r)


def compact(value: Any) -> Any:
    """``value`` with every float rounded to 6 significant digits: the tables show 4 at most,
    and the saved results stay small."""
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, dict):
        return {k: compact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [compact(v) for v in value]
    return value


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def describe(workload: Workload) -> dict[str, Any]:
    total, trainable = parameters(workload)
    return {"title": workload.title, "short": SHORT_NAMES.get(workload.name, workload.name), "model": workload.model_text, "data": workload.data_text,
            "parameters": total, "trainable": trainable, "steps": workload.steps,
            "checkpoints": workload.checkpoints, "every": workload.every, "metric": workload.metric}


def _timed(label: str, fn: Callable[[], RunResult]) -> dict[str, Any]:
    t = time.perf_counter()
    r = fn()
    _log(f"  {label}: {time.perf_counter() - t:.1f} s, final {r.final}")
    return _result(r)


def run_workload(workload: Workload, plan: Plan, ablations: bool, sweeps: bool) -> dict[str, dict[str, Any]]:
    """Every run of one workload, keyed: ``reference``, the MAIN keys, ``abl:<key>``,
    ``tol:<eps>`` and ``restores:<n>`` (the paper's setting, other tolerances or restore counts)."""
    runs = {"reference": _timed("reference + lossless", lambda: run(workload, None, 0, TOLERANCE, "reference"))}
    for key, method in MAIN.items():
        runs[key] = _timed(key, lambda m=method: run(workload, m, plan.failures, TOLERANCE, m.label))
    for key, (method, _) in ABLATIONS.items() if ablations else ():
        runs[f"abl:{key}"] = _timed(key, lambda m=method: run(workload, m, plan.failures, TOLERANCE, m.label))
    if not sweeps:
        return runs
    for eps in plan.tolerances:
        if eps != TOLERANCE:
            runs[f"tol:{eps}"] = _timed(f"tolerance {eps}", lambda e=eps: run(workload, _PAPER, plan.failures, e,
                                                                                 _PAPER.label))
    for n in plan.restores:
        if n not in (0, plan.failures):
            runs[f"restores:{n}"] = _timed(f"{n} restores", lambda k=n: run(workload, _PAPER, k, TOLERANCE,
                                                                            _PAPER.label))
    return runs


def evaluate(workloads: list[Workload], plan: Plan) -> dict[str, Any]:
    """Run the whole plan; the results as JSON-native data."""
    out: dict[str, Any] = {"plan": dataclasses.asdict(plan), "tolerance": TOLERANCE, "workloads": {}, "runs": {}}
    for i, workload in enumerate(workloads):
        t = time.perf_counter()
        _log(f"[{workload.name}] {workload.title}")
        out["workloads"][workload.name] = describe(workload)
        out["runs"][workload.name] = run_workload(workload, plan, ablations=i < plan.ablation_workloads,
                                                  sweeps=i < plan.sweep_workloads)
        out["workloads"][workload.name]["wall_s"] = time.perf_counter() - t
    out["labels"] = {**{k: m.label for k, m in MAIN.items()},
                     **{f"abl:{k}": m.label for k, (m, _) in ABLATIONS.items()}}
    out["knobs"] = {f"abl:{k}": knob for k, (_, knob) in ABLATIONS.items()}
    out["lossless_labels"] = LOSSLESS_LABELS
    return out
