"""torch tensors and nested state dicts <-> numpy arrays the store writes, bit-exact.

zarr has no bfloat16: BF16 tensors travel as uint16 bit patterns with their logical
dtype recorded (``attributes.inshrink.dtype == "BF16"``). Tied tensors (one storage,
several names) are stored once and come back as one tensor. Files are read with
``torch.load(weights_only=True)`` only: reading never executes code.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from inshrink_store import dtypes
from inshrink_store.errors import FormatError, require
from inshrink_store.structure import flatten, unflatten

torch = require("torch", "torch")

STRUCTURE_ATTR = "inshrink_structure"

#: torch dtype -> logical dtype name in :mod:`inshrink_store.dtypes` (which says how it is
#: carried); torch's unsigned 16/32/64-bit types are too new to rely on, so U16..U64 stay out
TORCH_DTYPES: dict[Any, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
_BY_NAME = {name: dt for dt, name in TORCH_DTYPES.items()}


def _bit_view(entry: dtypes.DType) -> tuple[np.dtype, Any]:
    """The signed integer type (numpy, torch) as wide as ``entry``'s carrier: a dtype carried
    as bits crosses between torch and numpy through it, since numpy has no bfloat16 and
    older torch no uint16."""
    signed = np.dtype(f"i{entry.carrier.itemsize}")
    return signed, _BY_NAME[dtypes.of_array(np.empty(0, signed)).name]


def tensor_to_array(tensor: Any, path: str) -> tuple[np.ndarray, str]:
    """A contiguous CPU numpy copy and the logical dtype name; unsupported dtypes are errors."""
    if tensor.dtype not in TORCH_DTYPES:
        supported = ", ".join(TORCH_DTYPES.values())
        raise FormatError(
            f"Expected tensor {path!r} to have a supported dtype ({supported}). "
            f"Got {tensor.dtype} instead; convert it (e.g. complex -> torch.view_as_real)."
        )
    if tensor.layout != torch.strided or tensor.is_meta:
        kind = "a meta tensor (it has no data)" if tensor.is_meta else f"a {tensor.layout} tensor"
        raise FormatError(
            f"Expected tensor {path!r} to be a dense tensor with data. Got {kind} instead; "
            "convert it first (e.g. .to_dense(), or materialise it on a real device)."
        )
    name = TORCH_DTYPES[tensor.dtype]
    entry = dtypes.get(name, f"tensor {path!r}")
    t = tensor.detach().to("cpu").contiguous()
    if entry.carried_as_bits:
        return t.view(_bit_view(entry)[1]).numpy().view(entry.carrier).copy(), name
    return t.numpy().copy(), name


def array_to_tensor(array: np.ndarray, name: str) -> Any:
    if name not in _BY_NAME:
        raise FormatError(f"Expected a logical dtype in {sorted(_BY_NAME)}. Got {name!r} instead.")
    array = np.array(array, order="C", copy=True)  # not ascontiguousarray: it makes 0-d arrays 1-d
    entry = dtypes.get(name)
    if entry.carried_as_bits:
        return torch.from_numpy(array.view(_bit_view(entry)[0])).view(_BY_NAME[name])
    return torch.from_numpy(array)


def _storage_identity(tensor: Any) -> Any:
    """Same identity = the same tensor stored once (tied weights). Empty tensors have no
    storage to share (every one has data_ptr 0), so each is its own; sparse and meta
    tensors have no data pointer to compare and are refused by name later."""
    if tensor.numel() == 0 or tensor.layout != torch.strided or tensor.is_meta:
        return ("unique", id(tensor))
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
            tuple(tensor.stride()), tensor.dtype)


def state_to_arrays(state: Any) -> tuple[dict[str, np.ndarray], dict[str, str], Any]:
    """Nested state -> (path -> array, path -> logical dtype, JSON skeleton)."""
    leaves, skeleton = flatten(state, lambda x: isinstance(x, torch.Tensor), _storage_identity)
    arrays, dtypes = {}, {}
    for path, tensor in leaves.items():
        arrays[path], dtypes[path] = tensor_to_array(tensor, path)
    return arrays, dtypes, skeleton


def arrays_to_state(arrays: Mapping[str, np.ndarray], dtypes: Mapping[str, str], skeleton: Any) -> Any:
    tensors = {p: array_to_tensor(a, dtypes[p]) for p, a in arrays.items()}
    return unflatten(skeleton, tensors)


def save_state(repo: Any, state: Mapping[str, Any], *, quantize: Any = None, **commit: Any) -> Any:
    """Commit a nested training state (e.g. ``{"model": sd, "optimizer": osd}``) as one version."""
    if not isinstance(state, Mapping):
        raise FormatError(f"Expected a dict of state (e.g. {{'model': ...}}). Got {type(state).__name__}.")
    arrays, dtypes, skeleton = state_to_arrays(dict(state))
    return repo.save(arrays, dtypes=dtypes, attributes={STRUCTURE_ATTR: skeleton}, quantize=quantize, **commit)


def load_state(repo: Any, ref: str = "main") -> Any:
    """The nested state of a version, as torch tensors in the saved structure and dtypes."""
    return reader_state(repo.checkout(ref))


def reader_state(reader: Any) -> Any:
    dtypes = reader.dtypes()
    arrays = reader.load()
    skeleton = reader.attributes.get(STRUCTURE_ATTR)
    if skeleton is None:  # written by plain repo.save: a flat dict by path
        return {p: array_to_tensor(a, dtypes[p]) for p, a in arrays.items()}
    return arrays_to_state(arrays, dtypes, skeleton)


def load_checkpoint_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a ``.safetensors`` or ``.pt``/``.pth`` file as ``{"model": ..., ["optimizer": ...]}``."""
    path = Path(path)
    if not path.is_file():
        raise FormatError(f"Expected a checkpoint file. Got {str(path)!r}, which does not exist.")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return {"model": load_file(str(path))}
        except Exception as exc:  # safetensors raises its own error types
            raise FormatError(f"Expected a valid .safetensors file at {str(path)!r}. Got: {exc}") from exc
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # UnpicklingError for anything that would execute code
        raise FormatError(
            f"Expected {str(path)!r} to hold tensors, dicts and plain values loadable with "
            f"torch.load(weights_only=True). Got an error instead ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}). inshrink never unpickles code."
        ) from exc
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


def import_file(repo: Any, path: str | os.PathLike[str], *, quantize: Any = None,
                progress: Callable[[str, int, int], None] | None = None, **commit: Any) -> Any:
    """Import a checkpoint file as the next version (``inshrink import``)."""
    return save_state(repo, load_checkpoint_file(path), quantize=quantize, progress=progress, **commit)


def save_safetensors(tensors: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Write via a temp file in the same folder, then rename: never a half-written file."""
    from safetensors.torch import save_file

    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent or ".")
    os.close(fd)
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def export_safetensors(reader: Any, path: str | os.PathLike[str], *, include_all: bool = False,
                       progress: Callable[[str, int, int], None] | None = None) -> int:
    """Model tensors (names without the ``model/`` prefix) of a version to a safetensors file."""
    dtypes = reader.dtypes()
    names = reader.names()
    model = [p for p in names if p.startswith("model/")]
    chosen = names if include_all or not model else model
    tensors = {}
    for i, p in enumerate(chosen):
        key = p[len("model/"):] if (p.startswith("model/") and not include_all) else p
        tensors[key] = array_to_tensor(reader.read(p), dtypes[p])
        if progress:
            progress(p, i + 1, len(chosen))
    save_safetensors(tensors, path)
    return len(tensors)
