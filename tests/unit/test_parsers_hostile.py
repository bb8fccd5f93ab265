"""Hostile and odd sampled text for every registered parser: it never raises, and what it returns accounts for the
whole input (the segments cover it exactly, only delimiting tags are dropped, everything else reaches the message)."""

from __future__ import annotations

import json
import re
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polar_gym.proxy.parsers.base import OutputParser, ParsedReply, parser_for
from polar_gym.proxy.parsers.qwen3 import Qwen3Parser
from polar_gym.registry import PARSERS

QWEN = Qwen3Parser()
PARSER_NAMES = PARSERS.names()

#: what a parser may drop: its delimiters, end-of-turn runs, and (between Llama calls) whitespace and ';'
DELIMITER = re.compile(r"(<think>|</think>|<tool_call>|</tool_call>|<\|python_tag\|>|[\s;]+"
                       r"|(\s*(<\|im_end\|>|<\|endoftext\|>|<\|eot_id\|>|<\|eom_id\|>|<\|end_of_text\|>))+\s*)")

PIECES = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<|im_end|>", "<|endoftext|>", "<|python_tag|>",
          "<|eot_id|>", "<|eom_id|>", "\n", " ", ";", "{", "}", '"name"', ": ", '"arguments"', '"parameters"',
          '"shell"', "{}", '{"cmd": "ls"}', "\ufffd", "é", "garbage", "[1]",
          '{"name": "shell", "arguments": {"cmd": "ls"}}', '{"name": "f", "parameters": {"a": 1}}']
hostile_text = st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=8)), max_size=24).map("".join)


def squeeze(text: str | None) -> str:
    return re.sub(r"\s+", "", text or "")


def assert_accounts_for(parser: OutputParser, text: str, reply: ParsedReply) -> None:
    segments = reply.segments
    assert "".join(s.text for s in segments) == text
    for seg in segments:
        if seg.kind == "tag":
            assert DELIMITER.fullmatch(seg.text), seg
    message = reply.message
    assert squeeze(message.reasoning_content) == squeeze("".join(s.text for s in segments if s.kind == "reasoning"))
    assert squeeze(message.content if isinstance(message.content, str) else None) == squeeze(
        "".join(s.text for s in segments if s.kind in ("content", "bad_call")))
    bodies = [s.text for s in segments if s.kind == "call"]
    tool_calls = message.tool_calls or []
    assert len(bodies) == len(tool_calls)
    for body, call in zip(bodies, tool_calls, strict=True):
        data = json.loads(body)
        assert data["name"] == call.function.name
        args = next((data[k] for k in ("arguments", "parameters") if k in data), {})
        args = json.loads(args) if isinstance(args, str) else args
        assert json.loads(call.function.arguments) == args
    assert reply.unparseable_tool_calls == sum(1 for s in segments if s.kind == "bad_call")
    assert len({c.id for c in tool_calls}) == len(tool_calls)


@pytest.mark.parametrize("name", PARSER_NAMES)
@settings(max_examples=300, deadline=None)
@given(text=hostile_text, thinking=st.booleans())
def test_never_raises_and_accounts_for_the_text(name, text, thinking):
    parser = parser_for(name)
    assert_accounts_for(parser, text, parser.parse(text, None, thinking=thinking))


@pytest.mark.parametrize("name", PARSER_NAMES)
@settings(max_examples=100, deadline=None)
@given(text=st.text(), thinking=st.booleans())
def test_any_unicode_text(name, text, thinking):
    parser = parser_for(name)
    assert_accounts_for(parser, text, parser.parse(text, None, thinking=thinking))


def test_nested_and_unbalanced_tags():
    reply = QWEN.parse("<think><think>a</think>b</think>c", None)
    assert reply.message.reasoning_content == "<think>a"
    assert reply.message.content == "b</think>c"
    nested = '<tool_call><tool_call>{"name": "shell", "arguments": {}}</tool_call></tool_call>'
    reply = QWEN.parse(nested, None)
    assert reply.message.tool_calls is None and reply.unparseable_tool_calls == 1
    assert reply.message.content == nested
    stray = QWEN.parse("done</tool_call> really", None)
    assert stray.message.content == "done</tool_call> really" and stray.unparseable_tool_calls == 0


def test_tool_call_inside_reasoning_stays_reasoning():
    inner = '<tool_call>\n{"name": "shell", "arguments": {"cmd": "ls"}}\n</tool_call>'
    reply = QWEN.parse(f"<think>maybe {inner}?</think>No call after all.", None)
    assert reply.message.reasoning_content == f"maybe {inner}?"
    assert reply.message.content == "No call after all."
    assert reply.message.tool_calls is None and reply.unparseable_tool_calls == 0


def test_huge_arguments_parse_quickly():
    big = "x" * 2_000_000
    text = '<think>r</think><tool_call>\n{"name": "write", "arguments": {"data": "' + big + '"}}\n</tool_call>'
    started = time.perf_counter()
    reply = QWEN.parse(text, None)
    assert time.perf_counter() - started < 5
    (call,) = reply.message.tool_calls or []
    assert json.loads(call.function.arguments) == {"data": big}


def test_replacement_characters_survive():
    """Detokenizing a reply cut inside a multi-byte character yields U+FFFD; it is model text like any other."""
    text = ('<think>\ufffd\ufffd</think>caf\ufffd'
            '<tool_call>{"name": "f\ufffd", "arguments": {"s": "\ufffd"}}</tool_call>')
    reply = QWEN.parse(text, None)
    assert reply.message.reasoning_content == "\ufffd\ufffd"
    assert reply.message.content == "caf\ufffd"
    (call,) = reply.message.tool_calls or []
    assert call.function.name == "f\ufffd" and json.loads(call.function.arguments) == {"s": "\ufffd"}
    assert_accounts_for(QWEN, text, reply)


@pytest.mark.parametrize(("name", "end"), [("qwen3", "<|im_end|>"), ("llama3_json", "<|eot_id|>")])
def test_empty_and_whitespace_only_text(name, end):
    for text in ("", "\n\n", end, f"\n{end}\n"):
        reply = parser_for(name).parse(text, None)
        assert reply.message.content is None and reply.message.tool_calls is None
        assert reply.message.reasoning_content is None and reply.unparseable_tool_calls == 0
