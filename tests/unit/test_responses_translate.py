"""The Responses front end as pure functions: request items -> chat messages, results -> Response objects and the
stream grammar, the reasoning round trip through our encrypted_content, and the 400s a harness can read.

Rendered bodies and events are validated with the official SDK's own models (tests may import SDKs; the package
may not)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

import polar_gym.proxy.providers.openai_responses as package
from polar_gym.proxy.chat import ChatMessage, ChatResult, FunctionCall, ToolCall, Usage
from polar_gym.proxy.errors import RequestError
from polar_gym.proxy.providers.base import RenderContext, Route
from polar_gym.proxy.providers.openai_responses import OpenAIResponsesProvider, protocol, render, translate
from polar_gym.proxy.providers.openai_responses.protocol import (
    ENCRYPTED_PREFIX,
    KNOWN_IGNORED,
    decode_reasoning,
    encode_reasoning,
)
from polar_gym.registry import PROVIDERS

PROVIDER = OpenAIResponsesProvider()
ROUTE = Route("/v1/responses")
CTX = RenderContext(response_id="resp_abc123", created=1_700_000_000)
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
SHELL = {"type": "function", "name": "shell", "description": "Run", "strict": False,
         "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}
PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files",
         "format": {"type": "grammar", "syntax": "lark", "definition": "start: hunk+"}}


def parse(**body: Any):
    return PROVIDER.parse({"model": "policy", **body}, ROUTE)


def messages(**body: Any) -> list[dict[str, Any]]:
    return [m.model_dump(exclude_none=True) for m in parse(**body).chat.messages]


def bad(match: str, **body: Any) -> None:
    with pytest.raises(RequestError, match=match):
        parse(**body)


def result(text: str | None = "", reasoning: str | None = None, calls: list[tuple[str, str]] | None = None,
           finish: str = "stop") -> ChatResult:
    tool_calls = [ToolCall(id=f"call_{i}", function=FunctionCall(name=n, arguments=a))
                  for i, (n, a) in enumerate(calls or [])]
    return ChatResult(message=ChatMessage(role="assistant", content=text, reasoning_content=reasoning,
                                          tool_calls=tool_calls or None),
                      finish_reason=finish, usage=Usage(prompt_tokens=11, completion_tokens=7))  # type: ignore[arg-type]


def rendered(res: ChatResult, **body: Any) -> dict[str, Any]:
    out = PROVIDER.render(res, parse(input="hi", **body), CTX)
    Response.model_validate(out)  # the SDK's own model accepts it
    return out


# ---------------------------------------------------------------- exports


def test_exports_and_registry():
    assert package.__all__ == ["OpenAIResponsesProvider"]
    for module in (package, protocol, translate, render):
        for name in module.__all__:
            assert hasattr(module, name), (module.__name__, name)
    assert PROVIDERS.get("openai_responses") is OpenAIResponsesProvider
    assert OpenAIResponsesProvider.name == "openai_responses"
    assert OpenAIResponsesProvider.conversation_field == "input"


# ---------------------------------------------------------------- parse: messages


def test_string_input_and_instructions():
    inbound = parse(input="hello", instructions="Be terse.", max_output_tokens=64, temperature=0.2, top_p=0.9,
                    stream=True)
    assert messages(input="hello", instructions="Be terse.") == [
        {"role": "system", "content": "Be terse."}, {"role": "user", "content": "hello"}]
    chat = inbound.chat
    assert (chat.max_tokens, chat.temperature, chat.top_p) == (64, 0.2, 0.9)
    assert inbound.stream is True and inbound.model == "policy" and inbound.provider == "openai_responses"


def test_typed_and_easy_messages_keep_roles_and_join_text():
    got = messages(input=[
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "a"},
                                                          {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "look"},
            {"type": "input_image", "image_url": "data:image/png;base64,AA==", "detail": "low"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed", "phase": "final_answer",
         "content": [{"type": "output_text", "text": "ok", "annotations": []}]},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
    ])
    assert got[0] == {"role": "developer", "content": "rules"}
    assert got[1] == {"role": "system", "content": "ab"}
    assert got[2]["content"][1] == {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA==",
                                                                       "detail": "low"}}
    assert got[3] == {"role": "assistant", "content": "ok"}
    assert got[4] == {"role": "assistant", "content": "no"}


def test_turn_items_fold_into_one_assistant_message():
    got = messages(input=[
        {"role": "user", "content": "go"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Running."}]},
        {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": '{"command": "ls"}'},
        {"type": "function_call", "call_id": "c2", "name": "shell", "arguments": {"command": "pwd"}},
        {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "/w"}]},
    ], tools=[SHELL])
    assert got[1] == {"role": "assistant", "content": "Running.", "reasoning_content": "think", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "shell", "arguments": '{"command": "ls"}'}},
        {"id": "c2", "type": "function", "function": {"name": "shell", "arguments": '{"command": "pwd"}'}}]}
    assert got[2:] == [{"role": "tool", "content": "a.txt", "tool_call_id": "c1"},
                       {"role": "tool", "content": "/w", "tool_call_id": "c2"}]


def test_reasoning_after_content_starts_a_new_assistant_message():
    got = messages(input=[
        {"role": "user", "content": "go"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "r1"}]},
        {"role": "assistant", "content": "first"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "r2"}]},
        {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": "{}"},
    ])
    assert [(m.get("reasoning_content"), m.get("content")) for m in got[1:]] == [("r1", "first"), ("r2", None)]
    assert got[2]["tool_calls"][0]["id"] == "c1"


def test_consecutive_and_orphan_reasoning_are_kept_with_notes():
    inbound = parse(input=[
        {"role": "user", "content": "go"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "r1"}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "r2"}]},
        {"role": "assistant", "content": "a"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "r3"}]},
        {"role": "user", "content": "next"}])
    got = [(m.role, m.reasoning_content, m.content) for m in inbound.chat.messages]
    assert got == [("user", None, "go"), ("assistant", "r1\n\nr2", "a"), ("assistant", "r3", None),
                   ("user", None, "next")]
    assert inbound.normalizations == [
        "input.2: consecutive reasoning items joined into one turn",
        "input.4: reasoning with no message or call after it kept as an assistant turn without text"]


def test_tool_output_images_are_dropped_with_a_note():
    inbound = parse(input=[
        {"type": "function_call", "call_id": "c1", "name": "view_image", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [
            {"type": "input_text", "text": "here"}, {"type": "input_image", "image_url": "data:x"}]}])
    assert inbound.chat.messages[1].content == "here"
    assert inbound.normalizations == ["input.1.output.1: 'input_image' part dropped (tool results carry text only)"]


# ---------------------------------------------------------------- parse: reasoning sources


def test_reasoning_restored_from_our_encrypted_content_exactly():
    text = "Step 1: think about `ls`\n\nthen ünïcode ✓"
    got = messages(input=[
        {"role": "user", "content": "go"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "a summary"}],
         "encrypted_content": encode_reasoning(text)},
        {"role": "assistant", "content": "done"}])
    assert got[1] == {"role": "assistant", "content": "done", "reasoning_content": text}


def test_reasoning_falls_back_to_summary_with_a_note_and_drops_foreign_blobs():
    inbound = parse(input=[
        {"role": "user", "content": "go"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s1"},
                                          {"type": "summary_text", "text": "s2"}],
         "encrypted_content": "gAAAAforeign"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "more"},
        {"type": "reasoning", "summary": [], "encrypted_content": "gAAAAforeign"},
        {"role": "assistant", "content": "b"}])
    assert inbound.chat.messages[1].reasoning_content == "s1\n\ns2"
    assert inbound.chat.messages[3].reasoning_content is None
    assert inbound.normalizations == ["input.1: reasoning restored from its summary",
                                      "input.4: foreign encrypted reasoning cannot be read; dropped"]


@given(st.text())
def test_encrypted_content_round_trips_any_text(text):
    blob = encode_reasoning(text)
    assert blob.startswith(ENCRYPTED_PREFIX)
    assert decode_reasoning(blob) == text


@pytest.mark.parametrize("blob", [None, "", "gAAAA", ENCRYPTED_PREFIX + "!!!", ENCRYPTED_PREFIX + "//79"])
def test_foreign_or_damaged_blobs_decode_to_none(blob):
    assert decode_reasoning(blob) is None


@settings(max_examples=50, deadline=None)
@given(reasoning=st.text(min_size=1), text=st.text(), summary=st.booleans())
def test_rendered_reasoning_comes_back_exactly(reasoning, text, summary):
    """What a harness sends back from our output (ids stripped, codex style) restores the turn exactly."""
    body: dict[str, Any] = {"include": ["reasoning.encrypted_content"]}
    if summary:
        body["reasoning"] = {"summary": "auto"}
    out = PROVIDER.render(result(text, reasoning), parse(input="q", **body), CTX)
    items = [{k: v for k, v in item.items() if k != "id"} for item in out["output"]]
    back = parse(input=[{"role": "user", "content": "q"}, *items], **body).chat.messages[1]
    assert back.reasoning_content == reasoning
    assert back.content == text


# ---------------------------------------------------------------- parse: tools


def test_custom_tool_is_a_function_with_one_input_string_and_round_trips():
    inbound = parse(input=[
        {"role": "user", "content": "edit"},
        {"type": "custom_tool_call", "call_id": "p1", "name": "apply_patch", "input": "*** Begin Patch\n"},
        {"type": "custom_tool_call_output", "call_id": "p1", "output": "Done!"}], tools=[PATCH])
    [tool] = inbound.chat.tools or []
    assert tool.name == "apply_patch" and tool.function["description"] == "Edit files"
    assert tool.parameters["required"] == ["input"]
    assert "start: hunk+" in tool.parameters["properties"]["input"]["description"]
    call = inbound.chat.messages[1].tool_calls[0]
    assert json.loads(call.function.arguments) == {"input": "*** Begin Patch\n"}
    assert inbound.chat.messages[2].content == "Done!"

    out = PROVIDER.render(result(calls=[("apply_patch", call.function.arguments)], finish="tool_calls"), inbound, CTX)
    Response.model_validate(out)
    assert out["output"] == [{"id": "ctc_abc123_0", "type": "custom_tool_call", "call_id": "call_0",
                              "name": "apply_patch", "input": "*** Begin Patch\n"}]


@pytest.mark.parametrize(("arguments", "expected"), [
    ('{"patch": "P"}', "P"), ("not json", "not json"), ('{"a": 1, "b": 2}', '{"a": 1, "b": 2}')])
def test_custom_tool_input_when_the_model_wrote_other_arguments(arguments, expected):
    out = rendered(result(calls=[("apply_patch", arguments)], finish="tool_calls"), tools=[PATCH])
    assert out["output"][0]["input"] == expected


def test_namespace_tools_are_flattened_and_rendered_back():
    tools = [{"type": "namespace", "name": "mcp__files__", "description": "files", "tools": [
                 {"type": "function", "name": "read", "parameters": {"type": "object", "properties": {}}}]},
             {"type": "namespace", "name": "crm", "description": "crm", "tools": [
                 {"type": "custom", "name": "note"}]}]
    inbound = parse(input=[
        {"role": "user", "content": "x"},
        {"type": "function_call", "call_id": "c1", "name": "read", "namespace": "mcp__files__", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"}], tools=tools)
    assert [t.name for t in inbound.chat.tools or []] == ["mcp__files__read", "crm__note"]
    assert inbound.chat.messages[1].tool_calls[0].function.name == "mcp__files__read"
    out = PROVIDER.render(result(calls=[("mcp__files__read", "{}"), ("crm__note", '{"input": "hi"}')]), inbound, CTX)
    Response.model_validate(out)
    first, second = out["output"]
    assert (first["type"], first["name"], first["namespace"]) == ("function_call", "read", "mcp__files__")
    assert (second["type"], second["name"], second["namespace"], second["input"]) == (
        "custom_tool_call", "note", "crm", "hi")


def test_local_shell_tool_and_items_round_trip():
    inbound = parse(input=[
        {"role": "user", "content": "x"},
        {"type": "local_shell_call", "id": "lsh_1", "call_id": "c1", "status": "completed",
         "action": {"type": "exec", "command": ["bash", "-lc", "ls"], "env": {}, "timeout_ms": None}},
        {"type": "local_shell_call_output", "id": "lsh_1", "output": "a.txt"}], tools=[{"type": "local_shell"}])
    [tool] = inbound.chat.tools or []
    assert tool.name == "local_shell" and tool.parameters["properties"]["command"]["type"] == "array"
    call = inbound.chat.messages[1].tool_calls[0]
    assert (call.id, json.loads(call.function.arguments)) == ("c1", {"command": ["bash", "-lc", "ls"]})
    assert inbound.chat.messages[2].tool_call_id == "c1"
    out = PROVIDER.render(result(calls=[("local_shell", call.function.arguments)]), inbound, CTX)
    Response.model_validate(out)
    item = out["output"][0]
    assert item["type"] == "local_shell_call" and item["call_id"] == "call_0"
    assert item["action"]["command"] == ["bash", "-lc", "ls"] and item["action"]["type"] == "exec"
    # a string command runs through bash; unusable arguments stay a plain function call rather than an invalid
    # local_shell_call
    out = PROVIDER.render(result(calls=[("local_shell", '{"command": "ls", "env": {"A": "1"}}'),
                                        ("local_shell", '{"command": 5}'), ("local_shell", "[1]")]), inbound, CTX)
    assert out["output"][0]["action"]["command"] == ["bash", "-lc", "ls"]
    assert out["output"][0]["action"]["env"] == {"A": "1"}
    assert [i["type"] for i in out["output"]] == ["local_shell_call", "function_call", "function_call"]


def test_only_the_local_shell_function_becomes_a_local_shell_call():
    """A function tool declared next to local_shell, called with arguments that would make a shell action, stays a
    function call: the harness runs its own tool, not a command on the local machine."""
    inbound = parse(input="x", tools=[SHELL, {"type": "local_shell"}])
    out = PROVIDER.render(result(calls=[("shell", '{"command": "ls"}'), ("local_shell", '{"command": "ls"}')],
                                 finish="tool_calls"), inbound, CTX)
    Response.model_validate(out)
    assert [(i["type"], i["call_id"]) for i in out["output"]] == [("function_call", "call_0"),
                                                                  ("local_shell_call", "call_1")]


def test_hosted_tools_are_left_out_with_notes():
    inbound = parse(input="x", tools=[SHELL, {"type": "web_search"}, {"type": "file_search", "vector_store_ids": []}])
    assert [t.name for t in inbound.chat.tools or []] == ["shell"]
    assert inbound.normalizations == [
        "tools.1: built-in tool 'web_search' left out (no hosted tools behind this proxy)",
        "tools.2: built-in tool 'file_search' left out (no hosted tools behind this proxy)"]


def test_additional_tools_item_adds_tools():
    inbound = parse(input=[{"type": "additional_tools", "role": "developer", "tools": [SHELL, PATCH]},
                           {"role": "user", "content": "x"}])
    assert [t.name for t in inbound.chat.tools or []] == ["shell", "apply_patch"]
    assert [m.role for m in inbound.chat.messages] == ["user"]


@pytest.mark.parametrize(("choice", "expected"), [
    ("auto", "auto"), ("required", "required"), ("none", "none"),
    ({"type": "function", "name": "shell"}, {"type": "function", "function": {"name": "shell"}}),
    ({"type": "custom", "name": "apply_patch"}, {"type": "function", "function": {"name": "apply_patch"}}),
    ({"type": "allowed_tools", "mode": "required", "tools": []}, "required"),
    ({"type": "web_search_preview"}, "auto"),
])
def test_tool_choice(choice, expected):
    assert parse(input="x", tools=[SHELL, PATCH], tool_choice=choice).chat.tool_choice == expected


@pytest.mark.parametrize(("fmt", "expected"), [
    ({"type": "text"}, None),
    ({"type": "json_object"}, {"type": "json_object"}),
    ({"type": "json_schema", "name": "out", "schema": {"type": "object"}, "strict": True},
     {"type": "json_schema", "json_schema": {"name": "out", "schema": {"type": "object"}, "strict": True}}),
    ({"type": "json_schema", "schema": {}, "description": "d"},
     {"type": "json_schema", "json_schema": {"name": "response", "schema": {}, "description": "d"}}),
])
def test_text_format_becomes_response_format(fmt, expected):
    assert parse(input="x", text={"format": fmt, "verbosity": "low"}).chat.response_format == expected


def test_options_echo_and_ignored_fields():
    inbound = parse(input="x", store=False, metadata={"a": "b"}, prompt_cache_key="k", service_tier="auto",
                    truncation="auto", user="u", client_metadata={}, brand_new_field=1,
                    chat_template_kwargs={"enable_thinking": False},
                    reasoning={"effort": "high", "summary": "auto"}, include=["reasoning.encrypted_content"])
    assert inbound.ignored_fields == ["brand_new_field"]
    assert {"store", "metadata", "prompt_cache_key", "service_tier", "truncation", "user"} <= KNOWN_IGNORED
    assert inbound.chat.extra == {"chat_template_kwargs": {"enable_thinking": False}}
    assert inbound.render_state.summary is True and inbound.render_state.encrypted is True
    assert inbound.render_state.echo["reasoning"] == {"effort": "high", "summary": "auto"}
    assert inbound.normalizations == ["reasoning.effort 'high' echoed, not applied (the engine's template decides)"]


# ---------------------------------------------------------------- parse: errors


@pytest.mark.parametrize(("body", "match"), [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id: this proxy is stateless"),
    ({"input": "x", "conversation": "conv_1"}, "conversation: this proxy is stateless"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt: stored prompt templates"),
    ({"input": "x", "background": True}, "background"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, r"input\.0: item_reference needs stored responses"),
    ({"input": [{"type": "teleport"}]}, r"input\.0\.type: unsupported input item type 'teleport'"),
    ({"input": [{"type": "function_call", "name": "x"}]}, r"input\.0\.call_id: Field required"),
    ({"input": ["hi"]}, r"input\.0: an input item must be an object"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     r"input\.0\.content\.0\.type: unsupported content part type 'input_file'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
     r"input\.0\.content\.0\.image_url: required"),
    ({"input": [{"role": "tool", "content": "x"}]}, r"input\.0\.role"),
    ({"input": []}, "input: at least one item"),
    ({"input": "x", "tools": [{"type": "function"}]}, r"tools\.0\.name: required"),
    ({"input": "x", "tools": [{"type": "hologram"}]}, r"tools\.0\.type: unsupported tool type 'hologram'"),
    ({"input": "x", "tools": [SHELL, SHELL]}, "tool names must be unique"),
    ({"input": "x", "tool_choice": "sometimes"}, "tool_choice: unsupported value"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, r"text\.format\.schema: required"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "tools": [{"type": "namespace", "tools": []}]}, r"tools\.0\.name: required"),
    ({"input": "x", "tools": [{"type": "namespace", "name": "n", "tools": [{"type": "web_search"}]}]},
     r"tools\.0\.tools\.0\.type: a namespace holds function or custom tools"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, r"text\.format\.type: unsupported 'yaml'"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
     r"input\.0\.content\.0\.text: required for a input_text part"),
    ({"input": 5}, "input"),
])
def test_bad_requests_name_the_field(body, match):
    bad(match, **body)


def test_missing_model_is_a_400():
    with pytest.raises(RequestError, match="model: Field required"):
        PROVIDER.parse({"input": "x"}, ROUTE)


def test_skipped_history_items_are_noted():
    inbound = parse(input=[{"role": "user", "content": "x"},
                           {"type": "web_search_call", "id": "ws_1", "status": "completed", "action": {}}])
    assert len(inbound.chat.messages) == 1
    assert inbound.normalizations == ["input.1: web_search_call item left out (hosted-tool history this proxy "
                                      "cannot replay)"]


# ---------------------------------------------------------------- render


def test_render_completed_response():
    out = rendered(result("All done.", "thought"), instructions="sys", tools=[SHELL], temperature=0.5,
                   reasoning={"summary": "auto"}, include=["reasoning.encrypted_content"])
    assert out["id"] == "resp_abc123" and out["object"] == "response" and out["created_at"] == CTX.created
    assert out["status"] == "completed" and out["incomplete_details"] is None and out["model"] == "policy"
    reasoning, message = out["output"]
    assert reasoning == {"id": "rs_abc123", "type": "reasoning",
                         "summary": [{"type": "summary_text", "text": "thought"}],
                         "encrypted_content": encode_reasoning("thought")}
    assert message == {"id": "msg_abc123", "type": "message", "status": "completed", "role": "assistant",
                       "content": [{"type": "output_text", "text": "All done.", "annotations": [], "logprobs": []}]}
    assert out["usage"] == {"input_tokens": 11, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                            "output_tokens": 7, "output_tokens_details": {"reasoning_tokens": 0},
                            "total_tokens": 18}
    assert (out["instructions"], out["tools"], out["temperature"], out["tool_choice"]) == ("sys", [SHELL], 0.5,
                                                                                           "auto")
    assert Response.model_validate(out).output_text == "All done."


def test_render_without_include_carries_raw_reasoning_content():
    reasoning = rendered(result("a", "why"))["output"][0]
    assert reasoning == {"id": "rs_abc123", "type": "reasoning", "summary": [],
                         "content": [{"type": "reasoning_text", "text": "why"}]}


@pytest.mark.parametrize(("finish", "reason"), [("length", "max_output_tokens"), ("content_filter",
                                                                                   "content_filter")])
def test_render_incomplete(finish, reason):
    out = rendered(result("partial", finish=finish))
    assert out["status"] == "incomplete" and out["incomplete_details"] == {"reason": reason}
    assert out["output"][0]["status"] == "incomplete"


def test_render_tool_calls_only_has_no_message_item():
    out = rendered(result("", calls=[("shell", '{"command": "ls"}'), ("shell", '{"command": "pwd"}')],
                          finish="tool_calls"), tools=[SHELL])
    assert [(i["type"], i["id"], i["call_id"]) for i in out["output"]] == [
        ("function_call", "fc_abc123_0", "call_0"), ("function_call", "fc_abc123_1", "call_1")]
    assert out["output"][0]["arguments"] == '{"command": "ls"}' and out["output"][0]["status"] == "completed"


def test_render_empty_answer_still_has_a_message():
    assert [i["type"] for i in rendered(result(None))["output"]] == ["message"]


# ---------------------------------------------------------------- stream grammar


def _check_stream(events: list, final_status: str) -> dict[str, Any]:
    """The grammar's invariants; returns the final response."""
    data = [e.data for e in events]
    for event in events:
        assert event.event == event.data["type"]
        EVENTS.validate_python(event.data)
    assert [d["sequence_number"] for d in data] == list(range(len(data)))
    assert [d["type"] for d in data[:2]] == ["response.created", "response.in_progress"]
    assert data[0]["response"]["output"] == [] and data[0]["response"]["status"] == "in_progress"
    final = data[-1]["response"]
    assert data[-1]["type"] == ("response.completed" if final_status == "completed" else "response.incomplete")
    assert final["status"] == final_status
    done: list[dict[str, Any]] = []
    open_index: int | None = None
    texts: dict[tuple[str, int], str] = {}
    for d in data[2:-1]:
        kind = d["type"]
        if kind == "response.output_item.added":
            assert open_index is None and d["output_index"] == len(done)
            open_index = d["output_index"]
            continue
        assert open_index is not None and d["output_index"] == open_index
        if kind == "response.output_item.done":
            done.append(d["item"])
            open_index = None
        elif kind.endswith(".delta"):
            key = (kind, d.get("content_index", d.get("summary_index", 0)))
            texts[key] = texts.get(key, "") + d["delta"]
        elif kind.endswith("_text.done") or kind.endswith("arguments.done") or kind.endswith("input.done"):
            field = {"response.function_call_arguments.done": "arguments",
                     "response.custom_tool_call_input.done": "input"}.get(kind, "text")
            key = (kind.replace(".done", ".delta"), d.get("content_index", d.get("summary_index", 0)))
            assert texts.pop(key, "") == d[field]
    assert open_index is None and done == final["output"]
    return final


def test_stream_carries_exactly_the_rendered_response():
    inbound = parse(input="x", tools=[SHELL, PATCH], reasoning={"summary": "auto"},
                    include=["reasoning.encrypted_content"])
    res = result("Let me look.", "plan", calls=[("shell", '{"command": "ls"}'), ("apply_patch", '{"input": "P"}')],
                 finish="tool_calls")
    events = list(PROVIDER.stream(res, inbound, CTX))
    final = _check_stream(events, "completed")
    assert final == PROVIDER.render(res, inbound, CTX)
    assert [e.event for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_summary_part.added",
        "response.reasoning_summary_text.delta", "response.reasoning_summary_text.done",
        "response.reasoning_summary_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done", "response.output_item.done",
        "response.completed"]


def test_stream_of_a_truncated_answer_ends_incomplete():
    events = list(PROVIDER.stream(result("par", finish="length"), parse(input="x"), CTX))
    final = _check_stream(events, "incomplete")
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}


_names = st.sampled_from(["shell", "apply_patch", "local_shell"])
_calls = st.lists(st.tuples(_names, st.sampled_from(['{"command": "ls"}', '{"input": "P"}', "{}", ""])),
                  max_size=3)


@settings(max_examples=60, deadline=None)
@given(text=st.one_of(st.none(), st.text(max_size=20)), reasoning=st.one_of(st.none(), st.text(max_size=20)),
       calls=_calls, finish=st.sampled_from(["stop", "length", "tool_calls", "content_filter"]),
       summary=st.booleans(), encrypted=st.booleans())
def test_stream_grammar_holds_for_any_result(text, reasoning, calls, finish, summary, encrypted):
    body: dict[str, Any] = {"input": "x", "tools": [SHELL, PATCH, {"type": "local_shell"}]}
    if summary:
        body["reasoning"] = {"summary": "detailed"}
    if encrypted:
        body["include"] = ["reasoning.encrypted_content"]
    inbound = parse(**body)
    res = result(text, reasoning, calls, finish)
    final = _check_stream(list(PROVIDER.stream(res, inbound, CTX)),
                          "incomplete" if finish in ("length", "content_filter") else "completed")
    assert final == PROVIDER.render(res, inbound, CTX)
    Response.model_validate(final)


# ---------------------------------------------------------------- recorded harness requests

HARNESS_DATA = Path(__file__).parents[1] / "data" / "harness"


@pytest.mark.skipif(not (HARNESS_DATA / "codex" / "01.json").exists(), reason="no recorded codex traffic")
def test_recorded_codex_second_request_parses_to_the_expected_chat():
    """codex 0.169's second call: developer and user messages, our reasoning item, the call and its output."""
    body = json.loads((HARNESS_DATA / "codex" / "01.json").read_text())["body"]
    inbound = PROVIDER.parse(body, ROUTE)
    assert inbound.ignored_fields == [] and inbound.stream is True
    assert [m.role for m in inbound.chat.messages] == ["developer", "developer", "user", "user", "assistant", "tool"]
    reasoning = next(item for item in body["input"] if item["type"] == "reasoning")
    assistant = inbound.chat.messages[4]
    assert assistant.reasoning_content == decode_reasoning(reasoning["encrypted_content"])
    assert assistant.tool_calls is not None and assistant.tool_calls[0].function.name == "exec_command"
    names = [t.name for t in inbound.chat.tools or []]
    assert "multi_agent_v1__spawn_agent" in names and "web_search" not in names
    assert inbound.render_state.encrypted is True and inbound.render_state.summary is True
    assert inbound.render_state.tool_kinds.namespaced["multi_agent_v1__spawn_agent"] == ("multi_agent_v1",
                                                                                          "spawn_agent")


def test_tool_names_are_checked_on_every_call_of_a_session_that_repeats_its_tools():
    """A harness's repeated tools are translated (and their names checked) once; a repeated list with a duplicate
    is refused on every call, and a unique one that an item adds a clashing tool to is refused too."""
    import orjson

    from polar_gym.known_json import KNOWN

    long_shell = {**SHELL, "description": "Run a command. " * 400}  # large enough to be kept as a known value
    twice = orjson.dumps({"model": "policy", "input": "x", "tools": [long_shell, long_shell]})
    once = orjson.dumps({"model": "policy", "input": [{"role": "user", "content": "x"},
                                                      {"type": "additional_tools", "role": "developer",
                                                       "tools": [SHELL]}], "tools": [long_shell, PATCH]})
    unique = orjson.dumps({"model": "policy", "input": "x", "tools": [long_shell, PATCH]})
    hits = KNOWN.hits
    for _ in range(3):
        with pytest.raises(RequestError, match="tool names must be unique"):
            PROVIDER.parse(KNOWN.loads(twice, "names"), ROUTE)
        with pytest.raises(RequestError, match="tool names must be unique"):
            PROVIDER.parse(KNOWN.loads(once, "names"), ROUTE)
        tools = PROVIDER.parse(KNOWN.loads(unique, "names"), ROUTE).chat.tools or []
        assert [t.name for t in tools] == ["shell", "apply_patch"]
    assert KNOWN.hits - hits >= 6  # the tools were known: the kept answer refused them
    KNOWN.forget("names")
