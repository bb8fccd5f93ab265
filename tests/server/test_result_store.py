"""Results in the rollout server's store: kept packed (about their unique token bytes), read back exactly, a store of
an older version (JSON results) migrated in place, and the retention policy applied once a trainer has them."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from polar_gym.result_codec import head, unpack
from polar_gym.schema import AgentSpec, SessionSpec, SessionStatus, TaskRequest
from polar_gym.server.callbacks import ResultRetention
from polar_gym.server.client import RolloutClient
from polar_gym.server.receiver import CallbackReceiver
from polar_gym.server.store import Store
from tests.server._server_kit import SERVER_TOKEN, Harness, make_task, wait_for
from tests.server.test_result_codec import growing_session

S = SessionStatus


async def _store_with_results(tmp_path: Path, n: int = 2) -> tuple[Store, list[str]]:
    store = Store(tmp_path / "db.sqlite")
    task = TaskRequest(task_id="t-1", instruction="x", num_samples=n, agent=AgentSpec(harness="h"))
    specs = [SessionSpec.from_task(task, i) for i in range(n)]
    assert await store.add_task(task, specs)
    for i, spec in enumerate(specs):
        result = growing_session(turns=10, seed=i).model_copy(update={"session_id": spec.session_id})
        assert await store.finish(result) is True
    return store, [s.session_id for s in specs]


async def test_a_result_is_stored_packed_and_reads_back_exactly(tmp_path: Path) -> None:
    store, ids = await _store_with_results(tmp_path)
    row = await store.session(ids[1])
    assert row is not None and row.result == growing_session(turns=10, seed=1).model_copy(
        update={"session_id": ids[1]})
    with sqlite3.connect(tmp_path / "db.sqlite") as con:
        packed, result, = con.execute("SELECT packed, result FROM sessions WHERE session_id = ?", (ids[1],)).fetchone()
    assert result is None and unpack(packed) == row.result
    assert len(packed) < len(row.result.model_dump_json()) / 5
    rows = await store.finished_session_rows((0.0, ""), 10)  # the viewer's columns come from the stored head
    assert [(r["reward"], r["traces"], r["completions"], r["seconds"], r["artifacts_cause"]) for r in rows] \
        == [(1.0, 10, 10, 12.5, "none_really")] * 2
    store.close()


async def test_a_corrupt_packed_result_is_quarantined_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Bytes that do not unpack: the session reads back ERROR with the reason, and the stand-in replaces the packed
    bytes, so later reads neither fail nor log again."""
    store, ids = await _store_with_results(tmp_path)
    with sqlite3.connect(tmp_path / "db.sqlite") as con:
        con.execute("UPDATE sessions SET packed = ? WHERE session_id = ?", (b"PGR\x01 truncated", ids[0]))
    first = await store.session(ids[0])
    assert first is not None and first.status is S.ERROR and (first.reason or "").startswith("quarantined:")
    caplog.clear()
    again = await store.session(ids[0])
    assert again is not None and again.reason == first.reason and caplog.records == []
    other = await store.session(ids[1])
    assert other is not None and other.status is S.COMPLETED and other.result is not None
    store.close()


async def test_a_store_of_an_older_version_is_migrated_and_its_results_read(tmp_path: Path) -> None:
    """A db whose sessions table has no packed column and holds a JSON result: opened, the column is added, the old
    row reads back, and a new result is stored packed beside it."""
    db = tmp_path / "db.sqlite"
    old_result = growing_session(turns=3)
    task = TaskRequest(task_id="t-1", instruction="x", num_samples=2, agent=AgentSpec(harness="h"))
    specs = [SessionSpec.from_task(task, i) for i in range(2)]
    with sqlite3.connect(db) as con:
        con.executescript("""
            CREATE TABLE tasks (task_id TEXT PRIMARY KEY, request TEXT NOT NULL, created REAL NOT NULL,
                cancelled INTEGER NOT NULL DEFAULT 0, callback_state TEXT, callback_error TEXT);
            CREATE TABLE sessions (session_id TEXT PRIMARY KEY, task_id TEXT NOT NULL, sample_index INTEGER NOT NULL,
                spec TEXT NOT NULL, status TEXT NOT NULL, gateway_id TEXT, attempts INTEGER NOT NULL DEFAULT 0,
                reason TEXT, result TEXT, created REAL NOT NULL, dispatched REAL, finished REAL);""")
        con.execute("INSERT INTO tasks(task_id, request, created) VALUES (?, ?, 1)", ("t-1", task.model_dump_json()))
        con.execute("INSERT INTO sessions VALUES (?, 't-1', 0, ?, 'COMPLETED', NULL, 1, NULL, ?, 1, 1, 2)",
                    (specs[0].session_id, specs[0].model_dump_json(),
                     old_result.model_copy(update={"session_id": specs[0].session_id}).model_dump_json()))
        con.execute("INSERT INTO sessions VALUES (?, 't-1', 1, ?, 'RUNNING', 'gw', 1, NULL, NULL, 1, 1, NULL)",
                    (specs[1].session_id, specs[1].model_dump_json()))
    store = Store(db)
    new = growing_session(turns=4).model_copy(update={"session_id": specs[1].session_id})
    assert await store.finish(new) is True
    rows = {r.session_id: r for r in await store.sessions_of("t-1")}
    assert rows[specs[0].session_id].result == old_result.model_copy(update={"session_id": specs[0].session_id})
    assert rows[specs[1].session_id].result == new
    viewed = await store.finished_session_rows((0.0, ""), 10)
    assert sorted((r["traces"], r["reward"]) for r in viewed) == [(3, 1.0), (4, 1.0)]
    store.close()


@pytest.mark.parametrize("mode", ["compact", "drop"])
async def test_retention_cuts_a_delivered_tasks_results_down(tmp_path: Path, mode: ResultRetention) -> None:
    store, ids = await _store_with_results(tmp_path)
    before = {i: len((await store.session(i)).result.model_dump_json()) for i in ids}  # type: ignore[union-attr]
    assert await store.retain("t-1", mode) == 2
    assert await store.retain("t-1", mode) == 0  # once
    for session_id in ids:
        row = await store.session(session_id)
        assert row is not None and row.result is not None and row.status is S.COMPLETED
        kept = row.result
        assert kept.trajectory is None and kept.evaluation is not None and kept.evaluation.reward == 1.0
        if mode == "compact":  # all but the trajectory
            assert kept.timings == {"total": 12.5, "run": 10.0} and kept.metadata["attempt_id"] == "a-7"
        else:  # the head's fields only
            assert kept.timings == {} and kept.metadata == {}
        assert len(kept.model_dump_json()) < before[session_id] / 50
    with sqlite3.connect(tmp_path / "db.sqlite") as con:
        heads = [head(p) for (p,) in con.execute("SELECT packed FROM sessions")]
    assert {h.retained for h in heads} == {mode}
    with pytest.raises(ValueError, match="unknown result retention"):
        await store.retain("t-1", "keep")
    store.close()


async def test_a_server_compacts_results_once_their_callback_was_delivered(harness: Harness) -> None:
    """Through the real server and gateway: the trainer's callback carries the whole results; afterwards the
    store holds them without trajectories."""
    receiver = CallbackReceiver()
    async with receiver.serve():
        gw = await harness.gateway()
        srv = await harness.server(result_retention="compact")
        await srv.register(gw, 2)
        task = receiver.attach(make_task("t-retained", 2))
        await srv.http.post("/tasks", content=task.model_dump_json(), headers={"content-type": "application/json"})
        body = await receiver.wait_for("t-retained", 60)
        assert [len(r["trajectory"]["traces"]) for r in body["results"]] == [1, 1]

        async def compacted() -> bool:
            view = (await srv.http.get("/tasks/t-retained")).json()
            return all(r["trajectory"] is None for r in view["results"])

        await wait_for(compacted, 60, "the delivered results compacted")
        view = (await srv.http.get("/tasks/t-retained")).json()
        assert view["status"] == "COMPLETED" and [r["evaluation"]["reward"] for r in view["results"]] == [1.0, 1.0]
        assert all(r["trajectory"] is None for r in view["results"])


async def test_a_trainer_takes_each_packed_result_once_through_the_cursor(harness: Harness) -> None:
    """GET /tasks/{id}/results answers the finished results packed, and only those past the cursor it gave;
    RolloutClient.results yields each session once, equal to the JSON view's result, then releases the task (the
    server's retention, ``keep`` here, changes nothing)."""
    gw = await harness.gateway()
    srv = await harness.server()
    await srv.register(gw, 2)
    task = make_task("t-packed", 3)
    await srv.http.post("/tasks", content=task.model_dump_json(), headers={"content-type": "application/json"})
    async with RolloutClient(srv.url, SERVER_TOKEN) as client:
        yielded = [r async for r in client.results(["t-packed"], timeout=60, poll=0.1)]
        meta, blobs = await client.packed_results("t-packed")
        assert meta["status"] == "COMPLETED" and len(blobs) == 3 and meta["aggregate"]["mean_reward"] == 1.0
        finished, last = meta["cursor"]
        again, none = await client.packed_results("t-packed", {"after": finished, "after_session": last})
        assert none == [] and again["cursor"] == meta["cursor"]
    view = (await srv.http.get("/tasks/t-packed")).json()
    assert sorted(r.session_id for r in yielded) == sorted(view["sessions"])
    by_id = {r["session_id"]: r for r in view["results"]}
    assert all(r.model_dump(mode="json") == by_id[r.session_id] for r in yielded)
    missing = await srv.http.get("/tasks/nope/results")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "unknown_task"


async def test_a_released_task_is_compacted_and_a_running_one_is_refused(harness: Harness) -> None:
    """A trainer without a callback releases what it took: the server then applies its retention; a task still
    running answers 409, an unknown one 404."""
    gw = await harness.gateway()
    srv = await harness.server(result_retention="compact")
    await srv.register(gw, 2)
    slow = make_task("t-slow", 1, sleep=30)
    for task in (make_task("t-taken", 2), slow):
        await srv.http.post("/tasks", content=task.model_dump_json(), headers={"content-type": "application/json"})
    async with RolloutClient(srv.url, SERVER_TOKEN) as client:
        taken = [r async for r in client.results(["t-taken"], timeout=60, poll=0.1)]
        assert [len(r.trajectory.traces) for r in taken] == [1, 1]  # type: ignore[union-attr]
        running = await client.http.post("/tasks/t-slow/release")
        assert running.status_code == 409 and running.json()["error"]["type"] == "task_running"
        unknown = await client.http.post("/tasks/nope/release")
        assert unknown.status_code == 404
        again = await client.release("t-taken")
        assert again == {"task_id": "t-taken", "retention": "compact", "results_changed": 0}  # already done
    view = (await srv.http.get("/tasks/t-taken")).json()
    assert [r["trajectory"] for r in view["results"]] == [None, None]
    await srv.http.post("/tasks/t-slow/cancel")
