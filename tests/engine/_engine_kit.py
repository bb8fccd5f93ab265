"""The real-engine tier: a proxy in front of the session's vLLM CPU server (``tests/_vllm.py``: tiny random Qwen3,
real Qwen tokenizer) whose upstream client keeps every raw answer, so tests compare what we recorded with what the
engine actually said."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from polar_gym.assets import (
    tokenizer_dir,
)
from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.engines.vllm import VLLMEngine
from polar_gym.proxy.service import ProxyService, SessionRegistry
from polar_gym.proxy.tokenizer import HFChatTokenizer
from polar_gym.proxy.upstreams import UpstreamPool
from tests._serving import serve
from tests._vllm import VLLMServer  # the vllm_server fixture itself is registered by tests/conftest.py


@pytest.fixture(scope="session")
def qwen_tokenizer(vllm_server: VLLMServer) -> HFChatTokenizer:
    return HFChatTokenizer(vllm_server.tokenizer_dir)


@dataclass
class Exchange:
    """One upstream call as it went over the wire."""

    path: str
    request: dict[str, Any]
    status: int
    answer: dict[str, Any]


@dataclass
class RecordingTransport(httpx.AsyncBaseTransport):
    """Passes requests to the real network transport and keeps each request body and raw JSON answer."""

    exchanges: list[Exchange] = field(default_factory=list)
    # no keep-alive: each proxy runs on its own short-lived event loop, which must not leave sockets open behind it
    inner: httpx.AsyncBaseTransport = field(
        default_factory=lambda: httpx.AsyncHTTPTransport(limits=httpx.Limits(max_keepalive_connections=0)))

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        content = await response.aread()
        await response.aclose()
        try:
            answer = json.loads(content)
        except ValueError:
            answer = {"_raw": content.decode(errors="replace")}
        self.exchanges.append(Exchange(request.url.path, json.loads(request.content or b"{}"),
                                       response.status_code, answer))
        headers = [(k, v) for k, v in response.headers.multi_items()
                   if k.lower() not in ("content-encoding", "content-length", "transfer-encoding")]
        return httpx.Response(response.status_code, headers=headers, content=content, request=request)

    async def aclose(self) -> None:
        await self.inner.aclose()


@dataclass
class EngineProxy:
    """The proxy (real app, uvicorn, loopback) with a VLLMEngine on the real server, plus the wire log."""

    url: str
    service: ProxyService
    transport: RecordingTransport
    server: VLLMServer

    @property
    def exchanges(self) -> list[Exchange]:
        return self.transport.exchanges


@pytest.fixture
def engine_proxy(vllm_server: VLLMServer) -> Iterator[EngineProxy]:
    transport = RecordingTransport()
    client = httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(120.0, connect=5.0))
    engine = VLLMEngine(UpstreamPool([vllm_server.url]), client=client, upstream_model=vllm_server.model)
    service = ProxyService(engine, CaptureJournal(), SessionRegistry(allow_adhoc=True),
                           model_names=[vllm_server.model])
    for running in serve(service):
        yield EngineProxy(running.url, service, transport, vllm_server)


SGLANG_HINT = ("needs a running SGLang server (GPU only): on a GPU node run `python -m sglang.launch_server "
               "--model-path Qwen/Qwen3-0.6B --port 30000 --tool-call-parser qwen25 --reasoning-parser qwen3`, then "
               "`POLAR_SGLANG_URL=http://127.0.0.1:30000 POLAR_SGLANG_MODEL=Qwen/Qwen3-0.6B "
               "pytest -m engine tests/engine/test_sglang_real.py`")


@pytest.fixture
def sglang_proxy() -> Iterator[EngineProxy]:
    """The proxy with an SGLangEngine on the server at $POLAR_SGLANG_URL (never started here: SGLang is GPU-only)."""
    from polar_gym.proxy.engines.sglang import SGLangEngine

    url = os.environ.get("POLAR_SGLANG_URL")
    if not url:
        pytest.skip(f"POLAR_SGLANG_URL is not set: this test {SGLANG_HINT}")
    model = os.environ.get("POLAR_SGLANG_MODEL", "default")
    server = VLLMServer(url.rstrip("/"), model, Path(), tokenizer_dir(), Path(), 0.0)
    transport = RecordingTransport()
    client = httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(120.0, connect=5.0))
    engine = SGLangEngine(UpstreamPool([server.url]), client=client, upstream_model=model)
    service = ProxyService(engine, CaptureJournal(), SessionRegistry(allow_adhoc=True), model_names=[model])
    for running in serve(service):
        yield EngineProxy(running.url, service, transport, server)
