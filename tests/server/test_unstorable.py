"""A result the rollout server cannot read or store is set aside once with its cause, never retried in a loop (issue
35, break 3: a gateway's result whose reward was inf went out with ``"reward": null``; the watcher logged it as
unreadable, kept the session and polled again, the gateway answered at once with the same result: 8,900 log lines in
120 s and a launch that never ended). The gateway is an httpx.MockTransport; the store is a real SQLite file."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from polar_gym.causes import UNSTORABLE_RESULT, cause_of
from polar_gym.schema import AgentSpec, GatewayRegistration, SessionResult, SessionStatus, TaskRequest
from polar_gym.server import RolloutServer
from polar_gym.server.store import SessionRow
from tests._waiting import until

S = SessionStatus


async def _one_session(server: RolloutServer) -> SessionRow:
    await server.submit(TaskRequest(task_id="t", instruction="x", agent=AgentSpec(harness="h")))
    [row] = await server.store.undispatched()
    return row


async def _ended(server: RolloutServer, session_id: str) -> SessionRow:
    async def probe() -> SessionRow | None:
        row = await server.store.session(session_id)
        return row if row is not None and row.status.terminal else None

    row: SessionRow = await until(probe, what=f"session {session_id} to end")
    return row


@pytest.mark.parametrize("bad", [
    {"evaluation": {"reward": None}},  # what a gateway made of reward inf
    {"evaluation": {"reward": "Infinity"}},
    {"status": "NOT_A_STATUS"},
], ids=["reward-null", "reward-string", "status"])
async def test_a_result_the_server_cannot_read_ends_its_session_once(make_server: Callable[..., RolloutServer],
                                                                     bad: dict[str, Any]) -> None:
    polled: list[list[str]] = []
    session_id = ""

    async def gateway(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(0)  # a real gateway's answer is a network round trip: the loop runs meanwhile
        if request.url.path == "/sessions":
            return httpx.Response(201, json={"session_id": session_id, "attempt_id": "a1", "status": "INITIALIZING"})
        assert request.url.path == "/sessions/poll"
        polled.append(json.loads(request.content)["session_ids"])
        result = {"session_id": session_id, "task_id": "t", "status": "COMPLETED", "metadata": {"attempt_id": "a1"},
                  **bad}
        return httpx.Response(200, json={"results": [result], "statuses": {}, "unknown": []})

    server = make_server(gateway)
    gw = await server.register(GatewayRegistration(url="http://gw", capacity=4))
    row = await _one_session(server)
    session_id = row.session_id
    assert await server.dispatcher.batch([row]) == 1

    async def ended_or_looping() -> bool:
        row = await server.store.session(session_id)
        return len(polled) > 20 or (row is not None and row.status.terminal)

    await until(ended_or_looping, what="the session to end, or the watcher to ask for it again and again")
    assert polled == [[session_id]]  # asked once; the watcher has nothing left to ask for
    ended = await _ended(server, session_id)
    assert ended.status is S.ERROR and cause_of(ended.status.value, ended.reason, {}) == UNSTORABLE_RESULT
    assert (ended.reason or "").startswith(f"{UNSTORABLE_RESULT}: the result {gw.gateway_id} sent could not be "
                                           "read: ")
    assert gw.sessions == set() and server.counters.errors["result_unreadable"] == 1
    assert (await server.task_view("t"))["status"] == "ERROR"  # the task, and a launch waiting on it, ends


async def test_a_result_the_store_cannot_write_is_set_aside_with_its_cause(make_server: Callable[..., RolloutServer],
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    server = make_server(lambda request: httpx.Response(500))
    row = await _one_session(server)
    finish = server.store.finish
    tried: list[SessionResult] = []

    async def failing_once(result: SessionResult) -> bool:
        tried.append(result)
        if len(tried) == 1:
            raise sqlite3.OperationalError("database or disk is full")
        return await finish(result)

    monkeypatch.setattr(server.store, "finish", failing_once)
    good = SessionResult(session_id=row.session_id, task_id="t", status=S.COMPLETED)
    await server.ledger.finish(good, None)
    ended = await server.store.session(row.session_id)
    assert ended is not None and ended.status is S.ERROR
    assert ended.reason == (f"{UNSTORABLE_RESULT}: the result could not be stored (OperationalError: database or "
                            "disk is full)")
    assert len(tried) == 2 and server.counters.errors["result_unstorable"] == 1
    assert (await server.task_view("t"))["status"] == "ERROR"
