"""Several rollout server workers on one PostgreSQL store, with real gateways (bubblewrap sandboxes, the curl
harness) on loopback: a task submitted to one worker runs on every worker's gateways, each session once; events,
results and cancels cross workers; a gateway that loses its worker is followed by the worker it registers with; a
gateway that dies has its sessions run elsewhere."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from tests.server._server_kit import Harness, RunningServer, make_task, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("harness", ["postgres"], indirect=True)]

JSON = {"content-type": "application/json"}


async def _submit(srv: RunningServer, task_id: str, samples: int, **knobs: Any) -> list[str]:
    resp = await srv.http.post("/tasks", content=make_task(task_id, samples, **knobs).model_dump_json(), headers=JSON)
    assert resp.status_code == 201, resp.text
    return list(resp.json()["sessions"])


async def _attempts(srv: RunningServer, task_id: str) -> dict[str, int]:
    return {row.session_id: row.attempts for row in await srv.store.sessions_of(task_id)}


async def test_a_task_runs_on_every_workers_gateways_once_and_its_events_reach_every_worker(
        harness: Harness) -> None:
    first, second = await harness.server(worker="w1"), None
    second = await harness.server(db=first.store.path, worker="w2")
    gw_a, gw_b = await harness.gateway(run_slots=3), await harness.gateway(run_slots=3)
    id_a, id_b = await first.register(gw_a, 3), await second.register(gw_b, 3)
    sessions = await _submit(first, "t-spread", 12, sleep=0.5)

    events: list[dict[str, Any]] = []

    async def read_events() -> None:  # through the other worker than the one the task was submitted to
        async with second.http.stream("GET", "/tasks/t-spread/events") as stream:
            async for line in stream.aiter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))

    reader = asyncio.create_task(read_events())
    view = await second.wait_task("t-spread", 120)
    await asyncio.wait_for(reader, 20)
    assert view["status"] == "COMPLETED" and len(view["results"]) == 12
    assert set(view["gateways"].values()) == {id_a, id_b}  # both workers dispatched
    assert await _attempts(first, "t-spread") == {sid: 1 for sid in sessions}  # each claimed once
    ran = sum(gw_a.node.health()["finished"].values()) + sum(gw_b.node.health()["finished"].values())
    assert ran == 12  # no session ran twice
    seen = {sid for sid, status in events[0]["sessions"].items() if status == "COMPLETED"}
    seen |= {e["session_id"] for e in events if e["event"] == "finished" and e.get("status") == "COMPLETED"}
    assert seen == set(sessions) and events[-1]["event"] == "task_finished"
    fleet = {g["gateway_id"]: g["worker"] for g in (await first.http.get("/gateways")).json()["gateways"]}
    assert fleet == {id_a: "w1", id_b: "w2"}
    # a result waited for at one worker, filed by the other
    one = next(sid for sid, gid in view["gateways"].items() if gid == id_a)
    assert (await second.http.get(f"/sessions/{one}/result")).json()["status"] == "COMPLETED"


async def test_a_cancel_through_one_worker_stops_the_sandboxes_on_anothers_gateway(harness: Harness) -> None:
    owner = await harness.server(worker="w1")
    other = await harness.server(db=owner.store.path, worker="w2")
    gw = await harness.gateway(run_slots=2)
    await owner.register(gw, 2)
    await _submit(owner, "t-cancel", 2, sleep=60, calls=0)

    async def running() -> bool:
        return bool(gw.node.health()["stages"]["run"] == 2)

    await wait_for(running, 30, "both sessions to run")
    assert (await other.http.post("/tasks/t-cancel/cancel")).status_code == 200
    view = await owner.wait_task("t-cancel", 30)  # well before the sandboxes' 60 s sleep ends
    assert view["status"] == "CANCELLED" and set(view["sessions"].values()) == {"CANCELLED"}

    async def torn_down() -> bool:
        return gw.node.stages.live_runtimes() == 0

    await wait_for(torn_down, 30, "the gateway to tear the cancelled sandboxes down")


async def test_a_gateway_whose_worker_stopped_is_followed_by_the_worker_it_registers_with(harness: Harness) -> None:
    lost = await harness.server(worker="w1")
    taker = await harness.server(db=lost.store.path, worker="w2")
    gw = await harness.gateway(run_slots=2)
    gw_id = await lost.register(gw, 2)
    sessions = await _submit(lost, "t-moved", 2, sleep=3, calls=0)

    async def running() -> bool:
        return bool(gw.node.health()["stages"]["run"] == 2)

    await wait_for(running, 30, "both sessions to run")
    await lost.stop()  # the worker's process ends; its gateway registers with the next worker
    assert await taker.register(gw, 2) == gw_id
    view = await taker.wait_task("t-moved", 60)
    assert view["status"] == "COMPLETED" and set(view["gateways"].values()) == {gw_id}
    assert await _attempts(taker, "t-moved") == {sid: 1 for sid in sessions}  # the runs were kept, not redone
    assert sum(gw.node.health()["finished"].values()) == 2


async def test_a_dead_gateways_sessions_run_on_another_workers_gateway(harness: Harness) -> None:
    first = await harness.server(worker="w1")
    second = await harness.server(db=first.store.path, worker="w2")
    doomed, spare = await harness.gateway(run_slots=2), await harness.gateway(run_slots=2)
    await first.register(doomed, 2)
    await _submit(first, "t-dies", 2, sleep=8, calls=0)

    async def on_doomed() -> bool:
        return bool(doomed.node.health()["stages"]["run"] == 2)

    await wait_for(on_doomed, 30, "sessions to run on the first gateway")
    spare_id = await second.register(spare, 2)
    await doomed.stop()
    view = await second.wait_task("t-dies", 90)
    assert view["status"] == "COMPLETED", view
    assert set(view["gateways"].values()) == {spare_id}
    assert set((await _attempts(first, "t-dies")).values()) == {2}
