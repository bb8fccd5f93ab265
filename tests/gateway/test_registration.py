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


async def test_a_gateway_moves_to_the_next_server_worker_when_its_own_stops_answering(tmp_path: Path) -> None:
    """Two server workers (both real apps; a worker that is gone refuses connections): the link leaves its own after
    ``failover_after`` unreachable beats, and the next worker registers it."""
    workers = {name: RolloutServer(Store(tmp_path / f"{name}.sqlite"), worker=name) for name in ("w1", "w2")}
    apps = {name: httpx.ASGITransport(app=create_server_app(server, TOKEN, manage_lifecycle=False))
            for name, server in workers.items()}
    gone: set[str] = set()
    tried: list[str] = []

    async def route(request: httpx.Request) -> httpx.Response:
        tried.append(request.url.host)
        if request.url.host in gone:
            raise httpx.ConnectError("refused", request=request)
        return await apps[request.url.host].handle_async_request(request)

    link = ServerLink("http://w1, http://w2", "http://gw:1", 2, server_token=TOKEN, gateway_token=None,
                      health=dict, interval=0.001, transport=httpx.MockTransport(route), failover_after=2)
    task = asyncio.create_task(link.run())
    try:
        await until(lambda: link.heartbeats >= 1, what="registered with w1")
        first = link.gateway_id
        assert link.server_url == "http://w1" and first in workers["w1"].fleet.gateways
        gone.add("w1")
        # registered there (the heartbeat count alone was already past 2 from w1: on a loaded machine the check ran
        # between the failover and the new registration)
        await until(lambda: link.server_url == "http://w2" and link.gateway_id in workers["w2"].fleet.gateways,
                    what="moved to w2 and registered there")
        moved = tried.index("w2")
        assert tried[moved - 2:moved] == ["w1", "w1"]  # two unanswered beats, then the next worker
        assert link.gateway_id in workers["w2"].fleet.gateways
        assert workers["w2"].fleet.gateways[link.gateway_id or ""].row.owner == "w2"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await link.drain_and_close()
        for server in workers.values():
            await server.stop()
            server.store.close()
