"""Starting a child process from a task that may be cancelled at any moment (a session's stage, a run's Ctrl-C).

On Python 3.11, ``asyncio.create_subprocess_exec`` cancelled while the new process's pipes are being connected
closes its transport and then waits for it, and that wait never ends: a subprocess transport wakes its exit waiters
only once every pipe has connected and closed, and the pipes that were still connecting never do. A run stopped
with Ctrl-C then hung for good in a session's sandbox start. :func:`start_process` starts the process in a task of
its own that a cancellation does not reach; a cancelled caller leaves the started process to be killed and reaped.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from typing import Any

__all__ = ["start_process"]

_reaping: set[asyncio.Task[None]] = set()


async def start_process(*argv: str, **kwargs: Any) -> asyncio.subprocess.Process:
    """``asyncio.create_subprocess_exec(*argv, **kwargs)``, safe to cancel: a cancellation while it starts re-raises
    at once, and the process, once started, is killed (its process group with ``start_new_session``) and reaped."""
    starting = asyncio.ensure_future(asyncio.create_subprocess_exec(*argv, **kwargs))
    try:
        return await asyncio.shield(starting)
    except asyncio.CancelledError:
        group = bool(kwargs.get("start_new_session"))
        starting.add_done_callback(lambda task: _kill_started(task, group))
        raise


def _kill_started(task: asyncio.Future[asyncio.subprocess.Process], group: bool) -> None:
    if task.cancelled() or task.exception() is not None:
        return
    proc = task.result()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if group:
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    reaper = asyncio.ensure_future(_reap(proc))
    _reaping.add(reaper)
    reaper.add_done_callback(_reaping.discard)


async def _reap(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(Exception):
        await proc.wait()
