"""Dynamic configuration search: the highest measured ratio the model still tolerates.
Layer: refs, history and policy (the policy imports neither sibling), below ``parts``.

ALGORITHM.md §3, explained in docs/understanding/search.md. Evaluating the dequantized
model is the expensive step, so the search spends its ``is_feasible`` calls where they
decide something. Quality is assumed monotone along every axis (fewer bins, more
pruning, less protection never improve it), so the feasible set is closed downwards in
the index cube: whatever is at most as aggressive as a feasible point is feasible,
whatever is at least as aggressive as an infeasible point is infeasible. Every answer
is cached and those two inferences are reused, so no point is evaluated twice and many
are never evaluated at all.

- First checkpoint and fallback: a best-first branch and bound over boxes of the
  cube. In a box, binary-search its diagonal for the most aggressive feasible point,
  then split the box there and queue the pieces that may still beat the best ratio:
  a piece is dropped when the ratio measured at its most aggressive corner cannot
  beat the best, or when its least aggressive corner is infeasible. Once per prune
  metric. When the ratio also grows with aggressiveness this returns the true
  optimum (tests check it against brute force).
- Later checkpoints: the previous point with the other metric (only if it measures a
  higher ratio), and the previous point's neighbourhood, never more aggressive than
  it. The previous point (and the other metric at it) first, in decreasing ratio: with
  ratios that grow with aggressiveness it has its neighbourhood's highest, so a
  feasible previous point is taken without measuring the points behind it (a point
  behind it whose ratio measures higher anyway is not preferred). Then the points
  behind it in decreasing ratio; stop at the first feasible one. None feasible: the
  full search over the whole cube, reusing every answer so far.

This module is pure (numpy-free, torch-free); ``SearchPoint.to_dict()`` has the same
keys as ``QuantConfig``'s search axes, so a caller builds its config from it.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import product
from numbers import Integral, Real
from typing import Any

from inshrink_store.errors import FormatError
from inshrink_store.policy.settings import HasSearchAxes

METRICS = ("magnitude", "sensitivity")
Index = tuple[int, int, int]




@dataclass(frozen=True)
class SearchPoint:
    """One point of the cube: ``bins`` levels, the lowest ``prune`` fraction by
    ``prune_metric`` zeroed, the top ``protect`` fraction kept in high precision."""

    bins: int
    prune: float
    prune_metric: str
    protect: float

    def __post_init__(self) -> None:
        checks = [
            (isinstance(self.bins, Integral) and not isinstance(self.bins, bool) and self.bins >= 2,
             "bins an int >= 2", self.bins),
            (isinstance(self.prune, Real) and 0.0 <= self.prune < 1.0, "prune in [0, 1)", self.prune),
            (self.prune_metric in METRICS, f"prune_metric in {METRICS}", self.prune_metric),
            (isinstance(self.protect, Real) and 0.0 <= self.protect < 1.0, "protect in [0, 1)", self.protect),
        ]
        for ok, what, got in checks:
            if not ok:
                raise FormatError(f"Expected {what} in SearchPoint. Got {got!r} instead. Fix the value.")
        for name, kind in (("bins", int), ("prune", float), ("protect", float)):
            object.__setattr__(self, name, kind(getattr(self, name)))  # numpy scalars -> JSON-native

    def to_dict(self) -> dict[str, Any]:
        return {"bins": self.bins, "prune": self.prune, "prune_metric": self.prune_metric,
                "protect": self.protect}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SearchPoint:
        if set(data) != set(cls.__dataclass_fields__):
            raise FormatError(f"Expected exactly the keys {sorted(cls.__dataclass_fields__)}. Got "
                              f"{sorted(data)} instead. Build it with SearchPoint.to_dict().")
        return cls(data["bins"], data["prune"], data["prune_metric"], data["protect"])

    @classmethod
    def of(cls, config: HasSearchAxes) -> SearchPoint:
        """The search axes of any object with these four attributes (e.g. a QuantConfig)."""
        return cls(config.bins, config.prune, config.prune_metric, config.protect)


@dataclass(frozen=True)
class SearchSpace:
    """The cube's axes. Index space orders each axis from least to most aggressive:
    bins from most to fewest, prune from least to most, protect from most to least."""

    bins: tuple[int, ...] = (4, 6, 8, 12, 16, 32)
    prune: tuple[float, ...] = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5)
    metrics: tuple[str, ...] = METRICS
    protect: tuple[float, ...] = (0.0005, 0.005, 0.01)

    def __post_init__(self) -> None:
        for name in ("bins", "prune", "metrics", "protect"):
            values = tuple(getattr(self, name))
            if not values or len(set(values)) != len(values):
                raise FormatError(f"Expected a non-empty SearchSpace.{name} without repeats. Got {values!r} "
                                  "instead. List each value once.")
            object.__setattr__(self, name, values)
        self.points()  # builds every SearchPoint, which validates each value

    @cached_property
    def axes(self) -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[Any, ...]]:
        return (tuple(sorted(self.bins, reverse=True)), tuple(sorted(self.prune)),
                tuple(sorted(self.protect, reverse=True)))

    @cached_property
    def shape(self) -> Index:
        b, p, r = self.axes
        return len(b), len(p), len(r)

    def __len__(self) -> int:
        b, p, r = self.shape
        return b * p * r * len(self.metrics)

    def point(self, idx: Index, metric: str) -> SearchPoint:
        b, p, r = self.axes
        return SearchPoint(b[idx[0]], p[idx[1]], metric, r[idx[2]])

    def index(self, point: SearchPoint) -> Index:
        b, p, r = self.axes
        try:
            return b.index(point.bins), p.index(point.prune), r.index(point.protect)
        except ValueError:
            raise FormatError(f"Expected a point on the axes {self.axes}. Got {point} instead. Search "
                              "with a SearchSpace that holds the previous point.") from None

    def points(self) -> list[SearchPoint]:
        """Every point, metric-major, each metric's points in index order."""
        b, p, r = self.shape
        return [self.point(i, m) for m in self.metrics for i in product(range(b), range(p), range(r))]


@dataclass(frozen=True)
class Trial:
    """One measured point; ``quality``/``feasible`` are None when only the ratio was measured.
    A budgeted search (:func:`budgeted_search`) also records the point's predicted ``error``
    (the weighted reconstruction error the predictor ranks by) and ``predicted``, the
    relative quality drop its fit expected when the point was chosen (None: not evaluated, or
    no fit yet)."""

    point: SearchPoint
    ratio: float
    quality: float | None = None
    feasible: bool | None = None
    error: float | None = None
    predicted: float | None = None

    def to_dict(self) -> dict[str, Any]:
        data = {"point": self.point.to_dict(), "ratio": self.ratio, "quality": self.quality,
                "feasible": self.feasible}
        if self.error is not None:
            data["error"] = self.error
        if self.predicted is not None:
            data["predicted"] = self.predicted
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Trial:
        return cls(SearchPoint.from_dict(data["point"]), float(data["ratio"]),
                   None if data["quality"] is None else float(data["quality"]),
                   None if data["feasible"] is None else bool(data["feasible"]),
                   None if data.get("error") is None else float(data["error"]),
                   None if data.get("predicted") is None else float(data["predicted"]))


@dataclass(frozen=True)
class BudgetSpent:
    """How one save's evaluation budget was spent, as of the end of this search.

    ``kind``: ``"first"`` (no earlier evaluation in the run) or ``"later"``; ``max_evals`` /
    ``max_seconds``: the budget (None: no limit); ``calls``: ``eval_fn`` calls of the save so
    far, the unquantized baseline's included (``before``: those spent before this search, by a
    closed-loop residual search that found nothing); ``seconds``: their wall time;
    ``stopped``: why the search ended (``"converged"``: raising the threshold brought no
    untried candidate that could beat the best confirmed one, ``"calls"`` / ``"seconds"``: the
    budget ran out)."""

    kind: str
    max_evals: int | None
    max_seconds: float | None
    calls: int
    before: int
    seconds: float
    stopped: str

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "max_evals": self.max_evals, "max_seconds": self.max_seconds,
                "calls": self.calls, "before": self.before, "seconds": self.seconds, "stopped": self.stopped}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BudgetSpent:
        return cls(str(data["kind"]), None if data["max_evals"] is None else int(data["max_evals"]),
                   None if data["max_seconds"] is None else float(data["max_seconds"]), int(data["calls"]),
                   int(data["before"]), float(data["seconds"]), str(data["stopped"]))


@dataclass(frozen=True)
class SearchResult:
    """The chosen point (None: nothing feasible), every trial in order, and how it was found:
    ``"full"`` (no previous), ``"neighbourhood"``, ``"budget"`` (stopped when its evaluation
    budget was spent), ``"embeddings"`` (a second full search with 32 embedding levels after
    nothing was feasible; see ``SearchPolicy``), ``"fallback"`` (full search after an
    infeasible neighbourhood), or ``"predicted"`` (:func:`budgeted_search`; then ``budget``
    says how the save's evaluation budget was spent)."""

    best: SearchPoint | None
    trials: list[Trial] = field(default_factory=list)
    mode: str = "full"
    budget: BudgetSpent | None = None

    @property
    def evaluations(self) -> int:
        """How many times ``is_feasible`` ran."""
        return sum(t.feasible is not None for t in self.trials)

    def to_dict(self) -> dict[str, Any]:
        data = {"best": None if self.best is None else self.best.to_dict(), "mode": self.mode,
                "evaluations": self.evaluations, "trials": [t.to_dict() for t in self.trials]}
        if self.budget is not None:
            data["budget"] = self.budget.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SearchResult:
        best = None if data["best"] is None else SearchPoint.from_dict(data["best"])
        budget = None if data.get("budget") is None else BudgetSpent.from_dict(data["budget"])
        return cls(best, [Trial.from_dict(t) for t in data["trials"]], str(data["mode"]), budget)


def at_most_as_aggressive(a: Index, b: Index) -> bool:
    """``a`` is at most as aggressive as ``b``."""
    return a[0] <= b[0] and a[1] <= b[1] and a[2] <= b[2]


class _OutOfBudgetError(Exception):
    """The evaluation budget is spent: the search stops with the best point it evaluated."""


class Evaluator:
    """Calls each callback at most once per point, infers what monotone quality decides,
    and records the trials in first-touch order."""

    def __init__(self, space: SearchSpace, measure_ratio: Callable[[SearchPoint], float],
                 is_feasible: Callable[[SearchPoint], tuple[bool, float]],
                 budget: int | None = None) -> None:
        self.space, self.measure_ratio, self.is_feasible = space, measure_ratio, is_feasible
        self.budget = budget
        self.ratios: dict[SearchPoint, float] = {}
        self.answers: dict[SearchPoint, bool] = {}
        self.known: dict[tuple[str, bool], list[Index]] = {}
        self.slot: dict[SearchPoint, int] = {}
        self.trials: list[Trial] = []
        self.best: SearchPoint | None = None  # the best really-evaluated feasible point
        self.best_ratio = float("-inf")  # earlier wins ties

    def ratio(self, p: SearchPoint) -> float:
        if p not in self.ratios:
            self.ratios[p] = float(self.measure_ratio(p))
            self.slot[p] = len(self.trials)
            self.trials.append(Trial(p, self.ratios[p]))
        return self.ratios[p]

    def evaluate(self, p: SearchPoint) -> bool:
        """Really run ``is_feasible`` (once per point)."""
        if p not in self.answers:
            if self.budget is not None and len(self.answers) >= self.budget:
                raise _OutOfBudgetError
            ratio = self.ratio(p)  # first, so the trial keeps its first-touch slot
            ok, quality = self.is_feasible(p)
            self.answers[p] = bool(ok)
            self.trials[self.slot[p]] = Trial(p, ratio, float(quality), bool(ok))
            if ok and ratio > self.best_ratio:
                self.best, self.best_ratio = p, ratio
            self.known.setdefault((p.prune_metric, bool(ok)), []).append(self.space.index(p))
        return self.answers[p]

    def consider(self, p: SearchPoint) -> None:
        """Evaluate ``p`` if it would beat the best (its feasibility may only be inferred)."""
        if self.ratio(p) > self.best_ratio:
            self.evaluate(p)

    def feasible(self, idx: Index, metric: str) -> bool:
        """Inferred from a known answer when monotonicity decides it, else evaluated."""
        if any(at_most_as_aggressive(idx, f) for f in self.known.get((metric, True), ())):
            return True
        if any(at_most_as_aggressive(g, idx) for g in self.known.get((metric, False), ())):
            return False
        return self.evaluate(self.space.point(idx, metric))


def as_index(values: Sequence[int]) -> Index:
    return values[0], values[1], values[2]


def _diagonal(lo: Index, hi: Index) -> list[Index]:
    """Points from ``lo`` to ``hi``, each axis at the same fraction, rounded half up; a chain
    whose consecutive points differ by at most one step per axis."""
    sides = [h - low for low, h in zip(lo, hi, strict=True)]
    steps = max(sides)
    if steps == 0:
        return [lo]
    return [as_index([low + (2 * d * s + steps) // (2 * steps) for low, s in zip(lo, sides, strict=True)])
            for d in range(steps + 1)]


def guided(ev: Evaluator, metric: str, box: tuple[Index, Index] | None = None) -> None:
    """Best-first branch and bound over boxes of one metric's cube (see the module docstring),
    or of the sub-box ``box`` (its least and most aggressive corners)."""
    space = ev.space
    top = as_index([n - 1 for n in space.shape])
    heap: list[tuple[float, Index, Index]] = []

    def push(lo: Index, hi: Index) -> None:
        heapq.heappush(heap, (-ev.ratio(space.point(hi, metric)), lo, hi))

    push(*(box or ((0, 0, 0), top)))
    while heap:
        neg, lo, hi = heapq.heappop(heap)
        if -neg <= ev.best_ratio or not ev.feasible(lo, metric):
            continue
        diag = _diagonal(lo, hi)
        low, high = 0, len(diag)  # diag[low] feasible, diag[high] infeasible (or past the end)
        while high - low > 1:
            mid = (low + high) // 2
            if ev.feasible(diag[mid], metric):
                low = mid
            else:
                high = mid
        f = diag[low]
        ev.consider(space.point(f, metric))
        for side in product((0, 1), repeat=3):
            if not any(side):
                continue  # [lo, f]: feasible, and f has its highest ratio when ratio is monotone
            parts = [(lo[k], f[k]) if s == 0 else (f[k] + 1, hi[k]) for k, s in enumerate(side)]
            if all(a <= b for a, b in parts):
                push(as_index([a for a, _ in parts]), as_index([b for _, b in parts]))


def _neighbourhood(ev: Evaluator, previous: SearchPoint, metrics: Sequence[str]) -> SearchPoint | None:
    """Never more aggressive than ``previous``: one step back on any subset of axes, plus
    ``previous`` with the other metric when that measures a higher ratio.

    ``previous`` is the most aggressive point of its neighbourhood, so with ratios that grow
    with aggressiveness it has the highest ratio of its metric: it (and the other metric at
    the same point, when that is higher) is tried first, and the ratios of the points behind
    it are asked for only when that fails. A version whose previous point still holds costs
    two ratios and one evaluation."""
    space = ev.space
    p = space.index(previous)

    def order(points: list[SearchPoint]) -> list[SearchPoint]:
        return sorted(points, key=lambda c: (-ev.ratio(c), space.index(c), c.prune_metric))

    head = [previous] + [space.point(p, m) for m in metrics
                         if m != previous.prune_metric and ev.ratio(space.point(p, m)) > ev.ratio(previous)]
    found = next((c for c in order(head) if ev.evaluate(c)), None)
    if found is not None:
        return found
    behind = [space.point((p[0] - a, p[1] - b, p[2] - c), previous.prune_metric)
              for a, b, c in product((0, 1), repeat=3) if any((a, b, c)) and min(p[0] - a, p[1] - b, p[2] - c) >= 0]
    return next((c for c in order(behind) if ev.evaluate(c)), None)


def search(measure_ratio: Callable[[SearchPoint], float], is_feasible: Callable[[SearchPoint], tuple[bool, float]],
           *, previous: HasSearchAxes | None = None, space: SearchSpace | None = None,
           metrics_available: Sequence[str] = METRICS, max_evaluations: int | None = None) -> SearchResult:
    """The feasible point with the highest measured ratio (best=None if none is feasible:
    the caller then stores losslessly or with its most conservative configuration).

    ``measure_ratio(point)`` encodes and returns the compression ratio; ``is_feasible(point)``
    evaluates the dequantized model and returns (within tolerance, quality). Each runs at
    most once per point; the same callbacks give the same trials in the same order.
    ``previous`` (any object with the four axes, e.g. a QuantConfig) selects the
    neighbourhood search; if its metric is not available, the first available one is used.
    ``max_evaluations`` caps the calls of ``is_feasible`` (for an expensive ``eval_fn``): when
    it is spent, the search stops with the best feasible point it evaluated (mode
    ``"budget"``; None if it evaluated none).
    """
    if max_evaluations is not None and (isinstance(max_evaluations, bool) or not isinstance(max_evaluations, int)
                                        or max_evaluations < 1):
        raise FormatError(f"Expected max_evaluations to be an int >= 1 or None. Got {max_evaluations!r} instead.")
    space = space if space is not None else SearchSpace()
    metrics = [m for m in space.metrics if m in metrics_available]
    if not metrics:
        raise FormatError(f"Expected metrics_available to share a metric with {space.metrics}. Got "
                          f"{tuple(metrics_available)} instead. Pass ('magnitude',) at least.")
    ev = Evaluator(space, measure_ratio, is_feasible, max_evaluations)
    mode = "full"
    try:
        if previous is not None:
            prev = previous if isinstance(previous, SearchPoint) else SearchPoint.of(previous)
            if prev.prune_metric not in metrics:
                prev = SearchPoint(prev.bins, prev.prune, metrics[0], prev.protect)
            found = _neighbourhood(ev, prev, metrics)
            if found is not None:
                return SearchResult(found, ev.trials, "neighbourhood")
            mode = "fallback"
        for metric in metrics:
            guided(ev, metric)
    except _OutOfBudgetError:
        return SearchResult(ev.best, ev.trials, "budget")
    return SearchResult(ev.best, ev.trials, mode)
