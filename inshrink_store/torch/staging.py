"""Copies of the training state for a background save, without holding the loop.
Layer: torch clients (beside the Checkpointer, which is its one user).

A save must copy the state before the loop's next step changes it. For CPU tensors that is
a plain copy. For CUDA tensors a blocking ``.to("cpu")`` per tensor waits for each transfer
(GPT-2 124 M: 2 to 10 s of the loop per save, most of it pageable-memory copies and a
synchronisation per tensor). :class:`HostStaging` instead:

- keeps **reusable pinned host buffers**, one per tensor of the state (matched by path,
  shape and dtype; allocated at the first save, reused by every later one), so a copy runs
  at the bus's speed and no save allocates page-locked memory again;
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


class HostStaging:
    """Pinned host buffers reused across saves; see the module docstring."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, tuple[int, ...], Any], Any] = {}

    def copy(self, obj: Any) -> tuple[Any, Staged]:
        """A copy of ``obj`` (nested dicts, lists and tuples of tensors and plain values)
        whose CUDA tensors land in pinned buffers once the returned :class:`Staged` is waited
        on; CPU tensors and everything else are copied now."""
        used: dict[tuple[str, tuple[int, ...], Any], Any] = {}
        seen: dict[tuple[Any, ...], Any] = {}
        devices: set[Any] = set()
        out = self._copy(obj, "", used, seen, devices)
        self._buffers = used  # buffers of tensors gone from the state are released
        staged = Staged()
        for device in sorted(devices, key=str):
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            staged.events.append(event)
        return out, staged

    def _copy(self, obj: Any, path: str, used: dict[tuple[str, tuple[int, ...], Any], Any],
              seen: dict[tuple[Any, ...], Any], devices: set[Any]) -> Any:
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            key = _identity(t)
            if key in seen:  # the same tensor under another name: one copy, both names
                return seen[key]
            if t.is_cuda:
                slot = (path, tuple(t.shape), t.dtype)
                buf = self._buffers.get(slot)
                if buf is None:
                    buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                used[slot] = buf
                buf.copy_(t, non_blocking=True)
                devices.add(t.device)
            else:
                buf = t.to("cpu", copy=True)
            seen[key] = buf
            return buf
        if isinstance(obj, dict):
            return {k: self._copy(v, f"{path}/{k}", used, seen, devices) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._copy(v, f"{path}/{i}", used, seen, devices) for i, v in enumerate(obj))
        return copy.deepcopy(obj)
