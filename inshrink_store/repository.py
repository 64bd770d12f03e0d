"""Repository: versions of a training state over one fsspec URL.

Commit writes objects, then trees, then the snapshot, then creates the next
branch ref file exclusively. A crash anywhere leaves the previous version intact
and nothing half-visible; a lost race is a :class:`ConflictError` and nothing is
lost. Reading resolves a ref to a snapshot and serves it as a plain zarr store.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from inshrink_store import arrays as _arrays
from inshrink_store import leases, maintenance
from inshrink_store.cas import DEFAULT_KEYFRAME_INTERVAL, ObjectStore
from inshrink_store.errors import ConflictError, FormatError, IntegrityError, NotFoundError
from inshrink_store.manifest import (
    FORMAT_VERSION,
    RootTree,
    Snapshot,
    canonical_json,
    check_commit_fields,
    utc_now,
)
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
#: how long a commit waits for a running gc before GcRunningError (a dead gc is recognised
#: after leases.EXPIRY seconds without renewal, or at once on its own machine)
GC_WAIT = 60.0
_ID = re.compile(r"[0-9a-f]{32}")
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
    if storage.is_local and os.path.exists(storage.root) and not os.path.isdir(storage.root):
        raise FormatError(
            f"Expected a folder (or nothing) at {url!r} to create a store in. Got a file there "
            "instead; choose another path."
        )
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
        self.settings = _read_settings(storage)
        if self.settings.get("format") != FORMAT_VERSION:
            raise FormatError(
                f"Expected store format {FORMAT_VERSION}. Got {self.settings.get('format')!r} "
                "instead; upgrade inshrink-store to read this store."
            )
        interval = keyframe_interval or self.settings.get("keyframe_interval", DEFAULT_KEYFRAME_INTERVAL)
        if isinstance(interval, bool) or not isinstance(interval, int) or not 1 <= interval <= 4096:
            raise IntegrityError(
                f"Expected keyframe_interval in {storage.url!r}/{CONFIG_FILE} to be an integer "
                f"from 1 to 4096. Got {interval!r} instead: the store's settings are corrupt."
            )
        self.objects = ObjectStore(storage, keyframe_interval=interval)

    @property
    def url(self) -> str:
        return self.storage.url

    def __repr__(self) -> str:
        return f"Repository({self.url!r})"

    # -- refs ------------------------------------------------------------------------
    def _branch_seqs(self) -> dict[str, list[int]]:
        return parse_branch_listing(list(self.storage.list("refs/branches")))

    def read_ref(self, path: str) -> str:
        """The snapshot id in a ref file, checked to be an id (never a path to follow)."""
        raw = self.storage.read(path)
        try:
            text = raw.decode("ascii").strip()
        except UnicodeDecodeError:
            text = ""
        if not _ID.fullmatch(text):
            raise IntegrityError(
                f"Expected ref file {path} in {self.url!r} to hold a 32-hex-digit snapshot id. "
                f"Got {len(raw)} bytes that are not one instead: the ref is corrupt. Run `inshrink verify`."
            )
        return text


    def _head(self, branch: str) -> tuple[int, str] | None:
        seqs = self._branch_seqs().get(branch)
        if not seqs:
            return None
        return seqs[-1], self.read_ref(branch_ref_path(branch, seqs[-1]))

    def branches(self) -> dict[str, str]:
        """Branch name -> head snapshot id."""
        return {b: self.read_ref(branch_ref_path(b, s[-1])) for b, s in self._branch_seqs().items()}

    def tags(self) -> dict[str, str]:
        return {p.split("/", 2)[2]: self.read_ref(p) for p in self.storage.list("refs/tags")}

    def tag(self, name: str, ref: str = DEFAULT_BRANCH, *, gc_wait: float = GC_WAIT) -> str:
        """Create a write-once tag; an existing tag is a :class:`ConflictError`.

        A new ref makes a version reachable, so it is published like a commit: under a
        writer lease, after checking the snapshot still exists, through the fence."""
        check_name(name, "tag")
        with self._ref_lease(gc_wait) as lease:
            snapshot_id = self._existing(self.resolve(ref), ref)
            leases.fence_for_commit(self.storage, lease)
            try:
                self.storage.create_exclusive(tag_path(name), snapshot_id.encode())
            except FileExistsError:
                raise ConflictError(
                    f"Expected tag {name!r} not to exist. Got an existing tag instead "
                    f"(-> {self.read_ref(tag_path(name))}); tags are write-once: delete it first "
                    "(`inshrink tag -d`) or pick another name."
                ) from None
        return snapshot_id

    def create_branch(self, name: str, ref: str = DEFAULT_BRANCH, *, gc_wait: float = GC_WAIT) -> str:
        """A new branch whose head is ``ref`` (published like a commit, see :meth:`tag`)."""
        check_name(name, "branch")
        with self._ref_lease(gc_wait) as lease:
            snapshot_id = self._existing(self.resolve(ref), ref)
            if name in self._branch_seqs():
                raise ConflictError(f"Expected branch {name!r} not to exist. Got an existing branch instead.")
            leases.fence_for_commit(self.storage, lease)
            self._advance(name, 0, snapshot_id)
        return snapshot_id

    def delete_tag(self, name: str) -> str:
        """Remove a tag; returns the snapshot id it named (its data goes at the next gc if
        nothing else keeps it)."""
        check_name(name, "tag")
        try:
            snapshot_id = self.read_ref(tag_path(name))
        except FileNotFoundError:
            raise NotFoundError(
                f"Expected tag {name!r} in {self.url!r}. Got no such tag instead "
                f"(tags: {', '.join(sorted(self.tags())) or 'none'})."
            ) from None
        self.storage.delete(tag_path(name))
        return snapshot_id

    def delete_branch(self, name: str) -> str:
        """Remove a branch (every ref file, oldest first so the head stays readable until the
        end); returns its head id. Its versions go at the next gc unless a ref keeps them."""
        check_name(name, "branch")
        seqs = self._branch_seqs().get(name)
        if not seqs:
            raise NotFoundError(
                f"Expected branch {name!r} in {self.url!r}. Got no such branch instead "
                f"(branches: {', '.join(sorted(self._branch_seqs())) or 'none'})."
            )
        head = self.read_ref(branch_ref_path(name, seqs[-1]))
        for seq in seqs:
            self.storage.delete(branch_ref_path(name, seq))
        return head

    @contextlib.contextmanager
    def _ref_lease(self, gc_wait: float) -> Iterator[leases.HeldLease]:
        lease = leases.acquire_writer(self.storage, wait=gc_wait)
        try:
            yield lease
        finally:
            lease.release()

    def _existing(self, snapshot_id: str, ref: str) -> str:
        """``snapshot_id`` if its snapshot exists now (checked under a lease: gc can't race it)."""
        if not self.storage.exists(snapshot_path(snapshot_id)):
            raise NotFoundError(
                f"Expected {ref!r} to name a snapshot in {self.url!r}. Got {snapshot_id}, which "
                "does not exist instead (removed by gc?); nothing was written."
            )
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
            return self.read_ref(tag_path(base))
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
        self, branch: str = DEFAULT_BRANCH, *, parent: str | None = None, inherit: bool = True,
        gc_wait: float = GC_WAIT, on_wait: Callable[[str], None] | None = None,
    ) -> Transaction:
        """One write session. ``parent`` (a ref) defaults to the branch head; ``inherit=False``
        starts empty (a full new state) while still delta-coding against the parent.

        The writer lease is taken *first*, so everything read after it (head, parent, the
        objects it dedups against) cannot be collected by a gc before the commit; a running
        gc is waited for up to ``gc_wait`` seconds (``on_wait`` hears about it)."""
        check_name(branch, "branch")
        lease = leases.acquire_writer(self.storage, wait=gc_wait, on_wait=on_wait)
        try:
            head = self._head(branch)
            parent_id = self.resolve(parent) if parent is not None else (head[1] if head else None)
            view = None
            if parent_id is not None:
                view = SnapshotChunks(self.objects, self.snapshot(parent_id).root, parent_id)
            tx = Transaction(self, branch, head[0] if head else -1, parent_id, view, inherit)
        except BaseException:
            lease.release()
            raise
        tx.lease = lease.keep_alive()
        return tx

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
        gc_wait: float = GC_WAIT,
        on_wait: Callable[[str], None] | None = None,
    ) -> SnapshotInfo:
        """Commit ``tensors`` (array path -> array) as the next version of ``branch``.

        ``dtypes`` names logical dtypes the array cannot carry (``"BF16"`` for uint16 bits);
        ``quantize`` (e.g. a policy ``QuantConfig``) plans lossy storage per tensor.
        Message, step, metrics and metadata are checked before anything is written; a running
        gc is waited for up to ``gc_wait`` seconds.
        """
        message, step, metrics, metadata = check_commit_fields(message, step, metrics, metadata)
        if quantize is not None and not callable(getattr(quantize, "plan", None)):
            raise FormatError(
                f"Expected quantize to be a planner with a plan() method (e.g. "
                f"inshrink_store.policy.QuantConfig(bins=16)) or None. Got {quantize!r} instead."
            )
        tx = self.transaction(branch, parent=parent, inherit=False, gc_wait=gc_wait, on_wait=on_wait)
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
        stale_after: float = leases.STALE_AFTER, wait: float = 0.0,
        on_wait: Callable[[str], None] | None = None,
    ) -> maintenance.GcReport:
        """Delete what no kept version reaches (delta bases of kept objects are kept).

        Safe beside any number of writers and gc runs. Refuses with ``ConflictError``
        (nothing deleted) while a commit is in progress, after waiting up to ``wait``
        seconds; a writer whose process is gone, or whose lease went unrenewed for
        ``stale_after`` seconds, is fenced off (it can no longer publish) and ignored.
        Refs naming missing snapshots are reported in ``GcReport.dangling``."""
        return maintenance.gc(self, keep_last=keep_last, dry_run=dry_run, progress=progress,
                              stale_after=stale_after, wait=wait, on_wait=on_wait)

    def du(self, ref: str = DEFAULT_BRANCH, prefix: str = "") -> list[maintenance.UsageRow]:
        """Per version, oldest first: logical bytes, new stored bytes, cumulative, ratio
        (``prefix="model/"``: only the tensors under it)."""
        return maintenance.du(self, ref, prefix)


def _read_settings(storage: Storage) -> dict[str, Any]:
    """``inshrink.json`` as a dict, or an IntegrityError naming the file and what is wrong."""
    raw = storage.read(CONFIG_FILE)
    try:
        settings = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise IntegrityError(
            f"Expected {storage.url!r}/{CONFIG_FILE} to hold the store's settings as JSON. Got "
            f"{len(raw)} bytes that are not JSON instead ({type(exc).__name__}): the file is "
            "corrupt; it holds only the format and keyframe interval, so restore it from "
            'another store (e.g. {"format": 1, "keyframe_interval": 8}).'
        ) from None
    if not isinstance(settings, dict):
        raise IntegrityError(
            f"Expected {storage.url!r}/{CONFIG_FILE} to hold a JSON object. Got a "
            f"{type(settings).__name__} instead: the file is corrupt."
        )
    return settings


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
    #: this writer's lease (see leases.py): held from before the head is read until the commit
    lease: leases.HeldLease | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.view = PendingChunks(self.repo.objects, self.parent_view, inherit=self.inherit)
        self.store = InshrinkStore(self.view)

    def abort(self) -> None:
        """Give up this transaction: nothing is committed; what it wrote is left for gc."""
        if self.lease is not None:
            self.lease.release()
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
        if self.lease is None:
            raise ConflictError("Expected an open transaction. Got one already aborted instead.")
        message, step, metrics, metadata = check_commit_fields(message, step, metrics, metadata)
        storage = self.repo.storage
        root, trees = self.view.build_trees()
        for tree_id, tree in trees.items():
            path = tree_path(tree_id)
            if not storage.exists(path):
                storage.write(path, tree.to_bytes())
        storage.write(tree_path(root.id), root.to_bytes())
        snap = Snapshot(root=root.id, parent=self.parent, time=utc_now(), message=message,
                        step=step, metrics=metrics, metadata=metadata)
        seq = self.head_seq + 1
        leases.fence_for_commit(storage, self.lease)  # a gc that judged us dead wins: publish nothing
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
                root = self._rebased_root(head[1]) if self.inherit else root
                snap = Snapshot(**{**snap.__dict__, "root": root.id, "parent": head[1], "time": utc_now()})
        else:
            raise ConflictError(f"Expected to commit to {self.branch!r}. Got 8 lost races instead.")
        self.committed = self.repo.snapshot(snap.id)
        self.abort()  # committed: the lease is no longer needed
        return self.committed

    def _rebased_root(self, head_id: str) -> RootTree:
        """This transaction's changes re-applied on ``head_id``, written; the new root tree.

        A transaction that inherited its parent's tensors changed only some of them; moving
        just its parent pointer would silently undo what the other writer committed. So
        the merge is per zarr node (a tensor with all its chunks, or a group's attributes):
        a node this transaction added, changed or removed is taken from it (this commit
        comes later in history, so its write is the newer one); every other node is taken
        from the new head."""
        storage = self.repo.storage
        base = _by_node(self.parent_view.entries if self.parent_view is not None else {})
        mine = _by_node(self.view.entries)
        head_view = SnapshotChunks(self.repo.objects, self.repo.snapshot(head_id).root, head_id)
        merged_nodes = _by_node(head_view.entries)
        for node in set(base) | set(mine):
            if base.get(node) == mine.get(node):
                continue  # untouched here: the head's version stands
            if node in mine:
                merged_nodes[node] = mine[node]
            else:
                merged_nodes.pop(node, None)
        merged = PendingChunks(self.repo.objects, head_view, inherit=False)
        for entries in merged_nodes.values():
            merged.entries.update(entries)
        root, trees = merged.build_trees()
        for tree_id, tree in trees.items():
            if not storage.exists(tree_path(tree_id)):
                storage.write(tree_path(tree_id), tree.to_bytes())
        storage.write(tree_path(root.id), root.to_bytes())
        return root


def _by_node(entries: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Store keys grouped by the zarr node they belong to ('' is the root group): the
    deepest ``<node>/zarr.json`` above each key."""
    nodes = {k[: -len("zarr.json")].rstrip("/") for k in entries if k == "zarr.json" or k.endswith("/zarr.json")}
    out: dict[str, dict[str, Any]] = {}
    for key, entry in entries.items():
        node = key.rsplit("/", 1)[0] if "/" in key else ""
        while node and node not in nodes:
            node = node.rsplit("/", 1)[0] if "/" in node else ""
        out.setdefault(node, {})[key] = entry
    return out


__all__ = ["Repository", "SnapshotInfo", "Transaction", "init", "open"]
