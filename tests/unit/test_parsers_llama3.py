"""The Llama 3.x JSON tool-call parser: bare ``{"name", "parameters"}`` replies, ``<|python_tag|>``, ``;``-joined
calls, JSON answers that are not calls, and the text the Llama 3.1 template renders for an assistant call."""

from __future__ import annotations

import json

from polar_gym.proxy.parsers.base import ParsedReply, parser_for
from polar_gym.proxy.parsers.llama3 import Llama3JsonParser

LLAMA = Llama3JsonParser()


def calls(reply: ParsedReply) -> list[tuple[str, dict[str, object]]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in reply.message.tool_calls or []]


def template_rendering(name: str, arguments: dict[str, object], end: str = "<|eot_id|>") -> str:
    """What the Llama 3.1/3.2/3.3 chat template renders for an assistant tool call (its documented form):
    ``{"name": "<name>", "parameters": <arguments | tojson>}`` then the end-of-turn token."""
    return '{"name": "' + name + '", "parameters": ' + json.dumps(arguments) + "}" + end


def test_registered_by_name():
    assert isinstance(parser_for("llama3_json"), Llama3JsonParser)


def test_round_trip_of_the_template_rendering():
    for args in ({"location": "Paris", "unit": "celsius"}, {}, {"q": "é ✓ \"quoted\"", "n": [1, 2, {"k": None}]}):
        reply = LLAMA.parse(template_rendering("get_weather", args), None)
        assert calls(reply) == [("get_weather", args)]
        assert reply.message.content is None and reply.message.reasoning_content is None
        assert reply.unparseable_tool_calls == 0
    assert calls(LLAMA.parse(template_rendering("f", {"a": 1}, "<|eom_id|>"), None)) == [("f", {"a": 1})]


def test_python_tag_with_text_before_and_several_calls():
    text = ('Let me check both.<|python_tag|>{"name": "a", "parameters": {"x": 1}}; '
            '{"name": "b", "arguments": {"y": "z"}}<|eom_id|>')
    reply = LLAMA.parse(text, None)
    assert reply.message.content == "Let me check both."
    assert calls(reply) == [("a", {"x": 1}), ("b", {"y": "z"})]
    ids = [c.id for c in reply.message.tool_calls or []]
    assert len(set(ids)) == 2


def test_plain_text_and_json_answers_are_content():
    assert LLAMA.parse("Paris is sunny.<|eot_id|>", None).message.content == "Paris is sunny."
    reply = LLAMA.parse('{"answer": 42}<|eot_id|>', None)
    assert reply.message.content == '{"answer": 42}'
    assert reply.message.tool_calls is None and reply.unparseable_tool_calls == 0
    prose = LLAMA.parse('I would call {"name": "f", "parameters": {}} here.', None)
    assert prose.message.tool_calls is None and prose.unparseable_tool_calls == 0  # a call starts the reply


def test_broken_calls_stay_text_and_are_counted():
    cut = '{"name": "get_weather", "parameters": {"location": "Par'
    reply = LLAMA.parse(cut, None)
    assert reply.message.content == cut and reply.unparseable_tool_calls == 1
    garbage = '{"name": "f", "parameters": {}} and then some'
    assert LLAMA.parse(garbage, None).unparseable_tool_calls == 1
    builtin = '<|python_tag|>brave_search.call(query="weather")<|eom_id|>'
    reply = LLAMA.parse(builtin, None)
    assert reply.message.content == '<|python_tag|>brave_search.call(query="weather")'
    assert reply.unparseable_tool_calls == 1 and reply.message.tool_calls is None
    one_bad = '<|python_tag|>{"name": "a", "parameters": {}}; {"parameters": {}}'
    reply = LLAMA.parse(one_bad, None)
    assert reply.message.tool_calls is None and reply.unparseable_tool_calls == 1


def test_thinking_flag_is_ignored():
    text = template_rendering("f", {"a": 1})
    assert calls(LLAMA.parse(text, None, thinking=False)) == calls(LLAMA.parse(text, None, thinking=True))
    assert LLAMA.parse("<think>x</think>y", None).message.reasoning_content is None
