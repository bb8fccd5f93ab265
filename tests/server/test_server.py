"""The rollout server against real gateways over loopback: tasks complete, resubmits are idempotent, cancels reach
the sandboxes, dispatch prefers the least-loaded gateway, a dead gateway's sessions move, a restart keeps
everything, callbacks survive a failing receiver, and metrics parse."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
from typing import Any

import atif
import httpx
import pytest
from fastapi import HTTPException
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from polar_gym.schema import TaskMetadata
from polar_gym.server import CallbackReceiver, RolloutClient
from polar_gym.server.core import RolloutServer
from polar_gym.serving import free_port, serving
from tests.server._server_kit import BOTH_STORES, SERVER_TOKEN, Harness, make_task, wait_for

pytestmark = pytest.mark.slow


async def test_task_runs_all_samples_and_resubmit_is_idempotent(harness: Harness) -> None:
    gw = await harness.gateway()
    srv = await harness.server()
    await srv.register(gw, 4)
    task = make_task("t-basic", 3)
    resp = await srv.http.post("/tasks", content=task.model_dump_json(), headers={"content-type": "application/json"})
    assert resp.status_code == 201 and resp.json()["created"] is True
    sessions = list(resp.json()["sessions"])
    assert len(sessions) == 3

    events: list[dict[str, Any]] = []

    async def read_events() -> None:
        async with srv.http.stream("GET", "/tasks/t-basic/events") as stream:
            async for line in stream.aiter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))

    reader = asyncio.create_task(read_events())
    view = await srv.wait_task("t-basic")
    await asyncio.wait_for(reader, 10)
    assert view["status"] == "COMPLETED"
    assert set(view["sessions"].values()) == {"COMPLETED"}
    assert view["aggregate"]["counts"] == {"COMPLETED": 3} and view["aggregate"]["mean_reward"] == 1.0
    assert len(view["results"]) == 3 and all(r["trajectory"]["traces"] for r in view["results"])
    assert events[0]["event"] == "snapshot" and events[-1]["event"] == "task_finished"
    seen = {sid for sid, status in events[0]["sessions"].items() if status == "COMPLETED"}  # before subscribing
    seen |= {e["session_id"] for e in events if e["event"] == "finished" and e.get("status") == "COMPLETED"}
    assert seen == set(sessions)

    again = await srv.http.post("/tasks", content=task.model_dump_json(), headers={"content-type": "application/json"})
    assert again.status_code == 200 and again.json()["created"] is False
    assert list(again.json()["sessions"]) == sessions
    result = await srv.http.get(f"/sessions/{sessions[0]}/result")
    assert result.status_code == 200 and result.json()["status"] == "COMPLETED"
    doc = atif.Trajectory.model_validate((await srv.http.get(f"/sessions/{sessions[0]}/result",
                                                             params={"format": "atif"})).json())
    assert doc.agent.name == task.agent.harness and doc.extra and doc.extra["reward"] == 1.0
    assert any(step.metrics and step.metrics.completion_token_ids for step in doc.steps)
    assert (await srv.http.get("/tasks")).json()["tasks"] == ["t-basic"]

    async with RolloutClient(srv.url, SERVER_TOKEN) as client:  # the trainer-side helper sees the same
        assert (await client.wait("t-basic", timeout=5))["aggregate"]["finished"] == 3


async def test_cancel_task_and_session(harness: Harness) -> None:
    gw = await harness.gateway()
    srv = await harness.server()
    await srv.register(gw, 4)
    await srv.http.post("/tasks", content=make_task("t-cancel", 2, sleep=60).model_dump_json(),
                        headers={"content-type": "application/json"})

    async def running() -> bool:
        view = (await srv.http.get("/tasks/t-cancel")).json()
        return set(view["sessions"].values()) == {"RUNNING"}

    await wait_for(running, 30, "both sessions to run")
    first = sorted((await srv.http.get("/tasks/t-cancel")).json()["sessions"])[0]
    assert (await srv.http.post(f"/sessions/{first}/cancel")).status_code == 200
    done = await srv.http.get(f"/sessions/{first}/result", params={"wait": 20})
    assert done.json()["status"] == "CANCELLED"
    await srv.http.post("/tasks/t-cancel/cancel")
    view = await srv.wait_task("t-cancel", 30)
    assert view["status"] == "CANCELLED" and set(view["sessions"].values()) == {"CANCELLED"}
    assert (await srv.http.post("/sessions/nope/cancel")).status_code == 404


async def test_least_loaded_dispatch_across_two_gateways(harness: Harness) -> None:
    small, big = await harness.gateway(1), await harness.gateway(3)
    srv = await harness.server()
    small_id, big_id = await srv.register(small, 1), await srv.register(big, 3)
    await srv.http.post("/tasks", content=make_task("t-spread", 4, sleep=1).model_dump_json(),
                        headers={"content-type": "application/json"})
    view = await srv.wait_task("t-spread")
    assert view["status"] == "COMPLETED"
    placed = list(view["gateways"].values())
    assert placed.count(small_id) == 1 and placed.count(big_id) == 3


@BOTH_STORES
async def test_dead_gateway_sessions_are_redispatched(harness: Harness) -> None:
    doomed, spare = await harness.gateway(), await harness.gateway()
    srv = await harness.server()
    doomed_id = await srv.register(doomed, 2)
    # No model call (calls=0): a call in flight when the gateway's HTTP server stops fails, the harness exits, and
    # the session could end on the dying gateway within its graceful shutdown. sleep 8: both sessions still run
    # when the first gateway dies, however far apart a loaded machine started them.
    await srv.http.post("/tasks", content=make_task("t-dies", 2, sleep=8, calls=0).model_dump_json(),
                        headers={"content-type": "application/json"})

    async def on_doomed() -> bool:
        return bool(doomed.node.health()["stages"]["run"] == 2)

    await wait_for(on_doomed, 30, "sessions to run on the first gateway")
    spare_id = await srv.register(spare, 2)
    await doomed.stop()
    view = await srv.wait_task("t-dies", 60)
    assert view["status"] == "COMPLETED", view
    assert set(view["gateways"].values()) == {spare_id}
    states = {g["gateway_id"]: g["state"] for g in (await srv.http.get("/gateways")).json()["gateways"]}
    assert states == {doomed_id: "dead", spare_id: "healthy"}
    first = next(iter(view["sessions"]))
    assert (await srv.http.get(f"/sessions/{first}/result")).json()["status"] == "COMPLETED"
    assert srv.core.counters.redispatched == 2


@BOTH_STORES
async def test_restart_keeps_tasks_and_resumes(harness: Harness) -> None:
    gw = await harness.gateway()
    srv = await harness.server()
    await srv.register(gw, 4)
    await srv.http.post("/tasks", content=make_task("t-before", 1).model_dump_json(),
                        headers={"content-type": "application/json"})
    await srv.wait_task("t-before")
    await srv.http.post("/tasks", content=make_task("t-during", 2, sleep=2).model_dump_json(),
                        headers={"content-type": "application/json"})

    async def dispatched() -> bool:
        view = (await srv.http.get("/tasks/t-during")).json()
        return all(v != "REGISTERED" for v in view["sessions"].values())

    await wait_for(dispatched, 30, "dispatch")
    await srv.stop()
    again = await harness.server(db=srv.store.path)
    before = (await again.http.get("/tasks/t-before")).json()
    assert before["status"] == "COMPLETED" and len(before["results"]) == 1
    view = await again.wait_task("t-during", 60)
    assert view["status"] == "COMPLETED" and len(view["results"]) == 2
    assert sorted((await again.http.get("/tasks")).json()["tasks"]) == ["t-before", "t-during"]


async def test_callbacks_retry_until_accepted_and_deduplicate(harness: Harness) -> None:
    failures = {"left": 2}

    def flaky(body: dict[str, Any]) -> None:
        if failures["left"] > 0:
            failures["left"] -= 1
            raise HTTPException(503, "not ready")

    receiver = CallbackReceiver(flaky)
    async with receiver.serve() as url:
        gw = await harness.gateway()
        srv = await harness.server()
        await srv.register(gw, 2)
        task = receiver.attach(make_task("t-callback", 2))
        await srv.http.post("/tasks", content=task.model_dump_json(), headers={"content-type": "application/json"})
        await asyncio.wait_for(receiver.arrived.wait(), 60)
        assert receiver.deliveries == 3 and list(receiver.received) == ["polar-task-t-callback"]
        body = receiver.received["polar-task-t-callback"]
        assert body["status"] == "COMPLETED" and body["aggregate"]["finished"] == 2
        async with httpx.AsyncClient() as client:  # a repeat without the signature is refused, not recorded
            repeat = await client.post(url, json=body, headers={"idempotency-key": "polar-task-t-callback"})
        assert repeat.status_code == 401 and len(receiver.received) == 1
        view = (await srv.http.get("/tasks/t-callback")).json()
        assert view["callback"] == {"state": "delivered", "error": None}


async def test_a_forged_callback_never_displaces_the_rollout_servers_signed_one(
        harness: Harness, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 35, point 5, end to end: an attacker who knows the predictable key posts a forged result before the
    server's delivery; the receiver refuses it (401), takes the server's signed one, and the secret that signs it
    comes back in no answer of the rollout server and in no log line."""
    caplog.set_level(logging.DEBUG)
    receiver = CallbackReceiver()
    async with receiver.serve() as url, httpx.AsyncClient() as attacker:
        gw = await harness.gateway()
        srv = await harness.server()
        await srv.register(gw, 2)
        task = receiver.attach(make_task("t-signed", 2, sleep=0.5))
        forged = {"task_id": "t-signed", "status": "COMPLETED", "results": [{"attacker-marker-7f3a": True}]}
        created = await srv.http.post("/tasks", content=task.model_dump_json(),
                                      headers={"content-type": "application/json"})
        assert created.status_code == 201
        refused = await attacker.post(url, json=forged, headers={"idempotency-key": "polar-task-t-signed"})
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "unsigned_callback"
        body = await receiver.wait_for("t-signed", 60)
        assert "attacker-marker-7f3a" not in json.dumps(body) and body["status"] == "COMPLETED"
        view = (await srv.http.get("/tasks/t-signed")).json()
        assert sorted(r["session_id"] for r in body["results"]) == sorted(view["sessions"])
        assert view["callback"] == {"state": "delivered", "error": None}
        answers = [created.text, json.dumps(view), (await srv.http.get("/tasks")).text]
        answers += [(await srv.http.get(f"/sessions/{sid}/result")).text for sid in view["sessions"]]
        async with srv.http.stream("GET", "/tasks/t-signed/events") as events:
            answers += [line async for line in events.aiter_lines()]
        assert all(receiver.secret not in answer for answer in answers)
        assert receiver.secret not in caplog.text
        assert os.stat(srv.store.path).st_mode & 0o077 == 0  # the store holding it is private


async def test_a_url_in_task_metadata_gets_no_post_from_the_gateway(harness: Harness) -> None:
    """The gateway used to POST every session result to ``metadata.callback_url``, a free-form field of the task:
    any URL a task named, unchecked and unsigned. Results now go back only through the rollout server."""
    hits: list[str] = []

    async def record(request: Request) -> PlainTextResponse:
        hits.append(request.url.path)
        return PlainTextResponse("ok")

    port = free_port()
    async with serving(Starlette(routes=[Route("/{path:path}", record, methods=["POST"])]), "127.0.0.1", port):
        gw = await harness.gateway()
        srv = await harness.server()
        await srv.register(gw, 2)
        task = make_task("t-metadata-url", 2).model_copy(
            update={"metadata": TaskMetadata(callback_url=f"http://127.0.0.1:{port}/steal")})
        await srv.http.post("/tasks", content=task.model_dump_json(), headers={"content-type": "application/json"})
        view = await srv.wait_task("t-metadata-url")
        assert view["status"] == "COMPLETED"
    assert hits == []


_SAMPLE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_][a-zA-Z0-9_]*="[^"]*",?)*\})? -?[0-9.e+-]+$')


def parse_prometheus(text: str) -> dict[str, float]:
    samples = {}
    for line in text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            continue
        assert _SAMPLE.match(line), f"not a Prometheus sample line: {line!r}"
        name, value = line.rsplit(" ", 1)
        samples[name] = float(value)
    return samples


async def test_metrics_and_backends(harness: Harness) -> None:
    gw = await harness.gateway()
    srv = await harness.server()
    await srv.register(gw, 2)
    await srv.http.post("/tasks", content=make_task("t-metrics", 1).model_dump_json(),
                        headers={"content-type": "application/json"})
    await srv.wait_task("t-metrics")
    server_text = (await srv.http.get("/metrics", headers={"x-admin-token": ""})).text
    samples = parse_prometheus(server_text)
    assert samples['polar_server_sessions{status="COMPLETED"}'] == 1
    assert samples["polar_server_dispatches_total"] == 1
    async with httpx.AsyncClient() as client:
        gw_samples = parse_prometheus((await client.get(f"{gw.url}/metrics")).text)
    assert gw_samples['polar_gateway_sessions_finished_total{status="COMPLETED"}'] == 1
    assert gw_samples['polar_gateway_tokens_captured_total{kind="response"}'] > 0

    added = await srv.http.post("/backends", json={"url": "http://127.0.0.1:9/v1"})
    assert added.status_code == 200 and added.json()["backends"] == ["http://127.0.0.1:9/v1"]
    listed = (await srv.http.get("/backends")).json()["gateways"]
    urls = [s["url"] for s in next(iter(listed.values()))["body"]["servers"]]
    assert "http://127.0.0.1:9/v1" in urls
    assert (await srv.http.post("/backends/pause")).status_code == 200
    resumed = (await srv.http.post("/backends/resume", json={"policy_version": 7})).json()["gateways"]
    assert next(iter(resumed.values()))["body"]["policy_version"] == 7
    assert gw.service.engine.pool.policy_version == 7
    removed = await srv.http.delete("/backends", params={"url": "http://127.0.0.1:9/v1"})
    assert removed.json()["backends"] == []


async def test_auth_and_bad_requests(tmp_path: Any) -> None:
    from tests.server._server_kit import Harness as H

    made = H(tmp_path)
    srv = await made.server()
    try:
        async with httpx.AsyncClient(base_url=srv.url) as anon:
            task = make_task("t-auth").model_dump(mode="json")
            assert (await anon.post("/tasks", json=task)).status_code == 401
            assert (await anon.get("/tasks")).status_code == 401
            wrong = await anon.post("/gateways/register", json={"url": "http://x", "capacity": 1},
                                    headers={"x-admin-token": "wrong"})
            assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "unauthorized"
            assert (await anon.get("/metrics")).status_code == 200
            assert (await anon.get("/openapi.json")).json()["info"]["title"] == "polar_gym rollout server"
        bad = await srv.http.post("/tasks", json={**task, "num_samples": 0})
        assert bad.status_code == 422 and bad.json()["error"]["type"] == "invalid_request"
        assert (await srv.http.post("/tasks", json={"task_id": "x"})).status_code == 422
        assert (await srv.http.get("/tasks/nope")).status_code == 404
        assert (await srv.http.get("/sessions/nope/result")).status_code == 404
        assert (await srv.http.post("/gateways/register", json={"url": "ftp://x", "capacity": 1})).status_code == 422
        assert (await srv.http.post("/gateways/register", json={"url": "http://x", "capacity": 0})).status_code == 422
        assert (await srv.http.post("/gateways/nope/drain")).status_code == 404
        assert (await srv.http.post("/gateways/nope/heartbeat", content=b"[1]")).status_code == 400
        assert (await srv.http.post("/gateways/nope/heartbeat", content=b"{nope")).status_code == 400
        assert (await srv.http.post("/gateways/nope/heartbeat", json={})).status_code == 404
        # a session waiting for a gateway answers 202 with its state
        await srv.http.post("/tasks", json=task)
        sid = next(iter((await srv.http.get("/tasks/t-auth")).json()["sessions"]))
        pending = await srv.http.get(f"/sessions/{sid}/result")
        assert pending.status_code == 202 and pending.json()["status"] == "REGISTERED"
    finally:
        await srv.stop()
        await asyncio.sleep(0)


def test_server_needs_a_token(tmp_path: Any) -> None:
    from polar_gym.server import Store, create_server_app
    from polar_gym.server.__main__ import parse_args

    store = Store(tmp_path / "x.sqlite")
    with pytest.raises(ValueError, match="admin token"):
        create_server_app(RolloutServer(store), "")
    store.close()
    with pytest.raises(SystemExit):
        parse_args(["--port", "1"])
    assert parse_args(["--admin-token", "t", "--db", "d.sqlite"]).admin_token == "t"


async def test_drain_heartbeat_and_giving_up(harness: Harness) -> None:
    drained, open_ = await harness.gateway(), await harness.gateway()
    srv = await harness.server(max_attempts=1)
    drained_id, open_id = await srv.register(drained, 4), await srv.register(open_, 4)
    beat = await srv.http.post(f"/gateways/{drained_id}/heartbeat", json={"live_sessions": 0, "status": "ok"})
    assert beat.status_code == 200 and beat.json()["health"]["status"] == "ok"
    assert (await srv.http.post(f"/gateways/{drained_id}/drain")).json()["state"] == "draining"
    # Under load this test saw COMPLETED (issue 11, fault 11): the gateway was stopped while a harness's model call
    # was in flight; the stopping HTTP server failed the call, the harness exited, the session ended on the gateway
    # within uvicorn's graceful shutdown and the server's in-flight long poll delivered it. So: no model call, and a
    # sleep far longer than the test (with sleep=5, sandboxes started seconds apart could also finish first).
    await srv.http.post("/tasks", content=make_task("t-drain", 2, sleep=600, calls=0).model_dump_json(),
                        headers={"content-type": "application/json"})

    async def running() -> bool:
        return bool(open_.node.health()["stages"]["run"] == 2)

    await wait_for(running, 30, "sessions to run on the open gateway")
    await open_.stop()  # with max_attempts=1 and the other gateway draining, the sessions fail with a reason
    view = await srv.wait_task("t-drain", 60)
    assert view["status"] == "ERROR" and set(view["gateways"].values()) == {open_id}
    assert all("gave up after 1 attempts" in r["reason"] for r in view["results"])
    errors = parse_prometheus((await srv.http.get("/metrics")).text)
    assert errors['polar_server_errors_total{cause="gateway_dead"}'] == 1
    assert (await srv.http.post(f"/gateways/{open_id}/heartbeat", json={})).status_code == 410
    # a gateway shutting down leaves at once (a server restarted on the store does not wait for it); not an error
    left = await srv.http.post(f"/gateways/{drained_id}/drain", json={"leaving": True})
    assert left.json()["state"] == "dead"
    assert {g.gateway_id: g.state for g in await srv.store.gateways()}[drained_id] == "dead"
    errors = parse_prometheus((await srv.http.get("/metrics")).text)
    assert errors['polar_server_errors_total{cause="gateway_dead"}'] == 1


async def test_a_withdrawing_drain_takes_back_what_has_not_run_and_refunds_its_attempt(harness: Harness) -> None:
    """The hand-over to the next Slurm job: a drain with ``withdraw`` cancels the sessions the gateway has queued
    (INIT, READY) and queues them again with their attempt refunded; the running one finishes there. Another gateway
    then runs the rest: every session ends once, in one attempt."""
    old = await harness.gateway(run_slots=1)
    srv = await harness.server(max_attempts=1)  # a withdrawn attempt that counted would fail its session
    old_id = await srv.register(old, 4)
    await srv.http.post("/tasks", content=make_task("t-withdraw", 4, sleep=3, calls=0).model_dump_json(),
                        headers={"content-type": "application/json"})

    async def one_runs_three_wait() -> bool:
        health = old.node.health()
        return bool(health["stages"]["run"] == 1 and health["live_sessions"] == 4)

    await wait_for(one_runs_three_wait, 60, "one session to run and three to wait on the old gateway")
    running = next(s.session_id for s in old.node.sessions() if s.status.value == "RUNNING")
    view = (await srv.http.post(f"/gateways/{old_id}/drain", json={"withdraw": True})).json()
    assert view["state"] == "draining" and view["in_flight"] == 1
    queued = {s.session_id: s.status.value for s in old.node.sessions() if s.session_id != running}
    new = await harness.gateway(run_slots=2)
    await srv.register(new, 4)
    done = await srv.wait_task("t-withdraw", 90)
    assert done["status"] == "COMPLETED" and done["gateways"][running] == old_id
    assert {done["gateways"][s] for s in queued} != {old_id}  # the withdrawn ones ran on the new gateway
    assert set(queued.values()) == {"CANCELLED"}  # on the old gateway, never run
    rows = {r.session_id: r for r in [await srv.store.session(s) for s in [running, *queued]] if r is not None}
    assert {r.attempts for r in rows.values()} == {1} and {r.status.value for r in rows.values()} == {"COMPLETED"}
    refused = await srv.http.post(f"/gateways/{old_id}/drain", json={"withdraw": "yes", "more": 1})
    assert refused.status_code in (400, 422)
