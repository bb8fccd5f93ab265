"""The rollout server: the facade the HTTP API and tests call. Its collaborators each own one concern: ``tasks``
(expanding a request, a task's view), ``dispatch`` (placing waiting sessions on gateways), ``watching`` (results,
health probes, gateway death), ``ledger`` (recording every session state change and who hears of it), ``callbacks``
(delivery with retries), ``links`` (the HTTP pools and typed gateway clients). State lives in the Store, so every
step is resumable after a restart; in-memory maps are only caches of who runs what."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from typing import Any

import httpx
import orjson
from pydantic import BaseModel

from polar_gym.gateway.client import GatewayClient
from polar_gym.gateway.errors import GatewayBadReply, GatewayCallError, GatewayRefused, GatewayUnreachable
from polar_gym.httpguard import check_upstream_url
from polar_gym.schema import GatewayRegistration, ResumeRequest, SessionStatus, TaskRequest
from polar_gym.server.background import Background
from polar_gym.server.callbacks import Callbacks, ResultRetention
from polar_gym.server.counters import ServerCounters
from polar_gym.server.dispatch import Dispatcher
from polar_gym.server.errors import ServerError
from polar_gym.server.fleet import DEAD, DRAINING, HEALTHY, Fleet, GatewayState
from polar_gym.server.ledger import Ledger, ended_as
from polar_gym.server.links import Links
from polar_gym.server.store import SessionRow, Store
from polar_gym.server.tasks import expand, task_view
from polar_gym.server.watching import Watching

__all__ = ["RolloutServer", "ServerError", "admin_call"]

log = logging.getLogger(__name__)
S = SessionStatus

#: one admin call to one gateway's proxy (its answer is reported by gateway id)
AdminCall = Callable[[GatewayClient], Awaitable[BaseModel]]
FANOUT_TIMEOUT = 120.0


class RolloutServer:
    def __init__(self, store: Store, *, heartbeat_interval: float = 2.0, dead_after: float = 10.0,
                 max_attempts: int = 3, result_wait: float = 2.0, callback_attempts: int = 8,
                 callback_backoff: float = 0.5, max_samples: int = 4096, max_task_bytes: int = 256 * 1024 * 1024,
                 weight_servers: Collection[str] = (), transport: httpx.AsyncBaseTransport | None = None,
                 result_retention: ResultRetention = "keep", worker: str = "main") -> None:
        self.store = store
        #: this server worker's name. Workers share a PostgreSQL store; each watches and dispatches to the gateways
        #: that registered with it, and any of them takes tasks and fleet-wide calls.
        self.worker = worker
        self._stop_listening: Callable[[], None] = lambda: None
        #: inference servers a weight update's ``servers`` may name besides the fleet's own (polar_gym.server.weights)
        self.weight_servers = [check_upstream_url(url).rstrip("/") for url in weight_servers]
        #: bounds of one task: sessions, and bytes stored for it (its request times its sessions)
        self.max_samples, self.max_task_bytes = max_samples, max_task_bytes
        self.fleet = Fleet()
        self.counters = ServerCounters()
        #: the LLM backends every gateway's proxy is told about (a new gateway gets them on registering)
        self.backends: list[str] = []
        #: the policy version the fleet's last weight update stamped (a gateway registering later resumes under it)
        self.policy_version: int | str | None = None
        self.weights_lock = asyncio.Lock()  # one fleet weight update at a time
        self.links = Links(transport)
        self.background = Background()
        self.callbacks = Callbacks(store, self.counters, self.background, lambda: self.links.client,
                                   attempts=callback_attempts, backoff=callback_backoff, retention=result_retention)
        self.ledger = Ledger(store, self.counters, self.callbacks, max_attempts=max_attempts, worker=worker)
        self.watching = Watching(store, self.fleet, self.counters, self.ledger, self.links, self.background,
                                 heartbeat_interval=heartbeat_interval, dead_after=dead_after,
                                 result_wait=result_wait)
        self.dispatcher = Dispatcher(store, self.fleet, self.counters, self.ledger, self.links, self.watching)
        #: held while a registration adopts a gateway and while the store's owners are followed: between reading a
        #: gateway another worker had and storing it as this one's, the store still names that worker, and following
        #: it then would let go of the gateway being adopted
        self._gateways_changing = asyncio.Lock()

    # -- lifecycle -------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Reload gateways and in-flight sessions from the store, then run the loops."""
        self.links.open()
        others: set[str] = set()  # live gateways of other workers: theirs to watch
        for gateway in await self.store.gateways():
            if gateway.owner in (None, self.worker):
                restored = self.fleet.restore(gateway)  # heartbeat clock restarts now: each gets dead_after to answer
                restored.stale.update(await self.store.given_up_on(gateway.gateway_id))
            elif gateway.state != DEAD:
                others.add(gateway.gateway_id)
        await self.recall_fleet()
        for row in await self.store.in_flight():
            gw = self.fleet.gateways.get(row.gateway_id or "")
            if row.gateway_id in others:
                continue
            if row.status.terminal:  # unreadable, now quarantined
                await self.ledger.ended(row.task_id, row.session_id, row.status, row.reason)
            elif gw is None or gw.row.state == DEAD:
                await self.ledger.lost(row, "its gateway is gone after a server restart")
            else:
                gw.sessions.add(row.session_id)
        await self.callbacks.resume()
        for gw in self.fleet.live():
            if gw.sessions:
                self.watching.ensure_watcher(gw)
        self.background.spawn(self.dispatcher.loop())
        self.background.spawn(self.watching.monitor_loop())
        if self.store.shared:
            loop = asyncio.get_running_loop()

            def heard(note: str) -> None:  # in the listening thread
                with contextlib.suppress(RuntimeError):  # the loop closed: the server stopped
                    loop.call_soon_threadsafe(self.ledger.heard, note)

            self._stop_listening = self.store.listen(heard)
            self.background.spawn(self._follow_store())

    async def stop(self) -> None:
        self._stop_listening()
        await self.background.stop()
        await self.links.close()

    async def _follow_store(self) -> None:
        """With other workers on the store: let go of a gateway that registered with another worker since (it
        failed over there), and drain one a fleet-wide call drained through another worker."""
        while True:
            try:
                async with self._gateways_changing:
                    rows = {row.gateway_id: row for row in await self.store.gateways()}
                    for gw in list(self.fleet.gateways.values()):
                        row = rows.get(gw.gateway_id)
                        if row is not None and row.owner not in (None, self.worker):
                            log.info("gateway %s moved to server worker %s", gw.gateway_id, row.owner)
                            self.fleet.release(gw)
                        elif row is not None and row.state == DRAINING and gw.row.state == HEALTHY:
                            gw.row.state = DRAINING
            except Exception:
                self.counters.errors["follow_store_failed"] += 1
                log.exception("reading the other workers' changes failed; trying again")
            await asyncio.sleep(self.watching.heartbeat_interval)

    async def recall_fleet(self) -> None:
        """The LLM backends and policy version the fleet was last given, through whichever worker (the store's copy
        is the one that counts: each fleet-wide change writes it)."""
        backends, version = await self.store.fleet_value("backends"), await self.store.fleet_value("policy_version")
        if backends is not None:
            self.backends[:] = orjson.loads(backends)
        if version is not None:
            self.policy_version = orjson.loads(version)

    async def remember_fleet(self) -> None:
        """Store the fleet's backends and policy version: a gateway registering with any worker later gets them."""
        await self.store.set_fleet_value("backends", orjson.dumps(self.backends).decode())
        await self.store.set_fleet_value("policy_version", orjson.dumps(self.policy_version).decode())

    @property
    def client(self) -> httpx.AsyncClient:
        return self.links.client

    # -- tasks -----------------------------------------------------------------------------------------------

    async def submit(self, task: TaskRequest) -> tuple[dict[str, Any], bool]:
        """Store the task and its sessions; resubmitting a task_id returns the existing task (created False)."""
        specs = await asyncio.to_thread(expand, task, self.max_samples, self.max_task_bytes)
        created = await self.store.add_task(task, specs)
        if created:
            await self.ledger.notify(task.task_id, {"event": "submitted", "sessions": [s.session_id for s in specs]})
            self.ledger.wake.set()
        return await self.task_view(task.task_id), created

    async def task_view(self, task_id: str) -> dict[str, Any]:
        """TaskStatus plus an aggregate: counts by status and the mean reward of the evaluated sessions."""
        return await task_view(self.store, task_id)

    async def release_task(self, task_id: str) -> dict[str, Any]:
        """The trainer has the task's results: apply the result retention (nothing under ``keep``). Only a finished
        task is released; a running one answers 409, its results not all taken yet."""
        task = await self.store.task(task_id)
        if task is None:
            raise ServerError(404, "unknown_task", f"no task {task_id!r}")
        if await self.store.unfinished(task_id):
            raise ServerError(409, "task_running", f"task {task_id!r} still has sessions running")
        retention = self.callbacks.retention
        changed = await self.store.retain(task_id, retention) if retention != "keep" else 0
        return {"task_id": task_id, "retention": retention, "results_changed": changed}

    async def cancel_task(self, task_id: str) -> dict[str, Any]:
        if await self.store.task(task_id) is None:
            raise ServerError(404, "unknown_task", f"no task {task_id!r}")
        await self.store.mark_task_cancelled(task_id)
        for row in await self.store.sessions_of(task_id):
            await self.cancel_session(row.session_id)
        return await self.task_view(task_id)

    async def cancel_session(self, session_id: str) -> SessionRow:
        row = await self.store.session(session_id)
        if row is None:
            raise ServerError(404, "unknown_session", f"no session {session_id!r}")
        if row.status.terminal:
            return row
        gw = self.fleet.owner(session_id)
        if gw is None and row.gateway_id and self.store.shared:  # maybe running on another worker's gateway
            gw = next((GatewayState(r) for r in await self.store.gateways() if r.gateway_id == row.gateway_id), None)
        if gw is not None and gw.row.state != DEAD:
            try:
                await self.links.gateway(gw).cancel_session(session_id)
                return row  # the watcher stores the gateway's CANCELLED result
            except GatewayBadReply:
                return row  # a 200 all the same
            except GatewayUnreachable as exc:
                self.counters.errors["cancel_failed"] += 1
                log.warning("cancel of %s on %s failed: %s", session_id, gw.gateway_id, exc)
            except GatewayRefused:
                pass  # it does not run there (any more): end it here
        await self.ledger.finish(ended_as(row, S.CANCELLED, "cancelled through the rollout server"), gw)
        return row

    async def result(self, session_id: str, wait: float = 0.0) -> SessionRow:
        row = await self.store.session(session_id)
        if row is None:
            raise ServerError(404, "unknown_session", f"no session {session_id!r}")
        deadline = time.monotonic() + min(wait, 600.0)
        while row is not None and not row.status.terminal and time.monotonic() < deadline:
            await self.ledger.changed(deadline - time.monotonic())
            row = await self.store.session(session_id)
        assert row is not None
        return row

    async def events(self, task_id: str) -> AsyncIterator[dict[str, Any]]:
        """Status changes of one task: a snapshot first, then each change, ending when every session ended."""
        with self.ledger.subscribe(task_id) as queue:
            view = await self.task_view(task_id)
            yield {"event": "snapshot", "status": view["status"], "sessions": view["sessions"]}
            if view["status"] not in ("COMPLETED", "ERROR", "CANCELLED"):
                # with other workers, the end is also checked each second (their notifications can be missed)
                patience = 1.0 if self.store.shared else None
                while True:  # a count per event, not a whole view: a big task's view is thousands of rows
                    with contextlib.suppress(TimeoutError):
                        yield await asyncio.wait_for(queue.get(), patience)
                    if await self.store.unfinished(task_id) == 0:
                        break
                view = await self.task_view(task_id)
            while not queue.empty():  # changes stored before the final view was read
                yield queue.get_nowait()
            yield {"event": "task_finished", "status": view["status"], "aggregate": view["aggregate"]}

    # -- gateways --------------------------------------------------------------------------------------------

    async def register(self, reg: GatewayRegistration) -> GatewayState:
        """A gateway joins (or comes back). One this worker does not know, registered before (with another
        worker, which it left), is taken over with the sessions it runs."""
        adopted = None
        async with self._gateways_changing:
            if self.fleet.by_url(reg.url) is None:
                known = await self.store.gateway_by_url(reg.url.rstrip("/"))
                if known is not None:
                    adopted = self.fleet.restore(known)
                    adopted.stale.update(await self.store.given_up_on(known.gateway_id))  # its last worker's
                    if known.state != DEAD:
                        adopted.sessions.update(r.session_id for r in await self.store.in_flight(known.gateway_id))
            gw = self.fleet.register(reg)
            gw.row.owner = self.worker
            await self.store.save_gateway(gw.row)
        if adopted is not None and adopted.sessions:
            self.watching.ensure_watcher(adopted)
        if self.store.shared:
            await self.recall_fleet()
        for url in self.backends:  # a new gateway gets the fleet's current LLM backends
            with contextlib.suppress(GatewayCallError):
                await self.links.gateway(gw).add_upstream(url)
        if self.policy_version is not None:
            with contextlib.suppress(GatewayCallError):
                await self.links.gateway(gw).resume(self.policy_version)
        self.ledger.wake.set()
        return gw

    def gateway(self, gateway_id: str) -> GatewayState:
        gw = self.fleet.gateways.get(gateway_id)
        if gw is None:
            raise ServerError(404, "unknown_gateway", f"no gateway {gateway_id!r}")
        return gw

    async def heartbeat(self, gateway_id: str, health: dict[str, Any]) -> GatewayState:
        gw = self.gateway(gateway_id)
        if gw.row.state == DEAD:
            raise ServerError(410, "gateway_dead", f"{gateway_id} was declared dead; register it again")
        gw.last_seen, gw.health = time.monotonic(), health
        capacity = health.get("dispatch_capacity")
        if (isinstance(capacity, int) and not isinstance(capacity, bool) and 1 <= capacity <= 1_000_000
                and capacity != gw.row.capacity):  # a self-sizing gateway's pools grew or shrank
            gw.row.capacity = capacity
            await self.store.save_gateway(gw.row)
            self.ledger.wake.set()
        return gw

    async def drain(self, gateway_id: str, withdraw: bool = False, leaving: bool = False) -> GatewayState:
        """No new sessions go to a draining gateway; the ones it runs finish there. With ``withdraw``, the ones it
        has not started running are cancelled there and queued again, their attempt refunded. With ``leaving`` (a
        gateway shutting down) it is declared dead now rather than after missed heartbeats: a server restarted on
        the store (a resumed run) then neither dispatches to it nor waits for it in a weight update."""
        gw = self.gateway(gateway_id)
        if leaving:
            if gw.row.state != DEAD:
                await self.watching.declare_dead(gw, left=True)
            return gw
        if gw.row.state == HEALTHY:
            gw.row.state = DRAINING
            await self.store.save_gateway(gw.row)
        if withdraw and gw.sessions:
            gw.withdrawing = set(gw.sessions)  # the watcher may hear of the cancelled attempts first
            try:
                reply = await self.links.gateway(gw).withdraw(sorted(gw.sessions))
            except GatewayCallError as exc:
                log.warning("gateway %s did not withdraw its queued sessions: %s", gateway_id, exc)
                return gw
            finally:
                withdrawing, gw.withdrawing = gw.withdrawing, set()
            taken = [i for i in reply.withdrawn if i in gw.sessions and i in withdrawing]
            gw.sessions.difference_update(taken)  # before any await: the watcher must not file them
            for session_id in taken:
                row = await self.store.session(session_id)
                if row is not None and await self.store.withdraw(session_id):
                    await self.ledger.notify(row.task_id, {"event": "requeued", "session_id": session_id,
                                                           "reason": f"withdrawn from {gateway_id} before it ran"})
            self.ledger.wake.set()
        return gw

    async def drain_anywhere(self, gateway_id: str) -> None:
        """Drain a gateway, this worker's or (through the store) another's."""
        if gateway_id in self.fleet.gateways:
            await self.drain(gateway_id)
            return
        row = next((r for r in await self.store.gateways() if r.gateway_id == gateway_id), None)
        if row is not None and row.state == HEALTHY:
            row.state = DRAINING
            await self.store.save_gateway(row)

    async def reachable(self) -> list[GatewayState]:
        """Every live gateway of the fleet: this worker's, and the other workers' as the store knows them."""
        mine = self.fleet.live()
        if not self.store.shared:
            return mine
        return mine + [GatewayState(row) for row in await self.store.gateways()
                       if row.state != DEAD and row.gateway_id not in self.fleet.gateways]

    async def fleet_view(self) -> list[dict[str, Any]]:
        """The fleet's gateways as GET /gateways shows them (other workers' with their store's counts)."""
        views = [gw.describe() for gw in self.fleet.gateways.values()]
        if self.store.shared:
            counts = await self.store.in_flight_counts()
            for row in await self.store.gateways():
                if row.gateway_id not in self.fleet.gateways:
                    other = GatewayState(row)
                    view = other.describe() | {"in_flight": counts.get(row.gateway_id, 0),
                                               "load": counts.get(row.gateway_id, 0) / max(row.capacity, 1),
                                               "seconds_since_heartbeat": None}
                    views.append(view)
        return views

    # -- LLM backends across the fleet -----------------------------------------------------------------------

    async def fanout(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """Send one admin call (named by the gateway route it calls, see :func:`admin_call`) to every live gateway;
        answers (or errors) by gateway id."""
        return await self.broadcast(admin_call(method, path, body))

    async def broadcast(self, call: AdminCall, only: Collection[str] | None = None) -> dict[str, Any]:
        """``call`` on every live gateway (of ``only``, when given) at once: ``{"status", "body"}`` per answer,
        ``{"status": None, "error"}`` per gateway that gave none."""

        async def one(gw: GatewayState) -> tuple[str, dict[str, Any]]:
            try:
                reply = await call(self.links.gateway(gw))
                return gw.gateway_id, {"status": 200, "body": reply.model_dump(mode="json")}
            except GatewayRefused as exc:
                if exc.body is not None:
                    return gw.gateway_id, {"status": exc.status, "body": exc.body}
                error: GatewayCallError = exc
            except GatewayCallError as exc:
                error = exc
            self.counters.errors["backend_fanout_failed"] += 1
            return gw.gateway_id, {"status": None, "error": repr(error)}

        return dict(await asyncio.gather(*(one(gw) for gw in await self.reachable()
                                           if only is None or gw.gateway_id in only)))


def admin_call(method: str, path: str, body: dict[str, Any] | None = None) -> AdminCall:
    """The typed client call for a gateway admin route (how the HTTP API names them); ValueError for any other."""
    args = body or {}
    route = (method.upper(), path)
    if route == ("GET", "/admin/upstreams"):
        return lambda c: c.upstreams(timeout=FANOUT_TIMEOUT)
    if route == ("POST", "/admin/upstreams"):
        return lambda c: c.add_upstream(str(args["url"]), timeout=FANOUT_TIMEOUT)
    if route == ("POST", "/admin/upstreams/remove"):
        return lambda c: c.remove_upstream(str(args["url"]), timeout=FANOUT_TIMEOUT)
    if route == ("POST", "/admin/pause"):
        return lambda c: c.pause(timeout=FANOUT_TIMEOUT)
    if route == ("POST", "/admin/resume"):
        version = ResumeRequest.model_validate(args).policy_version
        return lambda c: c.resume(version, timeout=FANOUT_TIMEOUT)
    raise ValueError(f"no gateway admin call {method} {path}")
