"""Engines without sockets: each engine's body builder and answer parser against the upstream shapes seen on real
servers (vLLM CPU 0.32.0 measured here; SGLang's from its source), error mapping by upstream status and transport
failure, and the UpstreamPool (least-loaded, sticky, changed at run time, paused and resumed with none lost)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from polar_gym.proxy.chat import ChatMessage, ChatRequest, Tool
from polar_gym.proxy.engines.base import upstream_status_error
from polar_gym.proxy.engines.openai import OpenAIEngine
from polar_gym.proxy.engines.sglang import SGLangEngine, output_tokens_in, sampling_params
from polar_gym.proxy.engines.vllm import VLLMEngine
from polar_gym.proxy.errors import (
    RequestError,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnavailable,
    translate_upstream_errors,
)
from polar_gym.proxy.upstreams import UpstreamPool
from tests._fakes import FakeVLLM
from tests._waiting import BOUND, until

URL = "http://engine"
SHELL = Tool(function={"name": "bash", "description": "run", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}})


def chat(**kwargs: Any) -> ChatRequest:
    return ChatRequest(model="policy", messages=[ChatMessage(role="user", content="hi")], **kwargs)


def client_for(handler: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def replying(body: dict[str, Any], seen: list[dict[str, Any]] | None = None) -> httpx.AsyncClient:
    def handler(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(json.loads(request.content))
        return httpx.Response(200, json=body)

    return client_for(handler)


# --- vLLM -----------------------------------------------------------------------------------------------------

#: the shape vLLM CPU 0.32.0 answers with ``return_token_ids`` and ``logprobs`` (measured on the tiny Qwen3)
VLLM_ANSWER: dict[str, Any] = {
    "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "tiny",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "abc", "refusal": None, "annotations": None,
                                         "audio": None, "function_call": None, "tool_calls": [],
                                         "reasoning": None},
                 "logprobs": {"content": [{"token": "a", "logprob": -11.9, "bytes": [97], "top_logprobs": []},
                                          {"token": "bc", "logprob": -12.25, "bytes": [98, 99], "top_logprobs": []}]},
                 "finish_reason": "length", "stop_reason": None, "token_ids": [64, 8904]}],
    "service_tier": None, "system_fingerprint": None,
    "usage": {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2, "prompt_tokens_details": None},
    "prompt_logprobs": None, "prompt_token_ids": [151644, 872, 198], "kv_transfer_params": None,
}


async def test_vllm_build_asks_for_token_ids_and_logprobs():
    seen: list[dict[str, Any]] = []
    engine = VLLMEngine(UpstreamPool([URL]), client=replying(VLLM_ANSWER, seen))
    result = await engine.complete(chat(max_tokens=2, tools=[SHELL]), "s")
    body = seen[0]
    assert body["return_token_ids"] is True and body["logprobs"] is True and body["stream"] is False
    assert body["max_tokens"] == 2 and body["tools"][0]["function"]["name"] == "bash"
    assert result.prompt_ids == [151644, 872, 198] and result.response_ids == [64, 8904]
    assert result.response_logprobs == [-11.9, -12.25]
    assert result.finish_reason == "length" and result.message.content == "abc"
    assert result.message.tool_calls is None  # vLLM sends [] when there are none
    assert result.usage.prompt_tokens == 3 and result.server == URL and result.engine == "vllm"


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_vllm_reasoning_under_either_name(field: str):
    body = json.loads(json.dumps(VLLM_ANSWER))
    body["choices"][0]["message"][field] = "thinking"
    assert VLLMEngine().parse(body).message.reasoning_content == "thinking"


def test_vllm_tool_call_answer():
    body = json.loads(json.dumps(VLLM_ANSWER))
    body["choices"][0]["message"]["tool_calls"] = [
        {"id": "chatcmpl-tool-1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}]
    body["choices"][0]["finish_reason"] = "tool_calls"
    result = VLLMEngine().parse(body)
    assert result.finish_reason == "tool_calls"
    assert result.message.tool_calls[0].function.arguments == '{"command": "ls"}'


@pytest.mark.parametrize(("edit", "needle"), [
    (lambda b: b.pop("prompt_token_ids"), "prompt_token_ids"),
    (lambda b: b["choices"][0].pop("token_ids"), "token_ids"),
    (lambda b: b["choices"][0]["logprobs"]["content"].pop(), "1 logprobs for 2"),
    (lambda b: b["choices"][0].update(logprobs=None), "0 logprobs"),
    (lambda b: b.update(choices=[]), "index"),
])
async def test_vllm_malformed_answers_are_upstream_errors(edit: Any, needle: str):
    body = json.loads(json.dumps(VLLM_ANSWER))
    edit(body)
    engine = VLLMEngine(UpstreamPool([URL]), client=replying(body))
    with pytest.raises(UpstreamError, match="unusable") as info:
        await engine.complete(chat(), "s")
    assert needle in str(info.value)
    assert engine.pool.servers()[0].failures == 1


async def test_vllm_against_the_recording_fake():
    fake = FakeVLLM(reply="ok", tool_call={"name": "bash", "arguments": '{"command": "pwd"}'})
    engine = VLLMEngine(UpstreamPool([URL]), client=client_for(fake.handler))
    result = await engine.complete(chat(tools=[SHELL]), "s")
    answer = fake.answer(fake.requests[0])
    assert result.prompt_ids == answer["prompt_token_ids"]
    assert result.response_ids == answer["choices"][0]["token_ids"]
    assert result.finish_reason == "tool_calls"


# --- SGLang chat ----------------------------------------------------------------------------------------------

#: SGLang's chat answer with return_prompt_token_ids, return_meta_info and logprobs (per its serving_chat.py)
SGLANG_ANSWER: dict[str, Any] = {
    "id": "abc", "object": "chat.completion", "created": 0, "model": "policy",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "", "reasoning_content": "hmm",
                                         "tool_calls": [{"id": "call_0", "index": 0, "type": "function",
                                                         "function": {"name": "bash",
                                                                      "arguments": '{"command": "ls"}'}}]},
                 "logprobs": {"content": [{"token": "x", "bytes": [120], "logprob": -0.5, "top_logprobs": []}]},
                 "finish_reason": "tool_calls", "matched_stop": None,
                 "prompt_token_ids": [151644, 872, 198, 6023],
                 "meta_info": {"id": "abc", "finish_reason": {"type": "stop", "matched": 151645},
                               "prompt_tokens": 4, "completion_tokens": 3, "cached_tokens": 0,
                               "weight_version": "step-7",
                               "output_token_logprobs": [[-0.5, 151657, "<tool_call>"], [-0.25, 785, None],
                                                         [-999999999.0, 151645, "<|im_end|>"]]}}],
    "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7},
    "metadata": {"weight_version": "step-7"},
}


async def test_sglang_chat_build_and_parse():
    seen: list[dict[str, Any]] = []
    engine = SGLangEngine(UpstreamPool([URL]), client=replying(SGLANG_ANSWER, seen))
    result = await engine.complete(chat(tools=[SHELL]), "s")
    body = seen[0]
    assert body["return_prompt_token_ids"] is True and body["return_meta_info"] is True and body["logprobs"] is True
    assert result.prompt_ids == [151644, 872, 198, 6023]
    assert result.response_ids == [151657, 785, 151645]
    assert result.response_logprobs == [-0.5, -0.25, -999999999.0]
    assert result.finish_reason == "tool_calls" and result.message.reasoning_content == "hmm"
    assert result.raw["weight_version"] == "step-7"


@pytest.mark.parametrize("drop", ["prompt_token_ids", "meta_info"])
def test_sglang_chat_without_token_fields_is_an_error(drop: str):
    body = json.loads(json.dumps(SGLANG_ANSWER))
    body["choices"][0].pop(drop)
    with pytest.raises(ValueError, match="return_prompt_token_ids"):
        SGLangEngine().parse(body)


def test_sglang_output_tokens_need_logprobs():
    with pytest.raises(ValueError, match="output_token_logprobs"):
        output_tokens_in({"id": "x"})
    # a null logprob means "none": the record says so (an empty list), never a made-up 0.0
    assert output_tokens_in({"output_token_logprobs": [[None, 5, None]]}) == ([5], [])
    assert output_tokens_in({"output_token_logprobs": [[-0.5, 5, None], [None, 6, None]]}) == ([5, 6], [])
    assert output_tokens_in({"output_token_logprobs": [[-0.5, 5, None], [0.0, 6, None]]}) == ([5, 6], [-0.5, 0.0])


async def test_sglang_chat_answer_without_logprobs_has_none():
    body = json.loads(json.dumps(SGLANG_ANSWER))
    for triple in body["choices"][0]["meta_info"]["output_token_logprobs"]:
        triple[0] = None
    engine = SGLangEngine(UpstreamPool([URL]), client=replying(body, []))
    result = await engine.complete(chat(tools=[SHELL]), "s")
    assert result.response_ids == [151657, 785, 151645] and result.response_logprobs == []


# --- SGLang native /generate ----------------------------------------------------------------------------------

def test_sampling_params_use_sglang_names():
    req = chat(max_tokens=8, temperature=0.5, top_p=0.9, top_k=20, stop=["END"], seed=3)
    assert sampling_params(req) == {"max_new_tokens": 8, "temperature": 0.5, "top_p": 0.9, "top_k": 20,
                                    "stop": ["END"], "sampling_seed": 3}
    assert sampling_params(chat()) == {}


# --- OpenAI-compatible (not token-faithful) -------------------------------------------------------------------

async def test_openai_engine_records_no_tokens():
    seen: list[dict[str, Any]] = []
    answer = {"choices": [{"message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 9, "completion_tokens": 1}}
    engine = OpenAIEngine(UpstreamPool([URL]), client=replying(answer, seen))
    result = await engine.complete(chat(), "s")
    assert "return_token_ids" not in seen[0] and "logprobs" not in seen[0]
    assert not result.token_faithful and result.prompt_ids == [] and result.response_ids == []
    assert result.usage.prompt_tokens == 9 and result.message.content == "hi"
    assert not OpenAIEngine.token_faithful


# --- error mapping --------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("status", "kind"), [
    (400, RequestError), (413, RequestError), (422, RequestError),
    (429, UpstreamUnavailable), (503, UpstreamUnavailable),
    (500, UpstreamError), (404, UpstreamError),
])
async def test_upstream_status_mapping(status: int, kind: type[Exception]):
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, json={"error": {"message": "maximum context length is 64 tokens"}})

    engine = VLLMEngine(UpstreamPool([URL]), client=client_for(handler))
    with pytest.raises(kind) as info:
        await engine.complete(chat(), "s")
    assert type(info.value) is kind and str(status) in str(info.value)
    if kind is RequestError:
        assert "maximum context length" in str(info.value)  # the harness sees the engine's reason


def test_upstream_status_error_truncates_bodies():
    assert len(upstream_status_error(URL, 500, "x" * 10_000).message) < 600


@pytest.mark.parametrize(("exc", "kind"), [
    (httpx.ConnectError("refused"), UpstreamUnavailable),
    (httpx.ReadTimeout("slow"), UpstreamTimeout),
    (httpx.RemoteProtocolError("eof"), UpstreamUnavailable),
])
async def test_transport_failures(exc: Exception, kind: type[Exception]):
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc

    engine = SGLangEngine(UpstreamPool([URL]), client=client_for(handler))
    with pytest.raises(kind):
        await engine.complete(chat(), "s")
    assert engine.pool.servers()[0].in_flight == 0


@pytest.mark.parametrize("payload", [b"<html>bad gateway</html>", b"[1, 2]"])
async def test_garbage_answers(payload: bytes):
    engine = VLLMEngine(UpstreamPool([URL]), client=client_for(lambda r: httpx.Response(200, content=payload)))
    with pytest.raises(UpstreamError, match="unusable"):
        await engine.complete(chat(), "s")


def test_translate_upstream_errors_passes_other_exceptions():
    with pytest.raises(RuntimeError), translate_upstream_errors(URL):
        raise RuntimeError("a bug is not an upstream error")


async def test_engine_owns_its_client_only_when_it_made_it():
    given = client_for(lambda r: httpx.Response(200, json=VLLM_ANSWER))
    await VLLMEngine(client=given).aclose()
    assert not given.is_closed
    own = VLLMEngine()
    await own.aclose()
    assert own.client.is_closed


# --- UpstreamPool ---------------------------------------------------------------------------------------------

async def test_pool_least_loaded_and_sticky():
    pool = UpstreamPool(["http://a", "http://b/"])
    async with pool.lease("s1") as first:
        async with pool.lease("s2") as second:
            assert {first.url, second.url} == {"http://a", "http://b"}  # the busy one is avoided
        async with pool.lease("s1") as again:
            assert again.url == first.url  # sticky, even though it is the busier one
    async with pool.lease(None) as anonymous:
        assert anonymous.in_flight == 1
    assert {s.url: s.served for s in pool.servers()} == {first.url: 2, second.url: 1} | {
        anonymous.url: (2 if anonymous.url == first.url else 1) + 1}


async def test_pool_add_remove_moves_sticky_sessions():
    pool = UpstreamPool(["http://a"])
    async with pool.lease("s") as server:
        assert server.url == "http://a"
    pool.add("http://b")
    async with pool.lease("s") as server:
        assert server.url == "http://a"
    assert pool.remove("http://a") and not pool.remove("http://a")
    async with pool.lease("s") as server:
        assert server.url == "http://b"
    pool.clear()
    assert pool.servers() == []
    pool.forget("s")


async def test_pool_empty_waits_for_a_server_then_gives_up():
    pool = UpstreamPool(wait_for_server_seconds=0.05)
    with pytest.raises(UpstreamUnavailable, match="no inference server"):
        async with pool.lease("s"):
            pass
    pool.wait_for_server_seconds = BOUND

    async def lease_url() -> str:
        async with pool.lease("s") as server:
            return server.url

    waiting = asyncio.create_task(lease_url())
    await asyncio.sleep(0.01)
    assert not waiting.done()
    pool.add("http://late")
    assert await asyncio.wait_for(waiting, BOUND) == "http://late"


async def test_pause_drains_in_flight_and_resume_releases_waiters_with_new_version():
    gate = asyncio.Event()
    versions_seen: list[Any] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        await gate.wait()
        return httpx.Response(200, json=VLLM_ANSWER)

    pool = UpstreamPool(["http://a", "http://b"], policy_version=1)
    engine = VLLMEngine(pool, client=client_for(handler))

    async def call(sid: str) -> None:
        result = await engine.complete(chat(), sid)
        versions_seen.append((sid, result.policy_version))

    in_flight = [asyncio.create_task(call(f"old{i}")) for i in range(3)]
    await until(lambda: sum(s.in_flight for s in pool.servers()) == 3, what="three requests in flight")
    pausing = asyncio.create_task(pool.pause(drain_timeout=BOUND))
    await until(lambda: pool.paused, what="the pool to pause")
    assert not pausing.done()  # waits for the three in flight
    waiting = [asyncio.create_task(call(f"new{i}")) for i in range(4)]
    await asyncio.sleep(0.02)  # (a chance to misbehave: on a slow machine the check below only gets weaker)
    assert sum(s.in_flight for s in pool.servers()) == 3  # no new request reached an engine
    gate.set()
    await asyncio.wait_for(pausing, BOUND)
    await asyncio.gather(*in_flight)
    await asyncio.sleep(0.02)  # (as above)
    assert not any(t.done() for t in waiting)  # still held: the weights are being swapped
    pool.resume(policy_version=2)
    await asyncio.wait_for(asyncio.gather(*waiting), BOUND)
    assert sorted(versions_seen) == sorted([(f"old{i}", 1) for i in range(3)] + [(f"new{i}", 2) for i in range(4)])
    assert sum(s.served for s in pool.servers()) == 7 and sum(s.failures for s in pool.servers()) == 0
    assert not pool.paused


async def test_pause_with_nothing_in_flight_returns_at_once_and_times_out_when_stuck():
    pool = UpstreamPool(["http://a"])
    await asyncio.wait_for(pool.pause(), BOUND)  # (returns: nothing in flight, no drain timeout given)
    pool.resume()
    stuck = asyncio.Event()

    async def hold() -> None:
        async with pool.lease("s"):
            await stuck.wait()

    holder = asyncio.create_task(hold())
    await until(lambda: pool.servers()[0].in_flight == 1, what="the lease to be held")
    with pytest.raises(TimeoutError):
        await pool.pause(drain_timeout=0.05)
    stuck.set()
    await holder
    pool.resume()
    assert pool.policy_version is None


async def test_upstream_model_replaces_the_harness_model_name():
    seen: list[dict[str, Any]] = []
    engine = VLLMEngine(UpstreamPool([URL]), client=replying(VLLM_ANSWER, seen), upstream_model="tiny")
    await engine.complete(ChatRequest(model="claude-sonnet-4-5", messages=[ChatMessage(role="user", content="x")]),
                          "s")
    assert seen[0]["model"] == "tiny"
    plain = VLLMEngine(UpstreamPool([URL]), client=replying(VLLM_ANSWER, seen))
    await plain.complete(chat(), "s")
    assert seen[1]["model"] == "policy"
