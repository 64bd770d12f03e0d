"""A fake clock for the lease protocol tests: one time for every actor, sleeping advances it."""

from __future__ import annotations

from inshrink_store import leases


class FakeClock(leases.Clock):
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return 1.7e9 + self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(seconds, 0.01)
