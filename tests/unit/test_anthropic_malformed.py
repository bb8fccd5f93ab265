"""Malformed Anthropic blocks get a 400 naming the field (never a 500, never silent acceptance), and the
normalization notes a harness is shown are exact."""

from __future__ import annotations

from typing import Any

import pytest

from polar_gym.proxy.errors import RequestError
from polar_gym.proxy.providers.anthropic import AnthropicProvider
from polar_gym.proxy.providers.anthropic.translate import BILLING_NOTE
from polar_gym.proxy.providers.base import Route

PROVIDER = AnthropicProvider()
ROUTE = Route("/v1/messages")


def parse(messages: list[dict[str, Any]], **fields: Any):
    return PROVIDER.parse({"model": "policy", "max_tokens": 8, "messages": messages, **fields}, ROUTE)


def user(*blocks: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(blocks)}]


def assistant(*blocks: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "q"}, {"role": "assistant", "content": list(blocks)}]


def result(content: Any, call_id: Any = "t") -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": call_id, "content": content}


def use(**fields: Any) -> dict[str, Any]:
    return {"type": "tool_use", **{"id": "toolu_1", "name": "Bash", "input": {}, **fields}}


def image(**source: Any) -> dict[str, Any]:
    return {"type": "image", "source": source}


@pytest.mark.parametrize(("messages", "fragment"), [
    (user(result(5)), "messages.0.content.0.content: must be a string or a list of content blocks"),
    (user(result(None)), "messages.0.content.0.content: must be a string or a list of content blocks"),
    (user(result({"type": "text", "text": "x"})), "messages.0.content.0.content: must be a string or a list"),
    (user(result(["x"])), "messages.0.content.0.content.0: a content block must be an object, got str"),
    (user(result([{"type": "tool_use"}])), "messages.0.content.0.content.0.type: 'tool_use' blocks belong in"),
    (user(result("x", call_id="")), "messages.0.content.0.tool_use_id: required"),
    (user(result("x", call_id=3)), "messages.0.content.0.tool_use_id: required"),
    (assistant(use(id="")), "messages.1.content.0.id: tool_use needs a non-empty string id"),
    (assistant(use(id=1)), "messages.1.content.0.id: tool_use needs a non-empty string id"),
    (assistant(use(name="")), "messages.1.content.0.name: tool_use needs a non-empty string name"),
    (assistant(use(name=None)), "messages.1.content.0.name: tool_use needs a non-empty string name"),
    (assistant(use(input=[1])), "messages.1.content.0.input: must be an object"),
    (assistant(use(input=None)), "messages.1.content.0.input: must be an object"),
    (assistant(use(input="{}")), "messages.1.content.0.input: must be an object"),
    (assistant({"type": "foo"}), "messages.1.content.0.type: unsupported assistant content block type 'foo'"),
    (assistant({"text": "x"}), "messages.1.content.0.type: unsupported assistant content block type None"),
    (assistant(image(type="url", url="u")), "messages.1.content.0.type: unsupported assistant content block"),
    (assistant({"type": "thinking", "thinking": 1}), "messages.1.content.0.thinking: must be a string"),
    (user(image(type="base64", data="AA")), "messages.0.content.0.source: a base64 source needs media_type and data"),
    (user(image(type="base64", media_type="image/png")), "messages.0.content.0.source: a base64 source needs"),
    (user(image(type="base64", media_type="", data="AA")), "messages.0.content.0.source: a base64 source needs"),
    (user(image(type="base64", media_type="image/png", data="")), "messages.0.content.0.source: a base64 source"),
    (user(image(type="url")), "messages.0.content.0.source.url: must be a string"),
    (user({"type": "image", "source": "x"}), "messages.0.content.0.source.type: unsupported image source None"),
])
def test_malformed_blocks_are_400s_naming_the_field(messages, fragment):
    with pytest.raises(RequestError) as info:
        parse(messages)
    assert info.value.status == 400 and fragment in info.value.message, info.value.message


@pytest.mark.parametrize("name", ["", 3, None])
def test_a_tool_without_a_name_is_a_400(name):
    with pytest.raises(RequestError) as info:
        parse(user({"type": "text", "text": "q"}), tools=[{"name": name, "input_schema": {"type": "object"}}])
    assert info.value.status == 400 and info.value.message.startswith("tools.0.name: required")


def test_a_tool_use_without_input_is_an_empty_call():
    """Lenient on purpose: a call with no arguments is still the call the model made."""
    msg = parse(assistant({"type": "tool_use", "id": "toolu_1", "name": "Bash"})).chat.messages[1]
    assert msg.tool_calls is not None and msg.tool_calls[0].function.arguments == "{}"


def test_normalization_notes_are_exact_and_each_given_once():
    billing = {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=2;\n"}
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "a"},
                                                  {"type": "redacted_thinking", "data": "b"}]},
                {"role": "system", "content": [billing, {"type": "text", "text": "reminder"}]},
                {"role": "assistant", "content": "The answer is"}]
    tools = [{"type": "bash_20250124", "name": "bash"}, {"type": "web_search_20250305", "name": "web_search"}]
    inbound = parse(messages, system=[billing, {"type": "text", "text": "sys"}], tools=tools)
    assert inbound.normalizations == [
        "dropped redacted_thinking blocks (encrypted, no text to show the policy)",
        BILLING_NOTE,
        "the final assistant message (a prefill) is sent as a complete turn, not continued",
        "mapped Anthropic tool 'bash' (bash_20250124) to a function tool with its documented input schema",
        "skipped server tool 'web_search' (web_search_20250305): the gateway cannot run Anthropic server tools",
    ]
    assert [m.content for m in inbound.chat.messages if m.role == "system"] == ["sys", "reminder"]


@pytest.mark.parametrize(("fields", "fragment"), [
    ({"system": [{"type": "image", "source": {}}]}, "system.0.type: only text blocks are allowed here, got 'image'"),
    ({"messages": user({"type": "document", "source": {"type": "content", "content": ["x"]}})},
     "messages.0.content.0.source.content.0: a content block must be an object, got str"),
])
def test_text_only_block_lists_refuse_other_blocks_with_a_400(fields, fragment):
    with pytest.raises(RequestError) as info:
        PROVIDER.parse({"model": "policy", "max_tokens": 8, "messages": user({"type": "text", "text": "q"}),
                        **fields}, ROUTE)
    assert info.value.status == 400 and fragment in info.value.message, info.value.message


def test_a_search_result_without_a_list_of_blocks_is_a_400():
    with pytest.raises(RequestError) as info:
        parse(user({"type": "search_result", "title": "T", "source": "s", "content": "r"}))
    assert info.value.status == 400 and "messages.0.content.0.content: must be a list of text blocks" in str(
        info.value.message)


def test_empty_or_non_text_titles_add_no_heading():
    """A document's title and context, a search result's title and source, head the text only when they are
    non-empty strings (no stray blank lines, no 500 on a number)."""
    blocks = [{"type": "document", "title": "", "context": "ctx", "source": {"type": "text", "data": "d"}},
              {"type": "document", "title": 5, "source": {"type": "text", "data": "e"}},
              {"type": "search_result", "title": "", "source": 7, "content": [{"type": "text", "text": "r"}]},
              {"type": "search_result", "title": "T", "source": "", "content": [{"type": "text", "text": "s"}]}]
    (msg,) = parse([{"role": "user", "content": blocks}]).chat.messages
    assert msg.content == "ctx\n\nd\n\ne\n\nr\n\nT\n\ns\n\n"


def test_a_custom_tool_is_translated_without_a_note():
    inbound = parse(user({"type": "text", "text": "q"}),
                    tools=[{"type": "custom", "name": "Bash", "input_schema": {"type": "object"}},
                           {"name": "Read", "input_schema": {"type": "object"}}])
    assert [t.function["name"] for t in inbound.chat.tools or []] == ["Bash", "Read"]
    assert inbound.normalizations == []
