"""What a DCP checkpoint is in the store: array names, the JSON document of DCP's metadata,
and plain Python values as JSON. No pickle is written, and none is ever read.

Layout of one version saved through :class:`~inshrink_store.torch.dcp.InshrinkStorageWriter`:

- each tensor shard DCP writes is its own zarr array ``<fqn>/@<offsets>``
  (``model.fc.weight/@0,0``, ``model.fc.weight/@512,0``), so every rank writes its shards
  side by side and a reader fetches only the chunks a resharded load needs;
- a non-tensor value (DCP's "bytes" items: a step counter, ``param_groups``) that is plain
  Python data (None, bool, int, float, str, and lists, tuples and dicts of them, with types
  kept exactly) is JSON inside the document; anything else (e.g. a dict holding tensors) is
  the ``torch.save`` bytes DCP produced, stored as a uint8 array ``<fqn>/bytes`` and only
  ever read back with ``torch.load(weights_only=True)``, which refuses to run code;
- the root group's attribute ``inshrink_dcp`` holds DCP's global metadata as JSON: every
  tensor's dtype, global size and chunks (offsets, sizes, array), every value, the planner's
  key mappings, and for quantized tensors the one codebook their shards share.

An FQN becomes one path component: ``%``, ``/`` and ``\\`` are percent-encoded, and a name
zarr or the store reserves (empty, ``.``, ``..``, ``zarr.json``, a leading ``__``) gets its
first character encoded, so every FQN has its own group.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from inshrink_store.errors import FormatError, IntegrityError, InvalidInputError
from inshrink_store.structure import flatten, unflatten

#: the root group attribute that holds the document
DOC_ATTR = "inshrink_dcp"
FORMAT = 1
#: a plain value whose JSON is longer than this is stored as bytes instead of inline
INLINE_LIMIT = 64 << 10
_RESERVED = ("", ".", "..", "zarr.json")


# -- names ------------------------------------------------------------------------------------
def fqn_component(fqn: str) -> str:
    """``fqn`` as one safe path component (injective: ``%`` is encoded first)."""
    text = fqn.replace("%", "%25").replace("/", "%2F").replace("\\", "%5C")
    if text in _RESERVED or text.startswith("__"):
        text = f"%{ord(text[0]):02X}{text[1:]}" if text else "%00"
    return text


def shard_path(fqn: str, offsets: tuple[int, ...] | list[int]) -> str:
    """The array of the shard of ``fqn`` at ``offsets`` (``@`` alone for a 0-d tensor)."""
    return f"{fqn_component(fqn)}/@{','.join(str(int(o)) for o in offsets)}"


def bytes_path(fqn: str) -> str:
    """The uint8 array of a value stored as ``torch.save`` bytes."""
    return f"{fqn_component(fqn)}/bytes"


# -- plain values as JSON ---------------------------------------------------------------------------
def _identical(a: Any, b: Any) -> bool:
    """Equal with the same types all the way down (a tuple is not a list, NaN bits count)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_identical(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return ([(type(k), k) for k in a] == [(type(k), k) for k in b]
                and all(_identical(a[k], b[k]) for k in a))
    return bool(a == b)


def plain_value(value: Any) -> Any | None:
    """The JSON skeleton of ``value`` if it is plain data that comes back from it exactly
    (see :mod:`inshrink_store.structure`) and is at most :data:`INLINE_LIMIT` long; else None."""
    try:
        leaves, skeleton = flatten(value, lambda x: False)
    except (FormatError, RecursionError):
        return None
    if leaves or len(json.dumps(skeleton)) > INLINE_LIMIT or not _identical(unflatten(skeleton, {}), value):
        return None
    return skeleton


def _planner_data_to_json(data: Any) -> Any:
    """The save planner's data: DefaultSavePlanner's key mappings (FQN -> path tuple of str
    and int) as pairs, anything else as a plain-value skeleton; None stays None."""
    if data is None:
        return None
    if isinstance(data, dict) and all(
            isinstance(k, str) and isinstance(v, tuple) and all(isinstance(p, (str, int)) and not isinstance(p, bool)
                                                               for p in v) for k, v in data.items()):
        return {"mappings": [[k, list(v)] for k, v in data.items()]}
    skeleton = plain_value(data)
    if skeleton is None:
        raise InvalidInputError(
            f"Expected the save planner's planner_data to be plain data (dicts, lists, tuples, str, int, float; "
            f"DefaultSavePlanner's key mappings). Got {type(data).__name__} instead: inshrink-store stores no pickle; "
            "use DefaultSavePlanner or make your planner's data plain.")
    return {"skeleton": skeleton}


def _planner_data_from_json(doc: Any, where: str) -> Any:
    if doc is None:
        return None
    _require(isinstance(doc, dict) and len(doc) == 1 and ("mappings" in doc or "skeleton" in doc),
             "planner_data null, {'mappings': ...} or {'skeleton': ...}", doc, where)
    if "skeleton" in doc:
        try:
            return unflatten(doc["skeleton"], {})
        except (FormatError, TypeError, ValueError) as exc:
            raise IntegrityError(f"Expected a readable planner_data skeleton in {where}. Got {exc} instead.") from None
    pairs = doc["mappings"]
    _require(isinstance(pairs, list) and all(
        isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], list)
        and all(isinstance(x, (str, int)) and not isinstance(x, bool) for x in p[1]) for p in pairs),
        "planner_data mappings as [fqn, [key, ...]] pairs", pairs, where)
    return {fqn: tuple(path) for fqn, path in pairs}


# -- the document ---------------------------------------------------------------------------------
def _require(ok: bool, what: str, got: Any, where: str) -> None:
    if not ok:
        shown = repr(got)
        shown = shown if len(shown) <= 100 else shown[:97] + "..."
        raise IntegrityError(
            f"Expected {what} in {where}. Got {shown} instead: the DCP document is corrupt or was not "
            "written by inshrink-store. Run `inshrink verify`.")


def _ints(value: Any, what: str, where: str, minimum: int = 0) -> tuple[int, ...]:
    _require(isinstance(value, list) and len(value) <= 32 and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= minimum for v in value), what, value, where)
    return tuple(value)


@dataclass(frozen=True)
class Chunk:
    """One stored shard: where it sits in the tensor and the array that holds it."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    array: str


@dataclass(frozen=True)
class TensorEntry:
    """A tensor: logical dtype (``F32``, ``BF16``...), global size, ``requires_grad`` as DCP
    recorded it, its chunks, and (quantized) the decisions its shards share."""

    dtype: str
    size: tuple[int, ...]
    chunks: tuple[Chunk, ...]
    requires_grad: bool = False
    quantization: Mapping[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"dtype": self.dtype, "size": list(self.size), "requires_grad": self.requires_grad,
                               "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes), "array": c.array}
                                          for c in self.chunks]}
        if self.quantization is not None:
            doc["quantization"] = dict(self.quantization)
        return doc

    @classmethod
    def from_json(cls, doc: Any, where: str, dtypes: tuple[str, ...]) -> TensorEntry:
        _require(isinstance(doc, dict) and {"dtype", "size", "chunks", "requires_grad"} <= set(doc),
                 "a tensor entry with dtype, size, requires_grad and chunks", doc, where)
        _require(doc["dtype"] in dtypes, f"a dtype in {dtypes}", doc["dtype"], where)
        _require(isinstance(doc["requires_grad"], bool), "requires_grad true or false", doc["requires_grad"], where)
        size = _ints(doc["size"], "a size of non-negative ints", where)
        _require(isinstance(doc["chunks"], list), "a list of chunks", doc["chunks"], where)
        chunks = tuple(_chunk(c, len(size), where) for c in doc["chunks"])
        quantization = doc.get("quantization")
        _require(quantization is None or isinstance(quantization, dict), "quantization an object or absent",
                 quantization, where)
        return cls(doc["dtype"], size, chunks, doc["requires_grad"], quantization)


def _chunk(doc: Any, rank: int, where: str) -> Chunk:
    _require(isinstance(doc, dict) and set(doc) == {"offsets", "sizes", "array"} and isinstance(doc.get("array"), str),
             "a chunk with offsets, sizes and array", doc, where)
    offsets = _ints(doc["offsets"], "chunk offsets of non-negative ints", where)
    sizes = _ints(doc["sizes"], "chunk sizes of non-negative ints", where)
    _require(len(offsets) == len(sizes) == rank, f"chunk offsets and sizes of rank {rank}", doc, where)
    return Chunk(offsets, sizes, doc["array"])


@dataclass(frozen=True)
class ValueEntry:
    """A non-tensor value: inline JSON (``encoding="json"``, its skeleton in ``value``) or
    ``torch.save`` bytes in a uint8 array (``encoding="torch"``)."""

    encoding: str
    value: Any = None
    array: str | None = None

    def to_json(self) -> dict[str, Any]:
        if self.encoding == "json":
            return {"encoding": "json", "value": self.value}
        return {"encoding": "torch", "array": self.array}

    @classmethod
    def from_json(cls, doc: Any, where: str) -> ValueEntry:
        _require(isinstance(doc, dict) and doc.get("encoding") in ("json", "torch"),
                 "a value entry with encoding 'json' or 'torch'", doc, where)
        if doc["encoding"] == "json":
            _require(set(doc) == {"encoding", "value"}, "a json value entry {encoding, value}", doc, where)
            return cls("json", value=doc["value"])
        _require(set(doc) == {"encoding", "array"} and isinstance(doc["array"], str),
                 "a torch value entry {encoding, array}", doc, where)
        return cls("torch", array=doc["array"])

    def python_value(self, where: str) -> Any:
        """The inline value (``encoding="json"`` only)."""
        try:
            return unflatten(self.value, {})
        except (FormatError, TypeError, ValueError, KeyError) as exc:
            raise IntegrityError(f"Expected a readable value skeleton in {where}. Got {exc} instead.") from None


@dataclass(frozen=True)
class DcpDocument:
    """DCP's global metadata of one checkpoint, as JSON (the root attribute :data:`DOC_ATTR`)."""

    tensors: Mapping[str, TensorEntry]
    values: Mapping[str, ValueEntry]
    planner_data: Any = None
    storage_meta: Mapping[str, Any] | None = None
    version: str | None = None
    quantize: Mapping[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        """JSON-native, keys sorted (the same checkpoint always gives the same bytes)."""
        doc = {"format": FORMAT, "version": self.version,
               "planner_data": _planner_data_to_json(self.planner_data),
               "storage_meta": None if self.storage_meta is None else dict(self.storage_meta),
               "quantize": None if self.quantize is None else dict(self.quantize),
               "tensors": {fqn: e.to_json() for fqn, e in self.tensors.items()},
               "values": {fqn: e.to_json() for fqn, e in self.values.items()}}
        return json.loads(json.dumps(doc, sort_keys=True))  # type: ignore[no-any-return]

    @classmethod
    def from_json(cls, doc: Any, where: str, dtypes: tuple[str, ...]) -> DcpDocument:
        _require(isinstance(doc, dict), "a JSON object", doc, where)
        if doc.get("format") != FORMAT:
            raise FormatError(
                f"Expected DCP document format {FORMAT} in {where}. Got {doc.get('format')!r} instead; upgrade "
                "inshrink-store to read this checkpoint.")
        keys = {"format", "version", "planner_data", "storage_meta", "quantize", "tensors", "values"}
        _require(set(doc) == keys, f"exactly the fields {sorted(keys)}", sorted(doc), where)
        _require(doc["version"] is None or isinstance(doc["version"], str), "version a string or null",
                 doc["version"], where)
        for name in ("storage_meta", "quantize"):
            _require(doc[name] is None or isinstance(doc[name], dict), f"{name} an object or null", doc[name], where)
        _require(isinstance(doc["tensors"], dict) and isinstance(doc["values"], dict),
                 "tensors and values as objects", type(doc["tensors"]).__name__, where)
        tensors = {fqn: TensorEntry.from_json(e, f"{where} (tensor {fqn!r})", dtypes)
                   for fqn, e in doc["tensors"].items()}
        values = {fqn: ValueEntry.from_json(e, f"{where} (value {fqn!r})") for fqn, e in doc["values"].items()}
        return cls(tensors, values, _planner_data_from_json(doc["planner_data"], where), doc["storage_meta"],
                   doc["version"], doc["quantize"])
