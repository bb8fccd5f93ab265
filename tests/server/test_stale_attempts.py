"""A gateway declared dead that comes back (a network partition, a stopped process): the attempts it still runs
are never taken. Real gateways and server (tests/server/_server_kit.py); the partition is the server's own verdict
(``declare_dead``, what missed heartbeats trigger), the gateway keeps running meanwhile."""

from __future__ import annotations

import pytest

from polar_gym.schema import SessionStatus
from tests.server._server_kit import BOTH_STORES, Harness, make_task, wait_for

pytestmark = pytest.mark.slow
JSON = {"content-type": "application/json"}


@BOTH_STORES
async def test_late_results_of_a_gateway_declared_dead_are_refused(harness: Harness) -> None:
    partitioned = await harness.gateway()
    srv = await harness.server()
    gw_id = await srv.register(partitioned, 2)
    await srv.http.post("/tasks", content=make_task("t-part", 2, sleep=3, calls=0).model_dump_json(), headers=JSON)

    async def running() -> bool:
        return bool(partitioned.node.health()["stages"]["run"] == 2)

    await wait_for(running, 30, "both sessions to run on the gateway")
    first = {s.session_id: s.attempt_id for s in partitioned.node.sessions()}
    await srv.core.watching.declare_dead(srv.core.fleet.gateways[gw_id])
    # a second gateway takes the sessions; the first comes back while its first attempts still run
    spare = await harness.gateway()
    spare_id = await srv.register(spare, 2)
    assert await srv.register(partitioned, 2) == gw_id
    view = await srv.wait_task("t-part", 60)
    assert view["status"] == "COMPLETED", view

    async def first_attempts_ended() -> bool:
        return all(partitioned.node.get(sid).result is not None for sid in first)

    await wait_for(first_attempts_ended, 30, "the partitioned gateway's attempts to end")
    stored = {r["session_id"]: r["metadata"]["attempt_id"] for r in view["results"]}
    assert set(stored) == set(first) and set(view["gateways"].values()) == {spare_id}
    for sid, attempt in stored.items():  # the stored result of every session is a new attempt, never the stale one
        assert attempt != first[sid]
        assert partitioned.node.get(sid).result.status is SessionStatus.COMPLETED  # type: ignore[union-attr]
    assert srv.core.counters.redispatched == 2


@BOTH_STORES
async def test_a_lone_gateway_that_comes_back_runs_a_fresh_attempt(harness: Harness) -> None:
    """No other gateway: the session goes back to the one that held it, as a new attempt (its stale one is
    cancelled there first), and only that attempt's result is stored."""
    lone = await harness.gateway()
    srv = await harness.server()
    gw_id = await srv.register(lone, 1)
    await srv.http.post("/tasks", content=make_task("t-lone", 1, sleep=6, calls=0).model_dump_json(),
                        headers=JSON)

    async def running() -> bool:
        return bool(lone.node.health()["stages"]["run"] == 1)

    await wait_for(running, 30, "the session to run")
    (stale,) = lone.node.sessions()
    stale_attempt = stale.attempt_id
    await srv.core.watching.declare_dead(srv.core.fleet.gateways[gw_id])
    assert await srv.register(lone, 1) == gw_id
    view = await srv.wait_task("t-lone", 90)
    assert view["status"] == "COMPLETED", view
    (result,) = view["results"]
    assert result["metadata"]["attempt_id"] != stale_attempt
    assert srv.core.counters.errors["dispatch_stale_attempt"] >= 1
