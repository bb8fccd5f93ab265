"""A gateway's link to its rollout server: register once it serves, push its stage metrics as heartbeats, register
again when the server forgot it (a restarted server with a fresh db, or one that declared it dead), and ask to be
drained on a graceful shutdown. Why push and not only be probed: a gateway behind NAT or a busy health route still
shows up, and the server learns the stage metrics without polling every node.

Several server workers (one PostgreSQL store): the link is given their URLs, its own worker first. When that one
stops answering for ``failover_after`` heartbeats in a row, the link registers with the next; that worker takes the
gateway over with the sessions it runs (polar_gym.server.core: ``register``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx

from polar_gym.keepalive import client_limits
from polar_gym.schema import GatewayHealth, GatewayRegistration, GatewayView

__all__ = ["ServerLink"]

log = logging.getLogger(__name__)
_JSON = {"content-type": "application/json"}


class ServerLink:
    """Keeps one gateway registered with one rollout server (worker) while :meth:`run` runs."""

    def __init__(self, server_url: str | Sequence[str], gateway_url: str, capacity: int, *, server_token: str,
                 gateway_token: str | None, health: Callable[[], Mapping[str, Any]], interval: float = 2.0,
                 transport: httpx.AsyncBaseTransport | None = None, failover_after: int = 3) -> None:
        #: the server workers this gateway may register with, its own first (a comma-separated string too)
        self.servers = [u.strip().rstrip("/") for u in
                        (server_url.split(",") if isinstance(server_url, str) else server_url) if u.strip()]
        if not self.servers:
            raise ValueError("no rollout server URL")
        self.server_url = self.servers[0]
        self.failover_after = failover_after
        self.gateway_url, self.capacity = gateway_url.rstrip("/"), capacity
        self.gateway_token, self.health, self.interval = gateway_token, health, interval
        self.http = httpx.AsyncClient(base_url=self.server_url, headers={"x-admin-token": server_token},
                                      transport=transport, timeout=httpx.Timeout(30.0, connect=5.0),
                                      limits=client_limits())
        self.gateway_id: str | None = None
        self.registered = asyncio.Event()
        self.registrations = 0
        self.heartbeats = 0
        self._task: asyncio.Task[None] | None = None

    async def register(self) -> str:
        body = GatewayRegistration(url=self.gateway_url, capacity=self.capacity, admin_token=self.gateway_token)
        resp = await self.http.post("/gateways/register", content=body.model_dump_json(), headers=_JSON)
        resp.raise_for_status()
        self.gateway_id = GatewayView.model_validate_json(resp.content).gateway_id
        self.registrations += 1
        self.registered.set()
        log.info("registered with %s as %s", self.server_url, self.gateway_id)
        return self.gateway_id

    async def beat(self) -> None:
        """One heartbeat; a server that does not know this gateway (404, 410) gets a new registration."""
        if self.gateway_id is None:
            await self.register()
            return
        view = GatewayHealth.model_validate(self.health())
        if view.dispatch_capacity is not None:  # a self-sizing node's: what a registration after a restart says
            self.capacity = view.dispatch_capacity
        health = view.model_dump_json(exclude_unset=True)  # as the node said
        resp = await self.http.post(f"/gateways/{self.gateway_id}/heartbeat", content=health, headers=_JSON)
        if resp.status_code in (404, 410):
            log.warning("the rollout server answered %d to a heartbeat: registering again", resp.status_code)
            self.gateway_id = None
            await self.register()
            return
        resp.raise_for_status()
        self.heartbeats += 1

    def fail_over(self) -> None:
        """Register with the next server worker from now on (its own worker stopped answering)."""
        at = self.servers.index(self.server_url)
        self.server_url = self.servers[(at + 1) % len(self.servers)]
        self.http.base_url = httpx.URL(self.server_url)
        self.gateway_id = None  # the next beat registers there
        log.warning("rollout server worker did not answer: registering with %s", self.server_url)

    async def run(self) -> None:
        """Heartbeat until cancelled; errors are logged and retried (the server may start after the gateway). With
        several server workers, a worker unreachable ``failover_after`` times in a row is left for the next."""
        failures, unreachable = 0, 0
        while True:
            try:
                await self.beat()
                failures, unreachable = 0, 0
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                failures += 1
                unreachable = unreachable + 1 if isinstance(exc, httpx.TransportError) else 0
                if len(self.servers) > 1 and unreachable >= self.failover_after:
                    self.fail_over()
                    failures, unreachable = 0, 0
                    continue
                if isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code in (401, 403):
                    why = "refused this gateway's server token (--server-token / POLAR_SERVER_TOKEN)"
                else:
                    why = f"could not be reached: {exc!r}"
                if failures in (1, 10) or failures % 100 == 0:
                    log.warning("rollout server %s %s (%d tries)", self.server_url, why, failures)
            await asyncio.sleep(self.interval if failures == 0 else min(self.interval * failures, 10.0))

    def start(self) -> None:
        """Run :meth:`run` in the background (once the gateway listens); :meth:`drain_and_close` stops it."""
        if self._task is None:
            self._task = asyncio.create_task(self.run())

    async def drain_and_close(self) -> None:
        """Stop heartbeating, tell the server this gateway leaves (best effort: it is gone at once, not after missed
        heartbeats), close the client."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.gateway_id is not None:
            with contextlib.suppress(httpx.HTTPError):
                await self.http.post(f"/gateways/{self.gateway_id}/drain", json={"leaving": True}, timeout=5.0)
        await self.http.aclose()
