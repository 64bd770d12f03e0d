"""du: storage per version along a history, each byte counted where first used."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

from inshrink_store import residual
from inshrink_store.errors import FormatError, IntegrityError, NotFoundError
from inshrink_store.layout import OBJECTS, object_path, residual_path, tree_path
from inshrink_store.parts import StoreParts
from inshrink_store.residual import ResidualRef


@dataclass
class UsageRow:
    snapshot: str
    step: int | None
    message: str
    logical_bytes: int
    new_stored_bytes: int
    cumulative_stored_bytes: int
    cumulative_logical_bytes: int
    new_objects: int
    delta_objects: int
    #: bytes of the version's restore residual still in the store (0: none, or collected);
    #: part of ``new_stored_bytes`` in a whole-store du (no prefix)
    residual_bytes: int = 0

    @property
    def ratio(self) -> float:
        return self.logical_bytes / self.new_stored_bytes if self.new_stored_bytes else math.inf

    @property
    def cumulative_ratio(self) -> float:
        c = self.cumulative_stored_bytes
        return self.cumulative_logical_bytes / c if c else math.inf

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["ratio"] = None if math.isinf(self.ratio) else self.ratio
        d["cumulative_ratio"] = None if math.isinf(self.cumulative_ratio) else self.cumulative_ratio
        return d


def du(parts: StoreParts, ref: str, prefix: str = "") -> list[UsageRow]:
    """Storage per version along ``ref``'s history, oldest first; bytes are counted where first used.

    ``prefix`` (e.g. ``"model/"``) counts only the tensors under it and no tree objects, so a
    training state's weights and optimizer can be reported apart.
    """
    history = list(reversed(parts.history.walk(parts.resolve(ref))))
    sizes = parts.storage.list("")
    seen: set[str] = set()
    rows: list[UsageRow] = []
    cumulative = cumulative_logical = 0
    for info in history:
        reader = parts.reader(info)
        new_bytes = new_objects = deltas = 0
        for tid in [info.root, *reader.index.root.nodes.values()]:
            if tid not in seen and not prefix:
                seen.add(tid)
                new_bytes += sizes.get(tree_path(tid), 0)
        arrays = [a for p, a in reader.arrays().items() if p.startswith(prefix)]
        for array in arrays:
            for oid in array.chunk_ids.values():
                if oid in seen:
                    continue
                seen.add(oid)
                new_objects += 1
                new_bytes += sizes.get(object_path(oid), 0)
                with contextlib.suppress(IntegrityError, NotFoundError):
                    deltas += parts.objects.header(oid).is_delta
        residual_bytes = 0 if prefix else _residual_bytes(parts, info, sizes, seen)
        new_bytes += residual_bytes
        logical = sum(a.logical_bytes for a in arrays)
        cumulative += new_bytes
        cumulative_logical += logical
        rows.append(UsageRow(info.id, info.step, info.message, logical, new_bytes, cumulative,
                             cumulative_logical, new_objects, deltas, residual_bytes))

    return rows


def _residual_bytes(parts: StoreParts, info: Any, sizes: dict[str, int], seen: set[str]) -> int:
    """Bytes of ``info``'s restore residual (document and pieces not counted before) while it
    is in the store; 0 when it has none or gc collected it."""
    try:
        ref = ResidualRef.from_metadata(info.metadata, info.id)
        if ref is None or residual_path(ref.id) not in sizes:
            return 0
        arrays = residual.load(parts.storage, ref.id)
    except (IntegrityError, NotFoundError, FormatError):
        return 0
    if ref.id in seen:  # a document two versions share counts once
        return 0
    seen.add(ref.id)
    total = sizes[residual_path(ref.id)]
    for array in arrays.values():
        for oid in array.pieces:
            if oid not in seen:
                seen.add(oid)
                total += sizes.get(object_path(oid), 0)
    return total


def stored_bytes(parts: StoreParts, ref: str) -> dict[str, int]:
    """Tensor path -> bytes its chunk objects take in the store (an object shared by two
    tensors counts for each; a delta counts its own bytes, not its base's)."""
    reader = parts.checkout(ref)
    sizes = parts.storage.list(OBJECTS)
    return {path: sum(sizes.get(object_path(o), 0) for o in set(info.chunk_ids.values()))
            for path, info in sorted(reader.arrays().items())}
