"""Freed memory back to the operating system once sessions end.

What the proxy keeps for a live session (its conversation and its last prompt token IDs, parsed once: see
:mod:`polar_gym.known_json`) is freed when the session ends or goes idle, but glibc's allocator keeps the freed pages
for itself: after many sessions the process's resident memory stays at the peak of what was live at once. Measured
with the standalone proxy (``benchmarks/bench_proxy.py``'s memory cells): 87 MB with 385 sessions live, still 87 MB
once all were idle, 63 MB after ``malloc_trim(0)``. :class:`HeapTrimmer` calls it after sessions end, at most once an
``interval``: a trim takes well under a millisecond on a tidy heap and ~13 ms on a heap of 100 MB in small holes.
Off glibc (musl, macOS) it does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import math
import time
from collections.abc import Callable

__all__ = ["HeapTrimmer"]


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    try:
        trim: Callable[[int], int] = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        return trim
    except (OSError, AttributeError):
        return None


class HeapTrimmer:
    """Gives freed heap pages back to the OS after :meth:`released`, on the event loop's next turn, and then at most
    once every ``interval`` seconds (a release in between is trimmed for when the interval ends)."""

    def __init__(self, interval: float = 1.0, *, trim: Callable[[int], int] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.clock = clock
        self._trim = trim if trim is not None else _malloc_trim()
        self._last = -math.inf
        self._scheduled = False
        #: trims done (for tests and benchmarks)
        self.trims = 0

    def released(self) -> None:
        """Something a session kept was freed: trim soon."""
        if self._trim is None or self._scheduled:
            return
        delay = max(0.0, self._last + self.interval - self.clock())
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a caller outside the service): trim now if due, else leave it
            if delay == 0.0:
                self._run()
            return
        self._scheduled = True
        loop.call_later(delay, self._run)

    def _run(self) -> None:
        self._scheduled = False
        self._last = self.clock()
        assert self._trim is not None
        self._trim(0)
        self.trims += 1
