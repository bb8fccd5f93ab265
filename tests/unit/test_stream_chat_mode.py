"""Streaming pass-through in chat mode (the engine renders the prompt): vLLM's chat stream with ``return_token_ids``
(recorded shape of vLLM 0.32: a role chunk with the prompt's IDs, then per chunk the sampled IDs, their logprobs and
a reasoning, content or tool-call delta, the finish reason, a usage chunk) is passed through as it comes, and
journaled exactly as the same call not streamed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest

from polar_gym.proxy.app import create_app
from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.engines.vllm import VLLMEngine
from polar_gym.proxy.providers.base import Route
from polar_gym.proxy.service import ProxyService, SessionRegistry
from polar_gym.proxy.settings import EngineSettings, build_engine
from polar_gym.proxy.upstreams import UpstreamPool

PROMPT = [151644, 872, 198, 3838, 151645]
#: (reasoning, content, tool-call piece) per sampled token, as vLLM's qwen3 reasoning and hermes tool parsers split
PIECES: list[tuple[str, str, dict[str, Any] | None]] = [
    ("", "", None), ("look", "", None), (" first", "", None), ("", "", None),
    ("", "I will", None), ("", " list.", None),
    ("", "", {"index": 0, "id": "chatcmpl-tool-1", "type": "function", "function": {"name": "bash", "arguments": ""}}),
    ("", "", {"index": 0, "function": {"arguments": '{"command": '}}),
    ("", "", {"index": 0, "function": {"arguments": '"ls"}'}}), ("", "", None)]
IDS = [151667, 1401, 1156, 151668, 40, 686, 151657, 5631, 4383, 151658]
LOGPROBS = [-0.1 * (i + 1) for i in range(len(IDS))]
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run a command", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]


def whole_answer(model: str) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": model, "prompt_token_ids": PROMPT,
            "choices": [{"index": 0, "finish_reason": "tool_calls", "token_ids": IDS, "message": {
                "role": "assistant", "content": "I will list.", "reasoning": "look first", "tool_calls": [
                    {"id": "chatcmpl-tool-1", "type": "function",
                     "function": {"name": "bash", "arguments": '{"command": "ls"}'}}]},
                "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
                                         for t, lp in zip(IDS, LOGPROBS, strict=True)]}}],
            "usage": {"prompt_tokens": len(PROMPT), "completion_tokens": len(IDS),
                      "total_tokens": len(PROMPT) + len(IDS)}}


def stream_chunks(model: str) -> list[bytes]:
    def chunk(choice: dict[str, Any] | None, **extra: Any) -> bytes:
        body = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": model,
                "choices": [choice] if choice else [], **extra}
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    out = [chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}, prompt_token_ids=PROMPT)]
    for i, (reasoning, content, call) in enumerate(PIECES):
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning"] = reasoning
        if content:
            delta["content"] = content
        if call:
            delta["tool_calls"] = [call]
        last = i == len(PIECES) - 1
        out.append(chunk({"index": 0, "delta": delta, "token_ids": [IDS[i]], "finish_reason": "tool_calls" if last
                          else None, "logprobs": {"content": [{"token": f"token_id:{IDS[i]}", "logprob": LOGPROBS[i],
                                                               "bytes": None, "top_logprobs": []}]}}))
    out.append(chunk(None, usage=whole_answer(model)["usage"]))
    return [*out, b"data: [DONE]\n\n"]


class ChatVLLM:
    """vLLM's /v1/chat/completions: the whole answer, or its stream one chunk a loop turn."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.bodies.append(body)
        if not body.get("stream"):
            return httpx.Response(200, json=whole_answer(body["model"]))

        async def chunks() -> AsyncIterator[bytes]:
            for piece in stream_chunks(body["model"]):
                yield piece
                await asyncio.sleep(0)

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=chunks())


def proxy() -> tuple[ProxyService, ChatVLLM, httpx.AsyncClient]:
    upstream = ChatVLLM()
    engine = VLLMEngine(UpstreamPool(["http://engine"]), client=httpx.AsyncClient(
        transport=httpx.MockTransport(upstream)))
    assert engine.stream_passthrough
    service = ProxyService(engine, CaptureJournal(), SessionRegistry(allow_adhoc=True))
    return service, upstream, httpx.AsyncClient(transport=httpx.ASGITransport(create_app(service, "admin")),
                                                base_url="http://proxy")


def same_capture(streamed: Any, plain: Any) -> None:
    for key in ("prompt_ids", "response_ids", "response_logprobs", "finish_reason", "token_faithful", "prompt_mode",
                "normalized_request", "status", "response"):
        a, b = getattr(streamed, key), getattr(plain, key)
        if key == "response":
            a, b = {**a, "id": None}, {**b, "id": None}
        assert a == b, key
    assert streamed.stream is True and plain.stream is False


async def test_openai_chat_stream_passes_vllm_deltas_through_and_captures_the_same() -> None:
    service, upstream, client = proxy()
    sdk = openai.AsyncOpenAI(base_url="http://proxy/v1", api_key="plain", http_client=client, max_retries=0)
    ask: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "ls?"}], "tools": TOOLS}
    plain = await sdk.chat.completions.create(**ask)
    sdk = openai.AsyncOpenAI(base_url="http://proxy/v1", api_key="streamed", http_client=client, max_retries=0)
    chunks = [c async for c in await sdk.chat.completions.create(**ask, stream=True)]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert [d.content for d in deltas if d.content] == ["I will", " list."]  # as vLLM sampled them
    calls = [d.tool_calls[0] for d in deltas if d.tool_calls]
    assert calls[0].function and calls[0].function.name == "bash"
    assert "".join(c.function.arguments or "" for c in calls if c.function) == '{"command": "ls"}'
    assert plain.choices[0].message.tool_calls and plain.choices[0].finish_reason == "tool_calls"
    assert upstream.bodies[1]["stream"] is True and upstream.bodies[1]["return_token_ids"] is True
    (p,), (s,) = await service.completions("plain"), await service.completions("streamed")
    same_capture(s, p)
    assert s.prompt_ids == PROMPT and s.response_ids == IDS and s.response_logprobs == LOGPROBS
    assert s.prompt_mode == "chat"


async def test_anthropic_stream_in_chat_mode_is_the_message_and_the_capture() -> None:
    service, _, _ = proxy()
    client = httpx2.AsyncClient(transport=httpx2.ASGITransport(create_app(service, "admin")))  # the SDK's httpx
    ask: dict[str, Any] = {"model": "claude-x", "max_tokens": 64, "tools": [
        {"name": "bash", "input_schema": TOOLS[0]["function"]["parameters"]}],
        "messages": [{"role": "user", "content": "ls?"}], "thinking": {"type": "enabled", "budget_tokens": 32}}
    plain = await anthropic.AsyncAnthropic(base_url="http://proxy", api_key="plain", http_client=client,
                                           max_retries=0).messages.create(**ask)
    sdk = anthropic.AsyncAnthropic(base_url="http://proxy", api_key="streamed", http_client=client, max_retries=0)
    async with sdk.messages.stream(**ask) as stream:
        streamed = await stream.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in plain.content]
    assert [b.type for b in streamed.content] == ["thinking", "text", "tool_use"]
    assert streamed.usage.input_tokens == len(PROMPT) and streamed.stop_reason == "tool_use"
    (p,), (s,) = await service.completions("plain"), await service.completions("streamed")
    same_capture(s, p)


async def test_a_chat_stream_opens_at_vllms_first_chunk_and_a_cut_stream_keeps_what_came() -> None:
    """vLLM renders the prompt, so its IDs come with its first chunk: the stream opens then. A stream cut before
    its finish is an error the harness hears in-stream, journaled with what was sampled."""
    cut = stream_chunks("m")[:5]  # the role chunk and four tokens

    def upstream(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=b"".join(cut))

    engine = VLLMEngine(UpstreamPool(["http://engine"]), client=httpx.AsyncClient(
        transport=httpx.MockTransport(upstream)))
    service = ProxyService(engine, CaptureJournal(), SessionRegistry(allow_adhoc=True))
    body = json.dumps({"model": "claude-x", "max_tokens": 64, "stream": True,
                       "messages": [{"role": "user", "content": "ls?"}]}).encode()
    reply = await service.handle("anthropic", body, Route("/v1/messages"), {"x-api-key": "s1"})
    assert reply.status == 200 and reply.stream is not None
    text = b"".join([c async for c in reply.stream]).decode()
    assert text.startswith("event: message_start") and f'"input_tokens":{len(PROMPT)}' in text
    assert "event: error" in text
    (rec,) = await service.completions("s1")
    assert rec.status == "error" and rec.prompt_ids == PROMPT and rec.response_ids == IDS[:4]
    assert rec.response_logprobs == LOGPROBS[:4]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_server_that_answers_a_stream_request_whole_is_read_whole(stream: bool) -> None:
    """A server (or fake) that ignores ``stream`` answers whole: the stream is synthesized from that answer."""
    engine = VLLMEngine(UpstreamPool(["http://engine"]), client=httpx.AsyncClient(
        transport=httpx.MockTransport(lambda r: httpx.Response(200, json=whole_answer("m")))))
    service = ProxyService(engine, CaptureJournal(), SessionRegistry(allow_adhoc=True))
    body = json.dumps({"model": "m", "stream": stream, "messages": [{"role": "user", "content": "ls?"}]}).encode()
    reply = await service.handle("openai_chat", body, Route("/v1/chat/completions"), {"authorization": "Bearer s"})
    assert reply.status == 200
    text = b"".join([c async for c in reply.stream]).decode() if reply.stream else reply.body.decode()
    assert "I will list." in text and "bash" in text
    (rec,) = await service.completions("s")
    assert rec.response_ids == IDS and rec.finish_reason == "tool_calls"


def test_the_stream_passthrough_setting_holds_in_chat_mode() -> None:
    settings = {"engine": "vllm", "upstreams": ["http://engine"], "prompt_mode": "chat"}
    assert build_engine(EngineSettings.model_validate(settings)).stream_passthrough
    assert not build_engine(EngineSettings.model_validate({**settings, "stream_passthrough": False})).stream_passthrough
    assert not build_engine(EngineSettings.model_validate({**settings, "engine": "sglang"})).stream_passthrough


CHAT_CALLS: dict[str, tuple[Route, dict[str, Any]]] = {
    "anthropic": (Route("/v1/messages"), {"model": "claude-x", "max_tokens": 64, "messages": [
        {"role": "user", "content": "ls?"}]}),
    "openai_chat": (Route("/v1/chat/completions"), {"model": "m", "messages": [{"role": "user", "content": "ls?"}]}),
    "openai_responses": (Route("/v1/responses"), {"model": "m", "input": "ls?"}),
    "google": (Route("/v1beta/models/g:streamGenerateContent", model="g", action="streamGenerateContent",
                     query={"alt": "sse"}), {"contents": [{"role": "user", "parts": [{"text": "ls?"}]}]}),
}


@pytest.mark.parametrize("front_end", sorted(CHAT_CALLS))
async def test_a_chat_stream_opens_when_vllm_takes_the_call_unless_its_opening_counts_the_prompt(
        front_end: str) -> None:
    """vLLM answers its head at once and its first chunk after prefill: a stream whose opening needs nothing from
    the engine opens at the head; Anthropic's message_start counts the prompt's tokens, so it waits for the first
    chunk (it carries the prompt's IDs)."""
    prefilled = asyncio.Event()

    def upstream(request: httpx.Request) -> httpx.Response:
        async def chunks() -> AsyncIterator[bytes]:
            await prefilled.wait()
            for piece in stream_chunks("m"):
                yield piece

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=chunks())

    engine = VLLMEngine(UpstreamPool(["http://engine"]), client=httpx.AsyncClient(
        transport=httpx.MockTransport(upstream)))
    service = ProxyService(engine, CaptureJournal(), SessionRegistry(allow_adhoc=True), keepalive_after=0.5)
    route, body = CHAT_CALLS[front_end]
    reply = await service.handle(front_end, json.dumps({**body, "stream": True}).encode(), route,
                                 {"x-api-key": "s1", "x-goog-api-key": "s1", "authorization": "Bearer s1"})
    assert reply.status == 200 and reply.stream is not None
    first = await anext(reply.stream)
    if front_end == "anthropic":
        assert first == b": keepalive\n\n"  # nothing to say before the prompt's length is known
    else:  # opened before vLLM sampled a token
        assert {"openai_chat": b'"role":"assistant"', "openai_responses": b"event: response.created",
                "google": b"\n"}[front_end] in first
    prefilled.set()
    rest = b"".join([first, *[c async for c in reply.stream]]).decode()
    if front_end == "anthropic":
        assert f'"input_tokens":{len(PROMPT)}' in rest
    assert "list." in rest
    (rec,) = await service.completions("s1")
    assert rec.status == "ok" and rec.prompt_ids == PROMPT and rec.response_ids == IDS
