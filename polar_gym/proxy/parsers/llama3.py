"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: the reply *is* the call, ``{"name": ..., "parameters": {...}}``.

Why this family: after Qwen it is the most widely fine-tuned open family, transformers ships its chat template in
every Llama-3.x-Instruct tokenizer, and its format is the opposite of hermes (no block delimiters: a call is bare
JSON, possibly after ``<|python_tag|>``), so it keeps the parser interface honest. The template renders an assistant
call as ``{"name": "<name>", "parameters": <arguments | tojson>}<|eot_id|>`` (``<|eom_id|>`` in ipython mode).

Rules (as vLLM's ``llama3_json`` tool parser reads them): the calls start at ``<|python_tag|>`` (text before it is
content) or, without the tag, when the reply opens with ``{``. Several calls may follow each other, separated by
``;``. ``"arguments"`` is accepted as well as ``"parameters"``. A reply opening with ``{`` that is JSON but not a
call (a model answering in JSON) is content; one that looks like a call (``{"name":``) and does not parse, e.g. cut
at max_tokens, is an unparseable call, as is anything after ``<|python_tag|>`` that is not call JSON (the built-in
``brave_search.call(...)`` / code-interpreter forms are not function tools). Llama 3 has no reasoning block, so
``thinking`` is ignored. ``<|eot_id|>`` / ``<|eom_id|>`` / ``<|end_of_text|>`` at the end are trimmed.
"""

from __future__ import annotations

import json
import re
from typing import ClassVar

from polar_gym.proxy.parsers.base import OutputParser, Segment, tool_call_from_json, trailing_end_tokens

__all__ = ["Llama3JsonParser"]

PYTHON_TAG = "<|python_tag|>"
END_TOKENS = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")
ARGUMENT_KEYS = ("parameters", "arguments")
_LOOKS_LIKE_CALL = re.compile(r'\s*\{\s*"name"\s*:')
_DECODER = json.JSONDecoder()
_GAP = re.compile(r"[\s;]*")


def _split_calls(region: str) -> list[Segment] | None:
    """``region`` as a run of call objects separated by ``;`` (whitespace allowed): call segments for the objects,
    ``tag`` segments for separators and whitespace; None when any part of it is not a call."""
    segments: list[Segment] = []
    pos = 0
    while pos < len(region):
        gap = _GAP.match(region, pos)
        assert gap is not None  # the pattern matches the empty string
        if gap.end() > pos:
            segments.append(Segment(kind="tag", text=gap.group()))
            pos = gap.end()
            if pos == len(region):
                break
        try:
            _, end = _DECODER.raw_decode(region, pos)
        except ValueError:
            return None
        call = tool_call_from_json(region[pos:end], ARGUMENT_KEYS)
        if call is None:
            return None
        segments.append(Segment(kind="call", text=region[pos:end], call=call))
        pos = end
    return segments if any(s.kind == "call" for s in segments) else None


class Llama3JsonParser(OutputParser):
    name: ClassVar[str] = "llama3_json"

    def segment(self, text: str, *, thinking: bool = True) -> list[Segment]:
        cut = trailing_end_tokens(text, END_TOKENS)
        body, tail = text[:cut], text[cut:]
        segments: list[Segment] = []
        tag_at = body.find(PYTHON_TAG)
        if tag_at >= 0:
            if tag_at:
                segments.append(Segment(kind="content", text=body[:tag_at]))
            region = body[tag_at + len(PYTHON_TAG):]
            calls = _split_calls(region)
            if calls is None:
                segments.append(Segment(kind="bad_call", text=body[tag_at:]))
            else:
                segments += [Segment(kind="tag", text=PYTHON_TAG), *calls]
        elif body.lstrip().startswith("{"):
            calls = _split_calls(body)
            if calls is not None:
                segments += calls
            elif _LOOKS_LIKE_CALL.match(body):
                segments.append(Segment(kind="bad_call", text=body))
            else:
                segments.append(Segment(kind="content", text=body))
        elif body:
            segments.append(Segment(kind="content", text=body))
        if tail:
            segments.append(Segment(kind="tag", text=tail))
        return segments
