"""What a checkpoint's search costs without ``eval_fn``: estimated ratios against measured ones.

The 32.5 M-parameter state of ``bench_quantization.py`` (1024x1024 Student-t layers, with
``|w * g|`` sensitivities from seeded gradients) goes through two checkpoints of
:class:`~inshrink_store.policy.SearchPolicy`: the first a full search of the default cube,
the second (weights moved a little) the neighbourhood search around the first's choice.
``eval_fn`` is a stand-in, ``1 - ||w - q|| / ||w||`` over the model with tolerance 0.2, and
its CPU time is left out of every figure. Each checkpoint is searched twice on the same
data, side by side:

- **estimated** (what the library does): candidates ranked by ratios estimated from their
  parts and samples (``policy/estimate.py``), only the evaluated ones quantized, and the
  feasible ones close to the best measured to decide (the chosen one's measured ratio in
  the table is taken afterwards, untimed);
- **measured** (what it did before): every candidate the search ranks quantized and
  encoded to measure its ratio.

"search + save" adds the write of the chosen plans into a fresh local store (encode,
hash, fsync). CPU seconds are the process's (every thread), minus the stand-in's. The
estimate's error is each trial's estimated ratio against the same configuration's
measured one (measured afterwards, untimed).

    python -m benchmarks search      # prints the markdown section
"""

from __future__ import annotations

import copy
import os
import sys
import tempfile
import time
from typing import Any

import numpy as np

import inshrink_store as ins  # noqa: E402
from inshrink_store.policy import SearchPolicy  # noqa: E402
from inshrink_store.policy.budgeted_search import QualityPredictor  # noqa: E402
from inshrink_store.policy.candidates import Candidates  # noqa: E402
from inshrink_store.policy.config import QuantConfig  # noqa: E402
from inshrink_store.policy.plans import PlanSet  # noqa: E402

N_PARAMS = 32_500_000
TOLERANCE = 0.2  # relative: the stand-in quality 1 - rel. L2 error may fall to 0.8
REPEAT = 2  # each search; the one with the least CPU is shown (the machine is shared)


class MeasuredCandidates(Candidates):
    """The search before estimates: every ranked candidate quantized and encoded."""

    def ratio(self, config: QuantConfig) -> float:
        return self.measured_ratio(config)


def _state(n: int, seed: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    from benchmarks.bench_quantization import make_weights

    rng = np.random.default_rng(seed + 100)
    weights = {f"model/{k}": v for k, v in make_weights(n).items()}
    if seed:  # a later checkpoint: every weight moved a little
        weights = {k: (v + rng.standard_normal(v.shape).astype(np.float32) * np.float32(0.002 * np.std(v)))
                   for k, v in weights.items()}
    sensitivity = {k: np.abs(v * rng.standard_normal(v.shape).astype(np.float32))
                   for k, v in weights.items() if v.ndim >= 2}
    return weights, sensitivity


class _StandIn:
    """``1 - ||w - q|| / ||w||`` over the planned tensors, timed apart (its CPU is left out)."""

    def __init__(self, weights: dict[str, np.ndarray]) -> None:
        self.weights, self.cpu, self.calls = weights, 0.0, 0
        self.norm = float(np.sqrt(sum(float(np.vdot(v, v)) for v in weights.values())))

    def __call__(self, plans: PlanSet | None) -> float:
        start = time.process_time()
        self.calls += 1
        try:
            if plans is None:
                return 1.0
            err = sum(float(np.sum(np.square(self.weights[p] - plan.values, dtype=np.float64)))
                      for p, plan in plans.items())
            return 1.0 - float(np.sqrt(err)) / self.norm
        finally:
            self.cpu += time.process_time() - start


def _search_once(kind: type[Candidates], weights: dict[str, np.ndarray], sensitivity: dict[str, np.ndarray],
                 previous_codecs: dict[str, dict[str, Any]], previous: QuantConfig | None, tmp: str,
                 attempt: str, predictor: QualityPredictor) -> dict[str, Any]:
    dtypes = dict.fromkeys(weights, "F32")
    policy = SearchPolicy(tolerance=TOLERANCE, optimizer=None)
    stand_in = _StandIn(weights)
    wall, cpu = time.perf_counter(), time.process_time()
    candidates = kind(weights, dtypes, previous_codecs, sensitivity=sensitivity)
    decision = policy.decide(candidates, stand_in, previous=previous, predictor=predictor)
    search_wall, search_cpu = time.perf_counter() - wall, time.process_time() - cpu - stand_in.cpu
    repo = ins.open(os.path.join(tmp, attempt), create=True)
    wall, cpu = time.perf_counter(), time.process_time()
    repo.save(weights, quantize=decision.plans, message="bench")
    save_wall, save_cpu = time.perf_counter() - wall, time.process_time() - cpu
    search = decision.record.search
    assert search is not None and decision.record.config is not None
    measured = candidates.measured_ratio(decision.record.config)  # untimed: encoded once more
    return {"search_cpu": search_cpu, "search_wall": search_wall, "save_cpu": save_cpu, "save_wall": save_wall,
            "evaluations": search.evaluations, "trials": len(search.trials), "mode": search.mode,
            "config": decision.record.config, "measured": measured,
            "chosen_estimate": next(t.ratio for t in search.trials if t.point.to_dict() == {
                k: getattr(decision.record.config, k) for k in ("bins", "prune", "prune_metric", "protect")}),
            "trial_points": [t.point for t in search.trials], "trial_ratios": [t.ratio for t in search.trials],
            "plans": decision.plans, "candidates": candidates, "predictor": predictor}


def _codecs(plans: PlanSet) -> dict[str, dict[str, Any]]:
    """The parent's codebooks as a save with a parent would read them from its zarr.json."""
    return {p: {"codec": {"codebook": list(plan.serializer.codebook)}} for p, plan in plans.items()}


def run(quick: bool = False) -> dict[str, Any]:
    n = N_PARAMS // 8 if quick else N_PARAMS
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        previous_codecs: dict[str, dict[str, Any]] = {}
        previous: QuantConfig | None = None
        # the run's evaluations so far, as a Checkpointer's policy keeps them from save to save
        # (a later save searches around its parent's point only when the run has a fit)
        predictor = QualityPredictor()
        for checkpoint in (1, 2):
            weights, sensitivity = _state(n, checkpoint - 1)
            results = {}
            for name, kind in (("estimated", Candidates), ("measured", MeasuredCandidates)):
                tries = [_search_once(kind, weights, sensitivity, previous_codecs, previous, tmp,
                                      f"{checkpoint}-{name}-{a}", copy.deepcopy(predictor)) for a in range(REPEAT)]
                results[name] = min(tries, key=lambda r: r["search_cpu"])
            est = results["estimated"]
            # each trial's estimate against the same configuration measured (untimed)
            policy = SearchPolicy(tolerance=TOLERANCE, optimizer=None)
            cands = est["candidates"]
            errors = [ratio / cands.measured_ratio(policy.config(point)) - 1
                      for point, ratio in zip(est["trial_points"], est["trial_ratios"], strict=True)]
            for name, r in results.items():
                rows.append({"checkpoint": checkpoint, "how": name, **{k: v for k, v in r.items()
                             if k not in ("plans", "candidates", "trial_points", "trial_ratios")},
                             "config": r["config"].to_dict(),
                             "errors": errors if name == "estimated" else None})
            previous, previous_codecs, predictor = est["config"], _codecs(est["plans"]), est["predictor"]
            del results, est, cands
    return {"n": n, "cores": os.cpu_count(), "rows": rows}


def _cfg(c: dict[str, Any]) -> str:
    return f"{c['bins']} / {c['prune']:.0%} {c['prune_metric']} / {c['protect']:.2%}"


def to_markdown(r: dict[str, Any]) -> str:
    n = r["n"]
    lines = [
        f"{n / 1e6:.1f} M float32 parameters (1024x1024 Student-t layers, seeded, with `|w * g|` sensitivities), "
        "two checkpoints through `SearchPolicy.decide` with its default search (the checkpoint column names the "
        "mode), the second's weights all moved a little from the first's. `eval_fn` is a stand-in "
        f"(1 - relative L2 error, tolerance {TOLERANCE:g}); its CPU is left out of every figure. Each search ran "
        f"{REPEAT} times on the same data; shown is the run that used the least CPU. *Estimated* is the library: "
        "candidates ranked by ratios estimated from a sample of each tensor, only evaluated ones quantized, the "
        "feasible ones within 15 % of the best estimate measured to decide (the measured ratio column is taken "
        "afterwards, untimed). *Measured* is the search before: every ranked candidate quantized and encoded. "
        "*Search + save* adds writing the chosen plans into a fresh local store. CPU is the process's, "
        "every thread (tensors are estimated and planned on the writer's threads).",
        "",
        "| checkpoint | ratios | trials | evaluations | chosen (bins / prune / protect) | ratio measured | "
        "search wall s | search CPU s | search M params per CPU-s | search + save M params per CPU-s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        total = row["search_cpu"] + row["save_cpu"]
        lines.append(
            f"| {row['checkpoint']} ({row['mode']}) | {row['how']} | {row['trials']} | {row['evaluations']} | "
            f"{_cfg(row['config'])} | {row['measured']:.2f}x | {row['search_wall']:.2f} | {row['search_cpu']:.2f} | "
            f"{n / 1e6 / row['search_cpu']:.1f} | {n / 1e6 / total:.1f} |")
    errors = [e for row in r["rows"] if row["errors"] for e in row["errors"]]
    chosen = [row["chosen_estimate"] / row["measured"] - 1 for row in r["rows"] if row["how"] == "estimated"]
    lines += [
        "",
        f"- Estimate against measurement, every trial of both checkpoints ({len(errors)} configurations): "
        f"mean error {np.mean(errors):+.1%}, largest {max(errors, key=abs):+.1%}; the chosen configuration "
        f"{', '.join(f'{e:+.1%}' for e in chosen)}. Both ways chose the same configurations: "
        f"{'yes' if _same_choices(r['rows']) else 'no'}.",
        "- Target: search + planning + encode per checkpoint, without `eval_fn`, >= 25 M params per CPU-s: "
        + ", ".join(f"checkpoint {row['checkpoint']} {n / 1e6 / (row['search_cpu'] + row['save_cpu']):.1f}"
                    for row in r["rows"] if row["how"] == "estimated") + ".",
    ]
    return "\n".join(lines)


def _same_choices(rows: list[dict[str, Any]]) -> bool:
    by = {(row["checkpoint"], row["how"]): row["config"] for row in rows}
    return all(by[(c, "estimated")] == by[(c, "measured")] for c in {row["checkpoint"] for row in rows})


if __name__ == "__main__":
    print(to_markdown(run(quick="--quick" in sys.argv)))
