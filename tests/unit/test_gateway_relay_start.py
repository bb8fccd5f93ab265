"""The host half of the gateway relay when its session is cancelled while it starts (a stale attempt cancelled by
the rollout server): stop() must still close the listening socket, or it stays open in the gateway until GC and
pytest reports it as an unraisable ResourceWarning (CI saw that once)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from polar_gym.runtime.base import GatewayEndpoint
from polar_gym.runtime.relay import GatewayRelay


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_a_start_cancelled_at_its_first_await_leaves_stop_nothing_open(tmp_path: Path) -> None:
    relay = GatewayRelay(tmp_path, GatewayEndpoint("127.0.0.1", 9))
    before = open_fds()
    starting = asyncio.create_task(relay.start())
    await asyncio.sleep(0)  # the start runs to its first suspension, where the cancel lands
    assert not starting.done()
    starting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starting
    await relay.stop()
    assert open_fds() == before
    assert not relay.path.exists()


async def test_a_started_relay_stops_clean(tmp_path: Path) -> None:
    relay = GatewayRelay(tmp_path, GatewayEndpoint("127.0.0.1", 9))
    before = open_fds()
    await relay.start()
    assert relay.path.is_socket() and open_fds() == before + 1
    await relay.stop()
    assert open_fds() == before and not relay.path.exists()
