"""Copies of the training state for a background save, without holding the loop.
Layer: torch clients (beside the Checkpointer, which is its one user).

A save must copy the state before the loop's next step changes it. For CPU tensors that is
a plain copy. For CUDA tensors a blocking ``.to("cpu")`` per tensor waits for each transfer
(GPT-2 124 M: 2 to 10 s of the loop per save, most of it pageable-memory copies and a
synchronisation per tensor). :class:`HostStaging` instead:

- keeps **one reusable pinned host arena** holding a buffer for every CUDA tensor of the
  state: allocated in one piece at the first save (one page-locking call, not one per
  tensor, and no rounding of each tensor up to a power of two as torch's host caching
  allocator does), carved into views, and reused by every later save whose tensors have
  the same names, shapes and dtypes; so a copy runs at the bus's speed;
- **enqueues** each copy with ``non_blocking=True`` on the stream the tensor was produced on
  (the loop's current stream) and records one CUDA event per device after the last copy;
- returns at once: the loop's thread never waits for a transfer. The background save calls
  :meth:`Staged.wait` (the events' ``synchronize``) before it reads a buffer.

Why the loop's own stream and not a side stream: on a side stream the copy would race with
whatever the loop enqueues next (the optimizer's in-place step, batch-norm statistics
updated by the next forward, an EMA of the weights). Stream order is the one guarantee
that needs no hook into the user's loop: every kernel enqueued after the save runs after
the copies have read their tensors. The cost is the copy's time on that stream (about
30 ms for 1.6 GB on an H100 with pinned memory), paid by the GPU, not by the loop's thread.

CPU tensors are copied into **host buffers kept from the previous save** (one per tensor,
reused when its path, shape, strides and dtype are the same; others are allocated afresh and
the ones no longer in the state dropped). Why: a fresh copy of a large state is mostly page
faults, the allocator handing back and re-mapping the same gigabytes at every save, and the
loop waits for all of it; a reused buffer is a plain memcpy. The cost is that the copy stays
resident between saves (a non-blocking save needs it at every save anyway: the peak is the
same).

Buffers are reused only after the previous save's background work finished (the
Checkpointer waits for it before staging the next save), so a buffer is never overwritten
while a save still reads it. A tensor shared under two names (tied weights) is copied once
and appears under both names as the same host tensor, as in the live state.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from inshrink_store.torch.tensors import torch


@dataclass
class Staged:
    """The copies of one save: wait before reading any CUDA tensor's buffer."""

    events: list[Any] = field(default_factory=list)

    def wait(self) -> None:
        """Block until every copy of this save has landed in its host buffer."""
        for event in self.events:
            event.synchronize()
        self.events.clear()


def _identity(t: Any) -> tuple[Any, ...]:
    """What makes two views the same tensor: storage, offset, shape, strides and dtype."""
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


#: each buffer starts at a multiple of this many bytes in the arena (any dtype's alignment)
ALIGN = 64


class HostStaging:
    """A pinned host arena reused across saves; see the module docstring."""

    def __init__(self) -> None:
        self._layout: tuple[tuple[str, tuple[int, ...], Any], ...] = ()
        self._views: list[Any] = []
        #: path -> the CPU tensor's host copy of the last save, reused by the next one
        self._host: dict[str, Any] = {}

    def copy(self, obj: Any) -> tuple[Any, Staged]:
        """A copy of ``obj`` (nested dicts, lists and tuples of tensors and plain values)
        whose CUDA tensors land in the pinned arena once the returned :class:`Staged` is
        waited on; CPU tensors and everything else are copied now."""
        cuda: dict[tuple[Any, ...], tuple[str, Any]] = {}
        self._collect(obj, "", cuda)
        views = self._arena([(path, t) for path, t in cuda.values()])
        buffers = dict(zip(cuda, views, strict=True))
        devices: set[Any] = set()
        for (_, t), view in zip(cuda.values(), views, strict=True):
            view.copy_(t, non_blocking=True)
            devices.add(t.device)
        host: dict[str, Any] = {}
        out = self._copy(obj, buffers, {}, "", host)
        self._host = host  # buffers of tensors no longer in the state are dropped
        staged = Staged()
        for device in sorted(devices, key=str):
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            staged.events.append(event)
        return out, staged

    def _collect(self, obj: Any, path: str, cuda: dict[tuple[Any, ...], tuple[str, Any]]) -> None:
        """The distinct CUDA tensors of ``obj``, in traversal order, with their first path."""
        if isinstance(obj, torch.Tensor):
            if obj.is_cuda:
                cuda.setdefault(_identity(obj.detach()), (path, obj.detach()))
        elif isinstance(obj, dict):
            for k, v in obj.items():
                self._collect(v, f"{path}/{k}", cuda)
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                self._collect(v, f"{path}/{i}", cuda)

    def _arena(self, tensors: list[tuple[str, Any]]) -> list[Any]:
        """A pinned view per tensor: the last save's when the layout is the same, else a
        new arena (the old one is freed with its views)."""
        layout = tuple((path, tuple(t.shape), t.dtype) for path, t in tensors)
        if layout != self._layout:
            sizes = [t.numel() * t.element_size() for _, t in tensors]
            starts, total = [], 0
            for size in sizes:
                starts.append(total)
                total += -(-size // ALIGN) * ALIGN
            self._views = []
            arena = torch.empty(total, dtype=torch.uint8, pin_memory=True) if total else None
            for (_, t), start, size in zip(tensors, starts, sizes, strict=True):
                if arena is None or not size:  # an empty tensor: nothing to hold
                    self._views.append(torch.empty(t.shape, dtype=t.dtype))
                else:
                    self._views.append(arena[start:start + size].view(t.dtype).view(t.shape))
            self._layout = layout
        return self._views

    def _copy(self, obj: Any, buffers: dict[tuple[Any, ...], Any], seen: dict[tuple[Any, ...], Any], path: str,
              host: dict[str, Any]) -> Any:
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            key = _identity(t)
            if key in buffers:
                return buffers[key]
            if key not in seen:  # the same tensor under another name: one copy, both names
                seen[key] = host[path] = self._host_copy(t, path)
            return seen[key]
        if isinstance(obj, dict):
            return {k: self._copy(v, buffers, seen, f"{path}/{k}", host) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._copy(v, buffers, seen, f"{path}/{i}", host) for i, v in enumerate(obj))
        return copy.deepcopy(obj)

    def _host_copy(self, t: Any, path: str) -> Any:
        """A CPU tensor's copy: into the last save's buffer for ``path`` when it fits exactly."""
        old = self._host.get(path)
        if old is not None and not t.is_cuda and old.shape == t.shape and old.dtype == t.dtype \
                and old.stride() == t.stride() and old.data_ptr() != t.data_ptr():
            return old.copy_(t)
        return t.to("cpu", copy=True)
