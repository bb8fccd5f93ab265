"""ServerLink against the real rollout server app: a gateway registers itself, its heartbeats carry its stage
metrics, it registers again when the server forgot it (declared dead, or a fresh store), and drains on the way out."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx

from polar_gym.gateway.registration import ServerLink
from polar_gym.server import RolloutServer, Store, create_server_app
from tests._waiting import until

TOKEN = "server-token"


def _link(app: Any, health: dict[str, Any]) -> ServerLink:
    return ServerLink("http://server", "http://gw-host:8100/", 6, server_token=TOKEN, gateway_token="gw-token",
                      health=lambda: health, interval=0.01, transport=httpx.ASGITransport(app=app))


async def test_registers_heartbeats_and_reregisters_when_forgotten(tmp_path: Path) -> None:
    store = Store(tmp_path / "a.sqlite")
    server = RolloutServer(store)
    app = create_server_app(server, TOKEN, manage_lifecycle=False)
    health = {"stages": {"run": 2}, "live_sessions": 2}
    link = _link(app, health)
    try:
        await link.beat()  # the first beat registers
        gw = server.fleet.gateways[link.gateway_id or ""]
        assert (gw.url, gw.row.capacity, gw.row.admin_token, gw.row.state) == ("http://gw-host:8100", 6, "gw-token",
                                                                              "healthy")
        await link.beat()
        assert gw.health == health and link.heartbeats == 1
        first = link.gateway_id

        await server.watching.declare_dead(gw)  # missed heartbeats: the server answers 410 and the link registers again
        assert gw.row.state == "dead"
        await link.beat()
        assert link.registrations == 2 and server.fleet.gateways[link.gateway_id or ""].row.state == "healthy"
        assert link.gateway_id == first  # the same URL keeps its id

        await link.drain_and_close()  # a gateway that stops leaves the fleet at once, not after missed heartbeats
        assert server.fleet.gateways[first or ""].row.state == "dead"
        assert [g.state for g in await store.gateways()] == ["dead"]  # a server restarted on the store knows it
    finally:
        store.close()


async def test_a_restarted_server_with_a_fresh_store_gets_a_new_registration(tmp_path: Path) -> None:
    stores = [Store(tmp_path / "old.sqlite"), Store(tmp_path / "new.sqlite")]
    old, new = (RolloutServer(s) for s in stores)
    before = _link(create_server_app(old, TOKEN, manage_lifecycle=False), {})
    after = _link(create_server_app(new, TOKEN, manage_lifecycle=False), {})
    try:
        after.gateway_id = await before.register()  # the id the gateway knew before the server lost its store
        await after.beat()  # 404 from the new server: register there
        assert after.registrations == 1 and after.heartbeats == 0
        assert [g.url for g in new.fleet.gateways.values()] == ["http://gw-host:8100"]
        await after.beat()
        assert after.heartbeats == 1
    finally:
        await before.http.aclose()
        await after.http.aclose()
        for store in stores:
            store.close()


async def test_run_keeps_retrying_an_unreachable_server(tmp_path: Path) -> None:
    calls = 0

    def refuse(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        raise httpx.ConnectError("refused", request=request)

    link = ServerLink("http://server", "http://gw:1", 1, server_token=TOKEN, gateway_token=None, health=dict,
                      interval=0.001, transport=httpx.MockTransport(refuse))
    task = asyncio.create_task(link.run())
    await until(lambda: calls >= 3 or task.done(), what="three connection attempts")
    assert not task.done()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert link.gateway_id is None and not link.registered.is_set()
    await link.drain_and_close()
