"""The rollout server's HTTP pools and the typed gateway clients over them. Two pools: the watchers' long polls (one
per gateway) get their own, so they never queue ahead of dispatches and health probes, whose short timeouts would
then expire and get live gateways declared dead."""

from __future__ import annotations

import httpx

from polar_gym.gateway.client import GatewayClient
from polar_gym.keepalive import client_limits
from polar_gym.server.fleet import GatewayState

__all__ = ["Links"]


class Links:
    def __init__(self, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self._transport = transport
        self.http: httpx.AsyncClient | None = None
        self.polls: httpx.AsyncClient | None = None

    def open(self) -> None:
        self.http = httpx.AsyncClient(transport=self._transport, timeout=httpx.Timeout(30.0, connect=5.0),
                                      limits=client_limits())
        self.polls = httpx.AsyncClient(transport=self._transport, timeout=httpx.Timeout(30.0, connect=5.0),
                                       limits=client_limits(max_connections=1024, max_keepalive_connections=256))

    async def close(self) -> None:
        for client in (self.http, self.polls):
            if client is not None:
                await client.aclose()

    @property
    def client(self) -> httpx.AsyncClient:
        """The pool for everything but the long polls (callbacks too)."""
        if self.http is None:
            raise RuntimeError("the rollout server is not started")
        return self.http

    def gateway(self, gw: GatewayState) -> GatewayClient:
        """A client of ``gw``'s API with its current URL and token (they change when it registers again)."""
        return GatewayClient(gw.url, gw.row.admin_token, http=self.client, polls=self.polls)
