"""torch layer: weights-only tiers, the versions of a Checkpointer's branch kept with their
model but not their optimizer state (``Retention(max_to_keep=N, full_state_for_last=K)``).

What is dropped: the ``optimizer`` entry of the saved state, every array under
``optimizer/`` (the Adam moments, the step counters, the parameter groups' tensors), its part
of the root group's skeleton and the parameter names that only name optimizer state, and
the version records that describe it (``metadata["moments"]``, and ``metadata["residual"]``:
an exact *resume* needs the optimizer, and the residual lists optimizer tensors). Everything
that loads the model stays: every array under ``model/``, the ``extra/`` state (scheduler,
RNG, epoch: a few bytes, and a Checkpointer given the same ``extra_state`` restores them),
any other part of the state, the quantization and probe records, step, metrics and message.
A version whose saved state has an alias from a kept tensor into the optimizer's keeps that
array (nothing a kept part needs is dropped).

How, and why nothing is lost: a version V that falls out of the K newest of branch B, while
still among the N newest and held by no tag, is committed again as an ordinary commit on
branch ``B.weights-only`` (:func:`tier_branch`) from V's own stored nodes: each array's
zarr.json and chunk object ids are taken as they are, nothing is read or encoded, so the
weights' bytes and objects are V's (deduplicated, never copied). Only after that commit does
the retention's gc run, keeping the K newest versions of B (and every tag) and the N - K
newest of ``B.weights-only``; it then deletes V with the optimizer objects no kept version
reaches. A crash before the commit leaves V whole (the gc runs only after every due
version is committed; the next save commits it); a crash after leaves both until the next
gc. The commit reads V under its writer lease: V's snapshot is there, so every tree and
object it names is (gc deletes top-down, and none sweeps while a writer lease is held).
docs/reference/format.md ("Weights-only tiers") states the argument.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from inshrink_store.errors import InvalidInputError, NotFoundError
from inshrink_store.structure import METADATA_KEY, PARAM_NAMES_ATTR, STRUCTURE_ATTR

if TYPE_CHECKING:
    from inshrink_store.repository import Repository, SnapshotInfo, WriteSession

#: the Checkpointer's logger: retention's lines (tiers included) are filtered by that name
log = logging.getLogger("inshrink_store.torch.checkpointer")

__all__ = ["DROPPED_METADATA", "DROPPED_STATE", "META_KEY", "WeightsOnlyTier", "refuse_dropped",
           "tier_branch", "weights_only_record", "write_weights_only"]

#: the version metadata key of a weights-only version's record
META_KEY = "weights_only"
#: the parts of the saved state a weights-only version leaves out (top-level state keys)
DROPPED_STATE = ("optimizer",)
#: the version records that describe what was dropped, left out with it
DROPPED_METADATA = ("moments", "residual")
_SUFFIX = ".weights-only"


def tier_branch(branch: str) -> str:
    """``<branch>.weights-only``: the branch holding ``branch``'s weights-only versions."""
    return branch[: 128 - len(_SUFFIX)].rstrip(".") + _SUFFIX


def weights_only_record(info: SnapshotInfo) -> dict[str, Any] | None:
    """The ``weights_only`` record of a version (None: it keeps its whole state)."""
    record = info.metadata.get(META_KEY)
    return dict(record) if isinstance(record, Mapping) else None


def refuse_dropped(info: SnapshotInfo, part: str, ref: str | None = None) -> None:
    """NotFoundError when ``part`` (``"optimizer"``, ``"optimizer/state"``...) is state that
    version ``info`` dropped as a weights-only version, naming why and the model-only restore."""
    record = weights_only_record(info)
    if record is None or not isinstance(part, str):  # a bad prefix: load_state says what is wrong with it
        return
    top = part.strip("/").split("/", 1)[0]
    if top not in record.get("dropped", []):
        return
    shown = repr(ref if ref is not None else info.id)
    full = record.get("full_state_for_last")
    branch = record.get("branch")
    raise NotFoundError(
        f"Expected version {info.id[:12]} (step {info.step}) to hold its {top} state. Got a weights-only "
        f"version instead: Retention(full_state_for_last={full}) dropped its {top} state when it fell out of "
        f"the {full} newest versions of branch {branch!r} (it keeps the weights of {str(record.get('of'))[:12]}). "
        f"Restore the model alone: Checkpointer(repo, model).restore({shown}) (no optimizer), or "
        f"model.load_state_dict(load_state(repo, {shown}, prefix='model')); to resume training with the "
        f"optimizer, restore one of the {full} newest versions of {branch!r}.")


def _without_dropped(attributes: Mapping[str, Any], dropped: set[str]) -> dict[str, Any]:
    """The root group's attributes without the dropped parts of the skeleton, and without the
    parameter names when the optimizer (the only state they name) goes."""
    out = dict(attributes)
    skeleton = out.get(STRUCTURE_ATTR)
    if isinstance(skeleton, dict) and isinstance(skeleton.get("__dict__"), list):
        out[STRUCTURE_ATTR] = {**skeleton, "__dict__": [pair for pair in skeleton["__dict__"]
                                                        if not (isinstance(pair, list) and pair and
                                                                pair[0] in dropped)]}
    if "optimizer" in dropped:
        out.pop(PARAM_NAMES_ATTR, None)
    return out


def _needed(node: Any, found: set[str]) -> set[str]:
    """Every array path a skeleton node names (its arrays and aliases)."""
    if isinstance(node, dict):
        for key in ("__array__", "__alias__"):
            if isinstance(node.get(key), str):
                found.add(node[key])
        for value in node.values():
            _needed(value, found)
    elif isinstance(node, list):
        for value in node:
            _needed(value, found)
    return found


def _stage(tx: WriteSession, source: Any, dropped: set[str]) -> tuple[list[str], int]:
    """Stage ``source``'s nodes (a SnapshotReader) into ``tx`` without the dropped parts:
    groups with their attributes (the root's without the dropped skeleton), then arrays as
    their zarr.json and chunk ids. Returns (dropped parts present, arrays dropped)."""
    attributes = _without_dropped(source.attributes, dropped)
    keep = _needed(attributes.get(STRUCTURE_ATTR), set())
    arrays = source.arrays()

    def gone(path: str) -> bool:
        return path.split("/", 1)[0] in dropped and path not in keep

    present = sorted({p.split("/", 1)[0] for p in arrays if gone(p)})
    tx.stage_group("", attributes)
    groups = sorted(key[: -len(METADATA_KEY) - 1] for key in source.view.keys()
                    if key.endswith("/" + METADATA_KEY) and key[: -len(METADATA_KEY) - 1] not in arrays)
    for path in groups:
        if not gone(path):
            doc = json.loads(source.view.get(f"{path}/{METADATA_KEY}") or b"{}")
            tx.stage_group(path, doc.get("attributes") or {})
    kept = 0
    for path, info in sorted(arrays.items()):
        if gone(path):
            continue
        metadata = source.view.get(f"{path}/{METADATA_KEY}")
        assert metadata is not None
        tx.stage_array(path, metadata, info.chunk_ids, check_stored=False)  # V is committed: see the module
        kept += 1
    return present, len(arrays) - kept


def write_weights_only(repo: Repository, info: SnapshotInfo, branch: str, full_state_for_last: int, *,
                       gc_wait: float, dropped: tuple[str, ...] = DROPPED_STATE) -> SnapshotInfo | None:
    """Commit version ``info`` of ``branch`` again without its ``dropped`` state, as the next
    version of :func:`tier_branch` (``branch``); returns it, or None when ``info`` is gone
    already (another gc collected it: nothing left to keep)."""
    if not full_state_for_last >= 1:
        raise InvalidInputError(f"Expected full_state_for_last >= 1. Got {full_state_for_last!r} instead.")
    with repo.transaction(tier_branch(branch), inherit=False, gc_wait=gc_wait) as tx:
        try:  # under the writer lease: V is there, so is everything it names (no gc sweeps now)
            source = repo.checkout(info.id)
        except NotFoundError:
            return None
        present, count = _stage(tx, source, set(dropped))
        record = {"version": 1, "of": info.id, "of_parent": info.parent, "of_time": info.time, "branch": branch,
                  "full_state_for_last": full_state_for_last, "dropped": present, "dropped_arrays": count,
                  "dropped_metadata": sorted(k for k in DROPPED_METADATA if k in info.metadata)}
        metadata = {k: v for k, v in info.metadata.items() if k not in DROPPED_METADATA and k != META_KEY}
        return tx.commit(message=info.message, step=info.step, metrics=info.metrics,
                         metadata={**metadata, META_KEY: record})


class WeightsOnlyTier:
    """The weights-only versions a :class:`~inshrink_store.torch.Retention` with
    ``full_state_for_last`` asks for, committed after each save before its gc may run.

    Why a class: it remembers nothing between saves but the settings; the store says what is
    due (the branch's versions past the K newest, among the N newest, held by no tag, whose
    weights-only copy the tier branch's newest N do not already hold), so a run that crashed
    between a commit and its copy makes the copy at its next save."""

    def __init__(self, repo: Repository, branch: str, max_to_keep: int, full_state_for_last: int,
                 gc_wait: float) -> None:
        self.repo, self.branch, self.gc_wait = repo, branch, gc_wait
        self.max_to_keep, self.full_state_for_last = max_to_keep, full_state_for_last

    def due(self, head: str) -> list[SnapshotInfo]:
        """The versions of the branch to commit weights-only now, oldest first."""
        versions = self.repo.log(head, limit=self.max_to_keep)[self.full_state_for_last:]
        if not versions:
            return []
        tagged = set(self.repo.tags().values())
        tier = tier_branch(self.branch)
        done: set[str] = set()
        if self.repo.head(tier) is not None:
            for copy in self.repo.log(tier, limit=self.max_to_keep):
                record = weights_only_record(copy)
                if record is not None:
                    done.add(str(record.get("of")))
        return [v for v in reversed(versions)
                if v.id not in tagged and v.id not in done and weights_only_record(v) is None]

    def commit_due(self, head: str) -> bool:
        """Commit every due version weights-only; True when all are (a gc may run), False
        after logging what failed (the gc waits: it would delete a version not yet copied)."""
        try:
            for info in self.due(head):
                copy = write_weights_only(self.repo, info, self.branch, self.full_state_for_last,
                                          gc_wait=self.gc_wait)
                if copy is not None:
                    log.info("retention: %s (step %s) kept weights-only as %s on %s (full_state_for_last=%d)",
                             info.id[:12], info.step, copy.id[:12], tier_branch(self.branch),
                             self.full_state_for_last)
        except Exception as exc:  # never into the loop: the gc waits and the next save tries again
            log.warning("retention: could not keep a version weights-only (%r); gc put off to the next save", exc)
            return False
        return True
