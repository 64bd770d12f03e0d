"""JSON between the ranks of a process group, failures shared, no pickle.
Layer: torch, below Hugging Face and Lightning, above the facade (a client of the store).

DCP moves its own plans with torch's object collectives (pickle). What this package adds
to a distributed save (each rank's sketch counts, the configuration rank 0 chose) travels
as JSON text in uint8 tensors instead, so nothing a rank receives is ever unpickled.

Every rank takes part in each exchange even when its own part failed: it sends the error
instead of its value. A rank that raised before the collective would leave the others
waiting in it until the process group's timeout (30 minutes by default); this way every
rank raises at once, the failing rank its own exception and the others an error naming it.

Without an initialised process group (a single process, ``dcp.save(..., no_dist=True)``)
nothing is exchanged: the value is this process's alone.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

from inshrink_store.errors import InshrinkError
from inshrink_store.torch.tensors import torch

T = TypeVar("T")


def distributed(group: Any = None) -> bool:
    """True when a process group of more than one rank is there to exchange with."""
    dist = torch.distributed
    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1)


def _device(group: Any) -> Any:
    """Where the group's collectives take their tensors: the CPU for gloo (and a mixed
    ``cpu:gloo,cuda:nccl`` group), this process's GPU for NCCL alone."""
    backend = str(torch.distributed.get_backend(group)).lower()
    if "gloo" in backend or "mpi" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _encode(compute: Callable[[], Any]) -> tuple[bytes, BaseException | None]:
    """This rank's message: its value, or the error computing it raised."""
    try:
        return json.dumps({"ok": True, "value": compute()}, sort_keys=True).encode(), None
    except Exception as exc:  # sent to every rank, then re-raised here
        text = f"{type(exc).__name__}: {exc}"
        return json.dumps({"ok": False, "error": text[:2000]}).encode(), exc


def _decode(messages: list[bytes], what: str, own: BaseException | None) -> list[Any]:
    """The values of every rank, or the failure: this rank's own exception if it had one,
    else an error naming each rank that failed and why."""
    docs = [json.loads(m) for m in messages]
    failed = {rank: doc["error"] for rank, doc in enumerate(docs) if not doc["ok"]}
    if own is not None:
        raise own
    if failed:
        named = "; ".join(f"rank {rank}: {error}" for rank, error in sorted(failed.items()))
        raise InshrinkError(f"Expected every rank to {what}. Got {len(failed)} rank(s) failing instead ({named}).")
    return [doc["value"] for doc in docs]


def _bytes_tensor(data: bytes, size: int, device: Any) -> Any:
    buffer = torch.zeros(max(size, 1), dtype=torch.uint8)
    if data:
        buffer[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buffer.to(device)


def _all_gather_bytes(data: bytes, group: Any) -> list[bytes]:
    dist, device = torch.distributed, _device(group)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64, device=device), group=group)
    lengths = [int(s.item()) for s in sizes]
    longest = max(max(lengths), 1)
    out = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(out, _bytes_tensor(data, longest, device), group=group)
    return [bytes(t[:n].cpu().numpy().tobytes()) for t, n in zip(out, lengths, strict=True)]


def gather_json(what: str, compute: Callable[[], T], group: Any = None) -> list[T]:
    """``compute()`` on every rank; every rank gets the list of all ranks' values (JSON-native),
    in rank order. ``what`` completes "Expected every rank to ..." in the error."""
    if not distributed(group):
        return [compute()]
    data, own = _encode(compute)
    return _decode(_all_gather_bytes(data, group), what, own)


def broadcast_json(what: str, compute: Callable[[], T], group: Any = None) -> T:
    """``compute()`` on the group's first rank only; every rank gets its value (JSON-native).
    A failure there is raised on every rank."""
    if not distributed(group):
        return compute()
    dist, device = torch.distributed, _device(group)
    first = dist.get_rank(group) == 0
    data, own = _encode(compute) if first else (b"", None)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    buffer = _bytes_tensor(data, int(size.item()), device)
    dist.broadcast(buffer, src=src, group=group)
    message = bytes(buffer[: int(size.item())].cpu().numpy().tobytes())
    return _decode([message], what, own)[0]  # type: ignore[no-any-return]
