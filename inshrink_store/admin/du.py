"""du: storage per version along a history, each byte counted where first used, and where
every other byte under the store is (:func:`du_summary`).
Layer: admin, below the facade (which delegates to it) and above the write session."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any

from inshrink_store import residual
from inshrink_store.admin.reachability import Reachable, reachable, with_bases
from inshrink_store.errors import FormatError, IntegrityError, NotFoundError
from inshrink_store.layout import (
    OBJECTS,
    SNAPSHOTS,
    classify,
    object_path,
    residual_path,
    snapshot_path,
    tree_path,
)
from inshrink_store.parts import StoreParts
from inshrink_store.residual import ResidualRef


@dataclass
class UsageRow:
    snapshot: str
    step: int | None
    message: str
    logical_bytes: int
    new_stored_bytes: int
    cumulative_stored_bytes: int
    cumulative_logical_bytes: int
    new_objects: int
    delta_objects: int
    #: bytes of the version's restore residual still in the store (0: none, or collected);
    #: part of ``new_stored_bytes`` in a whole-store du (no prefix)
    residual_bytes: int = 0

    @property
    def ratio(self) -> float:
        """This version's logical bytes over the bytes it alone added. Not what the version
        costs: a version that deduplicates against its parent adds a few bytes and reads as
        thousands (12924x on a user's store), so ``du`` shows it nowhere (issue 43)."""
        return self.logical_bytes / self.new_stored_bytes if self.new_stored_bytes else math.inf

    @property
    def cumulative_ratio(self) -> float:
        """The ratio so far: logical bytes of the versions up to this one over their new stored
        bytes (what ``du``'s table shows per row)."""
        c = self.cumulative_stored_bytes
        return self.cumulative_logical_bytes / c if c else math.inf

    def to_dict(self) -> dict[str, Any]:
        """The row as ``du --json`` lists it: its fields and its ratio so far (``ratio``, this
        version alone, is left out for the reason it gives)."""
        d = dict(self.__dict__)
        d["cumulative_ratio"] = _finite(self.cumulative_ratio)
        return d


def _finite(ratio: float) -> float | None:
    """A ratio for JSON: None where nothing was stored (an infinite ratio)."""
    return None if math.isinf(ratio) else ratio


def du(parts: StoreParts, ref: str, prefix: str = "") -> list[UsageRow]:
    """Storage per version along ``ref``'s history, oldest first; bytes are counted where first used.

    ``prefix`` (e.g. ``"model/"``) counts only the tensors under it and no tree objects, so a
    training state's weights and optimizer can be reported apart. What no row counts (delta
    bases of deleted versions, other refs, documents, garbage) is in :func:`du_summary`.
    """
    return _walk(parts, ref, prefix, parts.storage.list("")).rows


@dataclass
class DuSummary:
    """Every byte under the store, each counted once: the parts add up to ``total``.

    Why: the rows of :func:`du` count only what ``ref``'s history uses, so after
    ``gc(keep_last=N)`` the keyframes that kept deltas still need (they belonged to deleted
    versions), other branches' and tags' versions, the documents and what gc has yet to
    collect were nowhere, and du reported less than the store held."""

    ref: str
    #: the rows' ``new_stored_bytes``: snapshot documents, trees, chunks and residuals of
    #: ``ref``'s history
    versions: int
    #: delta bases the rows' deltas need that no row counts (a deleted version's keyframe)
    delta_bases: int
    #: trees, objects and residuals only other branches, tags or older ref files keep
    other_refs: int
    #: snapshot documents of kept versions outside ``ref``'s history, ref files, settings and leases
    metadata: int
    #: what no ref reaches, which the next ``gc`` deletes, and temp files of interrupted writes
    unreferenced: int
    rows: list[UsageRow] = field(default_factory=list, repr=False)
    #: how many versions the store keeps (every branch's history, tags, older ref files: what a
    #: plain gc keeps), and their logical bytes added up (what they hold decoded, each version
    #: in full: the bytes a file per checkpoint would take)
    kept_versions: int = 0
    kept_logical_bytes: int = 0

    @property
    def total(self) -> int:
        return self.versions + self.delta_bases + self.other_refs + self.metadata + self.unreferenced

    @property
    def ratio(self) -> float:
        """The whole store's ratio: logical bytes of every kept version / every byte under the
        store (``total``), so it holds against the bytes on disk. Why not the rows' cumulative
        ratio: it leaves out the delta bases they need, other refs' versions and documents."""
        return self.kept_logical_bytes / self.total if self.total else math.inf

    @property
    def ref_stored(self) -> int:
        """Bytes ``ref``'s versions need: the rows' new stored bytes and their delta bases."""
        return self.versions + self.delta_bases

    @property
    def ref_logical_bytes(self) -> int:
        return sum(r.logical_bytes for r in self.rows)

    @property
    def ref_ratio(self) -> float:
        """``ref``'s ratio: its versions' logical bytes over the bytes they need (their new
        stored bytes and the delta bases no row counts)."""
        return self.ref_logical_bytes / self.ref_stored if self.ref_stored else math.inf

    def to_dict(self) -> dict[str, Any]:
        return {"ref": self.ref, "versions": self.versions, "delta_bases": self.delta_bases,
                "other_refs": self.other_refs, "metadata": self.metadata,
                "unreferenced": self.unreferenced, "total": self.total,
                "kept_versions": self.kept_versions, "kept_logical_bytes": self.kept_logical_bytes,
                "ratio": _finite(self.ratio)}


#: what each ratio of ``du --json`` counts, said in the document itself
COUNTS = {
    "so_far": "logical bytes of the versions up to the newest row / their new stored bytes (each row's "
              "cumulative_ratio, up to it); leaves out delta bases, other refs and documents",
    "ref": "logical bytes of the ref's versions / their new stored bytes and the delta bases they need",
    "store": "logical bytes of every version the store keeps (each in full, as a file per checkpoint) / "
             "every byte under the store (where.total): what holds against the bytes on disk",
}


def usage_document(ref: str, prefix: str, rows: list[UsageRow], summary: DuSummary | None,
                   parts: dict[str, list[UsageRow]] | None = None) -> dict[str, Any]:
    """What ``du --json`` prints: the table's figures, each ratio with the bytes it divides
    and what they count.

    - ``rows``: each version, oldest first (:meth:`UsageRow.to_dict`), with ``{part}_cumulative_ratio``
      for each of ``parts`` (e.g. ``model``, ``optimizer``: that part's rows, the same versions);
    - ``where``: every byte under the store, counted once (None with a ``prefix``: the rows
      then count only the tensors under it);
    - ``ratios``: ``so_far`` (the newest row's), ``ref`` and ``store`` (None with a
      ``prefix``), each ``{logical_bytes, stored_bytes, ratio, counts}``.

    Why: ``du --json`` listed the rows alone, each with its version's own ratio, the figure
    the table dropped as misleading, and had none of the table's store-wide figures."""
    by_part = {name: {r.snapshot: r for r in part_rows} for name, part_rows in (parts or {}).items()}
    listed = [{**r.to_dict(), **{f"{name}_cumulative_ratio": _finite(found[r.snapshot].cumulative_ratio)
                                 for name, found in by_part.items() if r.snapshot in found}} for r in rows]
    last = rows[-1] if rows else None
    ratios: dict[str, Any] = {
        "so_far": _ratio_entry(last.cumulative_logical_bytes if last else 0,
                               last.cumulative_stored_bytes if last else 0, COUNTS["so_far"]),
        "ref": None, "store": None}
    where = None
    if summary is not None:
        where = {key: value for key, value in summary.to_dict().items()
                 if key in ("versions", "delta_bases", "other_refs", "metadata", "unreferenced", "total")}
        ratios["ref"] = {"versions": len(summary.rows),
                         **_ratio_entry(summary.ref_logical_bytes, summary.ref_stored, COUNTS["ref"])}
        ratios["store"] = {"versions": summary.kept_versions,
                           **_ratio_entry(summary.kept_logical_bytes, summary.total, COUNTS["store"])}
    return {"ref": ref, "prefix": prefix, "rows": listed, "where": where, "ratios": ratios}


def _ratio_entry(logical: int, stored: int, counts: str) -> dict[str, Any]:
    return {"logical_bytes": logical, "stored_bytes": stored,
            "ratio": logical / stored if stored else None, "counts": counts}


def du_summary(parts: StoreParts, ref: str) -> DuSummary:
    """:func:`du`'s rows for ``ref`` and where every other byte under the store is."""
    sizes = parts.storage.list("")
    walked = _walk(parts, ref, "", sizes)
    bases = {object_path(oid) for oid in with_bases(parts, walked.deltas, strict=False)} - walked.paths
    kept = reachable(parts, None, strict=False)  # du reports: it goes on where gc would stop
    live = _live_paths(parts, kept)
    totals = dict.fromkeys(("versions", "delta_bases", "other_refs", "metadata", "unreferenced"), 0)
    for path, size in sizes.items():
        totals[_category(path, walked.paths, bases, live)] += size
    totals["unreferenced"] += sum(size for size, _mtime in parts.storage.temp_files().values())
    return DuSummary(ref, rows=walked.rows, **totals, kept_versions=len(kept.snapshots),
                     kept_logical_bytes=_logical_bytes(parts, kept.snapshots, walked.rows))


def _logical_bytes(parts: StoreParts, snapshots: set[str], rows: list[UsageRow]) -> int:
    """The logical bytes of ``snapshots`` added up (the rows' versions are already read)."""
    known = {r.snapshot: r.logical_bytes for r in rows}
    total = 0
    for sid in sorted(snapshots):
        if sid in known:
            total += known[sid]
            continue
        with contextlib.suppress(IntegrityError, NotFoundError, FormatError):
            total += sum(a.logical_bytes for a in parts.reader(parts.history.get(sid)).arrays().values())
    return total


def _category(path: str, counted: set[str], bases: set[str], live: set[str]) -> str:
    """Which :class:`DuSummary` field the file at ``path`` belongs to (the first that fits)."""
    if path in counted:
        return "versions"
    if path in bases:
        return "delta_bases"
    found = classify(path)
    if found is None:  # refs, settings, leases
        return "metadata"
    if path not in live:
        return "unreferenced"
    return "metadata" if found[0] == SNAPSHOTS else "other_refs"


def _live_paths(parts: StoreParts, live: Reachable) -> set[str]:
    """The paths a plain gc keeps: what any ref reaches, delta bases and kept residuals included."""
    return ({snapshot_path(sid) for sid in live.snapshots} | {tree_path(tid) for tid in live.trees}
            | {residual_path(rid) for rid in live.residuals}
            | {object_path(oid) for oid in with_bases(parts, live.objects, strict=False)})


@dataclass
class _Walked:
    rows: list[UsageRow]
    paths: set[str]  # every path a row counted
    deltas: set[str]  # the delta objects among them, whose bases a row may not count


def _walk(parts: StoreParts, ref: str, prefix: str, sizes: dict[str, int]) -> _Walked:
    history = list(reversed(parts.history.walk(parts.resolve(ref))))
    seen: set[str] = set()
    delta_ids: set[str] = set()
    rows: list[UsageRow] = []
    cumulative = cumulative_logical = 0
    for info in history:
        reader = parts.reader(info)
        new_bytes = new_objects = deltas = 0
        # the version's documents: its snapshot (the Checkpointer's records: 1-2 KB) and trees
        for path in [snapshot_path(info.id), *(tree_path(t) for t in [info.root, *reader.index.root.nodes.values()])]:
            if path not in seen and not prefix:
                seen.add(path)
                new_bytes += sizes.get(path, 0)
        arrays = [a for p, a in reader.arrays().items() if p.startswith(prefix)]
        for array in arrays:
            for oid in array.chunk_ids.values():
                path = object_path(oid)
                if path in seen:
                    continue
                seen.add(path)
                new_objects += 1
                new_bytes += sizes.get(path, 0)
                with contextlib.suppress(IntegrityError, NotFoundError):
                    if parts.objects.header(oid).is_delta:
                        deltas += 1
                        delta_ids.add(oid)
        residual_bytes = 0 if prefix else _residual_bytes(parts, info, sizes, seen)
        new_bytes += residual_bytes
        logical = sum(a.logical_bytes for a in arrays)
        cumulative += new_bytes
        cumulative_logical += logical
        rows.append(UsageRow(info.id, info.step, info.message, logical, new_bytes, cumulative,
                             cumulative_logical, new_objects, deltas, residual_bytes))
    return _Walked(rows, seen, delta_ids)


def _residual_bytes(parts: StoreParts, info: Any, sizes: dict[str, int], seen: set[str]) -> int:
    """Bytes of ``info``'s restore residual (document and pieces not counted before) while it
    is in the store; 0 when it has none or gc collected it."""
    try:
        ref = ResidualRef.from_metadata(info.metadata, info.id)
        if ref is None or residual_path(ref.id) not in sizes:
            return 0
        arrays = residual.load(parts.storage, ref.id)
    except (IntegrityError, NotFoundError, FormatError):
        return 0
    if residual_path(ref.id) in seen:  # a document two versions share counts once
        return 0
    seen.add(residual_path(ref.id))
    total = sizes[residual_path(ref.id)]
    for array in arrays.values():
        for oid in array.pieces:
            if object_path(oid) not in seen:
                seen.add(object_path(oid))
                total += sizes.get(object_path(oid), 0)
    return total


def stored_bytes(parts: StoreParts, ref: str) -> dict[str, int]:
    """Tensor path -> bytes its chunk objects take in the store (an object shared by two
    tensors counts for each; a delta counts its own bytes, not its base's)."""
    reader = parts.checkout(ref)
    sizes = parts.storage.list(OBJECTS)
    return {path: sum(sizes.get(object_path(o), 0) for o in set(info.chunk_ids.values()))
            for path, info in sorted(reader.arrays().items())}
