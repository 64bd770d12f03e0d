"""The save side of DCP storage (:mod:`inshrink_store.torch.dcp`): :class:`InshrinkStorageWriter`.
Layer: torch, below Hugging Face and Lightning, above the facade (a client of the store).

The coordinator opens the write session in ``prepare_global_plan`` (the lease, then the head),
every rank writes its shards in ``write_data`` (:mod:`~inshrink_store.torch.dcp_rank`), and
``finish`` stages what the ranks wrote (:meth:`~inshrink_store.session.WriteSession.stage_array`,
:meth:`~inshrink_store.session.WriteSession.stage_group`) with DCP's metadata as the root
group's document, then commits. The steps and what a failure leaves are in
:mod:`inshrink_store.torch.dcp`.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import uuid
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult

from inshrink_store import repository
from inshrink_store.errors import ConflictError, InshrinkError, IntegrityError, InvalidInputError
from inshrink_store.policy import QuantConfig
from inshrink_store.rank_writer import ShardStore
from inshrink_store.repository import (
    GC_WAIT,
    Repository,
    SnapshotInfo,
    WriteSession,
    check_commit_fields,
    check_name,
)
from inshrink_store.torch.dcp_format import DOC_ATTR, Chunk, DcpDocument, TensorEntry, ValueEntry
from inshrink_store.torch.dcp_rank import RankSetup, RankWrite, quantize_targets
from inshrink_store.torch.dcp_reader import CheckpointIdIsTheUrl, checkpoint_url, previous_codebooks
from inshrink_store.torch.tensors import TORCH_DTYPES, torch

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["InshrinkStorageWriter"]


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


class InshrinkStorageWriter(CheckpointIdIsTheUrl, StorageWriter):
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
                 gc_wait: float = GC_WAIT, rebase: bool = False, process_group: ProcessGroup | None = None) -> None:
        super().__init__()
        if quantize is not None and not isinstance(quantize, QuantConfig):
            raise InvalidInputError(
                f"Expected quantize to be a QuantConfig (e.g. QuantConfig(bins=16)) or None for lossless. Got "
                f"{type(quantize).__name__} instead.")
        self.url, self.branch, self.quantize = checkpoint_url(url), check_name(branch, "branch"), quantize
        self.storage_options = dict(storage_options or {})
        self.gc_wait, self.rebase, self.process_group = gc_wait, bool(rebase), process_group
        self.set_commit(message=message, step=step, metrics=metrics, metadata=metadata)
        #: the version the last save on this (coordinator) writer committed
        self.last_commit: SnapshotInfo | None = None
        self.is_coordinator, self.rank = True, 0
        self._save_id = uuid.uuid4().hex
        self._repo: Repository | None = None
        self._shards: ShardStore | None = None
        self._held = _Held()
        weakref.finalize(self, self._held.abort)

    def __repr__(self) -> str:
        return f"InshrinkStorageWriter({self.url!r}, branch={self.branch!r})"

    def set_commit(self, *, message: str = "", step: int | None = None, metrics: Mapping[str, float] | None = None,
                   metadata: Mapping[str, Any] | None = None) -> None:
        """What the next version records; checked now, so a bad field fails before any write."""
        self._commit = check_commit_fields(message, step, metrics, metadata)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A new save; ``checkpoint_id`` (given to ``dcp.save``) is the store URL to write to."""
        if checkpoint_id:
            url = checkpoint_url(checkpoint_id)
            if url != self.url:
                self.url, self._repo, self._shards = url, None, None
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
            targets = None
            if self.quantize is not None:  # the tensors to quantize, with their previous codebooks
                targets = quantize_targets(plans, self.quantize, previous_codebooks(repo, session.parent))
            setup = RankSetup(session.parent, len(plans), self.quantize, targets).to_dict()
        except BaseException:
            self._held.abort()
            raise
        return [dataclasses.replace(plan, storage_data=setup) for plan in plans]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future[list[WriteResult]]:
        setup = RankSetup.from_plan(plan)
        parent = None if setup.parent is None else self._open().snapshot(setup.parent)
        arrays = self._shard_store().arrays(parent)
        results = RankWrite(arrays, setup, planner, self.process_group).run(plan.items)
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
            _stage(session, doc, results)
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

    def _shard_store(self) -> ShardStore:
        """This writer's object store (its own cache; objects are shared by content anyway)."""
        if self._shards is None:
            self._shards = ShardStore(self.url, self.storage_options, self._open().keyframe_interval)
        return self._shards


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


def _stage(session: WriteSession, doc: DcpDocument, results: list[list[WriteResult]]) -> None:
    """Every rank's arrays (each FQN's group comes with its first shard) and the root group,
    holding the document, into the session: all that the commit turns into trees. The ranks
    stored every object the arrays name while this session held its lease (or found it
    stored), so storage is not asked again."""
    for rank_results in results:
        for result in rank_results:
            data = result.storage_data
            if "array" not in data:
                continue
            path, node = data["array"], data["node"]
            if not isinstance(node.get("metadata"), str):
                raise InshrinkError(f"Expected the zarr.json of array {path!r} in a rank's write result. Got none.")
            session.stage_array(path, node["metadata"].encode(), node["chunks"], check_stored=False)
    session.stage_group("", {DOC_ATTR: doc.to_json()})
