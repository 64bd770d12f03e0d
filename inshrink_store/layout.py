"""The store's key layout: every path the store writes or parses is made and read here.
Layer: helpers (``layout`` | ``dtypes`` | ``parallel``), above only ``errors``.

Paths are relative to the store's root URL (see docs/reference/format.md)::

    inshrink.json                      settings
    refs/branches/<name>/<seq:012d>    one write-once file per commit; head = highest seq
    refs/tags/<name>                   write-once
    snapshots/<id>                     snapshot documents
    trees/<2 hex>/<30 hex>             root and node trees
    objects/<2 hex>/<30 hex>           chunk objects
    leases/{writers,fences,gc,broken}/<token>
    *.tmp-<uuid>                       a local atomic write in progress (never listed)

Every id is checked before a path is built from it, so a value read from a damaged or
hostile store (``../../x``) can never reach the filesystem.
"""

from __future__ import annotations

import re
from typing import Any

from inshrink_store.errors import FormatError, InshrinkError, IntegrityError

CONFIG_FILE = "inshrink.json"
ID_PATTERN = re.compile(r"[0-9a-f]{32}")
SEQ_WIDTH = 12
TEMP_MARKER = ".tmp-"

BRANCHES = "refs/branches"
TAGS = "refs/tags"
SNAPSHOTS = "snapshots"
TREES = "trees"
OBJECTS = "objects"
RESIDUALS = "residuals"
LEASES = "leases"
WRITER_LEASES = f"{LEASES}/writers"
FENCES = f"{LEASES}/fences"
GC_LEASES = f"{LEASES}/gc"
BROKEN_MARKERS = f"{LEASES}/broken"


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_id(value: Any, kind: str, where: str, error: type[InshrinkError] = IntegrityError) -> str:
    """``value`` if it is a well-formed id (32 lowercase hex digits), else ``error``.

    ``kind`` names what the id points to ("snapshot", "tree", "object") and ``where``
    the document or file it was read from; every path built from an id goes through
    here first, so a value such as ``../../x`` can never reach the filesystem.
    """
    if isinstance(value, str) and ID_PATTERN.fullmatch(value) is not None:
        return value
    fix = (
        "pass a full snapshot id, a branch or a tag"
        if issubclass(error, FormatError)
        else "the document is corrupt or was not written by inshrink-store; run `inshrink verify`"
    )
    raise error(
        f"Expected the {kind} id in {where} to be 32 lowercase hex digits. "
        f"Got {_show(value)} instead: {fix}."
    )


def _fanned(prefix: str, ident: str) -> str:
    return f"{prefix}/{ident[:2]}/{ident[2:]}"


def object_path(oid: str) -> str:
    """Where object ``oid`` lives."""
    return _fanned(OBJECTS, check_id(oid, "object", "an object reference"))


def tree_path(tree_id: str) -> str:
    """Where tree ``tree_id`` lives."""
    return _fanned(TREES, check_id(tree_id, "tree", "a tree reference"))


def residual_path(residual_id: str) -> str:
    """Where restore residual document ``residual_id`` lives."""
    return _fanned(RESIDUALS, check_id(residual_id, "residual", "a residual reference"))


def snapshot_path(snapshot_id: str) -> str:
    """Where snapshot ``snapshot_id`` lives."""
    return f"{SNAPSHOTS}/{check_id(snapshot_id, 'snapshot', 'a snapshot reference')}"


def branch_prefix(branch: str) -> str:
    return f"{BRANCHES}/{branch}"


def branch_ref_path(branch: str, seq: int) -> str:
    return f"{BRANCHES}/{branch}/{seq:0{SEQ_WIDTH}d}"


def tag_path(tag: str) -> str:
    return f"{TAGS}/{tag}"


def lease_token(path: str) -> str:
    """The token a lease, fence or marker file is named by."""
    return path.rsplit("/", 1)[-1]


def is_temp(path: str) -> bool:
    return TEMP_MARKER in path


def parse_branch_listing(paths: list[str]) -> dict[str, list[int]]:
    """``refs/branches/<name>/<seq>`` paths -> branch name -> sorted seqs (ignores strays)."""
    out: dict[str, list[int]] = {}
    for path in paths:
        parts = path.split("/")
        if len(parts) == 4 and f"{parts[0]}/{parts[1]}" == BRANCHES and parts[3].isdigit():
            out.setdefault(parts[2], []).append(int(parts[3]))
    return {name: sorted(seqs) for name, seqs in sorted(out.items())}


def parse_tag_listing(paths: list[str]) -> list[str]:
    """``refs/tags/<name>`` paths -> tag names."""
    return sorted(p.split("/", 2)[2] for p in paths if p.startswith(TAGS + "/") and p.count("/") == 2)


def classify(path: str) -> tuple[str, str] | None:
    """A listed path -> (kind, id) for snapshots, trees, objects and residuals; None for anything else."""
    kind, _, rest = path.partition("/")
    if kind == SNAPSHOTS and ID_PATTERN.fullmatch(rest):
        return kind, rest
    if kind in (TREES, OBJECTS, RESIDUALS):
        ident = rest.replace("/", "")
        if ID_PATTERN.fullmatch(ident) and rest == f"{ident[:2]}/{ident[2:]}":
            return kind, ident
    return None
