"""PyTorch Lightning's checkpoints as versions of an inshrink store: ``InshrinkCheckpointIO``.
Layer: Lightning, below the CLI, above Hugging Face and ``torch`` (it builds on the latter).

``Trainer(plugins=[InshrinkCheckpointIO("s3://bucket/run")])`` makes every checkpoint Lightning
writes one version of a branch: tensors as arrays, everything else (loops, callbacks, hyper
parameters) as the JSON structure ``save_state`` records, so loading never unpickles anything.

Lightning itself still thinks in file paths: ``ModelCheckpoint`` names its checkpoints, checks
which exist, and resolves ``ckpt_path="last"`` by listing its folder. So each save also

- tags its version with a name made from the path (:func:`tag_for`): the tag is what keeps the
  version, and ``remove_checkpoint`` (``save_top_k``) drops it, then a gc collects the versions
  this IO wrote that no tag, other branch or the head keeps. Every version it did not write
  (a base model ``inshrink import`` put on the branch, your own ``repo.save``) is kept like a
  tag, and objects shared with kept versions stay (gc marks what is reachable);
- writes a small *pointer* file at the path (store, snapshot, tag: JSON in a ``torch.save`` file that
  ``torch.load`` resolves through :func:`load_from_store`): Lightning's own file
  checks (``"last"``, ``-v1`` suffixes, ``save_last="link"``) then work as with torch files.

With :class:`~inshrink_store.lightning.search.InshrinkSearch` among the Trainer's callbacks,
each save searches the model weights' configuration with an ``eval_fn``, as the Checkpointer
does (``lightning/search``: the callback hands the plugin the LightningModule).

Lightning is imported in this package only, never elsewhere: ``pip install
'inshrink-store[lightning]'``.
"""

from __future__ import annotations

import contextlib
import hashlib
import io as io_module
import json
import logging
import os
import pickletools
import re
import threading
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote

import numpy as np

from inshrink_store.errors import (
    AlreadyExistsError,
    BackgroundSaveError,
    ConflictError,
    FormatError,
    InshrinkError,
    InvalidInputError,
    NotFoundError,
    require,
)
from inshrink_store.lightning.search import InshrinkSearch
from inshrink_store.policy import QuantConfig, StatePlanner
from inshrink_store.repository import MAX_KEEP_NEWEST, Repository, SnapshotInfo, check_name
from inshrink_store.repository import open as open_repo
from inshrink_store.structure import METADATA_KEY, flatten
from inshrink_store.torch.tensors import load_state, save_state, torch

#: Lightning's base class (``lightning.pytorch.plugins.io.CheckpointIO`` is the same class)
if TYPE_CHECKING:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

    from inshrink_store import GcReport
else:
    CheckpointIO = require("lightning.fabric.plugins.io.checkpoint_io", "lightning").CheckpointIO
_cloud = require("lightning.fabric.utilities.cloud_io", "lightning")

log = logging.getLogger(__name__)

__all__ = ["POINTER_FORMAT", "InshrinkCheckpointIO", "InshrinkSearch", "load_from_store", "tag_for"]

#: the ``format`` field of a pointer file, so a torch checkpoint is never mistaken for one
POINTER_FORMAT = "inshrink-lightning-pointer/1"
_POINTER_MAX_BYTES = 64 * 1024
#: the call a pointer file holds, as the pickle's GLOBAL opcode names it
_POINTER_GLOBAL = f"{__name__} load_from_store"
_TAG_PREFIX = "ckpt-"


# -- paths and tags ------------------------------------------------------------------------------
def path_key(path: Any) -> str:
    """The text a checkpoint path is known by: absolute and normalised for a local path (so
    ``ckpt_path="checkpoints/last.ckpt"`` finds what ModelCheckpoint saved by its absolute
    name), as given for a URL."""
    text: str | bytes = os.fspath(path)
    if not isinstance(text, str):
        text = text.decode()
    return text if "://" in text else os.path.normpath(os.path.abspath(text))


def tag_for(path: str | os.PathLike[str]) -> str:
    """The tag that keeps the version saved at ``path``: ``ckpt-<file name>-<hash>``.

    Why a hash: tag names allow letters, digits, '.', '_', '-' only, so the file name is
    sanitised (``epoch=3-step=40.ckpt`` -> ``epoch_3-step_40.ckpt``), which can map two names to
    one; 12 hex digits of the whole path's SHA-256 keep every path's tag its own."""
    key = path_key(path)
    name = re.sub(r"[^A-Za-z0-9._-]", "_", key.rstrip("/").rsplit("/", 1)[-1])
    name = re.sub(r"\.{2,}", ".", name).strip("._-")[:80] or "checkpoint"
    return check_name(f"{_TAG_PREFIX}{name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}", "tag")


# -- the checkpoint dict <-> what save_state stores ---------------------------------------------
def _escape_key(key: Any) -> Any:
    """A key the stored structure cannot name as it is (``'val/loss'`` in a callback's state
    key, file paths in ``best_k_models``, ``''``, ``'__x'``) becomes ``'%'`` + its
    percent-encoding; every other key is kept, so the common case stays readable."""
    if not isinstance(key, str):
        return key
    if (key in ("", ".", "..", METADATA_KEY) or key.startswith(("__", "%")) or "/" in key
            or "\\" in key):
        return "%" + quote(key, safe="")
    return key


def _unescape_key(key: Any) -> Any:
    return unquote(key[1:]) if isinstance(key, str) and key.startswith("%") else key


def _encode(node: Any, clone: bool) -> Any:
    """The checkpoint with its dict keys escaped (and arrays copied, tensors to the CPU, if
    ``clone``: a background save must not see the training loop change them). A tuple nothing
    under which changed is kept as it is, so ``save_state`` sees its own type (``torch.Size``)."""
    if isinstance(node, torch.Tensor):
        return node.detach().to("cpu", copy=True) if clone else node
    if isinstance(node, np.ndarray):
        return node.copy() if clone else node
    if isinstance(node, Mapping):
        return {_escape_key(k): _encode(v, clone) for k, v in node.items()}
    if isinstance(node, list):
        return [_encode(v, clone) for v in node]
    if isinstance(node, tuple):
        items = tuple(_encode(v, clone) for v in node)
        return node if all(a is b for a, b in zip(items, node, strict=True)) else items
    return node


def _decode(node: Any) -> Any:
    if isinstance(node, dict):
        return {_unescape_key(k): _decode(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_decode(v) for v in node]
    if isinstance(node, tuple):
        items = tuple(_decode(v) for v in node)
        return node if all(a is b for a, b in zip(items, node, strict=True)) else items
    return node


def _module_metadata(checkpoint: Mapping[str, Any]) -> dict[str, Any] | None:
    """``state_dict._metadata`` (each module's state-dict version, which ``load_state_dict``
    hands to modules that convert old layouts): an attribute, so the structure would lose it."""
    found = getattr(checkpoint.get("state_dict"), "_metadata", None)
    if not isinstance(found, Mapping):
        return None
    try:
        plain: dict[str, Any] = json.loads(json.dumps({str(k): dict(v) for k, v in found.items()}))
        return plain
    except (TypeError, ValueError):
        log.debug("state_dict._metadata is not plain JSON; it is not stored")
        return None


def _with_module_metadata(checkpoint: dict[str, Any], metadata: Any) -> dict[str, Any]:
    state_dict = checkpoint.get("state_dict")
    if isinstance(state_dict, dict):
        ordered: Any = OrderedDict(state_dict)
        if isinstance(metadata, Mapping):
            ordered._metadata = OrderedDict((k, dict(v)) for k, v in metadata.items())
        checkpoint["state_dict"] = ordered
    return checkpoint


# -- pointer files -------------------------------------------------------------------------------
class _PointerCall:
    """What a pointer file holds: pickled as the call ``load_from_store(pointer_json)``."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return load_from_store, (self.text,)


def load_from_store(pointer_json: str) -> dict[str, Any]:
    """The checkpoint a pointer file names, read from its store: what ``torch.load`` of a
    pointer file returns, so ``LightningModule.load_from_checkpoint(path)`` works on a path
    the plugin saved (tensors on the CPU; Lightning moves the model where you ask).

    Why a call: Lightning's ``load_from_checkpoint`` reads the file with ``torch.load`` itself,
    bypassing the IO. A pointer file is a ``torch.save`` file whose one object is this call on
    the pointer's JSON; importing this module allows it for ``torch.load(weights_only=True)``
    (``torch.serialization.add_safe_globals``), and in a process that has not imported it,
    torch's error names this function. It reads a store and decodes arrays; nothing else in
    the file runs."""
    pointer = _parse_pointer(pointer_json.encode(), "the pointer torch.load read")
    io = InshrinkCheckpointIO(str(pointer.get("store")), branch=str(pointer.get("branch") or "main"))
    try:
        snapshot = io.repo.snapshot(str(pointer.get("snapshot"))).id
    except (NotFoundError, InvalidInputError):
        snapshot = io.repo.resolve(str(pointer.get("tag")))
    return io._load(snapshot, None)


def _pointer_bytes(pointer: Mapping[str, Any]) -> bytes:
    buffer = io_module.BytesIO()
    torch.save(_PointerCall(json.dumps(pointer, indent=1, sort_keys=True)), buffer)
    return buffer.getvalue()


def _write_pointer(path: Any, pointer: Mapping[str, Any]) -> None:
    """Write the pointer through a temporary name and a rename: never half a file."""
    fs = _cloud.get_filesystem(path)
    target = os.fspath(path)
    folder = os.path.dirname(target)
    if folder:
        fs.makedirs(folder, exist_ok=True)
    temporary = f"{target}.inshrink-tmp"
    with fs.open(temporary, "wb") as handle:
        handle.write(_pointer_bytes(pointer))
    fs.mv(temporary, target)


def _pointer_text(raw: bytes) -> bytes:
    """The pointer's JSON in a pointer file: the whole file for a pointer of earlier releases,
    else the one string of the call pickled in the ``torch.save`` zip, found by reading the
    pickle's opcodes (nothing is unpickled). ``raw`` unchanged when it is neither."""
    try:
        with zipfile.ZipFile(io_module.BytesIO(raw)) as archive:
            names = [n for n in archive.namelist() if n.endswith("/data.pkl")]
            data = archive.read(names[0]) if len(names) == 1 else b""
    except (zipfile.BadZipFile, OSError, ValueError, KeyError):
        return raw
    try:
        ops = [(op.name, arg) for op, arg, _ in pickletools.genops(data)]
    except (ValueError, EOFError):
        return raw
    calls = [name for name, arg in ops if name == "GLOBAL" and arg == _POINTER_GLOBAL]
    texts = [arg for name, arg in ops if isinstance(arg, str) and name.endswith("UNICODE")]
    return texts[0].encode() if calls and len(texts) == 1 else raw


def _parse_pointer(raw: bytes, where: str) -> dict[str, Any]:
    try:
        pointer = json.loads(_pointer_text(raw)) if len(raw) <= _POINTER_MAX_BYTES else None
    except (UnicodeDecodeError, ValueError):
        pointer = None
    if not isinstance(pointer, dict) or pointer.get("format") != POINTER_FORMAT:
        raise FormatError(
            f"Expected {where} to be a checkpoint InshrinkCheckpointIO saved (a pointer file "
            f"with format {POINTER_FORMAT!r}). Got another file there instead (a torch checkpoint?): load it "
            "with Lightning's default CheckpointIO, or import it into the store with `inshrink import`.")
    return pointer


def _read_pointer(path: Any) -> dict[str, Any] | None:
    """The pointer at ``path``; None where there is no file; FormatError for a file that is
    not a pointer (a torch checkpoint, say)."""
    fs = _cloud.get_filesystem(path)
    try:
        with fs.open(os.fspath(path), "rb") as handle:
            raw = handle.read(_POINTER_MAX_BYTES + 1)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    return _parse_pointer(raw, repr(os.fspath(path)))


def _remove_pointer(path: Any) -> None:
    """Delete the pointer (or a link to one) at ``path``; any other file is left alone."""
    try:
        if _read_pointer(path) is None:
            return
    except FormatError:
        log.warning("remove_checkpoint(%r): not a pointer file, left where it is", os.fspath(path))
        return
    _cloud.get_filesystem(path).rm(os.fspath(path))


# -- the CheckpointIO ----------------------------------------------------------------------------
class InshrinkCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` that saves each checkpoint as a version of ``url``'s store.

    ``url``: a path, ``memory://``, ``s3://`` or ``gs://`` URL (the store is created on first
    use) or an open :class:`~inshrink_store.repository.Repository`. ``branch``: the branch the
    versions go on; of the versions this IO wrote there, its gc keeps those some checkpoint path
    still names (plus the head), and never collects a version it did not write (a base model,
    your own saves). ``quantize``: None (lossless, bit-exact: the default, for an exact resume)
    or a :class:`~inshrink_store.policy.QuantConfig` for the model's weights (``state_dict/``),
    everything else stays exact; then the newest ``exact_resume`` versions (default 1) also keep
    a restore residual, so a resume from them is bit-exact. ``background=True`` copies the
    tensors and commits on a thread, in order with removals and loads (see the guide,
    docs/guides/lightning.md). :class:`InshrinkSearch` in the Trainer's callbacks (with
    ``quantize`` left None) searches each save's configuration with an ``eval_fn`` instead;
    ``exact_resume`` then defaults to 1.
    """

    def __init__(self, url: str | os.PathLike[str] | Repository, *, branch: str = "main", quantize: QuantConfig | None = None,
                 exact_resume: int | None = None, background: bool = False,
                 storage_options: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        if not isinstance(url, (str, os.PathLike, Repository)):
            raise InvalidInputError(
                f"Expected url to be a store URL or path (e.g. 's3://bucket/run', './store') or a Repository. "
                f"Got {type(url).__name__} instead.")
        if quantize is not None and not isinstance(quantize, QuantConfig):
            raise InvalidInputError(
                f"Expected quantize to be None (lossless) or a QuantConfig. Got {type(quantize).__name__} "
                "instead; e.g. quantize=QuantConfig(bins=16).")
        self.exact_resume = _exact_resume(exact_resume, quantize)
        #: the ``exact_resume`` passed (None: left to its default, which InshrinkSearch may set)
        self.exact_resume_given = exact_resume
        #: the search InshrinkSearch attached at the Trainer's setup (None: ``quantize`` decides)
        self.search: InshrinkSearch | None = None
        self.branch = check_name(branch, "branch")
        self.quantize, self.background = quantize, bool(background)
        self._url = url if isinstance(url, (str, Repository)) else os.fspath(url)
        self._storage_options = dict(storage_options or {})
        self._repo: Repository | None = url if isinstance(url, Repository) else None
        self._lock = threading.RLock()
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future[Any]] = []
        self._error: BaseException | None = None
        self._gc_due, self._saves_since_due = False, 0
        #: the report of the last gc (after a removal or a moved tag), or None
        self.last_gc: GcReport | None = None

    @property
    def repo(self) -> Repository:
        """The store, opened (and created if nothing is there) on first use: a Trainer
        pickled to spawned processes carries the URL, not an open handle."""
        if self._repo is None:
            assert isinstance(self._url, str)
            self._repo = open_repo(self._url, create=True, storage_options=self._storage_options or None)
        return self._repo

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if not isinstance(self._url, Repository):
            state["_repo"] = None
        # the search holds the module; a Trainer in another process attaches its own at setup
        state.update(_lock=None, _pool=None, _pending=[], search=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()

    # -- Lightning's interface -----------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike[str],
                        storage_options: Any = None) -> None:
        """Commit ``checkpoint`` as one version, tag it for ``path`` and write the pointer.
        ``storage_options`` may carry ``{"message": str, "metrics": {name: number}}`` for the
        version's log entry."""
        self._raise_failure()
        commit = _commit_options(storage_options)
        if not isinstance(checkpoint, Mapping):
            raise InvalidInputError(
                f"Expected the checkpoint to be a dict (Lightning's checkpoint). Got {type(checkpoint).__name__} "
                "instead.")
        encoded = _encode(checkpoint, clone=self.background)
        modules = _module_metadata(checkpoint)
        # the search's scratch model, copied now: training goes on while a background save searches
        scratch = self.search.scratch_model() if self.search is not None else None
        names = {_escape_key(k): k for k in checkpoint.get("state_dict") or {}}
        if self.background:  # refuse what the store cannot hold here, not on the thread
            flatten(encoded, lambda x: isinstance(x, (torch.Tensor, np.ndarray)))
            self._submit(self._save, encoded, modules, path, commit, scratch, names)
        else:
            self._save(encoded, modules, path, commit, scratch, names)

    def load_checkpoint(self, path: str | os.PathLike[str], map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint saved at ``path`` (or a branch, tag or snapshot id of the store), as
        Lightning expects it. ``weights_only`` is accepted and moot: nothing is unpickled."""
        self._drain()
        if map_location is not None and not isinstance(map_location, (str, torch.device)):
            raise InvalidInputError(
                f"Expected map_location to be None, a device string or a torch.device. Got "
                f"{type(map_location).__name__} instead: tensors come back on the CPU with None, and "
                "Lightning moves them to the model's device.")
        return self._load(self.find(path), map_location)

    def _load(self, snapshot: str, map_location: Any) -> dict[str, Any]:
        state = load_state(self.repo, snapshot, map_location=map_location)
        meta = self.repo.snapshot(snapshot).metadata.get("lightning", {})
        return _with_module_metadata(_decode(state), meta.get("state_dict_metadata"))

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Drop the tag (and pointer) of ``path``, then gc this branch: the version goes unless
        another tag, another branch or the branch head keeps it; versions the plugin did not
        write and objects kept versions share stay. A path never saved here is nothing to
        remove."""
        self._raise_failure()
        if self.background:
            self._submit(self._remove, path)
        else:
            self._remove(path)

    def teardown(self) -> None:
        """Wait for background saves (``background=True``) and raise the first that failed;
        collect the versions whose path was saved again since the last gc (``last.ckpt``)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self._pending = []
        self._raise_failure()
        if self._gc_due:
            with self._lock:
                self._collect()

    # -- reading ---------------------------------------------------------------------------------
    def find(self, path: str | os.PathLike[str]) -> str:
        """The snapshot id of the checkpoint at ``path``: its pointer file's, else its tag's,
        else ``path`` read as a ref of the store (``"main"``: the newest checkpoint)."""
        pointer = _read_pointer(path)
        if pointer is not None:
            with contextlib.suppress(NotFoundError, InvalidInputError):
                return self.repo.snapshot(str(pointer.get("snapshot"))).id
        tag = tag_for(path)
        found = self.repo.tags().get(tag)
        if found is not None:
            return found
        with contextlib.suppress(NotFoundError, InvalidInputError):
            return self.repo.resolve(os.fspath(path))
        known = sorted(t for t in self.repo.tags() if t.startswith(_TAG_PREFIX))[:10]
        where = "no pointer file there" if pointer is None else (
            f"a pointer to snapshot {str(pointer.get('snapshot'))[:12]}, which store {pointer.get('store')!r} holds")
        raise NotFoundError(
            f"Expected a checkpoint saved at {os.fspath(path)!r} in the store at {self.repo.url!r}. Got {where} "
            f"and no tag {tag!r} instead: pass a path ModelCheckpoint saved with this store, or one of its "
            f"tags {known}.")

    # -- the work, on the caller's thread or the background one ----------------------------------
    def attach_search(self, search: InshrinkSearch) -> None:
        """Let ``search`` decide how each save stores the model weights (its ``setup`` calls
        this; refused beside ``quantize=`` or another search: :meth:`InshrinkSearch.attach`)."""
        search.attach(self)

    def _save(self, encoded: dict[str, Any], modules: Any, path: Any, commit: Mapping[str, Any],
              scratch: Any = None, names: Mapping[str, str] | None = None) -> None:
        key, tag = path_key(path), tag_for(path)
        step = encoded.get("global_step")
        meta: dict[str, Any] = {"path": key, "tag": tag}
        if modules is not None:
            meta["state_dict_metadata"] = modules
        with self._lock:
            head = self.repo.head(self.branch)
            quantize: Any = self._planner()
            metadata: dict[str, Any] = {"lightning": meta}
            if self.search is not None and scratch is not None:
                quantize, record = self.search.decide(encoded, names or {}, scratch, self.repo,
                                                      head, self.exact_resume)
                metadata["quantization"] = record.to_dict()
            where: dict[str, Any] = {"branch": self.branch}
            if head is not None and _is_last_save(encoded, key):
                # a ref, not a version of the branch: on its own branch, off the branch head
                where = {"branch": _side_branch(self.branch, tag), "parent": head, "expect_head": None}
                meta["last_of"] = self.branch
                with contextlib.suppress(NotFoundError):  # the previous last stays tagged until retagged
                    self.repo.delete_branch(where["branch"])
            info = save_state(
                self.repo, encoded, quantize=quantize, **where,
                step=step if isinstance(step, int) and not isinstance(step, bool) else None,
                message=commit.get("message") or _message(key, encoded), metrics=commit.get("metrics"),
                metadata=metadata, exact_resume=self.exact_resume)
            moved = self._retag(tag, info.id)
            _write_pointer(path, {"format": POINTER_FORMAT, "store": _store_url(self.repo.url),
                                  "branch": self.branch, "snapshot": info.id, "tag": tag, "step": info.step,
                                  "note": "a checkpoint kept in an inshrink store: InshrinkCheckpointIO(store)"
                                          ".load_checkpoint(this path) reads it, and so do torch.load and "
                                          "LightningModule.load_from_checkpoint where inshrink_store.lightning "
                                          "is imported"})
            self._after_save(moved)

    def _after_save(self, moved: bool) -> None:
        """A version a moved tag no longer names (``last.ckpt`` saved again), and restore
        residuals older than the newest ``exact_resume`` versions, are left for the gc of the
        next removal, which ModelCheckpoint usually makes within the same epoch; without one,
        the second save after them collects them (or ``teardown``), so at most two linger."""
        if self._gc_due:
            self._saves_since_due += 1
            if self._saves_since_due >= 2:
                self._collect()
        self._gc_due = self._gc_due or moved or self.exact_resume > 0

    def _remove(self, path: Any) -> None:
        tag = tag_for(path)
        with self._lock:
            try:
                self.repo.delete_tag(tag)
            except NotFoundError:
                log.debug("remove_checkpoint(%r): no tag %s", os.fspath(path), tag)
            with contextlib.suppress(NotFoundError):  # a last.ckpt's side branch
                self.repo.delete_branch(_side_branch(self.branch, tag))
            _remove_pointer(path)
            self._collect()

    def _retag(self, tag: str, snapshot_id: str) -> bool:
        """Point ``tag`` at ``snapshot_id``; True when it named another version before (a path
        saved again, like ``last.ckpt``), which is then left for the gc."""
        try:
            self.repo.tag(tag, snapshot_id)
            return False
        except AlreadyExistsError:
            if self.repo.tags().get(tag) == snapshot_id:
                return False
            self.repo.delete_tag(tag)
            self.repo.tag(tag, snapshot_id)
            return True

    def _collect(self) -> None:
        """One gc that keeps this branch's head, every tag, every other branch's history and
        every version of this branch the plugin did not write: it collects only checkpoints of
        its own whose tag is gone. Never raises into training: a gc that a commit in progress
        refuses (or that fails) is logged and run again at the next removal or save."""
        branch = self.branch
        try:
            # the branch trimmed to its head, with its side branches of last.ckpt versions (their
            # history is this branch's, whose removed checkpoints must go); every other branch keeps
            # its history, and every version of this branch the plugin did not write is kept
            self.last_gc = self.repo.gc(1, branch=branch, keep=_not_written_by_plugin,
                                        trim=lambda name: _is_side_branch(name, branch))
            self._gc_due, self._saves_since_due = False, 0
        except ConflictError as exc:
            self._gc_due = True
            log.info("gc put off to the next removal or save: %s", exc)
        except (InshrinkError, OSError) as exc:
            self._gc_due = True
            log.warning("gc failed (%r); trying again at the next removal or save", exc)

    def _planner(self) -> Any:
        return None if self.quantize is None else StatePlanner(self.quantize, scope="state_dict/")

    # -- background ------------------------------------------------------------------------------
    def _submit(self, work: Callable[..., None], *args: Any) -> None:
        """Queue ``work`` behind every earlier save and removal (one thread: in order, so a
        removal never overtakes the save it removes)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="inshrink-lightning")
        self._pending = [f for f in self._pending if not f.done()]
        self._pending.append(self._pool.submit(self._guarded, work, *args))

    def _guarded(self, work: Callable[..., None], *args: Any) -> None:
        if self._error is not None:
            return  # after a failure nothing more is written: the next call raises it
        try:
            work(*args)
        except BaseException as exc:  # raised by the next call, in the training thread
            self._error = exc

    def _drain(self) -> None:
        for future in list(self._pending):
            future.result()
        self._pending = []
        self._raise_failure()

    def _raise_failure(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise BackgroundSaveError(
                f"Expected the background checkpoint save to succeed. Got {type(error).__name__}: {error} "
                "instead; nothing after it was written. Fix the cause and save again.") from error


def _not_written_by_plugin(info: SnapshotInfo) -> bool:
    """Whether the plugin's gc keeps a version of its branch: one it did not write (a base model
    ``inshrink import`` put there, a user's own ``repo.save``), whatever its tags say."""
    return not _written_by_plugin(info.metadata)


def _written_by_plugin(metadata: Mapping[str, Any]) -> bool:
    """Whether a version's metadata has the record ``_save`` writes (path and tag)."""
    record = metadata.get("lightning")
    return (isinstance(record, Mapping) and isinstance(record.get("path"), str)
            and isinstance(record.get("tag"), str) and record["tag"].startswith(_TAG_PREFIX))


def _is_last_save(checkpoint: Mapping[str, Any], key: str) -> bool:
    """Whether this save is a ``ModelCheckpoint``'s ``save_last``: a callback's state in the
    checkpoint names ``key`` as its ``last_model_path`` (ModelCheckpoint sets it before it saves).

    Why it matters: ``last.ckpt`` is saved again every epoch, right after the top-k file of
    the same step. On the branch, each old ``last.ckpt`` the gc collects would cut the branch's
    history there (``inshrink log`` listed 2 of 6 kept checkpoints); as a ref off the head, it
    is a leaf that goes without taking any history along."""
    callbacks = checkpoint.get("callbacks")
    if not isinstance(callbacks, Mapping):
        return False
    for state in callbacks.values():
        last = state.get("last_model_path") if isinstance(state, Mapping) else None
        if isinstance(last, str) and last and path_key(last) == key:
            return True
    return False


def _side_branch(branch: str, tag: str) -> str:
    """The branch that holds a ``last.ckpt`` version off ``branch``: named after its tag, so
    the version keeps its restore residual (a branch head does; a tag alone does not)."""
    name = f"{branch}.{tag}"
    return check_name(name if len(name) <= 128 else f"{branch[:96]}.{tag[:10]}{tag[-13:]}", "branch")


def _is_side_branch(name: str, branch: str) -> bool:
    return name != branch and name.startswith((f"{branch}.{_TAG_PREFIX}", f"{branch[:96]}.{_TAG_PREFIX}"))


def _store_url(url: str) -> str:
    """The store's URL as a pointer names it: a local path made absolute, so a pointer read
    from another working directory (``load_from_checkpoint`` in another script) finds it."""
    return url if "://" in url else os.path.abspath(url)


torch.serialization.add_safe_globals([load_from_store])  # torch.load(weights_only=True) of a pointer


def _exact_resume(value: int | None, quantize: QuantConfig | None) -> int:
    if value is None:
        return 0 if quantize is None else 1
    if type(value) is not int or not 0 <= value <= MAX_KEEP_NEWEST:
        raise InvalidInputError(
            f"Expected exact_resume to be an int in 0..{MAX_KEEP_NEWEST} (newest versions kept bit-exact). "
            f"Got {value!r} instead.")
    return value


def _commit_options(options: Any) -> dict[str, Any]:
    """``storage_options`` of a save: None, or ``{"message": ..., "metrics": ...}``."""
    if options is None:
        return {}
    if not isinstance(options, Mapping) or set(options) - {"message", "metrics"}:
        raise InvalidInputError(
            f"Expected storage_options to be None or a dict with 'message' and/or 'metrics'. Got {options!r:.80} "
            "instead; e.g. trainer.save_checkpoint(path, storage_options={'message': 'before the sweep'}).")
    return dict(options)


def _message(key: str, checkpoint: Mapping[str, Any]) -> str:
    name = key.rstrip("/").rsplit("/", 1)[-1]
    where = ", ".join(f"{label} {checkpoint[key]}" for label, key in (("epoch", "epoch"), ("step", "global_step"))
                      if checkpoint.get(key) is not None)
    return f"lightning {name} ({where})" if where else f"lightning {name}"
