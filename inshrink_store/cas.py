"""The object store: content-addressed chunk objects under ``objects/``, written once, kept
whole or as bounded delta chains, every read verified end to end.
Layer: objects and leases (``cas`` | ``leases``), under everything that stores or deletes.

What an object's bytes are (header, checksum, coders, the bounds a reader checks) is
:mod:`inshrink_store.object_format`; this module decides where objects live and which form
to write: dedup by id, a delta against the parent version's chunk when clearly smaller, a
keyframe every ``keyframe_interval`` links, and read-your-writes before anything is stored.
A read resolves the chain (with loop and depth guards, never a hang), checks every link's
checksum and the logical id, and caches payloads for the next version's deltas.
"""


from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from inshrink_store.codecs import bytegroup
from inshrink_store.codecs._payload import is_quantized_payload
from inshrink_store.codecs.vdelta import VDelta, worth_delta
from inshrink_store.errors import (
    FormatError,
    IntegrityError,
    InvalidInputError,
    NotFoundError,
    WriteCheckError,
)
from inshrink_store.layout import object_path
from inshrink_store.lru import ByteBoundedLRU
from inshrink_store.manifest import content_id
from inshrink_store.object_format import (
    CODER_BYTEGROUP,
    CODER_CLOSED_LOOP,
    CODER_NONE,
    CODER_PACKED_ZSTD,
    CODER_ZSTD,
    HEADER_SIZE,
    KIND_DELTA,
    KIND_WHOLE,
    LOSSLESS_LEVEL,
    MAX_CHAIN,
    MAX_CHUNK_EXPANSION,
    ObjectHeader,
    check_floats,
    checked_body,
    decode_body,
    float_keyframe,
    frame,
    keyframe_body,
    parse_header,
)
from inshrink_store.storage import LocalStorage, Storage

log = logging.getLogger(__name__)
#: what a chain decoded in byte planes gives: bytes (:meth:`ObjectStore.get`) or an array (:meth:`ObjectStore.take`)
_Payload = TypeVar("_Payload", bytes, np.ndarray)

#: raw float chunks smaller than this are tried against the parent's chunk only when this
#: object store holds the parent's payload already (:data:`RECENT_FLOATS_BYTES`: it wrote it),
#: whose body is then never read. Why: reading costs two reads of the base object and decoding it (about
#: 0.2 ms per chunk here, 10-15 % of a save of thousands of small tensors, and a request each
#: on object storage), for little: on the demo's biases the XOR planes never came out clearly
#: smaller. Where they do (the evaluation's CNN: its first convolution, 288 weights, and its
#: classifier, 2,560, change little between versions), coding against a payload at hand costs
#: a second coding pass of a few KiB: the CNN's small lossless weights went from 258 to 183 KB
#: over 23 versions
FLOAT_DELTA_MIN = 16 << 10
#: raw float chunks smaller than this are never tried against the parent's chunk: on the
#: evaluation's CNN and LM, no bias or norm under 256 float32 values saved 1 % that way, and
#: the attempt costs about 50 us a chunk (a header read, a second coding pass), 5-10 % of
#: storing it (a model's thousands of small norms and step counters)
FLOAT_DELTA_SMALLEST = 1 << 10
#: the small raw-float payloads (under :data:`FLOAT_DELTA_MIN`) an object store keeps after
#: writing them: the next version's chunk of the same tensor is tried as a delta against one of
#: them, reading only the base's 40-byte header (its chain depth, as stored: another writer may
#: have stored the same content since). A training process saves the same small
#: tensors every version, so this holds at most a version of them (a model with 10,000 biases
#: of 4 KiB: 40 MiB); after a restart the first version's are keyframes
RECENT_FLOATS_BYTES = 64 << 20
#: set to 1 to decode raw-float objects too before they are stored and compare them with the
#: payload they were meant to hold (quantized ones always are); on in the test suite and in CI
VERIFY_WRITES_ENV = "INSHRINK_VERIFY_WRITES"
DEFAULT_KEYFRAME_INTERVAL = 8


@dataclass(frozen=True)
class ClosedLoopCoding:
    """A planner's coding of one float32 chunk (coder 4): ``body`` (``codecs/closed_loop``),
    and whether it is a ``residual`` against the parent version's chunk or a keyframe."""

    body: bytes
    residual: bool


@dataclass(frozen=True)
class PutResult:
    oid: str
    stored_bytes: int  # 0 when the object already existed (dedup)
    kind: int


class ObjectStore:
    """Write-once objects under ``objects/``; safe for concurrent writers (ids are content)."""

    def __init__(
        self,
        storage: Storage,
        keyframe_interval: int = DEFAULT_KEYFRAME_INTERVAL,
        cache_bytes: int = 512 << 20,
    ) -> None:
        if keyframe_interval < 1:
            raise FormatError(f"Expected keyframe_interval >= 1. Got {keyframe_interval} instead.")
        self.storage = storage
        self.keyframe_interval = keyframe_interval
        self._cache = ByteBoundedLRU(cache_bytes)
        #: oid -> payload of the small raw-float chunks written here (see FLOAT_DELTA_MIN)
        self._recent_floats = ByteBoundedLRU(RECENT_FLOATS_BYTES)
        self._delta = VDelta()

    def __getstate__(self) -> dict[str, object]:
        return {"storage": self.storage, "interval": self.keyframe_interval, "cache": self._cache.max_bytes}

    def __setstate__(self, state: dict[str, object]) -> None:
        # __init__ on an instance, as unpickling needs (mypy calls that unsound in general)
        self.__init__(state["storage"], state["interval"], state["cache"])  # type: ignore[misc]

    # -- writing ---------------------------------------------------------------------
    def put(self, payload: bytes | memoryview, base: str | None = None, element: str | None = None,
            closed: ClosedLoopCoding | None = None) -> PutResult:
        """Store ``payload`` (whole, or as a delta against object ``base`` when clearly smaller).

        ``element`` (one of :data:`ELEMENTS`) says the payload is raw little-endian floats of
        that type: it is then coded with ``inshrink.bytegroup`` (coder 3), and against
        ``base`` (the parent version's chunk) its byte planes may be XORed with the base's.
        ``closed`` (float32 payloads only): the planner's closed-loop coding of the payload
        (coder 4), stored when it decodes to the payload bit for bit, against ``base`` when
        it is a residual; otherwise the payload is stored as raw floats and a warning logged
        (the values stored never depend on the coding, only their size)."""
        if closed is not None and element == "float32":
            return self._put_closed(payload, base, closed)
        if element is not None:
            # raw floats are read where they lie (often a view of the caller's tensor: 4 MiB
            # chunks, no copy) and not cached: a copy of every chunk of the model, and the
            # caller's tensor may change; the next version's delta reads them back
            view = memoryview(payload).cast("B")
            oid = content_id(view)
            if oid == base or self.storage.exists_durably(object_path(oid)):
                return PutResult(oid, 0, -1)
            stored = self._encode_floats(view, base, element)
            try:
                self._check_writable(oid, stored, view)
            except WriteCheckError:
                if content_id(view) == oid:
                    raise
                # the caller's tensor moved under the coder: theirs to fix, not our bug
            if content_id(view) != oid:  # read where they lie: they must not move meanwhile
                raise InvalidInputError(
                    f"Expected the {element} values of a chunk to stay unchanged while they are "
                    "saved. Got different bits at the end than at the start instead (another thread "
                    "wrote to the tensor); nothing was stored for it. Save a copy, or wait for the "
                    "save before changing the tensor.")
            self.storage.write(object_path(oid), stored)
            if FLOAT_DELTA_SMALLEST <= len(view) < FLOAT_DELTA_MIN:
                self._recent_floats.put(oid, bytes(view))
            return PutResult(oid, len(stored), stored[4])
        payload = bytes(payload)
        oid = content_id(payload)
        # No process-wide "already written" set: gc (here or in another process) may have
        # deleted an object since, and skipping the write would commit a dangling id. An
        # unchanged chunk (same id as the parent's at this key) lives in the parent, which
        # every gc keeps as a branch head, so it needs no round trip.
        if oid == base or self.storage.exists_durably(object_path(oid)):
            return PutResult(oid, 0, -1)
        stored = self._encode(payload, base)
        self._check_writable(oid, stored, payload)
        self.storage.write(object_path(oid), stored)
        self._cache.put(oid, payload)  # kept for the next version's delta
        return PutResult(oid, len(stored), stored[4])

    def _put_closed(self, payload: bytes | memoryview, base: str | None, closed: ClosedLoopCoding) -> PutResult:
        """Coder 4 (see :meth:`put`): a keyframe, or a residual against ``base`` whose chain
        stays under the keyframe interval and whose payload has the same size."""
        view = memoryview(payload).cast("B")
        oid = content_id(view)
        if oid == base or self.storage.exists_durably(object_path(oid)):
            return PutResult(oid, 0, -1)
        why = ""
        depth = 0
        if closed.residual:
            try:
                base_header = None if base is None else self.header(base)
            except (FormatError, NotFoundError, IntegrityError) as exc:
                base_header, why = None, f"its base is unreadable ({exc})"
            if base_header is None:
                why = why or "it has no base (the tensor is new in this version)"
            elif base_header.depth + 1 >= self.keyframe_interval:
                why = f"its base {base} ends a chain of {base_header.depth + 1} (the keyframe interval)"
            elif base_header.logical_length != len(view):
                why = f"its base {base} holds {base_header.logical_length} bytes, not {len(view)}"
            else:
                depth = base_header.depth + 1
        body = closed.body
        short = -(-len(view) // MAX_CHUNK_EXPANSION) - HEADER_SIZE - len(body)
        if short > 0:  # zero padding after the stream, which its reader ignores
            body += bytes(short)
        if not why:
            stored = frame(KIND_DELTA if closed.residual else KIND_WHOLE, CODER_CLOSED_LOOP, depth, view,
                            base if closed.residual else None, body)
            try:
                self._check_writable(oid, stored, view)
            except WriteCheckError as exc:
                why = str(exc)
            else:
                self.storage.write(object_path(oid), stored)
                return PutResult(oid, len(stored), KIND_DELTA if closed.residual else KIND_WHOLE)
        log.warning("closed-loop chunk %s stored as raw floats: %s", oid, why)
        stored = self._encode_floats(view, base, "float32")
        self._check_writable(oid, stored, view)
        self.storage.write(object_path(oid), stored)
        return PutResult(oid, len(stored), stored[4])

    def _check_writable(self, oid: str, stored: bytes, payload: bytes | memoryview) -> None:
        """Read your writes: the header's declared sizes must pass the bounds the reader checks
        (:func:`parse_header`, always, a few comparisons). A quantized object (zstd or packed
        ids, or a level-id delta) is then decoded as a reader will, its base included, and
        must give back ``payload`` bit for bit: always, since decoding ids is cheap beside
        quantizing them, and the read-back defect of e41198a..a828d53 was in that path; raw
        floats (coder 3) too with ``INSHRINK_VERIFY_WRITES=1`` (their decode costs about half
        their encode). Either failure is a :class:`WriteCheckError` naming the coder, raised
        before the object is stored, so the version is never committed."""
        try:
            header = parse_header(oid, stored, len(stored))
        except IntegrityError as exc:
            raise WriteCheckError(f"Expected object {oid} to pass its reader's bounds before it is "
                                  f"stored. Got: {exc}") from None
        quantized = header.coder in (CODER_ZSTD, CODER_PACKED_ZSTD, CODER_CLOSED_LOOP) or (
            header.is_delta and header.coder == CODER_NONE)
        if not (quantized or verify_writes()):
            return
        base = None if header.base is None else self._base_payload(header.base)
        try:
            decoded = decode_body(oid, header, checked_body(oid, header, stored), base, self._delta)
        except IntegrityError as exc:
            decoded, why = b"", str(exc)
        else:
            why = f"{len(decoded)} bytes with id {content_id(decoded)}"
        if len(decoded) != len(payload) or content_id(decoded) != oid:
            raise WriteCheckError(
                f"Expected object {oid} (kind {header.kind}, coder {header.coder}) to decode to the "
                f"{len(payload)}-byte payload it was written from. Got {why} instead; nothing was "
                "stored and the version is not committed. This is a bug in inshrink-store: please "
                "report it.")

    def _encode(self, payload: bytes, base: str | None) -> bytes:
        quantized = is_quantized_payload(payload)
        coder, body = keyframe_body(payload)
        whole = frame(KIND_WHOLE, coder, 0, payload, None, body)
        if not quantized or base is None or base == content_id(payload):
            return whole
        try:
            base_header = self.header(base)
            if base_header.depth + 1 >= self.keyframe_interval:
                return whole
            base_payload = self.get(base)
            if not is_quantized_payload(base_payload):
                return whole
            delta = self._delta.encode(payload, base=base_payload)
        except (FormatError, NotFoundError, IntegrityError):
            return whole  # a shape change or an unreadable base: a keyframe is always correct
        if not worth_delta(len(delta), len(body)):
            return whole
        return frame(KIND_DELTA, CODER_NONE, base_header.depth + 1, payload, base, delta)

    def _encode_floats(self, payload: memoryview, base: str | None, element: str) -> bytes:
        """Coder 3: the payload's byte planes coded apart; a delta when a plane codes smaller
        as the XOR with the base payload's (same element count: the same tensor's chunk one
        version back) and the whole is clearly smaller than the keyframe. With a usable base,
        the keyframe and the delta come from one coding of the planes."""
        check_floats(payload, element)
        base_payload, depth = self._float_base(payload, base)
        if base_payload is None:
            coder, body = keyframe_body(payload, element)
            return frame(KIND_WHOLE, coder, 0, payload, None, body)
        keyframe, delta = bytegroup.encode_keyframe_and_delta(
            np.frombuffer(payload, np.uint8), element, LOSSLESS_LEVEL, "zstd+huffman",
            base=np.frombuffer(base_payload, np.uint8))
        coder, body = float_keyframe(payload, keyframe)  # the delta must beat what a keyframe stores
        if delta is None or not worth_delta(len(delta), len(body)):
            return frame(KIND_WHOLE, coder, 0, payload, None, body)
        return frame(KIND_DELTA, CODER_BYTEGROUP, depth + 1, payload, base, delta)

    def _float_base(self, payload: memoryview, base: str | None) -> tuple[bytes | None, int]:
        """(the base's payload, its depth) when raw floats can be coded against object
        ``base``: another object of the same size whose chain stays under the keyframe
        interval; (None, 0) otherwise (a keyframe is always correct). A payload under
        :data:`FLOAT_DELTA_MIN` only against a base whose payload this store wrote and holds:
        of the base only the header is read (its depth is the stored object's, whoever wrote
        it last), never its body."""
        if base is None or len(payload) < FLOAT_DELTA_SMALLEST or base == content_id(payload):
            return None, 0
        known = None
        if len(payload) < FLOAT_DELTA_MIN:
            known = self._recent_floats.get(base)
            if known is None:
                return None, 0
        try:
            base_header = self.header(base)
            if base_header.depth + 1 >= self.keyframe_interval or base_header.logical_length != len(payload):
                return None, 0
            return (self.get(base) if known is None else known), base_header.depth
        except (FormatError, NotFoundError, IntegrityError):
            return None, 0  # an unreadable base

    def _base_payload(self, oid: str) -> bytes:
        """A delta base's payload: the one this store wrote, when it is a small float chunk
        still at hand (its id is its hash, so it is the stored one), else :meth:`get`."""
        recent = self._recent_floats.get(oid)
        return recent if recent is not None else self.get(oid)

    # -- reading ---------------------------------------------------------------------
    def read_stored(self, oid: str) -> bytes:
        try:
            return self.storage.read(object_path(oid))
        except FileNotFoundError:
            raise _missing(oid) from None

    def stored_size(self, oid: str) -> int:
        """Bytes ``oid`` takes on storage (no read); NotFoundError when it is missing."""
        try:
            return self.storage.size(object_path(oid))
        except FileNotFoundError:
            raise _missing(oid) from None

    def header(self, oid: str) -> ObjectHeader:
        """The header of ``oid`` from a ranged read of its first 40 bytes (memory, local
        disks, S3 and GCS all serve byte ranges: a multi-MiB chunk is never downloaded to
        learn its kind or base). Structure only: the checksum and length bounds are checked
        by :meth:`get`."""
        path = object_path(oid)
        try:
            data = self.storage.read_range(path, 0, HEADER_SIZE)
        except FileNotFoundError:
            data = self.read_stored(oid)  # raises the NotFoundError naming the object
        except Exception:  # no ranged reads here, or a range past a truncated object (HTTP 416)
            data = self._header_fallback(oid, path)
        return parse_header(oid, bytes(data[:HEADER_SIZE]))

    def _header_fallback(self, oid: str, path: str) -> bytes:
        """The first bytes of ``oid`` where a ranged read failed: an object too short to hold
        a header (what HTTP 416 means) is read whole, a few bytes; any other streamed in one
        block of a header (:meth:`Storage.read_start`), so still no whole-object download."""
        if self.stored_size(oid) <= HEADER_SIZE:  # NotFoundError naming it when missing
            return self.read_stored(oid)
        return self.storage.read_start(path, HEADER_SIZE)

    def get(self, oid: str) -> bytes:
        """The logical payload of ``oid``, chain resolved: every link's stored checksum and the
        payload's id checked, and each link's id where the chain is decoded link by link (a
        chain of lossless float deltas is decoded in byte planes: :meth:`_decode_in_planes`)."""
        cached = self._cache.get(oid)
        if cached is not None:
            return cached
        chain, base_payload = self._read_chain(oid)
        payload = self._decode_in_planes(oid, chain, base_payload, bytegroup.decode_chain_to_bytes)
        if payload is None:
            return self._decode_links(chain, base_payload)
        self._cache.put(oid, payload)
        return payload

    def take(self, oid: str) -> np.ndarray:
        """:meth:`get`'s payload as a new writable uint8 array that the caller owns, with the
        same checks and errors, and not cached: for a reader that reads each chunk once and
        hands its memory on (an export writes it to a file), where the cache's payloads (a
        restore's next save wants them, as delta bases) would be a second copy of the version.

        Why: the cache keeps immutable bytes, so such a reader copied every chunk out of them
        into memory of its own; an ``export --all`` of a lossless chunk decoded it into a
        scratch buffer, copied that into the cache's bytes, then into the tensor (two copies
        into fresh memory, a page fault per 4 KiB each). Here a chain of bytegroup links (a
        lone keyframe too) is joined straight into the array returned (issue 43, item 10);
        other payloads are decoded link by link as :meth:`get` decodes them, and copied."""
        cached = self._cache.get(oid)
        if cached is None:
            chain, base_payload = self._read_chain(oid, mapped=True)  # each body dropped once decoded
            payload = self._decode_in_planes(oid, chain, base_payload, bytegroup.decode_chain, least=1,
                                             keep=False)
            if payload is not None:
                return payload
            cached = self._decode_links(chain, base_payload, keep=False)
        return np.frombuffer(cached, np.uint8).copy()

    def _read_chain(self, oid: str, mapped: bool = False) -> tuple[list[tuple[str, ObjectHeader, memoryview]],
                                                                    bytes | None]:
        """(links from ``oid`` down to a keyframe or a cached payload, newest first, with header
        and checksummed body; that cached payload or None). ``mapped``: on a local disk the
        bodies are views of the files mapped into memory (:meth:`LocalStorage.read_mapped`)."""
        chain: list[tuple[str, ObjectHeader, memoryview]] = []
        seen: set[str] = set()
        current: str | None = oid
        base_payload: bytes | None = None
        while current is not None:
            if current in seen or len(chain) > MAX_CHAIN:
                raise IntegrityError(
                    f"Expected the delta chain of object {oid} to end in a keyframe. "
                    f"Got a loop or an endless chain at {current} instead."
                )
            seen.add(current)
            cached = self._cache.get(current)
            if cached is not None:
                base_payload = cached
                break
            stored = self._read_link(oid, current, chain, mapped)
            header = parse_header(current, bytes(stored[:HEADER_SIZE]), len(stored))
            if chain and chain[-1][1].depth != header.depth + 1:
                raise IntegrityError(
                    f"Expected delta object {chain[-1][0]} (depth {chain[-1][1].depth}) to be one "
                    f"deeper than its base {current} (depth {header.depth}). Got a mismatch "
                    "instead: one of them is corrupt. Run `inshrink verify`."
                )
            body = checked_body(current, header, stored)
            chain.append((current, header, body))
            current = header.base
        return chain, base_payload

    def _decode_links(self, chain: list[tuple[str, ObjectHeader, memoryview]], base_payload: bytes | None,
                      keep: bool = True) -> bytes:
        """``chain[0]``'s payload, link by link from the bottom, each link's id checked and
        (with ``keep``) cached."""
        for cid, header, checked in reversed(chain):
            payload = decode_body(cid, header, checked, base_payload, self._delta)
            if len(payload) != header.logical_length or content_id(payload) != cid:
                raise IntegrityError(
                    f"Expected object {cid} to decode to {header.logical_length} bytes with that "
                    f"id. Got {len(payload)} bytes with id {content_id(payload)} instead: the "
                    "object or its base is corrupt."
                )
            if keep:
                self._cache.put(cid, payload)
            base_payload = payload
        assert base_payload is not None
        return base_payload

    def _decode_in_planes(self, oid: str, chain: list[tuple[str, ObjectHeader, memoryview]],
                          base_payload: bytes | None, decode: Callable[..., _Payload],
                          least: int = 2, keep: bool = True) -> _Payload | None:
        """``oid``'s payload where the chain's newest links are ``least`` (two) or more
        bytegroup links (deltas, and the keyframe under them), decoded in byte planes with one
        join by ``decode`` (:func:`bytegroup.decode_chain`, or its ``_to_bytes`` form: joining,
        hashing, copying and splitting each link was half an export's time); None otherwise,
        or where that fails or gives other bytes than ``oid``'s (then the caller decodes link
        by link, which names the bad link). Each link's checksum and base hash is checked, and
        the result's id; the links below are never formed, so their ids are not (``verify``
        reads every object base first) nor cached, and the caller caches the result or not
        (links under the bytegroup links are decoded and, with ``keep``, cached)."""
        top = 0
        while top < len(chain) and chain[top][1].coder == CODER_BYTEGROUP and chain[top][1].is_delta:
            top += 1
        if top < len(chain) and chain[top][1].coder == CODER_BYTEGROUP:  # the keyframe under them
            top += 1
        if top < least:
            return None
        below = chain[top:]
        base = self._decode_links(below, base_payload, keep) if below else base_payload
        header = chain[0][1]
        try:
            links = [np.frombuffer(body, np.uint8) for _, _, body in reversed(chain[:top])]
            payload = decode(links, bytegroup.DTYPE_NAMES[bytegroup.parse(links[-1])[0]], base,
                             header.logical_length, checked=False)  # the id is checked below
        except MemoryError:
            raise
        except Exception:  # noqa: BLE001 - decoded again link by link, which names the bad link
            return None
        if len(payload) != header.logical_length or content_id(payload if isinstance(payload, bytes) else payload.data) != oid:
            return None
        return payload

    def _read_link(self, oid: str, current: str, chain: list[tuple[str, ObjectHeader, memoryview]],
                   mapped: bool = False) -> bytes | memoryview:
        """Stored bytes of ``current`` (``mapped``: see :meth:`_read_chain`); a missing *base*
        means the chain of ``oid`` is broken."""
        try:
            if mapped and isinstance(self.storage, LocalStorage):
                try:
                    return self.storage.read_mapped(object_path(current))
                except FileNotFoundError:
                    raise _missing(current) from None
            return self.read_stored(current)
        except NotFoundError as exc:
            if not chain:
                raise
            raise IntegrityError(
                f"Expected the base {current} of delta object {chain[-1][0]} (chain of {oid}) to "
                f"exist. Got nothing instead ({exc}): the delta chain is broken."
            ) from None

    def chain(self, oid: str) -> list[str]:
        """Ids from ``oid`` down to its keyframe (for gc and verify); loops are errors."""
        out: list[str] = []
        current: str | None = oid
        while current is not None:
            if current in out or len(out) > MAX_CHAIN:
                raise IntegrityError(f"Expected a finite delta chain from {oid}. Got a loop at {current}.")
            out.append(current)
            current = self.header(current).base
        return out


def _missing(oid: str) -> NotFoundError:
    return NotFoundError(f"Expected object {oid} at {object_path(oid)}. Got nothing there instead: "
                         "the store is missing data. Run `inshrink verify`.")


def verify_writes() -> bool:
    """Whether ``INSHRINK_VERIFY_WRITES`` asks every stored object to be decoded first."""
    return os.environ.get(VERIFY_WRITES_ENV, "").strip().lower() in ("1", "true", "yes", "on")
