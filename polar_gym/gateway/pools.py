"""Slot pools and the stage metrics they feed.

:class:`Pool` is a FIFO counting semaphore that also says how many holders and waiters it has (the health endpoint's
"slots busy" and "queue depth"); a released slot is handed straight to the oldest waiter, so no newcomer can overtake
a session that has waited longer. :class:`UtilizationTracker` integrates busy run slots over time, overall and over
the intervals when work was queued (the benchmark's target: run slots busy >= 90 % whenever work is queued).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LatencyStats", "Pool", "UtilizationTracker"]


class Pool:
    """``capacity`` slots; ``await acquire()`` waits FIFO, ``release()`` hands the slot to the next waiter."""

    def __init__(self, name: str, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.name = name
        self.capacity = capacity
        self.busy = 0
        self.peak_busy = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def waiting(self) -> int:
        return sum(1 for w in self._waiters if not w.done())

    async def acquire(self) -> None:
        if self.busy < self.capacity and not self._waiters:
            self._take()
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # the slot was handed over just as we were cancelled: pass it on
            elif waiter in self._waiters:  # release() may have dropped it already
                self._waiters.remove(waiter)
            raise

    def _take(self) -> None:
        self.busy += 1
        self.peak_busy = max(self.peak_busy, self.busy)

    def release(self) -> None:
        if self.busy > self.capacity:  # shrunk while held: the slot goes away instead of passing on
            self.busy -= 1
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes on; busy stays the same
                return
        self.busy -= 1

    def resize(self, capacity: int) -> None:
        """A new capacity. Growing hands the new slots to waiters at once; shrinking takes no slot from a holder,
        the surplus disappears as holders release."""
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        while self.busy < self.capacity and self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self._take()
                waiter.set_result(None)

    def snapshot(self) -> dict[str, int]:
        return {"capacity": self.capacity, "busy": self.busy, "waiting": self.waiting, "peak_busy": self.peak_busy}


@dataclass
class LatencyStats:
    """Running mean and max per stage name."""

    count: dict[str, int] = field(default_factory=dict)
    total: dict[str, float] = field(default_factory=dict)
    peak: dict[str, float] = field(default_factory=dict)

    def add(self, stage: str, seconds: float) -> None:
        self.count[stage] = self.count.get(stage, 0) + 1
        self.total[stage] = self.total.get(stage, 0.0) + seconds
        self.peak[stage] = max(self.peak.get(stage, 0.0), seconds)

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {stage: {"count": n, "mean": self.total[stage] / n, "max": self.peak[stage]}
                for stage, n in sorted(self.count.items())}


class UtilizationTracker:
    """Integrates ``running`` (harnesses executing) against ``slots``; ``pending`` counts sessions dispatched but not
    yet running. ``while_queued`` is busy-slot time over slot time, restricted to when ``pending > 0``."""

    def __init__(self, slots: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.slots = slots
        self.clock = clock
        self.running = 0
        self.pending = 0
        self._last = clock()
        self._start: float | None = None
        self.busy_seconds = 0.0
        self.elapsed = 0.0
        self.busy_queued_seconds = 0.0
        self.queued_seconds = 0.0

    def _advance(self) -> None:
        now = self.clock()
        dt = now - self._last
        self._last = now
        if self._start is None:
            return
        self.elapsed += dt
        self.busy_seconds += dt * self.running
        if self.pending > 0:
            self.queued_seconds += dt
            self.busy_queued_seconds += dt * self.running

    def change(self, running: int = 0, pending: int = 0) -> None:
        self._advance()
        if self._start is None:
            self._start = self._last
        self.running += running
        self.pending += pending

    def snapshot(self) -> dict[str, Any]:
        self._advance()
        overall = self.busy_seconds / (self.slots * self.elapsed) if self.elapsed > 0 else 0.0
        queued = self.busy_queued_seconds / (self.slots * self.queued_seconds) if self.queued_seconds > 0 else None
        return {"slots": self.slots, "running": self.running, "pending": self.pending, "overall": overall,
                "while_queued": queued, "elapsed_seconds": self.elapsed, "queued_seconds": self.queued_seconds}
