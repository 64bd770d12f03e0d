"""The restore residual: what turns a version's stored (quantized) tensors back into the exact bits.
Layer: snapshot index and residual (``index`` | ``residual``), under the zarr view, above ``cas``.

Why: a fault-tolerant restart only ever needs the newest version, and ten lossy restores
in one run add up (each hands training a pruned, quantized model). So the newest N versions
of a branch keep, beside their lossy arrays, the XOR of the true float bits against the
bits the store returns for every quantized tensor. Restoring XORs it back: bit-exact. Older
versions drop it (gc collects it), so history stays compact.

It is a tier apart from the snapshot's arrays: zarr reads of a version keep returning the
stored values; only :func:`apply` (``load_state(exact=True)``, ``Checkpointer.restore``)
uses it. Layout, one canonical JSON document per version at ``residuals/<2 hex>/<30 hex>``
(id = xxh3-128 of its bytes)::

    {"format": 1, "arrays": {path: {"dtype": "F32", "shape": [..], "pieces": [object id, ...],
                                    "checksum": xxh3-64 of the exact bits, as 16 hex digits}}}

Each piece is a chunk object holding an ``inshrink.bytegroup`` encoding of up to
:data:`PIECE_BYTES` of the flat XOR bits: in a well-quantized tensor the sign and exponent
bytes mostly XOR to zero and code to almost nothing, the low mantissa bytes stay raw (a
tensor stored exactly has no pieces). The checksum of the exact bits is checked after the
XOR, so a damaged or forged residual is an error, never silently wrong numbers. The
version's snapshot metadata names the document (``metadata["residual"]``, see
:class:`ResidualRef`); the document and its pieces are written before the snapshot, under
the writer's lease, so a version whose residual gc keeps never lacks one.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from inshrink_store import dtypes as dtype_registry
from inshrink_store.cas import ObjectStore
from inshrink_store.codecs.bytegroup import ELEMENT_DTYPES, ByteGroup
from inshrink_store.codecs.nuq import quantizer
from inshrink_store.errors import FormatError, InshrinkError, IntegrityError, NotFoundError
from inshrink_store.layout import check_id, residual_path
from inshrink_store.manifest import canonical_json, content_id, parse_document
from inshrink_store.object_format import undecodable
from inshrink_store.storage import Storage

PIECE_BYTES = 4 << 20
#: every piece object starts with this, so most chunks are told apart by their first bytes;
#: not all: a lossless float chunk is its raw bits, which may equal a piece (one object by
#: content), so the residual-only sweep also keeps whatever a committed version reaches
PIECE_MAGIC = b"IRP\x01"
META_KEY = "residual"
#: the most versions of a branch that keep their residual (``exact_resume`` is capped here)
MAX_KEEP_NEWEST = 64


def _element(dtype: object) -> str | None:
    """The bytegroup element dtype a logical dtype's bits are coded as: the name the dtype
    registry gives it for the codecs (F32 -> float32, F16 -> float16, BF16 -> bfloat16), or
    None for a dtype that has no residual (integers, bool, F64, float8, complex)."""
    entry = dtype_registry.REGISTRY.get(dtype) if isinstance(dtype, str) else None
    name = None if entry is None else entry.codec_name
    return name if name in ELEMENT_DTYPES else None


def _bits(values: np.ndarray, dtype: str) -> np.ndarray:
    """The flat unsigned-integer bit patterns of ``values`` (a tensor carried as ``dtype``)."""
    carrier = dtype_registry.get(dtype).carrier
    data = np.ascontiguousarray(values, dtype=carrier).reshape(-1)
    return data.view(np.dtype(f"<u{carrier.itemsize}"))


@dataclass(frozen=True)
class ResidualRef:
    """What ``metadata["residual"]`` of a version says: the document ``id``, how many newest
    versions of the branch keep theirs (``keep_newest``), and its ``stored_bytes``."""

    id: str
    keep_newest: int
    stored_bytes: int
    arrays: int

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "keep_newest": self.keep_newest, "stored_bytes": self.stored_bytes,
                "arrays": self.arrays}

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], snapshot: str = "?") -> ResidualRef | None:
        """The version's residual reference, None when it has none; a malformed one is an
        IntegrityError naming the snapshot."""
        raw = metadata.get(META_KEY)
        if raw is None:
            return None
        where = f"metadata['residual'] of snapshot {snapshot[:12]}"
        if not isinstance(raw, Mapping) or set(raw) != {"id", "keep_newest", "stored_bytes", "arrays"}:
            raise IntegrityError(f"Expected {where} to hold id, keep_newest, stored_bytes and arrays. Got "
                                 f"{raw!r:.120} instead.")
        numbers = [raw["keep_newest"], raw["stored_bytes"], raw["arrays"]]
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in numbers) or \
                numbers[0] > MAX_KEEP_NEWEST:
            raise IntegrityError(f"Expected whole numbers >= 0 in {where} (keep_newest at most "
                                 f"{MAX_KEEP_NEWEST}). Got {numbers} instead.")
        return cls(check_id(raw["id"], "residual", where), *numbers)


@dataclass(frozen=True)
class ResidualArray:
    dtype: str
    shape: tuple[int, ...]
    pieces: tuple[str, ...]
    checksum: str  # xxh3-64 of the exact bits, 16 hex digits


def _checksum(bits: np.ndarray) -> str:
    return xxhash.xxh3_64_hexdigest(np.ascontiguousarray(bits).view(np.uint8).data)


class ResidualWriter:
    """Collects the residual of one write session, storing pieces as the arrays are written."""

    def __init__(self, objects: ObjectStore) -> None:
        self.objects = objects
        self.arrays: dict[str, ResidualArray] = {}
        self.stored_bytes = 0

    def add(self, path: str, original: np.ndarray, stored: np.ndarray, dtype: str) -> None:
        """Record what turns ``stored`` back into ``original`` (same shape, carried as ``dtype``).
        Only float dtypes have a residual; an exact tensor adds nothing."""
        element = _element(dtype)
        if element is None or original.shape != stored.shape:
            return
        exact = _bits(original, dtype)
        xor = np.bitwise_xor(exact, _bits(stored, dtype))
        checksum = _checksum(exact)
        if not xor.any():  # stored exactly: listed with no pieces, so the residual covers it
            self.arrays[path] = ResidualArray(dtype, tuple(original.shape), (), checksum)
            return
        codec = ByteGroup(dtype=element)
        per_piece = max(1, PIECE_BYTES // xor.itemsize)
        pieces = []
        for start in range(0, xor.size, per_piece):
            put = self.objects.put(PIECE_MAGIC + codec.encode(xor[start:start + per_piece]))
            self.stored_bytes += put.stored_bytes
            pieces.append(put.oid)
        self.arrays[path] = ResidualArray(dtype, tuple(original.shape), tuple(pieces), checksum)

    def document(self, arrays: Mapping[str, ResidualArray] | None = None) -> bytes:
        """The canonical document of ``arrays`` (by default the ones this session added)."""
        chosen = self.arrays if arrays is None else arrays
        return canonical_json({"format": 1, "arrays": {
            p: {"dtype": a.dtype, "shape": list(a.shape), "pieces": list(a.pieces), "checksum": a.checksum}
            for p, a in sorted(chosen.items())}})

    def write(self, storage: Storage, keep_newest: int,
              arrays: Mapping[str, ResidualArray] | None = None) -> ResidualRef | None:
        """Store the document of ``arrays`` (by default the ones this session added) before the
        snapshot that will name it; None if there is nothing to list. ``arrays`` lets a commit
        list exactly the entries that match its root tree (a rebase may write a second one)."""
        chosen = self.arrays if arrays is None else arrays
        if not chosen:
            return None
        data = self.document(chosen)
        rid = content_id(data)
        if not storage.exists_durably(residual_path(rid)):
            storage.write(residual_path(rid), data)
        return ResidualRef(rid, keep_newest, self.stored_bytes + len(data), len(chosen))


def load(storage: Storage, rid: str) -> dict[str, ResidualArray]:
    """The residual document ``rid``, every field checked (a store may be damaged or hostile)."""
    try:
        data = storage.read(residual_path(rid))
    except FileNotFoundError:
        raise NotFoundError(
            f"Expected the restore residual {rid} at {residual_path(rid)}. Got nothing there instead: "
            "gc collected it (only the newest versions of a branch keep theirs).") from None
    doc = parse_document(data, "residual", rid)
    arrays = doc.get("arrays")
    if set(doc) != {"format", "arrays"} or not isinstance(arrays, dict):
        raise IntegrityError(f"Expected residual {rid} to hold format and arrays. Got keys {sorted(doc)} instead.")
    out = {}
    for path, entry in arrays.items():
        where = f"residual {rid}, array {path!r}"
        ok = (isinstance(entry, dict) and set(entry) == {"dtype", "shape", "pieces", "checksum"}
              and _element(entry["dtype"]) is not None and isinstance(entry["shape"], list)
              and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in entry["shape"])
              and isinstance(entry["pieces"], list) and isinstance(entry["checksum"], str)
              and re.fullmatch(r"[0-9a-f]{16}", entry["checksum"]) is not None)
        if not ok:
            raise IntegrityError(f"Expected dtype, shape, pieces and checksum in {where}. Got {entry!r:.160} "
                                 "instead.")
        pieces = tuple(check_id(oid, "object", where) for oid in entry["pieces"])
        out[str(path)] = ResidualArray(entry["dtype"], tuple(entry["shape"]), pieces, entry["checksum"])
    return out


def apply(objects: ObjectStore, array: ResidualArray, stored: np.ndarray, path: str) -> np.ndarray:
    """``stored`` (the values a reader returns for ``path``) with its residual XORed back: the
    exact tensor, checked piece by piece (each bytegroup piece carries a checksum)."""
    if tuple(stored.shape) != array.shape:
        raise IntegrityError(f"Expected tensor {path!r} of shape {array.shape} for its residual. Got "
                             f"{tuple(stored.shape)} instead.")
    carrier = dtype_registry.get(array.dtype).carrier
    if np.asarray(stored).dtype != carrier:
        raise IntegrityError(f"Expected tensor {path!r} to be carried as {carrier} like its residual "
                             f"({array.dtype}). Got {np.asarray(stored).dtype} instead: the residual is corrupt.")
    bits = _bits(stored, array.dtype).copy()
    element = _element(array.dtype)
    if element is None:
        raise IntegrityError(f"Expected a float dtype in the residual of tensor {path!r}. Got {array.dtype!r} "
                             "instead: the residual is corrupt.")
    codec = ByteGroup(dtype=element)
    offset = 0
    for oid in array.pieces:
        try:
            payload = objects.get(oid)
            if payload[:len(PIECE_MAGIC)] != PIECE_MAGIC:
                raise FormatError(f"Expected a residual piece starting with {PIECE_MAGIC!r}. Got "
                                  f"{bytes(payload[:4])!r} instead.")
            piece = np.asarray(codec.decode(payload[len(PIECE_MAGIC):])).view(bits.dtype).reshape(-1)
        except FormatError as exc:
            raise IntegrityError(f"Residual piece of {path!r}: {undecodable(oid, exc)}") from exc
        except (InshrinkError, OSError, MemoryError):
            raise  # damaged or missing (named already), or the storage failed
        except Exception as exc:  # numpy's on a piece of the wrong size: the same error
            raise IntegrityError(f"Residual piece of {path!r}: {undecodable(oid, exc)}") from exc
        if offset + piece.size > bits.size:
            raise IntegrityError(f"Expected the residual pieces of {path!r} to cover {bits.size} elements. "
                                 "Got more instead.")
        bits[offset:offset + piece.size] ^= piece
        offset += piece.size
    if offset != bits.size and array.pieces:
        raise IntegrityError(f"Expected the residual pieces of {path!r} to cover {bits.size} elements. Got "
                             f"{offset} instead.")
    if _checksum(bits) != array.checksum:
        raise IntegrityError(
            f"Expected {path!r} with its residual to match the checksum of the saved bits ({array.checksum}). "
            f"Got {_checksum(bits)} instead: the residual or the stored tensor is damaged. Run `inshrink verify`.")
    return bits.view(carrier).reshape(array.shape)


class Residual:
    """One version's restore residual, loaded: :meth:`exact` turns a stored tensor back into
    its exact bits; tensors it does not name were stored exactly already."""

    def __init__(self, objects: ObjectStore, ref: ResidualRef, arrays: Mapping[str, ResidualArray]) -> None:
        self.objects, self.ref, self.arrays = objects, ref, dict(arrays)

    def __contains__(self, path: object) -> bool:
        return path in self.arrays

    def covers(self, quantized: list[str]) -> bool:
        """Whether every one of the version's ``quantized`` tensors comes back exact with it."""
        return all(path in self.arrays for path in quantized)

    def exact(self, path: str, stored: np.ndarray) -> np.ndarray:
        """``stored`` itself when ``path`` has no residual (it is exact), else the exact bits."""
        if path not in self.arrays:
            return stored
        return apply(self.objects, self.arrays[path], stored, path)


def near_heads(history: Any, heads: Iterable[str],
               on_error: Callable[[str, Exception], None] | None = None) -> dict[str, set[str]]:
    """Residual id -> the snapshots that keep it: every version less than its own
    ``keep_newest`` below a branch head. A set, since documents are addressed by content:
    identical saves name one document, and it is needed while any of them keeps it.
    ``keep_newest`` is at most :data:`MAX_KEEP_NEWEST`, so this reads at most that many
    snapshots per branch, whatever the length of the history (what lets the Checkpointer
    drop old residuals cheaply).

    A missing snapshot ends a walk (a parent gc removed, or a dangling head). Any other error
    reading one goes to ``on_error`` (snapshot id, error), which raises to stop the caller
    (gc fails closed) or returns to end that walk; without it a damaged snapshot ends the
    walk and any other error propagates."""
    out: dict[str, set[str]] = {}
    for head in heads:
        current: str | None = head
        distance = 0
        while current is not None and distance < MAX_KEEP_NEWEST:
            try:
                info = history.get(current)
                ref = ResidualRef.from_metadata(info.metadata, current)
            except NotFoundError:
                break
            except Exception as exc:
                if on_error is None and not isinstance(exc, (IntegrityError, FormatError)):
                    raise
                if on_error is not None:
                    on_error(current, exc)
                break
            if keeps(distance, ref):
                assert ref is not None
                out.setdefault(ref.id, set()).add(current)
            current, distance = info.parent, distance + 1
    return out


def keeps(distance: int, ref: ResidualRef | None) -> bool:
    """Whether a version ``distance`` steps below its branch head keeps its residual."""
    return ref is not None and distance < ref.keep_newest


def stored_values(values: np.ndarray, codec: Any, name: str) -> np.ndarray:
    """The values a reader will get back for a plan's ``values`` under its ``codec`` (its
    serializer) as logical dtype ``name``, what the residual is taken against: the values,
    except that a NaN or Inf the codec keeps as a protected value comes back in the protected
    dtype (a NaN payload can change), so those tensors go through the codec once."""
    values = np.asarray(values)
    entry = dtype_registry.get(name)
    if not entry.is_float or not hasattr(codec, "codebook") or np.isfinite(entry.to_float32(values)).all():
        return values
    q = quantizer(tuple(codec.codebook), codec.tolerance, codec.protected_dtype, str(entry.codec_name))
    return np.asarray(q.decode(q.encode(values.reshape(-1)))).reshape(values.shape)
