"""Repository: the public facade over one store URL — refs, history, reading, writing, admin.
Layer: facade, below the integrations (``torch``, ``hf``, ``lightning``, the CLI).

It holds no logic of its own: refs live in :mod:`~inshrink_store.refs`, snapshots in
:mod:`~inshrink_store.history`, the settings file a store is made and opened with in
:mod:`~inshrink_store.store_settings`, a write in :mod:`~inshrink_store.session`, and diff,
verify, gc and du in :mod:`~inshrink_store.admin`, each over the typed
:class:`~inshrink_store.parts.StoreParts` this facade builds once. A commit writes
objects, then trees, then the snapshot, then creates the next branch ref file
exclusively: a crash anywhere leaves the previous version intact and nothing
half-visible, and a lost race is a :class:`ConflictError` with nothing lost.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np
from typing_extensions import Unpack

from inshrink_store import admin, leases, residual, store_settings
from inshrink_store.errors import InvalidInputError, NotFoundError
from inshrink_store.history import SnapshotInfo
from inshrink_store.manifest import check_commit_fields
from inshrink_store.parts import DEFAULT_BRANCH
from inshrink_store.plans import Planner, Quantize, check_quantize
from inshrink_store.refs import check_name, replaced_branch_name
from inshrink_store.residual import MAX_KEEP_NEWEST, Residual, ResidualRef
from inshrink_store.session import ANY_HEAD, AnyHead, WriteSession, open_session
from inshrink_store.storage import Storage, open_storage

if TYPE_CHECKING:  # annotations only
    from inshrink_store.cas import ObjectStore
    from inshrink_store.reader import SnapshotReader
    from inshrink_store.zarr_store import InshrinkStore

#: how long a commit waits for a running gc before GcRunningError (a dead gc is recognised
#: after leases.EXPIRY seconds without renewal, or at once on its own machine)
GC_WAIT = 60.0
Progress = Callable[[str, int, int], None]
Transaction = WriteSession  # the name earlier releases used


class SaveOptions(TypedDict, total=False):
    """The keywords of :meth:`Repository.save` that ``save_state`` and ``import_file``
    (:mod:`inshrink_store.torch`) pass on as they are: ``save_state(repo, state, step=3,
    message="epoch 1")``. For type checkers and IDEs only; every one is optional."""

    branch: str
    message: str
    step: int | None
    metrics: Mapping[str, float] | None
    metadata: Mapping[str, Any] | None
    parent: str | None
    rebase: bool
    progress: Progress | None
    gc_wait: float
    on_wait: Callable[[str], None] | None
    exact_resume: int
    expect_head: str | None | AnyHead


def open(  # noqa: A001 - mirrors zarr.open / fsspec.open
    url: str,
    *,
    create: bool = False,
    storage_options: dict[str, Any] | None = None,
    keyframe_interval: int | None = None,
) -> Repository:
    """Open the store at ``url`` (a path, file://, memory://, s3://, gs://); ``create``
    makes an empty one if nothing is there."""
    storage = open_storage(url, storage_options)
    try:  # one read of the settings (no existence check first: a request saved on S3)
        return Repository(storage, keyframe_interval=keyframe_interval)
    except FileNotFoundError:
        if not create:
            store_settings.require_store(storage)
            raise
    return init(url, storage_options=storage_options, keyframe_interval=keyframe_interval, exist_ok=True)


def init(
    url: str,
    *,
    storage_options: dict[str, Any] | None = None,
    keyframe_interval: int | None = None,
    exist_ok: bool = False,
) -> Repository:
    """Create an empty store at ``url``; an existing store is an error unless ``exist_ok``."""
    storage = open_storage(url, storage_options)
    store_settings.create(storage, url, keyframe_interval, exist_ok=exist_ok)
    return Repository(storage, keyframe_interval=keyframe_interval)


class Repository:
    """Refs, history and versions of one store. Cheap to create; holds no open files."""

    def __init__(self, storage: Storage, keyframe_interval: int | None = None) -> None:
        self._settings, self._parts = store_settings.open_parts(storage, keyframe_interval)
        #: per ``keep`` of a scoped gc: snapshot id -> (kept, parent), asked once per version
        self._kept: dict[Callable[[SnapshotInfo], bool], dict[str, tuple[bool, str | None]]] = {}

    @property
    def url(self) -> str:
        """The URL this store was opened at."""
        return self._parts.url

    @property
    def keyframe_interval(self) -> int:
        """A delta chain is cut by a whole object at most every this many versions."""
        return self._parts.objects.keyframe_interval

    # white-box access for tests and tools built on the store's internals; not public API
    @property
    def _storage(self) -> Storage:
        return self._parts.storage

    @property
    def _objects(self) -> ObjectStore:
        return self._parts.objects

    def __repr__(self) -> str:
        return f"Repository({self.url!r})"

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without a scoped gc's memo: it is keyed by the caller's ``keep`` functions
        (a lambda does not pickle), and a copy asks ``keep`` again."""
        return {**self.__dict__, "_kept": {}}

    # -- refs ------------------------------------------------------------------------
    def branches(self) -> dict[str, str]:
        """Branch name -> head snapshot id."""
        return self._parts.refs.branches()

    def tags(self) -> dict[str, str]:
        """Tag name -> snapshot id."""
        return self._parts.refs.tags()

    def tag(self, name: str, ref: str = DEFAULT_BRANCH, *, gc_wait: float = GC_WAIT) -> str:
        """Create a write-once tag at ``ref``; returns its snapshot id. An existing tag is an
        :class:`AlreadyExistsError`. Published like a commit (under a writer lease, after
        checking the snapshot exists), so a gc running beside it cannot leave it dangling."""
        check_name(name, "tag")
        snapshot_id = self._parts.resolve(ref)
        self._parts.refs.create_tag(name, snapshot_id, ref, gc_wait)
        return snapshot_id

    def create_branch(self, name: str, ref: str = DEFAULT_BRANCH, *, gc_wait: float = GC_WAIT) -> str:
        """A new branch whose head is ``ref``; returns that snapshot id (published like a tag)."""
        check_name(name, "branch")
        snapshot_id = self._parts.resolve(ref)
        self._parts.refs.create_branch(name, snapshot_id, ref, gc_wait)
        return snapshot_id

    def delete_tag(self, name: str) -> str:
        """Remove a tag; returns the snapshot id it named (its data goes at the next gc if
        nothing else keeps it)."""
        return self._parts.refs.delete_tag(name)

    def delete_branch(self, name: str) -> str:
        """Remove a branch; returns its head id. Its versions go at the next gc unless a ref
        keeps them."""
        return self._parts.refs.delete_branch(name)

    def head(self, branch: str = DEFAULT_BRANCH) -> str | None:
        """The snapshot id of ``branch``'s head, or None for a branch with no commit (reads only
        that branch's ref files; :meth:`resolve` would also try tags and ids)."""
        found = self._parts.refs.head(branch)
        return None if found is None else found[1]

    def resolve(self, ref: str) -> str:
        """Branch, tag, snapshot id or unique id prefix, with ``~N`` / ``^`` suffixes -> id."""
        return self._parts.resolve(ref)

    # -- history -----------------------------------------------------------------------
    def snapshot(self, snapshot_id: str) -> SnapshotInfo:
        """One version's record (parent, time, message, step, metrics, metadata); like every
        reading method it takes any ref (a snapshot id, branch, tag or ``"main~1"``)."""
        return self._parts.history.get(self._parts.resolve(snapshot_id))

    def snapshot_ids(self) -> list[str]:
        """Every snapshot in the store, reachable from a ref or not."""
        return self._parts.history.ids()

    def log(self, ref: str = DEFAULT_BRANCH, limit: int | None = None) -> list[SnapshotInfo]:
        """Newest first, following parents until the first version (or what gc kept)."""
        return self._parts.history.walk(self._parts.resolve(ref), limit)

    # -- reading ---------------------------------------------------------------------
    def checkout(self, ref: str = DEFAULT_BRANCH) -> SnapshotReader:
        """A lazy reader of one version: ``reader["model/w"]`` is a zarr array, nothing is
        read until you index it."""
        return self._parts.checkout(ref)

    def residual(self, ref: str = DEFAULT_BRANCH, *, missing_ok: bool = True) -> Residual | None:
        """The restore residual of a version (what turns its quantized tensors back into the
        exact bits), or None: it was saved without one, or is no longer among the newest
        versions of its branch and gc collected it. ``missing_ok=False`` raises the
        NotFoundError naming the missing document instead of returning None."""
        info = self.snapshot(ref)
        found = ResidualRef.from_metadata(info.metadata, info.id)
        if found is None:
            return None
        try:
            return Residual(self._parts.objects, found, residual.load(self._parts.storage, found.id))
        except NotFoundError:
            if missing_ok:
                return None
            raise

    def codebooks(self, ref: str = DEFAULT_BRANCH) -> dict[str, dict[str, Any]]:
        """Path -> {"codec": nuq configuration, "attributes": inshrink attrs} of the quantized
        arrays of one version: the codebooks a planner may reuse for the next (read from the
        version's shared index, so its trees are read once)."""
        return self.checkout(ref).view.index.quantization_codecs()

    def snapshot_store(self, ref: str = DEFAULT_BRANCH) -> InshrinkStore:
        """A read-only zarr Store of one version: ``zarr.open_group(store=...)`` just works."""
        return self.checkout(ref).store

    def load(self, ref: str = DEFAULT_BRANCH) -> dict[str, np.ndarray]:
        """Every tensor of one version as numpy arrays (array path -> array)."""
        return self.checkout(ref).load()

    # -- writing ---------------------------------------------------------------------
    def transaction(
        self, branch: str = DEFAULT_BRANCH, *, parent: str | None = None, inherit: bool = True,
        gc_wait: float = GC_WAIT, on_wait: Callable[[str], None] | None = None,
        expect_head: str | None | AnyHead = ANY_HEAD,
    ) -> WriteSession:
        """One write session (a context manager that aborts on error). ``parent`` (a ref)
        defaults to the branch head; ``inherit=False`` starts empty (a full new state) while
        still delta-coding against the parent. A running gc is waited for up to ``gc_wait``
        seconds (``on_wait`` hears about it).

        The commit is a compare-and-swap on the branch head: it replaces the head read now, or
        raises ConflictError naming both heads. ``expect_head`` (a snapshot id; None: the branch
        must not exist yet) refuses at once, writing nothing, when the head is another version.
        A commit whose parent is not the head keeps the head it replaces as branch
        ``<branch>.replaced-<id12>``, unless ``rebase=True`` commits on top of the head."""
        check_name(branch, "branch")
        return open_session(self._parts, branch, parent=parent, inherit=inherit,
                            gc_wait=gc_wait, on_wait=on_wait, expect_head=expect_head)

    def save(
        self,
        tensors: Mapping[str, np.ndarray],
        *,
        branch: str = DEFAULT_BRANCH,
        message: str = "",
        step: int | None = None,
        metrics: Mapping[str, float] | None = None,
        metadata: Mapping[str, Any] | None = None,
        attributes: Mapping[str, Any] | None = None,
        dtypes: Mapping[str, str] | None = None,
        quantize: Quantize | None = None,
        parent: str | None = None,
        rebase: bool = False,
        progress: Progress | None = None,
        gc_wait: float = GC_WAIT,
        on_wait: Callable[[str], None] | None = None,
        exact_resume: int = 0,
        expect_head: str | None | AnyHead = ANY_HEAD,
    ) -> SnapshotInfo:
        """Commit ``tensors`` (array path -> array) as the next version of ``branch``.

        ``dtypes`` names logical dtypes the array cannot carry (``"BF16"`` for uint16 bits);
        ``quantize`` (e.g. a policy ``QuantConfig``) plans lossy storage per tensor; plans made
        already (path -> :class:`~inshrink_store.plans.ArrayPlan`, such as a search's
        ``PlanSet``) are written as they are.
        ``exact_resume`` N > 0 also stores the restore residual of every quantized tensor,
        kept while this version is among the N newest of its branch (then gc collects it):
        ``load_state(..., exact=True)`` and ``Checkpointer.restore`` return the exact bits.
        Message, step, metrics and metadata are checked before anything is written; a running
        gc is waited for up to ``gc_wait`` seconds.

        The commit is a compare-and-swap on the branch head (see :meth:`transaction`):
        ``expect_head`` names the head it may replace (None: a new branch), ``parent`` (default:
        the head) an older version to continue from, whose commit keeps the replaced head as
        branch ``<branch>.replaced-<id12>``; ``rebase=True`` commits on the head instead.
        """
        message, step, metrics, metadata = check_commit_fields(message, step, metrics, metadata)
        check_quantize(quantize)
        if residual.META_KEY in metadata:
            raise InvalidInputError(
                f"Expected metadata without the key {residual.META_KEY!r}: the store names a version's restore "
                "residual there. Got it in the metadata given instead; rename that key.")
        if type(exact_resume) is not int or not 0 <= exact_resume <= MAX_KEEP_NEWEST:
            raise InvalidInputError(
                f"Expected exact_resume to be an int in 0..{MAX_KEEP_NEWEST} (newest versions kept bit-exact; 0: "
                f"none). Got "
                f"{exact_resume!r} instead.")
        with self.transaction(branch, parent=parent, inherit=False, gc_wait=gc_wait, on_wait=on_wait,
                              expect_head=expect_head) as tx:
            tx.write(tensors, attributes=attributes, dtypes=dtypes, quantize=quantize, progress=progress,
                     residual=exact_resume > 0)
            return tx.commit(message=message, step=step, metrics=metrics, metadata=metadata, rebase=rebase,
                             keep_residual=max(exact_resume, 1))

    # -- admin (implemented in inshrink_store.admin) ----------------------------------------
    def diff(self, ref_a: str, ref_b: str, *, values: bool = False,
             progress: Progress | None = None) -> admin.DiffReport:
        """Per-tensor changes between two versions; ``values`` adds error figures (reading
        both versions; ``progress`` hears each tensor)."""
        return admin.diff(self._parts, ref_a, ref_b, values=values, progress=progress)

    def verify(self, progress: Progress | None = None) -> admin.VerifyReport:
        """Check every reachable object end to end; names bad objects and who uses them."""
        return admin.verify(self._parts, progress=progress)

    def gc(
        self, keep_last: int | None = None, *, branch: str | None = None,
        keep: Callable[[SnapshotInfo], bool] | None = None, trim: Callable[[str], bool] | None = None, dry_run: bool = False, progress: Progress | None = None,
        stale_after: float = leases.STALE_AFTER, wait: float = 0.0,
        on_wait: Callable[[str], None] | None = None,
    ) -> admin.GcReport:
        """Delete what no kept version reaches (delta bases of kept objects are kept).

        ``keep_last`` N keeps the N newest versions of every branch (every version without it).
        ``branch`` trims that branch alone: every other branch keeps its whole history, except
        those ``trim(name)`` names, which are trimmed like it; ``keep(info)`` keeps a version of
        ``branch`` whatever N says (asked once per version and remembered: it must depend on
        the version alone, e.g. its metadata). Tags keep their versions in every case.

        Safe beside any number of writers and gc runs. Refuses with ``ConflictError``
        (nothing deleted) while a commit is in progress, after waiting up to ``wait``
        seconds; a writer whose process is gone, or whose lease went unrenewed for
        ``stale_after`` seconds, is fenced off (it can no longer publish) and ignored.
        Refs naming missing snapshots are reported in ``GcReport.dangling``."""
        parts = self._parts
        if branch is not None:
            check_name(branch, "branch")
            memo = None if keep is None else self._kept.setdefault(keep, {})
            parts = parts.branch_scope(branch, keep=keep, trim=trim, memo=memo)
        elif keep is not None or trim is not None:
            raise InvalidInputError(
                "Expected keep= and trim= with branch=, the branch they scope. Got them without one instead; "
                "e.g. repo.gc(1, branch='main', keep=lambda info: info.step is None).")
        return admin.gc(parts, keep_last=keep_last, dry_run=dry_run, progress=progress,
                        stale_after=stale_after, wait=wait, on_wait=on_wait)

    def gc_residuals(self, *, dry_run: bool = False, stale_after: float = leases.STALE_AFTER, wait: float = 0.0,
                     on_wait: Callable[[str], None] | None = None) -> admin.GcReport:
        """Drop only the restore residuals no version keeps any more (outside the newest
        ``exact_resume`` of every branch), found by reading a few documents near the branch
        heads; their pieces are deleted unless a committed version reaches them (a chunk can
        be the same object as a piece), which reads the history's trees as gc does. A full
        :meth:`gc` does this too. The same lease protocol as ``gc``."""
        collector = admin.GarbageCollector(self._parts, stale_after=stale_after, wait=wait, on_wait=on_wait,
                                           residuals_only=True)
        return collector.run(dry_run=dry_run)

    def garbage_collector(self, keep_last: int | None = None,
                          **options: Unpack[admin.GcOptions]) -> admin.GarbageCollector:
        """A gc run in explicit steps (``start``, ``mark``, ``sweep``, ``finish``)."""
        return admin.GarbageCollector(self._parts, keep_last, **options)

    def stored_bytes(self, ref: str = DEFAULT_BRANCH) -> dict[str, int]:
        """Tensor path -> bytes its chunk objects take in the store."""
        return admin.stored_bytes(self._parts, ref)

    def du(self, ref: str = DEFAULT_BRANCH, prefix: str = "") -> list[admin.UsageRow]:
        """Per version, oldest first: logical bytes, new stored bytes, cumulative, ratio
        (``prefix="model/"``: only the tensors under it)."""
        return admin.du(self._parts, ref, prefix)

    def du_summary(self, ref: str = DEFAULT_BRANCH) -> admin.DuSummary:
        """:meth:`du`'s rows for ``ref`` and where every other byte under the store is: the delta
        bases they need that no row counts, other refs' versions, documents and refs, and what
        the next gc collects; the parts add up to the bytes under the store."""
        return admin.du_summary(self._parts, ref)


__all__ = [
    "ANY_HEAD", "GC_WAIT", "MAX_KEEP_NEWEST", "AnyHead", "Planner", "Repository", "SaveOptions", "SnapshotInfo",
    "Transaction", "WriteSession", "check_commit_fields", "check_name", "init", "open", "replaced_branch_name",
]
