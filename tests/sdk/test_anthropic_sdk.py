"""The official Anthropic SDK against a running proxy: plain and streamed messages, a Bash tool round trip played by
the oracle with thinking sent back, the beta path, count_tokens, errors, and what the journal keeps."""

from __future__ import annotations

import anthropic
import pytest

from tests.sdk._sdk_kit import closing

pytestmark = pytest.mark.sdk

BASH = {"name": "Bash", "description": "Run a shell command",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"},
                                                          "timeout": {"type": "number"}},
                         "required": ["command"]},
        "cache_control": {"type": "ephemeral"}}
SYSTEM = [{"type": "text", "text": "You are a coder.", "cache_control": {"type": "ephemeral"}}]
FINAL = "All done: out.txt holds hello."


def client(proxy, key: str) -> anthropic.Anthropic:
    return closing(anthropic.Anthropic(base_url=proxy.url, api_key=key, max_retries=0))


def test_plain_message(proxy_server):
    c = client(proxy_server, "ant-plain")
    msg = c.messages.create(model="policy", max_tokens=1024, system=SYSTEM,
                            messages=[{"role": "user", "content": "Say hi"}])
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant"
    assert msg.model == "policy"
    assert [b.type for b in msg.content] == ["text"]  # thinking was not enabled, so none is shown
    assert msg.content[0].text == FINAL
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
    (record,) = proxy_server.completions("ant-plain")
    assert record["provider"] == "anthropic" and record["path"] == "/v1/messages"
    assert msg.usage.input_tokens == len(record["prompt_ids"])
    assert msg.usage.output_tokens == len(record["response_ids"])
    assert msg.usage.cache_read_input_tokens == 0 and msg.usage.cache_creation_input_tokens == 0
    assert record["normalized_request"]["messages"][0] == {"role": "system", "content": "You are a coder."}


def test_stream_events_and_final_message(proxy_server):
    c = client(proxy_server, "ant-stream")
    with c.messages.stream(model="policy", max_tokens=2048, thinking={"type": "enabled", "budget_tokens": 1024},
                           messages=[{"role": "user", "content": "Say hi"}]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "The reference solution is complete."
    assert final.content[0].signature
    assert final.content[1].text == FINAL
    assert final.stop_reason == "end_turn"
    (record,) = proxy_server.completions("ant-stream")
    assert record["stream"] is True
    assert final.usage.input_tokens == len(record["prompt_ids"])
    assert final.usage.output_tokens == len(record["response_ids"])


def test_streamed_tool_use_accumulates_input(proxy_server):
    c = client(proxy_server, "ant-stream-tool")
    with c.messages.stream(model="policy", max_tokens=1024, tools=[BASH],
                           messages=[{"role": "user", "content": "Make out.txt"}]) as stream:
        final = stream.get_final_message()
    (use,) = [b for b in final.content if b.type == "tool_use"]
    assert use.name == "Bash" and use.input == {"command": "echo hello > out.txt"}
    assert use.id.startswith("toolu_")
    assert final.stop_reason == "tool_use"


def test_tool_round_trip_with_thinking_sent_back(proxy_server):
    c = client(proxy_server, "ant-tools")
    thinking = {"type": "adaptive"}
    messages: list = [{"role": "user", "content": "Make out.txt"}]
    first = c.messages.create(model="policy", max_tokens=4096, system=SYSTEM, tools=[BASH], thinking=thinking,
                              messages=messages)
    assert first.stop_reason == "tool_use"
    assert [b.type for b in first.content] == ["thinking", "tool_use"]
    use = first.content[1]
    assert use.id.startswith("toolu_01") and len(use.id) == len("toolu_01") + 22
    assert use.input == {"command": "echo hello > out.txt"}

    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": ""}]}]
    second = c.messages.create(model="policy", max_tokens=4096, system=SYSTEM, tools=[BASH], thinking=thinking,
                               messages=messages)
    (use2,) = [b for b in second.content if b.type == "tool_use"]
    assert use2.input == {"command": "cat out.txt"}
    assert use2.id != use.id

    records = proxy_server.completions("ant-tools")
    assert [r["index"] for r in records] == [0, 1]
    first_ids = records[0]["prompt_ids"]
    assert records[1]["prompt_ids"][: len(first_ids)] == first_ids
    assert len(records[1]["prompt_ids"]) > len(first_ids)
    assert len(records[0]["response_logprobs"]) == len(records[0]["response_ids"]) > 0
    sent_back = records[1]["normalized_request"]["messages"]
    assert [m["role"] for m in sent_back] == ["system", "user", "assistant", "tool"]
    assert sent_back[2]["reasoning_content"] == first.content[0].thinking
    assert sent_back[2]["tool_calls"][0]["id"] == use.id
    assert sent_back[3]["tool_call_id"] == use.id


def test_foreign_thinking_signature_is_accepted(proxy_server):
    c = client(proxy_server, "ant-signature")
    msg = c.messages.create(model="policy", max_tokens=512, messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Greet back.", "signature": "EqQBCkgI=="},
                                          {"type": "text", "text": "Hello!"}]},
        {"role": "user", "content": "Bye"}])
    assert msg.content[0].text == FINAL
    (record,) = proxy_server.completions("ant-signature")
    assert record["normalized_request"]["messages"][1]["reasoning_content"] == "Greet back."


def test_beta_path(proxy_server):
    # SDK 2.x keeps its beta marker internal; Claude Code puts ?beta=true on the URL, so the test does too.
    c = client(proxy_server, "ant-beta")
    msg = c.beta.messages.create(model="policy", max_tokens=512, messages=[{"role": "user", "content": "hi"}],
                                 betas=["interleaved-thinking-2025-05-14"], extra_query={"beta": "true"})
    assert isinstance(msg, anthropic.types.beta.BetaMessage)
    assert msg.content[0].type == "text" and msg.content[0].text == FINAL
    (record,) = proxy_server.completions("ant-beta")
    assert record["path"] == "/v1/messages?beta=true"


def test_count_tokens_matches_the_prompt(proxy_server):
    c = client(proxy_server, "ant-count")
    kwargs = {"model": "policy", "system": SYSTEM, "tools": [BASH],
              "messages": [{"role": "user", "content": "Make out.txt"}]}
    counted = c.messages.count_tokens(**kwargs)
    assert counted.input_tokens > 0
    msg = c.messages.create(max_tokens=512, **kwargs)
    assert counted.input_tokens == msg.usage.input_tokens


def test_bad_requests_raise_readable_errors(proxy_server):
    c = client(proxy_server, "ant-errors")
    with pytest.raises(anthropic.BadRequestError) as info:
        c.post("/v1/messages", body={"model": "policy", "messages": [{"role": "user", "content": "hi"}]},
               cast_to=anthropic.types.Message)
    assert "max_tokens" in info.value.message
    assert info.value.body["error"]["type"] == "invalid_request_error"

    pdf = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="}}
    with pytest.raises(anthropic.BadRequestError) as info:
        c.messages.create(model="policy", max_tokens=64, messages=[{"role": "user", "content": [pdf]}])
    assert "messages.0.content.0.source.type" in info.value.message
    assert proxy_server.completions("ant-errors") == []  # rejected requests never reach the engine


def test_billing_line_does_not_break_prefix_sharing(proxy_server):
    c = client(proxy_server, "ant-billing")
    replies = []
    for cch in ("36ee5", "0aaa9"):
        system = [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.197.c8e; cc_entrypoint=cli; "
                                           f"cch={cch};"},
                  {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."}]
        replies.append(c.messages.create(model="policy", max_tokens=512, system=system, tools=[BASH],
                                         messages=[{"role": "user", "content": "Make out.txt"}]))
    first, second = proxy_server.completions("ant-billing")
    assert first["prompt_ids"] == second["prompt_ids"]
    assert "cch=36ee5" in first["request"]["system"][0]["text"]  # the journal keeps the request as received
    assert first["normalized_request"]["messages"][0]["content"] == (
        "You are Claude Code, Anthropic's official CLI for Claude.")
    assert any("billing" in note for note in first["normalizations"])
    assert replies[0].usage.input_tokens == replies[1].usage.input_tokens
