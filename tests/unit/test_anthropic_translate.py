"""The Anthropic front end as pure functions: request blocks to the chat form, results to Messages and to the exact
stream grammar, Claude Code's billing line, and the 400s a harness gets for what cannot be translated."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import polar_gym.proxy.providers.anthropic as anthropic_pkg
from polar_gym.proxy.chat import ChatMessage, ChatResult, ContentPart, FunctionCall, ToolCall, Usage
from polar_gym.proxy.errors import RequestError, UpstreamError
from polar_gym.proxy.providers.anthropic import AnthropicProvider, protocol, translate
from polar_gym.proxy.providers.anthropic.translate import (
    BILLING_NOTE,
    content_blocks,
    strip_billing_lines,
    thinking_signature,
    tool_input,
    tool_use_id,
)
from polar_gym.proxy.providers.base import RenderContext, Route
from polar_gym.registry import PROVIDERS

ROUTE = Route("/v1/messages")
CTX = RenderContext(response_id="msg_test", created=0)
PROVIDER = AnthropicProvider()
BASH = {"name": "Bash", "description": "Run a command",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}


def body(messages: list[dict[str, Any]] | None = None, **fields: Any) -> dict[str, Any]:
    return {"model": "policy", "max_tokens": 256, "messages": messages or [{"role": "user", "content": "hi"}],
            **fields}


def parse(messages: list[dict[str, Any]] | None = None, **fields: Any):
    return PROVIDER.parse(body(messages, **fields), ROUTE)


def dumped(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    return [m.model_dump(exclude_none=True) for m in messages]


def result(content: str | None = "", reasoning: str | None = None, calls: list[tuple[str, str, str]] | None = None,
           finish: str = "stop", raw: dict[str, Any] | None = None) -> ChatResult:
    tool_calls = [ToolCall(id=i, function=FunctionCall(name=n, arguments=a)) for i, n, a in calls or []] or None
    return ChatResult(message=ChatMessage(role="assistant", content=content, reasoning_content=reasoning,
                                          tool_calls=tool_calls),
                      finish_reason=finish, usage=Usage(prompt_tokens=11, completion_tokens=7), raw=raw or {})


# ----------------------------------------------------------------------------------------------------- exports


def test_exports_and_registry():
    assert anthropic_pkg.__all__ == ["AnthropicProvider"]
    for module in (protocol, translate):
        assert all(hasattr(module, name) for name in module.__all__)
    assert PROVIDERS.get("anthropic") is AnthropicProvider
    assert (AnthropicProvider.name, AnthropicProvider.conversation_field) == ("anthropic", "messages")


# ------------------------------------------------------------------------------------------------------ request


def test_system_blocks_and_sampling_fields():
    inbound = parse(system=[{"type": "text", "text": "You are a coder.", "cache_control": {"type": "ephemeral"}},
                            {"type": "text", "text": "\nBe brief."}],
                    temperature=0.5, top_p=0.9, top_k=20, stop_sequences=["</done>"], stream=True)
    chat = inbound.chat
    assert dumped(chat.messages) == [{"role": "system", "content": "You are a coder.\nBe brief."},
                                     {"role": "user", "content": "hi"}]
    assert (chat.max_tokens, chat.temperature, chat.top_p, chat.top_k, chat.stop) == (256, 0.5, 0.9, 20, ["</done>"])
    assert inbound.stream is True and inbound.model == "policy" and inbound.normalizations == []
    assert parse(top_k=0).chat.top_k is None  # 0 is Anthropic's "unset"


def test_user_blocks_images_documents_and_search_results():
    blocks = [
        {"type": "text", "text": "Look:", "cache_control": {"type": "ephemeral"}},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBOR"}},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
        {"type": "document", "title": "Notes", "source": {"type": "text", "media_type": "text/plain", "data": "n1"}},
        {"type": "document", "source": {"type": "content", "content": [{"type": "text", "text": "c1"}]}},
        {"type": "search_result", "title": "T", "source": "https://s", "content": [{"type": "text", "text": "r"}]},
    ]
    (msg,) = parse([{"role": "user", "content": blocks}]).chat.messages
    assert msg.content == [
        ContentPart(type="text", text="Look:"),
        ContentPart(type="image_url", image_url={"url": "data:image/png;base64,iVBOR"}),
        ContentPart(type="image_url", image_url={"url": "https://example.com/a.png"}),
        ContentPart(type="text", text="Notes\n\nn1\n\nc1\n\nT\nhttps://s\n\nr\n\n"),
    ]


def test_text_blocks_concatenate_into_one_string():
    # Claude Code ends its reminder block with its own separator, so blocks are joined as they are
    reminder = "<system-reminder>x</system-reminder>\n\n"
    (msg,) = parse([{"role": "user", "content": [{"type": "text", "text": reminder},
                                                  {"type": "text", "text": "Fix the bug"}]}]).chat.messages
    assert msg.content == reminder + "Fix the bug"


def test_tool_results_come_first_in_block_order():
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_a", "name": "Bash", "input": {"command": "ls"}},
            {"type": "tool_use", "id": "toolu_b", "name": "Bash", "input": {"command": "pwd"}}]},
        {"role": "user", "content": [
            {"type": "text", "text": "before "},
            {"type": "tool_result", "tool_use_id": "toolu_a", "content": "a.txt", "cache_control": {"type": "x"}},
            {"type": "tool_result", "tool_use_id": "toolu_b", "is_error": True,
             "content": [{"type": "text", "text": "no "}, {"type": "text", "text": "such dir"}]},
            {"type": "text", "text": "after"}]},
    ]
    out = dumped(parse(messages, tools=[BASH]).chat.messages)
    assert out[1]["tool_calls"] == [
        {"id": "toolu_a", "type": "function", "function": {"name": "Bash", "arguments": '{"command": "ls"}'}},
        {"id": "toolu_b", "type": "function", "function": {"name": "Bash", "arguments": '{"command": "pwd"}'}}]
    assert "content" not in out[1]  # a tool-only turn has no text
    assert out[2:] == [{"role": "tool", "content": "a.txt", "tool_call_id": "toolu_a"},
                       {"role": "tool", "content": "no such dir", "tool_call_id": "toolu_b"},
                       {"role": "user", "content": "before after"}]


def test_tool_result_edge_cases():
    blocks = [{"type": "tool_result", "tool_use_id": "t1", "is_error": True},
              {"type": "tool_result", "tool_use_id": "t2",
               "content": [{"type": "text", "text": "shot:"},
                           {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}]}]
    first, second = parse([{"role": "user", "content": blocks}]).chat.messages
    assert (first.role, first.content) == ("tool", "Error")  # an empty failure must not read as success
    assert second.content == [ContentPart(type="text", text="shot:"),
                              ContentPart(type="image_url", image_url={"url": "https://x/y.png"})]


def test_assistant_thinking_text_and_tool_use():
    messages = [{"role": "user", "content": "go"}, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Plan.", "signature": "anything-at-all"},
        {"type": "redacted_thinking", "data": "EmwKAhgB"},
        {"type": "text", "text": "Running it."},
        {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "echo é"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "é"}]}]
    inbound = parse(messages)
    msg = inbound.chat.messages[1]
    assert (msg.content, msg.reasoning_content) == ("Running it.", "Plan.")
    assert msg.tool_calls is not None and json.loads(msg.tool_calls[0].function.arguments) == {"command": "echo é"}
    assert "é" in msg.tool_calls[0].function.arguments
    assert any("redacted_thinking" in n for n in inbound.normalizations)


def test_mid_conversation_system_turns_stay_in_place():
    reminder = "<total_tokens>99 tokens left</total_tokens>"
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "system", "content": [{"type": "text", "text": reminder}]},
                {"role": "user", "content": "go on"}]
    out = parse(messages, system="top").chat.messages
    assert [m.role for m in out] == ["system", "user", "assistant", "system", "user"]
    assert out[3].content == reminder


def test_prefill_is_noted():
    inbound = parse([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}])
    assert inbound.chat.messages[-1].content == "The answer is"
    assert any("prefill" in n for n in inbound.normalizations)


@pytest.mark.parametrize(("messages", "fragment"), [
    ([{"role": "user", "content": [{"type": "container_upload", "file_id": "f"}]}],
     "messages.0.content.0.type: unsupported content block type 'container_upload'"),
    ([{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}],
     "messages.0.content.0.source.type: unsupported image source 'file'"),
    ([{"role": "user", "content": [{"type": "document", "source": {"type": "url", "url": "https://x.pdf"}}]}],
     "'url' documents are not supported"),
    ([{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "n", "input": {}}]}],
     "'tool_use' blocks belong in assistant messages"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": [
        {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {}}]}],
     "messages.1.content.0.type: 'server_tool_use': server tools are not supported"),
    ([{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}],
     "messages.0.content.0.tool_use_id: required"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "messages.0.content.0.text: must be a string"),
    ([{"role": "tool", "content": "x"}], "messages.0.role"),
    ([], "messages"),
])
def test_untranslatable_requests_are_400s(messages, fragment):
    with pytest.raises(RequestError) as info:
        PROVIDER.parse({"model": "policy", "max_tokens": 8, "messages": messages}, ROUTE)
    assert fragment in info.value.message and info.value.status == 400


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=6),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                               st.sampled_from(["type", "text", "source", "content", "id", "name", "input",
                                                "tool_use_id", "data", "thinking", "url"]), inner, max_size=4),
                           max_leaves=12)
block_types = st.sampled_from(["text", "image", "document", "search_result", "tool_result", "tool_use", "thinking",
                               "redacted_thinking", "server_tool_use", "web_search_tool_result", "nope"])


@settings(max_examples=150, deadline=None)
@given(role=st.sampled_from(["user", "assistant", "system"]),
       blocks=st.lists(st.tuples(block_types, st.dictionaries(st.sampled_from(
           ["text", "source", "content", "id", "name", "input", "tool_use_id", "thinking", "title"]), json_values,
           max_size=4)), max_size=3))
def test_arbitrary_blocks_translate_or_fail_with_a_400(role, blocks):
    content = [{**fields, "type": kind} for kind, fields in blocks]
    try:
        parse([{"role": "user", "content": "q"}, {"role": role, "content": content}])
    except RequestError as exc:
        assert exc.status == 400 and exc.message


def test_max_tokens_is_required_but_not_for_count_tokens():
    payload = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "system": "s"}
    with pytest.raises(RequestError, match="max_tokens: Field required"):
        PROVIDER.parse(payload, ROUTE)
    with pytest.raises(RequestError, match="max_tokens"):
        PROVIDER.parse({**payload, "max_tokens": 0}, ROUTE)
    inbound = PROVIDER.parse_count({**payload, "stream": True}, Route("/v1/messages/count_tokens"))
    assert inbound.stream is False and [m.role for m in inbound.chat.messages] == ["system", "user"]
    assert PROVIDER.render_count(42) == {"input_tokens": 42}


def test_unknown_fields_are_reported_and_known_ones_are_not():
    inbound = parse(metadata={"user_id": "u"}, service_tier="auto", context_management={}, frobnicate=1)
    assert inbound.ignored_fields == ["frobnicate"]


@pytest.mark.parametrize(("thinking", "shown"), [
    ({"type": "enabled", "budget_tokens": 2048}, True), ({"type": "adaptive"}, True), ({"type": "disabled"}, False),
    (None, False)])
def test_thinking_option(thinking, shown):
    inbound = parse(**({"thinking": thinking} if thinking else {}))
    assert inbound.render_state.thinking is shown


def test_structured_output_becomes_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    inbound = parse(output_config={"effort": "high", "format": {"type": "json_schema", "schema": schema}})
    assert inbound.chat.response_format == {"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}
    assert parse().chat.response_format is None


# -------------------------------------------------------------------------------------------------------- tools


def test_tools_custom_client_and_server():
    tools = [BASH, {"type": "custom", "name": "Read", "input_schema": {"type": "object"}},
             {"type": "bash_20250124", "name": "bash"},
             {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"},
             {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}]
    inbound = parse(tools=tools)
    chat_tools = inbound.chat.tools or []
    assert [t.name for t in chat_tools] == ["Bash", "Read", "bash", "str_replace_based_edit_tool"]
    assert chat_tools[0].function == {"name": "Bash", "description": "Run a command",
                                      "parameters": BASH["input_schema"]}
    assert "command" in chat_tools[2].parameters["properties"]
    assert chat_tools[3].parameters["required"] == ["command", "path"]
    assert any("web_search" in n and "skipped" in n for n in inbound.normalizations)


def test_tool_without_schema_is_a_400():
    with pytest.raises(RequestError, match=r"tools\.0\.input_schema"):
        parse(tools=[{"name": "Bash"}])


@pytest.mark.parametrize(("choice", "expected", "parallel"), [
    ({"type": "auto"}, "auto", None),
    ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
    ({"type": "tool", "name": "Bash"}, {"type": "function", "function": {"name": "Bash"}}, None),
    ({"type": "none"}, "none", None),
])
def test_tool_choice(choice, expected, parallel):
    chat = parse(tools=[BASH], tool_choice=choice).chat
    assert (chat.tool_choice, chat.parallel_tool_calls) == (expected, parallel)


def test_tool_choice_errors_and_skipped_tools():
    with pytest.raises(RequestError, match="not one of the request's tools"):
        parse(tools=[BASH], tool_choice={"type": "tool", "name": "Write"})
    only_server = parse(tools=[{"type": "web_search_20250305", "name": "web_search"}], tool_choice={"type": "auto"})
    assert only_server.chat.tools is None and only_server.chat.tool_choice is None


# ------------------------------------------------------------------------------------------------ billing line

BILLING = "x-anthropic-billing-header: cc_version=2.1.197.{v}; cc_entrypoint=cli; cch={c};"


def test_billing_block_is_removed_and_noted():
    system = [{"type": "text", "text": BILLING.format(v="c8e", c="36ee5")},
              {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}]
    inbound = parse(system=system)
    assert inbound.chat.messages[0].content == "You are Claude Code."
    assert inbound.normalizations == [BILLING_NOTE]


def test_billing_line_inside_a_string_system_prompt():
    inbound = parse(system=BILLING.format(v="76b", c="0aaa9") + "\nYou are Claude Code.\nBe careful.")
    assert inbound.chat.messages[0].content == "You are Claude Code.\nBe careful."
    alone = parse(system=BILLING.format(v="76b", c="0aaa9"))
    assert [m.role for m in alone.chat.messages] == ["user"] and alone.normalizations == [BILLING_NOTE]


def test_text_that_merely_mentions_the_header_is_kept():
    text = "Never print x-anthropic-billing-header: values."
    assert strip_billing_lines(text) == (text, 0)
    assert parse(system=text).normalizations == []


hexes = st.text(alphabet="0123456789abcdef", min_size=3, max_size=5)

#: the header's own characters in both cases, the non-ASCII letters a case-blind match equates with ASCII ones
#: (dotless and dotted i, long s, the Kelvin sign), and line breaks
_HEADERISH = st.text(alphabet=sorted(set("x-anthropic-billing-header:" + "X-ANTHROPIC-BILLING-HEADER")
                                     | set("\u0131\u0130\u017f\u212a \t\n;=")), max_size=80)


@given(_HEADERISH, _HEADERISH)
@settings(max_examples=400, deadline=None)
def test_the_cheap_precheck_strips_exactly_what_the_case_blind_pattern_strips(before: str, after: str):
    from polar_gym.proxy.providers.anthropic.translate import _BILLING_LINE

    for text in (before + after, before + "\nX-Anthropic-Billing-Header: v=1\n" + after,
                 before + "x-anthrop\u0131c-b\u0130ll\u0130ng-header:" + after):
        assert strip_billing_lines(text) == _BILLING_LINE.subn("", text)


@given(st.text(alphabet=sorted(set("-hHeEaAdDrR: x\u0130\u0131\u017f\u212a\u0307")), max_size=60), st.text(max_size=20))
@settings(max_examples=400, deadline=None)
def test_the_header_marker_is_found_exactly_where_lower_casing_finds_it(text: str, noise: str):
    from polar_gym.proxy.providers.anthropic.translate import _has_header_marker

    for candidate in (text, noise + text + noise, text + "-HeAdEr:", "keybindings-help " + text):
        assert _has_header_marker(candidate) == ("-header:" in candidate.lower())


@settings(max_examples=50, deadline=None)
@given(v1=hexes, c1=hexes, v2=hexes, c2=hexes, rest=st.text(min_size=1).filter(lambda s: s.strip()))
def test_billing_values_never_change_the_normalized_request(v1, c1, v2, c2, rest):
    def chat_for(v: str, c: str):
        system = [{"type": "text", "text": BILLING.format(v=v, c=c)}, {"type": "text", "text": rest}]
        return parse(system=system, tools=[BASH]).chat

    assert chat_for(v1, c1) == chat_for(v2, c2)


# ------------------------------------------------------------------------------------------------------ render


def test_render_tool_use_message():
    res = result(content="", reasoning="Step 1.", calls=[("call_oracle_1_ab", "Bash", '{"command": "ls"}')],
                 finish="tool_calls")
    inbound = parse(thinking={"type": "enabled", "budget_tokens": 1024})
    msg = PROVIDER.render(res, inbound, CTX)
    assert msg == {
        "id": "msg_test", "type": "message", "role": "assistant", "model": "policy",
        "content": [{"type": "thinking", "thinking": "Step 1.", "signature": thinking_signature("Step 1.")},
                    {"type": "tool_use", "id": tool_use_id("call_oracle_1_ab"), "name": "Bash",
                     "input": {"command": "ls"}}],
        "stop_reason": "tool_use", "stop_sequence": None,
        "usage": {"input_tokens": 11, "output_tokens": 7, "cache_creation_input_tokens": 0,
                  "cache_read_input_tokens": 0},
    }


def test_thinking_hidden_unless_enabled_and_text_always_present():
    assert content_blocks(result(content="hi", reasoning="r"), thinking=False) == [{"type": "text", "text": "hi"}]
    assert content_blocks(result(content=None), thinking=True) == [{"type": "text", "text": ""}]


@pytest.mark.parametrize(("finish", "calls", "raw", "expected"), [
    ("stop", None, {}, ("end_turn", None)),
    ("length", None, {}, ("max_tokens", None)),
    ("length", [("c", "Bash", "{")], {}, ("max_tokens", None)),
    ("tool_calls", [("c", "Bash", "{}")], {}, ("tool_use", None)),
    ("stop", [("c", "Bash", "{}")], {}, ("tool_use", None)),
    ("content_filter", None, {}, ("refusal", None)),
    ("stop", None, {"stop_reason": "</done>"}, ("stop_sequence", "</done>")),
    ("stop", None, {"matched_stop": "</done>"}, ("stop_sequence", "</done>")),
    ("stop", None, {"stop_reason": "other"}, ("end_turn", None)),
])
def test_stop_reasons(finish, calls, raw, expected):
    inbound = parse(stop_sequences=["</done>"])
    msg = PROVIDER.render(result(content="x", calls=calls, finish=finish, raw=raw), inbound, CTX)
    assert (msg["stop_reason"], msg["stop_sequence"]) == expected


def test_tool_ids_are_anthropic_shaped_deterministic_and_unique():
    ident = tool_use_id("call_0")
    assert ident.startswith("toolu_01") and len(ident) == 30 and ident.isascii() and ident.replace("_", "").isalnum()
    assert tool_use_id("call_0") == ident != tool_use_id("call_1")
    assert tool_use_id(ident) == ident  # already Anthropic's: kept, so a round trip is stable
    blocks = content_blocks(result(calls=[("dup", "Bash", "{}"), ("dup", "Bash", "{}")]), thinking=False)
    assert len({b["id"] for b in blocks}) == 2


def test_unparseable_arguments_are_kept():
    assert tool_input('{"a": 1}') == {"a": 1}
    assert tool_input("") == {}
    assert tool_input("[1]") == {"_raw": "[1]"}
    assert tool_input('{"a": ') == {"_raw": '{"a": '}
    assert tool_input('{"a": NaN}') == {"_raw": '{"a": NaN}'}
    assert tool_input('{"a": 99999999999999999999999}') == {"_raw": '{"a": 99999999999999999999999}'}


# ------------------------------------------------------------------------------------------------------ stream


def check_grammar(events) -> list[str]:
    """Assert the Messages stream grammar; return the event types."""
    kinds = [e.event for e in events]
    assert all(e.data["type"] == e.event for e in events)
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    start = events[0].data["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    open_index, next_index = None, 0
    for e in events[1:-2]:
        if e.event == "ping":
            assert open_index is None
        elif e.event == "content_block_start":
            assert open_index is None and e.data["index"] == next_index
            open_index = next_index
        elif e.event == "content_block_delta":
            assert e.data["index"] == open_index
        elif e.event == "content_block_stop":
            assert e.data["index"] == open_index
            open_index, next_index = None, next_index + 1
        else:
            pytest.fail(f"unexpected event {e.event}")
    assert open_index is None
    return kinds


def accumulate(events) -> dict[str, Any]:
    """Rebuild the Message the way a client does (the SDK's accumulate_event, in miniature)."""
    msg: dict[str, Any] = {}
    partial: dict[int, str] = {}
    for e in events:
        d = e.data
        if e.event == "message_start":
            msg = json.loads(json.dumps(d["message"]))
        elif e.event == "content_block_start":
            msg["content"].append(dict(d["content_block"]))
        elif e.event == "content_block_delta":
            block, delta = msg["content"][d["index"]], d["delta"]
            kind = delta["type"]
            if kind == "text_delta":
                block["text"] += delta["text"]
            elif kind == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif kind == "signature_delta":
                block["signature"] = delta["signature"]
            elif kind == "input_json_delta":
                partial[d["index"]] = partial.get(d["index"], "") + delta["partial_json"]
                block["input"] = json.loads(partial[d["index"]])
        elif e.event == "message_delta":
            msg.update(d["delta"])
            msg["usage"].update(d["usage"])
    return msg


def test_stream_event_order():
    res = result(content="Let me look.", reasoning="Think.", calls=[("c1", "Bash", '{"command": "ls"}')],
                 finish="tool_calls")
    events = list(PROVIDER.stream(res, parse(thinking={"type": "adaptive"}), CTX))
    assert check_grammar(events) == [
        "message_start", "ping",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    deltas = [e.data["delta"]["type"] for e in events if e.event == "content_block_delta"]
    assert deltas == ["thinking_delta", "signature_delta", "text_delta", "input_json_delta"]
    assert events[0].data["message"]["usage"]["input_tokens"] == 11
    assert events[-2].data == {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                               "usage": {"output_tokens": 7}}


finishes = st.sampled_from(["stop", "length", "tool_calls", "content_filter"])
scalars = st.one_of(st.integers(min_value=-(2**63), max_value=2**63 - 1), st.text(max_size=20), st.booleans(),
                    st.none(), st.floats(allow_nan=False, allow_infinity=False))
json_objects = st.dictionaries(st.text(max_size=8), st.one_of(scalars, st.lists(scalars, max_size=3)), max_size=4)
calls = st.lists(st.tuples(st.text(min_size=1, max_size=12), st.sampled_from(["Bash", "Read"]), json_objects),
                 max_size=3)


@settings(max_examples=80, deadline=None)
@given(text=st.text(max_size=40), reasoning=st.one_of(st.none(), st.text(max_size=40)), tool_calls=calls,
       finish=finishes, thinking=st.booleans())
def test_stream_accumulates_to_the_rendered_message(text, reasoning, tool_calls, finish, thinking):
    res = result(content=text, reasoning=reasoning, finish=finish,
                 calls=[(i, n, json.dumps(a)) for i, n, a in tool_calls])
    inbound = parse(thinking={"type": "enabled" if thinking else "disabled", "budget_tokens": 1024})
    events = list(PROVIDER.stream(res, inbound, CTX))
    check_grammar(events)
    assert accumulate(events) == PROVIDER.render(res, inbound, CTX)


@settings(max_examples=80, deadline=None)
@given(text=st.text(max_size=40), reasoning=st.one_of(st.none(), st.text(min_size=1, max_size=40)),
       tool_calls=calls)
def test_a_rendered_message_sent_back_parses_to_the_same_turn(text, reasoning, tool_calls):
    res = result(content=text, reasoning=reasoning, calls=[(i, n, json.dumps(a)) for i, n, a in tool_calls])
    rendered = PROVIDER.render(res, parse(thinking={"type": "adaptive"}), CTX)
    follow_up = [{"type": "tool_result", "tool_use_id": b["id"], "content": "ok"}
                 for b in rendered["content"] if b["type"] == "tool_use"] or [{"type": "text", "text": "next"}]
    chat = parse([{"role": "user", "content": "go"}, {"role": "assistant", "content": rendered["content"]},
                  {"role": "user", "content": follow_up}]).chat
    back = chat.messages[1]
    assert back.reasoning_content == reasoning
    assert (back.content or "") == text
    sent = [(c.function.name, json.loads(c.function.arguments)) for c in back.tool_calls or []]
    assert sent == [(n, a) for _, n, a in tool_calls]
    # ids survive the trip: rendering the same result again gives the ids the harness just sent back
    assert [c.id for c in back.tool_calls or []] == [b["id"] for b in content_blocks(res, True)
                                                      if b["type"] == "tool_use"]
    assert [m.tool_call_id for m in chat.messages[2:] if m.role == "tool"] == [c.id for c in back.tool_calls or []]


# ------------------------------------------------------------------------------------------ recorded Claude Code

RECORDED = Path(__file__).parent.parent / "data" / "harness" / "claude_code"


@pytest.mark.skipif(not (RECORDED / "01.json").exists(), reason="no recorded Claude Code traffic")
def test_recorded_claude_code_requests_translate_append_only():
    first, second = (json.loads((RECORDED / f"{n}.json").read_text())["body"] for n in ("00", "01"))
    a, b = PROVIDER.parse(first, ROUTE), PROVIDER.parse(second, ROUTE)
    assert a.ignored_fields == b.ignored_fields == []
    assert BILLING_NOTE in a.normalizations and BILLING_NOTE in b.normalizations
    assert "x-anthropic-billing-header" not in (a.chat.messages[0].content or "")
    assert b.chat.messages[: len(a.chat.messages)] == a.chat.messages  # the conversation only grows
    assert a.chat.tools == b.chat.tools and a.render_state.thinking is True
    assert [m.role for m in b.chat.messages][-2:] == ["assistant", "tool"]


def test_the_stream_opens_with_no_output_tokens_and_ends_with_them():
    """message_start carries the prompt's size and zero output tokens; message_delta the sampled count (the SDKs
    add them up)."""
    events = list(PROVIDER.stream(result("Hi."), parse(), CTX))
    assert events[0].data["message"]["usage"]["input_tokens"] == 11
    assert events[0].data["message"]["usage"]["output_tokens"] == 0
    assert events[0].data["message"]["id"] == "msg_test"
    assert events[-2].data["usage"] == {"output_tokens": 7}


def test_an_error_mid_stream_is_an_anthropic_error_event():
    event = PROVIDER.stream_error(UpstreamError("engine went away"))
    assert event.event == "error"
    assert event.data == {"type": "error", "error": {"type": "api_error", "message": "engine went away"}}


def test_message_ids_look_like_anthropics():
    assert PROVIDER.id_prefix == "msg_"  # the Messages API's ids; clients and logs recognize them


def test_thinking_signatures_are_deterministic_and_opaque():
    """Our signature for thinking text we produced: "pg1" and a 48-byte keyed digest, base64; the same text always
    signs the same, different text differently; the rendered thinking block carries it."""
    signature = thinking_signature("Step 1.")
    raw = base64.b64decode(signature)
    assert raw[:3] == b"pg1" and len(raw) == 51
    assert thinking_signature("Step 1.") == signature != thinking_signature("Step 2.")
    blocks = content_blocks(result("Done.", reasoning="Step 1."), thinking=True)
    assert blocks[0] == {"type": "thinking", "thinking": "Step 1.", "signature": signature}
