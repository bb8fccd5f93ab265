"""Playing a RuntimeSpec's prepare actions (exec / upload_file / upload_dir) into a started runtime.

Why here: tasks describe their setup as data so that any backend can prepare them; this is the one interpreter of
that data, used by tests and by anything that starts a runtime for a task.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from polar_gym.runtime.base import ExecResult, Runtime
from polar_gym.schema import PrepareAction

__all__ = ["PrepareError", "run_prepare"]


class PrepareError(RuntimeError):
    """A prepare action failed; ``result`` holds the failing command's result when there was one."""

    def __init__(self, message: str, result: ExecResult | None = None) -> None:
        super().__init__(message)
        self.result = result


async def run_prepare(runtime: Runtime, actions: Sequence[PrepareAction], *, default_timeout: float = 600.0) -> None:
    """Run ``actions`` in order; stop at the first failure with a :class:`PrepareError`."""
    for i, action in enumerate(actions):
        if action.type == "exec":
            assert action.command is not None
            result = await runtime.exec(action.command, timeout=action.timeout_seconds or default_timeout)
            if not result.ok:
                out = (result.stderr or result.stdout).decode(errors="replace")[-2000:]
                raise PrepareError(f"prepare action {i} ({action.command!r}) ended {result.status.value} "
                                   f"(exit {result.exit_code}): {result.reason or out}", result)
        elif action.type == "upload_file":
            assert action.dst is not None
            data: bytes | Path = action.content.encode() if action.content is not None else Path(str(action.src))
            await runtime.upload(data, action.dst)
        else:
            assert action.dst is not None and action.src is not None
            await runtime.upload(Path(action.src), action.dst)
