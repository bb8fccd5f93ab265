"""The Store's contract on both of its databases (SQLite, PostgreSQL), and what only several workers on one
PostgreSQL store need: a session claimed by two workers at once goes to one, hostile text is kept, and a change one
worker publishes reaches the other's ledger."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from polar_gym.schema import AgentSpec, SessionResult, SessionSpec, SessionStatus, TaskRequest
from polar_gym.server.background import Background
from polar_gym.server.callbacks import Callbacks
from polar_gym.server.counters import ServerCounters
from polar_gym.server.ledger import Ledger, _payload
from polar_gym.server.store import GatewayRow, Store
from tests._postgres import fresh_database
from tests._waiting import until

S = SessionStatus


@pytest.fixture(params=["sqlite", "postgres"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Where a Store keeps its tables: a SQLite file, or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return str(tmp_path / "db.sqlite")
    return fresh_database(request.getfixturevalue("postgres_url"))


def _task(task_id: str, n: int) -> tuple[TaskRequest, list[SessionSpec]]:
    task = TaskRequest(task_id=task_id, instruction="x", num_samples=n, agent=AgentSpec(harness="h"))
    return task, [SessionSpec.from_task(task, i) for i in range(n)]


async def test_tasks_claims_results_and_gateways_behave_the_same_on_both(target: str) -> None:
    store = Store(target)
    task, specs = _task("t", 2)
    assert await store.add_task(task, specs) is True
    assert await store.add_task(task, specs[:1]) is False  # idempotent on the task id
    first, second = specs[0].session_id, specs[1].session_id
    assert await store.assign(first, "gw") == 1 and await store.assign(first, "gw2") is None
    await store.release(first, "gw")  # a claim never posted: uncounted
    assert await store.assign(first, "gw2") == 1
    await store.requeue(first, "lost")
    assert await store.assign(first, "gw2") == 2
    gave_up = SessionResult(session_id=second, task_id="t", status=S.ERROR, reason="gave up\x00 here")
    assert await store.finish(gave_up) is True
    assert await store.finish(SessionResult(session_id=second, task_id="t", status=S.COMPLETED)) is False
    row = await store.session(second)
    assert row is not None and row.status is S.ERROR and row.result is not None
    assert row.result.reason in ("gave up\x00 here", "gave up\ufffd here")  # PostgreSQL text holds no NUL
    assert [r.session_id for r in await store.in_flight()] == [first]
    assert [r.session_id for r in await store.in_flight("gw2")] == [first] and await store.in_flight("gw") == []
    assert await store.unfinished("t") == 1
    assert await store.claim_callback("t") is True and await store.claim_callback("t") is False
    sessions, tasks = await store.counts()
    assert sessions == {"INITIALIZING": 1, "ERROR": 1} and tasks == {"open": 1, "finished": 0}
    await store.save_gateway(GatewayRow("gw2", "http://a:1", 4, "tok", "healthy", "w1"))
    await store.save_gateway(GatewayRow("gw2", "http://a:1", 6, "tok", "draining", "w2"))
    assert await store.gateways() == [GatewayRow("gw2", "http://a:1", 6, "tok", "draining", "w2")]
    assert await store.gateway_by_url("http://a:1") == GatewayRow("gw2", "http://a:1", 6, "tok", "draining", "w2")
    assert await store.in_flight_counts() == {"gw2": 1}
    await store.set_fleet_value("policy_version", "7")
    assert await store.fleet_value("policy_version") == "7" and await store.fleet_value("backends") is None
    rows = await store.finished_session_rows((0.0, ""), 10)
    assert [(r["session_id"], r["harness"]) for r in rows] == [(second, "h")]
    store.close()


async def test_two_workers_claiming_the_same_sessions_at_once_each_get_a_share_and_none_twice(
        postgres_url: str) -> None:
    url = fresh_database(postgres_url)
    one, two = Store(url), Store(url)
    task, specs = _task("t", 200)
    assert await one.add_task(task, specs)
    ids = [s.session_id for s in specs]
    start = threading.Barrier(2)

    def claim(store: Store, gateway: str) -> dict[str, int]:
        start.wait()
        return asyncio.run(store.assign_many([(i, gateway) for i in ids]))

    got_one, got_two = await asyncio.gather(asyncio.to_thread(claim, one, "gw-a"),
                                            asyncio.to_thread(claim, two, "gw-b"))
    assert set(got_one) | set(got_two) == set(ids) and not set(got_one) & set(got_two)
    assert {r.gateway_id for r in await one.sessions_of("t")} <= {"gw-a", "gw-b"}
    assert all(r.attempts == 1 for r in await two.sessions_of("t"))
    one.close()
    two.close()


async def test_a_change_one_worker_publishes_reaches_the_others_subscribers(postgres_url: str) -> None:
    url = fresh_database(postgres_url)

    def ledger(store: Store, worker: str) -> Ledger:
        counters = ServerCounters()
        callbacks = Callbacks(store, counters, Background(), lambda: None)  # type: ignore[arg-type,return-value]
        return Ledger(store, counters, callbacks, max_attempts=3, worker=worker)

    here, there = Store(url), Store(url)
    sender, receiver = ledger(here, "w1"), ledger(there, "w2")
    loop = asyncio.get_running_loop()
    stop = there.listen(lambda note: loop.call_soon_threadsafe(receiver.heard, note))
    own = here.listen(lambda note: loop.call_soon_threadsafe(sender.heard, note))
    try:
        with receiver.subscribe("t") as theirs, sender.subscribe("t") as mine:
            await until_listening(url, 2)  # both LISTEN before the first NOTIFY (a busy machine starts them late)
            await sender.notify("t", {"event": "finished", "session_id": "s-1", "status": "COMPLETED"})
            event = await asyncio.wait_for(theirs.get(), 10)
            assert (event["task_id"], event["event"], event["session_id"]) == ("t", "finished", "s-1")
            assert not receiver.wake.is_set()  # a finish elsewhere does not change this worker's queue
            assert (await mine.get())["session_id"] == "s-1" and mine.empty()  # its own comes once, not echoed
            await sender.notify("t", {"event": "requeued", "session_id": "s-2", "reason": "its gateway died"})
            assert (await asyncio.wait_for(theirs.get(), 10))["event"] == "requeued"
            assert receiver.wake.is_set()  # a session to dispatch, maybe here
            receiver.heard("not json")
            receiver.heard('{"worker": "w1", "event": ["no", "task"]}')
            assert receiver.counters.errors["change_unreadable"] == 2 and theirs.empty()
    finally:
        stop()
        own()
        here.close()
        there.close()


async def until_listening(url: str, n: int) -> None:
    """Wait until ``n`` connections of the database at ``url`` have run LISTEN (their last statement)."""
    import psycopg

    def count() -> int:
        with psycopg.connect(url) as db:
            row = db.execute("SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database() "
                             "AND query LIKE 'LISTEN %'").fetchone()
        return int(row[0]) if row else 0

    async def listening() -> bool:
        return await asyncio.to_thread(count) >= n

    await until(listening, what=f"{n} connections listening")


def test_an_event_too_large_for_one_notification_goes_without_its_session_list() -> None:
    big = {"task_id": "t", "event": "submitted", "sessions": [f"s-{i:06d}" for i in range(2000)], "reason": "r" * 9000}
    payload = _payload("w1", big)
    assert len(payload) < 8000 and '"sessions"' not in payload and '"submitted"' in payload
    assert len(_payload("w1", {"task_id": "t", "event": "finished"})) < 100
