"""Checkpointer: dynamic quantization from a training loop, off the critical path.

In the loop, after ``backward()``, call :meth:`Checkpointer.observe_gradients`; it keeps
an exponential moving average of the gradients (``ema = 0.9 g + 0.1 ema``) on the CPU,
only over the last ``ema_batches`` batches before a checkpoint is due, so sensitivity
``|g*w|`` costs no extra pass. :meth:`save` copies the state (the only part training
waits for), then a background thread searches the configuration, encodes and commits.
A background failure is raised by the next call. :meth:`restore` loads a version and
makes the next save delta-code against it, so the chain survives a failure.

``extra_state`` objects (an LR scheduler, :class:`RNGState`, a sampler) and the ``extra``
of each save travel in the same version under ``extra/``: tensors and JSON scalars, no
pickle. A :class:`Retention` tags the versions kept for good (``keep-<step>``) and the
best by a metric (``best-<step>-<id8>``, dropped as better ones come) and, after each commit, runs a
gc that keeps the ``max_to_keep`` newest versions of the Checkpointer's branch (every other
branch keeps its whole history) on a background thread; a gc that a commit in progress
refuses is only logged and runs again after the next save.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import random
import re
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
from typing_extensions import Unpack

from inshrink_store.admin import GarbageCollector
from inshrink_store.errors import (
    AlreadyExistsError,
    BackgroundSaveError,
    ConflictError,
    FormatError,
    InshrinkError,
    InvalidInputError,
    LeaseBrokenError,
    NotFoundError,
)
from inshrink_store.layout import branch_ref_path
from inshrink_store.policy import (
    DEFAULT_CONFIG,
    Candidates,
    PlanSet,
    QuantConfig,
    QuantizationRecord,
    SearchPolicy,
)
from inshrink_store.policy.closed_loop import ClosedLoop, parent_bases
from inshrink_store.policy.moments import MomentPolicy
from inshrink_store.policy.search import SearchPoint, SearchResult, SearchSpace
from inshrink_store.policy.search_policy import Decision, PolicyArgs
from inshrink_store.refs import Refs
from inshrink_store.residual import MAX_KEEP_NEWEST
from inshrink_store.structure import PARAM_NAMES_ATTR, flatten
from inshrink_store.torch.optim import adam_hyper, param_paths
from inshrink_store.torch.tensors import (
    STRUCTURE_ATTR,
    array_to_tensor,
    is_state_leaf,
    load_state_report,
    state_to_arrays,
    torch,
)
from inshrink_store.writer import previous_codecs

if TYPE_CHECKING:  # annotations only; at run time torch comes from require() (tensors.py)
    import torch as _torch

    from inshrink_store.history import SnapshotInfo
    from inshrink_store.repository import Repository

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_CONFIG", "BackgroundSaveError", "Checkpointer", "RNGState", "Retention"]


def _cpu_copy(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu_copy(v) for v in obj)
    return copy.deepcopy(obj)


def _attributes(skeleton: Any, params: Mapping[str, str]) -> dict[str, Any]:
    """A version's root attributes: the state's skeleton, and each optimizer parameter's name
    (``params``: ``optimizer/state/<i>`` -> ``model/<name>``), which only the model knows and
    by which ``ls``, ``show`` and ``snap[...]`` name its moments."""
    names = {path.rsplit("/", 1)[1]: name.removeprefix("model/") for path, name in params.items()}
    return {STRUCTURE_ATTR: skeleton, **({PARAM_NAMES_ATTR: names} if names else {})}


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class Retention:
    """Which versions of the Checkpointer's branch outlive the next gc.

    ``max_to_keep``: the newest versions of the branch kept (a gc after every commit).
    ``keep_every_n_steps``: a version whose step is a multiple of it is also tagged
    ``keep-<step>`` (``keep-<branch>-<step>`` off ``main``) and so kept for good.
    ``keep_best`` with ``metric`` (and ``mode``, ``"min"`` or ``"max"``): the ``keep_best``
    versions with the best ``metrics[metric]`` of ``save(step, metrics=...)`` are tagged
    ``best-<step>-<id8>`` (``best-<branch>-<step>-<id8>`` off ``main``; ``none`` for the step of
    a version saved without one), ``<id8>`` the first 8 digits of its snapshot id, so a version
    saved again at an earlier step (after a restore) never takes another's tag. A version that
    drops out of them loses its tag, so gc collects it unless it is among the newest. A version
    without the metric (or with NaN) is never best; a tie keeps the earlier version. A restarted
    run ranks against the branch's best tags (``best-<step>`` ones from before ``<id8>`` too,
    which it never deletes) and, before its first gc, the branch's recent versions, so a best
    version whose tag a crash cut off is tagged then. The Retention deletes only a tag of that
    form whose ``<id8>`` is its version's. Tags are refs: every tag, yours included, keeps its
    version whatever this says. Only this branch is trimmed: every version in the history of
    another branch is kept, since another run (or a person) owns it.
    """

    max_to_keep: int
    keep_every_n_steps: int | None = None
    keep_best: int | None = None
    metric: str | None = None
    mode: str = "min"

    def __post_init__(self) -> None:
        if not _positive_int(self.max_to_keep):
            raise InvalidInputError(
                f"Expected max_to_keep to be an int >= 1 (the newest versions kept). Got "
                f"{self.max_to_keep!r} instead; e.g. Retention(max_to_keep=3).")
        if self.keep_every_n_steps is not None and not _positive_int(self.keep_every_n_steps):
            raise InvalidInputError(
                f"Expected keep_every_n_steps to be an int >= 1 or None. Got {self.keep_every_n_steps!r} "
                "instead; e.g. Retention(max_to_keep=3, keep_every_n_steps=1000).")
        self._check_best()

    def _check_best(self) -> None:
        """keep_best, metric and mode go together: a metric alone would rank nothing."""
        example = "e.g. Retention(max_to_keep=3, keep_best=2, metric='val_loss', mode='min')"
        if self.mode not in ("min", "max"):
            raise InvalidInputError(
                f"Expected mode to be 'min' or 'max' (whether a lower or a higher metric is better). Got "
                f"{self.mode!r} instead; {example}.")
        if self.keep_best is None:
            if self.metric is not None:
                raise InvalidInputError(
                    f"Expected keep_best with metric={self.metric!r}. Got none instead: pass keep_best=k to "
                    f"keep the k best versions by it; {example}.")
            return
        if not _positive_int(self.keep_best):
            raise InvalidInputError(
                f"Expected keep_best to be an int >= 1 (the best versions kept by metric) or None. Got "
                f"{self.keep_best!r} instead; {example}.")
        if self.metric is None:
            raise InvalidInputError(
                f"Expected a metric with keep_best={self.keep_best!r}. Got none instead: name the key of "
                f"save(step, metrics={{...}}) to rank by; {example}.")
        if not isinstance(self.metric, str) or not self.metric:
            raise InvalidInputError(
                f"Expected metric to be a non-empty str (a key of save(step, metrics={{...}})). Got "
                f"{self.metric!r} instead; {example}.")

    def tag_for(self, step: int | None, branch: str = "main") -> str | None:
        """The tag that keeps the version of ``step`` for good, or None if none does."""
        n = self.keep_every_n_steps
        if n is None or step is None or step % n:
            return None
        return f"keep-{step}" if branch == "main" else f"keep-{branch}-{step}"

    def best_tag_for(self, step: int | None, snapshot_id: str, branch: str = "main") -> str:
        """The tag that keeps version ``snapshot_id`` (saved at ``step``) while it is among the
        best: one name per version, so no other version ever takes it."""
        return f"{self._best_prefix(branch)}{'none' if step is None else step}-{snapshot_id[:8]}"

    def best_tags(self, tags: Mapping[str, str], branch: str = "main") -> dict[str, str]:
        """The tags among ``tags`` (name -> snapshot id) that :meth:`best_tag_for` names on
        ``branch``: the pattern, and the id prefix of the version the tag holds. Only these are
        ever deleted; any other tag is left as it is."""
        pattern = re.compile(re.escape(self._best_prefix(branch)) + r"(?:none|-?[0-9]+)-([0-9a-f]{8})")
        return {name: sid for name, sid in tags.items()
                if (match := pattern.fullmatch(name)) is not None and sid.startswith(match.group(1))}

    def legacy_best_tags(self, tags: Mapping[str, str], branch: str = "main") -> dict[str, tuple[str, int]]:
        """The ``best-<step>`` tags (``best-<branch>-<step>``) among ``tags``, as the Retention
        named them before ``<id8>``: name -> (snapshot id, step). Ranked when they hold a version
        of that step, never deleted: a person may have made one by hand."""
        pattern = re.compile(re.escape(self._best_prefix(branch)) + r"(-?[0-9]+)")
        return {name: (sid, int(match.group(1))) for name, sid in tags.items()
                if (match := pattern.fullmatch(name)) is not None}

    def value(self, metrics: Mapping[str, float]) -> float | None:
        """The metric a version is ranked by: None when it has none (or NaN), so it is never best."""
        value = metrics.get(self.metric) if self.metric is not None else None
        return None if value is None or math.isnan(value) else float(value)

    def sort_key(self, value: float) -> float:
        """Ascending means best first, whatever the mode."""
        return value if self.mode == "min" else -value

    @staticmethod
    def _best_prefix(branch: str) -> str:
        return "best-" if branch == "main" else f"best-{branch}-"


class RNGState:
    """The process's random number generators as one ``extra_state`` entry.

    ``state_dict()`` holds Python's ``random`` state, NumPy's global generator (the
    ``np.random.*`` functions), torch's CPU generator and, when CUDA is initialised, every
    CUDA device's: tensors, ints and floats only, so it is stored without pickle.
    ``load_state_dict`` puts them all back. A ``numpy.random.Generator`` of your own goes in
    ``extra=`` as ``rng.bit_generator.state`` (a dict of ints and strings)."""

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        legacy = np.random.get_state(legacy=False)
        assert isinstance(legacy, dict)
        state: dict[str, Any] = {
            "python": {"version": int(version), "internal": [int(v) for v in internal], "gauss": gauss},
            "numpy": {"bit_generator": str(legacy["bit_generator"]),
                      "key": torch.from_numpy(np.asarray(legacy["state"]["key"], dtype=np.int64)),
                      "pos": int(legacy["state"]["pos"]), "has_gauss": int(legacy["has_gauss"]),
                      "gauss": float(legacy["gauss"])},
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = list(torch.cuda.get_rng_state_all())
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        missing = [k for k in ("python", "numpy", "torch") if k not in state]
        if missing:
            raise FormatError(
                f"Expected an RNGState state dict with 'python', 'numpy' and 'torch'. Got keys "
                f"{sorted(state)} instead; it was not written by RNGState.state_dict().")
        py, npy = state["python"], state["numpy"]
        random.setstate((py["version"], tuple(py["internal"]), py["gauss"]))
        np.random.set_state({"bit_generator": npy["bit_generator"],
                             "state": {"key": npy["key"].numpy().astype(np.uint32), "pos": npy["pos"]},
                             "has_gauss": npy["has_gauss"], "gauss": npy["gauss"]})
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])


def _stateful(name: Any, obj: Any) -> None:
    """An ``extra_state`` entry must be able to give its state and take it back."""
    if not isinstance(name, str):
        raise InvalidInputError(
            f"Expected extra_state names to be str. Got {type(name).__name__} {name!r} instead; "
            "e.g. extra_state={'scheduler': scheduler}.")
    pairs = (("state_dict", "load_state_dict"), ("get_state", "set_state"))
    if not any(callable(getattr(obj, a, None)) and callable(getattr(obj, b, None)) for a, b in pairs):
        raise InvalidInputError(
            f"Expected extra_state[{name!r}] to have state_dict()/load_state_dict() (a scheduler, "
            f"RNGState()) or get_state()/set_state() (a torch.Generator). Got {type(obj).__name__} "
            "instead; pass plain values with save(step, extra={...}) and read them back from ck.extra.")


def _state_of(obj: Any) -> Any:
    return obj.state_dict() if callable(getattr(obj, "state_dict", None)) else obj.get_state()


def _load_into(obj: Any, state: Any) -> None:
    if callable(getattr(obj, "load_state_dict", None)):
        obj.load_state_dict(state)
    else:
        obj.set_state(state)


@dataclass(frozen=True)
class _Job:
    """What the loop's thread hands the background save: copies, never live objects."""

    state: dict[str, Any]
    sensitivity: dict[str, Any]  # path -> |g*w| as numpy, over the last EMA window
    kinds: dict[str, str]  # path -> owning module's class name (layer types)
    eval_model: Any  # a copy of the model on its own device to evaluate candidates on (None: no eval_fn)
    params: dict[str, str]  # optimizer/state/<i> -> model/<name> (joint pruning of the moments)
    step: int
    metrics: dict[str, float] | None
    message: str | None
    copy_s: float


#: where a closed-loop version's residuals are searched: a checkpoint interval's change is
#: mostly noise around a few moving weights, so most of it is pruned (the element keeps its
#: previous value, and a later residual corrects it), the rest coded with few levels
RESIDUAL_SPACE = SearchSpace(bins=(4, 8, 16), prune=(0.5, 0.8, 0.9, 0.95, 0.98), metrics=("magnitude",),
                             protect=(0.0005, 0.005))


def _with_plans(originals: dict[str, Any], plans: Mapping[str, Any], dtypes: dict[str, str]) -> dict[str, Any]:
    """The model's state dict ``originals`` with the planned values of its tensors in
    (``model/<name>`` plans; the optimizer's are left out): the model as a version stores it."""
    state = dict(originals)
    for path, plan in plans.items():
        if path.startswith("model/"):
            name = path[len("model/"):]
            state[name] = array_to_tensor(plan.values, dtypes[path]).reshape(originals[name].shape)
    return state


def _model_output(model: Any, probe: Any) -> Any:
    """The first tensor of ``model``'s output on ``probe`` (a tensor, a tuple, a dict; the
    output a tensor, a tuple or list, a mapping or a ``ModelOutput``), as float64 on the host."""
    with torch.no_grad():
        if isinstance(probe, Mapping):
            out = model(**probe)
        elif isinstance(probe, (tuple, list)):
            out = model(*probe)
        else:
            out = model(probe)
    while not torch.is_tensor(out):
        if isinstance(out, Mapping) and out:
            out = next(iter(out.values()))
        elif isinstance(out, (tuple, list)) and out:
            out = out[0]
        else:
            raise InvalidInputError(
                f"Expected the model's output on the probe batch to hold a tensor. Got {type(out).__name__} instead.")
    return out.detach().to("cpu", torch.float64)


def _probe_similarity(model: Any, probe: Any, dtypes: dict[str, str], originals: dict[str, Any],
                      plans: Mapping[str, Any] | None) -> dict[str, float]:
    """How close the stored model's output on ``probe`` is to the saved one's: per sample
    (the output's first axis) cosine, its mean and lowest, and the relative error overall.
    ``model`` is the scratch copy holding the saved weights; they are put back afterwards."""
    was_training = model.training
    model.eval()
    try:
        live = _model_output(model, probe)
        if plans:
            model.load_state_dict(_with_plans(originals, plans, dtypes))
        try:
            stored = _model_output(model, probe)
        finally:
            if plans:
                model.load_state_dict(originals)
    finally:
        model.train(was_training)
    a, b = live.reshape(live.shape[0] if live.ndim else 1, -1), stored.reshape(stored.shape[0] if stored.ndim else 1, -1)
    cos = torch.nn.functional.cosine_similarity(a, b, dim=1, eps=1e-30)
    norm = float(torch.linalg.vector_norm(a))
    error = float(torch.linalg.vector_norm(b - a)) / norm if norm > 0 else 0.0
    return {"cosine_mean": round(float(cos.mean()), 6), "cosine_min": round(float(cos.min()), 6),
            "rel_error": round(error, 6)}


def _on_axes(space: SearchSpace, previous: QuantConfig | None) -> bool:
    """Whether ``previous`` is a point of ``space`` (the neighbourhood search needs one)."""
    if previous is None:
        return False
    try:
        space.index(SearchPoint.of(previous))
    except FormatError:
        return False
    return True


class _QuantizedEval:
    """``eval_fn`` on a scratch copy of the model, on the model's own device, with a
    candidate's values loaded.

    Why the model's device: an ``eval_fn`` feeds the model tensors where the user's model
    lives (a CUDA model gets CUDA batches), and scoring a large model on the CPU takes seconds
    per candidate. Why a copy: the loop trains the live model while the search runs in the
    background. ``evaluate(None)`` scores the copy as it is (the baseline); after every
    candidate the saved weights (``originals``, the host copy the save already made, so the
    device holds one extra model, not two) are put back, even when ``eval_fn`` raises."""

    def __init__(self, eval_fn: Callable[[Any], float], model: Any, dtypes: dict[str, str],
                 originals: dict[str, Any], stored: Callable[[PlanSet], Mapping[str, Any]] | None = None) -> None:
        self.eval_fn, self.model, self.dtypes, self.originals = eval_fn, model, dtypes, originals
        #: a candidate's plans -> the plans as stored (closed-loop: residuals become reconstructions)
        self.stored = stored
        #: wall seconds spent in ``eval_fn`` (values loaded in and out included), and its calls
        self.seconds = 0.0
        self.calls = 0

    def __call__(self, plans: PlanSet | None) -> float:
        start = time.perf_counter()
        try:
            return self._evaluate(plans)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1

    def _evaluate(self, plans: PlanSet | None) -> float:
        if plans is None:
            return float(self.eval_fn(self.model))
        self.model.load_state_dict(_with_plans(self.originals, plans if self.stored is None else self.stored(plans),
                                               self.dtypes))
        try:
            return float(self.eval_fn(self.model))
        finally:
            self.model.load_state_dict(self.originals)


class Checkpointer:
    """Saves ``model`` (and ``optimizer``) into ``repo`` with the method of Inshrinkerator.

    ``policy`` (a :class:`~inshrink_store.policy.SearchPolicy`) decides what each checkpoint
    stores; the 0.1 keywords ``tolerance``, ``higher_is_better``, ``space`` and
    ``optimizer_policy`` still work and build it. Adam-shaped optimizer state (``exp_avg`` and
    ``exp_avg_sq``) is compressed by default, each tensor checked by the Adam update it
    drives (:class:`~inshrink_store.policy.moments.MomentPolicy`; the version's
    ``metadata["moments"]`` has the figures); ``optimizer_policy="lossless"`` keeps it
    bit-exact, a ``MomentPolicy(...)`` sets it. Without ``eval_fn`` the model weights are
    stored quantized with the policy's ``base`` (``DEFAULT_CONFIG``: 16 levels, no pruning,
    0.5% protected); ``lossless=True`` stores every tensor
    bit-exact instead (no search, no warning). ``every``: the save interval in steps, so
    the gradient EMA runs only over the last ``ema_batches`` batches before each save.
    ``gc_wait``: how long a save waits for a running gc (logged) before it fails; a commit
    that a gc fenced off (it judged this process dead) is retried at once, state in hand.

    ``retention`` (or ``max_to_keep`` / ``keep_every_n_steps``): see :class:`Retention`.
    ``extra_state``: name -> object with ``state_dict``/``load_state_dict`` (a scheduler,
    :class:`RNGState`) or ``get_state``/``set_state`` (a ``torch.Generator``), saved with
    every version and put back by :meth:`restore`.

    ``exact_resume`` (default 1, at most 64): the newest N versions of the branch keep a
    restore residual, so :meth:`restore` from them is bit-exact (``restored_exact`` says
    so). With ``exact_resume=0`` a restart resumes from the stored, quantized state, so
    the search runs in the policy's ``resume_space`` (256 levels, no pruning) instead of
    its ``space``: an aggressive version within the tolerance at save time still costs
    several percent of final quality when training resumes from it again and again.

    ``closed_loop`` (default True): a float32 weight whose previous version is closed-loop is
    stored as the quantized residual against that version's stored values, and the search
    judges the result (what a restore returns), so the stored model stays within one
    residual's error of the live one (:mod:`inshrink_store.policy.closed_loop`); False
    quantizes every version's weights afresh (the open-loop method of the paper).

    ``probe``: a batch the model takes (a tensor, a tuple for ``model(*probe)``, a dict for
    ``model(**probe)``), kept for the life of the Checkpointer. Each version then records
    how close the model it stores is to the live one: the model's output on the probe batch
    from the stored weights against the saved weights' output (``metadata["probe"]``: mean
    and lowest cosine over the batch's samples and the relative error), and ``inshrink log``
    shows it. A check you can read, beside the tolerance ``eval_fn`` enforces.
    """

    def __init__(self, repo: Repository, model: _torch.nn.Module, optimizer: _torch.optim.Optimizer | None = None,
                 eval_fn: Callable[[Any], float] | None = None,
                 every: int | None = None, *, policy: SearchPolicy | None = None, ema_batches: int = 50,
                 branch: str = "main", background: bool = True, gc_wait: float = 600.0,
                 lossless: bool = False, retention: Retention | None = None, max_to_keep: int | None = None,
                 keep_every_n_steps: int | None = None, extra_state: Mapping[str, Any] | None = None,
                 exact_resume: int = 1, closed_loop: bool = True, probe: Any = None,
                 **legacy: Unpack[PolicyArgs]) -> None:
        if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 0):
            raise FormatError(
                f"Expected every to be an int (steps between saves) or None. Got {every!r} instead; "
                f"tolerance is keyword-only: pass tolerance={every!r} or policy=SearchPolicy(...)."
            )
        if policy is not None and legacy:
            raise FormatError(
                f"Expected either policy= or the keywords {sorted(legacy)}. Got both instead; "
                "set those fields on the SearchPolicy."
            )
        if not isinstance(lossless, bool):
            raise InvalidInputError(f"Expected lossless to be True or False. Got {lossless!r} instead.")
        if lossless and (policy is not None or legacy or eval_fn is not None):
            given = [name for name, on in (("eval_fn", eval_fn is not None), ("policy", policy is not None))
                     if on] + sorted(legacy)
            raise InvalidInputError(
                f"Expected lossless=True alone: it stores every tensor bit-exact, with no search. Got "
                f"{', '.join(given)} as well instead; drop lossless=True to quantize, or drop {given[0]}."
            )
        if type(exact_resume) is not int or not 0 <= exact_resume <= MAX_KEEP_NEWEST:
            raise InvalidInputError(
                f"Expected exact_resume to be an int in 0..{MAX_KEEP_NEWEST} (the newest versions that resume "
                f"bit-exact; 0 turns it off). Got {exact_resume!r} instead.")
        self.exact_resume = exact_resume
        if not isinstance(closed_loop, bool):
            raise InvalidInputError(f"Expected closed_loop to be True or False. Got {closed_loop!r} instead.")
        self.closed_loop = closed_loop
        if probe is not None and not (torch.is_tensor(probe) or isinstance(probe, (tuple, list, Mapping))):
            raise InvalidInputError(
                f"Expected probe to be a batch the model takes: a tensor, a tuple of them (model(*probe)) or a "
                f"dict (model(**probe)). Got {type(probe).__name__} instead.")
        self.probe = probe
        #: after :meth:`restore`: True when the state loaded is bit-exact (a restore residual
        #: or a lossless version), False when quantized tensors hold their stored values
        self.restored_exact: bool | None = None
        self.retention = _retention(retention, max_to_keep, keep_every_n_steps)
        self.extra_state: dict[str, Any] = dict(extra_state or {})
        for name, obj in self.extra_state.items():
            _stateful(name, obj)
        self.policy = policy if policy is not None else SearchPolicy.from_args(**legacy)
        self.repo, self.model, self.optimizer, self.eval_fn = repo, model, optimizer, eval_fn
        self.every, self.ema_batches, self.branch, self.gc_wait = every, ema_batches, branch, gc_wait
        self.lossless = lossless
        #: the ``extra`` state of the version :meth:`restore` loaded ({} before a restore)
        self.extra: dict[str, Any] = {}
        self._ema: dict[str, Any] = {}
        self._batches = 0
        self._parent: str | None = None
        self._previous: QuantConfig | None = None
        self._previous_space: SearchSpace | None = None  # the search space _previous was found in
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="inshrink-save") if background else None
        self._pending: Future[SnapshotInfo] | None = None
        self._lock = threading.Lock()
        self._closed = False
        # retention: tags not yet created (gc waits for them) and the gc thread's state
        self._untagged: list[tuple[str, str]] = []
        # keep_best: snapshot id -> (sort key, commit time, step), or None without the metric
        # (read once a run); _rescan: rank the branch's recent versions at the next save (the
        # first of a run or after a restore), for a best version a crash left untagged
        self._metric_values: dict[str, tuple[float, str, int | None] | None] = {}
        self._rescan = True
        self._left_alone: set[str] = set()  # old-style best tags outranked (logged once)
        # gc runs after commits for retention, and to collect restore residuals that fell out
        # of the newest exact_resume versions
        self._gc_pool = (ThreadPoolExecutor(1, thread_name_prefix="inshrink-gc")
                         if background and (self.retention is not None or exact_resume > 0) else None)
        self._gc_due = self._gc_running = False
        self._gc_idle = threading.Event()
        self._gc_idle.set()
        self.last_gc: Any = None  # the GcReport of the last retention gc that ran
        self.last_search: SearchResult | None = None
        self._told_skipped = False  # the "optimizer state is not Adam-shaped" line is logged once
        #: per saved version, wall seconds: ``copy_s`` (the loop's copy), ``search_s`` (deciding
        #: what to store, ``eval_fn`` included), ``eval_s`` and ``evaluations`` (``eval_fn``'s share
        #: and its calls, the unquantized baseline's one included), ``total_s`` (copy to commit).
        #: Wall, not CPU: the search runs on its own thread and the writer's, beside training.
        self.timings: list[dict[str, float]] = []
        if eval_fn is None and not lossless:
            warnings.warn(_lossy_warning(self.policy), stacklevel=2)

    # the 0.1 attributes, read from the policy
    @property
    def tolerance(self) -> float:
        return self.policy.tolerance

    @property
    def higher_is_better(self) -> bool:
        return self.policy.higher_is_better

    @property
    def space(self) -> SearchSpace:
        return self.policy.space

    @property
    def optimizer_policy(self) -> Any:
        return self.policy.optimizer

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran (or the ``with`` block ended): no more saves."""
        return self._closed

    # -- in the loop -----------------------------------------------------------------------
    def observe_gradients(self) -> None:
        """Fold the current gradients into the sensitivity EMA (call after backward())."""
        self._batches += 1
        if self.lossless or (self.every and (self._batches % self.every) < self.every - self.ema_batches):
            return
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if p.grad is None:
                    continue
                g = p.grad.detach().to("cpu", dtype=torch.float32, copy=True)
                prev = self._ema.get(name)
                self._ema[name] = g if prev is None else g.mul_(0.9).add_(prev, alpha=0.1)

    def save(self, step: int, metrics: dict[str, float] | None = None, message: str | None = None, *,
             extra: Mapping[str, Any] | None = None) -> SnapshotInfo | Future[SnapshotInfo]:
        """Checkpoint now. Returns the :class:`~inshrink_store.SnapshotInfo` of the version with
        ``background=False``, and a ``concurrent.futures.Future`` of it with ``background=True``
        (the default; :meth:`wait` also gives it). Which one is fixed when the Checkpointer is
        made, so the return type is the union of the two: narrow it with ``isinstance(r,
        Future)``, or call ``r.result()`` only where you chose ``background=True``.

        ``extra``: nested state of this version (epoch, data-loader position, RNG states):
        dicts, lists and tuples of tensors, str, int, float, bool and None. :meth:`restore`
        puts it in :attr:`extra`, next to the state of every ``extra_state`` object."""
        self._check_open("save")
        self._raise_failure()
        self.wait()
        start = time.perf_counter()
        extras = self._extra_now(extra)
        model_state = _cpu_copy(self.model.state_dict())
        state = {"model": model_state}
        if self.optimizer is not None:
            state["optimizer"] = _cpu_copy(self.optimizer.state_dict())
        if extras:
            state["extra"] = _cpu_copy(extras)
        sensitivity = {f"model/{n}": (self._ema[n] * model_state[n].float()).abs().numpy()
                       for n in self._ema if n in model_state}
        # cleared here, in the loop's thread: the next window starts now, whatever the background does
        self._ema = {}
        kinds = {f"model/{name}.{p}": type(mod).__name__ for name, mod in self.model.named_modules()
                 for p, _ in mod.named_parameters(recurse=False)}
        eval_model = (copy.deepcopy(self.model)  # stays on its device
                      if self.eval_fn is not None or self.probe is not None else None)
        copy_s = time.perf_counter() - start
        params = param_paths(self.model, self.optimizer) if self.optimizer is not None else {}
        job = _Job(state, sensitivity, kinds, eval_model, params, step, metrics, message, copy_s)
        if self._pool is None:
            return self._save(job)
        self._pending = self._pool.submit(self._save, job)
        return self._pending

    def _extra_now(self, extra: Mapping[str, Any] | None) -> dict[str, Any]:
        """The ``extra`` subtree of this save, checked in the loop's thread (no pickle)."""
        if extra is not None and not isinstance(extra, Mapping):
            raise InvalidInputError(
                f"Expected extra to be a dict of state (e.g. {{'epoch': 3}}). Got {type(extra).__name__} "
                "instead; wrap it: extra={'name': value}.")
        given = dict(extra or {})
        clash = sorted(set(given) & set(self.extra_state))
        if clash:
            raise InvalidInputError(
                f"Expected the names in extra= to differ from extra_state's. Got {clash} in both instead; "
                "rename one of them.")
        extras = {name: _state_of(obj) for name, obj in self.extra_state.items()}
        extras.update(given)
        try:
            flatten(extras, is_state_leaf, prefix="extra")
        except FormatError as exc:
            raise InvalidInputError(str(exc)) from None
        return extras

    def wait(self) -> SnapshotInfo | None:
        """Block until the background save (if any) is committed and return its
        :class:`~inshrink_store.SnapshotInfo` (None: no save was pending); re-raise its failure."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        try:
            return pending.result()
        except BaseException as exc:
            raise BackgroundSaveError(f"Expected the background checkpoint to commit. Got {exc!r} instead.") from exc

    def _raise_failure(self) -> None:
        if self._pending is not None and self._pending.done() and self._pending.exception() is not None:
            self.wait()

    def _check_open(self, doing: str) -> None:
        if self._closed:
            raise InvalidInputError(
                f"Expected an open Checkpointer to {doing}. Got one that close() (or the end of its "
                "with-block) already closed instead; create a new Checkpointer(repo, model, optimizer, "
                "...) and call restore() on it to continue from the last version.")

    def restore(self, ref: str | None = None) -> int | None:
        """Load model, optimizer and ``extra_state`` of ``ref`` (default: the head of this
        Checkpointer's branch, so a restarted run resumes its own branch); returns its step.
        The version's ``extra`` is in :attr:`extra` afterwards. Saves continue from it, on
        this Checkpointer's branch: ``restore("main")`` on another branch forks it from main."""
        self._check_open("restore")
        self.wait()
        self._gc_idle.wait()  # a retention gc in flight must not race this read
        snapshot_id = self._resolve(ref)
        state, self.restored_exact = load_state_report(self.repo, snapshot_id)
        info = self.repo.snapshot(snapshot_id)
        log.info("restored step %s from %s: %s", info.step, snapshot_id[:12],
                 "bit-exact" if self.restored_exact else
                 "stored (quantized) values: this version keeps no restore residual")
        extras = state.get("extra", {})
        missing = sorted(set(self.extra_state) - set(extras))
        if missing:
            raise NotFoundError(
                f"Expected extra state {missing} in version {snapshot_id[:12]} (step {info.step}). Got only "
                f"{sorted(extras)} instead; that version was saved without it: restore a later version, or "
                "leave those names out of extra_state for this restore.")
        self.model.load_state_dict(state["model"])
        if self.optimizer is not None and "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        for name, obj in self.extra_state.items():
            _load_into(obj, extras[name])
        self.extra = dict(extras)
        self._parent = snapshot_id
        self._rescan = True
        recorded = info.metadata.get("quantization")
        self._previous = None if recorded is None else QuantizationRecord.from_dict(recorded).config
        self._ema.clear()
        return info.step

    def _resolve(self, ref: str | None) -> str:
        """``ref``'s snapshot id; None is this branch's head, looked up as a branch only (a
        tag or an id prefix spelled like the branch must not stand in for it)."""
        if ref is not None:
            return str(self.repo.resolve(ref))
        head = self.repo.branches().get(self.branch)
        if head is None:
            raise NotFoundError(
                f"Expected branch {self.branch!r} to have a version to restore. Got no such branch in "
                f"{self.repo.url!r} instead: restore('main') (or another ref) to start {self.branch!r} from "
                "that version, or save() without a restore to start it from scratch.")
        return str(head)

    # -- background ------------------------------------------------------------------------
    def _save(self, job: _Job) -> SnapshotInfo:
        t0 = time.perf_counter()
        arrays, dtypes, skeleton = state_to_arrays(job.state)
        evaluate: _QuantizedEval | None = None
        plans: Any = None
        if self.lossless:
            decision = Decision(None, QuantizationRecord(config=None, tolerance=self.policy.tolerance,
                                                         higher_is_better=self.policy.higher_is_better))
        else:
            loop = self._closed_loop(arrays) if self.closed_loop else None
            decision, plans, evaluate = self._decide(job, arrays, dtypes, loop)
            if loop is not None and loop.bases and decision.record.config is None \
                    and decision.record.search is not None:
                # no residual met the tolerance (the parents' reconstructions used up the
                # tolerance): keyframes, searched afresh, before a lossless version
                log.info("checkpoint at step %s: no closed-loop residual within tolerance; searching keyframes",
                         job.step)
                spent = evaluate
                decision, plans, evaluate = self._decide(job, arrays, dtypes, loop.keyframes())
                if evaluate is not None and spent is not None:
                    evaluate.calls, evaluate.seconds = evaluate.calls + spent.calls, evaluate.seconds + spent.seconds
        t_search = time.perf_counter() - t0
        metadata: dict[str, Any] = {"quantization": decision.record.to_dict()}
        if self.probe is not None and job.eval_model is not None:
            metadata["probe"] = _probe_similarity(job.eval_model, self.probe, dtypes, job.state["model"], plans)
        if decision.moments is not None:
            metadata["moments"] = decision.moments.to_dict()
            if decision.moments.skipped and not self._told_skipped:
                log.warning("checkpoint at step %s: %s", job.step, decision.moments.skipped)
                self._told_skipped = True
        self._gc_idle.wait()  # our own retention gc first: the commit would only poll for it
        info = self._commit(arrays, dtypes=dtypes, attributes=_attributes(skeleton, job.params), quantize=plans,
                            branch=self.branch, parent=self._parent, step=job.step, metrics=job.metrics,
                            message=job.message or f"step {job.step}",
                            metadata=metadata, exact_resume=0 if self.lossless else self.exact_resume)
        self._parent, self._previous, self.last_search = info.id, decision.record.config, decision.record.search
        self.timings.append({"copy_s": job.copy_s, "search_s": t_search,
                             "eval_s": evaluate.seconds if evaluate is not None else 0.0,
                             "evaluations": evaluate.calls if evaluate is not None else 0,
                             "total_s": time.perf_counter() - t0 + job.copy_s})
        if self.retention is not None:
            self._retain(info)
        elif self.exact_resume and info.metadata.get("residual") is not None:
            self._request_gc()  # older residuals fell out of the newest exact_resume versions
        return info

    def _decide(self, job: _Job, arrays: dict[str, Any], dtypes: dict[str, str], loop: ClosedLoop | None
                ) -> tuple[Decision, Any, _QuantizedEval | None]:
        """The search of one save: its decision, the plans to write (closed-loop ones when
        ``loop`` codes the weights) and the evaluator it used (None without ``eval_fn``)."""
        searched = arrays if loop is None else loop.search_arrays(arrays)
        sensitivity = job.sensitivity if loop is None else {
            p: s for p, s in job.sensitivity.items() if p not in loop.bases}  # a residual: by magnitude
        # joint moment pruning follows pruned *weights*; a residual's pruned elements are
        # most of the tensor (they keep their value), so its moments are pruned on their own
        params = job.params if loop is None else {k: p for k, p in job.params.items() if p not in loop.bases}
        candidates = Candidates(searched, dtypes, self._previous_codecs(), sensitivity=sensitivity,
                                module_kinds=job.kinds, keep=self.policy.keep, optimizer_params=params,
                                optimizer_hyper=adam_hyper(job.state.get("optimizer")))
        evaluate = None
        if self.eval_fn is not None and job.eval_model is not None:
            evaluate = _QuantizedEval(self.eval_fn, job.eval_model, dtypes, job.state["model"],
                                      None if loop is None else (lambda candidate: loop.plans(candidate, arrays)))
        # without a restore residual a restart resumes from what is stored: search the
        # policy's resume space, whose versions hold the tolerance over many restores (a
        # closed-loop residual searched in RESIDUAL_SPACE met the tolerance at every save
        # and still ended the evaluation's LM +11.8 % after 10 restores, against +2.3 %)
        policy = self.policy if self.exact_resume else self.policy.resuming()
        if self.exact_resume and loop is not None and loop.bases and policy.space == SearchSpace():
            policy = replace(policy, space=RESIDUAL_SPACE)  # a space the user chose is kept
        # the neighbourhood search starts from the previous version's point only in the
        # space that point came from (keyframes and residuals are searched apart)
        # (after a restore, the space is unknown: any previous point on this space's axes)
        same = policy.space == self._previous_space or (
            self._previous_space is None and _on_axes(policy.space, self._previous))
        previous = self._previous if same else None
        self._previous_space = policy.space
        decision = policy.decide(candidates, evaluate, previous=previous)
        plans: Any = decision.plans
        if loop is not None and decision.plans is not None:
            plans = loop.plans(decision.plans, arrays)
        return decision, plans, evaluate

    def _commit(self, arrays: dict[str, Any], **kwargs: Any) -> SnapshotInfo:
        """``repo.save`` that rides out a gc: waits for it (up to ``gc_wait`` s, logged) and
        retries a commit the gc fenced off, so a gc never costs the run a checkpoint."""
        def waiting(message: str) -> None:
            log.warning("checkpoint at step %s: %s (up to %.0f s)", kwargs.get("step"), message, self.gc_wait)

        for attempt in range(1, 4):
            try:
                return self.repo.save(arrays, gc_wait=self.gc_wait, on_wait=waiting, **kwargs)
            except LeaseBrokenError:
                if attempt == 3:
                    raise
                log.warning("checkpoint at step %s: a gc fenced off this commit; retrying (%d/3)",
                            kwargs.get("step"), attempt + 1)
        raise AssertionError("unreachable")

    def _closed_loop(self, arrays: Mapping[str, Any]) -> ClosedLoop:
        """This save's closed-loop coding: the float32 model tensors whose parent version
        holds a closed-loop array (read from the store, so a restore or another writer's
        parent is followed exactly)."""
        parent = self._parent or self.repo.branches().get(self.branch)
        paths = sorted(p for p, a in arrays.items() if p.startswith("model/") and getattr(a, "dtype", None) == np.float32)
        reader = None if parent is None else self.repo.checkout(parent)
        return ClosedLoop(paths, parent_bases(reader, paths, arrays), arrays, self.repo.keyframe_interval)

    def _previous_codecs(self) -> dict[str, dict[str, Any]]:
        parent = self._parent
        if parent is None:
            heads = self.repo.branches()
            parent = heads.get(self.branch)
        if parent is None:
            return {}
        return previous_codecs(self.repo.checkout(parent).view)

    # -- retention -------------------------------------------------------------------------
    def _retain(self, info: SnapshotInfo) -> None:
        """After a commit: tag it if it is kept for good, then ask for a gc. The commit has
        happened, so nothing here raises: what fails is logged and tried after the next save."""
        assert self.retention is not None
        keep = self.retention.tag_for(info.step, self.branch)
        if keep is not None:
            self._untagged.append((keep, info.id))
        self._untagged += self._best_due(info)
        self._untagged = [(n, sid) for n, sid in self._untagged if not self._tag(n, sid)]
        self._trim_best()
        if self._untagged:  # a gc now could collect a version a missing tag must keep
            log.info("retention: gc put off until %s exist", ", ".join(n for n, _ in self._untagged))
            return
        self._request_gc()

    def _best_due(self, info: SnapshotInfo) -> list[tuple[str, str]]:
        """The best tags to create after ``info``'s commit, as (name, snapshot id): its own if it
        ranks among the ``keep_best`` best, and, at the first save of a run or after a restore,
        those of the branch's recent versions that rank so but hold no best tag (a run that
        stopped between a commit and its tag). When the ranking cannot be read ``info`` is
        tagged anyway (if it has the metric): a tag too many is safe, the next trim ranks it."""
        retention = self.retention
        assert retention is not None
        if retention.keep_best is None:
            return []
        candidates = [info]
        try:
            if self._rescan:  # the newest (gc keeps them) and the best that may lack their tag
                candidates += self.repo.log(info.id, limit=2 * max(retention.keep_best, retention.max_to_keep))
            ranked = self._ranked_best(candidates)
        except (InshrinkError, OSError) as exc:
            known = self._known(info.id, info)
            if known is None:
                return []
            name = retention.best_tag_for(info.step, info.id, self.branch)
            log.warning("retention: could not rank %s (%s); tagging it until the next save ranks it", name, exc)
            return [(name, info.id)]
        self._rescan = False
        pending = {sid for n, sid in self._untagged if retention.best_tags({n: sid}, self.branch)}
        due = []
        for sid, names in ranked[:retention.keep_best]:
            known = self._metric_values.get(sid)
            if names or sid in pending or known is None:
                continue
            due.append((retention.best_tag_for(known[2], sid, self.branch), sid))
            if sid != info.id:
                log.info("retention: %s ranks among the %d best by %s but holds no best tag (a run stopped "
                         "before tagging it); tagging it", sid[:12], retention.keep_best, retention.metric)
        return due

    def _trim_best(self) -> None:
        """Delete the best tags of this branch beyond the ``keep_best`` best, so gc collects
        those versions (unless another ref keeps them or they are among the newest). Only tags
        :meth:`Retention.best_tags` names are deleted; an old-style ``best-<step>`` tag is left
        in place. A failure is logged: the tag keeps its version a while longer and the next
        save trims again."""
        retention = self.retention
        assert retention is not None
        if retention.keep_best is None:
            return
        try:
            for sid, names in self._ranked_best()[retention.keep_best:]:
                for name in names:
                    if name not in retention.best_tags({name: sid}, self.branch):
                        if name not in self._left_alone:
                            self._left_alone.add(name)
                            log.info("retention: leaving tag %s -> %s in place (no longer among the %d best "
                                     "by %s, but named before best tags named their version: delete it by "
                                     "hand to let gc collect it)", name, sid[:12], retention.keep_best,
                                     retention.metric)
                        continue
                    self.repo.delete_tag(name)
                    log.info("retention: deleted tag %s -> %s (no longer among the %d best by %s)",
                             name, sid[:12], retention.keep_best, retention.metric)
        except (InshrinkError, OSError) as exc:
            log.warning("retention: could not trim the best tags (%s); trying again after the next save", exc)

    def _ranked_best(self, candidates: list[SnapshotInfo] | None = None) -> list[tuple[str, list[str]]]:
        """The versions that compete for this branch's best tags, best first, each with the best
        tags it holds: those the branch's best tags hold (an old-style ``best-<step>`` tag only
        when its version is of that step), the ones whose tag is still to be created, and
        ``candidates``. A tie keeps the earlier commit. A version without the metric is left out
        (and its tags left alone): the Retention never made them."""
        retention = self.retention
        assert retention is not None
        tags = self.repo.tags()
        held: dict[str, list[str]] = {}
        for name, sid in retention.best_tags(tags, self.branch).items():
            held.setdefault(sid, []).append(name)
        for name, (sid, step) in retention.legacy_best_tags(tags, self.branch).items():
            known = self._known(sid)
            if known is not None and known[2] == step:
                held.setdefault(sid, []).append(name)
        pool = set(held) | {sid for n, sid in self._untagged if retention.best_tags({n: sid}, self.branch)}
        for info in candidates or []:
            self._known(info.id, info)
            pool.add(info.id)
        ranked = []
        for sid in pool:
            known = self._known(sid)
            if known is not None:
                ranked.append((known[0], known[1], sid))
        ranked.sort()
        return [(sid, sorted(held.get(sid, []))) for _key, _time, sid in ranked]

    def _known(self, snapshot_id: str, info: SnapshotInfo | None = None) -> tuple[float, str, int | None] | None:
        """(sort key, commit time, step) of a version, read once a run; None when it has no
        metric (never best) or is gone (a dangling tag, which verify reports)."""
        retention = self.retention
        assert retention is not None
        if snapshot_id not in self._metric_values:
            try:
                info = info if info is not None else self.repo.snapshot(snapshot_id)
            except NotFoundError:
                return None
            value = retention.value(info.metrics)
            self._metric_values[snapshot_id] = (None if value is None else
                                                (retention.sort_key(value), info.time, info.step))
        return self._metric_values[snapshot_id]

    def _tag(self, name: str, snapshot_id: str) -> bool:
        try:
            try:
                self.repo.tag(name, snapshot_id, gc_wait=self.gc_wait)
            except AlreadyExistsError:
                held = self.repo.tags().get(name)
                if held == snapshot_id:
                    return True
                assert self.retention is not None
                if self.retention.best_tags({name: snapshot_id}, self.branch):
                    # named for this version, yet held by another: not the Retention's, left alone
                    log.warning("retention: tag %s already holds %s, not %s; leaving it (that version is "
                                "kept only while among the newest)", name, str(held)[:12], snapshot_id[:12])
                    return True
                # the run was restored to an earlier version and saved this step again
                log.info("retention: moving tag %s from %s to %s", name, str(held)[:12], snapshot_id[:12])
                self.repo.delete_tag(name)
                self.repo.tag(name, snapshot_id, gc_wait=self.gc_wait)
            log.info("retention: tagged %s -> %s (kept for good)", name, snapshot_id[:12])
            return True
        except (InshrinkError, OSError) as exc:
            log.warning("retention: could not tag %s -> %s (%s); trying again after the next save",
                        name, snapshot_id[:12], exc)
            return False

    def _request_gc(self) -> None:
        with self._lock:
            self._gc_due = True
            if self._gc_running:
                return  # the running loop sees _gc_due and runs once more
            self._gc_running = True
            self._gc_idle.clear()
        if self._gc_pool is None:
            self._gc_loop()
        else:
            self._gc_pool.submit(self._gc_loop)

    def _gc_loop(self) -> None:
        finished = False
        try:
            while True:
                with self._lock:  # checked and cleared under one lock: no request is lost
                    if not self._gc_due:
                        self._gc_running, finished = False, True
                        self._gc_idle.set()
                        return
                    self._gc_due = False
                self._collect()
        finally:
            if not finished:  # only on an unexpected exit: never leave saves waiting on _gc_idle
                with self._lock:
                    self._gc_running = False
                    self._gc_idle.set()

    def _collect(self) -> None:
        """One gc keeping this branch's ``max_to_keep`` newest versions (every version kept
        without retention: it then only collects restore residuals and leftovers); never
        raises into the training loop."""
        keep = None if self.retention is None else self.retention.max_to_keep
        try:
            # without retention only the residuals that fell out of the newest versions are
            # dropped; when there are pieces to drop the sweep marks every reachable object
            # first (a piece can share its id with a committed chunk), so it reads the history
            report = self._gc_branch(keep) if keep is not None else self.repo.gc_residuals()
        except ConflictError as exc:
            log.info("retention: gc(keep_last=%s) put off to the next save: %s", keep, exc)
            return
        except Exception as exc:  # a storage error must not stop training; the next save retries
            log.warning("retention: gc(keep_last=%s) failed (%r); trying again after the next save", keep, exc)
            return
        self.last_gc = report
        log.info("retention: gc(keep_last=%s) kept %d versions, deleted %d snapshots, freed %d bytes",
                 keep, report.kept_snapshots, len(report.deleted.get("snapshots", [])), report.freed_bytes)

    def _gc_branch(self, keep_last: int) -> Any:
        """``repo.gc(keep_last=keep_last)`` that trims this branch alone: the store's gc
        keeps the last N of *every* branch, so it runs over :class:`_OtherBranchesKept`."""
        parts = self.repo._parts
        scoped = replace(parts, refs=_OtherBranchesKept(parts, self.branch))
        return GarbageCollector(scoped, keep_last).run()

    def close(self) -> None:
        """Wait for the last save and retention gc, then stop the threads. Idempotent; a
        save or restore afterwards is an InvalidInputError."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown()
            if self._gc_pool is not None:
                self._gc_pool.shutdown()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _OtherBranchesKept(Refs):
    """The store's refs, plus every version in the history of every other branch (from its
    head and its older ref files) as a tag, for a gc that trims one branch only.

    Why a view: ``gc(keep_last=N)`` keeps the N newest versions of every branch and has no
    per-branch form, but a tag keeps its version whatever N says. These tags exist only in
    this view, never in the store; gc reads them while it marks, under its lease, when no
    commit is in progress, so a version committed since is the branch's head and kept."""

    def __init__(self, parts: Any, branch: str) -> None:
        super().__init__(parts.storage)
        self._history, self._branch = parts.history, branch

    def tags(self) -> dict[str, str]:
        kept: set[str] = set()
        for name, seqs in self.branch_seqs().items():
            if name != self._branch:
                for seq in seqs:
                    with contextlib.suppress(FileNotFoundError, InshrinkError):
                        self._walk(self.read(branch_ref_path(name, seq)), kept)
        return {**{f"{sid} (another branch's)": sid for sid in kept}, **super().tags()}

    def _walk(self, start: str | None, kept: set[str]) -> None:
        """Add ``start`` and its ancestors to ``kept``, up to one already there or missing."""
        while start is not None and start not in kept:
            try:
                parent = self._history.get(start).parent
            except InshrinkError:
                return  # missing: gone before this gc (or a dangling ref, verify's to report)
            kept.add(start)
            start = parent


def _retention(retention: Retention | None, max_to_keep: int | None,
               keep_every_n_steps: int | None) -> Retention | None:
    if retention is not None:
        if max_to_keep is not None or keep_every_n_steps is not None:
            raise InvalidInputError(
                "Expected either retention=Retention(...) or max_to_keep=/keep_every_n_steps=. Got both "
                "instead; set those fields on the Retention.")
        if not isinstance(retention, Retention):
            raise InvalidInputError(
                f"Expected retention to be a Retention. Got {type(retention).__name__} instead; e.g. "
                "retention=Retention(max_to_keep=3, keep_every_n_steps=1000).")
        return retention
    if max_to_keep is None:
        if keep_every_n_steps is not None:
            raise InvalidInputError(
                f"Expected max_to_keep with keep_every_n_steps={keep_every_n_steps!r}. Got none instead; "
                "without it nothing is ever collected: pass max_to_keep=N as well.")
        return None
    return Retention(max_to_keep, keep_every_n_steps)


def _lossy_warning(policy: SearchPolicy) -> str:
    base = policy.base
    pruning = "no pruning" if base.prune == 0 else f"{base.prune:.0%} pruned by {base.prune_metric}"
    optimizer = ("optimizer state lossless" if policy.optimizer is None else
                 "Adam moments compressed, each tensor checked by the update it drives" if
                 isinstance(policy.optimizer, MomentPolicy) else
                 "optimizer state quantized by the policy's optimizer planner")
    return ("Checkpointer has no eval_fn: model weights are stored lossy, quantized with the policy's "
            f"base configuration ({base.bins} levels, {pruning}, {base.protect:.1%} protected; unchecked "
            f"for your model); {optimizer}; step counters and scalars exact. Pass eval_fn= to let the "
            "search pick the most aggressive configuration within tolerance, or lossless=True to store "
            "every tensor bit-exact.")
