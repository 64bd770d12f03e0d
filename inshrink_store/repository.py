"""Repository: versions of a training state over one fsspec URL.

Commit writes objects, then trees, then the snapshot, then creates the next
branch ref file exclusively. A crash anywhere leaves the previous version intact
and nothing half-visible; a lost race is a :class:`ConflictError` and nothing is
lost. Reading resolves a ref to a snapshot and serves it as a plain zarr store.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from inshrink_store import arrays as _arrays
from inshrink_store import leases, maintenance
from inshrink_store.cas import DEFAULT_KEYFRAME_INTERVAL, ObjectStore
from inshrink_store.errors import ConflictError, FormatError, NotFoundError
from inshrink_store.manifest import FORMAT_VERSION, Snapshot, canonical_json, utc_now
from inshrink_store.refs import (
    branch_ref_path,
    check_name,
    parse_branch_listing,
    parse_expression,
    tag_path,
)
from inshrink_store.storage import Storage
from inshrink_store.zarr_store import (
    InshrinkStore,
    PendingChunks,
    SnapshotChunks,
    tree_path,
)

CONFIG_FILE = "inshrink.json"
DEFAULT_BRANCH = "main"
Progress = Callable[[str, int, int], None]


def snapshot_path(snapshot_id: str) -> str:
    return f"snapshots/{snapshot_id}"


@dataclass(frozen=True)
class SnapshotInfo:
    """A committed version as ``log`` shows it."""

    id: str
    parent: str | None
    time: str
    message: str
    step: int | None
    metrics: Mapping[str, float]
    metadata: Mapping[str, Any]
    root: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id, "parent": self.parent, "time": self.time, "message": self.message,
            "step": self.step, "metrics": dict(self.metrics), "metadata": dict(self.metadata),
        }


class Planner(Protocol):
    """What ``save(quantize=...)`` needs; the policy layer implements it (dependency points down)."""

    def plan(
        self,
        tensors: Mapping[str, np.ndarray],
        dtypes: Mapping[str, str],
        previous: Mapping[str, dict[str, Any]],
    ) -> Mapping[str, _arrays.ArrayPlan]: ...


def open(  # noqa: A001 - mirrors zarr.open / fsspec.open
    url: str,
    *,
    create: bool = False,
    storage_options: dict[str, Any] | None = None,
    keyframe_interval: int | None = None,
) -> Repository:
    """Open the store at ``url`` (a path, file://, memory://, s3://, gs://)."""
    storage = Storage(url, storage_options)
    if not storage.exists(CONFIG_FILE):
        if not create:
            storage.require_exists(CONFIG_FILE)
        return init(url, storage_options=storage_options, keyframe_interval=keyframe_interval, exist_ok=True)
    return Repository(storage, keyframe_interval=keyframe_interval)


def init(
    url: str,
    *,
    storage_options: dict[str, Any] | None = None,
    keyframe_interval: int | None = None,
    exist_ok: bool = False,
) -> Repository:
    """Create an empty store at ``url``; an existing store is an error unless ``exist_ok``."""
    storage = Storage(url, storage_options)
    settings = {
        "format": FORMAT_VERSION,
        "created": utc_now(),
        "keyframe_interval": keyframe_interval or DEFAULT_KEYFRAME_INTERVAL,
    }
    try:
        storage.create_exclusive(CONFIG_FILE, canonical_json(settings))
    except FileExistsError:
        if not exist_ok:
            raise FormatError(
                f"Expected no store at {url!r}. Got an existing inshrink store instead; "
                "open it with inshrink_store.open(url)."
            ) from None
    return Repository(storage, keyframe_interval=keyframe_interval)


class Repository:
    """Refs, history and versions of one store. Cheap to create; holds no open files."""

    def __init__(self, storage: Storage, keyframe_interval: int | None = None) -> None:
        self.storage = storage
        raw = storage.read(CONFIG_FILE)
        self.settings = json.loads(raw)
        if self.settings.get("format") != FORMAT_VERSION:
            raise FormatError(
                f"Expected store format {FORMAT_VERSION}. Got {self.settings.get('format')!r} "
                "instead; upgrade inshrink-store to read this store."
            )
        interval = keyframe_interval or self.settings.get("keyframe_interval", DEFAULT_KEYFRAME_INTERVAL)
        self.objects = ObjectStore(storage, keyframe_interval=int(interval))

    @property
    def url(self) -> str:
        return self.storage.url

    def __repr__(self) -> str:
        return f"Repository({self.url!r})"

    # -- refs ------------------------------------------------------------------------
    def _branch_seqs(self) -> dict[str, list[int]]:
        return parse_branch_listing(list(self.storage.list("refs/branches")))

    def _read_ref(self, path: str) -> str:
        return self.storage.read(path).decode().strip()

    def _head(self, branch: str) -> tuple[int, str] | None:
        seqs = self._branch_seqs().get(branch)
        if not seqs:
            return None
        return seqs[-1], self._read_ref(branch_ref_path(branch, seqs[-1]))

    def branches(self) -> dict[str, str]:
        """Branch name -> head snapshot id."""
        return {b: self._read_ref(branch_ref_path(b, s[-1])) for b, s in self._branch_seqs().items()}

    def tags(self) -> dict[str, str]:
        return {p.split("/", 2)[2]: self._read_ref(p) for p in self.storage.list("refs/tags")}

    def tag(self, name: str, ref: str = DEFAULT_BRANCH) -> str:
        """Create a write-once tag; an existing tag is a :class:`ConflictError`."""
        check_name(name, "tag")
        snapshot_id = self.resolve(ref)
        try:
            self.storage.create_exclusive(tag_path(name), snapshot_id.encode())
        except FileExistsError:
            raise ConflictError(
                f"Expected tag {name!r} not to exist. Got an existing tag instead "
                f"(-> {self._read_ref(tag_path(name))}); tags are write-once, pick another name."
            ) from None
        return snapshot_id

    def create_branch(self, name: str, ref: str = DEFAULT_BRANCH) -> str:
        check_name(name, "branch")
        snapshot_id = self.resolve(ref)
        if name in self._branch_seqs():
            raise ConflictError(f"Expected branch {name!r} not to exist. Got an existing branch instead.")
        self._advance(name, 0, snapshot_id)
        return snapshot_id

    def _advance(self, branch: str, seq: int, snapshot_id: str) -> None:
        try:
            self.storage.create_exclusive(branch_ref_path(branch, seq), snapshot_id.encode())
        except FileExistsError:
            raise ConflictError(
                f"Expected to advance branch {branch!r} to version #{seq}. Got a version #{seq} "
                "committed by another writer first instead; nothing was lost: open the new head "
                "and retry (or commit with rebase=True)."
            ) from None

    def snapshot_ids(self) -> list[str]:
        return sorted(p.split("/", 1)[1] for p in self.storage.list("snapshots"))

    def resolve(self, ref: str) -> str:
        """Branch, tag, snapshot id or unique id prefix, with ``~N`` / ``^`` suffixes."""
        base, back = parse_expression(ref)
        snapshot_id = self._resolve_base(base)
        for i in range(back):
            parent = self.snapshot(snapshot_id).parent
            if parent is None:
                raise NotFoundError(
                    f"Expected {ref!r} to name a version. Got a history only {i} versions deep "
                    f"before {base!r} instead."
                )
            snapshot_id = parent
        if back:
            self.snapshot(snapshot_id)  # gc may have cut history here: NotFoundError, not a dangling id
        return snapshot_id

    def _resolve_base(self, base: str) -> str:
        head = self._head(base) if _maybe_name(base) else None
        if head is not None:
            return head[1]
        if _maybe_name(base) and self.storage.exists(tag_path(base)):
            return self._read_ref(tag_path(base))
        if all(c in "0123456789abcdef" for c in base) and len(base) >= 4:
            if len(base) == 32 and self.storage.exists(snapshot_path(base)):
                return base
            matches = [s for s in self.snapshot_ids() if s.startswith(base)]
            if len(matches) == 1:
                return matches[0]
            if len(matches) > 1:
                raise FormatError(
                    f"Expected a unique snapshot id prefix. Got {base!r}, which matches "
                    f"{len(matches)} snapshots instead; give more digits."
                )
        known = ", ".join(sorted(self._branch_seqs())) or "none"
        raise NotFoundError(
            f"Expected a branch, tag or snapshot id in {self.url!r}. Got {base!r} instead "
            f"(branches: {known}; see `inshrink log`)."
        )

    # -- history -----------------------------------------------------------------------
    def snapshot(self, snapshot_id: str) -> SnapshotInfo:
        try:
            raw = self.storage.read(snapshot_path(snapshot_id))
        except FileNotFoundError:
            raise NotFoundError(
                f"Expected snapshot {snapshot_id} in {self.url!r}. Got nothing instead "
                "(removed by gc, or never committed)."
            ) from None
        snap = Snapshot.from_bytes(raw, snapshot_id)
        return SnapshotInfo(
            snapshot_id, snap.parent, snap.time, snap.message, snap.step,
            snap.metrics, snap.metadata, snap.root,
        )

    def log(self, ref: str = DEFAULT_BRANCH, limit: int | None = None) -> list[SnapshotInfo]:
        """Newest first, following parents until the first version (or what gc kept)."""
        out: list[SnapshotInfo] = []
        current: str | None = self.resolve(ref)
        while current is not None and (limit is None or len(out) < limit):
            try:
                info = self.snapshot(current)
            except NotFoundError:
                if not out:
                    raise
                break
            out.append(info)
            current = info.parent
        return out

    # -- reading ---------------------------------------------------------------------
    def checkout(self, ref: str = DEFAULT_BRANCH) -> _arrays.SnapshotReader:
        snapshot_id = self.resolve(ref)
        info = self.snapshot(snapshot_id)
        return _arrays.SnapshotReader(info, SnapshotChunks(self.objects, info.root, snapshot_id))

    def snapshot_store(self, ref: str = DEFAULT_BRANCH) -> InshrinkStore:
        """A read-only zarr Store of one version: ``zarr.open_group(store=...)`` just works."""
        return self.checkout(ref).store

    def load(self, ref: str = DEFAULT_BRANCH) -> dict[str, np.ndarray]:
        return self.checkout(ref).load()

    # -- writing ---------------------------------------------------------------------
    def transaction(
        self, branch: str = DEFAULT_BRANCH, *, parent: str | None = None, inherit: bool = True
    ) -> Transaction:
        """One write session. ``parent`` (a ref) defaults to the branch head; ``inherit=False``
        starts empty (a full new state) while still delta-coding against the parent."""
        check_name(branch, "branch")
        head = self._head(branch)
        parent_id = self.resolve(parent) if parent is not None else (head[1] if head else None)
        view = None
        if parent_id is not None:
            view = SnapshotChunks(self.objects, self.snapshot(parent_id).root, parent_id)
        return Transaction(self, branch, head[0] if head else -1, parent_id, view, inherit)

    def save(
        self,
        tensors: Mapping[str, np.ndarray],
        *,
        branch: str = DEFAULT_BRANCH,
        message: str = "",
        step: int | None = None,
        metrics: Mapping[str, float] | None = None,
        metadata: Mapping[str, Any] | None = None,
        attributes: Mapping[str, Any] | None = None,
        dtypes: Mapping[str, str] | None = None,
        quantize: Planner | None = None,
        parent: str | None = None,
        rebase: bool = False,
        progress: Progress | None = None,
    ) -> SnapshotInfo:
        """Commit ``tensors`` (array path -> array) as the next version of ``branch``.

        ``dtypes`` names logical dtypes the array cannot carry (``"BF16"`` for uint16 bits);
        ``quantize`` (e.g. a policy ``QuantConfig``) plans lossy storage per tensor.
        """
        tx = self.transaction(branch, parent=parent, inherit=False)
        try:
            tx.write(tensors, attributes=attributes, dtypes=dtypes, quantize=quantize, progress=progress)
            return tx.commit(message=message, step=step, metrics=metrics, metadata=metadata, rebase=rebase)
        finally:
            tx.abort()  # no-op after a commit; after a failure, frees gc at once

    # -- maintenance (implemented in maintenance.py) --------------------------------------
    def diff(self, ref_a: str, ref_b: str, *, values: bool = False) -> maintenance.DiffReport:
        """Per-tensor changes between two versions; ``values`` adds error figures."""
        return maintenance.diff(self, ref_a, ref_b, values=values)

    def verify(self, progress: Progress | None = None) -> maintenance.VerifyReport:
        """Check every reachable object end to end; names bad objects and who uses them."""
        return maintenance.verify(self, progress=progress)

    def gc(
        self, keep_last: int | None = None, *, dry_run: bool = False, progress: Progress | None = None,
        stale_after: float = leases.STALE_AFTER,
    ) -> maintenance.GcReport:
        """Delete what no kept version reaches (delta bases of kept objects are kept).

        Refuses with ``ConflictError`` while a commit is in progress; a writer lease older
        than ``stale_after`` seconds is taken as a dead writer's (pass 0 after a crash you
        know about)."""
        return maintenance.gc(self, keep_last=keep_last, dry_run=dry_run, progress=progress,
                              stale_after=stale_after)

    def du(self, ref: str = DEFAULT_BRANCH, prefix: str = "") -> list[maintenance.UsageRow]:
        """Per version, oldest first: logical bytes, new stored bytes, cumulative, ratio
        (``prefix="model/"``: only the tensors under it)."""
        return maintenance.du(self, ref, prefix)


def _maybe_name(text: str) -> bool:
    try:
        check_name(text, "ref")
    except FormatError:
        return False
    return True


@dataclass
class Transaction:
    """One write session: a writable zarr store, committed once."""

    repo: Repository
    branch: str
    head_seq: int
    parent: str | None
    parent_view: SnapshotChunks | None
    inherit: bool
    committed: SnapshotInfo | None = field(default=None, init=False)
    #: this writer's lease (see leases.py): held from the first write until the commit
    lease: str | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.lease = leases.acquire_writer(self.repo.storage)
        self.view = PendingChunks(self.repo.objects, self.parent_view, inherit=self.inherit)
        self.store = InshrinkStore(self.view)

    def abort(self) -> None:
        """Give up this transaction: nothing is committed; what it wrote is left for gc."""
        leases.release(self.repo.storage, self.lease)
        self.lease = None

    def write(
        self,
        tensors: Mapping[str, np.ndarray],
        *,
        attributes: Mapping[str, Any] | None = None,
        dtypes: Mapping[str, str] | None = None,
        quantize: Planner | None = None,
        progress: Progress | None = None,
    ) -> None:
        previous = _arrays.previous_codecs(self.parent_view) if quantize is not None else {}
        _arrays.write_arrays(
            self.store, tensors, attributes=attributes, dtypes=dtypes,
            planner=quantize, previous=previous, progress=progress,
        )

    def commit(
        self,
        message: str = "",
        step: int | None = None,
        metrics: Mapping[str, float] | None = None,
        metadata: Mapping[str, Any] | None = None,
        rebase: bool = False,
    ) -> SnapshotInfo:
        if self.committed is not None:
            raise ConflictError("Expected an open transaction. Got one already committed instead.")
        storage = self.repo.storage
        root, trees = self.view.build_trees()
        for tree_id, tree in trees.items():
            path = tree_path(tree_id)
            if not storage.exists(path):
                storage.write(path, tree.to_bytes())
        storage.write(tree_path(root.id), root.to_bytes())
        snap = Snapshot(
            root=root.id, parent=self.parent, time=utc_now(), message=message,
            step=None if step is None else int(step),
            metrics={k: float(v) for k, v in (metrics or {}).items()},
            metadata=dict(metadata or {}),
        )
        seq = self.head_seq + 1
        for _ in range(8):
            storage.write(snapshot_path(snap.id), snap.to_bytes())
            try:
                self.repo._advance(self.branch, seq, snap.id)
                break
            except ConflictError:
                if not rebase:
                    raise
                head = self.repo._head(self.branch)
                assert head is not None
                seq = head[0] + 1
                snap = Snapshot(**{**snap.__dict__, "parent": head[1], "time": utc_now()})
        else:
            raise ConflictError(f"Expected to commit to {self.branch!r}. Got 8 lost races instead.")
        self.committed = self.repo.snapshot(snap.id)
        self.abort()  # committed: the lease is no longer needed
        return self.committed


__all__ = ["Repository", "SnapshotInfo", "Transaction", "init", "open"]
