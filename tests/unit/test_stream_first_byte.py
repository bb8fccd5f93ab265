"""A passed-through stream opens as soon as the engine has taken the prompt, before its first token: the harness
hears from the call while the engine prefills (the prompt is the one the proxy planned, so the opening events need
nothing the engine sends). What is journaled is unchanged: the whole call, stamped with when it came in."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.engines.tokenin import VLLMTokenInEngine
from polar_gym.proxy.parsers.base import parser_for
from polar_gym.proxy.providers.base import Route
from polar_gym.proxy.service import ProxyService, SessionRegistry
from polar_gym.proxy.tokenizer import HFChatTokenizer
from polar_gym.proxy.upstreams import UpstreamPool

EOT = 151645
ANSWER = "<think>\nfirst\n</think>\n\nAll done."


class PrefillingVLLM:
    """vLLM's /v1/completions stream: the answer's head at once (as vLLM sends it before prefill), its tokens
    only once ``sample`` is set; ``fail`` sends vLLM's in-stream error event instead of tokens."""

    def __init__(self, tok: HFChatTokenizer, fail: bool = False) -> None:
        self.tok, self.fail = tok, fail
        self.sample = asyncio.Event()
        self.prompts: list[list[int]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.prompts.append(body["prompt"])
        ids = [*self.tok.encode(ANSWER), EOT]

        async def chunks() -> AsyncIterator[bytes]:
            await self.sample.wait()
            if self.fail:
                yield b'data: {"error": {"message": "engine overloaded", "code": 500}}\n\n'
                return
            for i, token in enumerate(ids):
                choice = {"index": 0, "text": self.tok.decode([token]), "token_ids": [token],
                          "logprobs": {"token_logprobs": [-0.5]},
                          "finish_reason": "stop" if i == len(ids) - 1 else None,
                          "prompt_token_ids": body["prompt"] if i == 0 else None}
                yield b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=chunks())


def service(tok: HFChatTokenizer, upstream: PrefillingVLLM) -> ProxyService:
    engine = VLLMTokenInEngine(tok, parser_for("qwen3"), UpstreamPool(["http://engine"]),
                               client=httpx.AsyncClient(transport=httpx.MockTransport(upstream)))
    return ProxyService(engine, CaptureJournal(), SessionRegistry(allow_adhoc=True))


CALLS: dict[str, tuple[Route, dict[str, Any], bytes]] = {
    "anthropic": (Route("/v1/messages"), {"model": "claude-x", "max_tokens": 64, "stream": True, "messages": [
        {"role": "user", "content": "hi"}]}, b"event: message_start"),
    "openai_chat": (Route("/v1/chat/completions"), {"model": "m", "stream": True, "messages": [
        {"role": "user", "content": "hi"}]}, b'"delta":{"role":"assistant"'),
    "openai_responses": (Route("/v1/responses"), {"model": "m", "stream": True, "input": "hi"},
                         b"event: response.created"),
    # Gemini's first chunk carries text, so its stream opens with its keep-alive (a blank line every SSE reader
    # skips): the harness's idle timer sees the call alive
    "google": (Route("/v1beta/models/g:streamGenerateContent", model="g", action="streamGenerateContent",
                     query={"alt": "sse"}), {"contents": [{"role": "user", "parts": [{"text": "hi"}]}]}, b"\n"),
}


@pytest.mark.parametrize("front_end", sorted(CALLS))
async def test_the_stream_opens_before_the_first_token(tok: HFChatTokenizer, front_end: str) -> None:
    upstream = PrefillingVLLM(tok)
    proxy = service(tok, upstream)
    route, body, opening = CALLS[front_end]
    before = time.time()
    reply = await proxy.handle(front_end, json.dumps(body).encode(), route, {"x-api-key": "s1",
                                                                               "x-goog-api-key": "s1"})
    assert reply.status == 200 and reply.stream is not None
    first = await anext(reply.stream)
    assert opening in first if front_end != "google" else first == opening
    assert not upstream.sample.is_set()  # nothing was sampled yet
    upstream.sample.set()
    rest = b"".join([chunk async for chunk in reply.stream]).decode()
    assert " done" in rest  # the answer, token by token
    assert await proxy.wait_idle("s1", timeout=30)
    (rec,) = await proxy.completions("s1")
    assert rec.status == "ok" and rec.stream is True
    assert rec.prompt_ids == upstream.prompts[0] and rec.response_ids == [*tok.encode(ANSWER), EOT]
    assert before <= rec.started_at <= before + rec.total_seconds + 5  # when the call came in, not when it ended
    assert rec.normalized_request is not None and rec.normalized_request["messages"]


async def test_an_engine_error_after_the_stream_opened_is_a_stream_error_and_journaled(tok: HFChatTokenizer) -> None:
    upstream = PrefillingVLLM(tok, fail=True)
    proxy = service(tok, upstream)
    route, body, _ = CALLS["anthropic"]
    reply = await proxy.handle("anthropic", json.dumps(body).encode(), route, {"x-api-key": "s1"})
    assert reply.status == 200 and reply.stream is not None
    assert (await anext(reply.stream)).startswith(b"event: message_start")
    upstream.sample.set()
    rest = b"".join([chunk async for chunk in reply.stream]).decode()
    assert "event: error" in rest and "engine overloaded" in rest
    (rec,) = await proxy.completions("s1")
    assert rec.status == "error" and "engine overloaded" in (rec.error or "")
    assert rec.prompt_ids == upstream.prompts[0] and rec.response_ids == []
    assert proxy.stats["errors"] == 1
