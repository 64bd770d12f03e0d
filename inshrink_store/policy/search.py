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
import math
import time
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


def _le(a: Index, b: Index) -> bool:
    """``a`` is at most as aggressive as ``b``."""
    return a[0] <= b[0] and a[1] <= b[1] and a[2] <= b[2]


class _OutOfBudgetError(Exception):
    """The evaluation budget is spent: the search stops with the best point it evaluated."""


class _Evaluator:
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
        if any(_le(idx, f) for f in self.known.get((metric, True), ())):
            return True
        if any(_le(g, idx) for g in self.known.get((metric, False), ())):
            return False
        return self.evaluate(self.space.point(idx, metric))


def _index(values: Sequence[int]) -> Index:
    return values[0], values[1], values[2]


def _diagonal(lo: Index, hi: Index) -> list[Index]:
    """Points from ``lo`` to ``hi``, each axis at the same fraction, rounded half up; a chain
    whose consecutive points differ by at most one step per axis."""
    sides = [h - low for low, h in zip(lo, hi, strict=True)]
    steps = max(sides)
    if steps == 0:
        return [lo]
    return [_index([low + (2 * d * s + steps) // (2 * steps) for low, s in zip(lo, sides, strict=True)])
            for d in range(steps + 1)]


def _guided(ev: _Evaluator, metric: str, box: tuple[Index, Index] | None = None) -> None:
    """Best-first branch and bound over boxes of one metric's cube (see the module docstring),
    or of the sub-box ``box`` (its least and most aggressive corners)."""
    space = ev.space
    top = _index([n - 1 for n in space.shape])
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
                push(_index([a for a, _ in parts]), _index([b for _, b in parts]))


def _neighbourhood(ev: _Evaluator, previous: SearchPoint, metrics: Sequence[str]) -> SearchPoint | None:
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
    ev = _Evaluator(space, measure_ratio, is_feasible, max_evaluations)
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
            _guided(ev, metric)
    except _OutOfBudgetError:
        return SearchResult(ev.best, ev.trials, "budget")
    return SearchResult(ev.best, ev.trials, mode)


# -- the budgeted search -----------------------------------------------------------------------
#
# Evaluating a candidate (``eval_fn`` on the dequantized model) is what a save's search costs,
# so a budgeted search ranks candidates by a cheap prediction and spends its few evaluations
# confirming one. Each candidate has a predicted error ``E`` (estimated from the same sample of
# each tensor as its ratio; the caller's), and quality falls as ``E`` grows, so the search
# brackets the error the model tolerates: the first guess is where a fit of the run's
# evaluations (the relative drop against ``E``, a line through the origin, recent saves
# weighing most) reaches the tolerance, a little inside; each evaluation moves one side of the
# bracket and refits the line; a guess outside the bracket falls back to its middle. Only
# evaluated points are ever chosen.

#: evaluations of the run the predictor keeps (the newest; the model changes as it trains)
PREDICTOR_WINDOW = 16
#: how much a save's evaluation outweighs one of the save before it in the predictor's fit: the
#: drop per unit of error grew 20x over the evaluation's LM run (a trained model is touchier)
RECENCY = 2.0
#: where the first guess of a save aims: this fraction of the error the fit says reaches the
#: tolerance (a guess right at the edge of the fit fails about half the time)
MARGIN = 0.7
#: how far the bracket moves past its one known side (a factor on E: about one step of the
#: levels axis, whose squared error grows ~4x per halving)
GROW = 4.0
#: the bracket counts as closed when its ends are this close (a factor on E)
_CLOSED = 1.05
#: rounds of one search at most (evaluations and thresholds that brought nothing new together)
_ROUNDS = 40


class QualityPredictor:
    """The relative quality drop a candidate costs, predicted from its error ``E``: ``k * E``,
    ``k`` fitted by weighted least squares through the origin on the run's evaluations (drops
    below 0, noise, count as 0); an evaluation of an earlier save weighs :data:`RECENCY` times
    less per save between. Deterministic: the same evaluations, the same predictions."""

    def __init__(self) -> None:
        self.points: list[tuple[float, float, int]] = []  # (E, relative drop, save), oldest first
        self.save = 0
        self._budget: SaveBudget | None = None  # the save the newest evaluations belong to
        #: per search space, the (estimated ratio, E) of every point a search of that space
        #: estimated, carried from save to save: a later save ranks its box by them (scaled by
        #: the drift at its previous point) and estimates afresh only what it would evaluate
        self.estimates: dict[SearchSpace, tuple[dict[SearchPoint, float], dict[SearchPoint, float]]] = {}

    def begin(self, budget: SaveBudget) -> None:
        """Evaluations from now on belong to the save of ``budget`` (a new save outweighs the
        ones before; a second search of the same save, e.g. keyframes after residuals, not)."""
        if budget is not self._budget:
            self._budget = budget
            self.save += 1

    def add(self, error: float, drop: float) -> None:
        self.points.append((float(error), float(drop), self.save))
        del self.points[:-PREDICTOR_WINDOW]

    @property
    def slope(self) -> float | None:
        """``k`` (None: no evaluation has shown a drop yet)."""
        den = num = 0.0
        for e, d, save in self.points:
            w = RECENCY ** -(self.save - save)
            den += w * e * e
            num += w * e * max(d, 0.0)
        return None if den <= 0 or num <= 0 else num / den

    def predict(self, error: float) -> float | None:
        k = self.slope
        return None if k is None else k * error

    def threshold(self, tolerance: float) -> float:
        """The error at which the fit reaches ``tolerance`` (inf: no drop seen yet)."""
        k = self.slope
        return math.inf if k is None else tolerance / k


class SaveBudget:
    """One save's ``eval_fn`` calls and seconds, shared by every search of that save (a
    closed-loop residual search and the keyframe search after it, the wider-embeddings
    retry) and by the unquantized baseline, which counts as a call. ``max_seconds`` is checked
    before each call (wall clock: leave it None where decisions must repeat)."""

    def __init__(self, max_evals: int | None, max_seconds: float | None = None, kind: str = "first") -> None:
        self.max_evals, self.max_seconds, self.kind = max_evals, max_seconds, kind
        self.calls, self.seconds = 0, 0.0
        self.baseline: float | None = None  # the unquantized quality, evaluated once per save
        self._start = time.perf_counter()

    def widen(self, max_evals: int | None, kind: str) -> None:
        """Allow ``max_evals`` calls in all (never fewer than now): a keyframe search within a
        later save gets the first save's count, since nothing near it was confirmed."""
        if self.max_evals is not None:
            self.max_evals = None if max_evals is None else max(self.max_evals, max_evals)
        self.kind = kind

    def stop_reason(self) -> str | None:
        """Why no further call may start (None: one may)."""
        if self.max_evals is not None and self.calls >= self.max_evals:
            return "calls"
        if self.max_seconds is not None and time.perf_counter() - self._start >= self.max_seconds:
            return "seconds"
        return None

    def call(self, fn: Callable[[], float]) -> float:
        """Run one ``eval_fn`` call and count it."""
        t0 = time.perf_counter()
        try:
            return float(fn())
        finally:
            self.calls += 1
            self.seconds += time.perf_counter() - t0

    def spent(self, before: int, stopped: str) -> BudgetSpent:
        return BudgetSpent(self.kind, self.max_evals, self.max_seconds, self.calls, before, self.seconds, stopped)


def _box_around(space: SearchSpace, previous: SearchPoint) -> tuple[Index, Index]:
    """The points at most one step from ``previous`` on each axis (either way)."""
    p = space.index(previous)
    return (_index([max(v - 1, 0) for v in p]),
            _index([min(v + 1, n - 1) for v, n in zip(p, space.shape, strict=True)]))


def budgeted_search(measure_ratio: Callable[[SearchPoint], float], measure_error: Callable[[SearchPoint], float],
                    evaluate: Callable[[SearchPoint], tuple[bool, float, float]], *, predictor: QualityPredictor,
                    tolerance: float, budget: SaveBudget, start_error: float | Callable[[], float],
                    previous: HasSearchAxes | None = None,
                    space: SearchSpace | None = None, metrics_available: Sequence[str] = METRICS) -> SearchResult:
    """The highest-ratio point confirmed feasible within ``budget`` (None: none confirmed).

    ``evaluate(point)`` runs ``eval_fn`` on the point's model and returns (within tolerance,
    quality, relative drop); ``measure_error(point)`` is its predicted error ``E``. The
    candidate of a threshold ``theta`` is the highest-ratio point with ``E <= theta`` that is
    not at least as aggressive as a refused one, in the whole cube, or, when ``previous`` is
    given and the run has evaluations, within one step of it on each axis (found by the branch
    and bound above, so only the errors it needs are measured). The search keeps a bracket on
    ``E``: below ``lo`` nothing beats the best confirmed point, ``hi`` is the least error
    refused. Each round's ``theta`` is where the fit reaches the tolerance (a save's first
    guess :data:`MARGIN` inside it; with no fit yet, ``start_error``, or what it returns: a
    later save, which has a fit, never estimates it), or the bracket's
    geometric middle when that lies outside it; a threshold whose candidate is nothing new
    raises ``lo`` to it without an evaluation. A later save's neighbourhood search stops as
    soon as the fit predicts that nothing above its confirmed point holds; a first or keyframe
    search narrows the bracket until the budget ends or the bracket closes. The result is the
    best-ratio *evaluated* feasible point: a prediction alone never chooses.
    """
    space = space if space is not None else SearchSpace()
    metrics = [m for m in space.metrics if m in metrics_available]
    if not metrics:
        raise FormatError(f"Expected metrics_available to share a metric with {space.metrics}. Got "
                          f"{tuple(metrics_available)} instead. Pass ('magnitude',) at least.")
    later = bool(predictor.points)
    predictor.begin(budget)
    prev = None
    if previous is not None:
        prev = previous if isinstance(previous, SearchPoint) else SearchPoint.of(previous)
    box = None if prev is None or not later else _box_around(space, prev)
    ratios: dict[SearchPoint, float] = {}
    errors: dict[SearchPoint, float] = {}
    trials: dict[SearchPoint, Trial] = {}

    def ratio(p: SearchPoint) -> float:
        if p not in ratios:
            ratios[p] = float(measure_ratio(p))
        return ratios[p]

    def error(p: SearchPoint) -> float:
        if p not in errors:
            errors[p] = float(measure_error(p))
        return errors[p]

    # a later save ranks its box by the previous save's estimates (each a codebook fit and a
    # sample coded per tensor), scaled by how far its previous point's estimates moved, and
    # estimates afresh only a point it is about to evaluate: ratios and errors drift slowly from
    # save to save, and what is evaluated, recorded and chosen is always estimated afresh
    prior: tuple[dict[SearchPoint, float], dict[SearchPoint, float]] = ({}, {})
    if box is not None and prev is not None:
        kept = predictor.estimates.get(space, ({}, {}))
        if prev in kept[0] and prev in kept[1]:
            prior = kept
    drift: list[float] = []

    def _scale(now: float, then: float) -> float:
        factor = now / then if then > 0 else 1.0
        return factor if math.isfinite(factor) and factor > 0 else 1.0

    def scaled(p: SearchPoint, axis: int) -> float:
        if not drift:
            assert prev is not None  # a prior is only kept with a previous point
            drift.extend((_scale(ratio(prev), prior[0][prev]), _scale(error(prev), prior[1][prev])))
        return prior[axis][p] * drift[axis]

    def rank_ratio(p: SearchPoint) -> float:
        return ratio(p) if p in ratios or p not in prior[0] else scaled(p, 0)

    def rank_error(p: SearchPoint) -> float:
        return error(p) if p in errors or p not in prior[1] else scaled(p, 1)

    refused: dict[str, list[Index]] = {}

    def allowed(p: SearchPoint, theta: float, rank: bool = False) -> bool:
        """Predicted feasible at ``theta``, and not at least as aggressive as a refused point
        (quality is monotone along the cube's axes: such a point is known to fail)."""
        idx = space.index(p)
        e = rank_error(p) if rank else error(p)
        return e <= theta and not any(_le(r, idx) for r in refused.get(p.prune_metric, ()))

    # a later save stays with its previous point's prune metric: its neighbourhood in the other
    # metric doubled the configurations estimated (each a codebook fit per tensor) for little
    searched = [prev.prune_metric] if box is not None and prev is not None and prev.prune_metric in metrics \
        else metrics

    def ranked(theta: float) -> SearchPoint | None:
        """The highest-ratio point (of the box) predicted feasible at ``theta``, by the best
        estimates known (the prior's where nothing was estimated afresh)."""
        found: SearchPoint | None = None
        for metric in searched:
            ev = _Evaluator(space, rank_ratio, lambda p: (allowed(p, theta, rank=True), 0.0))
            _guided(ev, metric, box)
            if ev.best is not None and (found is None or ev.best_ratio > rank_ratio(found)):
                found = ev.best
        return found

    def candidate(theta: float) -> SearchPoint | None:
        """:func:`ranked`, until the point it names is estimated afresh and still named."""
        found = ranked(theta)
        while found is not None and (found not in ratios or found not in errors):
            ratio(found), error(found)
            found = ranked(theta)
        return found

    def middle(lo: float, hi: float) -> float:
        if math.isinf(hi):
            return lo * GROW if lo > 0 else start()
        return math.sqrt(lo * hi) if lo > 0 else hi / GROW

    def start() -> float:
        return float(start_error()) if callable(start_error) else float(start_error)

    explore = box is None
    lo, hi = 0.0, math.inf
    best: SearchPoint | None = None
    before = budget.calls
    stopped = "converged"
    first_guess = True
    for _ in range(_ROUNDS):
        if not math.isinf(hi) and lo > 0 and hi <= lo * _CLOSED:
            break  # the bracket closed: nothing untried lies between
        reason = budget.stop_reason()
        if reason is not None:
            stopped = reason
            break
        theta = predictor.threshold(tolerance) * (MARGIN if first_guess else 1.0)
        if math.isinf(theta):
            theta = start() if first_guess else math.inf
        first_guess = False
        if not lo < theta < hi:
            if theta <= lo and best is not None and not explore:
                break  # the fit says nothing above the confirmed point holds
            theta = middle(lo, hi)
        c = candidate(theta)
        if c is None or c in trials or (best is not None and ratio(c) <= ratio(best)):
            lo = max(lo, theta)  # below theta nothing beats the best: look higher
            continue
        expected = predictor.predict(error(c))
        ok, quality, drop = evaluate(c)
        trials[c] = Trial(c, ratio(c), float(quality), bool(ok), error(c), expected)
        predictor.add(error(c), drop)
        if ok:
            lo = max(lo, error(c))
            if best is None or ratio(c) > ratio(best):
                best = c
        else:
            hi = min(hi, error(c))
            refused.setdefault(c.prune_metric, []).append(space.index(c))
    if best is None and stopped == "converged" and budget.stop_reason() is None:
        # nothing confirmed: before the caller stores lossless, the safe fallback, the least
        # aggressive point of each metric not known to fail (the bracket can close just above
        # its error when the tolerance is tight)
        corner = box[0] if box is not None else (0, 0, 0)
        safe = [p for p in (space.point(corner, m) for m in searched) if p not in trials and allowed(p, math.inf)]
        for c in sorted(safe, key=lambda p: (error(p), p.prune_metric)):
            if budget.stop_reason() is not None:
                stopped = "calls"
                break
            ok, quality, drop = evaluate(c)
            trials[c] = Trial(c, ratio(c), float(quality), bool(ok), error(c), predictor.predict(error(c)))
            predictor.add(error(c), drop)
            if ok:
                best = c
                break
    predictor.estimates[space] = ({**{p: rank_ratio(p) for p in prior[0]}, **ratios},
                                  {**{p: rank_error(p) for p in prior[1]}, **errors})
    listed = [trials.get(p, Trial(p, r, error=errors.get(p))) for p, r in ratios.items()]
    return SearchResult(best, listed, "predicted", budget.spent(before, stopped))
