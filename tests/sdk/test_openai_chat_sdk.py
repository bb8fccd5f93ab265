"""The official OpenAI SDK against a running proxy: Chat Completions, plain and streaming, with a tool-call round
trip played by the oracle."""

from __future__ import annotations

import json

import openai
import pytest

from tests.sdk._sdk_kit import closing

pytestmark = pytest.mark.sdk

SHELL_TOOL = {"type": "function", "function": {
    "name": "run_shell_command", "description": "Run a shell command",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"},
                                                    "description": {"type": "string"}},
                   "required": ["command", "description"]}}}


def client(proxy, key: str) -> openai.OpenAI:
    return closing(openai.OpenAI(base_url=proxy.url + "/v1", api_key=key, max_retries=0))


def test_plain_tool_round_trip_is_captured(proxy_server):
    c = client(proxy_server, "chat-plain")
    messages = [{"role": "system", "content": "You are a coder."}, {"role": "user", "content": "Make out.txt"}]
    first = c.chat.completions.create(model="policy", messages=messages, tools=[SHELL_TOOL])
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "run_shell_command"
    assert json.loads(call.function.arguments) == {"command": "echo hello > out.txt",
                                                   "description": "Run a step of the reference solution"}
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": ""}]
    second = c.chat.completions.create(model="policy", messages=messages, tools=[SHELL_TOOL])
    assert json.loads(second.choices[0].message.tool_calls[0].function.arguments)["command"] == "cat out.txt"

    records = proxy_server.completions("chat-plain")
    assert [r["index"] for r in records] == [0, 1]
    assert records[1]["prompt_ids"][: len(records[0]["prompt_ids"])] == records[0]["prompt_ids"]
    assert records[0]["response_ids"][-1] == 257  # the end-of-turn token was sampled
    assert len(records[0]["response_logprobs"]) == len(records[0]["response_ids"])
    assert second.usage.prompt_tokens == len(records[1]["prompt_ids"])


def test_stream_with_usage_and_tool_call(proxy_server):
    c = client(proxy_server, "chat-stream")
    stream = c.chat.completions.create(model="policy", messages=[{"role": "user", "content": "go"}],
                                       tools=[SHELL_TOOL], stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    args = "".join(ch.choices[0].delta.tool_calls[0].function.arguments or ""
                   for ch in chunks if ch.choices and ch.choices[0].delta.tool_calls)
    assert json.loads(args)["command"] == "echo hello > out.txt"
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == ["tool_calls"]


def test_stream_accumulates_with_sdk_helper(proxy_server):
    c = client(proxy_server, "chat-helper")
    with c.chat.completions.stream(model="policy", messages=[{"role": "user", "content": "hi"}]) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.content == "All done: out.txt holds hello."
    assert final.choices[0].finish_reason == "stop"


def test_errors_are_openai_shaped(proxy_server):
    c = client(proxy_server, "chat-errors")
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="policy", messages=[])
    assert "messages" in info.value.message
