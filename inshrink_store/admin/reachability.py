"""What the refs keep: the snapshots, trees and objects gc must not delete and verify checks.
Layer: admin, below the facade (which delegates to it) and above the write session.

gc fails closed (docs/reference/format.md, "gc fails closed"): with ``strict`` (gc's mode, the
default) any error reading what decides what to keep (a ref, a snapshot, a tree, an object
header, a residual document) stops the mark with an error naming what could not be read, so
gc deletes nothing. Only a confirmed absence (``NotFoundError``, the storage layer's
``FileNotFoundError``) shortens a walk, and only where the format allows one: a missing
*parent* (history an earlier ``gc(keep_last=...)`` removed), a ref naming a missing snapshot
(reported as dangling), a collected restore residual. verify and du, which only report, pass
``strict=False`` and go on past what they cannot read.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from inshrink_store import residual
from inshrink_store.errors import (
    FormatError,
    InshrinkError,
    IntegrityError,
    NotFoundError,
    StorageError,
)
from inshrink_store.history import SnapshotInfo
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


def unreadable(what: str, exc: BaseException) -> InshrinkError:
    """The error gc stops with when it cannot read ``what`` while deciding what to keep: of
    the cause's kind (a ``StorageError`` for a backend failure, an ``IntegrityError`` for
    damaged bytes, a ``NotFoundError`` for something missing that must exist), naming
    ``what`` and saying that nothing was deleted."""
    message = (f"Expected gc to read {what} to know what to keep. Got {type(exc).__name__}: {exc} instead; "
               "gc stopped and deleted nothing. Run gc again (a storage error is often transient); if "
               "it fails again, run `inshrink verify`.")
    kind: type[InshrinkError] = (type(exc) if isinstance(exc, InshrinkError) else
                                 NotFoundError if isinstance(exc, FileNotFoundError) else StorageError)
    try:
        return kind(message)
    except Exception:  # noqa: BLE001 - a subclass whose constructor takes more than a message
        return StorageError(message)


@contextlib.contextmanager
def reading(what: str, strict: bool = True) -> Iterator[None]:
    """With ``strict``, any error reading ``what`` becomes :func:`unreadable`'s; without,
    errors pass through unchanged (a reporter decides what to do with them)."""
    try:
        yield
    except MemoryError:
        raise
    except Exception as exc:
        if not strict:
            raise
        raise unreadable(what, exc) from exc


def _ref_targets(parts: StoreParts, keep_last: int | None, strict: bool = True) -> dict[str, str]:
    """Every ref gc must honour, as 'tag NAME' / 'branch NAME' / a ref file path -> snapshot id."""
    with reading("the refs (tags and branch ref files)", strict):
        targets = {f"tag {name}": sid for name, sid in parts.refs.tags().items()}
        targets.update({f"branch {name}": sid for name, sid in parts.refs.branches().items()})
        if keep_last is None:  # old ref files also name versions (e.g. before a restore)
            targets.update(parts.refs.all_ref_files())
    return targets


def snapshot_closure(parts: StoreParts, keep_last: int | None, dangling: list[str] | None = None, *,
                     strict: bool = True, infos: dict[str, SnapshotInfo] | None = None) -> set[str]:
    """Snapshots kept: every tag's, and per branch the head's history (its last N if asked);
    without ``keep_last``, also the history of every older ref file of a branch.

    A ref naming a missing snapshot is listed in ``dangling`` (when given) and skipped;
    without ``dangling`` it is kept, for verify to report. ``infos`` (when given) receives
    every snapshot read, so a caller reads each once. ``strict``: see the module docstring."""
    kept: set[str] = set()
    read: dict[str, SnapshotInfo] = {} if infos is None else infos
    for name, sid in _ref_targets(parts, keep_last, strict).items():
        limit = keep_last if name.startswith("branch ") else (1 if name.startswith("tag ") else None)
        if not _walk(parts, name, sid, kept, limit, strict, read):
            if dangling is not None:
                dangling.append(f"{name} -> {sid} (snapshot missing)")
            else:
                kept.add(sid)
    return kept


def _walk(parts: StoreParts, name: str, start: str, kept: set[str], limit: int | None, strict: bool,
          infos: dict[str, SnapshotInfo]) -> bool:
    """Add ``start`` and up to ``limit`` - 1 ancestors to ``kept``; False (nothing added)
    when ``start`` itself does not exist (a dangling ref ``name``).

    A missing *parent* is history an earlier ``gc(keep_last=...)`` removed: the walk ends
    there. That is the only end besides the first version and ``limit``: absence is what a
    read says (``NotFoundError``), never an ``exists`` that answers False on any failure. Any
    other error reading a snapshot stops gc (``strict``); a reporter keeps the snapshot (verify
    reads it again and reports why) and ends this walk.
    """
    current: str | None = start
    count = 0
    while current is not None and (limit is None or count < limit):
        if limit is None and count and current in kept:
            return True  # the rest of this history is already kept
        try:
            info = infos[current] if current in infos else parts.history.get(current)
        except NotFoundError:
            return count > 0  # a missing parent ends the history; a missing start is dangling
        except MemoryError:
            raise
        except Exception as exc:
            if strict:
                raise unreadable(f"snapshot {current} (in the history of {name})", exc) from exc
            kept.add(current)
            return True
        infos[current] = info
        kept.add(current)
        count += 1
        current = info.parent
    return True


def reachable(parts: StoreParts, keep_last: int | None = None, progress: Progress | None = None, *,
              strict: bool = True) -> Reachable:
    """Everything the refs keep (see :func:`snapshot_closure`): snapshots, trees, objects and
    restore residuals. ``strict`` (gc): any error reading what decides that stops it with an
    error naming what (see the module docstring)."""
    dangling: list[str] = []
    infos: dict[str, SnapshotInfo] = {}
    out = Reachable(snapshots=snapshot_closure(parts, keep_last, dangling, strict=strict, infos=infos),
                    dangling=dangling)
    chunks_of: dict[str, list[str]] = {}  # tree id -> its chunk ids: each tree read once a run
    for i, sid in enumerate(sorted(out.snapshots)):
        info = infos[sid] if sid in infos else parts.history.get(sid)
        out.trees.add(info.root)
        with reading(f"root tree {info.root} of snapshot {sid}", strict):
            root = load_root(parts.objects, info.root)
        for path, tid in root.nodes.items():
            out.trees.add(tid)
            if tid not in chunks_of:  # versions share most trees: read storage only for new ones
                with reading(f"tree {tid} ({path!r} of snapshot {sid})", strict):
                    chunks_of[tid] = list(load_node(parts.objects, tid).chunks.values())
            for oid in chunks_of[tid]:
                out.objects.setdefault(oid, set()).add((sid, path))
        for path, tree in root.inline.items():  # held by the root tree itself: no file to keep
            for oid in tree.chunks.values():
                out.objects.setdefault(oid, set()).add((sid, path))
        if progress:
            progress(sid, i + 1, len(out.snapshots))
    for rid, sids in kept_residuals(parts, out.snapshots, strict=strict).items():
        out.residuals[rid] = sids
        arrays = load_kept_residual(parts, rid, sids, strict)
        for path, array in (arrays or {}).items():
            for oid in array.pieces:
                out.objects.setdefault(oid, set()).update((sid, f"residual of {path}") for sid in sids)
    return out


def load_kept_residual(parts: StoreParts, rid: str, sids: Iterable[str],
                       strict: bool = True) -> dict[str, residual.ResidualArray] | None:
    """Kept residual document ``rid``, or None when it is gone: a version's residual may be
    collected (it fell out of the newest of a branch) and stays so if the version later
    becomes a branch head; reads then return the stored values. Any other error stops gc
    (``strict``); a reporter gets None (verify reads it again and reports why)."""
    try:
        return residual.load(parts.storage, rid)
    except NotFoundError:
        return None
    except MemoryError:
        raise
    except Exception as exc:
        if strict:
            names = ", ".join(sorted(sids))
            raise unreadable(f"restore residual {rid} (kept by snapshot {names})", exc) from exc
        return None


def residuals_near_heads(parts: StoreParts, strict: bool = True,
                         kept: set[str] | None = None) -> dict[str, set[str]]:
    """Residual id -> the versions among the ``keep_newest`` newest of a branch that name it
    (:func:`inshrink_store.residual.near_heads`). ``strict`` (gc): an error reading a branch
    head or a snapshot stops gc, except a damaged snapshot that gc does not keep (not in
    ``kept``, when given): it is deleted, and no walk reaches past it anyway."""
    with reading("the branch heads", strict):
        heads = list(parts.refs.branches().values())

    def on_error(sid: str, exc: Exception) -> None:
        if kept is not None and sid not in kept and isinstance(exc, (IntegrityError, FormatError)):
            return
        raise unreadable(f"snapshot {sid} (near a branch head, for its restore residual)", exc) from exc

    return residual.near_heads(parts.history, heads, on_error if strict else None)


def kept_residuals(parts: StoreParts, kept: set[str], *, strict: bool = True) -> dict[str, set[str]]:
    """Residual id -> the kept versions among the ``keep_newest`` newest of a branch that
    name it (each version says its own ``keep_newest``). A document is kept while any version
    using it is: identical saves share one. Tags keep a version, not its residual."""
    out: dict[str, set[str]] = {}
    for rid, sids in residuals_near_heads(parts, strict, kept).items():
        if sids & kept:
            out[rid] = sids & kept
    return out


def with_bases(parts: StoreParts, oids: Iterable[str], *, strict: bool = True) -> set[str]:
    """``oids`` and the delta bases each needs, every header read once a run.

    Why: a delta reads its base, so whatever keeps a delta keeps its base too, even when the
    version that first stored the base is gone. ``strict`` (gc): a header that cannot be read
    stops gc, whatever the error, a missing object included (a kept object must exist; a
    transient error once read as "keep this object alone" and deleted a kept delta's base).
    A reporter (du) keeps what it reached and goes on."""
    keep: set[str] = set()
    for oid in oids:
        current: str | None = oid
        while current is not None and current not in keep:  # a loop ends too: all of it is kept
            try:
                base = parts.objects.header(current).base
            except MemoryError:
                raise
            except Exception as exc:
                if not strict:
                    keep.add(current)
                    break
                what = "kept object" if current == oid else f"delta base (of kept object {oid})"
                raise unreadable(f"the header of {what} {current}", exc) from exc
            keep.add(current)
            current = base
    return keep
