"""The proxy hook the gateway relies on before building: ``ProxyService.wait_idle`` waits until a session's model
calls are journaled, including one that finishes after its harness hung up."""

from __future__ import annotations

import asyncio

import orjson

from polar_gym.proxy.chat import ChatRequest, ChatResult
from polar_gym.proxy.engines.oracle import OracleEngine
from polar_gym.proxy.providers.base import Route
from polar_gym.proxy.service import ProxyService, SessionInfo, SessionRegistry
from tests._fakes import ByteTokenizer
from tests._waiting import BOUND, until


class SlowOracle(OracleEngine):
    def __init__(self) -> None:
        super().__init__(ByteTokenizer())
        self.release = asyncio.Event()
        self.entered = asyncio.Event()

    async def complete(self, request: ChatRequest, session_id: str) -> ChatResult:
        self.entered.set()
        await self.release.wait()
        return await super().complete(request, session_id)


async def test_wait_idle_waits_for_the_call_in_flight() -> None:
    engine = SlowOracle()
    service = ProxyService(engine, sessions=SessionRegistry(allow_adhoc=False))
    service.sessions.register(SessionInfo("k"))
    body = orjson.dumps({"model": "policy", "messages": [{"role": "user", "content": "hi"}]})
    call = asyncio.create_task(service.handle("openai_chat", body, Route("/v1/chat/completions"),
                                              {"authorization": "Bearer k"}))
    await until(engine.entered.is_set, what="the call to reach the engine")
    assert await service.wait_idle("k", timeout=0.05) is False  # the call cannot end before release is set
    assert await service.journal.records("k") == []
    waiter = asyncio.create_task(service.wait_idle("k", timeout=BOUND))
    engine.release.set()
    assert await waiter is True
    assert (await call).status == 200
    assert len(await service.journal.records("k")) == 1
    assert await service.wait_idle("other") is True
