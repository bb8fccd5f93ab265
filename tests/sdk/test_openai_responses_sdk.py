"""The official OpenAI SDK against a running proxy: the Responses API, plain and streaming, a function-call round
trip played by the oracle, and a codex-shaped conversation whose reasoning comes back through encrypted_content."""

from __future__ import annotations

import json

import openai
import pytest

from tests.sdk._sdk_kit import closing

pytestmark = pytest.mark.sdk

FINAL = "All done: out.txt holds hello."
SHELL_TOOL = {"type": "function", "name": "shell", "description": "Run a shell command", "strict": False,
              "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                             "required": ["command"]}}
# What codex offers: a unified-exec style function and the freeform apply_patch tool.
CODEX_TOOLS = [
    {"type": "function", "name": "exec_command", "description": "Runs a command in a PTY", "strict": False,
     "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}, "workdir": {"type": "string"},
                                                      "yield_time_ms": {"type": "number"}},
                    "required": ["cmd"], "additionalProperties": False}},
    {"type": "custom", "name": "apply_patch", "description": "Use the `apply_patch` tool to edit files.",
     "format": {"type": "grammar", "syntax": "lark", "definition": "start: begin_patch hunk+ end_patch"}},
]


def client(proxy, key: str) -> openai.OpenAI:
    return closing(openai.OpenAI(base_url=proxy.url + "/v1", api_key=key, max_retries=0))


def test_create_plain(proxy_server):
    resp = client(proxy_server, "resp-plain").responses.create(model="policy", input="Say hello.",
                                                              instructions="Be brief.")
    assert resp.id.startswith("resp_") and resp.object == "response"
    assert resp.status == "completed"
    assert resp.output_text == FINAL
    assert [item.type for item in resp.output] == ["reasoning", "message"]
    assert resp.output[0].content[0].text == "The reference solution is complete."
    assert resp.instructions == "Be brief." and resp.tool_choice == "auto" and resp.parallel_tool_calls is True
    [record] = proxy_server.completions("resp-plain")
    assert record["provider"] == "openai_responses"
    assert [m["role"] for m in record["normalized_request"]["messages"]] == ["system", "user"]
    assert resp.usage.input_tokens == len(record["prompt_ids"])
    assert resp.usage.output_tokens == len(record["response_ids"])
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens


def test_max_output_tokens_makes_an_incomplete_response(proxy_server):
    resp = client(proxy_server, "resp-short").responses.create(model="policy", input="hi", max_output_tokens=5)
    assert resp.status == "incomplete"
    assert resp.incomplete_details is not None and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 5


def test_stream_helper_accumulates_the_final_response(proxy_server):
    c = client(proxy_server, "resp-helper")
    with c.responses.stream(model="policy", input="hi", reasoning={"summary": "auto"}) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == FINAL
    assert final.output_text == FINAL
    assert final.output[0].type == "reasoning"
    assert final.output[0].summary[0].text == "The reference solution is complete."


def test_stream_true_event_grammar(proxy_server):
    events = list(client(proxy_server, "resp-events").responses.create(
        model="policy", input="make out.txt", tools=[SHELL_TOOL], stream=True))
    assert [e.type for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    call = events[-2].item
    assert call.type == "function_call" and call.name == "shell"
    assert json.loads(call.arguments) == {"command": "echo hello > out.txt"}
    assert events[-1].response.output[1] == call


def test_function_call_round_trip_extends_the_prompt(proxy_server):
    c = client(proxy_server, "resp-tools")
    conversation: list = [{"role": "user", "content": "Make out.txt"}]
    first = c.responses.create(model="policy", input=conversation, tools=[SHELL_TOOL])
    call = next(item for item in first.output if item.type == "function_call")
    assert json.loads(call.arguments)["command"] == "echo hello > out.txt"
    conversation += [item.model_dump(exclude_none=True) for item in first.output]
    conversation.append({"type": "function_call_output", "call_id": call.call_id, "output": ""})
    second = c.responses.create(model="policy", input=conversation, tools=[SHELL_TOOL])
    call2 = next(item for item in second.output if item.type == "function_call")
    assert json.loads(call2.arguments)["command"] == "cat out.txt"
    assert call2.call_id != call.call_id

    first_rec, second_rec = proxy_server.completions("resp-tools")
    assert second_rec["prompt_ids"][: len(first_rec["prompt_ids"])] == first_rec["prompt_ids"]
    assert len(second_rec["prompt_ids"]) > len(first_rec["prompt_ids"])
    assistant = second_rec["normalized_request"]["messages"][1]
    assert assistant["reasoning_content"] == "Step 1: run `echo hello > out.txt`."
    assert assistant["tool_calls"][0]["id"] == call.call_id


def test_codex_shaped_conversation_round_trips_reasoning(proxy_server):
    c = client(proxy_server, "resp-codex")
    conversation: list = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "<permissions>"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Create out.txt"}]},
    ]
    settings = dict(model="policy", tools=CODEX_TOOLS, tool_choice="auto", parallel_tool_calls=False,
                    reasoning={"effort": "medium", "summary": "auto"}, include=["reasoning.encrypted_content"],
                    store=False, stream=True, prompt_cache_key="thread-1", text={"verbosity": "medium"},
                    extra_body={"client_metadata": {"x": "y"}})
    events = list(c.responses.create(input=conversation, **settings))
    assert [e.type for e in events][2:7] == [
        "response.output_item.added", "response.reasoning_summary_part.added",
        "response.reasoning_summary_text.delta", "response.reasoning_summary_text.done",
        "response.reasoning_summary_part.done",
    ]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    reasoning, call = done
    assert reasoning.type == "reasoning" and reasoning.encrypted_content and reasoning.content is None
    assert reasoning.summary[0].text == "Step 1: run `echo hello > out.txt`."
    assert call.type == "function_call" and json.loads(call.arguments)["cmd"] == "echo hello > out.txt"
    completed = events[-1].response
    assert completed.status == "completed" and completed.usage.input_tokens > 0

    # codex sends items back without their ids
    conversation += [
        {"type": "reasoning", "summary": [s.model_dump() for s in reasoning.summary],
         "encrypted_content": reasoning.encrypted_content},
        {"type": "function_call", "name": call.name, "arguments": call.arguments, "call_id": call.call_id},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Process exited with code 0"},
    ]
    events = list(c.responses.create(input=conversation, **settings))
    call2 = next(e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call")
    assert json.loads(call2.arguments)["cmd"] == "cat out.txt"

    first, second = proxy_server.completions("resp-codex")
    assert second["prompt_ids"][: len(first["prompt_ids"])] == first["prompt_ids"]
    messages = second["normalized_request"]["messages"]
    assert [m["role"] for m in messages] == ["developer", "user", "assistant", "tool"]
    assert messages[2]["reasoning_content"] == "Step 1: run `echo hello > out.txt`."
    assert not any("summary" in note for note in second["normalizations"])  # decoded, not read off the summary
    assert messages[3] == {"role": "tool", "content": "Process exited with code 0", "tool_call_id": call.call_id}
    assert second["normalized_request"]["tools"][1]["function"]["name"] == "apply_patch"


def test_stateful_request_is_a_readable_bad_request(proxy_server):
    c = client(proxy_server, "resp-errors")
    with pytest.raises(openai.BadRequestError) as info:
        c.responses.create(model="policy", input="again", previous_response_id="resp_123")
    assert "previous_response_id" in info.value.message and "stateless" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        c.responses.create(model="policy", input=[{"type": "item_reference", "id": "msg_1"}])
    assert "input.0" in info.value.message and "item_reference" in info.value.message
    assert proxy_server.completions("resp-errors") == []
