"""Where the trainer's compute runs: one worker thread, optionally pinned to CPUs of its own.

On a cluster the trainer has its own GPUs. On a CPU-only machine (the reference trainer here, TRL on CPU) the
trainer, the sessions' sandboxes and harnesses, and an in-process fleet all compete for the same cores, and an
asynchronous step that trains while sessions run loses its overlap to that contention. ``trainer.cpus`` gives the
torch work, and only it, its own cores: the fleet on the event loop and the sessions it starts keep the process's
affinity. Linux affinity is per thread, so the worker pins itself when it starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

__all__ = ["CPU_LIST_PATTERN", "TrainerWorker", "parse_cpu_list", "pinned"]

#: a Linux CPU list as taskset and cpuset take it: ``1``, ``0-3``, ``0,2-3``
CPU_LIST_PATTERN = r"^\d+(-\d+)?(,\d+(-\d+)?)*$"

P = ParamSpec("P")
T = TypeVar("T")


def parse_cpu_list(cpus: str) -> frozenset[int]:
    """``"0,2-3"`` -> {0, 2, 3}; a malformed list or a range that runs backwards is a ValueError."""
    if not re.fullmatch(CPU_LIST_PATTERN, cpus):
        raise ValueError(f"not a CPU list (like 1, 0-3 or 0,2-3): {cpus!r}")
    found: set[int] = set()
    for part in cpus.split(","):
        low, _, high = part.partition("-")
        first, last = int(low), int(high or low)
        if last < first:
            raise ValueError(f"CPU range {part!r} runs backwards")
        found.update(range(first, last + 1))
    return frozenset(found)


def _pin_this_thread(cpus: frozenset[int]) -> None:
    try:
        os.sched_setaffinity(0, cpus)  # pid 0 on Linux: the calling thread only
    except OSError as error:
        raise ValueError(f"trainer.cpus {','.join(map(str, sorted(cpus)))} cannot be used here (this machine's "
                         f"CPUs are 0-{(os.cpu_count() or 1) - 1}, a cpuset may allow fewer): {error}") from None


@contextlib.contextmanager
def pinned(cpus: str | None) -> Iterator[None]:
    """The calling thread on ``cpus`` while the block runs (``None``: unchanged), then back where it was."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    _pin_this_thread(parse_cpu_list(cpus))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


class TrainerWorker:
    """One thread for every torch call of a run (so they never overlap), pinned to ``cpus`` when given. A CPU list
    this machine cannot give fails here, before a session is started."""

    def __init__(self, cpus: str | None = None) -> None:
        self.cpus = parse_cpu_list(cpus) if cpus is not None else None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="polar-trainer")
        if self.cpus is not None:
            try:
                self._pool.submit(_pin_this_thread, self.cpus).result()
            except BaseException:
                self._pool.shutdown(wait=False)
                raise

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """``fn(*args, **kwargs)`` on the worker thread, awaited from the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        """No new work; a step already running finishes on its thread (torch cannot be interrupted)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
