"""The RolloutServer's collaborators through their seams, without loops or sockets: the dispatch plan by free slots
and the other workers' gateways it sees, a post's outcome per gateway answer (httpx.MockTransport as the gateway),
re-queue then give up, callbacks that retry then give up, the admin fan-out, the typed counters."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from polar_gym.schema import AgentSpec, GatewayRegistration, SessionSpec, SessionStatus, TaskRequest
from polar_gym.server import RolloutServer, ServerCounters, dispatch
from polar_gym.server.core import admin_call
from polar_gym.server.dispatch import Dispatcher, free_slots, plan
from polar_gym.server.fleet import DRAINING, HEALTHY, Fleet
from polar_gym.server.store import GatewayRow, SessionRow
from tests._waiting import until

S = SessionStatus


def _rows(n: int) -> list[SessionRow]:
    task = TaskRequest(task_id="t", instruction="x", num_samples=n, agent=AgentSpec(harness="h"))
    return [SessionRow(SessionSpec.from_task(task, i), S.REGISTERED, None, 0, None, None, 0.0, None)
            for i in range(n)]


def test_the_plan_fills_free_slots_least_loaded_first_and_leaves_the_fleet_as_it_was() -> None:
    fleet = Fleet()
    small = fleet.register(GatewayRegistration(url="http://small", capacity=1))
    big = fleet.register(GatewayRegistration(url="http://big", capacity=3))
    busy = fleet.register(GatewayRegistration(url="http://busy", capacity=2))
    busy.sessions |= {"x", "y"}
    assert free_slots(fleet) == 4
    rows = _rows(6)
    chosen = plan(fleet, rows)
    assert [g.url for _, g in chosen] == ["http://big", "http://small", "http://big", "http://big"]
    assert [r.session_id for r, _ in chosen] == [r.session_id for r in rows[:4]]  # in order, until the fleet is full
    assert small.sessions == set() and big.sessions == set() and busy.sessions == {"x", "y"}
    big.suspect, small.row.state = True, DRAINING
    assert free_slots(fleet) == 0 and plan(fleet, rows) == []


class _SharedStore:
    """One worker's side of a PostgreSQL store: another worker's gateway shows once it has registered."""

    shared = True

    def __init__(self) -> None:
        self.others: list[GatewayRow] = []
        self.waiting: list[SessionRow] = []
        self.claimed: list[tuple[str, str]] = []

    async def in_flight_counts(self) -> dict[str, int]:
        return {}

    async def gateways(self) -> list[GatewayRow]:
        return list(self.others)

    async def undispatched(self, limit: int | None = None) -> list[SessionRow]:
        return self.waiting[:limit]

    async def assign_many(self, pairs: list[tuple[str, str]]) -> dict[str, int]:
        self.claimed += pairs
        self.waiting = [r for r in self.waiting if r.session_id not in dict(pairs)]
        return {session_id: 1 for session_id, _ in pairs}


class _Ledger:
    def __init__(self) -> None:
        self.wake = asyncio.Event()

    async def notify(self, task_id: str, event: dict[str, Any]) -> None:
        pass


class _Gateways:
    """The dispatcher's links to the gateways and its watchers at once: every gateway accepts, nothing is watched."""

    def gateway(self, gw: Any) -> _Gateways:
        return self

    async def start_session(self, spec: SessionSpec) -> Any:
        return SimpleNamespace(attempt_id="attempt")

    def ensure_watcher(self, gw: Any) -> None:
        pass


async def test_a_plan_for_new_sessions_sees_a_gateway_that_registered_elsewhere_since_the_last_look(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two workers, a gateway each: the view of the other's gateways is kept for a while between rounds, but a
    session created after it was read is planned on a fresh one. The other gateway registered between this worker's
    last look and the task's submission: of two new sessions, this worker takes one, not both."""
    monkeypatch.setattr(dispatch, "OTHERS_REFRESH", 3600.0)  # only a new session makes the worker look again
    fleet, store = Fleet(), _SharedStore()
    own = fleet.register(GatewayRegistration(url="http://own", capacity=4))
    dispatcher = Dispatcher(store, fleet, ServerCounters(), _Ledger(), _Gateways(), _Gateways())  # type: ignore[arg-type]
    assert not await dispatcher.round()  # nothing waits; the other workers' gateways are read: none yet
    store.others = [GatewayRow("gw-other", "http://other", 4, None, HEALTHY, owner="w2")]
    store.waiting = [dataclasses.replace(row, created=time.time()) for row in _rows(2)]
    await dispatcher.round()
    assert [gateway for _, gateway in store.claimed] == [own.gateway_id]
    assert [row.session_id for row in store.waiting] != []  # the other worker's share, left for it
    store.claimed.clear()
    await dispatcher.round()  # no newer session: the kept view, the same share
    assert store.claimed == []


async def _submitted(server: RolloutServer, n: int, callback_url: str | None = None) -> list[SessionRow]:
    task = TaskRequest(task_id="t", instruction="x", num_samples=n, agent=AgentSpec(harness="h"),
                       callback_url=callback_url)
    await server.submit(task)
    return await server.store.undispatched()


@pytest.mark.parametrize(("answer", "state", "attempts", "cause"), [
    (201, "healthy", 1, None),
    (409, "healthy", 1, None),  # it already runs there: as good as accepted
    (503, DRAINING, 1, "dispatch_http_503"),  # closing: no more sessions go there
    (500, "healthy", 1, "dispatch_http_500"),
    ("connect", "healthy", 0, "dispatch_unreachable"),  # never got there: the attempt is refunded
    ("timeout", "healthy", 1, "dispatch_unreachable"),
])
async def test_a_post_and_what_each_gateway_answer_means(make_server: Callable[..., RolloutServer],
                                                         answer: int | str, state: str, attempts: int,
                                                         cause: str | None) -> None:
    posts: list[tuple[str, str, str]] = []

    async def gateway(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/sessions/poll":  # the watcher an accepted post starts: a long poll, nothing ends
            await asyncio.Event().wait()
        posts.append((request.method, request.url.path, request.headers["x-admin-token"]))
        if answer == "connect":
            raise httpx.ConnectError("refused", request=request)
        if answer == "timeout":
            raise httpx.ReadTimeout("slow", request=request)
        assert isinstance(answer, int)
        return httpx.Response(answer, json={"session_id": "s", "status": "INITIALIZING"})

    server = make_server(gateway)
    gw = await server.register(GatewayRegistration(url="http://gw", capacity=4, admin_token="tok"))
    rows = await _submitted(server, 1)
    assert await server.dispatcher.batch(rows) == 1
    assert posts == [("POST", "/sessions", "tok")]
    row = await server.store.session(rows[0].session_id)
    assert row is not None and row.attempts == attempts and gw.row.state == state
    if cause is None:
        assert row.status is S.INITIALIZING and gw.sessions == {row.session_id}
        assert server.counters.dispatched == 1 and server.counters.redispatched == 0
        assert gw.watcher is not None  # the gateway's watcher runs
    else:
        assert row.status is S.REGISTERED and gw.sessions == set()  # back in the queue
        assert server.counters.errors[cause] == 1 and server.counters.redispatched == 1
        assert gw.suspect is (cause == "dispatch_unreachable")


async def test_a_lost_session_is_requeued_then_given_up(make_server: Callable[..., RolloutServer]) -> None:
    server = make_server(lambda request: httpx.Response(500), max_attempts=2)
    gw = await server.register(GatewayRegistration(url="http://gw", capacity=4))
    rows = await _submitted(server, 1)
    for attempt in (1, 2):
        gw.row.state = "healthy"
        await server.dispatcher.batch(await server.store.undispatched())
        row = await server.store.session(rows[0].session_id)
        assert row is not None and row.attempts == attempt
    assert row.status is S.ERROR and "gave up after 2 attempts" in (row.reason or "")
    assert server.counters.redispatched == 1


async def test_callbacks_retry_then_give_up_or_deliver(make_server: Callable[..., RolloutServer]) -> None:
    calls: list[str] = []

    def receiver(request: httpx.Request) -> httpx.Response:
        calls.append(request.headers["idempotency-key"])
        return httpx.Response(200 if request.url.host == "patient" and len(calls) >= 2 else 500, text="down")

    server = make_server(receiver, callback_attempts=3, callback_backoff=0.0)
    await _submitted(server, 1, callback_url="http://never/cb")
    await server.callbacks.deliver("t")
    task = await server.store.task("t")
    assert task is not None and (task.callback_state, task.callback_error) == ("failed", "HTTP 500: down")
    assert calls == ["polar-task-t"] * 3
    assert server.counters.callbacks == {"retried": 3, "failed": 1}

    calls.clear()
    other = make_server(receiver, callback_attempts=3, callback_backoff=0.0)
    await _submitted(other, 1, callback_url="http://patient/cb")
    await other.callbacks.deliver("t")
    task = await other.store.task("t")
    assert task is not None and task.callback_state == "delivered" and len(calls) == 2
    assert other.counters.callbacks == {"retried": 1, "delivered": 1}


async def test_the_admin_fanout_reports_each_gateway(make_server: Callable[..., RolloutServer]) -> None:
    def gateway(request: httpx.Request) -> httpx.Response:
        if request.url.host == "down":
            raise httpx.ConnectError("refused", request=request)
        if request.url.host == "old":
            return httpx.Response(404, json={"error": {"type": "not_found", "message": "no such route"}})
        assert request.url.path == "/admin/resume" and request.content == b'{"policy_version":3}'
        return httpx.Response(200, json={"paused": False, "policy_version": 3})

    server = make_server(gateway)
    ids = {url: (await server.register(GatewayRegistration(url=url, capacity=1))).gateway_id
           for url in ("http://ok", "http://old", "http://down")}
    answers = await server.fanout("POST", "/admin/resume", {"policy_version": 3})
    assert answers[ids["http://ok"]] == {"status": 200, "body": {"paused": False, "policy_version": 3}}
    assert answers[ids["http://old"]]["status"] == 404
    assert answers[ids["http://down"]]["status"] is None and "refused" in answers[ids["http://down"]]["error"]
    assert server.counters.errors == {"backend_fanout_failed": 1}
    with pytest.raises(ValueError):
        admin_call("POST", "/admin/shutdown")


def test_counters_are_typed() -> None:
    counters = ServerCounters()
    counters.dispatch(1.5)
    counters.dispatch(-1.0)  # a clock step back counts as no wait
    assert (counters.dispatched, counters.dispatch_seconds) == (2, 1.5)
    assert isinstance(counters.dispatched, int)


async def test_a_session_given_up_on_a_gateway_is_not_adopted_there(make_server: Callable[..., RolloutServer]) -> None:
    """409 from a gateway that holds an attempt this server gave up (it was declared dead, then came back): the
    stale attempt is cancelled there and the session waits again, its attempt not counted; a fresh gateway is
    preferred for it."""
    calls: list[str] = []

    async def gateway(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/sessions/poll":
            await asyncio.Event().wait()
        calls.append(f"{request.url.host} {request.url.path}")
        if request.url.path.endswith("/cancel"):
            return httpx.Response(200, json={"session_id": "s", "status": "CANCELLED", "cancelled": True})
        return httpx.Response(409 if request.url.host == "back" else 201,
                              json={"session_id": "s", "attempt_id": "a-new", "status": "INITIALIZING"})

    server = make_server(gateway)
    back = await server.register(GatewayRegistration(url="http://back", capacity=4))
    rows = await _submitted(server, 1)
    sid = rows[0].session_id
    back.stale.add(sid)
    assert await server.dispatcher.batch(rows) == 1
    assert calls == ["back /sessions", f"back /sessions/{sid}/cancel"]
    row = await server.store.session(sid)
    assert row is not None and row.status is S.REGISTERED and row.attempts == 0 and back.sessions == set()
    assert server.counters.errors["dispatch_stale_attempt"] == 1
    fresh = await server.register(GatewayRegistration(url="http://fresh", capacity=1))
    assert plan(server.fleet, [row]) == [(row, fresh)]  # the other gateway, though both are idle
    assert await server.dispatcher.batch([row]) == 1
    assert fresh.attempts == {sid: "a-new"} and sid not in fresh.stale


async def test_the_server_takes_a_gateways_new_capacity_from_its_heartbeat(
        make_server: Callable[..., RolloutServer]) -> None:
    server = make_server(lambda request: httpx.Response(200, json={}))
    gw = await server.register(GatewayRegistration(url="http://gw", capacity=4))
    await server.heartbeat(gw.gateway_id, {"dispatch_capacity": 30})
    assert gw.row.capacity == 30 and [row.capacity for row in await server.store.gateways()] == [30]
    for hostile in (0, -1, True, "31", 2_000_000, None, 3.5):
        await server.heartbeat(gw.gateway_id, {"dispatch_capacity": hostile})
        assert gw.row.capacity == 30
    await server.heartbeat(gw.gateway_id, {})  # an older gateway says nothing: its capacity stands
    assert gw.row.capacity == 30


async def test_a_session_being_posted_is_not_polled_before_its_gateway_took_it(
        make_server: Callable[..., RolloutServer]) -> None:
    """The watcher polls the sessions claimed for a gateway; one whose POST had not been answered yet was named
    unknown by the gateway, counted lost and dispatched a second time (seen at 1,000 sessions a run in
    benchmarks/bench_results.py). It is polled once the gateway took it."""
    accepted: set[str] = set()
    polled: list[list[str]] = []
    release = asyncio.Event()

    async def gateway(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"{}")
        if request.url.path == "/sessions/poll":
            ids = body["session_ids"]
            polled.append(ids)
            await asyncio.sleep(0.02)
            return httpx.Response(200, json={"results": [], "unknown": [i for i in ids if i not in accepted],
                                             "statuses": {i: "RUNNING" for i in ids if i in accepted}})
        if body["sample_index"] == 1:
            await release.wait()  # a slow answer to the second post
        accepted.add(body["session_id"])
        return httpx.Response(201, json={"session_id": body["session_id"], "status": "INITIALIZING"})

    server = make_server(gateway)
    await server.register(GatewayRegistration(url="http://gw", capacity=4))
    first, second = await _submitted(server, 2)
    assert await server.dispatcher.batch([first]) == 1
    await until(lambda: any(first.session_id in ids for ids in polled), what="the first session polled")
    posting = asyncio.create_task(server.dispatcher.batch([second]))
    seen = len(polled)
    await until(lambda: len(polled) >= seen + 5, what="five polls while the second post waits")
    assert not any(second.session_id in ids for ids in polled)
    release.set()
    assert await posting == 1
    await until(lambda: any(second.session_id in ids for ids in polled), what="the second session polled")
    row = await server.store.session(second.session_id)
    assert row is not None and row.attempts == 1 and row.status is not S.REGISTERED
    assert server.counters.errors["result_http_404"] == 0 and server.counters.redispatched == 0


async def test_a_loss_reported_late_leaves_a_session_another_worker_handed_on(
        make_server: Callable[..., RolloutServer]) -> None:
    """A gateway's loss reaches the ledger after the session was queued again and given to another gateway (by
    another server worker on the same store): queueing or ending it here would run it twice, so nothing happens."""
    server = make_server(lambda request: httpx.Response(500))
    [row] = await _submitted(server, 1)
    assert await server.store.assign(row.session_id, "gw-old") == 1
    assert await server.store.requeue(row.session_id, "its gateway died", "gw-old") is True
    assert await server.store.assign(row.session_id, "gw-new") == 2
    assert await server.store.requeue(row.session_id, "late", "gw-old") is False
    await server.ledger.lost(row, "gw-old stopped answering", "gw-old")
    await server.ledger.lost(dataclasses.replace(row, attempts=9), "gw-old again", "gw-old")  # not given up either
    now = await server.store.session(row.session_id)
    assert now is not None and now.gateway_id == "gw-new" and now.status is S.INITIALIZING and now.attempts == 2
    assert server.counters.redispatched == 0
    await server.ledger.lost(now, "gw-new stopped answering")  # its own gateway's loss still counts
    again = await server.store.session(row.session_id)
    assert again is not None and again.gateway_id is None and again.status is S.REGISTERED
    assert server.counters.redispatched == 1


async def test_what_one_worker_gave_up_on_a_gateway_the_next_worker_of_it_knows(
        make_server: Callable[..., RolloutServer]) -> None:
    """A gateway declared dead by its worker (a partition) comes back and registers with another worker (or the
    same one, restarted): the attempts given up there are still not adopted, since the store records them."""
    calls: list[str] = []

    async def gateway(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/sessions/poll":
            await asyncio.Event().wait()
        calls.append(request.url.path)
        if request.url.path.endswith("/cancel"):
            return httpx.Response(200, json={"session_id": "s", "status": "CANCELLED", "cancelled": True})
        return httpx.Response(409, json={"error": {"type": "exists", "message": "it runs here"}})

    server = make_server(gateway)
    back = await server.register(GatewayRegistration(url="http://back", capacity=4))
    [row] = await _submitted(server, 1)
    assert await server.store.assign(row.session_id, back.gateway_id) == 1
    back.sessions.add(row.session_id)
    await server.watching.declare_dead(back)  # its attempt is given up: recorded in the store
    server.fleet.release(back)  # the worker that knew it in memory is gone
    again = await server.register(GatewayRegistration(url="http://back", capacity=4))
    assert again is not back and again.gateway_id == back.gateway_id and again.stale == {row.session_id}
    waiting = await server.store.session(row.session_id)
    assert waiting is not None and await server.dispatcher.batch([waiting]) == 1
    assert calls == ["/sessions", f"/sessions/{row.session_id}/cancel"]  # 409: the stale attempt, cancelled
    now = await server.store.session(row.session_id)
    assert now is not None and now.status is S.REGISTERED and server.counters.errors["dispatch_stale_attempt"] == 1
