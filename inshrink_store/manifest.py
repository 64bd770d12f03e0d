"""Snapshots and trees: the immutable JSON documents that describe one version.

A snapshot names its parent and a root tree; the root tree maps each Zarr node
path (group or array) to a node tree; a node tree holds the node's ``zarr.json``
text and its chunk keys -> object ids. Every document is canonical JSON and is
addressed by the xxh3-128 of its bytes, so an unchanged array keeps the same tree
id from version to version and a diff can skip it without reading a chunk.
"""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import xxhash

from inshrink_store.errors import FormatError, IntegrityError

FORMAT_VERSION = 1


def canonical_json(doc: Any) -> bytes:
    """Deterministic bytes for a JSON document: sorted keys, no spaces, no NaN."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def content_id(data: bytes | memoryview) -> str:
    """The address of any stored thing: xxh3-128 of its logical bytes, 32 hex digits."""
    return xxhash.xxh3_128_hexdigest(data)


def parse_document(data: bytes, kind: str, expected_id: str | None = None) -> dict[str, Any]:
    """Parse a stored JSON document, checking its id and format version."""
    if expected_id is not None and content_id(data) != expected_id:
        raise IntegrityError(
            f"Expected {kind} {expected_id} to hash to its id. Got {content_id(data)} instead: "
            "the stored document is corrupt. Run `inshrink verify`."
        )
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise IntegrityError(f"Expected {kind} {expected_id} to be JSON. Got {exc} instead.") from exc
    version = doc.get("format") if isinstance(doc, dict) else None
    if version != FORMAT_VERSION:
        raise FormatError(
            f"Expected {kind} format version {FORMAT_VERSION}. Got {version!r} instead; "
            "upgrade inshrink-store to read this store."
        )
    return doc


@dataclass(frozen=True)
class NodeTree:
    """One Zarr node: its zarr.json text (None if absent) and chunk key -> object id."""

    metadata: str | None
    chunks: Mapping[str, str] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        return canonical_json(
            {"format": FORMAT_VERSION, "metadata": self.metadata, "chunks": dict(self.chunks)}
        )

    @classmethod
    def from_bytes(cls, data: bytes, tree_id: str | None = None) -> NodeTree:
        doc = parse_document(data, "tree", tree_id)
        return cls(metadata=doc["metadata"], chunks=doc["chunks"])

    @property
    def id(self) -> str:
        return content_id(self.to_bytes())


@dataclass(frozen=True)
class RootTree:
    """Node path ('' for the root group) -> node tree id."""

    nodes: Mapping[str, str]

    def to_bytes(self) -> bytes:
        return canonical_json({"format": FORMAT_VERSION, "nodes": dict(self.nodes)})

    @classmethod
    def from_bytes(cls, data: bytes, tree_id: str | None = None) -> RootTree:
        doc = parse_document(data, "root tree", tree_id)
        return cls(nodes=doc["nodes"])

    @property
    def id(self) -> str:
        return content_id(self.to_bytes())


def utc_now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="microseconds")


@dataclass(frozen=True)
class Snapshot:
    """One committed version. ``metadata`` is the caller's JSON (search trials, config, ...)."""

    root: str
    parent: str | None
    time: str
    message: str = ""
    step: int | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        return canonical_json(
            {
                "format": FORMAT_VERSION,
                "root": self.root,
                "parent": self.parent,
                "time": self.time,
                "message": self.message,
                "step": self.step,
                "metrics": dict(self.metrics),
                "metadata": dict(self.metadata),
            }
        )

    @classmethod
    def from_bytes(cls, data: bytes, snapshot_id: str | None = None) -> Snapshot:
        doc = parse_document(data, "snapshot", snapshot_id)
        return cls(
            root=doc["root"],
            parent=doc["parent"],
            time=doc["time"],
            message=doc.get("message", ""),
            step=doc.get("step"),
            metrics=doc.get("metrics", {}),
            metadata=doc.get("metadata", {}),
        )

    @property
    def id(self) -> str:
        return content_id(self.to_bytes())
