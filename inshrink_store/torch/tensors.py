"""torch tensors and nested state dicts <-> numpy arrays the store writes, bit-exact.
Layer: torch, below Hugging Face and Lightning, above the facade (a client of the store).

zarr has no bfloat16 or float8: BF16 tensors travel as uint16 bit patterns, float8 ones as
uint8, with their logical dtype recorded (``attributes.inshrink.dtype == "BF16"``). A numpy
array in the state is stored the same way and comes back a numpy array; a ``torch.Size``
comes back a ``torch.Size`` (the skeleton marks both). Tied tensors (one storage,
several names) are stored once and come back as one tensor. Checkpoint files (``.pt``,
``.safetensors``) in and out are :mod:`inshrink_store.torch.checkpoint_files`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, cast, overload

import numpy as np

from inshrink_store import dtypes
from inshrink_store.errors import (
    FormatError,
    IntegrityError,
    InvalidInputError,
    NotFoundError,
    require,
)
from inshrink_store.structure import STRUCTURE_ATTR, flatten, tagged_leaves, unflatten
from inshrink_store.torch.tiers import refuse_dropped

if TYPE_CHECKING:  # annotations only; at run time torch comes from require() below
    import torch as _torch
    from typing_extensions import Unpack

    from inshrink_store import SnapshotReader
    from inshrink_store.plans import Planner, Quantize
    from inshrink_store.policy import Allocation, MomentPolicy, QuantConfig
    from inshrink_store.repository import Repository, SaveOptions, SnapshotInfo

torch = require("torch", "torch")
log = logging.getLogger(__name__)


#: torch dtype -> logical dtype name in :mod:`inshrink_store.dtypes` (which says how it is
#: carried); torch's unsigned 16/32/64-bit types are too new to rely on, so U16..U64 stay out
TORCH_DTYPES: dict[Any, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64", torch.complex128: "C128",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
_BY_NAME = {name: dt for dt, name in TORCH_DTYPES.items()}
#: the skeleton's mark on a leaf saved from a numpy array: it comes back as one, not a tensor
NUMPY_TAG = "__numpy__"
#: tuple subclasses whose type the skeleton records, and how each is rebuilt
TUPLE_TYPES: dict[Any, str] = {torch.Size: "torch.Size"}
_TUPLE_BUILDERS: dict[str, Callable[[tuple[Any, ...]], Any]] = {"torch.Size": torch.Size}


def _bit_view(entry: dtypes.DType) -> tuple[np.dtype, Any]:
    """The signed integer type (numpy, torch) as wide as ``entry``'s carrier: a dtype carried
    as bits crosses between torch and numpy through it, since numpy has no bfloat16 and
    older torch no uint16."""
    signed = np.dtype(f"i{entry.carrier.itemsize}")
    return signed, _BY_NAME[dtypes.of_array(np.empty(0, signed)).name]


def tensor_to_array(tensor: _torch.Tensor, path: str, copy: bool = True) -> tuple[np.ndarray, str]:
    """A contiguous CPU numpy copy and the logical dtype name; unsupported dtypes are errors.

    ``copy=False`` (a save that ends before the caller goes on) gives a read-only view of a
    contiguous CPU tensor's memory instead: no copy, and an attempt to write through it
    raises rather than change the caller's tensor."""
    if tensor.dtype not in TORCH_DTYPES:
        supported = ", ".join(str(dt).removeprefix("torch.") for dt in TORCH_DTYPES)
        raise FormatError(
            f"Expected tensor {path!r} to have a supported dtype ({supported}). "
            f"Got {tensor.dtype} instead; convert it to one of those first (e.g. .to(torch.complex64) "
            "for complex32, .to(torch.float32) for other floats)."
        )
    if tensor.layout != torch.strided or tensor.is_meta:
        kind = "a meta tensor (it has no data)" if tensor.is_meta else f"a {tensor.layout} tensor"
        raise FormatError(
            f"Expected tensor {path!r} to be a dense tensor with data. Got {kind} instead; "
            "convert it first (e.g. .to_dense(), or materialise it on a real device)."
        )
    name = TORCH_DTYPES[tensor.dtype]
    entry = dtypes.get(name, f"tensor {path!r}")
    # a conjugate or negative view (x.conj()) is materialised: numpy cannot share a lazy sign
    t = tensor.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
    if entry.carried_as_bits:
        array = t.view(_bit_view(entry)[1]).numpy().view(entry.carrier)
    else:
        array = t.numpy()
    if copy:
        return array.copy(), name
    view = array.view()
    view.flags.writeable = False
    return view, name


def array_to_tensor(array: np.ndarray, name: str) -> _torch.Tensor:
    if name not in _BY_NAME:
        raise FormatError(f"Expected a logical dtype in {sorted(_BY_NAME)}. Got {name!r} instead.")
    array = np.array(array, order="C", copy=True)  # not ascontiguousarray: it makes 0-d arrays 1-d
    entry = dtypes.get(name)
    if entry.carried_as_bits:
        return cast("_torch.Tensor", torch.from_numpy(array.view(_bit_view(entry)[0])).view(_BY_NAME[name]))
    return cast("_torch.Tensor", torch.from_numpy(array))


def numpy_to_array(array: np.ndarray, path: str, copy: bool = True) -> tuple[np.ndarray, str]:
    """:func:`tensor_to_array` for a numpy array in the state: C-ordered, native byte order,
    a dtype the registry knows (an InvalidInputError naming ``path`` otherwise)."""
    native = array if array.dtype.isnative else array.astype(array.dtype.newbyteorder("="))
    name = dtypes.of_array(native, path=path).name
    if copy or native is not array or not array.flags.c_contiguous:
        return np.array(native, order="C", copy=True), name  # not ascontiguousarray: it makes 0-d 1-d
    view = array.view()
    view.flags.writeable = False
    return view, name


def is_state_leaf(value: Any) -> bool:
    """What a state stores as an array: a tensor, or a numpy array (which comes back as one)."""
    return isinstance(value, (torch.Tensor, np.ndarray))


def _numpy_tag(value: Any) -> dict[str, Any]:
    return {NUMPY_TAG: True} if isinstance(value, np.ndarray) else {}


def _storage_identity(tensor: Any) -> Any:
    """Same identity = the same tensor stored once (tied weights). Empty tensors have no
    storage to share (every one has data_ptr 0), so each is its own; sparse and meta
    tensors have no data pointer to compare and are refused by name later; a numpy array
    is always its own (nothing ties them)."""
    if isinstance(tensor, np.ndarray) or tensor.numel() == 0 or tensor.layout != torch.strided or tensor.is_meta:
        return ("unique", id(tensor))
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
            tuple(tensor.stride()), tensor.dtype, tensor.is_conj(), tensor.is_neg())  # x.conj() is not x


def flatten_state(state: Any) -> tuple[dict[str, Any], Any]:
    """(path -> tensor or numpy array, skeleton) of a nested state: tied tensors once, numpy
    leaves and ``torch.Size`` marked so that they come back as they were."""
    leaves, skeleton = flatten(state, is_state_leaf, _storage_identity, leaf_tag=_numpy_tag, tuple_types=TUPLE_TYPES)
    warn_shared_views(leaves)
    return leaves, skeleton


def shared_views(leaves: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Pairs of paths whose tensors overlap in memory without being the same view (what
    ``safetensors`` refuses: a fused weight and a slice of it). The same view under two names
    (tied weights) is an alias :func:`flatten_state` stores once, never listed here."""
    spans = []
    for path, tensor in leaves.items():
        if isinstance(tensor, np.ndarray) or tensor.numel() == 0 or tensor.layout != torch.strided or tensor.is_meta:
            continue
        size = tensor.element_size()
        start = tensor.untyped_storage().data_ptr() + tensor.storage_offset() * size
        extent = sum((n - 1) * abs(st) for n, st in zip(tensor.shape, tensor.stride(), strict=True)) + 1
        spans.append((str(tensor.device), start, start + extent * size, _storage_identity(tensor), path))
    spans.sort(key=lambda span: span[:3])
    pairs = []
    for i, (device, _start, end, ident, path) in enumerate(spans):
        for other in spans[i + 1:]:
            if other[0] != device or other[1] >= end:
                break
            if other[3] != ident:
                pairs.append((path, other[4]))
    return pairs


def warn_shared_views(leaves: Mapping[str, Any]) -> None:
    """Log the tensors that share memory as different views (see :func:`shared_views`)."""
    pairs = shared_views(leaves)
    if pairs:
        log.warning("tensors %s share memory as different views: each is stored with its own values (a lossy "
                    "version may give their shared elements two values); tie them as one tensor, or save "
                    "lossless", ", ".join(f"{a} and {b}" for a, b in pairs[:5]))


def unflatten_state(skeleton: Any, leaves: dict[str, Any]) -> Any:
    """Inverse of :func:`flatten_state` (``leaves`` already tensors or numpy arrays)."""
    return unflatten(skeleton, leaves, _TUPLE_BUILDERS)


def state_to_arrays(state: Any, copy: bool = True) -> tuple[dict[str, np.ndarray], dict[str, str], Any]:
    """Nested state -> (path -> array, path -> logical dtype, JSON skeleton); ``copy``: see
    :func:`tensor_to_array`."""
    leaves, skeleton = flatten_state(state)
    arrays, dtypes = {}, {}
    for path, leaf in leaves.items():
        to_array = numpy_to_array if isinstance(leaf, np.ndarray) else tensor_to_array
        arrays[path], dtypes[path] = to_array(leaf, path, copy)
    return arrays, dtypes, skeleton


def arrays_to_state(arrays: Mapping[str, np.ndarray], dtypes: Mapping[str, str], skeleton: Any) -> Any:
    numpy = tagged_leaves(skeleton, NUMPY_TAG)
    leaves = {p: np.array(a, order="C", copy=True) if p in numpy else array_to_tensor(a, dtypes[p])
              for p, a in arrays.items()}
    return unflatten_state(skeleton, leaves)


#: A state dict without its modules (a file, ``save_state``) does not say which 2-D weights
#: are embedding tables, so it is read from the module name, the part before ``.weight``:
#: one of these names, or a name that is or ends in ``_`` + one of the endings.
EMBEDDING_MODULES = ("wte", "wpe", "embed_tokens", "embed_positions", "embed_in")
EMBEDDING_ENDINGS = ("embed", "embeds", "embedding", "embeddings", "emb")


def infer_module_kinds(arrays: Mapping[str, np.ndarray]) -> dict[str, str]:
    """Path -> ``"Embedding"`` for each 2-D ``weight`` whose module is named like an embedding
    table (``embed.weight``, ``tok_embeddings.weight``, ``transformer.wte.weight``,
    ``embed_tokens.weight``...; see :data:`EMBEDDING_MODULES` and :data:`EMBEDDING_ENDINGS`),
    so a quantizer gives it ``embedding_bins``; every other tensor keeps the layer type its
    shape implies. The Checkpointer knows the real module classes and does not need this."""
    kinds = {}
    for path, array in arrays.items():
        module, dot, leaf = path.replace("/", ".").rpartition(".")
        if array.ndim != 2 or leaf != "weight" or not dot:
            continue
        name = module.rpartition(".")[2].lower()
        if name in EMBEDDING_MODULES or any(name == e or name.endswith("_" + e) for e in EMBEDDING_ENDINGS):
            kinds[path] = "Embedding"
    return kinds


def save_state(repo: Repository, state: Mapping[str, Any], *,
               quantize: QuantConfig | Allocation | Planner | None = None, moments: MomentPolicy | None = None,
               **commit: Unpack[SaveOptions]) -> SnapshotInfo:
    """Commit a nested training state (e.g. ``{"model": sd, "optimizer": osd}``) as one version;
    returns its :class:`~inshrink_store.SnapshotInfo`. ``commit``: the keywords of
    :meth:`Repository.save <inshrink_store.Repository.save>` that describe the version
    (``message``, ``step``, ``metrics``, ``metadata``, ``branch``, ...; see
    :class:`~inshrink_store.repository.SaveOptions`).

    An ``Allocation`` picks each model tensor's levels for its target. A ``QuantConfig`` applies ``embedding_bins`` to the tensors :func:`infer_module_kinds`
    names embedding tables (there are no module objects to ask). ``moments`` (a
    :class:`~inshrink_store.policy.moments.MomentPolicy`) compresses the optimizer's Adam
    moments, betas and eps read from its ``param_groups``; the outcome goes into the
    version's ``metadata["moments"]`` (without a model to ask, no joint pruning)."""
    from inshrink_store.policy import Allocation, AllocationPlanner, QuantConfig, StatePlanner
    from inshrink_store.torch.optim import adam_hyper

    if not isinstance(state, Mapping):
        raise FormatError(f"Expected a dict of state (e.g. {{'model': ...}}). Got {type(state).__name__}.")
    # the save ends before this returns: read the tensors in place (read-only views), no copy
    arrays, dtypes, skeleton = state_to_arrays(dict(state), copy=False)
    planner: Planner | None
    if isinstance(quantize, QuantConfig):
        planner = StatePlanner(quantize, module_kinds=infer_module_kinds(arrays))
    elif isinstance(quantize, Allocation):
        planner = AllocationPlanner(quantize, module_kinds=infer_module_kinds(arrays))
    else:
        planner = quantize
    planned: Quantize | None = planner
    if moments is not None:
        made = moments.plan(arrays, dtypes, {}, hyper=adam_hyper(state.get("optimizer")))
        metadata = dict(commit.pop("metadata", None) or {})
        metadata["moments"] = made.record.to_dict()
        commit["metadata"] = metadata
        planned = made if planner is None else _Both(made, planner)
    return repo.save(arrays, dtypes=dtypes, attributes={STRUCTURE_ATTR: skeleton}, quantize=planned, **commit)


class _Both:
    """Plans made already and a planner, as one planner: the first's plans win, the
    second's stay lazy (ChainMap)."""

    def __init__(self, first: Mapping[str, Any], second: Planner) -> None:
        self.first, self.second = first, second

    def plan(self, tensors: Any, dtypes: Any, previous: Any) -> Any:
        from collections import ChainMap

        return ChainMap(cast(Any, self.first), cast(Any, self.second.plan(tensors, dtypes, previous)))


@overload
def load_state(repo: Repository, ref: str = "main", *, map_location: str | _torch.device | None = None,
               prefix: None = None, exact: bool | None = None) -> dict[str, Any]: ...


@overload
def load_state(repo: Repository, ref: str = "main", *, map_location: str | _torch.device | None = None,
               prefix: str | None, exact: bool | None = None) -> Any: ...


def load_state(repo: Repository, ref: str = "main", *, map_location: str | _torch.device | None = None,
               prefix: str | None = None, exact: bool | None = None) -> Any:
    """The nested state of a version, as torch tensors in the saved structure and dtypes.

    Without ``prefix`` it is the whole state, the dict :func:`save_state` or the Checkpointer
    saved (typed ``dict[str, Any]``). ``prefix`` (e.g. ``"model"`` or ``"optimizer/state"``)
    gives only that part of the state, reading only the tensors under it; what is there (a
    dict, a tensor, a list, a number...) is known only when it is read, so that return is
    typed ``Any``. ``map_location`` (like ``torch.load``'s: a device
    string or ``torch.device``) moves every tensor there; tied tensors stay one tensor.

    ``exact``: None (the default) returns the exact bits where the version still keeps its
    restore residual (``Checkpointer(exact_resume=N)``: the N newest versions of a branch) and
    the stored values otherwise; True requires the residual (a NotFoundError says why there is
    none); False returns the stored values, as zarr reads them. :func:`load_state_report`
    also says which one you got."""
    return load_state_report(repo, ref, map_location=map_location, prefix=prefix, exact=exact)[0]


@overload
def load_state_report(repo: Repository, ref: str = "main", *, map_location: str | _torch.device | None = None,
                      prefix: None = None, exact: bool | None = None) -> tuple[dict[str, Any], bool]: ...


@overload
def load_state_report(repo: Repository, ref: str = "main", *, map_location: str | _torch.device | None = None,
                      prefix: str | None, exact: bool | None = None) -> tuple[Any, bool]: ...


def load_state_report(repo: Repository, ref: str = "main", *, map_location: str | _torch.device | None = None,
                      prefix: str | None = None, exact: bool | None = None) -> tuple[Any, bool]:
    """:func:`load_state` and whether what it returned is bit-exact (True: every tensor is
    the saved one; False: quantized tensors hold their stored values); typed as
    :func:`load_state` is (``dict[str, Any]`` without ``prefix``)."""
    if exact not in (None, True, False) or isinstance(exact, int) and not isinstance(exact, bool):
        raise InvalidInputError(f"Expected exact to be None, True or False. Got {exact!r} instead.")
    reader = repo.checkout(ref)
    if prefix is not None:  # a weights-only version says why its optimizer state is not there
        refuse_dropped(reader.info, prefix, ref)
    quantized = [p for p, info in reader.arrays().items() if info.storage == "quantized"]
    residual = None
    if exact is True and quantized:
        try:
            residual = repo.residual(reader.id, missing_ok=False)
        except NotFoundError as exc:
            raise NotFoundError(
                f"Expected the restore residual of snapshot {reader.id[:12]} for an exact load. Got {exc} "
                "Pass exact=None for the stored values; `inshrink verify` says whether it should be there."
            ) from None
        if residual is None or not residual.covers(quantized):
            raise NotFoundError(
                f"Expected the restore residual of snapshot {reader.id[:12]} for an exact load. Got "
                f"{'none' if residual is None else 'one that covers only some of its quantized tensors'} "
                "instead: only the newest versions of a branch keep one (Checkpointer(exact_resume=N)), and this "
                "one was saved without it or gc has collected it; pass exact=None for the stored values.")
    elif exact is None and quantized:
        try:
            residual = repo.residual(reader.id)
        except IntegrityError as exc:  # a malformed reference: the stored values, and say so
            log.warning("snapshot %s: its restore residual is unreadable (%s); returning the stored values",
                        reader.id[:12], exc)
    state = reader_state(reader, map_location=map_location, prefix=prefix, residual=residual)
    return state, not quantized or (residual is not None and residual.covers(quantized))


class ExactBits(Protocol):
    """A version's restore residual as the readers here use it (``Repository.residual(ref)``
    gives one): the exact bits of a stored tensor. A protocol, so that the clients name the
    one method they call rather than the store's residual module (the two doors)."""

    def exact(self, path: str, stored: np.ndarray) -> np.ndarray: ...


def reader_state(reader: SnapshotReader, *, map_location: str | _torch.device | None = None,
                 prefix: str | None = None, residual: ExactBits | None = None,
                 progress: Callable[[str, int, int], None] | None = None, cache: bool = True) -> Any:
    """The state of ``reader``'s version (see :func:`load_state`); ``progress(path, done,
    total)`` after each tensor read; ``cache=False`` for a reader that keeps nothing for a
    next save (an export: :meth:`SnapshotReader.read`'s ``cache``)."""
    device = _device(map_location)
    dtypes = reader.dtypes()
    skeleton = reader.attributes.get(STRUCTURE_ATTR)
    parts = _by_param_name(_prefix_parts(prefix), reader)
    done, lock = [0], threading.Lock()

    def exact(path: str, stored: np.ndarray) -> np.ndarray:
        array = stored if residual is None else residual.exact(path, stored)
        if progress is not None:
            with lock:  # tensors are read on several threads
                done[0] += 1
                progress(path, done[0], len(paths))
        return array

    def read_all(paths: list[str]) -> dict[str, Any]:
        """The tensors at ``paths``: read side by side, each array handed to torch as it is
        (freshly read, so no copy but where it is not contiguous or not writeable)."""
        arrays = reader.read_many(paths, exact, cache=cache)
        return {p: fresh_to_tensor(arrays.pop(p), dtypes[p]) for p in paths}

    if skeleton is None:  # written by plain repo.save: a flat dict by path
        paths = reader.names()
        return _flat_state(reader, parts, device, read_all)
    node = _subtree(skeleton, parts, reader.id)
    paths = sorted(_leaf_paths(node))
    numpy = tagged_leaves(skeleton, NUMPY_TAG)
    tensors = read_all([p for p in paths if p not in numpy])
    if device is not None:  # before unflatten: a tied tensor is moved once and stays tied
        tensors = {p: t.to(device) for p, t in tensors.items()}
    tensors.update(reader.read_many([p for p in paths if p in numpy], exact, cache=cache))  # numpy stays numpy, on the host
    return unflatten_state(node, tensors)


def fresh_to_tensor(array: np.ndarray, name: str) -> Any:
    """:func:`array_to_tensor` for an array nobody else holds (just read): shared, not copied."""
    if array.ndim and array.flags.c_contiguous and array.flags.writeable and name in _BY_NAME:
        entry = dtypes.get(name)
        if entry.carried_as_bits:
            return torch.from_numpy(array.view(_bit_view(entry)[0])).view(_BY_NAME[name])
        return torch.from_numpy(array)
    return array_to_tensor(array, name)


def _device(map_location: Any) -> Any:
    if map_location is None:
        return None
    if isinstance(map_location, (str, torch.device)):
        try:
            device = torch.device(map_location)
        except (RuntimeError, ValueError) as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise InvalidInputError(
                f"Expected map_location to be a device such as 'cpu', 'cuda:0' or torch.device('cuda'). "
                f"Got {map_location!r} instead ({reason}).") from None
        _check_available(device, map_location)
        return device
    raise InvalidInputError(
        f"Expected map_location to be a device string or a torch.device. Got {type(map_location).__name__} "
        "instead; e.g. map_location='cpu'.")


def _check_available(device: Any, map_location: Any) -> None:
    """A device this torch build or machine lacks fails here, named, before anything is read:
    torch itself fails only at the first ``.to()``, with an AssertionError ("Torch not compiled
    with CUDA enabled") or a RuntimeError that does not say which argument was wrong."""
    backend = getattr(torch, device.type, None)  # torch.cuda, torch.mps, torch.xpu (not meta)
    available = getattr(backend, "is_available", None)
    if callable(available) and not available():
        name = device.type.upper() if device.type == "cuda" else device.type
        raise InvalidInputError(
            f"Expected map_location to be a device this torch can use. Got {map_location!r} instead, but "
            f"{name} is not available in this torch build or on this machine "
            f"(torch.{device.type}.is_available() is False): pass map_location='cpu', or install a "
            f"{name}-enabled torch where that device exists.")
    count = getattr(backend, "device_count", None)
    if device.type != "cpu" and device.index is not None and callable(count) and device.index >= count():
        raise InvalidInputError(
            f"Expected map_location to name one of the {count()} {device.type} devices here. Got "
            f"{map_location!r} instead: pass an index below {count()}, e.g. '{device.type}:0'.")


def _by_param_name(parts: list[str], reader: Any) -> list[str]:
    """``optimizer/state/<param name>/...`` -> ``optimizer/state/<index>/...``: a prefix may
    name a parameter's optimizer state as a tensor name may (docs/reference/names.md)."""
    if len(parts) < 3 or parts[:2] != ["optimizer", "state"] or parts[2].isdigit():
        return parts
    index = {name: i for i, name in reader.param_names().items()}.get(parts[2])
    return parts if index is None else [*parts[:2], str(index), *parts[3:]]


def _prefix_parts(prefix: str | None) -> list[str]:
    if prefix is None:
        return []
    if not isinstance(prefix, str):
        raise InvalidInputError(
            f"Expected prefix to be a path in the saved state such as 'model' or 'optimizer/state'. Got "
            f"{type(prefix).__name__} {prefix!r} instead.")
    return [p for p in prefix.strip("/").split("/") if p]


def _subtree(skeleton: Any, parts: list[str], snapshot: str) -> Any:
    """The skeleton node at ``parts`` (each a dict key or a list index as text)."""
    node = skeleton
    for depth, part in enumerate(parts):
        children: dict[str, Any] = {}
        if isinstance(node, dict) and "__dict__" in node:
            children = {str(k): v for k, v in node["__dict__"]}
        elif isinstance(node, dict) and ("__list__" in node or "__tuple__" in node):
            items = node["__list__"] if "__list__" in node else node["__tuple__"]
            children = {str(i): v for i, v in enumerate(items)}
        if part not in children:
            where = "/".join(parts[:depth]) or "the top level"
            choices = sorted(children)[:20]
            raise NotFoundError(
                f"Expected {'/'.join(parts)!r} in the saved state of snapshot {snapshot[:12]}. Got no "
                f"{part!r} under {where} instead; choose one of {choices} (or prefix=None for everything).")
        node = children[part]
    return node


def _leaf_paths(node: Any) -> set[str]:
    """Every stored array a skeleton node needs (an alias may point outside the node)."""
    found: set[str] = set()

    def walk(n: Any) -> None:
        if isinstance(n, dict):
            if "__array__" in n:
                found.add(n["__array__"])
            elif "__alias__" in n:
                found.add(n["__alias__"])
            elif "__dict__" in n:
                for _, v in n["__dict__"]:
                    walk(v)
            else:
                for v in n.get("__list__") or n.get("__tuple__") or []:
                    walk(v)

    walk(node)
    return found


def _flat_state(reader: Any, parts: list[str], device: Any,
                read_all: Callable[[list[str]], dict[str, Any]]) -> Any:
    """A store written by plain ``repo.save``: path -> tensor, under ``prefix`` if given
    (paths relative to it; the prefix naming one tensor gives that tensor)."""
    base = "/".join(parts)
    chosen = {p: p[len(base) + 1:] if base else p for p in reader.names()
              if not base or p == base or p.startswith(base + "/")}
    if not chosen:
        tops = sorted({p.split("/")[0] for p in reader.names()})[:20]
        raise NotFoundError(
            f"Expected tensors under {base!r} in snapshot {reader.id[:12]}. Got none instead; choose "
            f"one of {tops} (or prefix=None for everything).")
    tensors = read_all(list(chosen))
    out = {key: tensors[path] if device is None else tensors[path].to(device) for path, key in chosen.items()}
    return out.get("", out)
