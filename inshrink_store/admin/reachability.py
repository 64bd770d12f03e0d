"""What the refs keep: the snapshots, trees and objects gc must not delete and verify checks.
Layer: admin, below the facade (which delegates to it) and above the write session."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from inshrink_store import residual
from inshrink_store.errors import InshrinkError
from inshrink_store.index import load_node, load_root
from inshrink_store.parts import StoreParts

Progress = Callable[[str, int, int], None]


@dataclass
class Reachable:
    snapshots: set[str] = field(default_factory=set)
    trees: set[str] = field(default_factory=set)
    objects: dict[str, set[tuple[str, str]]] = field(default_factory=dict)  # oid -> {(snap, tensor)}
    #: restore residual documents kept (their pieces are in ``objects``), with the kept
    #: snapshots that keep each (identical saves share one document)
    residuals: dict[str, set[str]] = field(default_factory=dict)  # residual id -> snapshot ids
    #: refs whose snapshot is missing ("tag best -> 1f2e..."): reported, never fatal
    dangling: list[str] = field(default_factory=list)


def _ref_targets(parts: StoreParts, keep_last: int | None) -> dict[str, str]:
    """Every ref gc must honour, as 'tag NAME' / 'branch NAME' / a ref file path -> snapshot id."""
    targets = {f"tag {name}": sid for name, sid in parts.refs.tags().items()}
    targets.update({f"branch {name}": sid for name, sid in parts.refs.branches().items()})
    if keep_last is None:  # old ref files also name versions (e.g. before a restore)
        targets.update(parts.refs.all_ref_files())
    return targets


def snapshot_closure(parts: StoreParts, keep_last: int | None, dangling: list[str] | None = None) -> set[str]:
    """Snapshots kept: every tag's, and per branch the head's history (its last N if asked);
    without ``keep_last``, also the history of every older ref file of a branch.

    A ref naming a missing snapshot is listed in ``dangling`` (when given) and skipped."""
    kept: set[str] = set()
    heads = {f"branch {name}" for name in parts.refs.branches()}
    for name, sid in _ref_targets(parts, keep_last).items():
        if dangling is not None and not parts.history.exists(sid):
            if name in heads or name.startswith("tag ") or keep_last is None:
                dangling.append(f"{name} -> {sid} (snapshot missing)")
            continue
        limit = keep_last if name in heads else (1 if name.startswith("tag ") else None)
        _walk(parts, sid, kept, limit)
    return kept


def _walk(parts: StoreParts, start: str, kept: set[str], limit: int | None) -> None:
    """Add ``start`` and up to ``limit`` - 1 ancestors to ``kept``.

    ``start`` is always added (a ref naming a missing or corrupt snapshot is a problem
    verify must report); a missing *parent* is history an earlier ``gc(keep_last=...)``
    removed, so the walk ends there instead of naming a snapshot that no longer exists.
    """
    current: str | None = start
    count = 0
    while current is not None and (limit is None or count < limit):
        if limit is None and count and current in kept:
            return  # the rest of this history is already kept
        kept.add(current)
        count += 1
        try:
            parent = parts.history.get(current).parent
        except InshrinkError:
            return
        if parent is not None and not parts.history.exists(parent):
            return
        current = parent


def reachable(parts: StoreParts, keep_last: int | None = None, progress: Progress | None = None) -> Reachable:
    dangling: list[str] = []
    out = Reachable(snapshots=snapshot_closure(parts, keep_last, dangling), dangling=dangling)
    chunks_of: dict[str, list[str]] = {}  # tree id -> its chunk ids: each tree read once a run
    for i, sid in enumerate(sorted(out.snapshots)):
        info = parts.history.get(sid)
        out.trees.add(info.root)
        root = load_root(parts.objects, info.root)
        for path, tid in root.nodes.items():
            out.trees.add(tid)
            if tid not in chunks_of:  # versions share most trees: read storage only for new ones
                chunks_of[tid] = list(load_node(parts.objects, tid).chunks.values())
            for oid in chunks_of[tid]:
                out.objects.setdefault(oid, set()).add((sid, path))
        for path, tree in root.inline.items():  # held by the root tree itself: no file to keep
            for oid in tree.chunks.values():
                out.objects.setdefault(oid, set()).add((sid, path))
        if progress:
            progress(sid, i + 1, len(out.snapshots))
    for rid, sids in kept_residuals(parts, out.snapshots).items():
        out.residuals[rid] = sids
        try:
            arrays = residual.load(parts.storage, rid)
        except InshrinkError:
            continue  # missing or damaged: verify reports it; gc keeps the id and moves on
        for path, array in arrays.items():
            for oid in array.pieces:
                out.objects.setdefault(oid, set()).update((sid, f"residual of {path}") for sid in sids)
    return out


def kept_residuals(parts: StoreParts, kept: set[str]) -> dict[str, set[str]]:
    """Residual id -> the kept versions among the ``keep_newest`` newest of a branch that
    name it (each version says its own ``keep_newest``). A document is kept while any version
    using it is: identical saves share one. Tags keep a version, not its residual."""
    out: dict[str, set[str]] = {}
    for rid, sids in residual.near_heads(parts.history, parts.refs.branches().values()).items():
        if sids & kept:
            out[rid] = sids & kept
    return out


def with_bases(parts: StoreParts, oids: Iterable[str]) -> set[str]:
    """``oids`` and the delta bases each needs (an unreadable one: itself, gc keeps it).

    Why: a delta reads its base, so whatever keeps a delta keeps its base too, even when the
    version that first stored the base is gone."""
    keep: set[str] = set()
    for oid in oids:
        try:
            keep.update(parts.objects.chain(oid))
        except InshrinkError:
            keep.add(oid)
    return keep
