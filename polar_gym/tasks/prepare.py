"""Playing a RuntimeSpec's prepare actions (exec / upload_file / upload_dir) into a started runtime.

Why here: tasks describe their setup as data so that any backend can prepare them; this is the one interpreter of
that data, used by tests and by anything that starts a runtime for a task.

A request is untrusted input, and an ``upload_file`` / ``upload_dir`` with a ``src`` names a *host* path: copying
it into the sandbox is reading the host for whoever wrote the request. So a ``src`` is read only under directories
the caller grants (``roots``; none by default, as the gateway's ``expose_roots``), by the rules of a task's files
(:mod:`polar_gym.tasks.files`: no link out of the root, no FIFO / device / socket, every read bounded).
"""

from __future__ import annotations

import asyncio
import os
import posixpath
from collections.abc import Sequence
from pathlib import Path

from polar_gym.runtime.base import ExecResult, Runtime
from polar_gym.schema import PrepareAction
from polar_gym.tasks.files import TaskFiles

__all__ = ["PrepareError", "host_source", "run_prepare", "upload_host_source"]


class PrepareError(RuntimeError):
    """A prepare action failed; ``result`` holds the failing command's result when there was one."""

    def __init__(self, message: str, result: ExecResult | None = None) -> None:
        super().__init__(message)
        self.result = result


def host_source(src: str, roots: Sequence[Path]) -> tuple[TaskFiles, str]:
    """The reader of the granted root ``src`` lies under and ``src``'s path in it; PrepareError when ``src`` is
    relative or under no root (the path is judged as written: a link is followed by the reader, inside the root
    only)."""
    if not os.path.isabs(src):
        raise PrepareError(f"{src!r}: a prepare action's src must be an absolute host path")
    path = os.path.normpath(src)
    for root in roots:
        top = os.path.normpath(os.path.abspath(root))
        if path == top or path.startswith(top.rstrip("/") + "/"):
            return TaskFiles(Path(top), scope=f"the granted directory {top}"), os.path.relpath(path, top)
    granted = ", ".join(map(str, roots)) or "none"
    raise PrepareError(f"{src}: not under a directory requests may read from (granted: {granted})")


async def upload_host_source(runtime: Runtime, action: PrepareAction, roots: Sequence[Path]) -> None:
    """An upload naming a host ``src``, read by the rules of task files under a granted root (PrepareError when it
    is under none; TaskFileError, a ValueError, for a link out, a FIFO or a file over the caps)."""
    assert action.src is not None and action.dst is not None
    files, rel = host_source(action.src, roots)
    if action.type == "upload_file":
        await runtime.upload(await asyncio.to_thread(files.read_bytes, rel), action.dst)
        return
    base = rel if rel != "." else ""
    for entry in await asyncio.to_thread(files.walk, base):
        if entry.link is None:  # links are not followed, as in a COPY
            data = await asyncio.to_thread(files.read_entry, entry, base)
            await runtime.upload(data, posixpath.join(action.dst, entry.rel))


async def run_prepare(runtime: Runtime, actions: Sequence[PrepareAction], *, default_timeout: float = 600.0,
                      roots: Sequence[Path] = ()) -> None:
    """Run ``actions`` in order; stop at the first failure with a :class:`PrepareError`. An upload's host ``src``
    must lie under one of ``roots`` (:func:`host_source`)."""
    for i, action in enumerate(actions):
        if action.type == "exec":
            assert action.command is not None
            result = await runtime.exec(action.command, timeout=action.timeout_seconds or default_timeout)
            if not result.ok:
                out = (result.stderr or result.stdout).decode(errors="replace")[-2000:]
                raise PrepareError(f"prepare action {i} ({action.command!r}) ended {result.status.value} "
                                   f"(exit {result.exit_code}): {result.reason or out}", result)
        elif action.type == "upload_file" and action.content is not None:
            assert action.dst is not None
            await runtime.upload(action.content.encode(), action.dst)
        else:
            try:
                await upload_host_source(runtime, action, roots)
            except (ValueError, PrepareError) as exc:  # not granted; TaskFileError: a link out, a FIFO, a cap
                raise PrepareError(f"prepare action {i} ({action.type} {action.src}): {exc}") from None
