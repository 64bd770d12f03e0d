"""Adam's moments as closed-loop versions: each a quantized residual against what the store
holds for the previous version, as the weights are (:mod:`inshrink_store.policy.closed_loop`).
Layer: refs, history and policy (the policy imports neither sibling), below ``parts``.

Why: once the weights are closed-loop residuals, Adam's two moments are about half of a
history's bytes, and each version coded them afresh (open loop). ``exp_avg_sq`` (v) moves
slowly (beta2 ~ 0.999: over a checkpoint interval of tens of steps most entries change by a
few per cent), so against the previous version's stored values ``V_{t-1}`` its residual is
small *relative to v*, and most of it can be pruned (the entry keeps ``V_{t-1}``; a later
residual corrects it when it drifts). ``exp_avg`` (m, beta1 ~ 0.9) forgets its past within
tens of steps, so a residual rarely pays; it is tried, and kept only when it is cheaper.

How v's residual lives in a log domain while the store adds in float32: coder 4 stores
``V_t = V_{t-1} + r_t`` (one float32 addition; readers need nothing new). The entries left at
``V_{t-1}`` are those whose relative change ``|log2(v_t / V_{t-1})|``, weighted by the update
they drive, is smallest; the residual's codebook is fitted with each entry weighted by
``(u / v)^2`` (an error in v moves the update by about ``u * dv / (2 v)``), so its levels sit
at the resolution each entry's *relative* change needs, across v's tens of octaves. Where a
level would make a positive v zero or negative, the entry keeps ``V_{t-1}`` (or, with no
positive parent value, stores its exact residual as a protected value).

The guard judges the reconstruction, the pair of tensors a lossy restore hands the optimizer:
``judge(M_t, V_t)`` is the caller's (:mod:`inshrink_store.policy.moments`) comparison of the
Adam update they drive with the exact one. Keyframes are the open-loop moments (already
guarded), coded by coder 4 on their own so the next version can chain on them; a moment gets
one when it has no closed-loop parent, its parent's chain is at the keyframe interval, it or
its parent holds NaN or inf, or its residual is not cheaper (estimated by coding it).

Deterministic: float32 subtractions and additions, partitions and the codebook fitter seeded
from the data; the same state and parent give the same bytes, whatever the thread count.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from inshrink_store.codecs import closed_loop as closed_loop_body
from inshrink_store.codecs.nuq import quantizer
from inshrink_store.plans import ArrayPlan
from inshrink_store.policy.closed_loop import Base, ClosedLoop, parent_bases, source_digest
from inshrink_store.policy.moment_codebooks import _PreparedM, quantize_exp_avg, smallest_mask
from inshrink_store.policy.partition import QuantizedTensor
from inshrink_store.policy.planner import array_plan

#: ``previous[path][LOOP_KEY]``: a :class:`LoopEntry`, put there by the caller (the
#: Checkpointer) for each float32 moment it wants coded closed-loop; without it, open loop
LOOP_KEY = "closed_loop"
#: v's residual attempts, in order: (fraction of entries left at the parent's value, levels).
#: The first that passes the guard is kept if it codes smaller than the keyframe; a later
#: attempt keeps more entries and levels, so it only costs more
V_LADDER = ((0.95, 8), (0.85, 16), (0.6, 16), (0.0, 32))
#: m's residual attempts (m is mostly new at each checkpoint: few and cheap to refuse)
M_LADDER = ((0.7, 16), (0.3, 16))
#: m's keyframes beyond the open-loop one, most aggressive first: (fraction of entries with the
#: smallest update set to 0, levels); the open-loop guard spent part of its bounds on an
#: open-loop v, which a closed-loop v leaves to m
M_KEY_LADDER = ((0.8, 4), (0.7, 4), (0.7, 8), (0.6, 8), (0.5, 8), (0.5, 16))
#: an entry of v's residual whose best level still moves its update by more than this
#: (relative) stores its exact residual instead
PROTECT_ERROR = 0.5
#: the share of the guard's bounds v's residual may use, judged with the exact m
V_SHARE = 1 / 3
CODINGS = ("keyframe", "residual", "unchanged")
_F32 = np.dtype("<f4")

#: (stored m, stored v) -> (update cosine, relative error) against the exact update
Judge = Callable[[np.ndarray, np.ndarray], tuple[float, float]]


@dataclass(frozen=True)
class LoopEntry:
    """What the caller knows of one moment's parent: its closed-loop array (None: the parent
    has none, or none of this shape) and the store's keyframe interval."""

    base: Base | None
    interval: int


def moment_paths(tensors: Mapping[str, Any], dtypes: Mapping[str, str]) -> list[str]:
    """The float32 ``exp_avg`` / ``exp_avg_sq`` tensors under ``optimizer/`` (sorted)."""
    return sorted(p for p, a in tensors.items() if p.startswith("optimizer/")
                  and p.rsplit("/", 1)[-1] in ("exp_avg", "exp_avg_sq") and dtypes.get(p) == "F32"
                  and getattr(a, "dtype", None) == np.float32)


def with_moment_bases(previous: Mapping[str, dict[str, Any]], reader: Any, tensors: Mapping[str, Any],
                      dtypes: Mapping[str, str], interval: int) -> dict[str, dict[str, Any]]:
    """``previous`` with a :class:`LoopEntry` for every float32 moment of ``tensors``: the
    parent's closed-loop array of it, read from ``reader`` (the parent version, or None)."""
    paths = moment_paths(tensors, dtypes)
    bases = parent_bases(reader, paths, {p: np.asarray(tensors[p]) for p in paths})
    out = dict(previous)
    for path in paths:
        out[path] = {**out.get(path, {}), LOOP_KEY: LoopEntry(bases.get(path), interval)}
    return out


def loop_entry(previous: Mapping[str, dict[str, Any]], path: str) -> LoopEntry | None:
    entry = previous.get(path, {}).get(LOOP_KEY)
    return entry if isinstance(entry, LoopEntry) else None


@dataclass(frozen=True)
class Coded:
    """One moment as a version stores it: ``q`` (what the codec codes: the residual, or the
    keyframe's values) on ``codebook``, ``values`` (the reconstruction a read returns), the
    ``coding`` and, for a residual, the fraction of entries left at the parent's value."""

    q: np.ndarray
    codebook: np.ndarray
    values: np.ndarray
    coding: str
    kept: float = 0.0

    def coded_bytes(self) -> int:
        """What coder 4 makes of it as one chunk: its body's length (an estimate of the
        stored bytes that ranks a residual against a keyframe)."""
        if self.coding == "unchanged":
            return 0
        centres = np.asarray(self.codebook, _F32)
        q = quantizer(tuple(float(c) for c in centres), 0.0, "float32", "float32")
        payload = q.encode(np.ascontiguousarray(self.q, _F32).reshape(-1))
        return len(closed_loop_body.encode(payload, centres))


def _finite(values: np.ndarray) -> bool:
    return bool(np.isfinite(np.sum(values, dtype=np.float64)))


def usable(entry: LoopEntry | None, tensor: np.ndarray) -> Base | None:
    """The parent's array a residual may be coded against (the rule the weights follow)."""
    if entry is None or entry.base is None:
        return None
    base = entry.base
    if base.values.shape != tensor.shape or base.depth + 1 >= entry.interval or not _finite(base.values) \
            or not _finite(tensor):
        return None
    return base


def unchanged(entry: LoopEntry | None, tensor: np.ndarray) -> Base | None:
    """The parent's array when it was made from these very bits (a frozen parameter's moments)."""
    if entry is None or entry.base is None or entry.base.source is None or entry.base.values.shape != tensor.shape:
        return None
    return entry.base if entry.base.source == source_digest(tensor) else None


def reconstruct(base: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``base + q`` in float32, the addition every reader of coder 4 repeats."""
    out: np.ndarray = closed_loop_body.reconstruct(base, q)
    return out


def _inverse_root(v: np.ndarray, c2: float, eps: float) -> np.ndarray:
    """``1 / (sqrt(v / c2) + eps)``, what v contributes to Adam's update (``-inf`` where v < 0,
    which no stored v may be)."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        out: np.ndarray = np.float32(1.0) / (np.sqrt(np.maximum(v, 0) / np.float32(c2)) + np.float32(eps))
    out[v < 0] = -np.inf
    return out


def residual_v(v: np.ndarray, base: np.ndarray, m: np.ndarray, hyper: tuple[float, float], kept: float,
               levels: int) -> Coded:
    """v's residual against ``base`` (see the module's docstring). Each entry's cost is the
    change of its own update, ``|m| * |g(V) - g(v)|`` with ``g`` = :func:`_inverse_root`
    (``hyper``: Adam's ``c2`` bias correction and eps), exact rather than linearised: a stored v
    far below the true one makes the update explode. ``kept`` of the entries, those whose
    parent's value costs least, stay at it; each other entry takes whichever of the levels
    around its residual (or 0) costs least, and one that would still move its update by more
    than :data:`PROTECT_ERROR` stores its exact residual (a protected value)."""
    c2, eps = hyper
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        r = np.subtract(v, base, dtype=np.float32)
        target = _inverse_root(v, c2, eps)
        weight = np.abs(m).astype(np.float32)
        score = weight * np.abs(_inverse_root(base, c2, eps) - target)
        score[~np.isfinite(score)] = np.inf
        keep = smallest_mask(score, kept) if kept > 0 else np.zeros(v.shape, bool)
        keep &= ~((v > 0) & ~(base > 0))  # a positive v never stored as 0 (or below): see moments
        keep |= r == 0
        del score
        # k-means weights: the update's squared change per unit of v, (m / v^1.5)^2 / 4
        vv = np.where(v > 0, v, 1).astype(np.float64)
        importance = np.where(v > 0, np.square(m.astype(np.float64)) / (vv * vv * vv), 0.0)
        del vv
    importance[~np.isfinite(importance)] = 0.0
    _, codebook = quantize_exp_avg(r, keep, levels, "F32", importance=importance)
    del importance
    centres = np.asarray(codebook, np.float32)
    at = np.searchsorted(centres, r)
    best_q = np.zeros(v.shape, np.float32)
    best = np.abs(_inverse_root(base, c2, eps) - target)  # the cost of 0 (the parent's value)
    best[~np.isfinite(best)] = np.inf
    for side in (at - 1, at):
        c = centres[np.clip(side, 0, centres.size - 1)]
        cost = np.abs(_inverse_root(reconstruct(base, c), c2, eps) - target)
        cost[~np.isfinite(cost)] = np.inf
        better = cost < best
        best_q[better], best[better] = c[better], cost[better]
    with np.errstate(divide="ignore", invalid="ignore"):
        off = ~(best <= PROTECT_ERROR * np.abs(target))
    off &= ~keep | (v < 0) | ~np.isfinite(best)
    q = np.where(keep, np.float32(0), best_q)
    q[off] = r[off]  # the exact residual: a protected value
    out = reconstruct(base, q)
    # a positive v far below its parent's value (under half its float32 spacing) that a level or
    # even its exact residual would take to 0: it keeps the parent's positive value (its update
    # is then smaller than the exact one, never exploding); with no positive parent the exact
    # residual is v itself
    lost = (v > 0) & ~(out > 0)
    if lost.any():
        q[lost] = np.where(base[lost] > 0, np.float32(0), r[lost])
        out = reconstruct(base, q)
    return Coded(q, codebook, out, "residual", round(float((q == 0).mean()), 6) if q.size else 0.0)


def residual_m(m: np.ndarray, base: np.ndarray, scale: np.ndarray, kept: float, levels: int) -> Coded:
    """m's residual against ``base``: ``kept`` of the entries, those whose change moves the
    update least (``|m - M| * scale``, ``scale`` the update per unit of m), stay at the
    parent's value; the rest on ``levels`` centres weighted by ``scale^2``."""
    with np.errstate(over="ignore", invalid="ignore"):
        r = np.subtract(m, base, dtype=np.float32)
        score = np.abs(r) * scale
    keep = smallest_mask(score, kept) if kept > 0 else np.zeros(m.shape, bool)
    del score
    q, codebook = quantize_exp_avg(r, keep, levels, "F32", importance=np.square(scale, dtype=np.float64))
    return Coded(q, codebook, reconstruct(base, q), "residual", round(float((q == 0).mean()), 6) if q.size else 0.0)


def keyframe(values: np.ndarray, codebook: np.ndarray) -> Coded:
    return Coded(values, codebook, values, "keyframe")


def kept_unchanged(base: Base) -> Coded:
    return Coded(base.values, np.zeros(1), base.values, "unchanged")


@dataclass(frozen=True)
class LoopOutcome:
    """How one pair was stored closed-loop: each moment's :class:`Coded`, the guard's figures
    of the stored pair, and the residual attempts made."""

    m: Coded
    v: Coded
    cosine: float
    error: float
    attempts: int


class _Candidates:
    """One moment's codings, made once when first asked for and their coded bytes measured
    once: the pair search judges each against several of the other moment's."""

    def __init__(self, makers: list[Callable[[], Coded]]) -> None:
        self._makers = makers
        self._made: dict[int, tuple[Coded, int]] = {}

    def __len__(self) -> int:
        return len(self._makers)

    def get(self, i: int) -> tuple[Coded, int]:
        if i not in self._made:
            coded = self._makers[i]()
            self._made[i] = (coded, coded.coded_bytes())
        return self._made[i]


def choose(m: np.ndarray, v: np.ndarray, exact: np.ndarray, scale: np.ndarray, hyper: tuple[float, float],
           entries: tuple[LoopEntry | None, LoopEntry | None], keyframes: tuple[Coded, Coded], judge: Judge,
           passes: Callable[[float, float], bool], v_passes: Callable[[float, float], bool],
           weight_pruned: np.ndarray | None = None) -> LoopOutcome:
    """The pair with the fewest coded bytes among those tried that the guard passes.

    v's options: its keyframe (the open-loop v) and its residuals (:data:`V_LADDER`, each
    judged with the exact m: one that fails the guard even so is dropped, and the ladder stops
    at the first that passes ``v_passes``, a share of the guard: more would only cost bytes).
    m's options: keyframes more aggressive than the open-loop one (:data:`M_KEY_LADDER`) and
    residuals (:data:`M_LADDER`); the keyframes set m to 0 where this version dropped the
    weight's update (``weight_pruned``, the open-loop ladder's joint pruning). For each v option, cheapest first, the first m of each
    ladder that passes the guard with it (a later one codes larger) and the open-loop m are
    judged; the smallest pair wins. ``keyframes``, the open-loop pair, passed the guard
    already: the fallback. An unchanged moment (its bits are its parent's) keeps the parent's."""
    m_key, v_key = keyframes
    attempts = 0
    v_same, m_same = unchanged(entries[1], v), unchanged(entries[0], m)
    v_options: list[tuple[Coded, int]] = []
    if v_same is not None:
        v_options.append((kept_unchanged(v_same), 0))
    else:
        v_options.append((v_key, v_key.coded_bytes()))
        v_base = usable(entries[1], v)
        for kept, levels in V_LADDER if v_base is not None else ():
            assert v_base is not None
            attempts += 1
            coded = residual_v(v, v_base.values, m, hyper, kept, levels)
            figures = judge(m, coded.values)
            if passes(*figures):
                v_options.append((coded, coded.coded_bytes()))
                if v_passes(*figures):
                    break
    ladders: list[_Candidates] = []
    if m_same is not None:
        ladders.append(_Candidates([lambda: kept_unchanged(m_same)]))
    else:
        ladders.append(_Candidates([lambda: m_key]))
        prepared: list[_PreparedM] = []

        def m_keyframe(prune: float, levels: int) -> Coded:
            if not prepared:
                prepared.append(_PreparedM.of(m, np.square(scale, dtype=np.float64)))
            drop = smallest_mask(exact, prune)
            if weight_pruned is not None:
                drop |= weight_pruned  # joint pruning, as the open-loop ladder's first attempt
            q, codebook = quantize_exp_avg(m, drop, levels, "F32", None, prepared[0])
            return keyframe(q, codebook)

        ladders.append(_Candidates([functools.partial(m_keyframe, p, n) for p, n in M_KEY_LADDER]))
        m_base = usable(entries[0], m)
        if m_base is not None and _worth(m, m_base.values, scale):
            base = m_base.values
            ladders.append(_Candidates([functools.partial(residual_m, m, base, scale, k, n) for k, n in M_LADDER]))
    best: tuple[int, Coded, Coded, tuple[float, float]] | None = None
    for v_coded, v_bytes in sorted(v_options, key=lambda o: o[1]):
        if best is not None and v_bytes >= best[0]:
            break
        for ladder in ladders:
            for i in range(len(ladder)):
                m_coded, m_bytes = ladder.get(i)
                if best is not None and v_bytes + m_bytes >= best[0]:
                    continue  # a later one of this ladder codes larger still; try it anyway only if cheaper
                attempts += 1
                figures = judge(m_coded.values, v_coded.values)
                if passes(*figures):
                    best = (v_bytes + m_bytes, m_coded, v_coded, figures)
                    break
    if best is None:  # nothing passed: the open-loop pair (passed before)
        return LoopOutcome(m_key, v_key, *judge(m_key.values, v_key.values), attempts)
    return LoopOutcome(best[1], best[2], best[3][0], best[3][1], attempts)


def _worth(m: np.ndarray, base: np.ndarray, scale: np.ndarray) -> bool:
    """Whether m's change since its parent's stored value is smaller than m itself (in the
    update it drives): otherwise a residual carries more than a keyframe and is not tried."""
    with np.errstate(over="ignore", invalid="ignore"):
        change = float(np.sum(np.square((m - base) * scale, dtype=np.float64)))
        whole = float(np.sum(np.square(m * scale, dtype=np.float64)))
    return bool(np.isfinite(change) and change < whole)


def nuq_plan(coded: Coded, attributes: dict[str, Any]) -> ArrayPlan:
    codebook = coded.codebook if coded.coding != "unchanged" else np.zeros(1)
    return array_plan(QuantizedTensor(coded.q, tuple(np.asarray(codebook, np.float64).tolist()), attributes),
                      "F32", "float32")


def loop_plans(paths: tuple[str, str], tensors: tuple[np.ndarray, np.ndarray], outcome: LoopOutcome,
               entries: tuple[LoopEntry | None, LoopEntry | None], figures: tuple[dict[str, Any], dict[str, Any]]
               ) -> dict[str, ArrayPlan]:
    """The pair's closed-loop plans (the weights' :class:`ClosedLoopPlans` make them: the
    reconstruction as a float32 array, each chunk coded by coder 4, residual or keyframe)."""
    coded = (outcome.m, outcome.v)
    bases = {}
    interval = 1
    for path, c, entry in zip(paths, coded, entries, strict=True):
        if entry is not None:
            interval = max(interval, entry.interval)
        if c.coding != "keyframe" and entry is not None and entry.base is not None:
            bases[path] = entry.base
    inner = {path: nuq_plan(c, {**f, "moment_coding": c.coding}) for path, c, f in zip(paths, coded, figures,
                                                                                        strict=True)}
    mapping = dict(zip(paths, tensors, strict=True))
    loop = ClosedLoop(paths, bases, mapping, interval)
    made = loop.plans(inner, mapping)
    return {path: made[path] for path in paths}
