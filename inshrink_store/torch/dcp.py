"""``torch.distributed.checkpoint`` (DCP) storage: every rank writes its shards, one version.

``dcp.save(state, storage_writer=InshrinkStorageWriter(url))`` and
``dcp.load(state, storage_reader=InshrinkStorageReader(url))`` work as with DCP's own
storage, resharding included (save on 8 ranks, load on 2); the checkpoint is one version of
a branch, with dedup, delta coding and (``quantize=QuantConfig(...)``) quantization.
The layout is in :mod:`~inshrink_store.torch.dcp_format`.

How a save runs, in DCP's order:

1. ``prepare_global_plan`` (the coordinator) opens the write session: it takes the store's
   writer lease, then reads the branch head (the parent). The lease is taken before any rank
   writes anything, and gc neither starts nor deletes while it is held, so no object a rank
   writes, or skips because the store has it, can be collected before the commit. The
   parent, and with ``quantize`` which tensors to quantize, reach every rank in its plan.
2. ``write_data`` (every rank): with ``quantize``, each rank sketches its shards of the
   tensors to quantize and the sketches are gathered over the process group (JSON in uint8
   tensors, :mod:`~inshrink_store.torch.dcp_comm`), so every shard of a tensor gets one
   codebook and one set of thresholds (:mod:`~inshrink_store.torch.dcp_quant`). Then each
   rank writes its shards as zarr arrays: chunk objects straight into the store
   (write-once, content-addressed: ranks need no coordination), unchanged lossless shards
   adopted from the parent without encoding. What the coordinator needs to commit, each
   array's zarr.json and chunk ids, goes back in the ``WriteResult``\\ s as JSON-native data.
3. ``finish`` (the coordinator, only if every rank succeeded): the arrays, the group
   documents and DCP's metadata as JSON become the version's trees; the session commits
   (fence, then the branch ref created exclusively). ``dcp.save`` returns DCP's ``Metadata``
   on every rank with ``storage_data = {"snapshot": id, "branch": ..., "url": ...}``.

A rank that fails leaves no visible version and the previous one intact: DCP skips
``finish``, nothing names what was written, and gc removes it later. The coordinator's
lease stays held until the writer's next save, :meth:`InshrinkStorageWriter.abort`, or the
writer being dropped (gc waits for it meanwhile, which is safe, never lossy).

Nothing is pickled into the store, and reading never unpickles: see ``dcp_format``.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import threading
import uuid
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import fsspec
import numpy as np
import zarr
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from zarr.storage import MemoryStore

from inshrink_store import dtypes as dtype_registry
from inshrink_store import repository
from inshrink_store.cas import ObjectStore
from inshrink_store.errors import (
    ConflictError,
    FormatError,
    InshrinkError,
    IntegrityError,
    InvalidInputError,
    NotFoundError,
)
from inshrink_store.history import SnapshotInfo
from inshrink_store.index import METADATA_KEY, Entry, SnapshotIndex
from inshrink_store.layout import check_id
from inshrink_store.manifest import check_commit_fields
from inshrink_store.parallel import map_in_order
from inshrink_store.plans import ArrayPlan
from inshrink_store.policy import QuantConfig
from inshrink_store.policy.planner import array_plan
from inshrink_store.policy.sketch import LogSketch
from inshrink_store.reader import SnapshotReader
from inshrink_store.refs import check_name
from inshrink_store.repository import GC_WAIT, Repository
from inshrink_store.session import WriteSession
from inshrink_store.storage import open_storage
from inshrink_store.storage.base import protocol_of
from inshrink_store.torch import dcp_quant
from inshrink_store.torch.dcp_comm import gather_json
from inshrink_store.torch.dcp_format import (
    DOC_ATTR,
    Chunk,
    DcpDocument,
    TensorEntry,
    ValueEntry,
    bytes_path,
    plain_value,
    shard_path,
)
from inshrink_store.torch.tensors import (
    TORCH_DTYPES,
    array_to_tensor,
    infer_module_kinds,
    tensor_to_array,
    torch,
)
from inshrink_store.writer import write_arrays
from inshrink_store.zarr_store import InshrinkStore, PendingChunks, SnapshotChunks

log = logging.getLogger(__name__)

__all__ = ["InshrinkStorageReader", "InshrinkStorageWriter"]

#: bytes of shards a rank turns into arrays per step (bounds device -> host copies held at once)
WRITE_BATCH_BYTES = 256 << 20
#: items a rank reads at once per step of a load (each waits on requests on an object store)
READ_WINDOW = 32
_TORCH_BY_NAME = {name: dt for dt, name in TORCH_DTYPES.items()}


def _url(url: str | os.PathLike[str]) -> str:
    if not isinstance(url, (str, os.PathLike)) or not os.fspath(url):
        raise InvalidInputError(f"Expected a store URL or path. Got {url!r} instead.")
    return os.fspath(url)


def _validate_id(checkpoint_id: Any) -> bool:
    """A checkpoint id these classes take: a local path or a URL of a protocol fsspec knows."""
    if not isinstance(checkpoint_id, (str, os.PathLike)) or not os.fspath(checkpoint_id):
        return False
    protocol = protocol_of(str(os.fspath(checkpoint_id)))
    return protocol in ("file", "local") or protocol in fsspec.available_protocols()


def _group_doc(attributes: Mapping[str, Any]) -> bytes:
    """The zarr.json of a group with these attributes, as zarr itself writes it."""
    written: dict[str, Any] = {}
    zarr.create_group(store=MemoryStore(store_dict=written), attributes=dict(attributes))
    return bytes(written[METADATA_KEY].to_bytes())


@cache
def _empty_group_doc() -> bytes:
    return _group_doc({})


# -- the save --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Setup:
    """What the coordinator hands every rank in its plan (``SavePlan.storage_data``)."""

    parent: str | None
    world: int
    quantize: QuantConfig | None
    targets: Mapping[str, dcp_quant.Target] | None

    def to_dict(self) -> dict[str, Any]:
        return {"parent": self.parent, "world": self.world,
                "quantize": None if self.quantize is None else self.quantize.to_dict(),
                "targets": None if self.targets is None else {f: t.to_dict() for f, t in self.targets.items()}}

    @classmethod
    def from_plan(cls, plan: SavePlan) -> _Setup:
        data = plan.storage_data
        if not isinstance(data, dict) or "parent" not in data:
            raise InvalidInputError(
                "Expected a plan prepared by InshrinkStorageWriter.prepare_global_plan. Got storage_data "
                f"{data!r:.80} instead: pass the same kind of storage_writer on every rank.")
        quantize = None if data["quantize"] is None else QuantConfig.from_dict(data["quantize"])
        targets = None if data["targets"] is None else {
            f: dcp_quant.Target.from_dict(t) for f, t in data["targets"].items()}
        return cls(data["parent"], int(data["world"]), quantize, targets)


class _Held:
    """The coordinator's open write session, kept apart from the writer: a finalizer holds
    this (not the writer), so a writer dropped after a failed save still frees its lease."""

    def __init__(self) -> None:
        self.session: WriteSession | None = None
        self._lock = threading.Lock()

    def take(self) -> WriteSession | None:
        with self._lock:
            session, self.session = self.session, None
            return session

    def abort(self) -> None:
        session = self.take()
        if session is not None:
            session.abort()


class _ParentEntries(Mapping[str, Entry]):
    """The parent's entries, each read when asked for: only the node trees of the keys asked
    about are read (a rank asks about its own shards, not the whole checkpoint)."""

    def __init__(self, index: SnapshotIndex) -> None:
        self._index = index

    def __getitem__(self, key: str) -> Entry:
        found = self._index.entry(key)
        if found is None:
            raise KeyError(key)
        return found

    def __iter__(self) -> Iterator[str]:
        return iter(self._index.entries())

    def __len__(self) -> int:
        return len(self._index.entries())


class _RankChunks(PendingChunks):
    """One rank's pending arrays over the parent version. Unlike a write session's view, it
    reads the parent's trees only for the arrays this rank writes (adoption and delta bases),
    not all of them: with N ranks, each reads 1/N of the parent's trees."""

    def __init__(self, objects: ObjectStore, parent: SnapshotChunks | None) -> None:
        super().__init__(objects, None, inherit=False)
        self.parent = parent
        if parent is not None:
            self._parent_entries = _ParentEntries(parent.index)


class _ShardPlans(Mapping[str, ArrayPlan]):
    """Quantized shards' plans, made when the writer asks (one shard in memory at a time)."""

    def __init__(self, arrays: Mapping[str, np.ndarray], dtypes: Mapping[str, str],
                 decisions: Mapping[str, dcp_quant.TensorQuantization], config: QuantConfig) -> None:
        self._arrays, self._dtypes, self._decisions, self._config = arrays, dtypes, decisions, config

    def __getitem__(self, path: str) -> ArrayPlan:
        q, dtype = self._decisions[path], self._dtypes[path]
        values = dtype_registry.get(dtype).to_float32(self._arrays[path])
        return array_plan(dcp_quant.quantize_shard(values, q, dtype, self._config), dtype,
                          self._config.protected_dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self._decisions)

    def __len__(self) -> int:
        return len(self._decisions)


class InshrinkStorageWriter(StorageWriter):
    """DCP ``StorageWriter``: one ``dcp.save`` becomes one version of ``branch`` at ``url``.

    ``quantize``: a :class:`~inshrink_store.policy.QuantConfig` stores the ``model.*`` tensors
    (or every float tensor when the state has no ``model`` part) quantized, each with one
    codebook shared by all its shards; None (the default) stores every tensor bit-exact. The
    coordinator's setting is the one every rank follows. ``message``, ``step``, ``metrics``
    and ``metadata`` go into the version (set them per save with :meth:`set_commit`).
    ``process_group``: the group passed to ``dcp.save`` (quantization exchanges sketches over
    it). ``gc_wait``: how long the coordinator waits for a running gc; ``rebase``: commit on
    top of a branch head another writer moved meanwhile instead of failing.
    """

    def __init__(self, url: str | os.PathLike[str], branch: str = "main", *, quantize: QuantConfig | None = None,
                 storage_options: Mapping[str, Any] | None = None, message: str = "", step: int | None = None,
                 metrics: Mapping[str, float] | None = None, metadata: Mapping[str, Any] | None = None,
                 gc_wait: float = GC_WAIT, rebase: bool = False, process_group: Any = None) -> None:
        super().__init__()
        if quantize is not None and not isinstance(quantize, QuantConfig):
            raise InvalidInputError(
                f"Expected quantize to be a QuantConfig (e.g. QuantConfig(bins=16)) or None for lossless. Got "
                f"{type(quantize).__name__} instead.")
        self.url, self.branch, self.quantize = _url(url), check_name(branch, "branch"), quantize
        self.storage_options = dict(storage_options or {})
        self.gc_wait, self.rebase, self.process_group = gc_wait, bool(rebase), process_group
        self.set_commit(message=message, step=step, metrics=metrics, metadata=metadata)
        #: the version the last save on this (coordinator) writer committed
        self.last_commit: SnapshotInfo | None = None
        self.is_coordinator, self.rank = True, 0
        self._save_id = uuid.uuid4().hex
        self._repo: Repository | None = None
        self._objects: ObjectStore | None = None
        self._held = _Held()
        weakref.finalize(self, self._held.abort)

    def __repr__(self) -> str:
        return f"InshrinkStorageWriter({self.url!r}, branch={self.branch!r})"

    def set_commit(self, *, message: str = "", step: int | None = None, metrics: Mapping[str, float] | None = None,
                   metadata: Mapping[str, Any] | None = None) -> None:
        """What the next version records; checked now, so a bad field fails before any write."""
        self._commit = check_commit_fields(message, step, metrics, metadata)

    @property
    def checkpoint_id(self) -> str:
        return self.url

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _validate_id(checkpoint_id)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A new save; ``checkpoint_id`` (given to ``dcp.save``) is the store URL to write to."""
        if checkpoint_id:
            url = _url(checkpoint_id)
            if url != self.url:
                self.url, self._repo, self._objects = url, None, None
        self._save_id = uuid.uuid4().hex

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.url, save_id=self._save_id)

    def abort(self) -> None:
        """Give up a save that failed on some rank: release the coordinator's writer lease now
        (the next save or dropping the writer does it too). Nothing is committed."""
        self._held.abort()

    # -- DCP's calls, in order --------------------------------------------------------------------
    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not kwargs.get("use_collectives", True):
            raise InvalidInputError(
                "Expected dcp.save(..., use_collectives=True) with InshrinkStorageWriter. Got use_collectives=False "
                "instead: one version needs the coordinator to collect every rank's writes.")
        self._held.abort()  # a lease left by a save that failed on another rank
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0) or 0)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Refuse what cannot be stored (a dtype without a logical name, a sparse tensor) on the
        rank that holds it, before anything is written."""
        for item in plan.items:
            data = item.tensor_data
            if data is None:
                continue
            if data.properties.dtype not in TORCH_DTYPES:
                raise InvalidInputError(
                    f"Expected tensor {item.index.fqn!r} to have a dtype inshrink-store stores "
                    f"({', '.join(TORCH_DTYPES.values())}). Got {data.properties.dtype} instead; convert it.")
            if data.properties.layout != torch.strided:
                raise InvalidInputError(
                    f"Expected tensor {item.index.fqn!r} to be dense. Got layout {data.properties.layout} instead; "
                    "convert it with .to_dense().")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Open the write session (the lease first, then the head) and tell every rank the parent."""
        repo = self._open(create=True)
        self._held.abort()
        session = repo.transaction(self.branch, inherit=False, gc_wait=self.gc_wait)
        self._held.session = session
        try:
            targets = self._targets(plans, repo, session.parent) if self.quantize is not None else None
            setup = _Setup(session.parent, len(plans), self.quantize, targets).to_dict()
        except BaseException:
            self._held.abort()
            raise
        return [dataclasses.replace(plan, storage_data=setup) for plan in plans]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future[list[WriteResult]]:
        setup = _Setup.from_plan(plan)
        results = _RankWrite(self, setup, planner).run(plan.items)
        future: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Commit one version holding every rank's arrays and DCP's metadata as JSON."""
        session = self._held.take()
        if session is None:
            raise ConflictError(
                f"Expected the write session opened by prepare_global_plan on {self.url!r}. Got none (aborted, "
                "or finish called twice) instead; save again.")
        try:
            metadata.version = metadata.version or CURRENT_DCP_VERSION
            doc = _document(metadata, results, self.quantize)
            _stage(session.view, doc, results)
            message, step, metrics, meta = self._commit
            info = session.commit(message=message, step=step, metrics=metrics, metadata=meta, rebase=self.rebase)
        finally:
            session.abort()  # a no-op once committed
        self.last_commit = info
        metadata.storage_data = {"snapshot": info.id, "branch": self.branch, "url": self.url}

    # -- helpers ----------------------------------------------------------------------------------
    def _open(self, create: bool = False) -> Repository:
        if self._repo is None:
            self._repo = repository.open(self.url, create=create, storage_options=self.storage_options or None)
        return self._repo

    def _object_store(self) -> ObjectStore:
        """This writer's object store (its own cache; objects are shared by content anyway)."""
        if self._objects is None:
            repo = self._open()
            self._objects = ObjectStore(open_storage(self.url, self.storage_options or None),
                                        keyframe_interval=repo.keyframe_interval)
        return self._objects

    def _targets(self, plans: Sequence[SavePlan], repo: Repository,
                 parent: str | None) -> dict[str, dcp_quant.Target]:
        """The tensors to quantize, as the global plan shows them, with their previous codebooks."""
        assert self.quantize is not None
        tensors = {item.index.fqn: (TORCH_DTYPES[item.tensor_data.properties.dtype], tuple(item.tensor_data.size))
                   for plan in plans for item in plan.items if item.tensor_data is not None}
        kinds = infer_module_kinds({fqn: np.empty((0,) * len(size)) for fqn, (_, size) in tensors.items()})
        return dcp_quant.targets(tensors, self.quantize, _previous_codebooks(repo, parent), kinds)


def _previous_codebooks(repo: Repository, parent: str | None) -> dict[str, tuple[float, ...]]:
    """FQN -> codebook of the quantized tensors of the parent, if it is a DCP checkpoint."""
    if parent is None:
        return {}
    try:
        doc = read_document(repo.checkout(parent))
    except NotFoundError:
        return {}  # saved without DCP: no codebooks to continue
    except InshrinkError as exc:
        log.warning("snapshot %s: its DCP document is unreadable (%s); fitting fresh codebooks", parent[:12], exc)
        return {}
    found = {}
    for fqn, entry in doc.tensors.items():
        codebook = (entry.quantization or {}).get("codebook")
        if isinstance(codebook, list) and all(isinstance(c, (int, float)) for c in codebook):
            found[fqn] = tuple(float(c) for c in codebook)
    return found


class _RankWrite:
    """One rank's part of a save: quantization decisions, then its shards as arrays."""

    def __init__(self, writer: InshrinkStorageWriter, setup: _Setup, planner: SavePlanner) -> None:
        self.writer, self.setup, self.planner = writer, setup, planner
        objects = writer._object_store()
        parent_view = None
        if setup.parent is not None:
            parent_view = SnapshotChunks(objects, writer._open().snapshot(setup.parent).root, setup.parent)
        self.view = _RankChunks(objects, parent_view)
        self.store = InshrinkStore(self.view)

    def run(self, items: Sequence[WriteItem]) -> list[WriteResult]:
        tensors = [i for i in items if i.type != WriteItemType.BYTE_IO]
        decisions = self._decisions(tensors)
        for batch in _batches(tensors):
            self._write_tensors(batch, decisions)
        values = {item.index: self._value(item) for item in items if item.type == WriteItemType.BYTE_IO}
        nodes = _nodes(self.view)
        results = []
        for item in items:
            if item.type == WriteItemType.BYTE_IO:
                data = values[item.index]
                if "array" in data:
                    data = {**data, "node": nodes[data["array"]]}
                results.append(WriteResult(item.index, 0, data))
                continue
            path = shard_path(item.index.fqn, _offsets(item))
            data = {"array": path, "node": nodes[path]}
            if item.index.fqn in decisions:
                data["quantization"] = decisions[item.index.fqn].to_dict()
            results.append(WriteResult(item.index, item.tensor_storage_size() or 0, data))
        return results

    def _array(self, item: WriteItem) -> tuple[np.ndarray, str]:
        return tensor_to_array(self.planner.resolve_data(item), item.index.fqn, copy=False)

    def _decisions(self, tensors: Sequence[WriteItem]) -> dict[str, dcp_quant.TensorQuantization]:
        """With quantization on: sketch this rank's shards, gather every rank's sketches, and
        decide each tensor this rank holds. Every rank takes part, holding shards or not."""
        setup = self.setup
        if not setup.targets or setup.quantize is None:
            return {}  # the same on every rank: the coordinator decided it
        targets = setup.targets
        mine = [item for item in tensors if item.index.fqn in targets]

        def sketch() -> dict[str, Any]:
            sketches: dict[str, Any] = {}
            for item in mine:
                array, name = self._array(item)
                local = LogSketch.from_values(dtype_registry.get(name).to_float32(array))
                fqn = item.index.fqn
                sketches[fqn] = sketches[fqn].merge(local) if fqn in sketches else local
            return {fqn: dcp_quant.sketch_to_json(s) for fqn, s in sorted(sketches.items())}

        gathered = gather_json("sketch its shards of the tensors to quantize", sketch, self.writer.process_group)
        if len(gathered) != setup.world:
            raise InvalidInputError(
                f"Expected the quantization exchange to reach the {setup.world} ranks of dcp.save. Got "
                f"{len(gathered)} instead: pass dcp.save's process_group to InshrinkStorageWriter(process_group=...).")
        merged = dcp_quant.merge_sketches(
            {f: dcp_quant.sketch_from_json(s) for f, s in ranks.items()} for ranks in gathered)
        return dcp_quant.decide(targets, merged, setup.quantize, {item.index.fqn for item in mine})

    def _write_tensors(self, items: Sequence[WriteItem], decisions: Mapping[str, dcp_quant.TensorQuantization]) -> None:
        arrays, dtypes, by_path = {}, {}, {}
        for item in items:
            path = shard_path(item.index.fqn, _offsets(item))
            arrays[path], dtypes[path] = self._array(item)
            if item.index.fqn in decisions:
                by_path[path] = decisions[item.index.fqn]
        plans = None
        if by_path:
            assert self.setup.quantize is not None
            plans = _ShardPlans(arrays, dtypes, by_path, self.setup.quantize)
        write_arrays(self.store, arrays, dtypes=dtypes, plans=plans)

    def _value(self, item: WriteItem) -> dict[str, Any]:
        """A non-tensor value: inline JSON when plain, else its torch.save bytes as an array.
        Either way it must load with ``weights_only=True``, so what is stored always reads back."""
        fqn = item.index.fqn
        data = self.planner.resolve_data(item)
        raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
        try:
            value = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
        except Exception as exc:  # torch's unpickler refuses code with several error types
            raise InvalidInputError(
                f"Expected state value {fqn!r} to load with torch.load(weights_only=True) (tensors, containers and "
                f"plain Python values). Got {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} "
                "instead; inshrink-store never stores what only pickle can read: convert it.") from None
        skeleton = plain_value(value)
        if skeleton is not None:
            return {"value": skeleton}
        path = bytes_path(fqn)
        write_arrays(self.store, {path: np.frombuffer(raw, np.uint8)}, dtypes={path: "U8"})
        return {"array": path}


def _offsets(item: WriteItem) -> tuple[int, ...]:
    assert item.tensor_data is not None
    return tuple(int(o) for o in item.tensor_data.chunk.offsets)


def _batches(items: Sequence[WriteItem]) -> Iterator[list[WriteItem]]:
    """Items in plan order, in groups of about :data:`WRITE_BATCH_BYTES`."""
    batch: list[WriteItem] = []
    size = 0
    for item in items:
        batch.append(item)
        size += item.tensor_storage_size() or 0
        if size >= WRITE_BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _nodes(view: PendingChunks) -> dict[str, dict[str, Any]]:
    """Array path -> {"metadata": zarr.json text, "chunks": key -> object id} of every array
    a rank wrote (each is ``<fqn>/<name>``: two components), in one pass over its keys."""
    nodes: dict[str, dict[str, Any]] = {}
    for key, entry in view.entries.items():
        parts = key.split("/", 2)
        if len(parts) < 3:
            continue  # the root's and the FQN groups' zarr.json
        node = nodes.setdefault(f"{parts[0]}/{parts[1]}", {"metadata": None, "chunks": {}})
        if parts[2] == METADATA_KEY and entry.inline is not None:
            node["metadata"] = entry.inline.decode()
        elif entry.oid is not None:
            node["chunks"][parts[2]] = entry.oid
    return nodes


# -- the commit ----------------------------------------------------------------------------------
def _by_index(results: list[list[WriteResult]]) -> dict[tuple[str, tuple[int, ...] | None], dict[str, Any]]:
    found = {}
    for rank_results in results:
        for result in rank_results:
            offset = None if result.index.offset is None else tuple(int(o) for o in result.index.offset)
            found[(result.index.fqn, offset)] = result.storage_data
    return found


def _shared_quantization(fqn: str, datas: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The one set of decisions every shard of ``fqn`` was written with (checked equal)."""
    decided = [d.get("quantization") for d in datas]
    if any(q != decided[0] for q in decided):
        raise IntegrityError(
            f"Expected every shard of tensor {fqn!r} to be quantized with one codebook. Got {len(decided)} shards "
            "with differing decisions instead: the ranks computed different results (report this as a bug); "
            "nothing was committed.")
    return decided[0] if decided else None


def _document(metadata: Metadata, results: list[list[WriteResult]], quantize: QuantConfig | None) -> DcpDocument:
    """DCP's metadata and the ranks' results as the JSON document of the version."""
    written = _by_index(results)
    tensors, values = {}, {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            data = _result(written, fqn, None)
            values[fqn] = (ValueEntry("json", value=data["value"]) if "value" in data
                           else ValueEntry("torch", array=data["array"]))
            continue
        assert isinstance(md, TensorStorageMetadata)
        datas = [_result(written, fqn, tuple(int(o) for o in c.offsets)) for c in md.chunks]
        chunks = tuple(Chunk(tuple(int(o) for o in c.offsets), tuple(int(s) for s in c.sizes), d["array"])
                       for c, d in zip(md.chunks, datas, strict=True))
        tensors[fqn] = TensorEntry(TORCH_DTYPES[md.properties.dtype], tuple(int(s) for s in md.size), chunks,
                                   bool(md.properties.requires_grad), _shared_quantization(fqn, datas))
    meta = metadata.storage_meta
    storage_meta = None if meta is None else {
        "checkpoint_id": None if meta.checkpoint_id is None else os.fspath(meta.checkpoint_id),
        "save_id": meta.save_id, "modules": list(meta.modules)}
    return DcpDocument(tensors, values, metadata.planner_data, storage_meta, metadata.version,
                       None if quantize is None else quantize.to_dict())


def _result(written: Mapping[Any, dict[str, Any]], fqn: str, offset: tuple[int, ...] | None) -> dict[str, Any]:
    data = written.get((fqn, offset))
    if not isinstance(data, dict):
        where = "" if offset is None else f" at offsets {list(offset)}"
        raise InshrinkError(
            f"Expected a write result for {fqn!r}{where} from some rank. Got {'none' if data is None else data!r} "
            "instead; nothing was committed. Was every rank's storage_writer an InshrinkStorageWriter?")
    return data


def _stage(view: PendingChunks, doc: DcpDocument, results: list[list[WriteResult]]) -> None:
    """Every rank's arrays, their groups and the root group (holding the document) into the
    session's view: all that the commit turns into trees."""
    groups = set()
    for rank_results in results:
        for result in rank_results:
            data = result.storage_data
            if "array" not in data:
                continue
            path, node = data["array"], data["node"]
            if not isinstance(node.get("metadata"), str):
                raise InshrinkError(f"Expected the zarr.json of array {path!r} in a rank's write result. Got none.")
            view.entries[f"{path}/{METADATA_KEY}"] = Entry(inline=node["metadata"].encode())
            for key, oid in node["chunks"].items():
                view.entries[f"{path}/{key}"] = Entry(oid=check_id(oid, "object", f"the write result of {path!r}"))
            groups.add(path.split("/", 1)[0])
    for group in sorted(groups):
        view.entries[f"{group}/{METADATA_KEY}"] = Entry(inline=_empty_group_doc())
    view.entries[METADATA_KEY] = Entry(inline=_group_doc({DOC_ATTR: doc.to_json()}))


# -- the load --------------------------------------------------------------------------------------
def read_document(reader: SnapshotReader) -> DcpDocument:
    """The DCP document of a version, or NotFoundError if it was not saved through DCP."""
    found = reader.attributes.get(DOC_ATTR)
    if found is None:
        raise NotFoundError(
            f"Expected snapshot {reader.id[:12]} to be a torch.distributed.checkpoint save. Got a version saved "
            "another way (repo.save, Checkpointer) instead; read it with inshrink_store.torch.load_state.")
    return DcpDocument.from_json(found, f"the DCP document of snapshot {reader.id[:12]}", tuple(_TORCH_BY_NAME))


def _metadata(doc: DcpDocument, load_id: str) -> Metadata:
    """DCP's ``Metadata`` from the document; ``storage_data`` maps each stored item to where it is."""
    entries: dict[str, Any] = {}
    where: dict[MetadataIndex, Any] = {}
    for fqn, tensor in doc.tensors.items():
        props = TensorProperties(dtype=_TORCH_BY_NAME[tensor.dtype], requires_grad=tensor.requires_grad)
        entries[fqn] = TensorStorageMetadata(
            props, torch.Size(tensor.size),
            [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in tensor.chunks])
        for c in tensor.chunks:
            where[MetadataIndex(fqn, c.offsets)] = (tensor, c)
    for fqn, value in doc.values.items():
        entries[fqn] = BytesStorageMetadata()
        where[MetadataIndex(fqn)] = value
    meta = dict(doc.storage_meta or {})
    storage_meta = StorageMeta(checkpoint_id=meta.get("checkpoint_id"), save_id=meta.get("save_id"),
                               load_id=load_id, modules=list(meta.get("modules") or []))
    return Metadata(entries, planner_data=doc.planner_data, storage_data=where, storage_meta=storage_meta,
                    version=doc.version)


class InshrinkStorageReader(StorageReader):
    """DCP ``StorageReader`` of one version (``ref``: a branch, tag, snapshot id or ``main~1``).

    Every rank resolves ``ref`` itself; if a commit moved it between two ranks' reads, the load
    fails with a ConflictError instead of mixing versions (pin a snapshot id to avoid it).
    A rank reads only the chunks its part of the state needs (resharding reads overlaps)."""

    def __init__(self, url: str | os.PathLike[str], ref: str = "main", *,
                 storage_options: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.url, self.ref = _url(url), ref
        self.storage_options = dict(storage_options or {})
        self.snapshot_id: str | None = None
        self._reader: SnapshotReader | None = None
        self._where: Mapping[MetadataIndex, Any] = {}
        self._load_id = uuid.uuid4().hex

    def __repr__(self) -> str:
        return f"InshrinkStorageReader({self.url!r}, ref={self.ref!r})"

    @property
    def checkpoint_id(self) -> str:
        return self.url

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return _validate_id(checkpoint_id)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A new load; ``checkpoint_id`` (given to ``dcp.load``) is the store URL to read from."""
        if checkpoint_id:
            self.url = _url(checkpoint_id)
        self._reader, self.snapshot_id, self._where = None, None, {}
        self._load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise NotFoundError("Expected no rank-local DCP metadata in an inshrink store: a save makes one version.")
        repo = repository.open(self.url, storage_options=self.storage_options or None)
        self._reader = repo.checkout(self.ref)
        self.snapshot_id = self._reader.id
        return _metadata(read_document(self._reader), self._load_id)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not isinstance(metadata.storage_data, dict):
            raise InvalidInputError(
                "Expected the Metadata returned by InshrinkStorageReader.read_metadata. Got storage_data "
                f"{type(metadata.storage_data).__name__} instead.")
        self._where = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return dataclasses.replace(plan, storage_data=self.snapshot_id)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Every rank must read the same version: a ref that moved between their reads fails."""
        seen = sorted({str(plan.storage_data) for plan in plans})
        if len(seen) > 1:
            raise ConflictError(
                f"Expected every rank to load one version of {self.ref!r} from {self.url!r}. Got {len(seen)} "
                f"({', '.join(s[:12] for s in seen)}) instead: a commit landed while the ranks read it; load again "
                "or pin a snapshot id: InshrinkStorageReader(url, ref=<id>).")
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        reader = self._require_reader()
        storage = reader.view.objects.storage
        local = storage.is_local or storage.protocol == "memory"
        threads = (os.cpu_count() or 1) if local else 8
        items = list(plan.items)
        for start in range(0, len(items), READ_WINDOW):
            window = items[start:start + READ_WINDOW]
            fetched = map_in_order(lambda item: self._fetch(reader, item), window, threads, "inshrink-dcp-read")
            for item, value in zip(window, fetched, strict=True):
                _deliver(item, value, planner)
        future: torch.futures.Future[None] = torch.futures.Future()
        future.set_result(None)
        return future

    @property
    def info(self) -> SnapshotInfo:
        """The version this load reads (its step, message, metrics, metadata)."""
        info: SnapshotInfo = self._require_reader().info
        return info

    def _require_reader(self) -> SnapshotReader:
        if self._reader is None:
            raise InvalidInputError("Expected read_metadata() before read_data(): dcp.load calls it first.")
        return self._reader

    def _fetch(self, reader: SnapshotReader, item: ReadItem) -> Any:
        """What ``item`` asks for: a numpy region of one stored shard, or a Python value."""
        stored = self._where.get(item.storage_index)
        if stored is None:
            raise NotFoundError(
                f"Expected {item.storage_index.fqn!r} at offsets {list(item.storage_index.offset or [])} in snapshot "
                f"{reader.id[:12]}. Got nothing stored there instead.")
        if item.type == LoadItemType.BYTE_IO:
            return _python_value(reader, item.storage_index.fqn, stored)
        tensor, chunk = stored
        return tensor.dtype, _region(reader, item, tensor, chunk)


def _region(reader: SnapshotReader, item: ReadItem, tensor: TensorEntry, chunk: Chunk) -> np.ndarray:
    """The part of one stored shard that a read item needs, read from its chunks only."""
    info = reader.index.array(chunk.array)
    fqn = item.storage_index.fqn
    if info is None or info.shape != chunk.sizes or info.dtype != tensor.dtype:
        got = "no array" if info is None else f"shape {list(info.shape)}, dtype {info.dtype}"
        raise IntegrityError(
            f"Expected array {chunk.array!r} of snapshot {reader.id[:12]} to hold the shard of {fqn!r} at "
            f"{list(chunk.offsets)} (shape {list(chunk.sizes)}, dtype {tensor.dtype}). Got {got} instead: the "
            "checkpoint is corrupt. Run `inshrink verify`.")
    starts, lengths = [int(o) for o in item.storage_offsets], [int(n) for n in item.lengths]
    if len(starts) != len(chunk.sizes) or any(s + n > size for s, n, size in zip(starts, lengths, chunk.sizes, strict=True)):
        raise IntegrityError(f"Expected a read inside the shard of {fqn!r} at {list(chunk.offsets)}. Got offsets "
                             f"{starts}, lengths {lengths} instead.")
    if 0 in lengths:
        return np.zeros(lengths, dtype_registry.get(tensor.dtype).carrier)
    array = reader[chunk.array]
    region = tuple(slice(s, s + n) for s, n in zip(starts, lengths, strict=True))
    return np.asarray(reader._zarr(f"tensor {chunk.array!r}", lambda: array[region]))


def _python_value(reader: SnapshotReader, fqn: str, value: ValueEntry) -> Any:
    """A stored non-tensor value; torch.save bytes are only loaded with weights_only=True."""
    if value.encoding == "json":
        return value.python_value(f"value {fqn!r} of snapshot {reader.id[:12]}")
    assert value.array is not None
    raw = reader.read(value.array).tobytes()
    try:
        return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch's safe unpickler refuses anything that would run code
        raise IntegrityError(
            f"Expected value {fqn!r} of snapshot {reader.id[:12]} to load with torch.load(weights_only=True). Got "
            f"{type(exc).__name__} instead: refusing to unpickle it (the checkpoint is corrupt or hostile).") from None


def _deliver(item: ReadItem, value: Any, planner: LoadPlanner) -> None:
    """Hand one fetched item to DCP's planner: a value as fresh torch.save bytes (made here
    from what was loaded safely), a region copied into the destination tensor."""
    if item.type == LoadItemType.BYTE_IO:
        buffer = io.BytesIO()
        torch.save(value, buffer)
        buffer.seek(0)
        planner.load_bytes(item, buffer)
        return
    dtype, region = value
    source = array_to_tensor(region, dtype)
    target = planner.resolve_tensor(item).detach()
    if target.size() != source.size():
        raise FormatError(
            f"Expected {item.dest_index.fqn!r} to take a {list(source.size())} region. Got a destination of "
            f"{list(target.size())} instead.")
    target.copy_(source)
    planner.commit_tensor(item, target)

