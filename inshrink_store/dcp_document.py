"""The JSON document of a DCP checkpoint (DCP's global metadata, the root group attribute
:data:`DOC_ATTR` of a version saved through :mod:`inshrink_store.torch.dcp`), parsed and
checked without torch.
Layer: documents (``manifest`` | ``dcp_document``), under ``cas``, above the codecs.

Why here, below the admin layer and outside ``inshrink_store.torch``: ``verify`` must refuse
a version whose document a DCP load would refuse, by the very same checks, and admin may not
import torch. A committed document is untrusted input: it is bounded in nesting before
anything recurses into it, every field is type-checked, and every tensor's chunks must lie
inside it and cover it exactly once, or an ``IntegrityError`` names the field, tensor or chunk.
The layout of such a version is in :mod:`inshrink_store.torch.dcp_format`.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, cast

from inshrink_store.errors import FormatError, IntegrityError, InvalidInputError
from inshrink_store.structure import flatten, unflatten

#: the root group attribute that holds the document
DOC_ATTR = "inshrink_dcp"
FORMAT = 1
#: a plain value whose JSON is longer than this is stored as bytes instead of inline
INLINE_LIMIT = 64 << 10
#: the deepest nesting of objects and lists a document may have; checked before anything
#: recurses into it (a hostile document nested ~1000 deep would exhaust Python's stack)
MAX_DEPTH = 128
#: levels of the document around an inline value or planner skeleton (document, ``values``,
#: the entry, ``value``): a value nested deeper than ``MAX_DEPTH - ENVELOPE`` is stored as bytes
ENVELOPE = 4
#: the logical dtypes a DCP tensor may have (torch's, see ``inshrink_store.torch.tensors``)
DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "C64", "C128", "I64", "I32", "I16", "I8", "U8", "BOOL")
_STORAGE_META = {"checkpoint_id": str, "save_id": str, "modules": list}


# -- nesting ---------------------------------------------------------------------------------------
def deeper_than(value: Any, limit: int) -> bool:
    """Whether ``value`` nests objects and lists more than ``limit`` deep (a container holding
    only scalars is 1 deep). Iterative, so it is safe on input that would exhaust the stack."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, (dict, list, tuple)):
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return False


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
    (see :mod:`inshrink_store.structure`), is at most :data:`INLINE_LIMIT` long and nests
    no deeper than a document may hold it (:data:`MAX_DEPTH`); else None."""
    try:
        leaves, skeleton = flatten(value, lambda x: False)
    except (FormatError, RecursionError):
        return None
    if (leaves or deeper_than(skeleton, MAX_DEPTH - ENVELOPE) or len(json.dumps(skeleton)) > INLINE_LIMIT
            or not _identical(unflatten(skeleton, {}), value)):
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
            f"Expected the save planner's planner_data to be plain data (dicts, lists, tuples, str, int, float, "
            f"nested at most {MAX_DEPTH - ENVELOPE} deep as JSON; DefaultSavePlanner's key mappings). Got "
            f"{type(data).__name__} instead: inshrink-store stores no pickle; use DefaultSavePlanner or make your "
            "planner's data plain.")
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
        _corrupt(what, shown if len(shown) <= 100 else shown[:97] + "...", where)


def _corrupt(what: str, got: str, where: str) -> NoReturn:
    raise IntegrityError(
        f"Expected {what} in {where}. Got {got} instead: the DCP document is corrupt or was not "
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
    def from_json(cls, doc: Any, where: str, dtypes: tuple[str, ...] = DTYPES) -> TensorEntry:
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


def check_tiling(fqn: str, entry: TensorEntry, where: str) -> None:
    """Every chunk of ``fqn`` inside its size and the chunks covering it exactly once. Why: a
    DCP load reads a tensor only from its chunks, so a chunk outside it, a gap (no chunks at
    all) or an overlap hiding a gap would leave the target's old values in place, silently."""
    for i, c in enumerate(entry.chunks):
        if any(o + n > s for o, n, s in zip(c.offsets, c.sizes, entry.size, strict=True)):
            _corrupt(f"chunk {i} of tensor {fqn!r} (offsets {list(c.offsets)}, sizes {list(c.sizes)}) inside its "
                     f"size {list(entry.size)}", "a chunk reaching past it", where)
    held, numel = sum(math.prod(c.sizes) for c in entry.chunks), math.prod(entry.size)
    pair = _overlap(entry.chunks) if held == numel else None
    if not entry.chunks or held != numel or pair is not None:
        got = ("no chunks" if not entry.chunks else f"chunks holding {held} elements" if pair is None
               else f"chunks {pair[0]} and {pair[1]} overlapping")
        _corrupt(f"tensor {fqn!r} covered by its chunks exactly once ({numel} elements)", got, where)


def _overlap(chunks: Sequence[Chunk]) -> tuple[int, int] | None:
    """Two chunks that share an element, as indices, or None: a sweep along the dimension with
    the most distinct offsets (a shard grid's chunks meet few others there)."""
    if not chunks or not chunks[0].offsets:
        return None  # a 0-d tensor: held == numel already means one chunk
    dim = max(range(len(chunks[0].offsets)), key=lambda d: len({c.offsets[d] for c in chunks}))
    order = sorted((i for i, c in enumerate(chunks) if math.prod(c.sizes)), key=lambda i: chunks[i].offsets[dim])
    active: list[int] = []
    for i in order:
        c = chunks[i]
        active = [j for j in active if chunks[j].offsets[dim] + chunks[j].sizes[dim] > c.offsets[dim]]
        for j in active:
            if all(a < b + m and b < a + n for a, n, b, m in
                   zip(c.offsets, c.sizes, chunks[j].offsets, chunks[j].sizes, strict=True)):
                return min(i, j), max(i, j)
        active.append(i)
    return None


def _storage_meta(doc: Any, where: str) -> Mapping[str, Any] | None:
    """DCP's ``StorageMeta`` fields as the writer stores them, each of its type, or null. Why:
    they become a ``StorageMeta`` a load hands to DCP, which trusts their types."""
    _require(doc is None or isinstance(doc, dict), "storage_meta an object or null", doc, where)
    if doc is None:
        return None
    _require(set(doc) <= set(_STORAGE_META), f"storage_meta fields among {sorted(_STORAGE_META)}", sorted(doc), where)
    for name, kind in _STORAGE_META.items():
        value = doc.get(name)
        _require(value is None or isinstance(value, kind), f"storage_meta.{name} a {kind.__name__} or null", value,
                 where)
    _require(all(isinstance(m, str) for m in doc.get("modules") or []), "storage_meta.modules a list of str",
             doc.get("modules"), where)
    return cast(Mapping[str, Any], doc)  # a dict of str keys, checked above


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
    def from_json(cls, doc: Any, where: str, dtypes: tuple[str, ...] = DTYPES) -> DcpDocument:
        """The document, checked (see the module's docstring); an IntegrityError names what is
        wrong, a FormatError a format this version cannot read."""
        if deeper_than(doc, MAX_DEPTH):
            _corrupt(f"JSON nested at most {MAX_DEPTH} deep", "deeper nesting", where)
        _require(isinstance(doc, dict), "a JSON object", doc, where)
        if doc.get("format") != FORMAT:
            raise FormatError(
                f"Expected DCP document format {FORMAT} in {where}. Got {doc.get('format')!r} instead; upgrade "
                "inshrink-store to read this checkpoint.")
        keys = {"format", "version", "planner_data", "storage_meta", "quantize", "tensors", "values"}
        _require(set(doc) == keys, f"exactly the fields {sorted(keys)}", sorted(doc), where)
        _require(doc["version"] is None or isinstance(doc["version"], str), "version a string or null",
                 doc["version"], where)
        _require(doc["quantize"] is None or isinstance(doc["quantize"], dict), "quantize an object or null",
                 doc["quantize"], where)
        _require(isinstance(doc["tensors"], dict) and isinstance(doc["values"], dict),
                 "tensors and values as objects", type(doc["tensors"]).__name__, where)
        tensors = {fqn: TensorEntry.from_json(e, f"{where} (tensor {fqn!r})", dtypes)
                   for fqn, e in doc["tensors"].items()}
        for fqn, entry in tensors.items():
            check_tiling(fqn, entry, where)
        values = {fqn: ValueEntry.from_json(e, f"{where} (value {fqn!r})") for fqn, e in doc["values"].items()}
        return cls(tensors, values, _planner_data_from_json(doc["planner_data"], where),
                   _storage_meta(doc["storage_meta"], where), doc["version"], doc["quantize"])


def check_attributes(attributes: Mapping[str, Any], where: str) -> None:
    """The DCP document among a version's root attributes, if it has one, parsed with every
    check a DCP load makes, inline values included. Why: ``verify`` calls it so that a version a
    load would refuse is reported as bad (it cannot import the torch side)."""
    found = attributes.get(DOC_ATTR)
    if found is not None:
        doc = DcpDocument.from_json(found, f"the DCP document of {where}")
        for fqn, value in doc.values.items():
            if value.encoding == "json":
                value.python_value(f"value {fqn!r} of {where}")
