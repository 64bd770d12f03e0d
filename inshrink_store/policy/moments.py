"""Adam's moments stored lossy, judged by the update they drive (ExCP-style, with a guard).
Layer: refs, history and policy (the policy imports neither sibling), below ``parts``.

Why: Adam keeps two moments per weight, so once the weights shrink 25x the lossless
moments are ~95 % of a checkpoint. Following ExCP (Li et al., ICML 2024) the moments are
pruned jointly and quantized with non-uniform codebooks; unlike ExCP, every tensor is
checked by what the moments are *for*: the Adam update ``m_hat / (sqrt(v_hat) + eps)``
computed from the exact and from the stored moments must agree (cosine and relative norm
error within :class:`MomentPolicy`'s bounds), or the tensor gets more levels and less
pruning, and stays lossless if even that drifts.

Per parameter (a state entry holding ``exp_avg`` and ``exp_avg_sq`` of one shape):

- ``exp_avg`` (m): set to 0 where the weight was pruned in this version and where the
  update it drives is among the smallest ``prune`` fraction, then snapped to a k-means
  codebook of ``exp_avg_bins`` centres with 0.0 pinned (the weights' codebook fitter).
- ``exp_avg_sq`` (v): positive with a range of tens of octaves, so it is clustered in the
  log2 domain and every positive entry stays positive (never ``v = 0`` under a kept ``m``,
  whose update would explode). By default v is not pruned: a pruned v restored as 0 gives
  that entry a ~3x larger step for hundreds of steps after a restore (Adam's warm-up
  without bias correction), while costing only a few bits to keep.
- ExCP's joint pruning of v (``MomentPolicy.joint_v_beta``, :meth:`MomentPolicy.excp`):
  v is set to 0 too, with its m, where this version dropped the weight's update *and* v is
  below ``joint_v_beta * mean(v)``. Those entries are quiet (small gradients) on weights
  that did not move in this version, so the warm-up above costs least there, and the
  invariant holds: v is pruned only where m is, so both are 0 and the stored update is 0,
  a drop the guard measures like any other. The survivors are quantized as above. This
  prunes less than ExCP itself (which keeps a moment only where the weight's update was
  kept *and* v is large): an entry whose weight still moves keeps its v.
- step counters, ``param_groups`` and any other state stay exact (lossless).

"Where the weight's update was dropped" is the weight plan's ``pruned`` mask when it has
one (closed-loop residual plans, whose values are reconstructions, never 0), else where
the stored weight is 0.

Deterministic: thresholds by partition, codebooks seeded from the data, so the same
state gives the same bytes (the store dedups and delta-codes by content).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from inshrink_store import dtypes as dtype_registry
from inshrink_store.dtypes import QUANTIZABLE_NAMES
from inshrink_store.errors import FormatError
from inshrink_store.parallel import map_in_order, write_threads
from inshrink_store.plans import ArrayPlan
from inshrink_store.policy import moment_loop
from inshrink_store.policy.moment_codebooks import (
    MAX_BINS,
    _PreparedM,
    quantize_exp_avg,
    quantize_exp_avg_sq,
    smallest_mask,
)
from inshrink_store.policy.partition import QuantizedTensor, sum_of_products
from inshrink_store.policy.planner import array_plan
from inshrink_store.policy.plans import PlanSet
from inshrink_store.policy.sketch import BLOCK

M_KEY, V_KEY = "exp_avg", "exp_avg_sq"
#: the newest ``metadata["moments"]`` record read; one written is version 1 unless it needs 2
#: (ExCP's joint v pruning: the policy's ``joint_v_beta``/``residual_alpha``, the pairs'
#: ``exp_avg_sq_pruned_fraction``) or 3 (closed-loop moments: the pairs' ``*_coding`` and
#: ``*_kept_fraction``, ``residual_attempts``; the policy's ``closed_loop`` when False), so
#: older readers still read every record they can and say "upgrade" for the rest
RECORD_VERSION = 3
#: the escalation when a tensor's update drifts, per attempt: (prune factor, bins factor, whether
#: entries whose weight was pruned lose their m too, and with ``joint_v_beta`` their small v).
#: A weight pruned for a small |w| or |g*w| may still have a large update, so joint pruning is
#: the first thing given up; then a quarter of the pruning, before half of it at twice the
#: levels (a policy that prunes hard, :data:`ROLLBACK_MOMENTS`' 80 %, then tries 60 % at its own
#: levels: on the evaluation's transfer run 80 % failed the guard where 60 % passed).
LADDER = ((1.0, 1, True), (1.0, 1, False), (0.75, 1, False), (0.5, 2, False), (0.0, 4, False))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class AdamHyper:
    """What turns moments into an update: ``betas``, ``eps`` and the step (bias correction)."""

    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    step: float | None = None

    def bias_corrections(self) -> tuple[float, float]:
        if self.step is None or not self.step >= 1:
            return 1.0, 1.0
        return 1.0 - self.beta1 ** self.step, 1.0 - self.beta2 ** self.step


#: ExCP's published constants: the weight-residual prune scale and the moments' v threshold
EXCP_ALPHA, EXCP_BETA = 5e-5, 2.0
#: MomentPolicy's optional ExCP fields (None: off, and then absent from its dict)
EXCP_FIELDS = ("joint_v_beta", "residual_alpha")
#: MomentTensorRecord's closed-loop fields (record version 3)
LOOP_FIELDS = ("exp_avg_coding", "exp_avg_sq_coding", "exp_avg_kept_fraction", "exp_avg_sq_kept_fraction",
               "residual_attempts")


@dataclass(frozen=True)
class MomentPolicy:
    """How the Checkpointer stores Adam-shaped optimizer state (the default: compressed).

    ``exp_avg_bins`` / ``exp_avg_sq_bins``: codebook levels of m and of log2 v;
    ``prune``: the fraction of m entries with the smallest update set to 0 (on top of the
    entries whose weight was pruned); ``min_update_cosine`` / ``max_update_error``: the
    guard, per tensor, on the Adam update from stored vs exact moments (cosine >= the
    first, ``||u' - u|| / ||u||`` <= the second). A tensor that fails is retried with three
    quarters of the pruning, then half the pruning and twice the levels, then none and four
    times, then kept lossless (the first retry only gives up pruning m where the weight was
    pruned: see :data:`LADDER`).
    Moments smaller than ``min_numel`` elements stay lossless (their bytes do not matter). It
    was 4096, the weights' own threshold, until closed-loop moments: on the evaluation's LM a
    3072-element position table's lossless moments were then an eighth of the moments' bytes,
    while 1024 elements of float32 are still 40 times a codebook's and a document's overhead.

    ``joint_v_beta`` (None: off, the default): ExCP's joint pruning of v. Where this version
    dropped the weight's update and ``0 < v < joint_v_beta * mean(v)`` (the mean over v's
    finite entries), v is set to 0 together with m (both 0: the stored update there is 0,
    never the explosion of a 0 v under a kept m), and the guard judges the result as usual.
    Only the first attempt does it (with the rest of the joint pruning). ``residual_alpha``
    (None, or ExCP's 5e-5): the scale of ExCP's weight-residual pruning (a residual dropped
    where ``|r| <= alpha / sqrt(v) * median(|W|)``), recorded here so the setting is one
    named thing; the weight side decides by it, the moments never read it. Both are left
    out of :meth:`to_dict` while None, so a default policy's dict is the one older versions
    wrote and read. :meth:`excp` is the published setting.

    ``closed_loop`` (default False, opt-in): where the caller hands the parent's stored
    moments (the Checkpointer does when this is True, unless its own ``closed_loop=False``),
    each float32 moment is stored as a quantized residual against them when that is cheaper
    and the guard passes the reconstruction (:mod:`inshrink_store.policy.moment_loop`); False
    codes every version on its own (open loop). Opt-in because of its cost: the moments' history
    is 1.1-1.3x smaller on the evaluation's workloads, but a later save of an 8.4 M-parameter MLP
    took 79-91 s against 14 s open loop (docs/understanding/closed-loop.md). Left out of
    :meth:`to_dict` while False, so the dict is the one older versions wrote and read.
    """

    exp_avg_bins: int = 16
    exp_avg_sq_bins: int = 16
    prune: float = 0.3
    min_update_cosine: float = 0.95
    max_update_error: float = 0.3
    min_numel: int = 1024
    joint_v_beta: float | None = None
    residual_alpha: float | None = None
    closed_loop: bool = False

    def __post_init__(self) -> None:
        checks = [
            (_is_int(self.exp_avg_bins) and 3 <= self.exp_avg_bins <= MAX_BINS // 4,
             f"exp_avg_bins an int in 3..{MAX_BINS // 4}", self.exp_avg_bins),
            (_is_int(self.exp_avg_sq_bins) and 2 <= self.exp_avg_sq_bins <= MAX_BINS // 4,
             f"exp_avg_sq_bins an int in 2..{MAX_BINS // 4}", self.exp_avg_sq_bins),
            (_is_number(self.prune) and 0.0 <= self.prune <= 0.95, "prune a fraction in [0, 0.95]", self.prune),
            (_is_number(self.min_update_cosine) and -1.0 <= self.min_update_cosine <= 1.0,
             "min_update_cosine a number in [-1, 1]", self.min_update_cosine),
            (_is_number(self.max_update_error) and self.max_update_error >= 0,
             "max_update_error a finite number >= 0", self.max_update_error),
            (_is_int(self.min_numel) and self.min_numel >= 1, "min_numel an int >= 1", self.min_numel),
            (self.joint_v_beta is None or (_is_number(self.joint_v_beta) and self.joint_v_beta > 0),
             "joint_v_beta None (no v pruning) or a finite number > 0 (ExCP: 2.0)", self.joint_v_beta),
            (self.residual_alpha is None or (_is_number(self.residual_alpha) and self.residual_alpha > 0),
             "residual_alpha None or a finite number > 0 (ExCP: 5e-5)", self.residual_alpha),
            (isinstance(self.closed_loop, bool), "closed_loop a bool", self.closed_loop),
        ]
        for ok, what, got in checks:
            if not ok:
                raise FormatError(f"Expected {what} in MomentPolicy. Got {got!r} instead.")

    def to_dict(self) -> dict[str, Any]:
        """JSON-native; ``from_dict`` of it gives an equal policy. The ExCP fields appear only
        when set, so a policy without them writes the dict older versions read."""
        return {k: v for k, v in asdict(self).items()
                if not (k in EXCP_FIELDS and v is None) and not (k == "closed_loop" and not v)}

    @classmethod
    def excp(cls) -> MomentPolicy:
        """ExCP's published moment setting (Li et al., ICML 2024), under our guard: v pruned
        with m where the weight's update was dropped and ``v < 2.0 * mean(v)``
        (``joint_v_beta``), ``residual_alpha`` 5e-5 recorded for the weight side, 4-bit codes
        (16 levels of m with 0 among them; 15 of v, plus the 0 of pruned entries), and no
        pruning of m by update size (``prune`` 0: ExCP prunes moments only by the joint mask)."""
        return cls(exp_avg_bins=16, exp_avg_sq_bins=15, prune=0.0, joint_v_beta=EXCP_BETA,
                   residual_alpha=EXCP_ALPHA)

    @classmethod
    def from_dict(cls, data: object) -> MomentPolicy:
        if not isinstance(data, Mapping):
            raise FormatError(f"Expected a MomentPolicy dict. Got {type(data).__name__} instead.")
        unknown = sorted(str(k) for k in data if k not in cls.__dataclass_fields__)
        if unknown:
            raise FormatError(
                f"Expected only MomentPolicy fields {sorted(cls.__dataclass_fields__)}. Got unknown "
                f"{unknown} instead; remove them.")
        return cls(**dict(data))

    def attempts(self) -> list[tuple[float, int, int, bool]]:
        """(prune, m levels, v levels, joint with the weights) tried in order until the guard passes."""
        return [(self.prune * p, min(self.exp_avg_bins * b, MAX_BINS), min(self.exp_avg_sq_bins * b, MAX_BINS),
                 joint) for p, b, joint in LADDER]

    # -- the repository's Planner protocol ----------------------------------------------------
    def plan(self, tensors: Mapping[str, np.ndarray], dtypes: Mapping[str, str],
             previous: Mapping[str, dict[str, Any]], *, weights: Mapping[str, Any] | None = None,
             params: Mapping[str, str] | None = None,
             hyper: Mapping[str, AdamHyper] | None = None) -> MomentPlans:
        """Plans for every Adam-shaped moment pair under ``optimizer/`` (the rest lossless).

        ``weights``: this version's model plans (path -> ArrayPlan) and ``params``: state
        prefix (``optimizer/state/3``) -> model path, for joint pruning; ``hyper``: prefix ->
        :class:`AdamHyper` (betas, eps, step; defaults otherwise) for the update guard."""
        return plan_moments(self, tensors, dtypes, previous=previous, weights=weights or {},
                            params=params or {}, hyper=hyper or {})


def adam_pairs(tensors: Mapping[str, np.ndarray], dtypes: Mapping[str, str]) -> list[str]:
    """Sorted state prefixes holding an ``exp_avg`` and an ``exp_avg_sq`` of one shape and a
    float dtype (any numel; size limits are the policy's)."""
    found = []
    for path in tensors:
        if not path.startswith("optimizer/") or not path.endswith("/" + M_KEY):
            continue
        prefix = path[: -len(M_KEY) - 1]
        v_path = f"{prefix}/{V_KEY}"
        if v_path not in tensors or tensors[path].shape != tensors[v_path].shape:
            continue
        if dtypes.get(path) in QUANTIZABLE_NAMES and dtypes.get(v_path) == dtypes.get(path):
            found.append(prefix)
    return sorted(found)


def update(m: np.ndarray, v: np.ndarray, hyper: AdamHyper) -> np.ndarray:
    """The Adam step direction ``m_hat / (sqrt(v_hat) + eps)`` (float32, lr left out)."""
    c1, c2 = hyper.bias_corrections()
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        denom = np.sqrt(np.maximum(v, 0, dtype=np.float32) / np.float32(c2)) + np.float32(hyper.eps)
        step: np.ndarray = (m / np.float32(c1)) / denom
        return step


def compare(exact: np.ndarray, stored: np.ndarray) -> tuple[float, float]:
    """(cosine, relative norm error) of two updates over the entries finite in both, blockwise
    in float64 (1.0 and 0.0 when both are all zero)."""
    a_flat, b_flat = exact.ravel(), stored.ravel()
    dot = aa = bb = dd = 0.0
    for s in range(0, a_flat.size, BLOCK):
        a = a_flat[s:s + BLOCK].astype(np.float64)
        b = b_flat[s:s + BLOCK].astype(np.float64)
        ok = np.isfinite(a) & np.isfinite(b)
        if not ok.all():
            a, b = a[ok], b[ok]
        d = a - b
        dot += sum_of_products(a, b)
        aa += sum_of_products(a, a)
        bb += sum_of_products(b, b)
        dd += sum_of_products(d, d)
    if aa == 0.0:
        return (1.0, 0.0) if bb == 0.0 else (0.0, math.inf)
    cosine = dot / math.sqrt(aa * bb) if bb > 0 else 0.0
    return float(min(1.0, cosine)), float(math.sqrt(dd / aa))


@dataclass(frozen=True)
class MomentTensorRecord:
    """One moment pair's outcome: ``storage`` ("quantized" or "lossless"), the guard's
    figures for the stored update, the levels and pruning used, and the attempts made.
    ``pruned_fraction``: of m's entries, the non-zero ones stored as 0;
    ``exp_avg_sq_pruned_fraction`` (only under ``joint_v_beta``): of v's entries, the
    positive ones stored as 0 by the joint pruning (each with its m).

    Closed-loop moments (record version 3): ``exp_avg_coding`` / ``exp_avg_sq_coding``, one of
    "keyframe" (coded on its own, the open-loop values), "residual" (against the parent's
    stored values) or "unchanged" (the parent's, the moment's bits did not change);
    ``*_kept_fraction``: of a residual's entries, those left at the parent's value;
    ``residual_attempts``: residual settings tried. The guard's figures are the stored pair's."""

    storage: str
    update_cosine: float | None = None
    update_rel_error: float | None = None
    exp_avg_levels: int | None = None
    exp_avg_sq_levels: int | None = None
    pruned_fraction: float | None = None
    attempts: int = 0
    reason: str | None = None
    exp_avg_sq_pruned_fraction: float | None = None
    exp_avg_coding: str | None = None
    exp_avg_sq_coding: str | None = None
    exp_avg_kept_fraction: float | None = None
    exp_avg_sq_kept_fraction: float | None = None
    residual_attempts: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class MomentRecord:
    """What ``metadata["moments"]`` of a version says: the policy, each pair's outcome, and
    why nothing was compressed when nothing was (``skipped``)."""

    policy: MomentPolicy | None
    tensors: Mapping[str, MomentTensorRecord] = field(default_factory=dict)
    skipped: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """Version 1 unless the ExCP fields are used (then 2) or the closed-loop ones (then 3):
        an older reader says "upgrade" for what it cannot read."""
        policy = None if self.policy is None else self.policy.to_dict()
        tensors = {p: r.to_dict() for p, r in sorted(self.tensors.items())}
        excp = any(k in EXCP_FIELDS for k in policy or {}) or any(
            "exp_avg_sq_pruned_fraction" in t for t in tensors.values())
        loop = "closed_loop" in (policy or {}) or any(k in LOOP_FIELDS for t in tensors.values() for k in t)
        return {"version": 3 if loop else 2 if excp else 1, "policy": policy, "tensors": tensors,
                "skipped": self.skipped}

    @classmethod
    def from_dict(cls, data: object) -> MomentRecord:
        """Read ``metadata["moments"]``; a FormatError names what is wrong."""
        if not isinstance(data, Mapping) or not isinstance(data.get("tensors", {}), Mapping):
            raise FormatError(
                f"Expected metadata['moments'] to be a dict with a 'tensors' dict. Got {type(data).__name__} "
                "instead; it was not written by a Checkpointer.")
        version = data.get("version", RECORD_VERSION)
        if not _is_int(version) or not 1 <= version <= RECORD_VERSION:
            raise FormatError(f"Expected moments record version 1..{RECORD_VERSION}. Got {version!r} instead; "
                              "a newer inshrink-store wrote it: upgrade.")
        policy = data.get("policy")
        tensors = {}
        for prefix, entry in data.get("tensors", {}).items():
            if not isinstance(entry, Mapping) or entry.get("storage") not in ("quantized", "lossless"):
                raise FormatError(f"Expected moments record entry {prefix!r} with storage 'quantized' or "
                                  f"'lossless'. Got {entry!r:.120} instead.")
            tensors[str(prefix)] = _tensor_record(str(prefix), entry)
        skipped = data.get("skipped")
        return cls(None if policy is None else MomentPolicy.from_dict(policy), tensors,
                   None if skipped is None else str(skipped))

    def summary(self) -> dict[str, Any]:
        """Counts and the worst guard figures: what ``inshrink log`` and the demo print."""
        quantized = [r for r in self.tensors.values() if r.storage == "quantized"]
        cosines = [r.update_cosine for r in quantized if r.update_cosine is not None]
        errors = [r.update_rel_error for r in quantized if r.update_rel_error is not None]
        return {"quantized": len(quantized), "lossless": len(self.tensors) - len(quantized),
                "min_update_cosine": min(cosines) if cosines else None,
                "max_update_rel_error": max(errors) if errors else None, "skipped": self.skipped}


_RECORD_FIELDS: dict[str, Any] = {
    "update_cosine": _is_number, "update_rel_error": lambda v: isinstance(v, (int, float)) and not
    isinstance(v, bool) and v >= 0, "exp_avg_levels": _is_int, "exp_avg_sq_levels": _is_int,
    "pruned_fraction": lambda v: _is_number(v) and 0 <= v <= 1, "attempts": lambda v: _is_int(v) and v >= 0,
    "reason": lambda v: isinstance(v, str),
    "exp_avg_sq_pruned_fraction": lambda v: _is_number(v) and 0 <= v <= 1,
    "exp_avg_coding": lambda v: v in moment_loop.CODINGS, "exp_avg_sq_coding": lambda v: v in moment_loop.CODINGS,
    "exp_avg_kept_fraction": lambda v: _is_number(v) and 0 <= v <= 1,
    "exp_avg_sq_kept_fraction": lambda v: _is_number(v) and 0 <= v <= 1,
    "residual_attempts": lambda v: _is_int(v) and v >= 0,
}


def _tensor_record(prefix: str, entry: Mapping[str, Any]) -> MomentTensorRecord:
    """One entry of ``metadata["moments"]["tensors"]``, every field checked."""
    fields: dict[str, Any] = {"storage": entry["storage"]}
    for key, value in entry.items():
        if key == "storage":
            continue
        check = _RECORD_FIELDS.get(str(key))
        if check is None:
            raise FormatError(f"Expected only the fields {['storage', *_RECORD_FIELDS]} in moments record "
                              f"entry {prefix!r}. Got unknown {str(key)!r} instead.")
        if not check(value):
            raise FormatError(f"Expected moments record entry {prefix!r} field {key!r} of the documented "
                              f"kind (see docs/reference/format.md). Got {value!r:.80} instead.")
        fields[str(key)] = value
    return MomentTensorRecord(**fields)


@dataclass(frozen=True, eq=False)
class MomentPlans(PlanSet):
    """A :class:`PlanSet` (read-only path -> ArrayPlan, itself a repository planner) of the
    compressed moments, with the :class:`MomentRecord` that explains them (``record``)."""

    record: MomentRecord = field(default_factory=lambda: MomentRecord(None))


def _plan(values: np.ndarray, codebook: np.ndarray, dtype: str, attributes: dict[str, Any]) -> ArrayPlan:
    """The weights' own plan maker, protected values (NaN, Inf, anything off the levels) in float32."""
    return array_plan(QuantizedTensor(values, tuple(codebook.tolist()), attributes), dtype, "float32")


def _step_of(tensors: Mapping[str, np.ndarray], prefix: str) -> float | None:
    step = tensors.get(f"{prefix}/step")
    if step is None or np.asarray(step).size != 1:
        return None
    value = float(np.asarray(step).reshape(-1)[0])
    return value if math.isfinite(value) else None


def plan_moments(policy: MomentPolicy, tensors: Mapping[str, np.ndarray], dtypes: Mapping[str, str], *,
                 previous: Mapping[str, dict[str, Any]], weights: Mapping[str, Any], params: Mapping[str, str],
                 hyper: Mapping[str, AdamHyper]) -> MomentPlans:
    """See :meth:`MomentPolicy.plan`. The caller's arrays are only read."""
    pairs = adam_pairs(tensors, dtypes)
    if not pairs:
        keys = sorted({p.rsplit("/", 1)[-1] for p in tensors if p.startswith("optimizer/state/")})
        skipped = None
        if keys:
            skipped = (f"optimizer state is not Adam-shaped (no exp_avg/exp_avg_sq pairs; state keys {keys[:6]}): "
                       "stored lossless")
        return MomentPlans(None, {}, record=MomentRecord(policy, {}, skipped))
    def one(prefix: str) -> tuple[dict[str, ArrayPlan], MomentTensorRecord]:
        m_path, v_path = f"{prefix}/{M_KEY}", f"{prefix}/{V_KEY}"
        if tensors[m_path].size < policy.min_numel:
            return {}, MomentTensorRecord("lossless", reason=f"fewer than {policy.min_numel} elements")
        dtype = dtypes[m_path]
        entry = dtype_registry.get(dtype)
        m, v = entry.to_float32(tensors[m_path]), entry.to_float32(tensors[v_path])
        h = hyper.get(prefix, AdamHyper())
        if h.step is None:
            h = AdamHyper(h.beta1, h.beta2, h.eps, _step_of(tensors, prefix))
        exact = update(m, v, h)
        weight_pruned = _weight_pruned(weights, params.get(prefix), m.shape)
        prev_v = previous.get(v_path, {}).get("codec", {}).get("codebook")
        chosen = _guarded(policy, m, v, exact, h, weight_pruned, dtype, prev_v)
        if chosen is None:
            usable = bool((np.isfinite(v) & (v >= 0)).any())
            return {}, MomentTensorRecord(
                "lossless", attempts=len(policy.attempts()) if usable else 0,
                reason=(f"update drifted beyond cosine {policy.min_update_cosine} / error "
                        f"{policy.max_update_error} at every setting tried" if usable else
                        "exp_avg_sq has no finite value >= 0 to build levels from"))
        (m_q, m_cb), (v_q, v_cb), record = chosen
        entries = (moment_loop.loop_entry(previous, m_path), moment_loop.loop_entry(previous, v_path))
        if policy.closed_loop and dtype == "F32" and entries[0] is not None and entries[1] is not None:
            return _closed_pair(policy, (m_path, v_path), (m, v), exact, h, entries,
                                (moment_loop.keyframe(m_q, m_cb), moment_loop.keyframe(v_q, v_cb)), record,
                                weight_pruned)
        figures = {"moment": M_KEY, "update_cosine": record.update_cosine,
                   "update_rel_error": record.update_rel_error, "levels": int(m_cb.size),
                   "pruned_fraction": record.pruned_fraction, "protected_fraction": 0.0}
        return {m_path: _plan(m_q, m_cb, dtype, figures),
                v_path: _plan(v_q, v_cb, dtype, {**figures, "moment": V_KEY, "levels": int(v_cb.size),
                                                 "pruned_fraction": record.exp_avg_sq_pruned_fraction or 0.0})}, record

    # pairs side by side on the writer's threads (numpy releases the GIL); each is planned on
    # its own, and results are gathered in the pairs' order: the same plans whatever the threads.
    # How many run at once is also bounded by memory (see WorkingMemory)
    memory = WorkingMemory(sum(tensors[f"{p}/{M_KEY}"].size for p in pairs))

    def bounded(prefix: str) -> tuple[dict[str, ArrayPlan], MomentTensorRecord]:
        with memory.hold(tensors[f"{prefix}/{M_KEY}"].size):
            return one(prefix)

    plans: dict[str, ArrayPlan] = {}
    records: dict[str, MomentTensorRecord] = {}
    for prefix, (made, record) in zip(pairs, map_in_order(bounded, pairs, write_threads(), "inshrink-moments"),
                                      strict=True):
        plans.update(made)
        records[prefix] = record
    return MomentPlans(None, plans, record=MomentRecord(policy, records))


def _closed_pair(policy: MomentPolicy, paths: tuple[str, str], moments: tuple[np.ndarray, np.ndarray],
                 exact: np.ndarray, h: AdamHyper, entries: tuple[Any, Any], keyframes: tuple[Any, Any],
                 open_loop: MomentTensorRecord,
                 weight_pruned: np.ndarray | None) -> tuple[dict[str, ArrayPlan], MomentTensorRecord]:
    """One pair coded closed-loop (:mod:`inshrink_store.policy.moment_loop`): residuals where
    they are cheaper and the guard passes the reconstruction, keyframes (the open-loop moments,
    ``keyframes``, guarded as ``open_loop`` records) elsewhere."""
    m, v = moments
    _, c2 = h.bias_corrections()
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        scale = (np.float32(1.0) / (np.sqrt(np.maximum(v, 0, dtype=np.float32) / np.float32(c2))
                                    + np.float32(h.eps))).astype(np.float32)
    scale[~np.isfinite(scale)] = 0.0

    def judge(m_stored: np.ndarray, v_stored: np.ndarray) -> tuple[float, float]:
        return compare(exact, update(m_stored, v_stored, h))

    def passes(cosine: float, error: float) -> bool:
        return cosine >= policy.min_update_cosine and error <= policy.max_update_error

    def v_passes(cosine: float, error: float) -> bool:
        share = moment_loop.V_SHARE
        return cosine >= 1 - (1 - policy.min_update_cosine) * share and error <= policy.max_update_error * share

    out = moment_loop.choose(m, v, exact, scale, (c2, h.eps), entries, keyframes, judge, passes, v_passes,
                             weight_pruned)
    del scale
    mc, vc = out.m, out.v
    record = MomentTensorRecord(
        "quantized", update_cosine=round(out.cosine, 6), update_rel_error=round(out.error, 6),
        exp_avg_levels=int(mc.codebook.size) if mc.coding != "unchanged" else None,
        exp_avg_sq_levels=int(vc.codebook.size) if vc.coding != "unchanged" else None,
        pruned_fraction=round(float(((mc.values == 0) & (m != 0)).mean()), 6) if m.size else 0.0,
        attempts=open_loop.attempts, exp_avg_sq_pruned_fraction=open_loop.exp_avg_sq_pruned_fraction
        if vc.coding == "keyframe" else None,
        exp_avg_coding=mc.coding, exp_avg_sq_coding=vc.coding,
        exp_avg_kept_fraction=mc.kept if mc.coding == "residual" else None,
        exp_avg_sq_kept_fraction=vc.kept if vc.coding == "residual" else None,
        residual_attempts=out.attempts)
    figures = {"moment": M_KEY, "update_cosine": record.update_cosine, "update_rel_error": record.update_rel_error,
               "levels": int(mc.codebook.size), "pruned_fraction": record.pruned_fraction, "protected_fraction": 0.0}
    v_figures = {**figures, "moment": V_KEY, "levels": int(vc.codebook.size),
                 "pruned_fraction": record.exp_avg_sq_pruned_fraction or 0.0}
    return moment_loop.loop_plans(paths, moments, out, entries, (figures, v_figures)), record


#: working memory of one pair's guard at its peak, bytes per element (measured with tracemalloc
#: on a 16 M-element float32 pair: 64, after the float64 work arrays were cut to the entries
#: that need them; it was 104)
PAIR_BYTES_PER_ELEMENT = 64
#: the pairs planned at once may hold this much working memory, as a fraction of the moments'
#: own bytes (a pair larger than that still runs, alone)
MOMENT_WORKING_FRACTION = 0.5


class WorkingMemory:
    """How many moment pairs are planned at once, by the memory their guards need: each pair
    holds ``PAIR_BYTES_PER_ELEMENT`` per element while it runs, and the pairs running together
    stay within :data:`MOMENT_WORKING_FRACTION` of the moments' bytes (m and v, float32). Why:
    on the writer's 8 threads a model of 16.8 M-element layers planned 8 pairs at once, 8.6 GB
    for 1.6 GB of moments. Which thread plans which pair never changes a plan, so this changes
    only time and memory."""

    def __init__(self, elements: int) -> None:
        self.limit = max(1, int(MOMENT_WORKING_FRACTION * 8 * elements))
        self.used = 0
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def hold(self, elements: int) -> Iterator[None]:
        need = min(self.limit, PAIR_BYTES_PER_ELEMENT * elements)
        with self._cond:
            self._cond.wait_for(lambda: self.used + need <= self.limit)
            self.used += need
        try:
            yield
        finally:
            with self._cond:
                self.used -= need
                self._cond.notify_all()


def _weight_pruned(weights: Mapping[str, Any], path: str | None, shape: tuple[int, ...]) -> np.ndarray | None:
    """Where this version dropped the update of the moments' weight, or None if unknown: the
    plan's ``pruned`` mask when it has one of this shape (closed-loop residual plans, whose
    values are reconstructions, never 0), else where the stored weight is 0."""
    if path is None or path not in weights:
        return None
    plan = weights[path]
    pruned = getattr(plan, "pruned", None)
    if pruned is not None and np.shape(pruned) == shape:
        return np.asarray(pruned, dtype=bool)
    values = np.asarray(plan.values)
    if values.shape != shape:
        return None
    return np.asarray(values == 0, dtype=bool)


def below_mean(v: np.ndarray, beta: float) -> np.ndarray:
    """``0 < v < beta * mean(v)``, the mean taken in float64 over v's finite entries and the
    comparison exact (float32 v against the float32 next above a threshold it cannot hold)."""
    finite = np.isfinite(v)
    if not finite.any():
        return np.zeros(v.shape, bool)
    mean = float(np.mean(v if finite.all() else v[finite], dtype=np.float64))
    threshold = beta * mean
    if not math.isfinite(threshold) or threshold <= 0:
        return np.zeros(v.shape, bool)
    t32 = np.float32(threshold)
    if float(t32) < threshold:  # rounded down: v < threshold is v < the next float32 up
        t32 = np.nextafter(t32, np.float32(np.inf))
    return (v > 0) & (v < t32)


def joint_v_mask(m: np.ndarray, v: np.ndarray, weight_pruned: np.ndarray, beta: float) -> np.ndarray:
    """Where ExCP's joint pruning sets v (and m with it) to 0: the weight's update dropped,
    m finite (so it can be stored as 0) and ``0 < v < beta * mean(v)``."""
    return np.asarray(weight_pruned & np.isfinite(m) & below_mean(v, beta), dtype=bool)


def _guarded(policy: MomentPolicy, m: np.ndarray, v: np.ndarray, exact: np.ndarray, h: AdamHyper,
             weight_pruned: np.ndarray | None, dtype: str, previous_v: Any) -> Any:
    """The first attempt whose stored update passes the guard, or None."""
    v_cache: dict[tuple[int, bool], tuple[np.ndarray, np.ndarray]] = {}
    _, c2 = h.bias_corrections()
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        m_importance = 1.0 / (np.sqrt(np.maximum(v, 0) / c2) + h.eps) ** 2
    # every attempt buckets the same m: its importance lives on in the prepared entries only,
    # and v's importance (the exact update squared) is squared where v is positive, per attempt
    m_prepared = _PreparedM.of(m, m_importance)
    del m_importance
    attempts = policy.attempts()
    joint_matters = weight_pruned is not None and bool(weight_pruned.any())
    v_pruned = None  # ExCP's joint v pruning, done by the attempts that prune jointly
    if policy.joint_v_beta is not None and weight_pruned is not None and joint_matters:
        v_pruned = joint_v_mask(m, v, weight_pruned, policy.joint_v_beta)
        if not v_pruned.any():
            v_pruned = None
    tried: set[tuple[float, int, int, bool]] = set()
    # a quantized v is kept while a later attempt has its key (its levels, jointly pruned or
    # not), then dropped: each is a tensor-sized array
    uses: dict[tuple[int, bool], int] = {}
    for _, _, v_levels, joint in attempts:
        key = (v_levels, joint and v_pruned is not None)
        uses[key] = uses.get(key, 0) + 1
    for n, (prune, m_levels, v_levels, joint) in enumerate(attempts, start=1):
        setting = (prune, m_levels, v_levels, joint and joint_matters)
        if setting in tried:  # joint pruning with no pruned weight: an attempt already made
            continue
        tried.add(setting)
        drop = smallest_mask(exact, prune) if prune > 0 else np.zeros(m.shape, bool)
        if joint and weight_pruned is not None:
            drop |= weight_pruned
        v_drop = v_pruned if joint else None
        if v_drop is not None:
            drop |= v_drop  # already within the weight's mask; stated so v is never 0 under a kept m
        m_q, m_cb = quantize_exp_avg(m, drop, m_levels, dtype, None, m_prepared)
        key = (v_levels, v_drop is not None)
        if key not in v_cache:
            v_in = v if v_drop is None else np.where(v_drop, np.float32(0.0), v)
            v_cache[key] = quantize_exp_avg_sq(v_in, v_levels, dtype, previous=previous_v,
                                                 importance_root=exact)
        v_q, v_cb = v_cache[key]
        uses[key] -= 1
        if uses[key] <= 0:
            del v_cache[key]
        if v_cb.size == 0:
            return None
        cosine, error = compare(exact, update(m_q, v_q, h))
        if cosine >= policy.min_update_cosine and error <= policy.max_update_error:
            v_share = None  # recorded only under joint_v_beta, so other records stay version 1
            if policy.joint_v_beta is not None:
                v_share = 0.0 if v_drop is None else round(float(v_drop.mean()), 6)
            record = MomentTensorRecord(
                "quantized", update_cosine=round(cosine, 6), update_rel_error=round(error, 6),
                exp_avg_levels=int(m_cb.size), exp_avg_sq_levels=int(v_cb.size),
                pruned_fraction=round(float((drop & (m != 0)).mean()), 6) if drop.size else 0.0, attempts=n,
                exp_avg_sq_pruned_fraction=v_share)
            return (m_q, m_cb), (v_q, v_cb), record
        del m_q, v_q, drop  # refused: free them before the next attempt makes its own
    return None


#: the Checkpointer's default: moments compressed, guarded
DEFAULT_MOMENTS = MomentPolicy()
#: the default moments of versions a restart never loads as stored (``SearchPolicy.history_moments``):
#: with a restore residual the newest version resumes bit-exact, so every version's stored
#: moments serve rollbacks, evaluations and exports only. Judged by the rollback (the
#: evaluation's check: restore the run's middle version lossy, train on, compare with training
#: on from the exact state), a looser guard (update cosine >= 0.8, error <= 0.6), first attempts
#: at 8 levels with 80 % then 60 % of m pruned, and moments from 64 elements (biases and norms
#: too: their lossless bytes were an eighth of the LM's history). On the evaluation's CNN / LM /
#: transfer the moments' history went from 17.9x / 9.9x / 10.1x to 35.2x / 18.4x / 18.5x and the
#: rollback changed the final loss +0.15 % / +1.12 % / +1.79 % against +0.09 % / +1.28 % / +1.75 %
#: with the strict guard (dropping Adam's state there instead: -1.18 % / +1.72 % / +2.26 %); the
#: whole state's history 21.4x / 10.6x / 13.0x -> 35.2x / 15.8x / 18.2x
#: (``python -m benchmarks.evaluate.single NAME --methods ours,ours-strict --rollback-at 0.5``).
ROLLBACK_MOMENTS = MomentPolicy(exp_avg_bins=8, exp_avg_sq_bins=8, prune=0.8, min_update_cosine=0.8,
                                max_update_error=0.6, min_numel=64)
