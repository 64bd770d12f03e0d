"""The budgeted search (``SearchPolicy(max_evals=...)``, the default): a bounded number of
``eval_fn`` calls per save, candidates ranked by a predictor of their quality drop.
Layer: refs, history and policy (the policy imports neither sibling), below ``parts``.

Evaluating a candidate (``eval_fn`` on the dequantized model) is what a save's search costs,
so a budgeted search ranks candidates by a cheap prediction and spends its few evaluations
confirming one. Each candidate has a predicted error ``E`` (estimated from the same sample of
each tensor as its ratio; the caller's), and quality falls as ``E`` grows, so the search
brackets the error the model tolerates: the first guess is where a fit of the run's
evaluations (the relative drop against ``E``, a line through the origin, recent saves
weighing most) reaches the tolerance, a little inside; each evaluation moves one side of the
bracket and refits the line; a guess outside the bracket falls back to its middle. Only
evaluated points are ever chosen.

Split out of :mod:`~inshrink_store.policy.search` (the cube, its points and the exhaustive
search), whose branch and bound it uses to find a threshold's candidate.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

from inshrink_store.errors import FormatError
from inshrink_store.policy.search import (
    METRICS,
    BudgetSpent,
    Evaluator,
    Index,
    SearchPoint,
    SearchResult,
    SearchSpace,
    Trial,
    as_index,
    at_most_as_aggressive,
    guided,
)
from inshrink_store.policy.settings import HasSearchAxes

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
    return (as_index([max(v - 1, 0) for v in p]),
            as_index([min(v + 1, n - 1) for v, n in zip(p, space.shape, strict=True)]))


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
        return e <= theta and not any(at_most_as_aggressive(r, idx) for r in refused.get(p.prune_metric, ()))

    # a later save stays with its previous point's prune metric: its neighbourhood in the other
    # metric doubled the configurations estimated (each a codebook fit per tensor) for little
    searched = [prev.prune_metric] if box is not None and prev is not None and prev.prune_metric in metrics \
        else metrics

    def ranked(theta: float) -> SearchPoint | None:
        """The highest-ratio point (of the box) predicted feasible at ``theta``, by the best
        estimates known (the prior's where nothing was estimated afresh)."""
        found: SearchPoint | None = None
        for metric in searched:
            ev = Evaluator(space, rank_ratio, lambda p: (allowed(p, theta, rank=True), 0.0))
            guided(ev, metric, box)
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
