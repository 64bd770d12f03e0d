"""A stand-in for CUDA in staging tests on machines without a GPU (``HostStaging(_device=...)``).

Floating-point tensors play the device's tensors: "cloned on the device" at the save, copied
into the "pinned" arena by the background save; the test sets the room left for clones."""

from __future__ import annotations

from typing import Any

import torch


class FakeDevice:
    """A stand-in for CUDA on a CPU machine: floating-point tensors play the device's tensors
    (cloned "on the device", copied into the "pinned" arena by the background save), with
    ``room`` bytes free for clones."""

    def __init__(self, room: int = 1 << 40, clones_fail: bool = False) -> None:
        self.room_bytes = room
        self.clones_fail = clones_fail  # a clone raises out-of-memory (memory the room check missed)
        self.arenas = 0  # arenas allocated
        self.copied_after: list[int] = []  # pairs copied by each background copy

    @staticmethod
    def holds(t: Any) -> bool:
        return t.is_floating_point()

    def clone(self, t: Any) -> Any:
        if self.clones_fail:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (stand-in)")
        return t.clone()

    def room(self, device: Any) -> int:
        return self.room_bytes

    @staticmethod
    def record(device: Any) -> Any:
        class Event:
            def synchronize(self) -> None:
                pass

        return Event()

    def pinned(self, nbytes: int) -> Any:
        self.arenas += 1
        return torch.empty(nbytes, dtype=torch.uint8)

    def copy_after(self, pairs: list[tuple[Any, Any]], events: list[Any]) -> None:
        self.copied_after.append(len(pairs))
        for view, clone in pairs:
            view.copy_(clone)

