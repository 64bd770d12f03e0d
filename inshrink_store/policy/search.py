"""Dynamic configuration search: the most aggressive configuration the model tolerates.

ALGORITHM.md §3. Quality is monotone along each axis of the cube (fewer bins, more
pruning, less protection never help), so the feasible set is closed downwards:
anything less aggressive than a feasible point is feasible, anything more aggressive
than an infeasible one is infeasible. The full (guided) search binary-searches the
cube's diagonal, then visits the remaining points in decreasing measured ratio,
skipping every point the known results already decide; it stops once no undecided
point can beat the best feasible ratio. Later checkpoints search the small
neighbourhood of the previous configuration, never more aggressive than it, and fall
back to the full search when nothing there holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from inshrink_store.policy.config import BINS, METRICS, PROTECT, PRUNE, QuantConfig

Point = QuantConfig


@dataclass(frozen=True)
class SearchSpace:
    """Axes, each listed from least to most aggressive."""

    bins: tuple[int, ...] = tuple(sorted(BINS, reverse=True))
    prune: tuple[float, ...] = PRUNE
    protect: tuple[float, ...] = tuple(sorted(PROTECT, reverse=True))
    metrics: tuple[str, ...] = METRICS

    def index(self, p: Point) -> tuple[int, int, int]:
        return self.bins.index(p.bins), self.prune.index(p.prune), self.protect.index(p.protect)

    def point(self, idx: tuple[int, int, int], metric: str, base: Point) -> Point:
        return QuantConfig(**{**base.to_dict(), "bins": self.bins[idx[0]], "prune": self.prune[idx[1]],
                              "prune_metric": metric, "protect": self.protect[idx[2]]})

    def cube(self) -> list[tuple[int, int, int]]:
        return [(b, p, r) for b in range(len(self.bins)) for p in range(len(self.prune))
                for r in range(len(self.protect))]


def _le(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """a is at most as aggressive as b."""
    return all(x <= y for x, y in zip(a, b, strict=True))


@dataclass(frozen=True)
class Trial:
    config: dict[str, Any]
    ratio: float
    quality: float | None = None
    feasible: bool | None = None


@dataclass
class SearchResult:
    best: Point | None
    mode: str
    trials: list[Trial] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"best": None if self.best is None else self.best.to_dict(), "mode": self.mode,
                "trials": [asdict(t) for t in self.trials]}


class _Evaluator:
    """Caches ratio and feasibility per point and records every trial in order."""

    def __init__(self, measure_ratio: Callable[[Point], float],
                 is_feasible: Callable[[Point], tuple[bool, float]]) -> None:
        self.measure_ratio, self.is_feasible = measure_ratio, is_feasible
        self.ratios: dict[Point, float] = {}
        self.results: dict[Point, tuple[bool, float]] = {}
        self.trials: list[Trial] = []

    def ratio(self, p: Point) -> float:
        if p not in self.ratios:
            self.ratios[p] = float(self.measure_ratio(p))
        return self.ratios[p]

    def feasible(self, p: Point) -> bool:
        if p not in self.results:
            ok, quality = self.is_feasible(p)
            self.results[p] = (bool(ok), float(quality))
            self.trials.append(Trial(p.to_dict(), self.ratio(p), float(quality), bool(ok)))
        return self.results[p][0]


def _full(ev: _Evaluator, space: SearchSpace, metric: str, base: Point) -> tuple[Point | None, float]:
    cube = space.cube()
    feasible: list[tuple[int, int, int]] = []
    infeasible: list[tuple[int, int, int]] = []

    def check(idx: tuple[int, int, int]) -> bool:
        ok = ev.feasible(space.point(idx, metric, base))
        (feasible if ok else infeasible).append(idx)
        return ok

    # 1. binary search along the diagonal
    steps = max(len(space.bins), len(space.prune), len(space.protect)) - 1
    diag = [tuple(round(d * (n - 1) / steps) for n in (len(space.bins), len(space.prune), len(space.protect)))
            for d in range(steps + 1)]
    lo, hi = -1, len(diag)  # diag[lo] feasible, diag[hi] infeasible
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if check(diag[mid]):  # type: ignore[arg-type]
            lo = mid
        else:
            hi = mid
    if lo < 0:
        return None, 0.0

    # 2. the undecided rest, best measured ratio first
    def undecided(idx: tuple[int, int, int]) -> bool:
        return not any(_le(f, idx) for f in infeasible) and not any(_le(idx, g) for g in feasible)

    best = max(feasible, key=lambda i: ev.ratio(space.point(i, metric, base)))
    best_ratio = ev.ratio(space.point(best, metric, base))
    for idx in sorted((i for i in cube if undecided(i)),
                      key=lambda i: (-ev.ratio(space.point(i, metric, base)), i)):
        r = ev.ratio(space.point(idx, metric, base))
        if r <= best_ratio:
            break
        if undecided(idx) and check(idx):
            best, best_ratio = idx, r
    return space.point(best, metric, base), best_ratio


def search(measure_ratio: Callable[[Point], float], is_feasible: Callable[[Point], tuple[bool, float]],
           *, previous: Point | None = None, space: SearchSpace | None = None,
           metrics_available: Sequence[str] = METRICS, base: Point | None = None) -> SearchResult:
    """Pick the configuration with the highest measured ratio that stays feasible.

    ``measure_ratio`` should really encode (cheap next to an evaluation); ``is_feasible``
    evaluates the dequantized model and returns (within tolerance, quality).
    """
    space = space or SearchSpace()
    base = base or QuantConfig()
    metrics = [m for m in space.metrics if m in metrics_available] or ["magnitude"]
    ev = _Evaluator(measure_ratio, is_feasible)
    if previous is not None and previous.bins in space.bins and previous.prune in space.prune \
            and previous.protect in space.protect:
        pidx = space.index(previous)
        candidates = {space.point(pidx, m, previous) for m in metrics}
        for b in (pidx[0] - 1, pidx[0]):
            for p in (pidx[1] - 1, pidx[1]):
                for r in (pidx[2] - 1, pidx[2]):
                    if min(b, p, r) >= 0:
                        candidates.add(space.point((b, p, r), previous.prune_metric, previous))
        for cand in sorted(candidates, key=lambda c: (-ev.ratio(c), space.index(c), c.prune_metric)):
            if ev.feasible(cand):
                return SearchResult(cand, "neighbourhood", ev.trials)
        mode = "fallback"
    else:
        mode = "full"
    best, best_ratio = None, 0.0
    for metric in metrics:
        found, ratio = _full(ev, space, metric, base)
        if found is not None and ratio > best_ratio:
            best, best_ratio = found, ratio
    return SearchResult(best, mode, ev.trials)
