"""The gateways the rollout server dispatches to: their capacity, liveness and load. Why its own module: choosing
a gateway (least loaded among the healthy, accepting ones) is a pure decision that tests read without HTTP."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from polar_gym.schema import GatewayRegistration, GatewayView
from polar_gym.server.store import GatewayRow

__all__ = ["DEAD", "DRAINING", "HEALTHY", "Fleet", "GatewayRegistration", "GatewayState"]

HEALTHY, DRAINING, DEAD = "healthy", "draining", "dead"


@dataclass
class GatewayState:
    row: GatewayRow
    last_seen: float = field(default_factory=time.monotonic)
    health: dict[str, Any] = field(default_factory=dict)
    #: session ids this server has handed to the gateway and not seen finish
    sessions: set[str] = field(default_factory=set)
    #: a dispatch could not connect: skipped until the next health answer
    suspect: bool = False
    #: session id -> the attempt id the gateway answered when it accepted the session (its result must carry it)
    attempts: dict[str, str] = field(default_factory=dict)
    #: sessions this server gave up here (declared lost) whose attempt the gateway may still hold: their late
    #: results are refused, and they go to another gateway when one has a free slot
    stale: set[str] = field(default_factory=set)
    #: sessions whose POST to the gateway has not answered yet: not polled (the gateway would call them unknown, and
    #: the session would be lost and dispatched a second time)
    posting: set[str] = field(default_factory=set)
    #: sessions being withdrawn (a draining hand-over): a CANCELLED result of one is its withdrawn attempt's
    withdrawing: set[str] = field(default_factory=set)
    #: another server worker took the gateway over (it registered there): this one's watcher stops
    released: bool = False
    #: the batch watcher of this gateway's sessions (polar_gym.server.watching) and its wake-up
    watcher: asyncio.Task[None] | None = field(default=None, repr=False)
    added: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    @property
    def gateway_id(self) -> str:
        return self.row.gateway_id

    @property
    def url(self) -> str:
        return self.row.url.rstrip("/")

    @property
    def headers(self) -> dict[str, str]:
        return {"x-admin-token": self.row.admin_token} if self.row.admin_token else {}

    @property
    def load(self) -> float:
        return len(self.sessions) / self.row.capacity

    def view(self) -> GatewayView:
        """What the server's gateway routes answer (the wire type the gateway's ServerLink reads)."""
        return GatewayView(gateway_id=self.gateway_id, url=self.url, capacity=self.row.capacity,
                           state=self.row.state, suspect=self.suspect, in_flight=len(self.sessions), load=self.load,
                           seconds_since_heartbeat=time.monotonic() - self.last_seen, health=self.health,
                           worker=self.row.owner)

    def describe(self) -> dict[str, Any]:
        return self.view().model_dump(mode="json")


class Fleet:
    """In-memory view of the gateways; the store keeps the registrations across restarts."""

    def __init__(self) -> None:
        self.gateways: dict[str, GatewayState] = {}

    def register(self, reg: GatewayRegistration) -> GatewayState:
        """Registering a known URL again refreshes it (a restarted gateway comes back healthy)."""
        url = reg.url.rstrip("/")
        for gw in self.gateways.values():
            if gw.url == url:
                gw.row.capacity, gw.row.admin_token, gw.row.state = reg.capacity, reg.admin_token, HEALTHY
                gw.last_seen = time.monotonic()
                return gw
        gw = GatewayState(GatewayRow(f"gw-{uuid.uuid4().hex[:10]}", url, reg.capacity, reg.admin_token, HEALTHY))
        self.gateways[gw.gateway_id] = gw
        return gw

    def by_url(self, url: str) -> GatewayState | None:
        return next((gw for gw in self.gateways.values() if gw.url == url.rstrip("/")), None)

    def release(self, gw: GatewayState) -> None:
        """Forget a gateway another server worker took over; its watcher ends after the poll it is in."""
        self.gateways.pop(gw.gateway_id, None)
        gw.released = True
        gw.added.set()

    def restore(self, row: GatewayRow) -> GatewayState:
        gw = GatewayState(row)
        self.gateways[row.gateway_id] = gw
        return gw

    def live(self) -> list[GatewayState]:
        return [g for g in self.gateways.values() if g.row.state != DEAD]

    def pick(self, session_id: str | None = None) -> GatewayState | None:
        """The least-loaded healthy gateway with a free slot (ties go to the larger capacity); for a session given
        up on some gateway, one that does not hold its stale attempt if any is free."""
        free = [g for g in self.gateways.values()
                if g.row.state == HEALTHY and not g.suspect and len(g.sessions) < g.row.capacity]
        if not free:
            return None
        fresh = [g for g in free if session_id not in g.stale] if session_id is not None else free
        return min(fresh or free, key=lambda g: (g.load, -g.row.capacity, g.gateway_id))

    def owner(self, session_id: str) -> GatewayState | None:
        for gw in self.gateways.values():
            if session_id in gw.sessions:
                return gw
        return None
