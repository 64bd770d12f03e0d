"""The load side of DCP storage (:mod:`inshrink_store.torch.dcp`): the reader, its document.
Layer: torch, below Hugging Face and Lightning, above the facade (a client of the store).

:class:`InshrinkStorageReader`; the DCP document of a version (:func:`read_document`, and
:func:`previous_codebooks` for a save that continues its codebooks); the checks of a store
URL and checkpoint id both sides share.

A load reads one version: ``read_metadata`` turns its document into DCP's ``Metadata`` (where
each stored item is goes in ``storage_data``), and each rank reads only the regions of the
shards its part of the state needs (a resharded load reads the overlaps). Nothing is
unpickled: a value stored as ``torch.save`` bytes loads with ``weights_only=True``.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import uuid
from collections.abc import Mapping
from typing import Any

import fsspec
import numpy as np
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from inshrink_store import SnapshotReader, repository
from inshrink_store import dtypes as dtype_registry
from inshrink_store.errors import (
    ConflictError,
    FormatError,
    InshrinkError,
    IntegrityError,
    InvalidInputError,
    NotFoundError,
)
from inshrink_store.parallel import map_in_order
from inshrink_store.repository import Repository, SnapshotInfo
from inshrink_store.storage import local_path, protocol_of
from inshrink_store.torch.dcp_format import DOC_ATTR, Chunk, DcpDocument, TensorEntry, ValueEntry
from inshrink_store.torch.tensors import TORCH_DTYPES, array_to_tensor, torch

log = logging.getLogger(__name__)

__all__ = ["InshrinkStorageReader", "checkpoint_url", "previous_codebooks", "read_document",
           "valid_checkpoint_id"]

#: items a rank reads at once per step of a load (each waits on requests on an object store)
READ_WINDOW = 32
_TORCH_BY_NAME = {name: dt for dt, name in TORCH_DTYPES.items()}


def checkpoint_url(url: str | os.PathLike[str]) -> str:
    """``url`` (a store URL or path) as the string both sides open, or InvalidInputError."""
    if not isinstance(url, (str, os.PathLike)) or not os.fspath(url):
        raise InvalidInputError(f"Expected a store URL or path. Got {url!r} instead.")
    return os.fspath(url)


def valid_checkpoint_id(checkpoint_id: Any) -> bool:
    """A checkpoint id these classes take: a local path or a URL of a protocol fsspec knows."""
    if not isinstance(checkpoint_id, (str, os.PathLike)) or not os.fspath(checkpoint_id):
        return False
    url = str(os.fspath(checkpoint_id))
    return local_path(url) is not None or protocol_of(url) in fsspec.available_protocols()


class CheckpointIdIsTheUrl:
    """What torch's StorageReader and StorageWriter protocols ask of both sides alike: a
    checkpoint's id is the store URL (``self.url``), valid when :func:`valid_checkpoint_id`
    says so."""

    url: str

    @property
    def checkpoint_id(self) -> str:
        return self.url

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return valid_checkpoint_id(checkpoint_id)


def read_document(reader: SnapshotReader) -> DcpDocument:
    """The DCP document of a version, or NotFoundError if it was not saved through DCP."""
    found = reader.attributes.get(DOC_ATTR)
    if found is None:
        raise NotFoundError(
            f"Expected snapshot {reader.id[:12]} to be a torch.distributed.checkpoint save. Got a version saved "
            "another way (repo.save, Checkpointer) instead; read it with inshrink_store.torch.load_state.")
    return DcpDocument.from_json(found, f"the DCP document of snapshot {reader.id[:12]}", tuple(_TORCH_BY_NAME))


def previous_codebooks(repo: Repository, parent: str | None) -> dict[str, tuple[float, ...]]:
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


class InshrinkStorageReader(CheckpointIdIsTheUrl, StorageReader):
    """DCP ``StorageReader`` of one version (``ref``: a branch, tag, snapshot id or ``main~1``).

    Every rank resolves ``ref`` itself; if a commit moved it between two ranks' reads, the load
    fails with a ConflictError instead of mixing versions (pin a snapshot id to avoid it).
    A rank reads only the chunks its part of the state needs (resharding reads overlaps)."""

    def __init__(self, url: str | os.PathLike[str], ref: str = "main", *,
                 storage_options: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.url, self.ref = checkpoint_url(url), ref
        self.storage_options = dict(storage_options or {})
        self.snapshot_id: str | None = None
        self._reader: SnapshotReader | None = None
        self._where: Mapping[MetadataIndex, Any] = {}
        self._load_id = uuid.uuid4().hex

    def __repr__(self) -> str:
        return f"InshrinkStorageReader({self.url!r}, ref={self.ref!r})"

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A new load; ``checkpoint_id`` (given to ``dcp.load``) is the store URL to read from."""
        if checkpoint_id:
            self.url = checkpoint_url(checkpoint_id)
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
        local = not storage.is_remote
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
    region = tuple(slice(s, s + n) for s, n in zip(starts, lengths, strict=True))
    return reader.read_region(chunk.array, region)


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

