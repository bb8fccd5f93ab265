"""Streaming pass-through with capture, without sockets: the proxy (real app, real Qwen tokenizer) in front of a
fake vLLM ``/v1/completions`` that streams the tokens it samples a few at a time, as vLLM 0.32 does (token ids,
logprobs and text per chunk, the prompt ids on the first). A streamed call must reach the official SDKs as the
same answer a non-streamed call gets, and be journaled exactly as that call; a failure mid-stream keeps what was
sampled; the parser never streams text the whole answer would not have."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest

from polar_gym.assets import tokenizer_dir
from polar_gym.journal import read_received
from polar_gym.proxy.app import create_app
from polar_gym.proxy.capture import CaptureJournal
from polar_gym.proxy.engines.tokenin import SGLangTokenInEngine, StreamedAnswer, VLLMTokenInEngine
from polar_gym.proxy.parsers.base import parser_for
from polar_gym.proxy.parsers.qwen3 import Qwen3Parser
from polar_gym.proxy.providers.base import Route
from polar_gym.proxy.service import ProxyService, SessionRegistry
from polar_gym.proxy.settings import EngineSettings, build_engine
from polar_gym.proxy.tokenizer import HFChatTokenizer
from polar_gym.proxy.upstreams import UpstreamPool
from tests._waiting import until

EOT = 151645
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run a command", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]
CALL_TEXT = ('<think>\nlook first\n</think>\n\nI will list the files.\n<tool_call>\n{"name": "bash", "arguments": '
             '{"command": "ls"}}\n</tool_call>')
REPLIES = [CALL_TEXT, "<think>\nok\n</think>\n\nAll done, the file is there.", "Plain answer, no thinking.",
           "<think>\ncut short at max tok"]
#: texts the parser property test cuts at every point
PARSER_TEXTS = [*REPLIES, "\n<think>a</think>b<tool_call>\n{bad}\n</tool_call>\nafter", "  <think>x</think> y\n\n",
                "reason</think>answer<|im_end|>", "<thi", "text <tool_call>\n{\"name\": \"a\"}\n</tool_call>"
                "<tool_call>\n{\"name\": \"b\"}\n</tool_call>tail<|im_end|>", "<think></think>\n\n\n<|im_end|>"]


class FakeVLLM:
    """vLLM's /v1/completions for token prompts: replies ``texts`` in order, each sampled token by token (the
    same ids streamed or not); ``fail_after`` cuts a stream after that many chunks (an engine that died)."""

    def __init__(self, tok: HFChatTokenizer, texts: list[str], fail_after: int | None = None) -> None:
        self.tok, self.texts, self.fail_after = tok, list(texts), fail_after
        self.sent: list[dict[str, Any]] = []

    def sample(self) -> tuple[list[int], list[str]]:
        text = self.texts.pop(0)
        ids = self.tok.encode(text)
        if not text.endswith("tok"):  # a reply cut at max_tokens samples no end of turn
            ids.append(EOT)
        return ids, [self.tok.decode([i]) for i in ids]

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.sent.append(body)
        ids, pieces = self.sample()
        finish = "length" if ids[-1] != EOT else "stop"
        logprobs = [-0.01 * (i + 1) for i in range(len(ids))]
        if not body.get("stream"):
            choice = {"index": 0, "text": "".join(pieces), "finish_reason": finish,
                      "prompt_token_ids": body["prompt"], "token_ids": ids,
                      "logprobs": {"token_logprobs": logprobs, "tokens": [], "top_logprobs": None}}
            return httpx.Response(200, json={"id": "cmpl", "object": "text_completion", "choices": [choice]})

        async def chunks() -> AsyncIterator[bytes]:
            for n, start in enumerate(range(0, len(ids), 3)):
                if self.fail_after is not None and n == self.fail_after:
                    raise httpx.ReadError("the engine died")
                end = min(start + 3, len(ids))
                choice = {"index": 0, "text": "".join(pieces[start:end]), "token_ids": ids[start:end],
                          "logprobs": {"token_logprobs": logprobs[start:end]},
                          "finish_reason": finish if end == len(ids) else None,
                          "prompt_token_ids": body["prompt"] if start == 0 else None}
                yield b"data: " + json.dumps({"id": "cmpl", "choices": [choice]}).encode() + b"\n\n"
                await asyncio.sleep(0)
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=chunks())


def proxy(tok: HFChatTokenizer, texts: list[str], journal_root: Path | None = None,
          **fake: Any) -> tuple[ProxyService, httpx.AsyncClient]:
    engine = VLLMTokenInEngine(tok, parser_for("qwen3"), UpstreamPool(["http://engine"]),
                               client=httpx.AsyncClient(transport=httpx.MockTransport(FakeVLLM(tok, texts, **fake))),
                               upstream_model="tiny")
    service = ProxyService(engine, CaptureJournal(journal_root), SessionRegistry(allow_adhoc=True))
    return service, httpx.AsyncClient(transport=httpx.ASGITransport(create_app(service, "admin")),
                                      base_url="http://proxy")


def same_capture(streamed: dict[str, Any], plain: dict[str, Any]) -> None:
    """A streamed call's record holds what the non-streamed call's does (ids and clocks aside)."""
    for key in ("prompt_ids", "response_ids", "response_logprobs", "finish_reason", "token_faithful", "prompt_mode",
                "unparseable_tool_calls", "normalized_request", "status"):
        assert streamed[key] == plain[key], key
    assert streamed["response"]["message"] == plain["response"]["message"]
    assert streamed["response"]["usage"] == plain["response"]["usage"]
    assert streamed["stream"] is True and plain["stream"] is False


async def records(client: httpx.AsyncClient, session: str) -> list[dict[str, Any]]:
    resp = await client.get(f"/sessions/{session}/completions", headers={"authorization": f"Bearer {session}"})
    return list(resp.json()["completions"])


@pytest.mark.parametrize("text", PARSER_TEXTS)
@pytest.mark.parametrize("thinking", [True, False])
def test_streamed_text_is_always_a_prefix_of_the_whole_answer(text: str, thinking: bool) -> None:
    parser = Qwen3Parser()
    whole = parser.parse(text, None, thinking=thinking).message
    reasoning, content = "", ""
    for cut in range(len(text) + 1):
        r, c = parser.stream_prefix(text[:cut], thinking=thinking)
        assert r.startswith(reasoning) and c.startswith(content), (cut, r, c)  # never takes back what it sent
        assert (whole.reasoning_content or "").startswith(r), (cut, r)
        assert (whole.content or "").startswith(c), (cut, c)
        if c:  # text only once the reasoning is whole
            assert r == (whole.reasoning_content or "")
        reasoning, content = r, c
    if thinking and text.startswith("<think>") and "</think>" in text and (whole.content or "").strip():
        assert content  # a closed think block lets the answer stream


async def test_openai_stream_is_the_non_streamed_answer_and_capture(tok: HFChatTokenizer) -> None:
    _, client = proxy(tok, [CALL_TEXT, CALL_TEXT])
    sdk = openai.AsyncOpenAI(base_url="http://proxy/v1", api_key="s1", http_client=client, max_retries=0)
    ask: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "ls?"}], "tools": TOOLS,
                           "max_tokens": 64}
    plain = await sdk.chat.completions.create(**ask)
    content, reasoning, calls, finish = "", "", {}, None
    stream = await sdk.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            content += delta.content or ""
            reasoning += getattr(delta, "reasoning_content", None) or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": call.id, "name": "", "arguments": ""})
                entry["name"] += call.function.name or "" if call.function else ""
                entry["arguments"] += call.function.arguments or "" if call.function else ""
            finish = chunk.choices[0].finish_reason or finish
    message = plain.choices[0].message
    assert content == message.content == "I will list the files."
    assert reasoning == "look first"
    assert [(c["id"], c["name"], c["arguments"]) for c in calls.values()] == [
        (c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []]
    assert finish == plain.choices[0].finish_reason == "tool_calls"
    first, second = await records(client, "s1")
    # the same sampled tokens on the same prompt: the capture is the same
    same_capture(second, first)


@pytest.mark.parametrize("thinking", [True, False])
async def test_anthropic_stream_is_the_non_streamed_message_and_capture(tok: HFChatTokenizer, thinking: bool) -> None:
    for text in [*REPLIES, "<think>\nonly thinking\n</think>"]:
        service, client = proxy(tok, [text, text])
        http = httpx2.AsyncClient(transport=httpx2.ASGITransport(create_app(service, "admin")))  # the SDK's httpx
        sdk = anthropic.AsyncAnthropic(base_url="http://proxy", api_key="s1", http_client=http, max_retries=0)
        ask: dict[str, Any] = {"model": "claude-x", "max_tokens": 64, "tools": [
            {"name": "bash", "description": "run", "input_schema": TOOLS[0]["function"]["parameters"]}],
            "messages": [{"role": "user", "content": "ls?"}]}
        if thinking:
            ask["thinking"] = {"type": "enabled", "budget_tokens": 32}
        plain = await sdk.messages.create(**ask)
        async with sdk.messages.stream(**ask) as stream:
            kinds = [event.type async for event in stream]
            streamed = await stream.get_final_message()
        assert kinds[0] == "message_start"
        assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in plain.content]
        assert streamed.stop_reason == plain.stop_reason
        assert streamed.usage.output_tokens == plain.usage.output_tokens
        first, second = await records(client, "s1")
        same_capture(second, first)


async def test_responses_and_gemini_streams_carry_the_same_answer(tok: HFChatTokenizer) -> None:
    _, client = proxy(tok, [CALL_TEXT] * 4)
    headers = {"authorization": "Bearer s1"}
    ask = {"model": "gpt-x", "input": "ls?", "tools": [{"type": "function", "name": "bash", "parameters":
                                                        TOOLS[0]["function"]["parameters"]}]}
    plain = (await client.post("/v1/responses", json=ask, headers=headers)).json()
    events = [json.loads(line[6:]) for line in (await client.post("/v1/responses", json={**ask, "stream": True},
                                                                  headers=headers)).text.splitlines()
              if line.startswith("data: ")]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    done = events[-1]["response"]
    assert events[-1]["type"] == "response.completed"
    assert [{k: v for k, v in i.items() if k != "id"} for i in done["output"]] == [
        {k: v for k, v in i.items() if k != "id"} for i in plain["output"]]
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    assert added == list(range(len(done["output"])))
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "I will list the files."
    gem = {"contents": [{"role": "user", "parts": [{"text": "ls?"}]}],
           "tools": [{"functionDeclarations": [{"name": "bash", "parameters": TOOLS[0]["function"]["parameters"]}]}]}
    plain_g = (await client.post("/v1beta/models/g:generateContent", json=gem, headers=headers)).json()
    chunks = [json.loads(line[6:]) for line in (await client.post(
        "/v1beta/models/g:streamGenerateContent?alt=sse", json=gem, headers=headers)).text.splitlines()
        if line.startswith("data: ")]
    parts = [p for c in chunks for p in c["candidates"][0]["content"]["parts"]]
    assert "".join(p.get("text", "") for p in parts if not p.get("thought")) == "".join(
        p.get("text", "") for p in plain_g["candidates"][0]["content"]["parts"])
    assert [p["functionCall"] for p in parts if "functionCall" in p] == [
        p["functionCall"] for p in plain_g["candidates"][0]["content"]["parts"] if "functionCall" in p]
    assert chunks[-1]["candidates"][0]["finishReason"] == "STOP"
    recs = await records(client, "s1")
    same_capture(recs[1], recs[0])
    same_capture(recs[3], recs[2])


async def test_engine_dying_mid_stream_keeps_what_was_sampled(tok: HFChatTokenizer) -> None:
    _, client = proxy(tok, [CALL_TEXT], fail_after=3)
    resp = await client.post("/v1/messages", json={"model": "claude-x", "max_tokens": 64, "stream": True,
                                                    "messages": [{"role": "user", "content": "ls?"}]},
                             headers={"x-api-key": "s1"})
    assert resp.status_code == 200
    assert "event: message_start" in resp.text
    assert resp.text.rstrip().splitlines()[-2:][0] == "event: error"  # the protocol's stream error event
    (rec,) = await records(client, "s1")
    assert rec["status"] == "error" and "unreachable" in rec["error"]
    assert rec["response_ids"] == tok.encode(CALL_TEXT)[:9]  # the three chunks that arrived
    assert len(rec["response_logprobs"]) == 9 and rec["prompt_ids"]


async def test_a_harness_hanging_up_mid_stream_still_gets_the_call_journaled(tok: HFChatTokenizer) -> None:
    service, _ = proxy(tok, [CALL_TEXT])
    body = json.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "ls?"}]}).encode()
    reply = await service.handle("openai_chat", body, Route("/v1/chat/completions"), {"authorization": "Bearer s1"})
    assert reply.stream is not None
    await anext(reply.stream)  # the first chunk, then the harness goes away
    await reply.stream.aclose()  # type: ignore[attr-defined]
    assert await service.wait_idle("s1", timeout=30)
    (rec,) = await service.completions("s1")
    assert rec.status == "ok" and rec.response_ids == [*tok.encode(CALL_TEXT), EOT]


async def test_an_engine_refusal_before_the_stream_is_a_plain_error_status(tok: HFChatTokenizer) -> None:
    engine = VLLMTokenInEngine(tok, parser_for("qwen3"), UpstreamPool(["http://engine"]), client=httpx.AsyncClient(
        transport=httpx.MockTransport(lambda r: httpx.Response(400, text="prompt too long"))))
    service = ProxyService(engine, CaptureJournal(), SessionRegistry(allow_adhoc=True))
    body = json.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}).encode()
    reply = await service.handle("openai_chat", body, Route("/v1/chat/completions"), {"authorization": "Bearer s1"})
    assert reply.status == 400 and reply.stream is None and b"prompt too long" in reply.body
    (rec,) = await service.completions("s1")
    assert rec.status == "error"


def test_sglang_stream_chunks_read_cumulative_and_incremental(tok: HFChatTokenizer) -> None:
    """SGLang /generate streams (recorded shape): cumulative text and output_token_logprobs by default; only the
    new entries with --incremental-streaming-output. Both add up to the same answer."""
    engine = SGLangTokenInEngine(tok, parser_for("qwen3"), UpstreamPool(["http://engine"]))
    triples = [[-0.5, 9707, None], [-0.25, 11, None], [-0.125, 1879, None]]
    texts = ["Hello", ",", " world"]
    for incremental in (False, True):
        answer = StreamedAnswer()
        for n in range(1, 4):
            listed = triples[n - 1:n] if incremental else triples[:n]
            text = texts[n - 1] if incremental else "".join(texts[:n])
            meta = {"completion_tokens": n, "output_token_logprobs": listed, "weight_version": "v3",
                    "finish_reason": {"type": "stop", "matched": EOT} if n == 3 else None}
            engine.read_chunk(answer, {"text": text, "meta_info": meta})
        assert answer.response_ids == [9707, 11, 1879] and answer.logprobs == [-0.5, -0.25, -0.125]
        assert answer.text == "Hello, world" and answer.finish == "stop" and answer.extra["weight_version"] == "v3"
    vllm = VLLMTokenInEngine(tok, parser_for("qwen3"), UpstreamPool(["http://engine"]))
    answer = StreamedAnswer(prompt_ids=[1, 2])
    assert vllm.read_chunk(answer, {"choices": [], "usage": {"prompt_tokens": 2}}) == ([], [])  # usage only
    assert answer.response_ids == [] and answer.finish is None


class FakeSGLang:
    """SGLang's native /generate (recorded shape): a whole answer, or (``stream``) cumulative ``text`` and
    ``meta_info.output_token_logprobs`` per chunk, ``finish_reason`` on the last, then ``[DONE]``."""

    def __init__(self, tok: HFChatTokenizer, texts: list[str]) -> None:
        self.tok, self.texts = tok, list(texts)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert request.url.path == "/generate" and body["return_logprob"] is True
        text = self.texts.pop(0)
        ids = [*self.tok.encode(text), EOT]
        pieces = [self.tok.decode([i]) for i in ids]
        triples = [[-0.5 / (i + 1), t, None] for i, t in enumerate(ids)]

        def answer(n: int) -> dict[str, Any]:
            finish = {"type": "stop", "matched": EOT} if n == len(ids) else None
            return {"text": "".join(pieces[:n]), "output_ids": ids[:n], "meta_info": {
                "id": "g", "prompt_tokens": len(body["input_ids"]), "completion_tokens": n,
                "output_token_logprobs": triples[:n], "finish_reason": finish, "weight_version": "7"}}

        if not body.get("stream"):
            return httpx.Response(200, json=answer(len(ids)))
        events = [b"data: " + json.dumps(answer(n)).encode() + b"\n\n" for n in range(2, len(ids), 2)]
        events += [b"data: " + json.dumps(answer(len(ids))).encode() + b"\n\n", b"data: [DONE]\n\n"]
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=b"".join(events))


async def test_sglang_generate_stream_is_captured_as_the_whole_answer(tok: HFChatTokenizer) -> None:
    fake = FakeSGLang(tok, [CALL_TEXT] * 2)
    engine = SGLangTokenInEngine(tok, parser_for("qwen3"), UpstreamPool(["http://engine"]),
                                 client=httpx.AsyncClient(transport=httpx.MockTransport(fake)))
    service = ProxyService(engine, CaptureJournal(), SessionRegistry(allow_adhoc=True))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(create_app(service, "admin")), base_url="http://proxy")
    ask = {"model": "m", "messages": [{"role": "user", "content": "ls?"}], "tools": TOOLS}
    for stream in (False, True):
        resp = await client.post("/v1/chat/completions", json={**ask, "stream": stream},
                                 headers={"authorization": "Bearer s1"})
        assert resp.status_code == 200
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in resp.text.splitlines()
              if line.startswith("data: {") and '"choices":[{' in line]
    assert "".join(d.get("content") or "" for d in deltas) == "I will list the files."
    assert sum(1 for d in deltas if d.get("content")) > 1  # it came as SGLang sampled it
    assert [d["tool_calls"][0]["function"]["name"] for d in deltas if d.get("tool_calls") and
            d["tool_calls"][0].get("id")] == ["bash"]
    plain, streamed = await records(client, "s1")
    same_capture(streamed, plain)
    assert streamed["response_logprobs"][:2] == [-0.5, -0.25] and streamed["policy_version"] is None


async def test_stream_passthrough_off_synthesizes_the_stream(tok: HFChatTokenizer) -> None:
    settings = {"engine": "vllm", "upstreams": ["http://engine"], "prompt_mode": "token_in", "tokenizer":
                str(tokenizer_dir()), "stream_passthrough": False}
    assert build_engine(EngineSettings.model_validate(settings)).stream_passthrough is False
    assert build_engine(EngineSettings.model_validate({**settings, "stream_passthrough": True})).stream_passthrough
    fake = FakeVLLM(tok, [CALL_TEXT])
    engine = VLLMTokenInEngine(tok, parser_for("qwen3"), UpstreamPool(["http://engine"]),
                               client=httpx.AsyncClient(transport=httpx.MockTransport(fake)))
    engine.stream_passthrough = False
    engine.cut_non_streamed = False  # the answer read whole upstream too (by default it is read as a stream)
    service = ProxyService(engine, CaptureJournal(), SessionRegistry(allow_adhoc=True))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(create_app(service, "admin")), base_url="http://proxy")
    resp = await client.post("/v1/chat/completions", json={"model": "m", "stream": True, "messages": [
        {"role": "user", "content": "ls?"}]}, headers={"authorization": "Bearer s1"})
    assert resp.status_code == 200 and resp.text.rstrip().endswith("data: [DONE]")
    assert fake.sent[0]["stream"] is False  # one whole upstream call
    (rec,) = await records(client, "s1")
    assert rec["stream"] is True and rec["response_ids"] == [*tok.encode(CALL_TEXT), EOT]


async def test_a_slow_prefill_gets_keepalives_before_the_first_token(tok: HFChatTokenizer) -> None:
    """An engine still prefilling a long prompt: the harness gets the provider's keep-alive at once (its idle
    timer must not fire), then the answer as it is sampled."""
    prefilled = asyncio.Event()

    def upstream(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        ids = [*tok.encode("Hi there."), EOT]

        async def chunks() -> AsyncIterator[bytes]:
            await prefilled.wait()
            choice = {"index": 0, "text": "Hi there.<|im_end|>", "token_ids": ids, "finish_reason": "stop",
                      "logprobs": {"token_logprobs": [-0.5] * len(ids)}, "prompt_token_ids": body["prompt"]}
            yield b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\ndata: [DONE]\n\n"

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=chunks())

    engine = VLLMTokenInEngine(tok, parser_for("qwen3"), UpstreamPool(["http://engine"]),
                               client=httpx.AsyncClient(transport=httpx.MockTransport(upstream)))
    service = ProxyService(engine, CaptureJournal(), SessionRegistry(allow_adhoc=True), keepalive_after=0.0,
                           keepalive_interval=60.0)
    body = json.dumps({"model": "claude-x", "max_tokens": 64, "stream": True,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    reply = await service.handle("anthropic", body, Route("/v1/messages"), {"x-api-key": "s1"})
    assert reply.status == 200 and reply.stream is not None
    assert await anext(reply.stream) == b": keepalive\n\n"
    prefilled.set()
    rest = b"".join([chunk async for chunk in reply.stream]).decode()
    assert rest.startswith("event: message_start") and '"text":"Hi there."' in rest
    assert rest.rstrip().endswith('data: {"type":"message_stop"}')
    (rec,) = await service.completions("s1")
    assert rec.status == "ok" and rec.response_ids == [*tok.encode("Hi there."), EOT]


async def test_a_streamed_call_journals_the_request_byte_for_byte(tok: HFChatTokenizer, tmp_path: Path) -> None:
    """Pass-through keeps the journal's promise too: the body comes back exactly as the harness sent it."""
    _, client = proxy(tok, [CALL_TEXT], journal_root=tmp_path)
    sent = json.dumps({"model": "m", "messages": [{"role": "user", "content": "ls? é"}], "tools": TOOLS,
                       "max_tokens": 64, "stream": True}, indent=1).encode()
    async with client.stream("POST", "/v1/chat/completions", content=sent,
                             headers={"authorization": "Bearer s1", "content-type": "application/json"}) as resp:
        assert resp.status_code == 200
        body = b"".join([chunk async for chunk in resp.aiter_bytes()])
    assert b"data: [DONE]" in body
    stream = CaptureJournal(tmp_path).stream_dir("s1")
    assert stream is not None
    await until(lambda: read_received(stream) == [sent], what="the streamed call's record with its body")
