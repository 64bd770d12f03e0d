"""du: storage per version along a history, each byte counted where first used."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

from inshrink_store.errors import IntegrityError, NotFoundError
from inshrink_store.layout import OBJECTS, object_path, tree_path
from inshrink_store.parts import StoreParts


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
        logical = sum(a.logical_bytes for a in arrays)
        cumulative += new_bytes
        cumulative_logical += logical
        rows.append(UsageRow(info.id, info.step, info.message, logical, new_bytes, cumulative,
                             cumulative_logical, new_objects, deltas))

    return rows


def stored_bytes(parts: StoreParts, ref: str) -> dict[str, int]:
    """Tensor path -> bytes its chunk objects take in the store (an object shared by two
    tensors counts for each; a delta counts its own bytes, not its base's)."""
    reader = parts.checkout(ref)
    sizes = parts.storage.list(OBJECTS)
    return {path: sum(sizes.get(object_path(o), 0) for o in set(info.chunk_ids.values()))
            for path, info in sorted(reader.arrays().items())}
