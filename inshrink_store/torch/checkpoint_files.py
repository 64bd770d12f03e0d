"""Checkpoint files in and out: a ``.safetensors`` or ``torch.save`` file read as a state
(told by its first bytes, ``torch.load(weights_only=True)`` only: reading never executes code)
and imported as a version; a version exported as a model's state dict or its whole state to
either format, written to a temp file and renamed (never a half-written file).
Layer: torch, below Hugging Face and Lightning, above the facade (a client of the store).

Split from :mod:`inshrink_store.torch.tensors` (issue 45: rooms sized), which moves tensors
and nested states in and out of a repository; this module is where they meet files.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from inshrink_store.errors import FormatError, require
from inshrink_store.structure import STRUCTURE_ATTR
from inshrink_store.torch.tensors import (
    TORCH_DTYPES,
    ExactBits,
    fresh_to_tensor,
    reader_state,
    save_state,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from inshrink_store import SnapshotReader
    from inshrink_store.plans import Planner
    from inshrink_store.policy import Allocation, MomentPolicy, QuantConfig
    from inshrink_store.repository import Repository, SaveOptions, SnapshotInfo

torch = require("torch", "torch")

#: the logical dtype names torch has a type for (:data:`TORCH_DTYPES`); others export through numpy
_TORCH_NAMES = frozenset(TORCH_DTYPES.values())


#: what a checkpoint file may be, for the errors that say what is read
CHECKPOINT_FORMATS = ".safetensors, or a torch.save file (.pt, .pth, .bin; zip or legacy)"


def checkpoint_format(path: str | os.PathLike[str]) -> str:
    """``"safetensors"`` or ``"torch"``, from the file's first bytes, not its name: a text file
    named ``.pt`` would otherwise reach torch's unpickler, whose errors (``KeyError: 101``, or
    advice to load with ``weights_only=False``) say nothing a user can act on. FormatError
    naming the file when it is neither."""
    path = Path(path)
    if not path.is_file():
        raise FormatError(f"Expected a checkpoint file. Got {str(path)!r}, which does not exist.")
    with path.open("rb") as f:
        head = f.read(9)
    size = path.stat().st_size
    if head[:4] == b"PK\x03\x04" or (len(head) > 1 and head[0] == 0x80 and 2 <= head[1] <= 5):
        return "torch"  # torch.save's zip archive, or its legacy pickle (protocol 2..5)
    if len(head) == 9 and head[8:9] == b"{" and 8 < int.from_bytes(head[:8], "little") + 8 <= size:
        return "safetensors"  # an 8-byte header length, then the JSON header
    raise FormatError(
        f"Expected a checkpoint file: {CHECKPOINT_FORMATS}. Got {str(path)!r} instead, which is "
        f"neither (it starts with {head[:8]!r}): it is not a checkpoint this tool reads; import the "
        "checkpoint file itself.")


def load_checkpoint_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a ``.safetensors`` or ``torch.save`` file as ``{"model": ..., ["optimizer": ...]}``
    (the format from its content, :func:`checkpoint_format`)."""
    path = Path(path)
    if checkpoint_format(path) == "safetensors":
        from safetensors.torch import load_file

        try:
            return {"model": load_file(str(path))}
        except Exception as exc:  # safetensors raises its own error types
            raise FormatError(f"Expected a valid .safetensors file at {str(path)!r}. Got: {exc}") from exc
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # UnpicklingError for anything that would execute code
        raise _unreadable_torch_file(path, exc) from None
    if isinstance(obj, Mapping) and ("model" in obj or "optimizer" in obj):
        return dict(obj)
    if isinstance(obj, Mapping) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return {"model": dict(obj)}
    if isinstance(obj, Mapping) and "state_dict" in obj:
        return {"model": obj["state_dict"], **{k: v for k, v in obj.items() if k != "state_dict"}}
    raise FormatError(
        f"Expected {str(path)!r} to hold a state_dict or a dict with 'model'/'optimizer'. "
        f"Got {type(obj).__name__} instead."
    )


def _unreadable_torch_file(path: Path, exc: Exception) -> FormatError:
    """Why torch.load(weights_only=True) refused ``path``, in our words: torch's message
    advises loading with ``weights_only=False``, which would run the file's code; that
    advice is never relayed. (Told by the class name: no pickle module here.)"""
    import re

    if type(exc).__name__ == "UnpicklingError":
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        what = f"an object of class {found.group(1)}" if found else "objects other than tensors and plain values"
        return FormatError(
            f"Expected {str(path)!r} to hold only tensors, dicts, lists and plain values. Got {what} "
            "instead, which loading would have to run code to build: inshrink never unpickles code; "
            "save just the state dicts, e.g. torch.save({'model': model.state_dict(), "
            "'optimizer': optimizer.state_dict()}, path).")
    lines = [line for line in str(exc).splitlines() if line.strip() and "weights_only" not in line]
    return FormatError(
        f"Expected {str(path)!r} to be a readable torch.save file. Got {type(exc).__name__}"
        f"{': ' + lines[0][:200] if lines else ''} instead: the file is damaged or truncated; save or "
        f"download it again (formats read: {CHECKPOINT_FORMATS}).")


def import_file(repo: Repository, path: str | os.PathLike[str], *,
                quantize: QuantConfig | Allocation | Planner | None = None, moments: MomentPolicy | None = None,
                **commit: Unpack[SaveOptions]) -> SnapshotInfo:
    """Import a checkpoint file as the next version (``inshrink import``); ``commit`` and the
    return: see :func:`save_state`."""
    return save_state(repo, load_checkpoint_file(path), quantize=quantize, moments=moments, **commit)


def save_safetensors(tensors: Mapping[str, Any], path: str | os.PathLike[str],
                     metadata: Mapping[str, str] | None = None) -> None:
    """Write via a temp file in the same folder, then rename: never a half-written file."""
    from safetensors.torch import save_file

    write_atomically(Path(path), lambda tmp: save_file({k: v.contiguous() for k, v in tensors.items()}, tmp,
                                                       metadata=dict(metadata) if metadata else None))


def write_atomically(path: Path, write: Callable[[str], None]) -> None:
    """``write`` a temp file in ``path``'s folder, then rename it to ``path``.

    The file gets the mode a plain ``open()`` gives (0666 less the umask), as
    ``save_pretrained``'s files have: not ``mkstemp``'s 0600, nor what ``write`` leaves
    (safetensors writes 0600 too). The umask is read from the mode the temp file is created
    with (``os.umask`` can only be read by setting it, which races with other threads)."""
    folder = path.parent or Path(".")
    while True:
        tmp = str(folder / f"{path.name}.{secrets.token_hex(8)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            break
        except FileExistsError:  # another writer's name: draw again
            continue
    try:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)
        os.close(fd)
        write(tmp)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _export_tensor(array: np.ndarray, name: str) -> Any:
    """A stored array as a tensor for a file; a numpy array of a dtype torch's table leaves out
    (U16..U64) through torch.from_numpy. The array was just read for the export (nobody else
    holds it), so it is shared, not copied (:func:`fresh_to_tensor`): a copy of every tensor
    cost about a sixth of an ``export --all``'s CPU time (issue 43, item 10)."""
    return fresh_to_tensor(array, name) if name in _TORCH_NAMES else torch.from_numpy(np.array(array, order="C"))


#: the parts of a saved state that hold the model's state dict, in the order looked for:
#: ``model`` (the Checkpointer's, ``save_state(repo, {"model": ...})``) and ``state_dict``
#: (a Lightning checkpoint's, as the Lightning plugin or ``inshrink import`` of a .ckpt stores it)
MODEL_PARTS = ("model", "state_dict")


def model_part(reader: SnapshotReader) -> str | None:
    """The top-level part of ``reader``'s version that holds the model's state dict (one of
    :data:`MODEL_PARTS`), or None when the version has none (a flat ``repo.save``)."""
    tops = _tops(reader)
    return next((part for part in MODEL_PARTS if part + "/" in tops), None)


def export_tensors(reader: SnapshotReader, *, include_all: bool = False,
                   progress: Callable[[str, int, int], None] | None = None, residual: ExactBits | None = None) -> dict[str, Any]:
    """What an export writes: the model tensors of a version under their state-dict names
    (without ``model/``, or a Lightning version's ``state_dict/``: :func:`model_part`), or
    every tensor under its full path with ``include_all`` (or when the version has no model
    part); with the version's ``residual``, the exact bits."""
    dtypes = reader.dtypes()
    names = reader.names()
    part = None if include_all else model_part(reader)
    chosen = names if part is None else [p for p in names if p.startswith(part + "/")]
    tensors = {}
    done = 0
    for start in range(0, len(chosen), _EXPORT_BATCH):  # tensors read side by side (issue 43, item 10)
        batch = chosen[start:start + _EXPORT_BATCH]
        for p, stored in reader.read_many(batch, cache=False).items():  # read once, kept by the caller
            key = p if part is None else p[len(part) + 1:]
            tensors[key] = _export_tensor(stored if residual is None else residual.exact(p, stored), dtypes[p])
            done += 1
            if progress:
                progress(p, done, len(chosen))
    return tensors


#: tensors an export reads at once (SnapshotReader.read_many: on the cores, or several
#: requests at once on an object store); the progress bar moves after each batch
_EXPORT_BATCH = 32


def export_safetensors(reader: SnapshotReader, path: str | os.PathLike[str], *, include_all: bool = False,
                       progress: Callable[[str, int, int], None] | None = None, residual: ExactBits | None = None) -> int:
    """Model tensors (names without the ``model/`` or a Lightning version's ``state_dict/``
    prefix: :func:`model_part`) of a version to a safetensors file
    (the exact bits with the version's ``residual``). With ``include_all``: every tensor under
    its stored path (safetensors is flat), the structure the paths came from as JSON in the
    file's metadata (``inshrink_structure``: the skeleton of docs/reference/names.md, scalars
    such as ``param_groups`` included), and ``inshrink_param_names`` (parameter index ->
    name) where the version knows them."""
    tensors = export_tensors(reader, include_all=include_all, progress=progress, residual=residual)
    metadata = {}
    if include_all:
        skeleton = reader.attributes.get(STRUCTURE_ATTR)
        if skeleton is not None:
            metadata["inshrink_structure"] = json.dumps(skeleton, separators=(",", ":"))
        if reader.param_names():
            metadata["inshrink_param_names"] = json.dumps({str(i): n for i, n in sorted(reader.param_names().items())})
    save_safetensors(tensors, path, metadata)
    return len(tensors)


def export_state(reader: SnapshotReader, *, include_all: bool = False,
                 progress: Callable[[str, int, int], None] | None = None,
                 residual: ExactBits | None = None) -> dict[str, Any]:
    """What :func:`export_torch` writes: the model's state dict by state-dict key (a Lightning
    version's ``state_dict``: :func:`model_part`), or with
    ``include_all`` the version's whole state as it was saved (``{"model": ..., "optimizer":
    ..., "extra": ...}``, optimizer state by parameter index as torch's ``load_state_dict``
    takes it), numpy arrays in it as tensors (torch.load(weights_only=True) reads no numpy).
    A version saved without structure (plain ``repo.save``) gives its tensors by stored path;
    the model's state dict keeps the order it was saved in."""
    prefix = None if include_all else model_part(reader)
    if reader.attributes.get(STRUCTURE_ATTR) is None or not (include_all or prefix):
        return export_tensors(reader, include_all=include_all, progress=progress, residual=residual)
    state: dict[str, Any] = _numpy_as_tensors(reader_state(reader, prefix=prefix, residual=residual, progress=progress,
                                                           cache=False))
    return state


def _tops(reader: SnapshotReader) -> set[str]:
    """The first components of a version's stored paths, each with its ``/``."""
    return {p.split("/", 1)[0] + "/" for p in reader.names()}


def _numpy_as_tensors(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.array(obj, order="C"))
    if isinstance(obj, dict):
        return {k: _numpy_as_tensors(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_numpy_as_tensors(v) for v in obj]
    if isinstance(obj, tuple):  # torch.Size holds ints only: never a numpy array
        return obj if isinstance(obj, torch.Size) else tuple(_numpy_as_tensors(v) for v in obj)
    return obj


def export_torch(reader: SnapshotReader, path: str | os.PathLike[str], *, include_all: bool = False,
                 progress: Callable[[str, int, int], None] | None = None, residual: ExactBits | None = None) -> int:
    """:func:`export_state` to a ``torch.save`` file (temp file, then rename) that loads with
    ``torch.load(weights_only=True)``: ``model.load_state_dict(torch.load(path))``, or with
    ``include_all`` ``loaded["model"]`` and ``loaded["optimizer"]`` into the model and its
    optimizer. Returns the number of tensors written."""
    state = export_state(reader, include_all=include_all, progress=progress, residual=residual)
    write_atomically(Path(path), lambda tmp: torch.save(state, tmp))
    if include_all and reader.attributes.get(STRUCTURE_ATTR) is not None:
        return len(reader.names())
    return len(state)
