"""SearchPolicy: how a checkpoint's configuration is chosen, and what it takes to store it.
Layer: refs, history and policy (the policy imports neither sibling), below ``parts``.

The policy owns every decision about *what* a checkpoint stores: the search space, the
acceptance rule (``tolerance`` relative to the unquantized quality, ``higher_is_better``),
the settings every candidate starts from (``base``, also what is stored when there is
no way to evaluate), and the planner of the optimizer state. The Checkpointer keeps
only its own job (copying, the background thread, commits) and hands the policy a
:class:`Candidates` and an evaluation callback; :meth:`SearchPolicy.decide` returns the
plans to write and the :class:`QuantizationRecord` that explains them.

The policy knows nothing of torch: ``evaluate(plans)`` is the caller's, and returns the
model's quality with those plans' values loaded (``evaluate(None)``: the model as it is).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from numbers import Real
from typing import Any, TypedDict

from typing_extensions import Unpack

from inshrink_store.errors import FormatError
from inshrink_store.plans import Planner
from inshrink_store.policy.allocation import Allocation, AllocationCandidates, AllocationTrial
from inshrink_store.policy.budgeted_search import QualityPredictor, SaveBudget, budgeted_search
from inshrink_store.policy.candidates import KEEP, Candidates
from inshrink_store.policy.config import DEFAULT_CONFIG, EMBEDDING_BINS, QuantConfig
from inshrink_store.policy.moments import (
    DEFAULT_MOMENTS,
    ROLLBACK_MOMENTS,
    MomentPlans,
    MomentPolicy,
    MomentRecord,
)
from inshrink_store.policy.plans import PlanSet
from inshrink_store.policy.record import QuantizationRecord
from inshrink_store.policy.search import SearchPoint, SearchResult, SearchSpace, search
from inshrink_store.policy.streaming import MomentStream, StreamedPlanSet, WeightStream

#: the caller's quality of the model with a candidate's values loaded (None: unquantized)
Evaluate = Callable[[PlanSet | None], float]


class PolicyArgs(TypedDict, total=False):
    """The Checkpointer keywords of 0.1 that each set a field of the policy."""

    tolerance: float
    higher_is_better: bool
    space: SearchSpace | None
    optimizer_policy: Planner | MomentPolicy | str | None


#: where a version that a restart will load as stored is searched (Checkpointer
#: ``exact_resume=0``): 16 to 64 levels, at most 40 % of a residual's entries left at the
#: parent's value, 0.5 % protected. Each lossy restore hands training the stored model. While
#: every version was quantized afresh the damage added up over restores even when each
#: version was within the tolerance (a digits MLP +33 % after 10 restores at the default
#: space's 4-32 levels, +24 % at 16, -0.1 % at 256), so this space was 256 levels, nothing
#: pruned. Versions are closed-loop residuals now (each within one residual's error of the
#: live weights), and the damage no longer adds up: after 10 restores at tolerance 1 % the
#: digits MLP and a character LM end -0.31 % / +0.81 % with this space (+3.58 % / -0.93 %
#: with the default space, -0.06 % / +0.08 % with 256 levels; ``python -m benchmarks
#: fault_tolerance --sweep``), and the evaluation's three workloads at tolerance 5 % -0.25 %
#: (accuracy) / -0.54 % / +0.16 %, whole state 16.7x / 8.7x / 11.8x against 9.4x / 5.4x / 7.1x
#: at 256 levels (docs/guides/what-you-get-back.md).
RESUME_SPACE = SearchSpace(bins=(64, 32, 16), prune=(0.0, 0.2, 0.4), metrics=("magnitude",), protect=(0.005,))

#: evaluated feasible points whose estimated ratio is at least (1 - this) x the best's are
#: measured, and the highest measured one is stored (see ``SearchPolicy._measured_choice``)
MEASURE_WITHIN = 0.15

#: the ``optimizer`` values that name a policy: Adam moments compressed (guarded) or lossless
OPTIMIZER_POLICIES = ("compressed", "lossless")

#: ``eval_fn`` calls a save may spend by default (the unquantized baseline's included): on the
#: first save of a run, and on later ones (``SearchPolicy.max_evals``)
MAX_EVALS = (8, 3)

#: the relative drop a quality that is not a number counts as in the predictor's fit
_NAN_DROP = 1.0


@dataclass(frozen=True)
class Decision:
    """What to write for one checkpoint: ``plans`` (model and optimizer; None: nothing is
    quantized), the ``record`` that goes into the version's metadata, and ``moments``: how
    the optimizer's moments were stored (None when a custom planner or nothing stored them)."""

    plans: PlanSet | None
    record: QuantizationRecord
    moments: MomentRecord | None = None
    #: ``decide(stream=True)``: the moments planned as the writer reads them (``moments`` is
    #: None until then); :meth:`moment_record` gives the record once they are written
    streamed_moments: MomentStream | None = None

    def moment_record(self) -> MomentRecord | None:
        """How the moments were stored: ``moments``, or the streamed moments' record (after
        the writer read them; a pair it did not read is planned now)."""
        if self.moments is None and self.streamed_moments is not None:
            return self.streamed_moments.record
        return self.moments


@dataclass(frozen=True)
class SearchPolicy:
    """The most aggressive configuration of ``space`` whose quality stays within ``tolerance``.

    ``tolerance`` is relative to the unquantized model's quality (``higher_is_better=False``
    for a loss). ``base`` gives every candidate its settings off the search axes and is
    stored as it is when there is nothing to evaluate with. ``optimizer`` stores the
    ``optimizer/`` tensors: a :class:`~inshrink_store.policy.moments.MomentPolicy` (the
    default, ``"compressed"``: Adam's moments pruned with the weights and quantized, each
    tensor checked by the Adam update it drives), ``"lossless"`` or None (bit-exact), or any
    planner (e.g. ``StatePlanner(QuantConfig(...), scope="optimizer/")``, unchecked).
    ``keep``: candidate PlanSets held at once.

    ``max_evals`` (default :data:`MAX_EVALS`, ``(8, 3)``; docs/understanding/search.md, "A
    search with a budget"): the ``eval_fn`` calls one save may spend, the unquantized
    baseline's included, on the first save of a run and on later ones (an int sets both); a
    keyframe search within a later save (a closed-loop chain's new keyframe, or the fallback
    after its residuals failed) gets the first count (:meth:`widen_for_keyframes`).
    Candidates are ranked by a predictor of their quality drop (their weighted reconstruction
    error, fitted to the run's evaluations:
    :func:`~inshrink_store.policy.budgeted_search.budgeted_search`) and only a confirmed one is
    stored: when the budget runs out first, the best configuration confirmed so far, else the
    model lossless. ``max_seconds``: also stop starting ``eval_fn`` calls once the save's
    search has run this long (wall clock; None: no limit). ``max_evals=None`` runs the
    exhaustive search (about 20-40 calls on a first save), whose cap is
    ``max_evaluations``: at most this many candidate evaluations per checkpoint (None: no
    limit); setting ``max_evaluations`` selects that search too. ``resume_space`` replaces ``space`` for
    versions a restart loads as stored (:meth:`resuming`; the Checkpointer with
    ``exact_resume=0``): see :data:`RESUME_SPACE`. ``history_moments`` (default
    :data:`~inshrink_store.policy.moments.ROLLBACK_MOMENTS`) replaces the default ``optimizer``
    for versions a restart never loads as stored (:meth:`for_history`; the Checkpointer with
    ``exact_resume`` >= 1), whose moments serve rollbacks only; None keeps ``optimizer``.

    ``allocation_ratios`` (e.g. :data:`~inshrink_store.policy.allocation.RATIOS`) searches
    per-tensor allocations instead of the configuration cube: the one knob is the target
    ratio, each tensor's levels follow from it (:class:`~inshrink_store.policy.Allocation`,
    protecting ``base.protect``), and a bisection over the ratios finds the largest one whose
    quality is within tolerance (about log2(len) evaluations).
    """

    tolerance: float = 0.05
    higher_is_better: bool = True
    space: SearchSpace = field(default_factory=SearchSpace)
    base: QuantConfig = DEFAULT_CONFIG
    optimizer: Planner | MomentPolicy | str | None = DEFAULT_MOMENTS
    keep: int = KEEP
    resume_space: SearchSpace = field(default_factory=lambda: RESUME_SPACE)
    max_evaluations: int | None = None
    allocation_ratios: tuple[float, ...] | None = None
    max_evals: int | tuple[int, int] | None = MAX_EVALS
    max_seconds: float | None = None
    history_moments: MomentPolicy | None = ROLLBACK_MOMENTS

    def __post_init__(self) -> None:
        evals = self.max_evals
        if evals is not None:
            pair = (evals, evals) if isinstance(evals, int) and not isinstance(evals, bool) else evals
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(
                    isinstance(n, int) and not isinstance(n, bool) and n >= 2 for n in pair)):
                raise FormatError(
                    "Expected max_evals an int >= 2 or a pair (first save, later saves) of them (eval_fn calls "
                    f"per save, the baseline's included), or None (the exhaustive search) in SearchPolicy. Got "
                    f"{evals!r} instead.")
            object.__setattr__(self, "max_evals", (int(pair[0]), int(pair[1])))
        secs = self.max_seconds
        if secs is not None and not (isinstance(secs, Real) and not isinstance(secs, bool) and secs > 0):
            raise FormatError(f"Expected max_seconds a number > 0 or None in SearchPolicy. Got {secs!r} instead.")
        if self.allocation_ratios is not None:
            ratios = self.allocation_ratios
            if not isinstance(ratios, (tuple, list)) or not ratios or not all(
                    isinstance(r, Real) and not isinstance(r, bool) and math.isfinite(r) and r >= 1 for r in ratios):
                raise FormatError(
                    "Expected allocation_ratios a non-empty tuple of ratios >= 1 (e.g. (4, 8, 12, 16)) or "
                    f"None in SearchPolicy. Got {ratios!r} instead."
                )
            object.__setattr__(self, "allocation_ratios", tuple(sorted({float(r) for r in ratios})))
        if isinstance(self.optimizer, str) and self.optimizer in OPTIMIZER_POLICIES:
            object.__setattr__(self, "optimizer", DEFAULT_MOMENTS if self.optimizer == "compressed" else None)
        tol = self.tolerance
        checks = [
            (isinstance(tol, Real) and not isinstance(tol, bool) and math.isfinite(tol) and tol >= 0,
             "tolerance a finite number >= 0 (relative, e.g. 0.05)", tol),
            (isinstance(self.higher_is_better, bool), "higher_is_better True or False (False for a loss)",
             self.higher_is_better),
            (isinstance(self.space, SearchSpace), "space a SearchSpace", self.space),
            (isinstance(self.resume_space, SearchSpace), "resume_space a SearchSpace", self.resume_space),
            (self.history_moments is None or isinstance(self.history_moments, MomentPolicy),
             "history_moments a MomentPolicy or None (optimizer for every version)", self.history_moments),
            (isinstance(self.base, QuantConfig), "base a QuantConfig", self.base),
            (self.optimizer is None or (not isinstance(self.optimizer, str)
                                        and callable(getattr(self.optimizer, "plan", None))),
             f"optimizer one of {OPTIMIZER_POLICIES}, a MomentPolicy, a planner with a plan() method "
             "(e.g. StatePlanner(..., scope='optimizer/')) or None", self.optimizer),
            (isinstance(self.keep, int) and not isinstance(self.keep, bool) and self.keep >= 1,
             "keep an int >= 1", self.keep),
            (self.max_evaluations is None or (isinstance(self.max_evaluations, int)
                                              and not isinstance(self.max_evaluations, bool)
                                              and self.max_evaluations >= 1),
             "max_evaluations an int >= 1 or None (no limit)", self.max_evaluations),
        ]
        for ok, what, got in checks:
            if not ok:
                raise FormatError(f"Expected {what} in SearchPolicy. Got {got!r} instead.")

    @classmethod
    def from_args(cls, **args: Unpack[PolicyArgs]) -> SearchPolicy:
        """The policy the Checkpointer's 0.1 keywords describe (:class:`PolicyArgs`)."""
        unknown = sorted(set(args) - set(PolicyArgs.__annotations__))
        if unknown:
            raise TypeError(
                f"Expected Checkpointer keywords from {sorted(PolicyArgs.__annotations__)}. Got {unknown} "
                "instead; check the spelling."
            )
        fields: dict[str, Any] = {}
        if "tolerance" in args:
            fields["tolerance"] = args["tolerance"]
        if "higher_is_better" in args:
            fields["higher_is_better"] = args["higher_is_better"]
        if args.get("space") is not None:
            fields["space"] = args["space"]
        if "optimizer_policy" in args:
            fields["optimizer"] = args["optimizer_policy"]
        return cls(**fields)

    def resuming(self) -> SearchPolicy:
        """This policy searching ``resume_space``: for versions that a restart loads as
        stored (no restore residual), which must survive being resumed many times."""
        return dataclasses.replace(self, space=self.resume_space, allocation_ratios=None)

    def for_history(self) -> SearchPolicy:
        """This policy for versions a restart never loads as stored (the Checkpointer with
        ``exact_resume`` >= 1: the newest version resumes bit-exact from its restore residual,
        so stored moments serve rollbacks only): ``optimizer`` becomes ``history_moments``
        when it is the default :class:`MomentPolicy` (a policy of your own is kept; ``history_moments=None``
        keeps the default's strict guard too)."""
        if self.history_moments is None or not isinstance(self.optimizer, MomentPolicy) \
                or self.optimizer != DEFAULT_MOMENTS:
            return self
        return dataclasses.replace(self, optimizer=self.history_moments)

    def within(self, quality: float, baseline: float) -> bool:
        """Quality within ``tolerance`` (relative) of the baseline, in the better direction."""
        slack = self.tolerance * abs(baseline)
        return quality >= baseline - slack if self.higher_is_better else quality <= baseline + slack

    def config(self, point: SearchPoint, base: QuantConfig | None = None) -> QuantConfig:
        """The candidate configuration at ``point``: the base (``base``, else the policy's) with
        the point's four axes."""
        return QuantConfig(**{**(base or self.base).to_dict(), **point.to_dict()})

    def base_after(self, previous: QuantConfig | None) -> QuantConfig:
        """The base a checkpoint's search starts from: the policy's, with the embedding levels
        the previous version needed when they were more (see :meth:`decide`)."""
        if previous is not None and previous.embedding_bins > self.base.embedding_bins:
            return dataclasses.replace(self.base, embedding_bins=previous.embedding_bins)
        return self.base

    @property
    def budgeted(self) -> bool:
        """Whether :meth:`decide` runs the budgeted search (else the exhaustive one)."""
        return self.max_evals is not None and self.max_evaluations is None and self.allocation_ratios is None

    def save_budget(self, first: bool) -> SaveBudget:
        """A new save's budget: ``max_evals``' first or later count, and ``max_seconds``."""
        evals = self.max_evals
        count = None if not isinstance(evals, tuple) else evals[0 if first else 1]
        return SaveBudget(count, self.max_seconds, "first" if first else "later")

    def widen_for_keyframes(self, budget: SaveBudget) -> None:
        """Give a keyframe search of a later save the first save's count of calls (kind
        ``"keyframe"``): nothing near it was confirmed (the closed loop's residuals failed, or
        its chain ended), and a keyframe stored losslessly for want of calls costs the ratio
        of a whole chain (the evaluation's LM: 15.1x with the exhaustive search, 4.3x with a
        keyframe search of 1-2 calls)."""
        evals = self.max_evals
        budget.widen(evals[0] if isinstance(evals, tuple) else None, "keyframe")

    def drop(self, quality: float, baseline: float) -> float:
        """The relative quality drop (worse direction positive) the predictor fits."""
        change = (baseline - quality) if self.higher_is_better else (quality - baseline)
        value = change / abs(baseline) if baseline else change
        return value if math.isfinite(value) else _NAN_DROP

    def recall(self, record: QuantizationRecord, predictor: QualityPredictor) -> None:
        """Feed ``predictor`` the evaluations a stored version's record kept (after a restore,
        so the next save continues the run's fit instead of searching afresh)."""
        search_ = record.search
        if search_ is None or record.baseline_quality is None:
            return
        for t in search_.trials:
            if t.error is not None and t.quality is not None:
                predictor.add(t.error, self.drop(t.quality, record.baseline_quality))

    def decide(self, candidates: Candidates, evaluate: Evaluate | None,
               previous: QuantConfig | None = None, *, budget: SaveBudget | None = None,
               predictor: QualityPredictor | None = None, stream: bool = False) -> Decision:
        """Search (when there is ``evaluate``) and return what to write.

        Without ``evaluate`` the base configuration is stored. With it, nothing within
        tolerance stores the model lossless (the record's config is None). ``previous``
        (the parent version's configuration) starts the neighbourhood search. ``budget``
        (one save's, shared by its searches; made here from ``max_evals`` when None) and
        ``predictor`` (the run's evaluations; a new one when None) serve the budgeted search.

        ``stream=True``: the plans of the chosen configuration (unless a search already holds
        them) and of the moments are made as the writer reads them, one tensor at a time
        (:mod:`inshrink_store.policy.streaming`), and the moments' record comes with
        :meth:`Decision.moment_record` once they are written. Same plans, same bytes; the save
        never holds the quantized state."""
        if self.allocation_ratios is not None and evaluate is not None:
            return self._decide_allocation(candidates, evaluate)
        baseline: float | None = None
        result: SearchResult | None = None
        if evaluate is None:
            chosen: QuantConfig | None = self.base
        else:
            predictor = predictor if predictor is not None else QualityPredictor()
            budget = budget if budget is not None else self.save_budget(previous is None and not predictor.points)
            if budget.baseline is None:
                budget.baseline = budget.call(lambda: evaluate(None))
            baseline = budget.baseline
            base = self.base_after(previous)
            if self.budgeted:
                result = self._budgeted(candidates, evaluate, baseline, previous, base, budget, predictor)
            else:
                result = self._search(candidates, _counted(evaluate, budget), baseline, previous, base)
            wider = self._wider_embeddings(candidates, base)
            if result.best is None and wider is not None and budget.stop_reason() is None:
                if self.budgeted:
                    again = self._budgeted(candidates, evaluate, baseline, None, wider, budget, predictor)
                    result = SearchResult(again.best, [*result.trials, *again.trials], "embeddings", again.budget)
                else:
                    result = self._search_again(candidates, _counted(evaluate, budget), baseline, result, wider)
                base = wider
            chosen = None if result.best is None else self.config(result.best, base)
        weights: WeightStream | None = None
        model: PlanSet | None = None
        if chosen is not None:
            held = candidates.held(chosen) if stream else None
            if stream and held is None:
                masked = frozenset(candidates.optimizer_params.values()) \
                    if isinstance(self.optimizer, MomentPolicy) else frozenset()
                weights = WeightStream(candidates.quantizer(chosen), candidates.dtypes, chosen.protected_dtype,
                                       masked)
                model = StreamedPlanSet(chosen, {}, candidates.estimator.logical_bytes, None, (weights,))
            else:
                model = held if held is not None else candidates.plans(chosen)
        record = QuantizationRecord(
            config=chosen, tolerance=self.tolerance, higher_is_better=self.higher_is_better,
            baseline_quality=baseline, search=result,
            model_ratio_estimate=None if chosen is None else candidates.ratio(chosen),
        )
        if stream:
            plans, streamed = self._streamed_optimizer(model, weights, candidates)
            return Decision(plans, record, None, streamed)
        plans, moments = self._with_optimizer(model, candidates)
        return Decision(plans, record, moments)

    def allocation_base(self) -> Allocation:
        """The allocation every target of an allocation search shares (``base``'s protection)."""
        base = self.base
        return Allocation(target_ratio=1.0, protect=base.protect, protected_dtype=base.protected_dtype,
                          min_numel=base.min_numel, codebook_reuse_tolerance=base.codebook_reuse_tolerance)

    def _decide_allocation(self, candidates: Candidates, evaluate: Evaluate) -> Decision:
        """Bisection over ``allocation_ratios`` for the largest feasible target (quality falls
        as the ratio grows); nothing feasible stores the model lossless."""
        ratios = self.allocation_ratios or ()
        baseline = float(evaluate(None))
        pool = AllocationCandidates(self.allocation_base(), candidates.tensors, candidates.dtypes,
                                    candidates.previous, sensitivity=candidates.sensitivity,
                                    module_kinds=candidates.module_kinds, scope=candidates.scope)
        trials: list[AllocationTrial] = []
        held: dict[float, PlanSet] = {}
        lo, hi = -1, len(ratios)  # ratios[lo] feasible (-1: lossless), ratios[hi] not
        while hi - lo > 1 and (self.max_evaluations is None or len(trials) < self.max_evaluations):
            mid = (lo + hi) // 2
            plans = pool.plans(ratios[mid])
            quality = float(evaluate(plans))
            ok = self.within(quality, baseline)
            trials.append(AllocationTrial(ratios[mid], plans.ratio, quality, ok))
            held = {ratios[mid]: plans} if ok else held  # only the best feasible one is kept
            lo, hi = (mid, hi) if ok else (lo, mid)
        chosen = ratios[lo] if lo >= 0 else None
        model = held.get(chosen) if chosen is not None else None
        plans_out, moments = self._with_optimizer(model, candidates)
        record = QuantizationRecord(
            config=None, tolerance=self.tolerance, higher_is_better=self.higher_is_better,
            baseline_quality=baseline, model_ratio_estimate=None if model is None else model.ratio,
            allocation=None if chosen is None else pool.spec(chosen), allocation_search=tuple(trials))
        return Decision(plans_out, record, moments)

    def _search(self, candidates: Candidates, evaluate: Evaluate, baseline: float,
                previous: QuantConfig | None, base: QuantConfig,
                max_evaluations: int | None = None) -> SearchResult:
        def measure_ratio(point: SearchPoint) -> float:
            return candidates.ratio(self.config(point, base))

        def is_feasible(point: SearchPoint) -> tuple[bool, float]:
            quality = float(evaluate(candidates.plans(self.config(point, base))))
            return self.within(quality, baseline), quality

        budget = self.max_evaluations if max_evaluations is None else max_evaluations
        result = search(measure_ratio, is_feasible, previous=previous, space=self.space,
                        metrics_available=candidates.metrics_available, max_evaluations=budget)
        return self._measured_choice(candidates, result, base)

    def _budgeted(self, candidates: Candidates, evaluate: Evaluate, baseline: float, previous: QuantConfig | None,
                  base: QuantConfig, budget: SaveBudget, predictor: QualityPredictor) -> SearchResult:
        def measure_ratio(point: SearchPoint) -> float:
            return candidates.ratio(self.config(point, base))

        def measure_error(point: SearchPoint) -> float:
            return candidates.predicted_error(self.config(point, base))

        def run(point: SearchPoint) -> tuple[bool, float, float]:
            plans = candidates.plans(self.config(point, base))
            quality = budget.call(lambda: evaluate(plans))
            return self.within(quality, baseline), quality, self.drop(quality, baseline)

        on_axes = previous is not None and _on_axes(self.space, SearchPoint.of(previous))
        result = budgeted_search(measure_ratio, measure_error, run, predictor=predictor, tolerance=self.tolerance,
                                 budget=budget, start_error=lambda: candidates.predicted_error(base),
                                 previous=previous if on_axes else None, space=self.space,
                                 metrics_available=candidates.metrics_available)
        return self._measured_choice(candidates, result, base)

    def _measured_choice(self, candidates: Candidates, result: SearchResult, base: QuantConfig) -> SearchResult:
        """Among the evaluated feasible points whose estimated ratio is within
        :data:`MEASURE_WITHIN` of the best, the one whose *measured* ratio is highest.

        Why: ratios are estimated from a sample of each tensor, within a few percent on most
        tensors but up to ~10 % on tensors whose pruning follows rows and columns, and the
        first checkpoint's choice is where every later neighbourhood starts. The points are
        already quantized for their evaluation, so measuring them costs an encode each; a
        neighbourhood search, which stops at its first feasible point, measures nothing."""
        if result.best is None:
            return result
        best = next(t for t in result.trials if t.point == result.best)
        close = [t for t in result.trials if t.feasible and t.ratio >= best.ratio * (1 - MEASURE_WITHIN)]
        if len(close) < 2:
            return result
        measured = [(candidates.measured_ratio(self.config(t.point, base)), -i, t.point) for i, t in enumerate(close)]
        chosen = max(measured)[2]  # the highest measured ratio; ties to the earlier trial
        return dataclasses.replace(result, best=chosen)

    def _wider_embeddings(self, candidates: Candidates, base: QuantConfig) -> QuantConfig | None:
        """``base`` with the most embedding levels (32), when the state has an embedding table
        and ``base`` gives it fewer; else None.

        Why: the search's axes set the levels of every other tensor, while an embedding table
        always gets ``base.embedding_bins`` (16). On a fine-tuned language model that table
        alone cost more than the tolerance, so no point was feasible and every such version
        was stored lossless (``python -m benchmarks evaluate``, transfer workload: 8 of 24)."""
        top = max(EMBEDDING_BINS)
        if base.embedding_bins >= top or not any("embedding" in kind.lower()
                                                 for kind in candidates.module_kinds.values()):
            return None
        return dataclasses.replace(base, embedding_bins=top)

    def _search_again(self, candidates: Candidates, evaluate: Evaluate, baseline: float,
                      first: SearchResult, wider: QuantConfig) -> SearchResult:
        """A full search with ``wider`` embeddings after one with nothing feasible, within what
        is left of the evaluation budget; both searches' trials are kept, mode ``"embeddings"``."""
        left = None if self.max_evaluations is None else self.max_evaluations - first.evaluations
        if left is not None and left < 1:
            return first
        again = self._search(candidates, evaluate, baseline, None, wider, left)
        return SearchResult(again.best, [*first.trials, *again.trials], "embeddings")

    def _with_optimizer(self, model: PlanSet | None,
                        candidates: Candidates) -> tuple[PlanSet | None, MomentRecord | None]:
        """The model's plans plus the optimizer's (None when there are none at all), and the
        moments' record when a MomentPolicy stored them."""
        plans = model if model is not None else PlanSet(None)
        moments: MomentRecord | None = None
        if self.optimizer is not None:
            tensors = {p: a for p, a in candidates.tensors.items() if p.startswith("optimizer/")}
            if isinstance(self.optimizer, MomentPolicy):
                made: MomentPlans = self.optimizer.plan(
                    tensors, candidates.dtypes, candidates.previous, weights=model or {},
                    params=candidates.optimizer_params, hyper=candidates.optimizer_hyper)
                moments = made.record
                plans = plans.with_plans(made)
            else:
                assert not isinstance(self.optimizer, str)  # names became policies in __post_init__
                plans = plans.with_plans(self.optimizer.plan(tensors, candidates.dtypes, candidates.previous))
        return (plans if len(plans) else None), moments


    def _streamed_optimizer(self, model: PlanSet | None, weights: WeightStream | None,
                            candidates: Candidates) -> tuple[PlanSet | None, MomentStream | None]:
        """:meth:`_with_optimizer` for ``decide(stream=True)``: a MomentPolicy's plans made as
        they are read (joint pruning from ``weights``' masks when the model is streamed too);
        another planner's plans as it makes them."""
        if model is None:
            plans = StreamedPlanSet(None)
        elif isinstance(model, StreamedPlanSet):
            plans = model
        else:
            plans = StreamedPlanSet(model.config, {}, model.logical_bytes, model.stored_bytes, (model,))
        moments: MomentStream | None = None
        if self.optimizer is not None:
            tensors = {p: a for p, a in candidates.tensors.items() if p.startswith("optimizer/")}
            if isinstance(self.optimizer, MomentPolicy):
                moments = MomentStream(self.optimizer, tensors, candidates.dtypes, candidates.previous,
                                       weights=weights if weights is not None else (model or {}),
                                       params=candidates.optimizer_params, hyper=candidates.optimizer_hyper)
                plans = plans.with_plans(moments)
            else:
                assert not isinstance(self.optimizer, str)  # names became policies in __post_init__
                plans = plans.with_plans(self.optimizer.plan(tensors, candidates.dtypes, candidates.previous))
        return (plans if len(plans) else None), moments


def _counted(evaluate: Evaluate, budget: SaveBudget) -> Evaluate:
    """``evaluate`` with each call counted in ``budget`` (the exhaustive search's calls)."""
    return lambda plans: budget.call(lambda: evaluate(plans))


def _on_axes(space: SearchSpace, point: SearchPoint) -> bool:
    try:
        space.index(point)
    except FormatError:
        return False
    return True
