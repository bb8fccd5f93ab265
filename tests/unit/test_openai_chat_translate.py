"""The Chat Completions front end as pure functions: a request -> the normalized chat request (every role, content
parts, tool calls and results, the legacy ``functions`` fields folded in), a result -> a chat.completion and the
synthesized chunk stream, and the 400s a harness can read.

Rendered bodies and chunks are validated with the official SDK's own models (tests may import SDKs; the package
may not)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from openai.types.chat import ChatCompletion, ChatCompletionChunk

import polar_gym.proxy.providers.openai_chat as package
from polar_gym.proxy.chat import ChatMessage, ChatResult
from polar_gym.proxy.errors import RequestError
from polar_gym.proxy.providers.base import RenderContext, Route
from polar_gym.proxy.providers.openai_chat import OpenAIChatProvider, protocol, translate
from polar_gym.proxy.providers.openai_chat.protocol import KNOWN_IGNORED
from polar_gym.proxy.providers.openai_chat.translate import OpenAIChatRenderState
from polar_gym.registry import PROVIDERS
from tests.unit.test_responses_translate import result

PROVIDER = OpenAIChatProvider()
ROUTE = Route("/v1/chat/completions")
CTX = RenderContext(response_id="chatcmpl-abc123", created=1_700_000_000)
SHELL = {"type": "function", "function": {"name": "shell", "description": "Run",
                                          "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}
HI = [{"role": "user", "content": "hi"}]


def parse(messages: list[dict[str, Any]] | None = None, **body: Any):
    return PROVIDER.parse({"model": "policy", "messages": HI if messages is None else messages, **body}, ROUTE)


def messages(*msgs: dict[str, Any], **body: Any) -> list[dict[str, Any]]:
    return [m.model_dump(exclude_none=True) for m in parse(list(msgs), **body).chat.messages]


def call(name: str = "shell", arguments: Any = '{"cmd": "ls"}', **fields: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}, **fields}


def assert_400(body: dict[str, Any], fragment: str) -> None:
    with pytest.raises(RequestError) as info:
        PROVIDER.parse({"model": "policy", **body}, ROUTE)
    assert fragment in info.value.message
    status, shown = PROVIDER.error_body(info.value)
    assert status == 400 and shown == {"error": {"message": info.value.message, "type": "invalid_request_error",
                                                 "param": None, "code": None}}


def rendered(res: ChatResult, **body: Any) -> dict[str, Any]:
    out = PROVIDER.render(res, parse(**body), CTX)
    ChatCompletion.model_validate(out)  # the SDK's own model accepts it
    return out


def streamed(res: ChatResult, **body: Any) -> list[dict[str, Any] | str]:
    events = list(PROVIDER.stream(res, parse(stream=True, **body), CTX))
    assert all(e.event is None for e in events)  # Chat streams are bare `data:` lines
    for e in events:
        if isinstance(e.data, dict):
            ChatCompletionChunk.model_validate(e.data)
    return [e.data for e in events]


def deltas(chunks: list[dict[str, Any] | str]) -> list[dict[str, Any]]:
    return [c["choices"][0]["delta"] for c in chunks if isinstance(c, dict) and c["choices"]]


# ---------------------------------------------------------------- exports


def test_exports_and_registry():
    assert package.__all__ == ["OpenAIChatProvider"]
    for module in (protocol, translate):
        assert all(hasattr(module, name) for name in module.__all__)
    assert PROVIDERS.get("openai_chat") is OpenAIChatProvider
    assert (OpenAIChatProvider.name, OpenAIChatProvider.conversation_field) == ("openai_chat", "messages")
    assert OpenAIChatProvider.id_prefix == "chatcmpl-" and OpenAIChatProvider.error_style == "openai"


# ---------------------------------------------------------------- parse: messages


def test_every_role_keeps_its_place_and_names_only_where_chat_templates_use_them():
    got = messages(
        {"role": "system", "content": "Be terse.", "name": "sys"},
        {"role": "developer", "content": "rules", "name": "dev"},
        {"role": "user", "content": "hi", "name": "alice"},
        {"role": "assistant", "content": "hello", "name": "bot"},
        {"role": "user", "content": None},
    )
    assert got == [{"role": "system", "content": "Be terse.", "name": "sys"},
                   {"role": "developer", "content": "rules", "name": "dev"},
                   {"role": "user", "content": "hi", "name": "alice"},
                   {"role": "assistant", "content": "hello"},
                   {"role": "user"}]


def test_text_parts_join_into_one_string_and_images_keep_the_parts():
    got = messages(
        {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "c"}, {"type": "text", "text": "d"}]},
        {"role": "user", "content": [{"type": "text", "text": "look"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA==",
                                                                         "detail": "low"}},
                                     {"type": "image_url", "image_url": "https://x/cat.png"}]},
        {"role": "user", "content": []},
    )
    assert got[0] == {"role": "system", "content": "ab"}
    assert got[1] == {"role": "assistant", "content": "cd"}
    assert got[2]["content"] == [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA==", "detail": "low"}},
        {"type": "image_url", "image_url": {"url": "https://x/cat.png"}},  # a bare string url is wrapped
    ]
    assert got[3] == {"role": "user", "content": ""}


def test_tool_calls_and_their_results():
    got = messages(
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "tool_calls": [
            call(id="call_a"),
            call(arguments={"cmd": "pwd"}, id="call_b"),  # an object is sent on as its JSON
            {"function": {"name": "noop"}},  # no id, no type, no arguments
            call(id="", arguments="{}"),
        ]},
        {"role": "tool", "tool_call_id": "call_a", "content": "a.txt"},
        {"role": "tool", "tool_call_id": "call_b", "content": [{"type": "text", "text": "/"},
                                                                {"type": "text", "text": "w"}]},
    )
    assert got[1] == {"role": "assistant", "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "shell", "arguments": '{"cmd": "ls"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "shell", "arguments": '{"cmd":"pwd"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "noop", "arguments": "{}"}},
        {"id": "call_3", "type": "function", "function": {"name": "shell", "arguments": "{}"}},
    ]}
    assert got[2:] == [{"role": "tool", "content": "a.txt", "tool_call_id": "call_a"},
                       {"role": "tool", "content": "/w", "tool_call_id": "call_b"}]


def test_an_empty_tool_calls_list_is_no_tool_calls():
    assert messages({"role": "assistant", "content": "x", "tool_calls": []}) == [{"role": "assistant", "content": "x"}]


def test_legacy_function_call_and_function_messages_fold_into_tool_calls():
    got = messages(
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": None, "function_call": {"name": "shell", "arguments": "{}"}},
        {"role": "function", "name": "shell", "content": "ok"},
    )
    assert got[1:] == [
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                              "function": {"name": "shell", "arguments": "{}"}}]},
        {"role": "tool", "content": "ok", "tool_call_id": "shell"},
    ]


def test_tool_calls_win_over_a_legacy_function_call_in_the_same_message():
    got = messages({"role": "assistant", "tool_calls": [call(id="c1")], "function_call": {"name": "old"}})
    assert [c["function"]["name"] for c in got[0]["tool_calls"]] == ["shell"]


@pytest.mark.parametrize(("fields", "expected"), [
    ({"reasoning_content": "think"}, "think"),
    ({"reasoning": "think"}, "think"),  # the name some harnesses send back
    ({"reasoning_content": "new", "reasoning": "old"}, "new"),
    ({"reasoning_content": "", "reasoning": "old"}, ""),  # an explicit empty reasoning_content is kept
    ({}, None),
])
def test_assistant_reasoning_fields(fields, expected):
    msg = parse([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", **fields}]).chat.messages[1]
    assert msg.reasoning_content == expected


def test_recorded_harness_bodies_parse_with_nothing_ignored():
    """Real opencode, pi and qwen-code bodies: every tool result answers a call, nothing is reported as ignored."""
    recorded = sorted(Path(__file__).parents[1].glob("data/harness/*/*.json"))
    cases = [c for c in (json.loads(p.read_text()) for p in recorded) if c.get("provider") == "openai_chat"]
    assert len(cases) >= 3
    for case in cases:
        inbound = PROVIDER.parse(case["body"], ROUTE)
        assert inbound.stream and not inbound.ignored_fields and inbound.chat.messages
        call_ids = {c.id for m in inbound.chat.messages for c in m.tool_calls or []}
        assert all(m.tool_call_id in call_ids for m in inbound.chat.messages if m.role == "tool")


# ---------------------------------------------------------------- parse: tools and options


def test_tools_and_legacy_functions_become_function_tools():
    chat = parse(tools=[SHELL, {"function": {"name": "untyped"}}],
                 functions=[{"name": "legacy", "parameters": {"type": "object"}}]).chat
    assert [t.name for t in chat.tools] == ["shell", "untyped", "legacy"]
    assert chat.tools[0].function == SHELL["function"] and chat.tools[2].parameters == {"type": "object"}
    assert [t.name for t in parse(functions=[{"name": "only"}]).chat.tools] == ["only"]
    assert parse().chat.tools is None and parse(tools=[]).chat.tools is None


def test_sampling_options_are_carried():
    chat = parse(temperature=0.2, top_p=0.9, top_k=20, seed=7, max_tokens=64, stop="</s>", tool_choice="auto",
                 parallel_tool_calls=False, response_format={"type": "json_object"},
                 chat_template_kwargs={"enable_thinking": False}).chat
    assert (chat.temperature, chat.top_p, chat.top_k, chat.seed, chat.max_tokens) == (0.2, 0.9, 20, 7, 64)
    assert chat.stop == ["</s>"] and chat.tool_choice == "auto" and chat.parallel_tool_calls is False
    assert chat.response_format == {"type": "json_object"}
    assert chat.extra == {"chat_template_kwargs": {"enable_thinking": False}}
    bare = parse().chat
    assert (bare.max_tokens, bare.temperature, bare.stop, bare.extra) == (None, None, None, {})
    assert parse(stop=["a", "b"]).chat.stop == ["a", "b"] and parse(stop=[]).chat.stop is None


@pytest.mark.parametrize(("fields", "expected"), [
    ({"max_tokens": 64}, 64),
    ({"max_completion_tokens": 32}, 32),
    ({"max_completion_tokens": 32, "max_tokens": 64}, 32),  # the current name wins over the deprecated one
])
def test_max_completion_tokens_is_the_current_name_of_max_tokens(fields, expected):
    assert parse(**fields).chat.max_tokens == expected


@pytest.mark.parametrize(("fields", "stream", "usage"), [
    ({}, False, False),
    ({"stream": True}, True, False),
    ({"stream": True, "stream_options": {}}, True, False),
    ({"stream": True, "stream_options": {"include_usage": False}}, True, False),
    ({"stream": True, "stream_options": {"include_usage": True}}, True, True),
])
def test_stream_and_stream_options(fields, stream, usage):
    inbound = parse(**fields)
    assert (inbound.stream, inbound.render_state) == (stream, OpenAIChatRenderState(include_usage=usage))
    assert (inbound.provider, inbound.model) == ("openai_chat", "policy")


def test_a_render_state_made_without_the_option_streams_no_usage():
    assert OpenAIChatRenderState() == OpenAIChatRenderState(include_usage=False)


def test_unknown_fields_are_reported_and_known_ones_are_not():
    inbound = parse(user="u1", store=False, logprobs=True, metadata={"a": "b"}, foo=1, bar={"x": 1})
    assert inbound.ignored_fields == ["bar", "foo"]
    assert parse(**dict.fromkeys(KNOWN_IGNORED)).ignored_fields == []
    assert parse().ignored_fields == [] and parse().normalizations == []


def test_reasoning_effort_is_noted_as_not_applied():
    """The engine's chat template decides how much a model thinks; a harness that asked for an effort is told so
    in the journal instead of the field vanishing (it is neither forwarded nor an unknown field)."""
    inbound = parse(reasoning_effort="high")
    assert inbound.normalizations == ["reasoning_effort 'high' not applied (the engine's template decides)"]
    assert inbound.ignored_fields == [] and inbound.chat.extra == {}


# ---------------------------------------------------------------- parse: malformed requests are 400s


@pytest.mark.parametrize(("body", "fragment"), [
    ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]},
     "messages.0.content.0.type: unsupported content part type 'audio'"),
    ({"messages": [{"role": "user", "content": [{"text": "x"}]}]},
     "messages.0.content.0.type: unsupported content part type None"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages.0.content.0.text: must be a string"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_text"}]}]},
     "messages.0.content.1.text: must be a string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages.0.content.0.image_url: needs a url"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"detail": "low"}}]}]},
     "messages.0.content.0.image_url: needs a url"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": 5}]}]},
     "messages.0.content.0.image_url: needs a url"),
    ({"messages": [*HI, {"role": "assistant", "tool_calls": [{"id": "c"}]}]},
     "messages.1.tool_calls.0.function.name: required"),
    ({"messages": [*HI, {"role": "assistant", "tool_calls": [call(), {"function": {"name": 3}}]}]},
     "messages.1.tool_calls.1.function.name: required"),
    ({"messages": [*HI, {"role": "assistant", "tool_calls": [{"function": "shell"}]}]},
     "messages.1.tool_calls.0.function.name: required"),
    ({"messages": [*HI, {"role": "assistant", "function_call": {"arguments": "{}"}}]},
     "messages.1.tool_calls.0.function.name: required"),
    ({"messages": [{"role": "tool", "tool_call_id": "c", "content": [
        {"type": "image_url", "image_url": {"url": "u"}}]}]},
     "messages.0.content: tool results carry text only"),
    ({"messages": [{"role": "function", "name": "f", "content": [{"type": "audio"}]}]},
     "messages.0.content.0.type: unsupported content part type 'audio'"),
    ({"messages": HI, "tools": [{"type": "web_search"}]}, "tools.0.function.name: required"),
    ({"messages": HI, "tools": [SHELL, {"type": "function", "function": {"description": "x"}}]},
     "tools.1.function.name: required"),
    ({"messages": HI, "tools": [{"type": "function"}]}, "tools.0.function.name: required"),
    ({"messages": HI, "functions": [{"name": None}]}, "functions.0.name: required"),
])
def test_malformed_requests_are_400s_in_the_openai_error_shape(body, fragment):
    assert_400(body, fragment)


@pytest.mark.parametrize(("body", "fragment"), [
    ({"messages": [*HI, {"role": "assistant", "tool_calls": [call(name="")]}]},
     "messages.1.tool_calls.0.function.name: required, a non-empty string"),
    ({"messages": [*HI, {"role": "assistant", "tool_calls": [call(id=7)]}]},
     "messages.1.tool_calls.0.id: must be a string"),
    ({"messages": [*HI, {"role": "assistant", "tool_calls": [call(id={"a": 1})]}]},
     "messages.1.tool_calls.0.id: must be a string"),
    ({"messages": [*HI, {"role": "assistant", "tool_calls": [call(arguments=None)]}]},
     "messages.1.tool_calls.0.function.arguments: must be a JSON string or an object"),
    ({"messages": [*HI, {"role": "assistant", "tool_calls": [call(arguments=[1])]}]},
     "messages.1.tool_calls.0.function.arguments: must be a JSON string or an object"),
    ({"messages": [*HI, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "custom", "custom": {"name": "patch", "input": "x"}}]}]},
     "messages.1.tool_calls.0.type: only function tool calls are supported, got 'custom'"),
    ({"messages": [*HI, {"role": "assistant", "function_call": {"name": "f", "arguments": 5}}]},
     "messages.1.tool_calls.0.function.arguments: must be a JSON string or an object"),
    ({"messages": [{"role": "function", "content": "ok"}]},
     "messages.0.name: a function result needs the name of the function it answers"),
    ({"messages": HI, "tools": [{"type": "function", "function": {"name": ""}}]},
     "tools.0.function.name: required, a non-empty string"),
    ({"messages": HI, "tools": [SHELL], "functions": [{"name": "ok"}, {"description": "x"}]},
     "functions.1.name: required"),
    ({"messages": HI, "functions": [{"name": ""}]}, "functions.0.name: required, a non-empty string"),
])
def test_tool_calls_and_tools_that_name_nothing_are_400s(body, fragment):
    """An empty name calls no tool and a call id that is not a string pairs no result: these were sent on as
    they were (or coerced), leaving the engine to fail or the journal to hold a call nothing can answer."""
    assert_400(body, fragment)


@pytest.mark.parametrize(("body", "fragment"), [
    ({"messages": []}, "messages: List should have at least 1 item"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role: Input should be 'system'"),
    ({"messages": HI, "n": 2}, "n: Input should be less than or equal to 1"),
    ({"messages": HI, "temperature": 3}, "temperature: Input should be less than or equal to 2"),
    ({"messages": HI, "max_tokens": 0}, "max_tokens: Input should be greater than or equal to 1"),
])
def test_requests_pydantic_rejects_are_400s(body, fragment):
    assert_400(body, fragment)


def test_a_body_that_is_not_an_object_is_a_400():
    with pytest.raises(RequestError, match="must be a JSON object"):
        PROVIDER.parse([], ROUTE)  # type: ignore[arg-type]


def test_a_tool_result_of_text_parts_is_text():
    assert messages({"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "ok"}]}) == [
        {"role": "tool", "content": "ok", "tool_call_id": "c"}]


# ---------------------------------------------------------------- render


def test_render_text_reasoning_tool_calls_and_usage():
    out = rendered(result("Listing.", reasoning="look first", calls=[("shell", '{"cmd": "ls"}')],
                          finish="tool_calls"), messages=HI, model="my-model")
    assert out == {
        "id": "chatcmpl-abc123", "object": "chat.completion", "created": 1_700_000_000, "model": "my-model",
        "choices": [{"index": 0, "logprobs": None, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": "Listing.", "reasoning_content": "look first",
            "tool_calls": [{"id": "call_0", "type": "function",
                            "function": {"name": "shell", "arguments": '{"cmd": "ls"}'}}]}}],
        "usage": {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18},
    }


def test_render_plain_and_empty_answers():
    plain = rendered(result("hi"))["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": "hi"} and plain["finish_reason"] == "stop"
    assert rendered(result(None, calls=[("f", "{}")]))["choices"][0]["message"]["content"] is None
    assert rendered(result("", reasoning=""))["choices"][0]["message"] == {"role": "assistant", "content": ""}
    parts = ChatResult(message=ChatMessage(role="assistant", content=[{"type": "text", "text": "a"},
                                                                      {"type": "text", "text": "b"}]))
    assert rendered(parts)["choices"][0]["message"]["content"] == "ab"


@pytest.mark.parametrize("finish", ["stop", "length", "tool_calls", "content_filter"])
def test_finish_reasons_are_passed_through(finish):
    assert rendered(result("x", finish=finish))["choices"][0]["finish_reason"] == finish
    assert streamed(result("x", finish=finish))[-2]["choices"][0]["finish_reason"] == finish


# ---------------------------------------------------------------- stream


def test_stream_chunk_sequence():
    chunks = streamed(result("Listing.", reasoning="look", calls=[("shell", '{"cmd": "ls"}'), ("noop", "{}")],
                             finish="tool_calls"), model="my-model")
    assert chunks[-1] == "[DONE]"
    for c in chunks[:-1]:
        assert (c["id"], c["object"], c["created"], c["model"]) == (
            "chatcmpl-abc123", "chat.completion.chunk", 1_700_000_000, "my-model")
        assert "usage" not in c and c["choices"][0]["index"] == 0 and c["choices"][0]["logprobs"] is None
    assert deltas(chunks) == [
        {"role": "assistant", "content": ""},
        {"reasoning_content": "look"},
        {"content": "Listing."},
        {"tool_calls": [{"index": 0, "id": "call_0", "type": "function",
                         "function": {"name": "shell", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"cmd": "ls"}'}}]},
        {"tool_calls": [{"index": 1, "id": "call_1", "type": "function",
                         "function": {"name": "noop", "arguments": ""}}]},
        {"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]},
        {},
    ]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * 7 + ["tool_calls"]


def test_stream_of_a_plain_answer_skips_empty_deltas():
    chunks = streamed(result("", reasoning=""))
    assert deltas(chunks) == [{"role": "assistant", "content": ""}, {}] and chunks[-1] == "[DONE]"


def test_stream_with_include_usage_ends_with_a_usage_chunk():
    chunks = streamed(result("hi"), stream_options={"include_usage": True})
    assert [c["usage"] for c in chunks[:-2]] == [None, None, None]  # every chunk carries the key, as OpenAI's do
    assert chunks[-2] == {"id": "chatcmpl-abc123", "object": "chat.completion.chunk", "created": 1_700_000_000,
                          "model": "policy", "choices": [],
                          "usage": {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}}
    assert chunks[-1] == "[DONE]"


@given(text=st.text(max_size=8), reasoning=st.none() | st.text(max_size=8),
       calls=st.lists(st.tuples(st.sampled_from(["shell", "read"]), st.sampled_from(["{}", '{"a": 1}'])),
                      max_size=3),
       finish=st.sampled_from(["stop", "length", "tool_calls"]))
def test_the_stream_accumulates_to_the_rendered_message(text, reasoning, calls, finish):
    """What a client assembles from the chunks is what the non-streamed answer says."""
    res = result(text, reasoning=reasoning, calls=calls, finish=finish)
    message = rendered(res)["choices"][0]["message"]
    chunks = streamed(res)
    got: dict[str, Any] = {"role": "assistant", "content": ""}
    for d in deltas(chunks):
        got["content"] += d.get("content", "")
        if d.get("reasoning_content"):
            got["reasoning_content"] = got.get("reasoning_content", "") + d["reasoning_content"]
        for tc in d.get("tool_calls", []):
            calls_so_far = got.setdefault("tool_calls", [])
            if "id" in tc:
                calls_so_far.append({"id": tc["id"], "type": tc["type"], "function": dict(tc["function"])})
            else:
                calls_so_far[tc["index"]]["function"]["arguments"] += tc["function"]["arguments"]
    assert got == message
    assert chunks[-2]["choices"][0]["finish_reason"] == finish
