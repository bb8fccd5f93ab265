"""The pure parts of the rollout server: gateway choice, task status, Prometheus rendering, the store's claims."""

from __future__ import annotations

from pathlib import Path

import pytest

import polar_gym.server as server_pkg
from polar_gym.prometheus import render
from polar_gym.schema import AgentSpec, SessionResult, SessionSpec, SessionStatus, TaskRequest
from polar_gym.server.fleet import DEAD, DRAINING, Fleet, GatewayRegistration
from polar_gym.server.store import SessionRow, Store
from polar_gym.server.tasks import task_state

S = SessionStatus


def test_exports() -> None:
    assert sorted(server_pkg.__all__) == server_pkg.__all__
    for name in server_pkg.__all__:
        assert hasattr(server_pkg, name)


def test_pick_prefers_least_loaded_healthy_gateways() -> None:
    fleet = Fleet()
    a = fleet.register(GatewayRegistration(url="http://a", capacity=1))
    b = fleet.register(GatewayRegistration(url="http://b/", capacity=3))
    assert fleet.pick() is b  # tie at zero load: the larger one
    b.sessions.add("s1")
    assert fleet.pick() is a
    a.sessions.add("s2")
    assert fleet.pick() is b
    b.suspect = True
    assert fleet.pick() is None
    b.suspect, b.row.state = False, DRAINING
    assert fleet.pick() is None
    assert fleet.register(GatewayRegistration(url="http://b", capacity=5)) is b  # same URL: refreshed
    assert b.row.state == "healthy" and b.row.capacity == 5
    a.row.state = DEAD
    assert fleet.live() == [b] and fleet.owner("s1") is b and fleet.owner("zz") is None
    with pytest.raises(ValueError):
        GatewayRegistration(url="a.example", capacity=1)


def _rows(*statuses: SessionStatus) -> list[SessionRow]:
    spec = SessionSpec(task_id="t", instruction="x", agent=AgentSpec(harness="h"))
    return [SessionRow(spec, s, None, 0, None, None, 0.0, None) for s in statuses]


@pytest.mark.parametrize(("statuses", "cancelled", "expected"), [
    ((S.REGISTERED, S.REGISTERED), False, S.REGISTERED),
    ((S.REGISTERED, S.RUNNING), False, S.RUNNING),
    ((S.COMPLETED, S.ERROR), False, S.COMPLETED),
    ((S.ERROR, S.TIMEOUT), False, S.ERROR),
    ((S.CANCELLED, S.CANCELLED), False, S.CANCELLED),
    ((S.COMPLETED, S.CANCELLED), True, S.CANCELLED),
])
def test_task_state(statuses: tuple[SessionStatus, ...], cancelled: bool, expected: SessionStatus) -> None:
    assert task_state(_rows(*statuses), cancelled) == expected


def test_render_escapes_labels() -> None:
    text = render([("x_total", "counter", "Things.", [({"cause": 'a "b"\n'}, 2), ({}, 0.5)])])
    assert text == '# HELP x_total Things.\n# TYPE x_total counter\nx_total{cause="a \\"b\\"\\n"} 2\nx_total 0.5\n'


async def test_store_is_idempotent_and_claims_once(tmp_path: Path) -> None:
    store = Store(tmp_path / "db.sqlite")
    task = TaskRequest(task_id="t", instruction="x", num_samples=2, agent=AgentSpec(harness="h"))
    specs = [SessionSpec.from_task(task, i) for i in range(2)]
    assert await store.add_task(task, specs) is True
    assert await store.add_task(task, [SessionSpec.from_task(task, 0)]) is False
    assert len(await store.sessions_of("t")) == 2
    first = specs[0].session_id
    assert await store.assign(first, "gw") == 1
    assert await store.assign(first, "gw2") is None  # already claimed
    await store.requeue(first, "lost")
    assert await store.assign(first, "gw2") == 2
    await store.finish(SessionResult(session_id=specs[1].session_id, task_id="t", status=S.CANCELLED))
    assert await store.assign(specs[1].session_id, "gw") is None  # finished sessions are never dispatched
    assert [r.session_id for r in await store.in_flight()] == [first]
    assert await store.claim_callback("t") is True and await store.claim_callback("t") is False
    assert await store.pending_callbacks() == ["t"]
    sessions, tasks = await store.counts()
    assert sessions == {"INITIALIZING": 1, "CANCELLED": 1} and tasks == {"open": 1, "finished": 0}
    store.close()


async def test_the_first_final_result_stays(tmp_path: Path) -> None:
    """A gateway's late COMPLETED must not overwrite the server's giving up (ERROR), nor the reverse: the race
    behind a task reported COMPLETED after its gateway had been declared dead (issue 11, fault 11)."""
    store = Store(tmp_path / "db.sqlite")
    task = TaskRequest(task_id="t", instruction="x", num_samples=1, agent=AgentSpec(harness="h"))
    spec = SessionSpec.from_task(task, 0)
    await store.add_task(task, [spec])
    gave_up = SessionResult(session_id=spec.session_id, task_id="t", status=S.ERROR, reason="gave up")
    assert await store.finish(gave_up) is True
    late = SessionResult(session_id=spec.session_id, task_id="t", status=S.COMPLETED)
    assert await store.finish(late) is False
    row = await store.session(spec.session_id)
    assert row is not None and row.status is S.ERROR and row.result == gave_up
    store.close()


async def test_a_corrupted_row_is_quarantined_once_and_for_all(tmp_path: Path) -> None:
    import sqlite3

    store = Store(tmp_path / "db.sqlite")
    task = TaskRequest(task_id="t", instruction="x", num_samples=3, agent=AgentSpec(harness="h"))
    specs = [SessionSpec.from_task(task, i) for i in range(3)]
    await store.add_task(task, specs)
    with sqlite3.connect(tmp_path / "db.sqlite") as conn:
        conn.execute("UPDATE sessions SET spec = '{\"broken' WHERE session_id = ?", (specs[0].session_id,))
        conn.execute("UPDATE sessions SET status = 'NONSENSE' WHERE session_id = ?", (specs[1].session_id,))
        conn.execute("UPDATE tasks SET request = '[]' WHERE task_id = 't'")
    waiting = await store.undispatched()
    assert [(r.session_id, r.status) for r in waiting] == [(specs[0].session_id, S.ERROR),
                                                           (specs[2].session_id, S.REGISTERED)]
    assert (waiting[0].reason or "").startswith("quarantined:")
    rows = {r.session_id: r for r in await store.sessions_of("t")}
    assert rows[specs[1].session_id].status is S.ERROR and rows[specs[2].session_id].status is S.REGISTERED
    assert [r.session_id for r in await store.undispatched()] == [specs[2].session_id]  # stored, not re-tried
    row = await store.task("t")
    assert row is not None and (row.quarantined or "").startswith("quarantined:") and row.request.task_id == "t"
    store.close()
