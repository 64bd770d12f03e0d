"""Copies of the training state for a background save, without holding the loop.
Layer: torch clients (beside the Checkpointer, which is its one user).

A save must copy the state before the loop's next step changes it. For CPU tensors that is
a plain copy. For CUDA tensors a blocking ``.to("cpu")`` per tensor waits for each transfer
(GPT-2 124 M: 2 to 10 s of the loop per save, most of it pageable-memory copies and a
synchronisation per tensor). :meth:`HostStaging.stage` copies CUDA tensors one of two ways,
neither of which makes the loop's thread wait for a transfer:

- **Into the pinned arena, on the loop's stream** (``host`` mode, the steady state). One
  reusable page-locked host arena holds a buffer for every CUDA tensor of the state:
  allocated in one piece (one page-locking call, not one per tensor, and no rounding of each
  tensor up to a power of two as torch's host caching allocator does), carved into views,
  and reused by every later save whose tensors have the same names, shapes and dtypes. Each
  copy is enqueued with ``non_blocking=True`` on the stream the tensor was produced on (the
  loop's current stream), one CUDA event is recorded per device, and ``stage`` returns.
- **On the device first** (``device`` mode), when the arena cannot take the copy now: at the
  first save (page-locking 1.5 GB takes about 1 s, which the loop would wait for) and while
  the previous save still reads the arena (the loop would wait for that save to commit).
  Each tensor is cloned on the loop's stream (a device-to-device copy, about 1 ms for
  1.5 GB on an H200), an event is recorded, and ``stage`` returns. The background save then
  allocates the arena if it has none (off the loop's thread), copies the clones into it on
  a side stream after that event, and frees the clones. Only when the device has room: the
  clones must fit in the device's free memory (``cudaMemGetInfo``, not the blocks torch
  keeps cached, which the next forward pass will want back) less :data:`DEVICE_HEADROOM`
  of its total; otherwise the caller waits and the copy goes the ``host`` way.

Why the loop's own stream for everything that reads a live tensor, and not a side stream:
on a side stream the copy would race with whatever the loop enqueues next (the optimizer's
in-place step, batch-norm statistics updated by the next forward, an EMA of the weights).
Stream order is the one guarantee that needs no hook into the user's loop: every kernel
enqueued after the save runs after the copies have read their tensors. The side stream of
``device`` mode reads only the save's own clones, which nothing else writes.

CPU tensors are copied into **host buffers kept from the previous save** (one per tensor,
reused when its path, shape, strides and dtype are the same; others are allocated afresh and
the ones no longer in the state dropped). Why: a fresh copy of a large state is mostly page
faults, the allocator handing back and re-mapping the same gigabytes at every save, and the
loop waits for all of it; a reused buffer is a plain memcpy. The cost is that the copy stays
resident between saves. While the previous save is running (``busy``) its buffers are its
own: CPU tensors then get fresh copies, and nothing is reused.

Buffers are reused only after the previous save's background work finished: the caller says
whether a save is still running (``busy``), and the background saves run one at a time, in
order, so the arena is written by one of them at a time. A tensor shared under two names
(tied weights) is copied once and appears under both names as the same host tensor, as in
the live state.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from inshrink_store.torch.tensors import torch

#: each buffer starts at a multiple of this many bytes in the arena (any dtype's alignment)
ALIGN = 64
#: ``device`` mode leaves this fraction of the device's total memory free (at least 1 GiB)
#: beside its clones: room for the allocator's fragmentation and the next step's growth
DEVICE_HEADROOM = 0.10


class _Slot:
    """Where a CUDA tensor's host copy goes in a save's state, filled in by :meth:`Staged.wait`."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


@dataclass
class Staged:
    """The copies of one save. :meth:`wait` (the background save calls it) returns the host
    state once every copy has landed; the loop never calls it."""

    #: host mode: events recorded on the loop's streams after the copies into the arena;
    #: device mode: events recorded after the clones
    events: list[Any] = field(default_factory=list)
    #: "host" (copies into the arena enqueued on the loop's stream), "device" (clones on the
    #: device, copied into the arena by :meth:`wait`), or "none" (no CUDA tensor)
    mode: str = "none"
    _finish: Callable[[], Any] | None = None
    _state: Any = None

    def wait(self) -> Any:
        """Block until this save's copies are in host memory; return the host state."""
        for event in self.events:
            event.synchronize()
        self.events.clear()
        if self._finish is not None:
            finish, self._finish = self._finish, None
            self._state = finish()
        return self._state


def _identity(t: Any) -> tuple[Any, ...]:
    """What makes two views the same tensor: storage, offset, shape, strides and dtype."""
    return (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


class _Cuda:
    """The device operations staging needs; tests on machines without CUDA pass a stand-in."""

    @staticmethod
    def holds(t: Any) -> bool:
        return bool(t.is_cuda)

    @staticmethod
    def room(device: Any) -> int:
        """Bytes a save may clone onto ``device`` now (see :data:`DEVICE_HEADROOM`)."""
        free, total = torch.cuda.mem_get_info(device)
        return int(free - max(DEVICE_HEADROOM * total, 1 << 30))

    @staticmethod
    def clone(t: Any) -> Any:
        """A copy of ``t`` on its device, on the current stream."""
        return t.clone()

    @staticmethod
    def record(device: Any) -> Any:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    @staticmethod
    def pinned(nbytes: int) -> Any:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def __init__(self) -> None:
        self._streams: dict[Any, Any] = {}

    def copy_after(self, pairs: list[tuple[Any, Any]], events: list[Any]) -> None:
        """Copy each (host view, device clone) pair on a side stream per device, after
        ``events`` (the clones are complete), and wait for the copies."""
        by_device: dict[Any, list[tuple[Any, Any]]] = {}
        for view, clone in pairs:
            by_device.setdefault(clone.device, []).append((view, clone))
        streams = []
        for device, group in by_device.items():
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device=device)
            for event in events:
                stream.wait_event(event)
            with torch.cuda.stream(stream):
                for view, clone in group:
                    view.copy_(clone, non_blocking=True)
            streams.append(stream)
        for stream in streams:
            stream.synchronize()


class HostStaging:
    """A pinned host arena reused across saves; see the module docstring.

    ``on_device``: whether ``device`` mode may be used (``False``: every copy goes through
    the arena, and a busy caller waits before staging)."""

    def __init__(self, on_device: bool = True, _device: Any = None) -> None:
        self.on_device = on_device
        self._dev = _device if _device is not None else _Cuda()
        self._layout: tuple[tuple[str, tuple[int, ...], Any], ...] = ()
        self._views: list[Any] = []
        #: path -> the CPU tensor's host copy of the last save, reused by the next one
        self._host: dict[str, Any] = {}

    def copy(self, obj: Any) -> tuple[Any, Staged]:
        """The ``host``-mode copy of ``obj`` and its :class:`Staged` (the caller has no save
        running): CUDA tensors land in the pinned arena once the Staged is waited on; CPU
        tensors and everything else are copied now."""
        cuda: dict[tuple[Any, ...], tuple[str, Any]] = {}
        self._collect(obj, "", cuda)
        staged = self._stage_into_arena(obj, cuda)
        return staged._state, staged

    def stage(self, obj: Any, busy: bool) -> Staged | None:
        """Start the copy of ``obj`` (nested dicts, lists and tuples of tensors and plain
        values) for a background save; :meth:`Staged.wait` gives the host copy.

        ``busy``: a previous save is still running (it reads the arena and the reused host
        buffers). Then only ``device`` mode can stage without waiting; None means it cannot
        (no CUDA tensor, no room on the device, or ``on_device`` is off): wait for that
        save, then stage again with ``busy=False``."""
        cuda: dict[tuple[Any, ...], tuple[str, Any]] = {}
        self._collect(obj, "", cuda)
        tensors = list(cuda.values())
        if tensors and (busy or self._layout_of(tensors) != self._layout) and self._fits(tensors):
            staged = self._stage_on_device(obj, cuda, busy)
            if staged is not None:
                return staged
        if busy:  # CPU state too: a queued copy of it would cost the host its size again
            return None
        return self._stage_into_arena(obj, cuda)

    # -- the two ways ------------------------------------------------------------------------
    def _stage_into_arena(self, obj: Any, cuda: dict[tuple[Any, ...], tuple[str, Any]]) -> Staged:
        """``host`` mode: no save is running, so the arena and the reused buffers are free."""
        tensors = list(cuda.values())
        views = self._arena(tensors)
        buffers = dict(zip(cuda, views, strict=True))
        devices: set[Any] = set()
        for (_, t), view in zip(tensors, views, strict=True):
            view.copy_(t, non_blocking=True)
            devices.add(t.device)
        host: dict[str, Any] = {}
        out = self._copy(obj, buffers, {}, "", host, reuse=True)
        self._host = host  # buffers of tensors no longer in the state are dropped
        events = [self._dev.record(device) for device in sorted(devices, key=str)]
        return Staged(events, "host" if devices else "none", None, out)

    def _stage_on_device(self, obj: Any, cuda: dict[tuple[Any, ...], tuple[str, Any]], busy: bool) -> Staged | None:
        """``device`` mode; None when the clones do not fit after all (the device's memory
        went to another process, or a cap such as ``set_per_process_memory_fraction`` that
        ``cudaMemGetInfo`` does not see): the caller then takes the ``host`` way."""
        try:
            clones = [self._dev.clone(t) for _, t in cuda.values()]
        except torch.cuda.OutOfMemoryError:
            return None  # the clones made so far go with this frame
        tensors = [(path, c) for (path, _), c in zip(cuda.values(), clones, strict=True)]  # no live tensor kept
        slots = {key: _Slot(i) for i, key in enumerate(cuda)}
        host: dict[str, Any] = {}
        template = self._copy(obj, slots, {}, "", host, reuse=not busy)
        self._host = {} if busy else host  # a running save still reads the old buffers
        events = [self._dev.record(device) for device in sorted({t.device for t in clones}, key=str)]

        def finish() -> Any:
            # in the background save: the arena (page-locked here, not in the loop's thread),
            # then the clones into it on a side stream; the saves run one at a time, so no
            # other save reads the arena now
            views = self._arena(tensors)
            self._dev.copy_after(list(zip(views, clones, strict=True)), events)
            clones.clear()  # the clones go back to torch's cache now, not with the save
            tensors.clear()
            return _fill(template, views)

        return Staged([], "device", finish)

    def _fits(self, tensors: list[tuple[str, Any]]) -> bool:
        """Whether every device has room for this save's clones (``device`` mode)."""
        if not self.on_device:
            return False
        need: dict[Any, int] = {}
        for _, t in tensors:
            need[t.device] = need.get(t.device, 0) + t.numel() * t.element_size()
        return all(nbytes <= self._dev.room(device) for device, nbytes in need.items())

    # -- pieces ------------------------------------------------------------------------------
    def _collect(self, obj: Any, path: str, cuda: dict[tuple[Any, ...], tuple[str, Any]]) -> None:
        """The distinct CUDA tensors of ``obj``, in traversal order, with their first path."""
        if isinstance(obj, torch.Tensor):
            if self._dev.holds(obj):
                cuda.setdefault(_identity(obj.detach()), (path, obj.detach()))
        elif isinstance(obj, dict):
            for k, v in obj.items():
                self._collect(v, f"{path}/{k}", cuda)
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                self._collect(v, f"{path}/{i}", cuda)

    @staticmethod
    def _layout_of(tensors: list[tuple[str, Any]]) -> tuple[tuple[str, tuple[int, ...], Any], ...]:
        return tuple((path, tuple(t.shape), t.dtype) for path, t in tensors)

    def _arena(self, tensors: list[tuple[str, Any]]) -> list[Any]:
        """A pinned view per tensor: the last save's when the layout is the same, else a
        new arena (the old one is freed with its views)."""
        layout = self._layout_of(tensors)
        if layout != self._layout:
            sizes = [t.numel() * t.element_size() for _, t in tensors]
            starts, total = [], 0
            for size in sizes:
                starts.append(total)
                total += -(-size // ALIGN) * ALIGN
            views = []
            arena = self._dev.pinned(total) if total else None
            for (_, t), start, size in zip(tensors, starts, sizes, strict=True):
                if arena is None or not size:  # an empty tensor: nothing to hold
                    views.append(torch.empty(t.shape, dtype=t.dtype))
                else:
                    views.append(arena[start:start + size].view(t.dtype).view(t.shape))
            self._views, self._layout = views, layout
        return self._views

    def _copy(self, obj: Any, buffers: dict[tuple[Any, ...], Any], seen: dict[tuple[Any, ...], Any], path: str,
              host: dict[str, Any], reuse: bool) -> Any:
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            key = _identity(t)
            if key in buffers:
                return buffers[key]
            if key not in seen:  # the same tensor under another name: one copy, both names
                seen[key] = host[path] = self._host_copy(t, path, reuse)
            return seen[key]
        if isinstance(obj, dict):
            return {k: self._copy(v, buffers, seen, f"{path}/{k}", host, reuse) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._copy(v, buffers, seen, f"{path}/{i}", host, reuse) for i, v in enumerate(obj))
        return copy.deepcopy(obj)

    def _host_copy(self, t: Any, path: str, reuse: bool) -> Any:
        """A CPU tensor's copy: into the last save's buffer for ``path`` when it fits exactly
        and no running save still reads it."""
        old = self._host.get(path) if reuse else None
        if old is not None and not t.is_cuda and old.shape == t.shape and old.dtype == t.dtype \
                and old.stride() == t.stride() and old.data_ptr() != t.data_ptr():
            return old.copy_(t)
        return t.to("cpu", copy=True)


def _fill(template: Any, views: list[Any]) -> Any:
    """``template`` with each :class:`_Slot` replaced by its host view."""
    if isinstance(template, _Slot):
        return views[template.index]
    if isinstance(template, dict):
        return {k: _fill(v, views) for k, v in template.items()}
    if isinstance(template, (list, tuple)):
        return type(template)(_fill(v, views) for v in template)
    return template
