"""Qwen3 (and Qwen2.5, QwQ: the hermes tool format): ``<think>`` reasoning, ``<tool_call>`` JSON blocks.

Reasoning: with ``thinking=True`` the text may open with ``<think>`` (the model wrote it) or start inside the think
block (the template put ``<think>`` in the prompt, so only ``</think>`` appears). ``<think>`` with no ``</think>`` is
a reply cut at max_tokens: all of it is reasoning. No tag at all means the model answered directly. Anything after
``</think>``, ``<tool_call>`` included, is the answer; ``<tool_call>`` inside the reasoning stays reasoning.

Calls: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, several per reply, with text before and
between. A block whose JSON does not parse (trailing garbage included), names no tool, or is never closed is kept
as content and counted as unparseable. ``<|im_end|>`` / ``<|endoftext|>`` at the end are trimmed.
"""

from __future__ import annotations

from typing import ClassVar

from polar_gym.proxy.parsers.base import OutputParser, Segment, tool_call_from_json, trailing_end_tokens

__all__ = ["Qwen3Parser", "split_tool_calls"]

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
END_TOKENS = ("<|im_end|>", "<|endoftext|>")


def split_tool_calls(text: str, open_tag: str = CALL_OPEN, close_tag: str = CALL_CLOSE) -> list[Segment]:
    """The answer part: content, and each ``open ... close`` block as a parsed call (tags as ``tag``) or, when it
    does not parse or never closes, as one ``bad_call`` segment holding the block verbatim."""
    segments: list[Segment] = []
    pos = 0
    while True:
        start = text.find(open_tag, pos)
        if start < 0:
            break
        if start > pos:
            segments.append(Segment(kind="content", text=text[pos:start]))
        body_start = start + len(open_tag)
        end = text.find(close_tag, body_start)
        if end < 0:
            segments.append(Segment(kind="bad_call", text=text[start:]))
            return segments
        body = text[body_start:end]
        call = tool_call_from_json(body.strip())
        if call is None:
            segments.append(Segment(kind="bad_call", text=text[start:end + len(close_tag)]))
        else:
            segments += [Segment(kind="tag", text=open_tag), Segment(kind="call", text=body, call=call),
                         Segment(kind="tag", text=close_tag)]
        pos = end + len(close_tag)
    if pos < len(text):
        segments.append(Segment(kind="content", text=text[pos:]))
    return segments


class Qwen3Parser(OutputParser):
    name: ClassVar[str] = "qwen3"

    def segment(self, text: str, *, thinking: bool = True) -> list[Segment]:
        cut = trailing_end_tokens(text, END_TOKENS)
        body, tail = text[:cut], text[cut:]
        segments: list[Segment] = []
        answer_from = 0
        if thinking:
            lead = len(body) - len(body.lstrip())
            opened = body.startswith(THINK_OPEN, lead)
            reasoning_from = lead + len(THINK_OPEN) if opened else 0
            close = body.find(THINK_CLOSE, reasoning_from)
            if close >= 0 or opened:
                if opened:
                    if lead:
                        segments.append(Segment(kind="content", text=body[:lead]))
                    segments.append(Segment(kind="tag", text=THINK_OPEN))
                reasoning_to = close if close >= 0 else len(body)
                segments.append(Segment(kind="reasoning", text=body[reasoning_from:reasoning_to]))
                if close >= 0:
                    segments.append(Segment(kind="tag", text=THINK_CLOSE))
                    answer_from = close + len(THINK_CLOSE)
                else:
                    answer_from = len(body)
        segments += split_tool_calls(body[answer_from:])
        if tail:
            segments.append(Segment(kind="tag", text=tail))
        return segments
