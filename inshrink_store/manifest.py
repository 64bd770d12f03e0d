"""Snapshots and trees: the immutable JSON documents that describe one version.
Layer: documents (``manifest`` | ``dcp_document``), under ``cas``, above the codecs.

A snapshot names its parent and a root tree; the root tree maps each Zarr node
path (group or array) to a node tree; a node tree holds the node's ``zarr.json``
text and its chunk keys -> object ids. Every document is canonical JSON and is
addressed by the xxh3-128 of its bytes, so an unchanged array keeps the same tree
id from version to version and a diff can skip it without reading a chunk.
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NoReturn

import xxhash
import zstandard

from inshrink_store.codecs import _zstd
from inshrink_store.errors import FormatError, IntegrityError, InvalidInputError
from inshrink_store.layout import ID_PATTERN, check_id  # noqa: F401 - re-exported

FORMAT_VERSION = 1
#: trees are stored as one zstd frame of their canonical JSON (a tree written before that is
#: plain JSON and still read). Why: a tree is rewritten for every array that changes, in every
#: version; on small models (an LM of 0.3 M parameters with ~100 arrays) trees were a third of
#: all stored bytes. Level 19: a tree is a few KB, so even the strongest level takes well under
#: a millisecond, and the same document always gives the same bytes (same zstd library).
TREE_ZSTD_LEVEL = 19
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
#: snapshots are stored as one zstd frame of their canonical JSON too (a snapshot written
#: before that is plain JSON and still read). Why: the Checkpointer's metadata (the search's
#: trials, a record per Adam pair) made each snapshot 4-10 KB of JSON, 4-10 % of a small
#: model's stored history; a frame is about a sixth of it (the evaluation's LM: 242 KB of
#: snapshots over 24 versions -> 41 KB). Level 9, not 19: the metadata grows with the model
#: (MBs for thousands of tensors) and 19 took 20x as long for 4 % fewer bytes.
SNAPSHOT_ZSTD_LEVEL = 9
#: the largest tree a reader inflates (a tree lists one array's chunks: ~50 bytes each)
MAX_TREE_BYTES = 1 << 30
#: every snapshot, tree and object id: the xxh3-128 of the content, 32 lowercase hex digits
#: how a non-finite float is kept in strict JSON: {"$float": "nan" | "inf" | "-inf"}
FLOAT_KEY = "$float"
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
#: nesting limit for user metadata (checked on commit and on read; JSON parsers recurse)
MAX_DEPTH = 64


def _show(value: Any, limit: int = 80) -> str:
    """A short repr for error messages: a hostile document never floods (or leaks) a log."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def canonical_json(doc: Any) -> bytes:
    """Deterministic bytes for a JSON document: sorted keys, no spaces, no NaN."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def content_id(data: bytes | memoryview) -> str:
    """The address of any stored thing: xxh3-128 of its logical bytes, 32 hex digits."""
    return xxhash.xxh3_128_hexdigest(data)


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"the non-standard JSON constant {name}")


def pack_tree(document: bytes, level: int = TREE_ZSTD_LEVEL) -> bytes:
    """A tree's stored bytes: its canonical JSON as one zstd frame (see :data:`TREE_ZSTD_LEVEL`)."""
    return zstandard.ZstdCompressor(level=level, write_content_size=True).compress(document)


def _inflate(data: bytes, name: str) -> bytes:
    """A stored tree's JSON: decompressed (bounded) when it is a zstd frame, else as stored."""
    if bytes(data[:4]) != ZSTD_MAGIC:
        return data
    try:
        return _zstd.decompress(data, MAX_TREE_BYTES, name)
    except FormatError as exc:
        raise IntegrityError(f"{exc} The stored document is corrupt. Run `inshrink verify`.") from None


def parse_document(data: bytes, kind: str, expected_id: str | None = None, *,
                   compressed: bool = False, versions: tuple[int, ...] = (FORMAT_VERSION,)) -> dict[str, Any]:
    """Parse a stored JSON document, checking its id and format version.

    Anything that is not strict JSON holding an object (NaN literals, invalid UTF-8,
    nesting deeper than the parser allows) is an :class:`IntegrityError` naming ``kind``
    and id; a different ``format`` is a :class:`FormatError`. ``compressed``: the document
    may be stored as a zstd frame (trees); the id is the hash of the stored bytes.
    """
    name = _name(kind, expected_id)
    if expected_id is not None and content_id(data) != expected_id:
        raise IntegrityError(
            f"Expected {name} to hash to its id. Got {content_id(data)} instead: "
            "the stored document is corrupt. Run `inshrink verify`."
        )
    if compressed:
        data = _inflate(data, name)
    try:
        doc = json.loads(data, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        reason = "nesting too deep to parse" if isinstance(exc, RecursionError) else str(exc)
        raise IntegrityError(
            f"Expected {name} to be a strict JSON document. Got {_show(reason, 160)} instead: "
            "the stored document is corrupt. Run `inshrink verify`."
        ) from None
    if not isinstance(doc, dict):
        raise IntegrityError(
            f"Expected {name} to be a JSON object. Got a {type(doc).__name__} instead: "
            "the stored document is corrupt. Run `inshrink verify`."
        )
    version = doc.get("format")
    if type(version) is not int or version not in versions:
        wanted = " or ".join(str(v) for v in versions)
        raise FormatError(
            f"Expected {name} format version {wanted}. Got {_show(version)} instead; "
            "upgrade inshrink-store to read this store."
        )
    return doc


def _name(kind: str, doc_id: str | None) -> str:
    return f"{kind} {doc_id}" if doc_id is not None else f"{kind} (id unknown)"


def _bad(name: str, what: str, got: Any) -> NoReturn:
    raise IntegrityError(
        f"Expected {what} in {name}. Got {_show(got)} instead: the stored document is "
        "corrupt or was not written by inshrink-store. Run `inshrink verify`."
    )


def _check_fields(doc: dict[str, Any], name: str, required: set[str], optional: set[str]) -> None:
    missing = sorted(required - doc.keys())
    unknown = sorted(doc.keys() - required - optional)
    if missing or unknown:
        _bad(name, f"the fields {sorted(required)} (optionally {sorted(optional)})",
             f"missing {missing}, unknown {unknown}")


def check_key(key: Any, name: str, what: str, allow_root: bool = False) -> str:
    """A '/'-separated relative key: no leading '/', no empty, '.' or '..' segments.

    ``allow_root`` accepts ``""`` (the root node). IntegrityError naming ``name``.
    """
    if not isinstance(key, str) or (key == "" and not allow_root):
        _bad(name, f"a {what} that is a non-empty string", key)
    if key and any(part in ("", ".", "..") for part in key.split("/")):
        _bad(name, f"a safe {what} (no leading '/', no empty, '.' or '..' segments)", key)
    return key


def _id_map(value: Any, name: str, what: str, allow_root: bool) -> dict[str, str]:
    if not isinstance(value, dict):
        _bad(name, f"an object of {what} -> id", value)
    out = {}
    for key, oid in value.items():
        check_key(key, name, what, allow_root)
        out[key] = check_id(oid, "tree" if allow_root else "object", f"{name} ({what} {key!r})")
    return out


#: a node tree is kept inside its root tree (not written as a file of its own) when it lists
#: at most this many chunks and its zarr.json is at most :data:`INLINE_MAX_METADATA` bytes
INLINE_MAX_CHUNKS = 4
INLINE_MAX_METADATA = 8192
#: the root tree format that holds inline node trees (format 1 roots, without them, are
#: still written when a version has none, and read)
ROOT_INLINE_FORMAT = 2
#: the most bytes of zarr.json and chunk ids a root tree holds inline; nodes past it (in path
#: order) are tree files. Why: the root is rewritten in full by every commit and read in full
#: by every reader, and must stay far below what a reader inflates (MAX_TREE_BYTES)
INLINE_MAX_ROOT_BYTES = 64 << 20
#: zstd level of a root tree holding inline nodes. Why not 19: such a root holds every small
#: node's zarr.json, tens of KB for a few dozen tensors and MBs for thousands, and level 19
#: took 3 ms on 21 KB (CREPE's root) for 1.5 % fewer bytes than level 9, which takes 0.06 ms
ROOT_INLINE_ZSTD_LEVEL = 9


@dataclass(frozen=True)
class NodeTree:
    """One Zarr node: its zarr.json text (None if absent) and chunk key -> object id."""

    metadata: str | None
    chunks: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # a read-only copy: ids and stored bytes are cached, so the caller's dict must not move them
        object.__setattr__(self, "chunks", MappingProxyType(dict(self.chunks)))

    def __reduce__(self) -> tuple[Any, ...]:  # a read-only mapping does not pickle: rebuilt from a dict
        return (NodeTree, (self.metadata, dict(self.chunks)))

    def document(self) -> dict[str, Any]:
        """The node's JSON document (without the format field)."""
        return {"metadata": self.metadata, "chunks": dict(self.chunks)}

    def to_bytes(self) -> bytes:
        return self._stored

    @functools.cached_property
    def _stored(self) -> bytes:
        """The stored form, made once: a commit hashes a tree (its id) and then writes it,
        and packing is a zstd pass at a high level. A tree is immutable once built."""
        return pack_tree(canonical_json({"format": FORMAT_VERSION, **self.document()}))

    @classmethod
    def from_bytes(cls, data: bytes, tree_id: str | None = None) -> NodeTree:
        """Parse and validate: ``metadata`` text or null, ``chunks`` safe key -> object id."""
        doc = parse_document(data, "tree", tree_id, compressed=True)
        name = _name("tree", tree_id)
        _check_fields(doc, name, {"format", "metadata", "chunks"}, set())
        return cls.from_document(doc, name)

    @classmethod
    def from_document(cls, doc: Any, name: str) -> NodeTree:
        """A node from its checked document (``metadata`` and ``chunks``; ``format`` is the
        caller's); IntegrityError naming ``name`` for anything else."""
        if not isinstance(doc, dict):
            _bad(name, "a node as a JSON object", doc)
        metadata = doc.get("metadata")
        if metadata is not None and not isinstance(metadata, str):
            _bad(name, "metadata as zarr.json text or null", metadata)
        return cls(metadata=metadata, chunks=_id_map(doc.get("chunks"), name, "chunk key", False))

    @functools.cached_property
    def id(self) -> str:
        return content_id(self.to_bytes())

    @functools.cached_property
    def inline_id(self) -> str:
        """What names this node when its root tree holds it inline: the xxh3-128 of its
        canonical JSON, the same whether the node is stored inline or as a tree file (so
        it also tells whether two versions hold the same node, whichever way each keeps it).
        Never a storage address: no file has it."""
        return content_id(canonical_json({"format": FORMAT_VERSION, "inline": True, **self.document()}))

    @property
    def inlinable(self) -> bool:
        """Whether a root tree keeps this node inline: few chunks and a small zarr.json. Why:
        every node tree was a file of its own, and a checkpoint of many small tensors wrote
        two fsynced files per tensor (its one chunk and its tree), most of such a save; kept
        in the root, the zarr.json documents of a version are also compressed together."""
        return len(self.chunks) <= INLINE_MAX_CHUNKS and len(self.metadata or "") <= INLINE_MAX_METADATA


@dataclass(frozen=True)
class RootTree:
    """Node path ('' for the root group) -> node tree id, and the nodes kept inline (path ->
    :class:`NodeTree`, no file of their own; see :attr:`NodeTree.inlinable`)."""

    nodes: Mapping[str, str]
    inline: Mapping[str, NodeTree] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # read-only copies: the stored bytes and id are cached
        object.__setattr__(self, "nodes", MappingProxyType(dict(self.nodes)))
        object.__setattr__(self, "inline", MappingProxyType(dict(self.inline)))

    def __reduce__(self) -> tuple[Any, ...]:  # a read-only mapping does not pickle: rebuilt from dicts
        return (RootTree, (dict(self.nodes), dict(self.inline)))

    def to_bytes(self) -> bytes:
        return self._stored

    @functools.cached_property
    def _stored(self) -> bytes:
        """Made once: a commit hashes the root (its id), writes it and seeds the index with it."""
        if not self.inline:  # a root without inline nodes keeps format 1 (its id unchanged)
            return pack_tree(canonical_json({"format": FORMAT_VERSION, "nodes": dict(self.nodes)}))
        return pack_tree(canonical_json({
            "format": ROOT_INLINE_FORMAT, "nodes": dict(self.nodes),
            "inline": {path: tree.document() for path, tree in self.inline.items()}}), ROOT_INLINE_ZSTD_LEVEL)

    @classmethod
    def from_bytes(cls, data: bytes, tree_id: str | None = None) -> RootTree:
        """Parse and validate: ``nodes`` safe node path ('' = root) -> tree id; in format 2
        also ``inline`` safe node path -> node document, no path in both."""
        doc = parse_document(data, "root tree", tree_id, compressed=True,
                             versions=(FORMAT_VERSION, ROOT_INLINE_FORMAT))
        name = _name("root tree", tree_id)
        if doc["format"] == FORMAT_VERSION:
            _check_fields(doc, name, {"format", "nodes"}, set())
            return cls(nodes=_id_map(doc["nodes"], name, "node path", True))
        _check_fields(doc, name, {"format", "nodes", "inline"}, set())
        nodes = _id_map(doc["nodes"], name, "node path", True)
        raw = doc["inline"]
        if not isinstance(raw, dict) or not raw:  # format 1 is written when no node is inline
            _bad(name, "a non-empty object of node path -> inline node", raw)
        inline = {}
        for path, node in raw.items():
            check_key(path, name, "node path", allow_root=True)
            if path in nodes:
                _bad(name, f"node {_show(path)} either inline or as a tree id, not both", path)
            where = f"{name} (inline node {_show(path)})"
            if not isinstance(node, dict):
                _bad(where, "a node as a JSON object", node)
            _check_fields(node, where, {"metadata", "chunks"}, set())
            inline[path] = NodeTree.from_document(node, where)
        return cls(nodes=nodes, inline=inline)

    def has_node(self, path: str) -> bool:
        return path in self.nodes or path in self.inline

    @functools.cached_property
    def id(self) -> str:
        return content_id(self.to_bytes())


def utc_now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="microseconds")


# -- non-finite floats in strict JSON ----------------------------------------------------


def _encode_floats(value: Any) -> Any:
    """NaN and +-Inf -> {"$float": "nan" | "inf" | "-inf"}, recursively (strict JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return {FLOAT_KEY: "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, Mapping):
        return {k: _encode_floats(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_encode_floats(v) for v in value]
    return value


def _decode_floats(value: Any, name: str, where: str, depth: int = 0) -> Any:
    """Inverse of :func:`_encode_floats` on a parsed document; depth-limited."""
    if depth > MAX_DEPTH:
        _bad(name, f"{where} nested at most {MAX_DEPTH} levels deep", "deeper nesting")
    if isinstance(value, dict):
        if len(value) == 1 and FLOAT_KEY in value:
            text = value[FLOAT_KEY]
            if not isinstance(text, str) or text not in _NONFINITE:
                _bad(name, f'{where} {{"{FLOAT_KEY}": "nan" | "inf" | "-inf"}}', value)
            return _NONFINITE[text]
        return {k: _decode_floats(v, name, f"{where}[{k!r}]", depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode_floats(v, name, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
    return value


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool | _np_bool())


def _np_bool() -> type:
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency; keep this module stdlib-safe
        return bool
    return np.bool_


@dataclass(frozen=True)
class Snapshot:
    """One committed version. ``metadata`` is the caller's JSON (search trials, config, ...).

    Non-finite floats in ``metrics`` and ``metadata`` are stored as
    ``{"$float": "nan" | "inf" | "-inf"}`` (the files stay strict JSON) and read back
    as floats; a caller's own object whose only key is ``"$float"`` is refused as reserved.
    """

    root: str
    parent: str | None
    time: str
    message: str = ""
    step: int | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        """The stored form: canonical JSON as one zstd frame (:data:`SNAPSHOT_ZSTD_LEVEL`)."""
        return pack_tree(self.canonical(), SNAPSHOT_ZSTD_LEVEL)

    def canonical(self) -> bytes:
        """The canonical JSON the stored frame holds."""
        return canonical_json(
            {
                "format": FORMAT_VERSION,
                "root": self.root,
                "parent": self.parent,
                "time": self.time,
                "message": self.message,
                "step": self.step,
                "metrics": _encode_floats(dict(self.metrics)),
                "metadata": _encode_floats(dict(self.metadata)),
            }
        )

    @classmethod
    def from_bytes(cls, data: bytes, snapshot_id: str | None = None) -> Snapshot:
        """Parse and validate every field; any malformed document is an IntegrityError."""
        doc = parse_document(data, "snapshot", snapshot_id, compressed=True)
        name = _name("snapshot", snapshot_id)
        _check_fields(doc, name, {"format", "root", "parent", "time"},
                      {"message", "step", "metrics", "metadata"})
        root = check_id(doc["root"], "root tree", name)
        parent = doc["parent"]
        if parent is not None:
            check_id(parent, "parent snapshot", name)
        if not isinstance(doc["time"], str):
            _bad(name, "time as a string", doc["time"])
        message = doc.get("message", "")
        if not isinstance(message, str):
            _bad(name, "message as a string", message)
        step = doc.get("step")
        if step is not None and (type(step) is not int):
            _bad(name, "step as an integer or null", step)
        metrics_doc = doc.get("metrics", {})
        if not isinstance(metrics_doc, dict):
            _bad(name, "metrics as an object", metrics_doc)
        metrics: dict[str, float] = {}
        for key, raw in metrics_doc.items():
            value = _decode_floats(raw, name, f"metrics[{key!r}]")
            if not _is_real(value):
                _bad(name, f"metrics[{key!r}] as a number", raw)
            metrics[key] = float(value)
        raw_metadata = doc.get("metadata", {})
        metadata = _decode_floats(raw_metadata, name, "metadata")
        if not isinstance(metadata, dict):
            _bad(name, "metadata as an object", raw_metadata)
        return cls(
            root=root, parent=parent, time=doc["time"], message=message, step=step,
            metrics=metrics, metadata=metadata,
        )

    @property
    def id(self) -> str:
        return content_id(self.to_bytes())


# -- commit arguments, checked before anything is written ---------------------------------


def _field_error(field_name: str, expected: str, got: Any, fix: str) -> NoReturn:
    raise InvalidInputError(
        f"Expected {field_name} to be {expected}. Got {_show(got)} "
        f"({type(got).__name__}) instead; {fix}."
    )


def _json_value(value: Any, where: str, depth: int) -> Any:
    """A JSON-encodable copy of ``value`` (numpy scalars -> Python), else FormatError."""
    if depth > MAX_DEPTH:
        _field_error(where, f"nested at most {MAX_DEPTH} levels deep", "deeper nesting",
                     "flatten the metadata")
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, numbers.Integral):
        return bool(value) if isinstance(value, _np_bool()) else int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, _np_bool()):
        return bool(value)
    if isinstance(value, Mapping):
        if len(value) == 1 and FLOAT_KEY in value:
            _field_error(where, f'an object other than one with the single key "{FLOAT_KEY}"',
                         dict(value), f'"{FLOAT_KEY}" is reserved for NaN and infinity; rename the key')
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                _field_error(f"the keys of {where}", "strings", key, "convert the key with str()")
            out[key] = _json_value(item, f"{where}[{key!r}]", depth + 1)
        return out
    if isinstance(value, list | tuple):
        return [_json_value(item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value)]
    _field_error(where, "JSON-encodable (null, bool, number, string, list or str-keyed dict)",
                 value, "convert it (a set to a sorted list, an array with .tolist(), an object "
                 "to a dict or str)")


def check_commit_fields(
    message: Any, step: Any, metrics: Any, metadata: Any
) -> tuple[str, int | None, dict[str, float], dict[str, Any]]:
    """Validate and normalise what a commit records, before anything is written.

    - ``message``: a string;
    - ``step``: None or an integer (numpy integers too); bool, strings and floats (even
      ``3.0``: no silent truncation) are refused;
    - ``metrics``: None or a mapping of str -> real number (numpy scalars too, NaN and
      infinity kept), returned as floats;
    - ``metadata``: None or a str-keyed mapping of JSON values (numpy scalars become
      Python numbers, tuples lists; NaN and infinity kept); an object whose only key is
      ``"$float"`` is reserved.

    Returns ``(message, step, metrics, metadata)``; raises :class:`FormatError` naming
    the field (and the key path inside it).
    """
    if not isinstance(message, str):
        _field_error("message", "a string", message, "pass message='...'")
    if step is not None:
        if isinstance(step, bool | _np_bool()) or not isinstance(step, numbers.Integral):
            _field_error("step", "an integer or None", step, "pass the training step as an int")
        step = int(step)
    if metrics is None:
        metrics = {}
    if not isinstance(metrics, Mapping):
        _field_error("metrics", "a mapping of str -> number", metrics, "pass a dict")
    clean_metrics: dict[str, float] = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            _field_error("the keys of metrics", "strings", key, "convert the key with str()")
        if not _is_real(value):
            _field_error(f"metrics[{key!r}]", "a real number", value,
                         "log a float (use float(x) for a tensor or array scalar)")
        clean_metrics[key] = float(value)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, Mapping):
        _field_error("metadata", "a mapping of str -> JSON value", metadata, "pass a dict")
    clean_metadata = _json_value(metadata, "metadata", 0)
    return message, step, clean_metrics, clean_metadata
