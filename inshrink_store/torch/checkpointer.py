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

This module is the Checkpointer itself: the loop's side (gradient EMA, state copy) and the
background save (commit, retries around gc) and restore. What a save stores — closed loop or
keyframe, which space, the keyframe fallback — is decided by the policy's one entry for it,
:class:`~inshrink_store.policy.SaveDecider` (issue 45): this module hands it the state, the
parent version read as data and an evaluator of candidates on its model, and writes what it
returns. Beside it, in the torch
layer: ``checkpointer_options`` checks its keywords, ``retention`` keeps the tags and runs
the gc, ``quantized_eval`` runs ``eval_fn`` and the probe on a candidate's model, and
``extra_state`` holds :class:`RNGState` and what an ``extra_state`` entry must offer.
``Retention`` and ``RNGState`` stay importable from here.
"""

from __future__ import annotations

import copy
import logging
import time
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from typing_extensions import Unpack

from inshrink_store.errors import (
    BackgroundSaveError,
    ConflictError,
    FormatError,
    InvalidInputError,
    LeaseBrokenError,
    NotFoundError,
)
from inshrink_store.policy import (
    DEFAULT_CONFIG,
    ParentVersion,
    PolicyArgs,
    QuantizationRecord,
    SaveDecider,
    SaveRun,
    SaveState,
    SearchPolicy,
    SearchResult,
    SearchSpace,
)
from inshrink_store.repository import ANY_HEAD, AnyHead, check_commit_fields, replaced_branch_name
from inshrink_store.structure import PARAM_NAMES_ATTR, STRUCTURE_ATTR, flatten
from inshrink_store.torch.checkpointer_options import CheckpointerOptions, OnBusy, Probe
from inshrink_store.torch.extra_state import RNGState, load_into, state_of
from inshrink_store.torch.optim import adam_hyper, load_optimizer_state, param_paths
from inshrink_store.torch.quantized_eval import QuantizedEval, probe_similarity
from inshrink_store.torch.retention import GcWorker, Retention, RetentionKeeper
from inshrink_store.torch.staging import HostStaging, Staged
from inshrink_store.torch.tensors import (
    flatten_state,
    is_state_leaf,
    load_state_report,
    state_to_arrays,
    torch,
)
from inshrink_store.torch.tiers import refuse_dropped

if TYPE_CHECKING:  # annotations only; at run time torch comes from require() (tensors.py)
    import torch as _torch

    from inshrink_store import GcReport
    from inshrink_store.plans import Planner
    from inshrink_store.policy import MomentPolicy
    from inshrink_store.repository import Repository, SnapshotInfo

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_CONFIG", "BackgroundSaveError", "Checkpointer", "RNGState", "Retention"]


def _attributes(skeleton: Any, params: Mapping[str, str]) -> dict[str, Any]:
    """A version's root attributes: the state's skeleton, and each optimizer parameter's name
    (``params``: ``optimizer/state/<i>`` -> ``model/<name>``), which only the model knows and
    by which ``ls``, ``show`` and ``snap[...]`` name its moments."""
    names = {path.rsplit("/", 1)[1]: name.removeprefix("model/") for path, name in params.items()}
    return {STRUCTURE_ATTR: skeleton, **({PARAM_NAMES_ATTR: names} if names else {})}


@dataclass(frozen=True)
class _Job:
    """What the loop's thread hands the background save: copies, never live objects."""

    sensitivity: dict[str, Any]  # path -> |g*w| as numpy, over the last EMA window
    kinds: dict[str, str]  # path -> owning module's class name (layer types)
    eval_model: Any  # a copy of the model on its own device to evaluate candidates on (None: no eval_fn)
    params: dict[str, str]  # optimizer/state/<i> -> model/<name> (joint pruning of the moments)
    step: int
    metrics: dict[str, float] | None
    message: str | None
    copy_s: float
    staged: Staged  # the state's copies in flight: its wait() gives the host state
    ema: dict[str, Any]  # model name -> gradient EMA (host), for sensitivity once staged lands


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

    Each save is a compare-and-swap on the branch head (docs/reference/format.md, "Commits
    are compare-and-swap"): it replaces the head this Checkpointer last saw (its last save, or
    the head when it restored), else it raises ConflictError naming both heads: one branch,
    one trainer (another writer's version is never dropped). A save after restoring an older
    version keeps the head it replaces as branch ``<branch>.replaced-<id12>``.
    ``extra_state``: name -> object with ``state_dict``/``load_state_dict`` (a scheduler,
    :class:`RNGState`) or ``get_state``/``set_state`` (a ``torch.Generator``), saved with
    every version and put back by :meth:`restore`.

    ``exact_resume`` (default 1, at most 64): the newest N versions of the branch keep a
    restore residual, so :meth:`restore` from them is bit-exact (``restored_exact`` says
    so). With ``exact_resume=0`` a restart resumes from the stored, quantized state, so
    the search runs in the policy's ``resume_space`` (16-64 levels, at most 40 % pruned)
    instead of its ``space``: an aggressive version within the tolerance at save time can
    still cost a few percent of final quality when training resumes from it again and again.

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

    ``on_busy``: what :meth:`save` does when the previous background save is still running.
    ``"wait"`` (the default, as PyTorch DCP's ``async_save`` and Orbax do) takes this
    checkpoint after it: a CUDA state is cloned on the device and the save queued behind the
    running one when the device has room for the copy (one queued at most; see
    :mod:`inshrink_store.torch.staging`), otherwise the loop blocks until the running save
    commits; ``"skip"`` does not take this checkpoint
    (one warning names the step and the step still in flight; :attr:`skipped` lists them) and
    returns at once, so the loop never waits for the store beyond the state copy. Needs
    ``background=True``.
    """

    def __init__(self, repo: Repository, model: _torch.nn.Module, optimizer: _torch.optim.Optimizer | None = None,
                 eval_fn: Callable[[Any], float] | None = None,
                 every: int | None = None, *, policy: SearchPolicy | None = None, ema_batches: int = 50,
                 branch: str = "main", background: bool = True, gc_wait: float = 600.0,
                 lossless: bool = False, retention: Retention | None = None, max_to_keep: int | None = None,
                 keep_every_n_steps: int | None = None, extra_state: Mapping[str, Any] | None = None,
                 exact_resume: int = 1, closed_loop: bool = True, probe: Probe | None = None,
                 on_busy: OnBusy = "wait", **legacy: Unpack[PolicyArgs]) -> None:
        options = CheckpointerOptions(  # raises what a bad keyword gets
            eval_fn=eval_fn, every=every, policy=policy, legacy=legacy, ema_batches=ema_batches, branch=branch,
            background=background, gc_wait=gc_wait, lossless=lossless, retention=retention,
            max_to_keep=max_to_keep, keep_every_n_steps=keep_every_n_steps, extra_state=extra_state,
            exact_resume=exact_resume, closed_loop=closed_loop, probe=probe, on_busy=on_busy)
        self.exact_resume, self.closed_loop, self.probe = exact_resume, closed_loop, probe
        self.on_busy: OnBusy = on_busy
        #: the steps whose :meth:`save` was skipped (``on_busy="skip"``: the previous save was running)
        self.skipped: list[int] = []
        #: after :meth:`restore`: True when the state loaded is bit-exact (a restore residual
        #: or a lossless version), False when quantized tensors hold their stored values
        self.restored_exact: bool | None = None
        self.retention = options.resolved_retention
        self.extra_state: dict[str, Any] = options.resolved_extra_state
        self.policy = options.resolved_policy
        self.repo, self.model, self.optimizer, self.eval_fn = repo, model, optimizer, eval_fn
        self.every, self.ema_batches, self.branch, self.gc_wait = every, ema_batches, branch, gc_wait
        self.lossless = lossless
        #: the ``extra`` state of the version :meth:`restore` loaded ({} before a restore)
        self.extra: dict[str, Any] = {}
        self._ema: dict[str, Any] = {}
        self._batches = 0
        self._parent: str | None = None
        #: the branch head the next commit replaces (a compare-and-swap): this Checkpointer's
        #: last save, or the head when it restored; ANY_HEAD before either
        self._expect_head: str | None | AnyHead = ANY_HEAD
        #: what the decisions carry from save to save: the last configuration and its space, and
        #: the run's evaluations that rank a budgeted search's candidates (refilled by restore())
        self._run = SaveRun()
        # clones on the device serve a save that runs behind the loop; a foreground save
        # copies in the loop anyway, so it goes straight into the pinned arena
        self._staging = HostStaging(on_device=background)
        #: (the model's tensor layout, a scratch copy of the model on its device) for eval_fn and
        #: probe: made here, reused by every save, remade when the layout changes (see _scratch_model)
        self._scratch: tuple[tuple[Any, ...], Any] | None = None
        if eval_fn is not None or probe is not None:
            self._scratch_model(model.state_dict())
        self._checked_views = False  # the first save logs tensors that share memory as different views
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="inshrink-save") if background else None
        #: the background saves not yet waited for, oldest first, with their steps: the one
        #: running and at most one staged behind it (staging.py's device mode)
        self._pending: list[tuple[Future[SnapshotInfo], int]] = []
        self._closed = False
        # retention: the tags it asks for, after each commit (see retention.py)
        self._keeper = (None if self.retention is None else
                        RetentionKeeper(repo, self.retention, branch, gc_wait))
        # gc runs after commits for retention, and to collect restore residuals that fell out
        # of the newest exact_resume versions; on its own thread when saves run in the background
        self._gc = GcWorker(repo, branch, None if self.retention is None else self.retention.max_to_keep,
                            background=background and (self.retention is not None or exact_resume > 0),
                            full_state_for_last=None if self.retention is None else self.retention.full_state_for_last)
        self.last_search: SearchResult | None = None
        self._told_skipped = False  # the "optimizer state is not Adam-shaped" line is logged once
        #: per saved version, wall seconds: ``copy_s`` (the loop's copy), ``search_s`` (deciding
        #: what to store, ``eval_fn`` included), ``eval_s`` and ``evaluations`` (``eval_fn``'s share
        #: and its calls, the unquantized baseline's one included), ``total_s`` (copy to commit).
        #: Wall, not CPU: the search runs on its own thread and the writer's, beside training.
        self.timings: list[dict[str, float]] = []
        #: said with the first save (a Checkpointer that only restores stores nothing lossy)
        self._lossy_warning: str | None = options.lossy_warning()

    @property
    def decider(self) -> SaveDecider:
        """The policy's one decision of each save (issue 45): closed loop or keyframe, which space,
        the fallback (:mod:`inshrink_store.policy.save_decision`); this Checkpointer copies the
        state, evaluates candidates on its model and commits. Made from the attributes as they
        are now (``policy``, ``closed_loop``, ``exact_resume``, ``lossless``)."""
        return SaveDecider(self.policy, closed_loop=self.closed_loop, resume_space=not self.exact_resume,
                           lossless=self.lossless, stream=True)

    @property
    def last_gc(self) -> GcReport | None:
        """The GcReport of the last retention gc that ran (None before one has)."""
        return self._gc.last_report

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
    def optimizer_policy(self) -> Planner | MomentPolicy | str | None:
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
        puts it in :attr:`extra`, next to the state of every ``extra_state`` object.

        While the previous background save is running, ``on_busy="wait"`` (the default) queues
        this one behind it (CUDA state with room on the device for a copy; a second one waits)
        or waits for it to commit first; ``on_busy="skip"`` takes no checkpoint at all (nothing is
        copied, nothing is written; the step goes into :attr:`skipped` and a warning names it)
        and returns the running save's Future, whose result is the version of that earlier
        step (compare ``result().step`` with ``step`` to tell a skipped save)."""
        self._check_open("save")
        self._raise_failure()
        warning, self._lossy_warning = self._lossy_warning, None
        if warning is not None:
            warnings.warn(warning, stacklevel=2)
        running = self._running()
        if self.on_busy == "skip" and running is not None:
            return self._skip(step, running)
        while len(self._unfinished()) > 1:  # one save staged behind the running one at most
            self._wait_oldest()
        start = time.perf_counter()
        extras = self._extra_now(extra)
        live: dict[str, Any] = {"model": self.model.state_dict()}
        if self.optimizer is not None:
            live["optimizer"] = self.optimizer.state_dict()
        if extras:
            live["extra"] = extras
        if not self._checked_views:  # before the copy, which keeps ties but not partial overlaps
            self._checked_views = True
            flatten_state(live)  # logs tensors sharing memory as different views (tied ones alias)
        # CUDA tensors: cloned on the device, or enqueued into reusable pinned buffers, not
        # waited for (staging.py); a save still running holds those buffers, so without room
        # on the device for clones this save waits for it first
        staged = self._staging.stage(live, busy=self._running() is not None)
        if staged is None:
            waited = time.perf_counter()
            self.wait()
            start += time.perf_counter() - waited  # copy_s is the loop's copy, not this wait
            staged = self._staging.stage(live, busy=False)
            assert staged is not None
        # handed over and cleared here, in the loop's thread: the next window starts now
        ema, self._ema = self._ema, {}
        kinds = {f"model/{name}.{p}": type(mod).__name__ for name, mod in self.model.named_modules()
                 for p, _ in mod.named_parameters(recurse=False)}
        scores = self.eval_fn is not None or self.probe is not None
        eval_model = self._scratch_model(live["model"]) if scores else None
        copy_s = time.perf_counter() - start
        params = param_paths(self.model, self.optimizer) if self.optimizer is not None else {}
        job = _Job({}, kinds, eval_model, params, step, metrics, message, copy_s, staged, ema)
        if self._pool is None:
            return self._save(job)
        future = self._pool.submit(self._save, job)
        # committed saves are let go (a run that never calls wait() would keep one per save);
        # failures stay for wait() to raise
        self._pending = [(f, s) for f, s in self._pending if not f.done() or f.exception() is not None]
        self._pending.append((future, step))
        return future

    def _scratch_model(self, state: Mapping[str, Any]) -> Any:
        """The copy of the model that ``eval_fn`` and ``probe`` run on, on the model's device:
        made when the Checkpointer is made, not in a save (a deep copy held the loop: 0.33 s at
        the first save of GPT-2 124 M on an H200), and again at a save whose model tensors
        changed (names, shapes, dtypes, devices). Its values never matter: each save loads its
        own copy of the weights into it before scoring (``_save``). The saves run one at a time,
        so one copy serves them all; the device holds it for the Checkpointer's lifetime."""
        layout = tuple((k, tuple(v.shape), v.dtype, v.device) for k, v in state.items() if isinstance(v, torch.Tensor))
        if self._scratch is None or self._scratch[0] != layout:
            scratch = copy.deepcopy(self.model)  # stays on its device
            for p in scratch.parameters():
                p.grad = None  # a gradient copied with the model would only take memory
            self._scratch = (layout, scratch)
        return self._scratch[1]

    def _skip(self, step: int, running: tuple[Future[SnapshotInfo], int]) -> Future[SnapshotInfo]:
        """``on_busy="skip"`` while ``running`` (the save of an earlier step) is in flight."""
        self.skipped.append(step)
        log.warning("checkpoint at step %s skipped (on_busy='skip'): the save of step %s is still running",
                    step, running[1])
        return self._pending[-1][0]

    def _unfinished(self) -> list[tuple[Future[SnapshotInfo], int]]:
        return [(f, s) for f, s in self._pending if not f.done()]

    def _running(self) -> tuple[Future[SnapshotInfo], int] | None:
        """The background save still running or queued (the oldest unfinished), if any."""
        unfinished = self._unfinished()
        return unfinished[0] if unfinished else None

    def _wait_oldest(self) -> None:
        """Wait for the oldest background save; re-raise its failure (the later ones are
        still waited for by :meth:`wait`)."""
        future, step = self._pending.pop(0)
        try:
            future.result()
        except BaseException as exc:
            raise BackgroundSaveError(
                f"Expected the background checkpoint of step {step} to commit. Got {exc!r} instead.") from exc

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
        extras = {name: state_of(obj) for name, obj in self.extra_state.items()}
        extras.update(given)
        try:
            flatten(extras, is_state_leaf, prefix="extra")
        except FormatError as exc:
            raise InvalidInputError(str(exc)) from None
        return extras

    def wait(self) -> SnapshotInfo | None:
        """Block until the background save (if any) is committed and return its
        :class:`~inshrink_store.SnapshotInfo` (None: no save was pending); re-raise its failure."""
        pending, self._pending = self._pending, []
        failure: tuple[BaseException, int] | None = None
        info: SnapshotInfo | None = None
        for future, step in pending:  # every one, so none is left running after a failure
            try:
                info = future.result()
            except BaseException as exc:
                failure = failure or (exc, step)
        if failure is not None:
            error, failed = failure
            later = [s for _, s in pending if s != failed]
            raise BackgroundSaveError(
                f"Expected the background checkpoint of step {failed} to commit. Got {error!r} instead"
                + (f" (the saves of steps {later} were waited for too; `inshrink log` shows which committed)."
                   if later else ".")) from error
        return info

    def _raise_failure(self) -> None:
        if any(f.done() and f.exception() is not None for f, _ in self._pending):
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
        self._gc.wait_idle()  # a retention gc in flight must not race this read
        head = self.repo.branches().get(self.branch)  # what the next save replaces
        snapshot_id = self._resolve(ref)
        if self.optimizer is not None:  # a weights-only version (Retention(full_state_for_last=K)) has none
            refuse_dropped(self.repo.snapshot(snapshot_id), "optimizer", ref)
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
            load_optimizer_state(self.optimizer, state["optimizer"], f"{snapshot_id[:12]} (step {info.step})")
        for name, obj in self.extra_state.items():
            load_into(obj, extras[name])
        self.extra = dict(extras)
        self._parent, self._expect_head = snapshot_id, head
        if self._keeper is not None:
            self._keeper.restored()
        recorded = info.metadata.get("quantization")
        record = None if recorded is None else QuantizationRecord.from_dict(recorded)
        self._run.restored(record, self.policy)  # the next save continues the run's fit
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
        job_state: dict[str, Any] = job.staged.wait()
        model_state = job_state["model"]
        # in place: the EMA is this save's own (handed over by save()), so |g*w| needs no new
        # tensor-sized array per weight
        job.sensitivity.update({f"model/{n}": g.mul_(model_state[n].float()).abs_().numpy()
                                for n, g in job.ema.items() if n in model_state})
        # views, not copies: job_state is this save's own copy (staging.py), read-only from here on
        arrays, dtypes, skeleton = state_to_arrays(job_state, copy=False)
        parent, expected = self._commit_base()
        state = SaveState(arrays, dtypes, job.kinds, job.sensitivity, job.params,
                          adam_hyper(job_state.get("optimizer")))
        evaluator = None
        if job.eval_model is not None:  # the scratch model holds this save's weights from here on
            with torch.no_grad():
                job.eval_model.load_state_dict(model_state)
        if self.eval_fn is not None and job.eval_model is not None:
            eval_fn, eval_model = self.eval_fn, job.eval_model
            evaluator = lambda stored: QuantizedEval(eval_fn, eval_model, dtypes, model_state, stored)  # noqa: E731
        decider = self.decider
        outcome = decider.decide(state, ParentVersion.read(self.repo, parent, decider, state), self._run, evaluator)
        if outcome.fell_back:
            log.info("checkpoint at step %s: no closed-loop residual within tolerance; searched keyframes instead",
                     job.step)
        decision, plans, evaluate = outcome.decision, outcome.plans, outcome.evaluator
        t_search = time.perf_counter() - t0
        metadata: dict[str, Any] = {"quantization": decision.record.to_dict()}
        if self.probe is not None and job.eval_model is not None:
            metadata["probe"] = probe_similarity(job.eval_model, self.probe, dtypes, job_state["model"], plans)

        def with_moments() -> dict[str, Any]:
            """The metadata once the tensors are written: the moments' record is complete only
            then (they are planned as the writer reads them)."""
            moments = decision.moment_record()
            if moments is None:
                return metadata
            if moments.skipped and not self._told_skipped:
                log.warning("checkpoint at step %s: %s", job.step, moments.skipped)
                self._told_skipped = True
            return {**metadata, "moments": moments.to_dict()}

        self._gc.wait_idle()  # our own retention gc first: the commit would only poll for it
        try:
            info = self._commit(arrays, dtypes=dtypes, attributes=_attributes(skeleton, job.params), quantize=plans,
                                parent=parent, expect_head=expected, step=job.step,
                                metrics=job.metrics, message=job.message or f"step {job.step}",
                                metadata=metadata, finish=with_moments,
                                exact_resume=0 if self.lossless else self.exact_resume)
        except ConflictError as exc:
            found = self.repo.branches().get(self.branch)
            if found == expected:
                raise  # not a moved head (a gc holding the store): the message says what to do
            raise ConflictError(self._moved(expected, found)) from exc
        if expected is not None and parent != expected:
            log.warning("checkpoint at step %s: committed on %s, not on the head %s it replaces; that head is "
                        "kept as branch %r", job.step, str(parent)[:12], expected[:12],
                        replaced_branch_name(self.branch, expected))
        self._parent, self.last_search = info.id, decision.record.search
        self._run.committed(decision.record)
        self._expect_head = info.id
        self.timings.append({"copy_s": job.copy_s, "search_s": t_search,
                             "eval_s": evaluate.seconds if evaluate is not None else 0.0,
                             "evaluations": evaluate.calls if evaluate is not None else 0,
                             "total_s": time.perf_counter() - t0 + job.copy_s})
        if self.retention is not None:
            self._retain(info)
        elif self.exact_resume and info.metadata.get("residual") is not None:
            self._gc.request()  # older residuals fell out of the newest exact_resume versions
        return info

    def _commit_base(self) -> tuple[str | None, str | None]:
        """(parent, head it replaces) of this save, checked before the search: the head must be
        the one this Checkpointer expects (its last save, or the head when it restored; any
        head before either), else ConflictError naming both. The parent is the version this
        Checkpointer continues (its last save or the restored one; the head at first); a
        restored version another process's gc collected since is replaced by the head it would
        have replaced, with a warning: the state in hand is whole, only its delta base changes."""
        head = self.repo.branches().get(self.branch)
        expected = head if self._expect_head is ANY_HEAD else self._expect_head
        assert not isinstance(expected, AnyHead)
        if head != expected:
            raise ConflictError(self._moved(expected, head))
        parent = self._parent if self._parent is not None else head
        if parent is not None and parent != head:
            try:
                self.repo.resolve(parent)
            except NotFoundError:
                log.warning("checkpoint: the version restored (%s) is gone (collected by a gc); this save "
                            "commits on the head %s instead", parent[:12], str(head)[:12])
                self._parent = parent = head
        return parent, expected

    def _moved(self, expected: str | None, head: str | None) -> str:
        """The ConflictError message of a branch head another writer moved."""
        mine = (f"{expected}, this Checkpointer's last save or the head when it restored" if expected
                else "no head (this Checkpointer starts the branch)")
        got = f"head {head}" if head is not None else "no such branch (deleted)"
        return (f"Expected the head of branch {self.branch!r} to be {mine}. Got {got} instead: another writer "
                "committed since. Nothing was written and both versions are kept. Two writers on one branch "
                "would drop each other's versions from its history: give each Checkpointer its own branch= "
                "(restore('main') forks it), or call restore() to continue from the new head.")

    def _commit(self, arrays: dict[str, Any], *, quantize: Any, dtypes: dict[str, str], attributes: dict[str, Any],
                parent: str | None, expect_head: str | None, step: int, metrics: dict[str, float] | None,
                message: str, metadata: dict[str, Any], finish: Callable[[], dict[str, Any]],
                exact_resume: int) -> SnapshotInfo:
        """A write session that rides out a gc: waits for it (up to ``gc_wait`` s, logged) and
        retries a commit the gc fenced off, so a gc never costs the run a checkpoint.

        What ``repo.save`` does, with the metadata taken after the write: ``finish()`` gives it
        (the moments' record exists once the writer has planned them, tensor by tensor); the
        commit fields are checked before anything is written all the same."""
        def waiting(note: str) -> None:
            log.warning("checkpoint at step %s: %s (up to %.0f s)", step, note, self.gc_wait)

        check_commit_fields(message, step, metrics, metadata)
        for attempt in range(1, 4):
            try:
                with self.repo.transaction(self.branch, parent=parent, inherit=False, gc_wait=self.gc_wait,
                                           on_wait=waiting, expect_head=expect_head) as tx:
                    tx.write(arrays, attributes=attributes, dtypes=dtypes, quantize=quantize,
                             residual=exact_resume > 0)
                    return tx.commit(message=message, step=step, metrics=metrics, metadata=finish(),
                                     keep_residual=max(exact_resume, 1))
            except LeaseBrokenError:
                if attempt == 3:
                    raise
                log.warning("checkpoint at step %s: a gc fenced off this commit; retrying (%d/3)", step, attempt + 1)
        raise AssertionError("unreachable")

    # -- retention -------------------------------------------------------------------------
    def _retain(self, info: SnapshotInfo) -> None:
        """After a commit: the keeper tags it if it is kept for good and trims the best tags,
        then a gc runs, unless a tag is still missing (the gc could collect its version). The
        commit has happened, so nothing here raises: what fails is logged and tried after the
        next save."""
        assert self._keeper is not None
        if self._keeper.retain(info):
            self._gc.request()

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
            self._gc.shutdown()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

