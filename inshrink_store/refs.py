"""Branches and tags as write-once files; resolving ref expressions to snapshot ids.
Layer: refs, history and policy (siblings, none importing another), below ``parts``.

A branch is a folder of files ``refs/branches/<name>/<seq>`` each holding one
snapshot id; the head is the highest ``seq``. Advancing a branch is creating the
next ``seq`` exclusively, the one atomic step every fsspec backend offers, so two
writers can never both win. Tags are single write-once files. Creating a ref makes a
version reachable, so it happens under a writer lease and through its fence, like a
commit (see leases.py); deleting one only shrinks what gc keeps.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

from inshrink_store import leases
from inshrink_store.errors import (
    AlreadyExistsError,
    ConflictError,
    FormatError,
    IntegrityError,
    InvalidInputError,
    NotFoundError,
)
from inshrink_store.layout import (
    BRANCHES,
    TAGS,
    branch_prefix,
    branch_ref_path,
    check_id,
    parse_branch_listing,
    parse_tag_listing,
    snapshot_path,
    tag_path,
)
from inshrink_store.storage import Storage

# always used with fullmatch: "$" would also match before a trailing newline
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_EXPR = re.compile(r"(?P<base>[^~^\s]+)(?P<ops>(?:~[0-9]*|\^)*)")
_MAX_BACK = 1 << 20  # "main~N" walks N parents: far above any history, bounded


def check_name(name: str, kind: str) -> str:
    """Branch and tag names: letters, digits, '.', '_', '-'; no slashes, no '..'."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise InvalidInputError(
            f"Expected a {kind} name of letters, digits, '.', '_' or '-' (no '/' or '..'). "
            f"Got {name!r} instead."
        )
    return name


def parse_expression(expr: str) -> tuple[str, int]:
    """``main~3`` -> ("main", 3); ``main^^`` -> ("main", 2); ``abc123`` -> ("abc123", 0)."""
    if not isinstance(expr, str):
        raise InvalidInputError(f"Expected a ref such as 'main', 'main~3', a tag or a snapshot id. Got {expr!r}.")
    match = _EXPR.fullmatch(expr.strip())
    if not match:
        raise InvalidInputError(
            f"Expected a ref such as 'main', 'main~3', a tag or a snapshot id. Got {expr!r:.80} instead."
        )
    back = 0
    for op in re.findall(r"~[0-9]*|\^", match.group("ops")):
        back += 1 if op in ("^", "~") else int(op[1:]) if len(op) < 12 else _MAX_BACK + 1
    if back > _MAX_BACK:
        raise InvalidInputError(
            f"Expected at most {_MAX_BACK} steps back in ref {expr!r:.80}. Got {back} instead; "
            "name the version by its snapshot id."
        )
    return match.group("base"), back


def replaced_branch_name(branch: str, head_id: str, short: bool = True) -> str:
    """``<branch>.replaced-<id12>``: the branch that keeps ``head_id`` when a commit on an
    older version replaces it as ``branch``'s head (``short=False``: the whole id)."""
    suffix = f".replaced-{head_id[:12] if short else head_id}"
    return branch[: 128 - len(suffix)].rstrip(".") + suffix  # never '..' in a name


def maybe_name(text: str) -> bool:
    """Could ``text`` be a branch or tag name (as opposed to only a snapshot id)?"""
    try:
        check_name(text, "ref")
    except FormatError:
        return False
    return True


class Refs:
    """The branches and tags of one store: read, create (fenced), delete, resolve."""

    def __init__(self, storage: Storage) -> None:
        self._storage = storage

    # -- reading ---------------------------------------------------------------------------
    def read(self, path: str) -> str:
        """The snapshot id in a ref file, checked to be an id (never a path to follow)."""
        raw = self._storage.read(path)
        try:
            text = raw.decode("ascii").strip()
        except UnicodeDecodeError:
            text = repr(raw[:40])
        return check_id(text, "snapshot", f"ref file {path} of {self._storage.url!r}", IntegrityError)

    def branch_seqs(self) -> dict[str, list[int]]:
        """Branch name -> its ref files' sequence numbers, oldest first."""
        return parse_branch_listing(list(self._storage.list(BRANCHES)))

    def head(self, branch: str) -> tuple[int, str] | None:
        """(seq, snapshot id) of ``branch``'s head, or None for a branch with no commit."""
        seqs = self._storage.list(branch_prefix(branch)) if maybe_name(branch) else {}
        found = parse_branch_listing(list(seqs)).get(branch)
        if not found:
            return None
        return found[-1], self.read(branch_ref_path(branch, found[-1]))

    def branches(self) -> dict[str, str]:
        """Branch name -> head snapshot id."""
        return {b: self.read(branch_ref_path(b, s[-1])) for b, s in self.branch_seqs().items()}

    def tags(self) -> dict[str, str]:
        """Tag name -> snapshot id."""
        return {name: self.read(tag_path(name)) for name in parse_tag_listing(list(self._storage.list(TAGS)))}

    def tag_target(self, name: str) -> str | None:
        if not maybe_name(name) or not self._storage.exists(tag_path(name)):
            return None
        return self.read(tag_path(name))

    def all_ref_files(self) -> dict[str, str]:
        """Every branch ref file (old ones too) -> the snapshot id it names."""
        out = {}
        for branch, seqs in self.branch_seqs().items():
            for seq in seqs:
                path = branch_ref_path(branch, seq)
                with contextlib.suppress(FileNotFoundError):
                    out[path] = self.read(path)
        return out

    # -- writing ---------------------------------------------------------------------------
    def advance(self, branch: str, seq: int, snapshot_id: str, replaces: str | None = None) -> None:
        """Create ``branch``'s ref file ``seq`` exclusively: the commit point, a compare-and-swap
        on the head ``replaces`` (ref file ``seq - 1``, read by the caller)."""
        try:
            self._storage.create_exclusive(branch_ref_path(branch, seq), snapshot_id.encode())
        except FileExistsError:
            winner = ""
            with contextlib.suppress(FileNotFoundError, IntegrityError):
                winner = f" ({self.read(branch_ref_path(branch, seq))})"
            was = f" on head {replaces}" if replaces else ""
            raise ConflictError(
                f"Expected to advance branch {branch!r} to version #{seq}{was}. Got a version #{seq}{winner} "
                "committed by another writer first instead; nothing was lost: open the new head "
                "and retry (or commit with rebase=True)."
            ) from None

    @contextlib.contextmanager
    def _published(self, snapshot_id: str, ref: str, gc_wait: float) -> Iterator[None]:
        """A writer lease around publishing a ref to ``snapshot_id``, which must exist
        (checked under the lease, so gc cannot race it), then the fence."""
        lease = leases.acquire_writer(self._storage, wait=gc_wait)
        try:
            if not self._storage.exists_durably(snapshot_path(snapshot_id)):
                raise NotFoundError(
                    f"Expected {ref!r} to name a snapshot in {self._storage.url!r}. Got "
                    f"{snapshot_id}, which does not exist instead (removed by gc?); nothing was written."
                )
            leases.fence_for_commit(self._storage, lease)
            yield
        finally:
            lease.release()

    def create_tag(self, name: str, snapshot_id: str, ref: str, gc_wait: float) -> None:
        check_name(name, "tag")
        with self._published(snapshot_id, ref, gc_wait):
            try:
                self._storage.create_exclusive(tag_path(name), snapshot_id.encode())
            except FileExistsError:
                raise AlreadyExistsError(
                    f"Expected tag {name!r} not to exist. Got an existing tag instead "
                    f"(-> {self.read(tag_path(name))}); tags are write-once: delete it first "
                    "(`inshrink tag -d`) or pick another name."
                ) from None

    def create_branch(self, name: str, snapshot_id: str, ref: str, gc_wait: float) -> None:
        check_name(name, "branch")
        with self._published(snapshot_id, ref, gc_wait):
            if name in self.branch_seqs():
                raise AlreadyExistsError(
                    f"Expected branch {name!r} not to exist. Got an existing branch instead "
                    "(`inshrink branch URL NAME -d` deletes it)."
                )
            self.advance(name, 0, snapshot_id)

    def delete_tag(self, name: str) -> str:
        check_name(name, "tag")
        try:
            snapshot_id = self.read(tag_path(name))
        except FileNotFoundError:
            raise NotFoundError(
                f"Expected tag {name!r} in {self._storage.url!r}. Got no such tag instead "
                f"(tags: {', '.join(sorted(self.tags())) or 'none'})."
            ) from None
        self._storage.delete(tag_path(name))
        return snapshot_id

    def delete_branch(self, name: str) -> str:
        """Every ref file, oldest first, so the head stays readable until the end."""
        check_name(name, "branch")
        seqs = self.branch_seqs().get(name)
        if not seqs:
            raise NotFoundError(
                f"Expected branch {name!r} in {self._storage.url!r}. Got no such branch instead "
                f"(branches: {', '.join(sorted(self.branch_seqs())) or 'none'})."
            )
        head = self.read(branch_ref_path(name, seqs[-1]))
        for seq in seqs:
            self._storage.delete(branch_ref_path(name, seq))
        return head
