"""Issue 11, fault 10: model calls that fail for infrastructure reasons make the session ERROR with a cause, not
COMPLETED with reward 0. A real gateway (local sandbox, curl harness, vLLM engine) in front of a real loopback
upstream that answers like vLLM, then dies or answers 500, mid-session."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.engines.vllm import VLLMEngine
from polar_gym.proxy.providers.base import Route
from polar_gym.proxy.service import ProxyService, SessionRegistry
from polar_gym.proxy.upstreams import UpstreamPool
from polar_gym.schema import AgentSpec, BuilderSpec, EvaluatorSpec, RuntimeSpec, SessionSpec, SessionStatus
from tests._fakes import FakeVLLM
from tests._serving import served_gateway

S = SessionStatus


class ScriptedUpstream:
    """An HTTP/1.1 server on loopback that plays ``plan``, one step per request: ``ok`` answers like vLLM,
    ``500`` answers an internal error, ``die`` closes the listening socket and the connection without answering
    (the server process is gone: every later connection is refused)."""

    def __init__(self, plan: list[str]) -> None:
        self.plan = list(plan)
        self.fake = FakeVLLM(reply="working on it")
        self.served: list[str] = []
        self.server: asyncio.Server | None = None
        self.url = ""
        self.writers: set[asyncio.StreamWriter] = set()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.add(writer)
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                body = json.loads(await reader.readexactly(length)) if length else {}
                step = self.plan.pop(0) if self.plan else "ok"
                self.served.append(step)
                if step == "die":
                    assert self.server is not None
                    self.server.close()
                    break
                status, payload = (200, self.fake.answer(body)) if step == "ok" else (500, {"error": "boom"})
                data = json.dumps(payload).encode()
                writer.write(f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n"
                             f"content-length: {len(data)}\r\n\r\n".encode() + data)
                await writer.drain()
        writer.close()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[ScriptedUpstream]:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        try:
            yield self
        finally:
            self.server.close()
            for writer in self.writers:
                writer.close()
                with contextlib.suppress(ConnectionError):
                    await writer.wait_closed()


def _spec(calls: int) -> SessionSpec:
    return SessionSpec(
        session_id=f"up-{uuid.uuid4().hex[:8]}", task_id="upstream-test", instruction="say hello", timeout_seconds=60,
        runtime=RuntimeSpec(backend="local", network="gateway", workdir="/workspace"),
        agent=AgentSpec(harness="tests.gateway._gw_doubles:CurlHarness", model_name="policy", config={"calls": calls}),
        builder=BuilderSpec(strategy="per_request"),
        evaluator=EvaluatorSpec(strategy="tests.gateway._gw_doubles:PassEvaluator"))


async def _run(tmp_path: Path, plan: list[str], calls: int) -> tuple[ScriptedUpstream, object]:
    upstream = ScriptedUpstream(plan)
    async with upstream.running():
        engine = VLLMEngine(UpstreamPool([upstream.url]), timeout=30)
        service = ProxyService(engine, CaptureJournal(tmp_path / "capture"), SessionRegistry(allow_adhoc=False))
        try:
            async with served_gateway(service, tmp_path / "gw") as node:
                (result,) = await node.run([_spec(calls)])
        finally:
            service.journal.close()
            await engine.aclose()
    assert not service.call_failures  # taken by the gateway: nothing is kept per finished session
    return upstream, result


@pytest.mark.parametrize(("step", "cause"), [("die", "upstream_unreachable"), ("500", "upstream_error")])
async def test_an_upstream_that_fails_mid_session_ends_it_in_error_with_the_cause(tmp_path: Path, step: str,
                                                                                  cause: str) -> None:
    upstream, result = await _run(tmp_path, ["ok", step], calls=3)
    assert upstream.served == ["ok", step]  # the curl harness stops at its first failed call
    assert result.status is S.ERROR, (result.status, result.reason)
    assert result.reason.startswith(f"{cause}: upstream {upstream.url}"), result.reason
    artifacts = result.metadata["artifacts"]
    assert artifacts["error_cause"] == cause
    assert artifacts["model_call_failures"] == {"failed": 1, "by_cause": {cause: 1}, "recovered": False,
                                                "last_error": artifacts["model_call_failures"]["last_error"]}
    assert result.evaluation is None  # not scored: a reward 0 here would read as the policy's
    assert result.trajectory is not None and len(result.trajectory.traces) == 1  # the call that worked is kept
    assert "curl: " in artifacts["harness_stderr_tail"]  # the failed harness's stderr travels with the result


@pytest.mark.parametrize(("statuses", "expected"), [
    ([200, 500, 200], {"failed": 1, "by_cause": {"upstream_error": 1}, "recovered": True}),
    ([503, 504], {"failed": 2, "by_cause": {"upstream_unreachable": 1, "upstream_error": 1}, "recovered": False}),
    ([400, 422, 200], None),  # the server refused the harness's own request: the policy's business, not counted
    ([0, 0], {"failed": 2, "by_cause": {"upstream_timeout": 2}, "recovered": False}),  # 0: no answer in time
])
async def test_the_proxy_counts_infrastructure_failures_per_session(statuses: list[int],
                                                                   expected: dict[str, object] | None) -> None:
    fake, plan = FakeVLLM(), list(statuses)

    def answer(request: httpx.Request) -> httpx.Response:
        fake.status = plan.pop(0)
        if not fake.status:
            raise httpx.ReadTimeout("no answer", request=request)
        return fake.handler(request)

    engine = VLLMEngine(UpstreamPool(["http://upstream.test"]), client=httpx.AsyncClient(
        transport=httpx.MockTransport(answer)))
    service = ProxyService(engine, sessions=SessionRegistry(allow_adhoc=True), keepalive_after=None)
    body = json.dumps({"model": "policy", "messages": [{"role": "user", "content": "hi"}]}).encode()
    for _ in statuses:
        await service.handle("openai_chat", body, Route("/v1/chat/completions"), {"authorization": "Bearer s1"})
    failures = service.take_call_failures("s1")
    if expected is None:
        assert failures is None
        return
    assert failures is not None
    summary = failures.summary()
    assert summary.pop("last_error").startswith("upstream_")
    assert summary == expected
    assert service.take_call_failures("s1") is None  # taken once: nothing stays per finished session
