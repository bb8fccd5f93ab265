"""GatewayClient against the real gateway app (httpx.ASGITransport, no sockets): every method the rollout server
uses hits the route it names with the body the route reads, so a route or a field renamed on one side fails here.
The stage functions are scripted (ScriptedStages), so no sandbox runs; failures are translated into typed errors."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio

from polar_gym.gateway import GatewayConfig, GatewayNode, create_gateway_app
from polar_gym.gateway.client import GatewayClient
from polar_gym.gateway.errors import GatewayBadReply, GatewayRefused, GatewayUnreachable
from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.engines.oracle import OracleEngine
from polar_gym.proxy.service import ProxyService, SessionRegistry
from polar_gym.result_codec import unpack
from polar_gym.schema import AgentSpec, SessionSpec, SessionStatus, WeightUpdateRequest
from tests._fakes import ByteTokenizer
from tests.gateway._gw_doubles import ScriptedStages

ADMIN = "client-test-admin"


def _spec(session_id: str, **metadata: object) -> SessionSpec:
    return SessionSpec(session_id=session_id, task_id="t-client", instruction="x", agent=AgentSpec(harness="h"),
                       metadata=metadata)


@pytest_asyncio.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[tuple[GatewayClient, GatewayNode, ScriptedStages]]:
    stages = ScriptedStages()
    node = GatewayNode(stages, GatewayConfig(run_slots=4))
    service = ProxyService(OracleEngine(ByteTokenizer()), CaptureJournal(tmp_path / "capture"),
                           SessionRegistry(allow_adhoc=False))
    app = create_gateway_app(node, service, ADMIN)
    async with GatewayClient.connect("http://gw/", ADMIN, transport=httpx.ASGITransport(app=app)) as client:
        yield client, node, stages
    await node.stop()


async def test_sessions_start_poll_cancel(gateway: tuple[GatewayClient, GatewayNode, ScriptedStages]) -> None:
    client, node, stages = gateway
    view = await client.start_session(_spec("quick"))
    assert view.session_id == "quick" and view.task_id == "t-client"
    await client.start_session(_spec("held", hold="run"))
    with pytest.raises(GatewayRefused) as dup:  # it still runs here
        await client.start_session(_spec("held", hold="run"))
    assert (dup.value.status, dup.value.kind) == (409, "duplicate_session")
    seen: set[str] = set()
    while "quick" not in seen:  # a poll answers as soon as one of them finished
        polled = await client.poll(["quick", "held", "nope"], wait=10.0)
        assert polled.unreadable == [] and polled.unknown == ["nope"]
        seen |= {r.session_id for r in polled.results}
        assert "held" in polled.statuses
    done = (await client.poll(["quick"], wait=0.0)).results[0]  # packed: filed by its head, decoded on demand
    assert done.status == SessionStatus.COMPLETED and done.task_id == "t-client"
    assert unpack(done.data) == await node.wait("quick", 10.0)
    # a finished session posted again (the rollout server gave that attempt up) runs as a new attempt
    again = await client.start_session(_spec("quick"))
    assert again.attempt_id and again.attempt_id != view.attempt_id
    result = await node.wait("quick", 10.0)
    assert result.metadata["attempt_id"] == again.attempt_id

    cancelled = await client.cancel_session("held")
    assert cancelled.cancelled and cancelled.session_id == "held"
    result = await node.wait("held", 10.0)
    assert result.status == SessionStatus.CANCELLED
    with pytest.raises(GatewayRefused) as unknown:
        await client.cancel_session("nope")
    assert (unknown.value.status, unknown.value.kind) == (404, "unknown_session")
    assert stages.started  # the scripted stages ran: the sessions went through the node


async def test_health_and_the_proxy_admin_calls(gateway: tuple[GatewayClient, GatewayNode, ScriptedStages]) -> None:
    client, _, _ = gateway
    health = await client.health(timeout=5.0)
    assert health.accepting and health.status == "ok" and set(health.stages) >= {"queued", "run"}

    assert (await client.add_upstream("http://127.0.0.1:9/v1")).added == "http://127.0.0.1:9/v1"
    upstreams = await client.upstreams()
    assert not upstreams.paused and [s["url"] for s in upstreams.servers] == ["oracle://local",
                                                                              "http://127.0.0.1:9/v1"]
    paused = await client.pause()
    assert paused.paused and paused.drained_seconds >= 0
    assert (await client.upstreams()).paused
    resumed = await client.resume(policy_version=7)
    assert (resumed.paused, resumed.policy_version) == (False, 7)
    updated = await client.update_weights(WeightUpdateRequest(checkpoint="/ckpt/step-8", policy_version=8))
    assert (updated.policy_version, updated.previous_version, updated.servers) == (8, 7, {})  # the oracle: a stamp
    assert (await client.upstreams()).checkpoint == "/ckpt/step-8"
    assert (await client.remove_upstream("http://127.0.0.1:9/v1")).removed is True
    assert [s["url"] for s in (await client.upstreams()).servers if not s["removed"]] == ["oracle://local"]


async def test_a_wrong_token_is_refused(tmp_path: Path) -> None:
    node = GatewayNode(ScriptedStages(), GatewayConfig())
    service = ProxyService(OracleEngine(ByteTokenizer()), CaptureJournal(tmp_path / "capture"),
                           SessionRegistry(allow_adhoc=False))
    app = create_gateway_app(node, service, ADMIN)
    async with GatewayClient.connect("http://gw", "wrong", transport=httpx.ASGITransport(app=app)) as client:
        with pytest.raises(GatewayRefused) as refused:
            await client.start_session(_spec("s"))
        assert refused.value.status == 401
        with pytest.raises(GatewayRefused):
            await client.pause()
        assert (await client.health()).accepting  # health is open
    await node.stop()


async def test_transport_failures_and_bad_answers_are_typed() -> None:
    def unreachable(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    async with GatewayClient.connect("http://gw", transport=httpx.MockTransport(unreachable)) as client:
        with pytest.raises(GatewayUnreachable) as exc:
            await client.health()
        assert not exc.value.connected  # never got there: a dispatch attempt is refunded

    def timeout(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("slow", request=request)

    async with GatewayClient.connect("http://gw", transport=httpx.MockTransport(timeout)) as client:
        with pytest.raises(GatewayUnreachable) as exc:
            await client.start_session(_spec("s"))
        assert exc.value.connected  # it may have arrived

    good = {"session_id": "a", "task_id": "t", "status": "COMPLETED"}

    def odd(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/sessions/poll":
            return httpx.Response(200, json={"results": [good, {"session_id": 3}], "statuses": {"b": "RUNNING"}})
        if request.url.path == "/admin/pause":
            return httpx.Response(503, text="busy")
        return httpx.Response(200, text="not json")

    async with GatewayClient.connect("http://gw", transport=httpx.MockTransport(odd)) as client:
        polled = await client.poll(["a", "b"], wait=0.0)
        assert [r.session_id for r in polled.results] == ["a"] and len(polled.unreadable) == 1
        assert polled.statuses == {"b": "RUNNING"} and polled.unknown == []
        with pytest.raises(GatewayBadReply):
            await client.health()
        with pytest.raises(GatewayRefused) as refused:
            await client.pause()
        assert (refused.value.status, refused.value.kind, refused.value.text, refused.value.body) == \
            (503, "http_503", "busy", None)
