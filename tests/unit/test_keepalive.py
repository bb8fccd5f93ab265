"""Our httpx clients let an idle connection go before a uvicorn server closes it (polar_gym.keepalive): a client that
reused a connection idle for the server's whole keep-alive could send into its close (httpx.ReadError, seen when a
trainer polled the rollout server between training steps on a loaded machine)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import uvicorn

from polar_gym.keepalive import CLIENT_KEEP_ALIVE_SECONDS, SERVER_KEEP_ALIVE_SECONDS
from polar_gym.server.client import RolloutClient
from polar_gym.serving import free_port, serving

pytestmark = pytest.mark.asyncio


async def test_a_connection_idle_past_the_clients_expiry_is_not_reused_and_the_server_keeps_its_own() -> None:
    client_ports: list[int] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        client_ports.append(scope["client"][1])  # a new port: a new connection
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})

    assert uvicorn.Config(app).timeout_keep_alive == SERVER_KEEP_ALIVE_SECONDS > CLIENT_KEEP_ALIVE_SECONDS
    async with serving(app, "127.0.0.1", free_port()) as url, RolloutClient(url, "token") as client:
        for path in ("/one", "/two"):
            (await client.http.get(path)).raise_for_status()
        await asyncio.sleep(CLIENT_KEEP_ALIVE_SECONDS + 0.5)  # idle past the client's expiry, within the server's
        (await client.http.get("/three")).raise_for_status()
    first, second, third = client_ports
    assert first == second, "back-to-back calls share a kept-alive connection"
    assert third != second, "a connection idle past the client's expiry is let go, not raced against the server"
