"""The Responses front end pinned where mutation testing found it loose (issue 20): the settings a Response echoes
and their defaults, tool inputs shown to the model as written, function and custom tool specs, tool_choice notes and
400s, which parts of tool outputs and reasoning items are read, and images in assistant messages."""

from __future__ import annotations

import pytest

from tests.unit.test_responses_translate import PATCH, SHELL, bad, parse, rendered, result


def test_a_response_reports_the_request_settings_back():
    """What a Response object echoes: the request's settings, and the API's defaults for those it left out."""
    plain = rendered(result("ok"))
    assert {k: plain[k] for k in ("parallel_tool_calls", "text", "metadata", "store", "service_tier", "truncation",
                                  "background", "tool_choice", "tools")} == {
        "parallel_tool_calls": True, "text": {"format": {"type": "text"}}, "metadata": {}, "store": False,
        "service_tier": "default", "truncation": "disabled", "background": False, "tool_choice": "auto", "tools": []}
    given = rendered(result("ok"), parallel_tool_calls=False, text={"verbosity": "low"}, metadata={"run": "7"},
                     store=True, service_tier="flex", truncation="auto")
    assert {k: given[k] for k in ("parallel_tool_calls", "text", "metadata", "store", "service_tier",
                                  "truncation")} == {
        "parallel_tool_calls": False, "text": {"format": {"type": "text"}, "verbosity": "low"},
        "metadata": {"run": "7"}, "store": True, "service_tier": "flex", "truncation": "auto"}


def test_tool_inputs_reach_the_model_as_written_not_escaped():
    """A freeform tool's input and a local_shell action become JSON arguments with non-ASCII text kept as it is:
    the model is shown (and trained on) what it wrote, not \\u escapes."""
    inbound = parse(input=[
        {"role": "user", "content": "edit"},
        {"type": "custom_tool_call", "call_id": "p1", "name": "apply_patch", "input": "grüße ✓"},
        {"type": "custom_tool_call_output", "call_id": "p1", "output": "ok"},
        {"type": "local_shell_call", "id": "lsh_1", "call_id": "s1", "status": "completed",
         "action": {"type": "exec", "command": ["echo", "héllo"], "env": {}}},
        {"type": "local_shell_call_output", "id": "lsh_1", "output": "héllo"}],
        tools=[PATCH, {"type": "local_shell"}])
    arguments = [c.function.arguments for m in inbound.chat.messages for c in m.tool_calls or []]
    assert arguments[0] == '{"input": "grüße ✓"}'
    assert "héllo" in arguments[1] and "\\u" not in arguments[1]


def test_a_function_tool_keeps_its_description_parameters_and_strictness():
    [tool] = parse(input="x", tools=[SHELL]).chat.tools or []
    assert tool.function == {"name": "shell", "description": "Run", "parameters": SHELL["parameters"],
                             "strict": False}


@pytest.mark.parametrize(("choice", "note"), [
    ({"type": "allowed_tools", "mode": "auto", "tools": []},
     "tool_choice: allowed_tools narrowed to its mode (every offered tool stays visible)"),
    ({"type": "web_search_preview"}, "tool_choice: built-in tool 'web_search_preview' is not offered; using 'auto'"),
])
def test_a_narrowed_tool_choice_is_noted(choice, note):
    assert parse(input="x", tools=[SHELL], tool_choice=choice).normalizations == [note]


@pytest.mark.parametrize("choice", [{"type": "function"}, {"type": "function", "name": 3},
                                    {"type": "allowed_tools", "mode": "sometimes", "tools": []}])
def test_an_unusable_tool_choice_is_a_400(choice):
    bad("tool_choice: unsupported value", input="x", tools=[SHELL], tool_choice=choice)


@pytest.mark.parametrize("tools", [[{"type": "function", "name": ""}],
                                   [{"type": "namespace", "name": "", "tools": [SHELL]}]])
def test_an_empty_tool_or_namespace_name_is_a_400(tools):
    bad(r"tools\.0\.name: required", input="x", tools=tools)


def test_only_text_parts_of_a_tool_output_or_reasoning_item_are_read():
    """A tool output keeps its text parts (a part of another type, or with no text, is dropped and noted); a
    reasoning item's raw content is its reasoning_text / text parts with text."""
    inbound = parse(input=[
        {"role": "user", "content": "go"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "think"}, {"type": "note", "text": "aside"},
                     {"type": "text", "text": None}]},
        {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1",
         "output": [{"type": "input_text", "text": "a"}, {"type": "log", "text": "b"}, {"type": "text"}]}],
        tools=[SHELL])
    assert inbound.chat.messages[1].reasoning_content == "think"
    assert inbound.chat.messages[2].content == "a"
    assert inbound.normalizations == ["input.3.output.1: 'log' part dropped (tool results carry text only)",
                                      "input.3.output.2: 'text' part dropped (tool results carry text only)"]


def test_a_custom_tools_stand_in_takes_exactly_one_input_string():
    [tool] = parse(input="x", tools=[PATCH]).chat.tools or []
    assert tool.parameters["required"] == ["input"] and tool.parameters["additionalProperties"] is False


def test_an_image_in_an_assistant_message_is_dropped_with_a_note():
    inbound = parse(input=[{"role": "user", "content": "q"}, {"type": "message", "role": "assistant", "content": [
        {"type": "output_text", "text": "A"}, {"type": "input_image", "image_url": "data:image/png;base64,AA"},
        {"type": "output_text", "text": "B"}]}])
    assert inbound.chat.messages[1].content == "AB"
    assert inbound.normalizations == [
        "input.1.content.1: 'input_image' part dropped (assistant messages carry text only)"]
