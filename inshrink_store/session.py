"""The write session: one writable version, committed once, owning its writer lease.
Layer: write session, below admin, the facade and ``torch/dcp``; above ``parts``.

Use it as a context manager: it commits nothing by itself, aborts (releases the lease)
on an error, and refuses a second commit::

    with repo.transaction("main") as tx:
        tx.write({"model/w": w})
        tx.commit(message="step 10", step=10)

Commit order (docs/reference/format.md, "Commit protocol"): objects (during ``write``),
trees, snapshot, the fence, then the ref; a crash anywhere leaves only garbage.

Every commit is a compare-and-swap on the branch head (format.md, "Commits are
compare-and-swap"): it replaces the head the session read when it opened (``expect_head``
names the one the caller believes in), or fails with ConflictError; a commit whose parent is
not that head keeps the head it replaces reachable as branch ``<branch>.replaced-<id12>``,
unless ``rebase=True`` puts it on top of the head instead.
"""

from __future__ import annotations

import enum
import functools
import json
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import zarr
from zarr.storage import MemoryStore

from inshrink_store import dtypes as dtype_registry
from inshrink_store import leases
from inshrink_store import residual as residual_module
from inshrink_store.errors import ConflictError, InshrinkError, InvalidInputError, NotFoundError
from inshrink_store.index import METADATA_KEY, Entry, SnapshotIndex
from inshrink_store.layout import check_id, object_path, snapshot_path, tree_path
from inshrink_store.manifest import NodeTree, RootTree, Snapshot, check_commit_fields, utc_now
from inshrink_store.parallel import map_in_order
from inshrink_store.plans import ArrayPlan, Planner, Quantize, check_quantize
from inshrink_store.refs import replaced_branch_name
from inshrink_store.residual import META_KEY, ResidualArray, ResidualRef, ResidualWriter
from inshrink_store.writer import check_path, prepare_arrays, previous_codecs, write_arrays
from inshrink_store.zarr_store import InshrinkStore, PendingChunks, SnapshotChunks

if TYPE_CHECKING:  # annotations only
    from inshrink_store.history import SnapshotInfo
    from inshrink_store.parts import StoreParts

Progress = Callable[[str, int, int], None]
#: chunk keys taken without splitting them into parts: ``c/0/1`` (zarr v3's default), ``0.1``
_PLAIN_CHUNK_KEY = re.compile(r"c(?:/[0-9]+)*|[0-9]+(?:\.[0-9]+)*")
#: attempts at a rebased commit before giving up (each lost race re-reads the head)
MAX_REBASES = 8
#: node trees a commit writes at once (small documents: the requests wait, not the cores)
TREE_WRITE_THREADS = 8


class AnyHead(enum.Enum):
    """The type of :data:`ANY_HEAD`."""

    ANY = "any"


#: ``expect_head`` of a session that replaces whatever head it finds when it opens (the commit
#: is still a compare-and-swap on that head)
ANY_HEAD = AnyHead.ANY


class _Recording(Mapping[str, ArrayPlan]):
    """A planner's plans that hand each plan, as the writer takes it, to the residual."""

    def __init__(self, plans: Mapping[str, ArrayPlan], tensors: Mapping[str, np.ndarray],
                 dtypes: Mapping[str, str], residual: ResidualWriter) -> None:
        self._plans, self._tensors, self._dtypes, self._residual = plans, tensors, dtypes, residual

    def __getitem__(self, path: str) -> ArrayPlan:
        plan = self._plans[path]
        original = np.asarray(self._tensors[path])
        name = dtype_registry.of_array(original, self._dtypes.get(path), path).name
        self._residual.add(path, original, residual_module.stored_values(plan.values, plan.serializer, name), name)
        return plan

    def __iter__(self) -> Any:
        return iter(self._plans)

    def __len__(self) -> int:
        return len(self._plans)

    def __contains__(self, path: object) -> bool:
        return path in self._plans


class WriteSession:
    """One write session: a writable zarr store (``.store``) over the parent's chunks."""

    def __init__(self, parts: StoreParts, branch: str, head_seq: int, parent: str | None,
                 parent_view: SnapshotChunks | None, inherit: bool, lease: leases.HeldLease,
                 head_id: str | None = None) -> None:
        self._parts = parts
        self.branch, self.head_seq, self.parent, self.inherit = branch, head_seq, parent, inherit
        #: the head this session's commit replaces (read under the lease when it opened)
        self.head_id = head_id
        #: the branch a commit on an older parent created to keep the head it replaced
        self.replaced_branch: str | None = None
        self.parent_view = parent_view
        self.residual: ResidualWriter | None = None
        #: this writer's lease: held from before the head was read until commit or abort
        self.lease: leases.HeldLease | None = lease
        self.committed: SnapshotInfo | None = None
        self.view = PendingChunks(parts.objects, parent_view, inherit=inherit)
        self.store = InshrinkStore(self.view)

    def __repr__(self) -> str:
        state = "committed" if self.committed else ("open" if self.lease else "aborted")
        return f"WriteSession({self._parts.url!r}, branch={self.branch!r}, {state})"

    def __enter__(self) -> WriteSession:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        self.abort()  # after a commit: a no-op; after an error: frees gc at once

    def abort(self) -> None:
        """Give up: nothing is committed; what was written is left for gc."""
        if self.lease is not None:
            self.lease.release()
        self.lease = None

    def write(
        self,
        tensors: Mapping[str, np.ndarray],
        *,
        attributes: Mapping[str, Any] | None = None,
        dtypes: Mapping[str, str] | None = None,
        quantize: Quantize | None = None,
        progress: Progress | None = None,
        residual: bool = False,
    ) -> None:
        """Write tensors (array path -> array) into this version; objects are stored now.

        ``quantize``: plans (path -> :class:`~inshrink_store.plans.ArrayPlan`, e.g. a search's
        ``PlanSet``) for the tensors stored lossy, or a planner (e.g. a policy ``QuantConfig``)
        that :meth:`plan` asks for them. ``residual``: also store what turns every quantized
        tensor back into its exact bits (the restore residual; :meth:`commit` names it in the
        version's metadata)."""
        self._require_open()
        check_quantize(quantize)
        arrays, names = prepare_arrays(tensors, dtypes)
        plans = quantize if quantize is None or isinstance(quantize, Mapping) else self.plan(quantize, arrays, names)
        if residual and plans:
            if self.residual is None:
                self.residual = ResidualWriter(self._parts.objects)
            plans = _Recording(plans, arrays, names, self.residual)
        write_arrays(self.store, arrays, attributes=attributes, dtypes=names, plans=plans, progress=progress)

    def plan(self, planner: Planner, tensors: Mapping[str, np.ndarray],
             dtypes: Mapping[str, str] | None = None) -> Mapping[str, ArrayPlan]:
        """``planner``'s plans for ``tensors`` in this session: it is handed the tensors and
        dtype names as the writer takes them, and the parent version's codebooks (read once,
        here; a caller that planned already passes its plans to :meth:`write` instead)."""
        arrays, names = prepare_arrays(tensors, dtypes)
        return planner.plan(arrays, names, previous_codecs(self.parent_view))

    def stage_array(self, path: str, metadata: bytes, chunk_ids: Mapping[str, str], *,
                    check_stored: bool = True) -> None:
        """Put array ``path`` into this version from objects already stored: what another
        process wrote, e.g. the shards each rank of a ``torch.distributed.checkpoint`` save
        writes while only the coordinator holds this session.

        ``metadata``: the array's zarr.json, a zarr v3 array document, kept byte for byte as
        given. ``chunk_ids``: each chunk's key relative to the array (``c/0/0``) -> the id of
        the stored object holding it, as :meth:`~inshrink_store.zarr_store.PendingChunks.node`
        gives them. Whatever this version held at ``path`` is replaced (as :meth:`write`
        replaces it), and each group above it that this version lacks gets an empty group's
        zarr.json (as :meth:`stage_group` writes it).

        ``check_stored``: ask storage that each object exists before the version may name it
        (a request per object on an object store); a caller that stored or found the objects
        itself under this session's lease (the DCP coordinator, whose ranks did) passes False.

        Everything is checked before anything is staged, so an error leaves this session as
        it was: ``path`` as a tensor name is checked for :meth:`write`, each chunk key as a
        relative path, each id as 32 lowercase hex digits (InvalidInputError naming the array
        and the chunk); a missing object is a NotFoundError."""
        self._require_open()
        path = _check_node_path(path, "array")
        doc = _node_document(path, metadata)
        if doc.get("node_type") != "array":
            raise InvalidInputError(
                f"Expected the zarr.json of array {path!r} to be a zarr v3 array document (node_type 'array'). "
                f"Got node_type {doc.get('node_type')!r} instead; nothing was staged.")
        if not isinstance(chunk_ids, Mapping):
            raise InvalidInputError(
                f"Expected the chunk ids of array {path!r} as a mapping (chunk key -> object id). Got "
                f"{type(chunk_ids).__name__} instead; nothing was staged.")
        chunks = {_check_chunk_key(path, key): _check_object_id(path, key, oid) for key, oid in chunk_ids.items()}
        groups = self._missing_groups(path, "array")
        if check_stored:
            storage = self._parts.storage
            for key, oid in sorted(chunks.items()):
                if not storage.exists_durably(object_path(oid)):
                    raise NotFoundError(
                        f"Expected chunk {key!r} of array {path!r} to name a stored object. Got {oid}, which this "
                        "store does not hold, instead: store the objects before staging the array; nothing was "
                        "staged.")
        staged = {f"{group}/{METADATA_KEY}" if group else METADATA_KEY: Entry(inline=_group_document({}))
                  for group in groups}
        staged[f"{path}/{METADATA_KEY}"] = Entry(inline=bytes(metadata))
        staged.update({f"{path}/{key}": Entry(oid=oid) for key, oid in chunks.items()})
        self.view.delete_prefix(f"{path}/")
        self.view.entries.update(staged)

    def stage_group(self, path: str, attributes: Mapping[str, Any] | None = None) -> None:
        """Put group ``path`` (``""``: the root group) into this version with these attributes:
        its zarr.json as zarr itself writes it (indented, byte for byte what
        ``zarr.create_group`` stores), replacing the group's document, never its members.
        Each group above it that this version lacks gets an empty group's zarr.json.

        ``path`` is checked as for :meth:`stage_array`; a path where this version holds an
        array, or below one, and attributes zarr cannot store as JSON are InvalidInputErrors
        naming the path, and stage nothing."""
        self._require_open()
        path = _check_node_path(path, "group") if path != "" else path
        if attributes is not None and not isinstance(attributes, Mapping):
            raise InvalidInputError(
                f"Expected the attributes of group {path!r} as a mapping. Got {type(attributes).__name__} instead; "
                "nothing was staged.")
        try:
            document = _group_document(dict(attributes or {}))
        except (TypeError, ValueError) as exc:
            raise InvalidInputError(
                f"Expected attributes zarr stores as JSON for group {path!r}. Got {type(exc).__name__}: {exc} "
                "instead; nothing was staged.") from None
        groups = self._missing_groups(path, "group")
        own = f"{path}/{METADATA_KEY}" if path else METADATA_KEY
        if _node_type(self.view.entries.get(own)) == "array":
            raise InvalidInputError(
                f"Expected group {path!r} where this version holds no array. Got an array there instead; "
                "stage_array replaces an array, stage_group never does. Nothing was staged.")
        staged = {f"{group}/{METADATA_KEY}" if group else METADATA_KEY: Entry(inline=_group_document({}))
                  for group in groups}
        staged[own] = Entry(inline=document)
        self.view.entries.update(staged)

    def _missing_groups(self, path: str, kind: str) -> list[str]:
        """The groups above ``path`` (the root first) this version has no zarr.json for;
        InvalidInputError if one of them is an array (no node can be inside an array)."""
        parts = path.split("/") if path else []
        missing = []
        for cut in range(len(parts)):
            group = "/".join(parts[:cut])
            entry = self.view.entries.get(f"{group}/{METADATA_KEY}" if group else METADATA_KEY)
            if entry is None:
                missing.append(group)
            elif group and _node_type(entry) == "array":  # the root, a group (its document may be large)
                raise InvalidInputError(
                    f"Expected {kind} {path!r} to be below groups only. Got array {group!r} above it instead; "
                    "nothing was staged.")
        return missing

    def commit(
        self,
        message: str = "",
        step: int | None = None,
        metrics: Mapping[str, float] | None = None,
        metadata: Mapping[str, Any] | None = None,
        rebase: bool = False,
        keep_residual: int = 1,
    ) -> SnapshotInfo:
        """Publish this version as the next of its branch: a compare-and-swap on the head this
        session opened on (another writer's commit since is a ConflictError). ``rebase`` puts it
        on top of the head instead, whether another writer moved it or this session's parent is
        an older version (a partial update is replayed per zarr node). Without ``rebase``, a
        commit whose parent is not the head keeps that head as branch ``<branch>.replaced-<id12>``
        (created before the branch moves), so no committed version leaves every ref.

        A residual written with ``write(residual=True)`` is stored now, before the snapshot
        that names it, and kept while this version is among the ``keep_residual`` newest of
        its branch."""
        if self.committed is not None:
            raise ConflictError("Expected an open transaction. Got one already committed instead.")
        lease = self._require_open()
        message, step, metrics, metadata = check_commit_fields(message, step, metrics, metadata)
        if META_KEY in metadata:
            raise InvalidInputError(
                f"Expected metadata without the key {META_KEY!r}: the store names a version's restore residual "
                "there. Got it in the metadata given instead; rename that key.")
        storage = self._parts.storage
        root = self._write_trees(self.view)
        mine = _node_ids(self._parts.objects, root) if self.inherit and self.residual is not None else {}
        meta = self._with_residual(metadata, root, mine, self.parent, keep_residual)
        snap = Snapshot(root=root.id, parent=self.parent, time=utc_now(), message=message,
                        step=step, metrics=metrics, metadata=meta)
        seq = self.head_seq + 1
        leases.fence_for_commit(storage, lease)  # a gc that judged us dead wins: publish nothing
        replaced = self.head_id if self.head_id is not None and self.parent != self.head_id else None

        def onto(head: tuple[int, str]) -> Snapshot:
            nonlocal root, meta
            if self.inherit:  # new root: its residual follows each node to where it came from
                root = self._rebased_root(head[1])
                meta = self._with_residual(meta, root, mine, head[1], keep_residual)
            return Snapshot(**{**snap.__dict__, "root": root.id, "parent": head[1], "time": utc_now(),
                               "metadata": meta})

        if replaced is not None and rebase:  # an older parent, rebased: on top of the head
            snap, replaced = onto((self.head_seq, replaced)), None
        if replaced is not None:  # kept before the branch moves: never a moment unreachable
            leases.check_publishable(storage, lease)
            self.replaced_branch = self._keep_replaced(replaced)
        expected = self.head_id
        for _ in range(MAX_REBASES):
            storage.write(snapshot_path(snap.id), snap.to_bytes())
            leases.check_publishable(storage, lease)
            try:
                self._parts.refs.advance(self.branch, seq, snap.id, replaces=expected)
                break
            except ConflictError:
                if not rebase:
                    raise
                head = self._parts.refs.head(self.branch)
                assert head is not None
                seq, expected = head[0] + 1, head[1]
                snap = onto(head)
        else:
            raise ConflictError(f"Expected to commit to {self.branch!r}. Got {MAX_REBASES} lost races instead.")
        self.committed = self._parts.history.get(snap.id)
        self.abort()  # committed: the lease is no longer needed
        return self.committed

    def _keep_replaced(self, head_id: str) -> str:
        """Branch ``<branch>.replaced-<id12>`` at ``head_id``, the head a commit on an older
        parent replaces (an existing one at that version is kept as it is); its name."""
        refs = self._parts.refs
        for name in (replaced_branch_name(self.branch, head_id, short=True),
                     replaced_branch_name(self.branch, head_id, short=False)):
            found = refs.head(name)
            if found is not None and found[1] == head_id:
                return name
            if found is None:
                try:
                    refs.advance(name, 0, head_id)
                    return name
                except ConflictError:
                    if refs.head(name) == (0, head_id):  # another writer kept the same head
                        return name
        raise ConflictError(
            f"Expected to keep the head {head_id} of branch {self.branch!r} that this commit replaces under "
            f"branch {replaced_branch_name(self.branch, head_id, short=False)!r}. Got that name taken by another "
            "version instead; nothing was committed: delete that branch or commit on the head (rebase=True).")

    def _with_residual(self, metadata: Mapping[str, Any], root: RootTree, mine: Mapping[str, str],
                       source: str | None, keep: int) -> dict[str, Any]:
        """``metadata`` naming the residual of the version whose root tree is ``root`` (written
        now, before its snapshot), or without one when no entry fits.

        Why per root: every entry must match the stored tensor of the version that names it,
        or an exact restore fails its checksum. An entry this session wrote fits where its node
        (``mine``: node path -> :attr:`NodeTree.inline_id` of this session's own root) is
        ``root``'s; an entry of ``source`` (the parent, or after a lost race the new head) fits
        where ``source``'s node is ``root``'s. A rebase takes the head's nodes, so it takes the
        head's entries for them, never the old parent's."""
        out = {k: v for k, v in metadata.items() if k != META_KEY}
        if self.residual is None:
            return out
        arrays = dict(self.residual.arrays)
        if self.inherit:
            final = _node_ids(self._parts.objects, root)
            arrays = {p: a for p, a in arrays.items() if p in final and final[p] == mine.get(p)}
            for path, array in self._source_residual(source, final).items():
                arrays.setdefault(path, array)
        ref = self.residual.write(self._parts.storage, keep, arrays)
        return out if ref is None else {**out, META_KEY: ref.to_dict()}

    def _source_residual(self, source: str | None, final: Mapping[str, str]) -> dict[str, ResidualArray]:
        """The residual entries of version ``source`` for the nodes it shares with ``final``
        (compared by what each node holds, :attr:`NodeTree.inline_id`, not how it is stored:
        a version written before inline nodes keeps tree files for nodes a newer one inlines).
        Nothing when ``source`` has no readable residual: those tensors are simply not exact."""
        if source is None:
            return {}
        info = self._parts.history.get(source)
        try:
            ref = ResidualRef.from_metadata(info.metadata, source)
            arrays = residual_module.load(self._parts.storage, ref.id) if ref is not None else {}
        except InshrinkError:
            return {}  # collected or unreadable: those tensors are simply not exact here
        theirs = _node_ids(self._parts.objects, info.root)
        return {p: a for p, a in arrays.items() if p in final and final[p] == theirs.get(p)}

    def _require_open(self) -> leases.HeldLease:
        if self.lease is None:
            state = "committed" if self.committed is not None else "aborted"
            raise ConflictError(f"Expected an open transaction. Got one already {state} instead.")
        return self.lease

    def _write_trees(self, view: PendingChunks) -> RootTree:
        """Write the node trees storage lacks, then the root tree. A tree the view's parent
        names is stored (the parent was read under this lease, and no gc sweeps while it is
        held) and is skipped without asking storage: on an object store that is one request
        saved per unchanged tensor. The others are written side by side (each is a request or
        two on an object store, and a DCP save has one per shard); the root goes last."""
        storage = self._parts.storage
        root, trees = view.build_trees()
        stored = set(view.parent.root.nodes.values()) if view.parent is not None else set()

        def write_tree(item: tuple[str, NodeTree]) -> None:
            if not storage.exists_durably(tree_path(item[0])):
                storage.write(tree_path(item[0]), item[1].to_bytes())

        map_in_order(write_tree, [(tid, tree) for tid, tree in trees.items() if tid not in stored],
                     TREE_WRITE_THREADS, "inshrink-trees")
        if view.parent is None or root.id != view.parent.root_id:
            storage.write(tree_path(root.id), root.to_bytes())
        # The next save's parent is this version: it finds these trees in the process's index
        # instead of reading them all back (trees are content-addressed: never stale).
        SnapshotIndex.of(self._parts.objects, root.id).seed(root, trees)
        return root

    def _rebased_root(self, head_id: str) -> RootTree:
        """This session's changes re-applied on ``head_id``, written; the new root tree.

        A session that inherited its parent's tensors changed only some of them; moving
        just its parent pointer would silently undo what the other writer committed. So
        the merge is per zarr node (a tensor with all its chunks, or a group's attributes):
        a node this session added, changed or removed is taken from it (this commit comes
        later in history, so its write is the newer one); every other node is taken from
        the new head."""
        base = _by_node(self.parent_view.entries if self.parent_view is not None else {})
        mine = _by_node(self.view.entries)
        head_view = SnapshotChunks(self._parts.objects, self._parts.history.get(head_id).root, head_id)
        merged_nodes = _by_node(head_view.entries)
        for node in set(base) | set(mine):
            if base.get(node) == mine.get(node):
                continue  # untouched here: the head's version stands
            if node in mine:
                merged_nodes[node] = mine[node]
            else:
                merged_nodes.pop(node, None)
        merged = PendingChunks(self._parts.objects, head_view, inherit=False)
        for entries in merged_nodes.values():
            merged.entries.update(entries)
        return self._write_trees(merged)


def _check_node_path(path: str, kind: str) -> str:
    """``path`` checked as :meth:`WriteSession.write` checks a tensor name, the error naming
    the node: no empty, ``.``, ``..``, ``__*`` or zarr.json part, no backslash."""
    try:
        return check_path(path)
    except InshrinkError as exc:
        raise InvalidInputError(
            f"Expected a {kind} path to stage that is a valid tensor name. Got {path!r}: {exc} Nothing was "
            "staged.") from None


def _node_document(path: str, metadata: bytes) -> dict[str, Any]:
    """The zarr.json ``metadata`` of node ``path`` parsed: a JSON object of zarr format 3."""
    if not isinstance(metadata, (bytes, bytearray, memoryview)):
        raise InvalidInputError(
            f"Expected the zarr.json of array {path!r} as bytes. Got {type(metadata).__name__} instead; "
            "nothing was staged.")
    try:
        doc = json.loads(bytes(metadata))
    except (ValueError, RecursionError) as exc:
        raise InvalidInputError(
            f"Expected the zarr.json of array {path!r} to be a JSON document. Got {bytes(metadata)[:60]!r} "
            f"({type(exc).__name__}) instead; nothing was staged.") from None
    if not isinstance(doc, dict) or doc.get("zarr_format") != 3:
        got = f"zarr_format {doc.get('zarr_format')!r}" if isinstance(doc, dict) else type(doc).__name__
        raise InvalidInputError(
            f"Expected the zarr.json of array {path!r} to be a zarr v3 document (zarr_format 3). Got {got} "
            "instead; nothing was staged.")
    return doc


def _check_chunk_key(path: str, key: Any) -> str:
    """A chunk key relative to its array (``c/0/0``, ``0.0``): '/'-separated parts, none empty,
    ``.``, ``..`` or zarr.json, no backslash (it must name a key inside the array)."""
    if isinstance(key, str) and _PLAIN_CHUNK_KEY.fullmatch(key):
        return key  # zarr's default and v2-style keys, without splitting (a DCP save has many)
    if (not isinstance(key, str) or not key
            or any(part in ("", ".", "..", METADATA_KEY) or "\\" in part for part in key.split("/"))):
        raise InvalidInputError(
            f"Expected the chunk keys of array {path!r} to be paths inside it (e.g. 'c/0/0'). Got {key!r} "
            "instead; nothing was staged.")
    return key


def _check_object_id(path: str, key: str, oid: Any) -> str:
    """``oid`` if :func:`~inshrink_store.layout.check_id` takes it as an object id."""
    try:
        return check_id(oid, "object", f"chunk {key!r} of array {path!r}", InvalidInputError)
    except InvalidInputError:
        raise InvalidInputError(
            f"Expected chunk {key!r} of array {path!r} to name a stored object by its id (32 lowercase hex "
            f"digits). Got {oid!r:.80} instead; nothing was staged.") from None


def _group_document(attributes: Mapping[str, Any]) -> bytes:
    """The zarr.json of a group with these attributes, as ``zarr.create_group`` writes it."""
    if not attributes:
        return _empty_group_document()
    written: dict[str, Any] = {}
    zarr.create_group(store=MemoryStore(store_dict=written), attributes=dict(attributes))
    return bytes(written[METADATA_KEY].to_bytes())


@functools.cache
def _empty_group_document() -> bytes:
    written: dict[str, Any] = {}
    zarr.create_group(store=MemoryStore(store_dict=written), attributes={})
    return bytes(written[METADATA_KEY].to_bytes())


def _node_type(entry: Entry | None) -> str | None:
    """``node_type`` of the zarr.json held in ``entry`` (None when there is none or it is not
    inline JSON). Small documents are parsed once: every shard staged below a group asks."""
    if entry is None or entry.inline is None:
        return None
    if len(entry.inline) <= 4096:
        return _small_node_type(entry.inline)
    return _small_node_type.__wrapped__(entry.inline)


@functools.lru_cache(maxsize=256)
def _small_node_type(inline: bytes) -> str | None:
    try:
        doc = json.loads(inline)
    except (ValueError, RecursionError):
        return None
    found = doc.get("node_type") if isinstance(doc, dict) else None
    return found if isinstance(found, str) else None


def _node_ids(objects: Any, root: RootTree | str) -> dict[str, str]:
    """Node path -> :attr:`NodeTree.inline_id` of every node of a root tree (or its id): what
    each node holds, however it is stored. A root this process just wrote is in the index
    already (seeded), so nothing is read back."""
    root_id = root if isinstance(root, str) else root.id
    return {path: tree.inline_id for path, (_tid, tree) in SnapshotIndex.of(objects, root_id).node_trees().items()}


def _by_node(entries: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Store keys grouped by the zarr node they belong to ('' is the root group): the
    deepest ``<node>/zarr.json`` above each key."""
    nodes = {k[: -len(METADATA_KEY)].rstrip("/") for k in entries
             if k == METADATA_KEY or k.endswith("/" + METADATA_KEY)}
    out: dict[str, dict[str, Any]] = {}
    for key, entry in entries.items():
        node = key.rsplit("/", 1)[0] if "/" in key else ""
        while node and node not in nodes:
            node = node.rsplit("/", 1)[0] if "/" in node else ""
        out.setdefault(node, {})[key] = entry
    return out


def check_head(url: str, branch: str, found: str | None, expected: str | None | AnyHead) -> None:
    """ConflictError naming both heads unless ``found`` (the head of ``branch``, None: no such
    branch) is the head the caller ``expected`` (None: a new branch; :data:`ANY_HEAD`: any)."""
    if expected is ANY_HEAD or found == expected:
        return
    if expected is None:
        raise ConflictError(
            f"Expected branch {branch!r} of {url!r} not to exist (this commit starts it). Got head {found} "
            "instead: another writer created it first. Nothing was written; commit on that head "
            "(expect_head=its id, or rebase=True) or pick another branch.")
    got = "no such branch (deleted)" if found is None else f"head {found}, committed by another writer since"
    raise ConflictError(
        f"Expected the head of branch {branch!r} of {url!r} to be {expected}. Got {got} instead; both "
        "versions are kept and nothing was written. Read the new head and commit on it (or rebase=True), "
        "or give each writer its own branch.")


def open_session(parts: StoreParts, branch: str, *, parent: str | None, inherit: bool,
                 gc_wait: float, on_wait: Callable[[str], None] | None = None,
                 expect_head: str | None | AnyHead = ANY_HEAD) -> WriteSession:
    """Take the writer lease *first*, then read the head and parent under it, so nothing
    read here (head, parent, the objects to dedup against) can be collected before the
    commit; a running gc is waited for up to ``gc_wait`` seconds. A head other than
    ``expect_head`` is a ConflictError (nothing written)."""
    lease = leases.acquire_writer(parts.storage, wait=gc_wait, on_wait=on_wait)
    lease.keep_alive()  # at once: reading a big parent's trees must not let the lease lapse
    try:
        head = parts.refs.head(branch)
        check_head(parts.url, branch, head[1] if head else None, expect_head)
        parent_id = parts.resolve(parent) if parent is not None else (head[1] if head else None)
        view = None
        if parent_id is not None:
            view = SnapshotChunks(parts.objects, parts.history.get(parent_id).root, parent_id)
        session = WriteSession(parts, branch, head[0] if head else -1, parent_id, view, inherit, lease,
                               head[1] if head else None)
    except BaseException:
        lease.release()
        raise
    return session
