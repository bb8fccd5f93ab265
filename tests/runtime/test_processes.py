"""polar_gym.runtime.processes.start_process: a caller cancelled while its process starts gets CancelledError at
once, and the process it asked for does not outlive it (killed with its group, reaped)."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from polar_gym.runtime.processes import start_process
from tests._procs import processes_with
from tests._waiting import until


async def test_a_cancelled_start_leaves_no_process() -> None:
    marker = f"polarproc{uuid.uuid4().hex[:10]}"
    for turns in range(6):  # cancelled at different points of the start
        starting = asyncio.create_task(start_process(
            "sh", "-c", "sleep 60", stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True, env={"MARKER": marker, "PATH": "/usr/bin:/bin"}))
        for _ in range(turns):
            await asyncio.sleep(0)
        starting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(starting, 30)
    await until(lambda: not processes_with(marker), timeout=30, what="the started processes to be killed")


async def test_a_start_that_is_not_cancelled_is_the_process() -> None:
    proc = await start_process("sh", "-c", "echo hi", stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    assert out == b"hi\n" and proc.returncode == 0
