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

from polar_gym.proxy.parsers.base import OutputParser, Segment, held_back, tool_call_from_json, trailing_end_tokens

__all__ = ["Qwen3Parser", "split_tool_calls"]

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
END_TOKENS = ("<|im_end|>", "<|endoftext|>")
MARKERS = (THINK_OPEN, THINK_CLOSE, CALL_OPEN, *END_TOKENS)


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

    def stream_prefix(self, text: str, *, thinking: bool = True) -> tuple[str, str]:
        """Reasoning as it comes inside an opened ``<think>``; content up to the first ``<tool_call>`` once the
        reasoning is closed (or when there is none). Newlines the whole answer may trim are held back, and so is
        text that may yet be reasoning (no ``<think>`` written and no ``</think>`` seen yet)."""
        answer_from, lead = 0, ""
        if thinking:
            start = len(text) - len(text.lstrip())
            rest = text[start:]
            if not rest or (len(rest) < len(THINK_OPEN) and THINK_OPEN.startswith(rest)):
                return "", ""
            opened = rest.startswith(THINK_OPEN)
            reasoning_from = start + len(THINK_OPEN) if opened else 0
            close = text.find(THINK_CLOSE, reasoning_from)
            if close < 0:
                if not opened:
                    return "", ""  # reasoning if a </think> comes, an answer if none does
                end = held_back(text, reasoning_from, MARKERS, END_TOKENS)
                return text[reasoning_from:end].strip("\n"), ""
            reasoning = text[reasoning_from:close].strip("\n")
            answer_from = close + len(THINK_CLOSE)
            lead = text[:start] if opened else ""
        else:
            reasoning = ""
        call = text.find(CALL_OPEN, answer_from)
        end = held_back(text, answer_from, MARKERS, (*END_TOKENS, CALL_OPEN) if call >= 0 else END_TOKENS)
        content = lead + text[answer_from:end]
        return reasoning, content.strip("\n") if content.strip() else ""
