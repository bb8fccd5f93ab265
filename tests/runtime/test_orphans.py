"""A gateway SIGKILLed while its local sandboxes start and stop must leave no sandbox behind.

bwrap alone did: a sandbox's pid 1 arms --die-with-parent only after the outer bwrap has written its uid map, so an
outer bwrap killed before that (by its own --die-with-parent when the gateway died) left pid 1 blocked for good,
reparented to init. Every one of 20 runs of this churn left 3-21 of them; relay.c's watchdog (``-W``) takes them
down. The child below is the gateway's part: several sandboxes, each running commands that a short timeout kills,
so that at any moment some sandboxes are being set up, some run and some are being killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests._procs import processes_with
from tests._waiting import until_sync

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="bubblewrap sandboxes are Linux only")

CHURN = """
import asyncio, sys
from polar_gym.runtime.local import LocalRuntime
from polar_gym.schema import RuntimeSpec

async def main(root, marker):
    runtimes = []
    for i in range(3):
        runtime = LocalRuntime(RuntimeSpec(network="none"), f"{root}/s{i}")
        await runtime.start()
        runtimes.append(runtime)

    async def churn(runtime):
        while True:
            await runtime.exec(f"sleep {marker}", timeout=0.05)

    await asyncio.gather(*(churn(r) for r in runtimes for _ in range(3)))

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def _kill_leftovers(marker: str) -> None:
    for line in processes_with(marker):
        try:
            os.kill(int(line.split(":", 1)[0]), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@pytest.mark.parametrize("round_", range(2))
def test_a_sigkilled_gateway_leaves_no_sandbox(tmp_path: Path, round_: int) -> None:
    marker = f"{3000 + round_}.{uuid.uuid4().int % 10**6:06d}"  # a sleep length no other process has
    script = tmp_path / "churn.py"
    script.write_text(CHURN)
    log = tmp_path / "churn.log"
    with log.open("wb") as out:
        child = subprocess.Popen([sys.executable, str(script), str(tmp_path), marker], stdout=out, stderr=out)
    try:
        # several sandboxes have run their command: the churn is under way
        until_sync(lambda: child.poll() is not None or len(processes_with(f"sleep {marker}")) >= 2,
                   what="the sandboxes to run their commands", interval=0.01)
        assert child.poll() is None, log.read_text()
        child.kill()
        child.wait()
        try:
            until_sync(lambda: not processes_with(marker), timeout=30, what="every sandbox of the killed gateway to go")
        except AssertionError:
            raise AssertionError(f"sandboxes outlived the killed gateway: {processes_with(marker)}") from None
        finally:
            _kill_leftovers(marker)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_the_watchdog_kills_only_its_own_group_never_its_launchers(tmp_path: Path) -> None:
    """A sandbox killed by a signal takes its process group down; the watchdog leads a group of its own, so a caller
    that did not start it in a new session (here a shell) is never in that group."""
    from polar_gym.runtime.relay import build_relay

    relay = build_relay()
    script = f'{relay} -W $$ -- /bin/sh -c "kill -9 \\$\\$"; echo "launcher survived $?"'
    done = subprocess.run(["setsid", "/bin/sh", "-c", script], capture_output=True, text=True, timeout=60)
    assert "launcher survived 137" in done.stdout, (done.stdout, done.stderr)
