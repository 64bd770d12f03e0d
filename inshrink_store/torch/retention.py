"""torch layer: the Checkpointer's retention, which versions outlive gc, and the gc itself.

:class:`Retention` says which versions of the Checkpointer's branch are kept: the
``max_to_keep`` newest, every ``keep_every_n_steps``-th step for good (``keep-<step>`` tags),
and the ``keep_best`` best by a metric (``best-<step>-<id8>`` tags, dropped as better ones
come). :class:`RetentionKeeper` creates and deletes those tags after each commit;
:class:`GcWorker` runs the gc that then collects what no tag and no newest version keeps, on a
thread of its own, one at a time.

Why a module of its own: this is the part of a Checkpointer that runs *after* a version is
committed and must never raise into the training loop (what fails is logged and tried again
after the next save); the Checkpointer owns one keeper and one gc worker and calls them, and
its own module keeps the save itself. Everything here logs under the Checkpointer's logger
(``inshrink_store.torch.checkpointer``), the name the training-loop guide gives for every
tag and gc a Checkpointer runs.
"""

from __future__ import annotations

import logging
import math
import re
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from inshrink_store.errors import (
    AlreadyExistsError,
    ConflictError,
    InshrinkError,
    InvalidInputError,
    NotFoundError,
)
from inshrink_store.torch.tiers import WeightsOnlyTier, tier_branch

if TYPE_CHECKING:
    from inshrink_store import GcReport
    from inshrink_store.repository import Repository, SnapshotInfo

#: the Checkpointer's logger, not this module's: users filter retention's lines by that name
log = logging.getLogger("inshrink_store.torch.checkpointer")

__all__ = ["GcWorker", "Retention", "RetentionKeeper"]


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

    ``full_state_for_last`` K (at most ``max_to_keep``; None keeps every version whole): only
    the K newest versions of the branch keep the optimizer state (the weights-only tiers of the
    Hugging Face Trainer's ``save_only_model`` and Orbax). A version that falls out of the K
    newest, while still among the ``max_to_keep`` newest and held by no tag, is first committed
    again without its ``optimizer/`` state on branch ``<branch>.weights-only``
    (:mod:`~inshrink_store.torch.tiers`: same weights, same chunk objects), then the gc drops the
    whole version. That branch keeps its ``max_to_keep - K`` newest. A version a tag keeps
    (``keep-<step>``, ``best-...``, yours) keeps its whole state.
    """

    max_to_keep: int
    keep_every_n_steps: int | None = None
    keep_best: int | None = None
    metric: str | None = None
    mode: str = "min"
    full_state_for_last: int | None = None

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
        full = self.full_state_for_last
        if full is not None and not (_positive_int(full) and full <= self.max_to_keep):
            raise InvalidInputError(
                f"Expected full_state_for_last to be an int from 1 to max_to_keep={self.max_to_keep} (the newest "
                f"versions that keep their optimizer state; the older ones keep their weights) or None. Got "
                f"{full!r} instead; e.g. Retention(max_to_keep=10, full_state_for_last=2). A version without its "
                "optimizer state cannot resume training, so at least the newest one keeps it.")

    @property
    def weights_only(self) -> int:
        """How many versions of the branch keep their weights alone (``max_to_keep - K``; 0
        without ``full_state_for_last``)."""
        return 0 if self.full_state_for_last is None else self.max_to_keep - self.full_state_for_last

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


class RetentionKeeper:
    """The tags a :class:`Retention` asks for, kept up to date after each commit of one branch.

    Why a class: the tags of a run depend on what it has seen (the versions ranked so far,
    the tags still to create, the old-style tags it logged about), and that state lives as
    long as the Checkpointer that owns the keeper. Only the save's thread calls it (the
    Checkpointer's :meth:`~inshrink_store.torch.Checkpointer.restore` waits for the save
    first), so it takes no lock. It never raises: a tag that cannot be created or deleted is
    logged and tried again after the next save, and :meth:`retain` says whether a gc may run.
    """

    def __init__(self, repo: Repository, retention: Retention, branch: str, gc_wait: float) -> None:
        self.repo, self.retention, self.branch, self.gc_wait = repo, retention, branch, gc_wait
        # tags not yet created (gc waits for them)
        self._untagged: list[tuple[str, str]] = []
        # keep_best: snapshot id -> (sort key, commit time, step), or None without the metric
        # (read once a run); _rescan: rank the branch's recent versions at the next save (the
        # first of a run or after a restore), for a best version a crash left untagged
        self._metric_values: dict[str, tuple[float, str, int | None] | None] = {}
        self._rescan = True
        self._left_alone: set[str] = set()  # old-style best tags outranked (logged once)
        self._tier = (WeightsOnlyTier(repo, branch, retention.max_to_keep, retention.full_state_for_last, gc_wait)
                      if retention.full_state_for_last is not None and retention.weights_only else None)

    def restored(self) -> None:
        """After a restore: rank the branch's recent versions at the next save, as at a run's
        first, for a best version a crash left untagged."""
        self._rescan = True

    def retain(self, info: SnapshotInfo) -> bool:
        """After a commit: tag it if it is kept for good, and trim the best tags. The commit has
        happened, so nothing here raises: what fails is logged and tried after the next save.
        True when a gc may run now (every tag a version needs exists)."""
        keep = self.retention.tag_for(info.step, self.branch)
        if keep is not None:
            self._untagged.append((keep, info.id))
        self._untagged += self._best_due(info)
        self._untagged = [(n, sid) for n, sid in self._untagged if not self._tag(n, sid)]
        self._trim_best()
        if self._untagged:  # a gc now could collect a version a missing tag must keep
            log.info("retention: gc put off until %s exist", ", ".join(n for n, _ in self._untagged))
            return False
        # full_state_for_last: the versions past the K newest are copied weights-only first, or
        # the gc (which keeps only the K newest) would delete them whole
        return self._tier is None or self._tier.commit_due(info.id)

    def _best_due(self, info: SnapshotInfo) -> list[tuple[str, str]]:
        """The best tags to create after ``info``'s commit, as (name, snapshot id): its own if it
        ranks among the ``keep_best`` best, and, at the first save of a run or after a restore,
        those of the branch's recent versions that rank so but hold no best tag (a run that
        stopped between a commit and its tag). When the ranking cannot be read ``info`` is
        tagged anyway (if it has the metric): a tag too many is safe, the next trim ranks it."""
        retention = self.retention
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


class GcWorker:
    """The Checkpointer's gc, one at a time, on a thread of its own (or inline without one).

    Why a worker: a gc reads the history and deletes objects, which takes a while on a large
    store, and training must not wait for it; a request while one runs is not lost (the
    running one goes round once more), and :meth:`wait_idle` lets a save or a restore wait
    for it (a commit would only poll for a running gc's lease, a restore must not race it).
    ``keep_last``: the newest versions of ``branch`` kept (every other branch keeps its
    history); None keeps every version and collects only restore residuals and leftovers.
    A gc never raises into the training loop: a refusal or a failure is logged and the next
    save asks again.
    """

    def __init__(self, repo: Repository, branch: str, keep_last: int | None, background: bool,
                 full_state_for_last: int | None = None) -> None:
        self.repo, self.branch, self.keep_last = repo, branch, keep_last
        #: Retention(full_state_for_last=K): the branch keeps its K newest, its weights-only
        #: branch the ``keep_last - K`` newest (the RetentionKeeper copied them there first)
        self.full_state_for_last = full_state_for_last
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="inshrink-gc") if background else None
        self._lock = threading.Lock()
        self._due = self._running = False
        self._idle = threading.Event()
        self._idle.set()
        self.last_report: GcReport | None = None  # the GcReport of the last gc that ran

    def wait_idle(self) -> None:
        """Block until no gc runs or is due."""
        self._idle.wait()

    def request(self) -> None:
        """Ask for a gc: run it now (no thread) or on the worker's thread."""
        with self._lock:
            self._due = True
            if self._running:
                return  # the running loop sees _due and runs once more
            self._running = True
            self._idle.clear()
        if self._pool is None:
            self._loop()
        else:
            self._pool.submit(self._loop)

    def shutdown(self) -> None:
        """Wait for the gc in flight, then stop the thread."""
        if self._pool is not None:
            self._pool.shutdown()

    def _loop(self) -> None:
        finished = False
        try:
            while True:
                with self._lock:  # checked and cleared under one lock: no request is lost
                    if not self._due:
                        self._running, finished = False, True
                        self._idle.set()
                        return
                    self._due = False
                self._collect()
        finally:
            if not finished:  # only on an unexpected exit: never leave saves waiting on _idle
                with self._lock:
                    self._running = False
                    self._idle.set()

    def _collect(self) -> None:
        """One gc keeping this branch's ``keep_last`` newest versions (the Retention's
        ``max_to_keep``; every version kept without retention: it then only collects restore
        residuals and leftovers); never raises into the training loop."""
        keep = self.keep_last
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
        self.last_report = report
        log.info("retention: gc(keep_last=%s) kept %d versions, deleted %d snapshots, freed %d bytes",
                 keep, report.kept_snapshots, len(report.deleted.get("snapshots", [])), report.freed_bytes)

    def _gc_branch(self, keep_last: int) -> Any:
        """``repo.gc(keep_last=keep_last)`` that trims this branch alone (every other branch
        keeps its whole history): the store's gc scoped to the branch. With weights-only tiers
        the branch keeps its ``full_state_for_last`` newest (the older ones are on the
        weights-only branch, committed before this gc was asked for), then a second gc trims
        the weights-only branch to the rest of ``keep_last`` when it holds more."""
        full = self.full_state_for_last
        if full is None or full >= keep_last:
            return self.repo.gc(keep_last, branch=self.branch)
        report = self.repo.gc(full, branch=self.branch)
        tier, rest = tier_branch(self.branch), keep_last - full
        if self.repo.head(tier) is not None and len(self.repo.log(tier, limit=rest + 1)) > rest:
            trimmed = self.repo.gc(rest, branch=tier)
            log.info("retention: gc(keep_last=%d) of %s deleted %d snapshots, freed %d bytes", rest, tier,
                     len(trimmed.deleted.get("snapshots", [])), trimmed.freed_bytes)
        return report
