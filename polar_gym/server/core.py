"""The rollout server's engine: expands tasks into sessions, dispatches them to gateways, watches their results,
re-dispatches the sessions of a gateway that stops answering, and delivers callbacks. State lives in the Store, so
every step is resumable after a restart; in-memory maps are only caches of who runs what."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import httpx

from polar_gym.httpguard import MAX_JSON_DEPTH, check_upstream_url, excerpt, json_depth
from polar_gym.schema import SessionResult, SessionSpec, SessionStatus, TaskRequest
from polar_gym.server.fleet import DEAD, DRAINING, HEALTHY, Fleet, GatewayRegistration, GatewayState
from polar_gym.server.store import SessionRow, Store, TaskRow

__all__ = ["RolloutServer", "ServerError"]

log = logging.getLogger(__name__)
S = SessionStatus


class ServerError(Exception):
    """A request the server refuses: ``status`` is the HTTP status the API answers with."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


def task_state(rows: list[SessionRow], cancelled: bool) -> SessionStatus:
    """One status for a task: running until every session ended, then completed unless none completed."""
    statuses = [r.status for r in rows]
    if not all(s.terminal for s in statuses):
        return S.REGISTERED if all(s == S.REGISTERED for s in statuses) else S.RUNNING
    if cancelled or all(s == S.CANCELLED for s in statuses):
        return S.CANCELLED
    return S.COMPLETED if S.COMPLETED in statuses else S.ERROR


def expand(task: TaskRequest, max_samples: int, max_task_bytes: int) -> list[SessionSpec]:
    """The sessions of a task, after checking it is bounded and can be read back once stored (a pure function,
    run in a worker thread: thousands of specs would hold the event loop). Raises ServerError 413/422."""
    if task.num_samples > max_samples:
        raise ServerError(413, "too_many_samples", f"num_samples {task.num_samples} exceeds this server's limit of "
                                                   f"{max_samples} sessions per task")
    try:
        stored, dumped = task.model_dump_json(), task.model_dump(mode="json")
    except ValueError as exc:  # nested past the serializer's own guard (a few hundred levels)
        raise ServerError(422, "unreadable_task", f"the task cannot be stored: {excerpt(exc, 300)}") from exc
    if len(stored) * (task.num_samples + 1) > max_task_bytes:
        raise ServerError(413, "task_too_large", f"{task.num_samples} samples of a {len(stored)}-byte request exceed "
                                                 f"this server's limit of {max_task_bytes} stored bytes per task")
    if task.callback_url is not None:
        try:
            check_upstream_url(task.callback_url)
        except ValueError as exc:
            raise ServerError(422, "invalid_callback_url", str(exc)) from exc
    depth = json_depth(dumped)
    if depth > MAX_JSON_DEPTH:
        raise ServerError(422, "too_deep", f"the task nests JSON {depth} levels deep; the limit is {MAX_JSON_DEPTH}")
    specs = [SessionSpec.from_task(task, i) for i in range(task.num_samples)]
    try:  # what is stored must read back (e.g. an infinite float is written as null and then fails)
        TaskRequest.model_validate_json(stored)
        SessionSpec.model_validate_json(specs[0].model_dump_json())
    except ValueError as exc:
        raise ServerError(422, "unreadable_task", f"the task would not read back once stored: {excerpt(exc, 300)}") \
            from exc
    return specs


class RolloutServer:
    def __init__(self, store: Store, *, heartbeat_interval: float = 2.0, dead_after: float = 10.0,
                 max_attempts: int = 3, result_wait: float = 2.0, callback_attempts: int = 8,
                 callback_backoff: float = 0.5, max_samples: int = 4096, max_task_bytes: int = 256 * 1024 * 1024,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.store = store
        #: bounds of one task: sessions, and bytes stored for it (its request times its sessions)
        self.max_samples, self.max_task_bytes = max_samples, max_task_bytes
        self.fleet = Fleet()
        self.heartbeat_interval, self.dead_after = heartbeat_interval, dead_after
        self.max_attempts, self.result_wait = max_attempts, result_wait
        self.callback_attempts, self.callback_backoff = callback_attempts, callback_backoff
        self._transport = transport
        self.http: httpx.AsyncClient | None = None
        self.polls: httpx.AsyncClient | None = None
        self._wake = asyncio.Event()
        self._changed = asyncio.Condition()
        self._subscribers: dict[str, set[asyncio.Queue[dict[str, Any]]]] = collections.defaultdict(set)
        self._tasks: set[asyncio.Task[Any]] = set()
        self.backends: list[str] = []
        # metrics
        self.errors: collections.Counter[str] = collections.Counter()
        self.dispatch_latency = [0, 0.0]  # count, total seconds from submission to dispatch
        self.dispatched = 0
        self.redispatched = 0
        self.callbacks: collections.Counter[str] = collections.Counter()

    # -- lifecycle -------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Reload gateways and in-flight sessions from the store, then run the loops."""
        self.http = httpx.AsyncClient(transport=self._transport, timeout=httpx.Timeout(30.0, connect=5.0))
        # The watchers' long polls (one per gateway) get their own pool, so they never queue ahead of dispatches and
        # health probes, whose short timeouts would then expire and get live gateways declared dead.
        self.polls = httpx.AsyncClient(transport=self._transport, timeout=httpx.Timeout(30.0, connect=5.0),
                                       limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256))
        for row in await self.store.gateways():
            self.fleet.restore(row)  # heartbeat clock restarts now: each gets dead_after to answer
        for row in await self.store.in_flight():
            gw = self.fleet.gateways.get(row.gateway_id or "")
            if row.status.terminal:  # unreadable, now quarantined
                await self._ended(row.task_id, row.session_id, row.status, row.reason)
            elif gw is None or gw.row.state == DEAD:
                await self._lost(row, "its gateway is gone after a server restart")
            else:
                gw.sessions.add(row.session_id)
        for task_id in await self.store.pending_callbacks():
            self._spawn(self._deliver(task_id))
        for gw in self.fleet.live():
            if gw.sessions:
                self._ensure_watcher(gw)
        self._spawn(self._dispatch_loop())
        self._spawn(self._monitor_loop())

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for client in (self.http, self.polls):
            if client is not None:
                await client.aclose()

    def _spawn(self, coro: Awaitable[Any]) -> None:
        task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @property
    def client(self) -> httpx.AsyncClient:
        if self.http is None:
            raise RuntimeError("the rollout server is not started")
        return self.http

    # -- tasks -----------------------------------------------------------------------------------------------

    async def submit(self, task: TaskRequest) -> tuple[dict[str, Any], bool]:
        """Store the task and its sessions; resubmitting a task_id returns the existing task (created False)."""
        specs = await asyncio.to_thread(expand, task, self.max_samples, self.max_task_bytes)
        created = await self.store.add_task(task, specs)
        if created:
            await self._notify(task.task_id, {"event": "submitted", "sessions": [s.session_id for s in specs]})
            self._wake.set()
        return await self.task_view(task.task_id), created

    async def task_view(self, task_id: str) -> dict[str, Any]:
        """TaskStatus plus an aggregate: counts by status and the mean reward of the evaluated sessions."""
        task = await self.store.task(task_id)
        if task is None:
            raise ServerError(404, "unknown_task", f"no task {task_id!r}")
        rows = await self.store.sessions_of(task_id)
        return await asyncio.to_thread(_view, task_id, task, rows)  # thousands of results: off the event loop

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
        if gw is not None and gw.row.state != DEAD:
            try:
                resp = await self.client.post(f"{gw.url}/sessions/{session_id}/cancel", headers=gw.headers)
                if resp.status_code == 200:
                    return row  # the watcher stores the gateway's CANCELLED result
            except httpx.HTTPError as exc:
                self.errors["cancel_failed"] += 1
                log.warning("cancel of %s on %s failed: %s", session_id, gw.gateway_id, exc)
        await self._finish(self._result(row, S.CANCELLED, "cancelled through the rollout server"), gw)
        return row

    async def result(self, session_id: str, wait: float = 0.0) -> SessionRow:
        row = await self.store.session(session_id)
        if row is None:
            raise ServerError(404, "unknown_session", f"no session {session_id!r}")
        deadline = time.monotonic() + min(wait, 600.0)
        while row is not None and not row.status.terminal and time.monotonic() < deadline:
            async with self._changed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), deadline - time.monotonic())
            row = await self.store.session(session_id)
        assert row is not None
        return row

    async def events(self, task_id: str) -> AsyncIterator[dict[str, Any]]:
        """Status changes of one task: a snapshot first, then each change, ending when every session ended."""
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._subscribers[task_id].add(queue)
        try:
            view = await self.task_view(task_id)
            yield {"event": "snapshot", "status": view["status"], "sessions": view["sessions"]}
            if view["status"] not in ("COMPLETED", "ERROR", "CANCELLED"):
                while True:  # a count per event, not a whole view: a big task's view is thousands of rows
                    yield await queue.get()
                    if await self.store.unfinished(task_id) == 0:
                        break
                view = await self.task_view(task_id)
            while not queue.empty():  # changes stored before the final view was read
                yield queue.get_nowait()
            yield {"event": "task_finished", "status": view["status"], "aggregate": view["aggregate"]}
        finally:
            self._subscribers[task_id].discard(queue)
            if not self._subscribers[task_id]:
                del self._subscribers[task_id]

    async def _notify(self, task_id: str, event: dict[str, Any]) -> None:
        for queue in self._subscribers.get(task_id, ()):
            queue.put_nowait({"task_id": task_id, "time": time.time(), **event})
        async with self._changed:
            self._changed.notify_all()

    # -- gateways --------------------------------------------------------------------------------------------

    async def register(self, reg: GatewayRegistration) -> GatewayState:
        gw = self.fleet.register(reg)
        await self.store.save_gateway(gw.row)
        for url in self.backends:  # a new gateway gets the fleet's current LLM backends
            with contextlib.suppress(httpx.HTTPError):
                await self.client.post(f"{gw.url}/admin/upstreams", json={"url": url}, headers=gw.headers)
        self._wake.set()
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
        return gw

    async def drain(self, gateway_id: str) -> GatewayState:
        """No new sessions go to a draining gateway; the ones it runs finish there."""
        gw = self.gateway(gateway_id)
        if gw.row.state == HEALTHY:
            gw.row.state = DRAINING
            await self.store.save_gateway(gw.row)
        return gw

    async def _monitor_loop(self) -> None:
        while True:
            try:
                await asyncio.gather(*(self._probe(gw) for gw in self.fleet.live()))
                now = time.monotonic()
                for gw in self.fleet.live():
                    if now - gw.last_seen > self.dead_after:
                        await self._declare_dead(gw)
            except Exception:
                self.errors["monitor_round_failed"] += 1
                log.exception("a gateway monitoring round failed; monitoring goes on")
            await asyncio.sleep(self.heartbeat_interval)

    async def _probe(self, gw: GatewayState) -> None:
        """Gateways need not push heartbeats: a health answer counts as one."""
        try:
            resp = await self.client.get(f"{gw.url}/gateway/health", timeout=max(self.heartbeat_interval, 1.0))
            if resp.status_code == 200:
                gw.last_seen, gw.health, gw.suspect = time.monotonic(), resp.json(), False
        except (httpx.HTTPError, ValueError):
            self.errors["heartbeat_failed"] += 1

    async def _declare_dead(self, gw: GatewayState) -> None:
        log.warning("gateway %s (%s) missed heartbeats: re-dispatching %d sessions", gw.gateway_id, gw.url,
                    len(gw.sessions))
        self.errors["gateway_dead"] += 1
        gw.row.state = DEAD
        await self.store.save_gateway(gw.row)
        lost, gw.sessions = list(gw.sessions), set()
        for session_id in lost:
            row = await self.store.session(session_id)
            if row is not None and not row.status.terminal:
                await self._lost(row, f"gateway {gw.gateway_id} ({gw.url}) stopped answering")
        self._wake.set()

    async def _lost(self, row: SessionRow, why: str) -> None:
        """Re-queue a session whose gateway lost it, or fail it with the reason after max_attempts."""
        if row.attempts >= self.max_attempts:
            await self._finish(self._result(row, S.ERROR, f"{why}; gave up after {row.attempts} attempts"), None)
            return
        self.redispatched += 1
        await self.store.requeue(row.session_id, why)
        await self._notify(row.task_id, {"event": "requeued", "session_id": row.session_id, "reason": why})
        self._wake.set()

    # -- dispatch and watch ----------------------------------------------------------------------------------

    def _free_slots(self) -> int:
        return sum(max(0, g.row.capacity - len(g.sessions)) for g in self.fleet.gateways.values()
                   if g.row.state == HEALTHY and not g.suspect)

    async def _dispatch_loop(self) -> None:
        """Each round claims a batch of waiting sessions in one store transaction and posts them concurrently.
        Why batches: one store round trip and one gateway POST awaited per session, on a loop busy with watchers,
        held dispatch to ~100 sessions/s and let the queue (and scheduling latency) grow with every submit.
        Nothing ends the loop: a round that fails is logged and counted, and the next one runs."""
        while True:
            self._wake.clear()
            try:
                limit = min(self._free_slots(), 1000)
                waiting = await self.store.undispatched(limit) if limit else []  # a full fleet reloads nothing
                quarantined = [r for r in waiting if r.status.terminal]
                for row in quarantined:
                    await self._ended(row.task_id, row.session_id, row.status, row.reason)
                dispatchable = [r for r in waiting if not r.status.terminal]
                if (await self._dispatch_batch(dispatchable) or quarantined) and len(waiting) == limit:
                    continue  # maybe more waiting: another round before sleeping
            except Exception:
                self.errors["dispatch_round_failed"] += 1
                log.exception("a dispatch round failed; dispatching goes on")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 1.0)

    async def _dispatch_batch(self, waiting: list[SessionRow]) -> int:
        """Pick a gateway for each waiting session (as many as have a free slot), claim them, post them."""
        plan: list[tuple[SessionRow, GatewayState]] = []
        for row in waiting:
            gw = self.fleet.pick()
            if gw is None:
                break
            gw.sessions.add(row.session_id)  # so the next pick() counts it; undone below, before any await
            plan.append((row, gw))
        for row, gw in plan:
            gw.sessions.discard(row.session_id)
        if not plan:
            return 0
        attempts = await self.store.assign_many([(r.session_id, g.gateway_id) for r, g in plan])
        claimed = [(r, g, attempts[r.session_id]) for r, g in plan if r.session_id in attempts]
        for row, gw, _ in claimed:  # the others were cancelled while waiting
            gw.sessions.add(row.session_id)
        sem = asyncio.Semaphore(64)  # a 1000-session burst would only queue in the HTTP pool
        await asyncio.gather(*(self._post_claimed(sem, *c) for c in claimed))
        return len(plan)

    async def _post_claimed(self, sem: asyncio.Semaphore, row: SessionRow, gw: GatewayState, attempt: int) -> None:
        async with sem:
            if gw.row.state == HEALTHY and not gw.suspect:
                await self._post(row, gw, attempt)
                return
        # the gateway stopped accepting after the plan (drained, or a dispatch to it failed): as if never picked
        gw.sessions.discard(row.session_id)
        await self.store.release(row.session_id, gw.gateway_id)
        self._wake.set()

    async def _post(self, row: SessionRow, gw: GatewayState, attempt: int) -> None:
        """Hand a claimed session (already counted in ``gw.sessions``) to its gateway; re-queue it on failure."""
        try:
            resp = await self.client.post(f"{gw.url}/sessions", content=row.spec.model_dump_json(),
                                          headers={**gw.headers, "content-type": "application/json"})
        except httpx.HTTPError as exc:
            self.errors["dispatch_unreachable"] += 1
            gw.sessions.discard(row.session_id)
            gw.suspect = True  # not picked again until a health probe answers
            unreached = isinstance(exc, httpx.ConnectError)  # it never got there: the try does not count
            row.attempts = attempt - 1 if unreached else attempt
            if unreached:
                await self.store.refund_attempt(row.session_id)
            await self._lost(row, f"dispatch to {gw.gateway_id} failed: {exc!r}")
            return
        if resp.status_code not in (201, 409):  # 409: it already runs there (a dispatch before a restart)
            self.errors[f"dispatch_http_{resp.status_code}"] += 1
            gw.sessions.discard(row.session_id)
            if resp.status_code == 503:
                gw.row.state = DRAINING
                await self.store.save_gateway(gw.row)
            row.attempts = attempt
            await self._lost(row, f"{gw.gateway_id} refused the session ({resp.status_code}): {resp.text[:300]}")
            return
        self.dispatched += 1
        self.dispatch_latency[0] += 1
        self.dispatch_latency[1] += max(0.0, time.time() - row.created)
        await self._notify(row.task_id, {"event": "dispatched", "session_id": row.session_id,
                                         "gateway_id": gw.gateway_id, "attempt": attempt})
        self._ensure_watcher(gw)

    def _ensure_watcher(self, gw: GatewayState) -> None:
        """One watcher per gateway (not one long poll per session: a thousand of those starved the event loop and
        the HTTP pool after a restart); a new session wakes it."""
        gw.added.set()
        if gw.watcher is None or gw.watcher.done():
            gw.watcher = asyncio.ensure_future(self._watch_gateway(gw))
            self._tasks.add(gw.watcher)
            gw.watcher.add_done_callback(self._tasks.discard)

    async def _watch_gateway(self, gw: GatewayState) -> None:
        """Batch long polls (POST /sessions/poll) for every session this server handed to ``gw``, until the
        gateway is declared dead; sessions dispatched meanwhile join the next poll (a poll waits at most
        ``result_wait`` seconds)."""
        last: dict[str, str] = {}
        while gw.row.state != DEAD:
            gw.added.clear()
            ids = list(gw.sessions)
            if not ids:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(gw.added.wait(), 60.0)
                continue
            try:
                assert self.polls is not None
                resp = await self.polls.post(f"{gw.url}/sessions/poll", json={"session_ids": ids,
                                                                              "wait": self.result_wait},
                                             headers=gw.headers, timeout=self.result_wait + 30.0)
                body = resp.json() if resp.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                self.errors["result_poll_failed"] += 1
                await asyncio.sleep(min(1.0, self.heartbeat_interval))
                continue
            if body is None:  # a gateway shutting down or overloaded: ask again, heartbeats decide
                self.errors[f"result_http_{resp.status_code}"] += 1
                await asyncio.sleep(min(1.0, self.heartbeat_interval))
                continue
            finished = []
            for data in body.get("results", []) if isinstance(body, dict) else []:
                try:
                    finished.append(SessionResult.model_validate(data))
                except ValueError as exc:  # one bad result must not stop the watch of the others
                    self.errors["result_unreadable"] += 1
                    log.error("unreadable result from %s: %s", gw.gateway_id, excerpt(exc, 300))
            for result in finished:
                last.pop(result.session_id, None)
            mine = [r for r in finished if r.session_id in gw.sessions]
            for start in range(0, len(mine), 64):  # concurrently: each finish waits on the store and callbacks
                await asyncio.gather(*(self._finish(r, gw) for r in mine[start:start + 64]))
            for session_id, status in body.get("statuses", {}).items():
                if session_id in gw.sessions and status != last.get(session_id) and status in S.__members__ \
                        and not S(status).terminal:
                    last[session_id] = status
                    await self._status(session_id, S(status))
            for session_id in body.get("unknown", []):
                if session_id in gw.sessions:
                    self.errors["result_http_404"] += 1
                    gw.sessions.discard(session_id)
                    last.pop(session_id, None)
                    row = await self.store.session(session_id)
                    if row is not None and not row.status.terminal:
                        await self._lost(row, f"{gw.gateway_id} does not know the session any more")

    async def _status(self, session_id: str, status: SessionStatus) -> None:
        await self.store.set_status(session_id, status)
        row = await self.store.session(session_id)
        if row is not None:
            await self._notify(row.task_id, {"event": "status", "session_id": session_id, "status": status.value})

    def _result(self, row: SessionRow, status: SessionStatus, reason: str) -> SessionResult:
        return SessionResult(session_id=row.session_id, task_id=row.task_id, status=status, reason=reason)

    async def _finish(self, result: SessionResult, gw: GatewayState | None) -> None:
        if gw is not None:
            gw.sessions.discard(result.session_id)
        if await self.store.finish(result):  # False: it had already ended (the first final result stays)
            await self._ended(result.task_id, result.session_id, result.status, result.reason)

    async def _ended(self, task_id: str, session_id: str, status: SessionStatus, reason: str | None) -> None:
        """A session reached its final state (a result, or quarantined): tell subscribers, call back when the
        task is done."""
        await self._notify(task_id, {"event": "finished", "session_id": session_id, "status": status.value,
                                     "reason": reason})
        self._wake.set()
        if await self.store.unfinished(task_id) == 0:
            task = await self.store.task(task_id)
            if task is not None and task.request.callback_url and await self.store.claim_callback(task_id):
                self._spawn(self._deliver(task_id))

    # -- callbacks -------------------------------------------------------------------------------------------

    async def _deliver(self, task_id: str) -> None:
        """POST the finished task to its callback_url until a 2xx, with exponential backoff; the idempotency key
        lets the receiver drop repeats (delivery is at least once)."""
        task = await self.store.task(task_id)
        if task is None or not task.request.callback_url:
            return
        body = await self.task_view(task_id)
        headers = {"idempotency-key": f"polar-task-{task_id}", "content-type": "application/json"}
        error = "no attempt made"
        for attempt in range(self.callback_attempts):
            try:
                resp = await self.client.post(task.request.callback_url, json=body, headers=headers)
                if 200 <= resp.status_code < 300:
                    self.callbacks["delivered"] += 1
                    await self.store.set_callback(task_id, "delivered")
                    return
                error = f"HTTP {resp.status_code}: {resp.text[:200]}"
            except httpx.HTTPError as exc:
                error = repr(exc)
            self.callbacks["retried"] += 1
            self.errors["callback_failed"] += 1
            await asyncio.sleep(self.callback_backoff * 2**attempt)
        self.callbacks["failed"] += 1
        await self.store.set_callback(task_id, "failed", error)

    # -- LLM backends across the fleet -----------------------------------------------------------------------

    async def fanout(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """Send one admin call to every live gateway; answers (or errors) by gateway id."""

        async def one(gw: GatewayState) -> tuple[str, Any]:
            try:
                resp = await self.client.request(method, f"{gw.url}{path}", json=body, headers=gw.headers,
                                                 timeout=120.0)
                return gw.gateway_id, {"status": resp.status_code, "body": resp.json()}
            except (httpx.HTTPError, ValueError) as exc:
                self.errors["backend_fanout_failed"] += 1
                return gw.gateway_id, {"status": None, "error": repr(exc)}

        return dict(await asyncio.gather(*(one(gw) for gw in self.fleet.live())))


def _view(task_id: str, task: TaskRow, rows: list[SessionRow]) -> dict[str, Any]:
    """TaskStatus plus an aggregate, as JSON-ready data (pure; run in a worker thread). Built entry by entry, not as
    one TaskStatus dump: one call over thousands of results would hold the GIL, and so the event loop, throughout."""
    rewards = [r.result.evaluation.reward for r in rows if r.result and r.result.evaluation]
    counts = collections.Counter(r.status.value for r in rows)
    view = {"task_id": task_id, "status": task_state(rows, task.cancelled).value,
            "sessions": {r.session_id: r.status.value for r in rows},
            "results": [r.result.model_dump(mode="json") for r in rows if r.result is not None],
            "aggregate": {"counts": dict(counts), "num_sessions": len(rows),
                          "finished": sum(r.status.terminal for r in rows),
                          "mean_reward": sum(rewards) / len(rewards) if rewards else None},
            "gateways": {r.session_id: r.gateway_id for r in rows},
            "callback": {"state": task.callback_state, "error": task.callback_error}}
    if task.quarantined:
        view["quarantined"] = task.quarantined
    return view
