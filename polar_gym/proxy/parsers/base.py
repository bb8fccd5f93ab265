"""The interface every output parser implements, and the lossless segmentation they share.

A token-in engine samples raw text; the agent harness needs an OpenAI-shaped assistant message. A parser first cuts
the text into :class:`Segment` s that cover it exactly (``"".join(s.text for s in segments) == text``), then projects
them onto a :class:`ParsedReply`: only the delimiting tags are dropped, so nothing the model wrote disappears
silently. A tool-call block that does not parse stays in the content as text and is counted, so a trainer can mask
or zero that sample instead of training on a call the harness never saw.
"""

from __future__ import annotations

import abc
import hashlib
import json
from bisect import bisect_left, bisect_right
from collections.abc import Callable
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from polar_gym.proxy.chat import ChatMessage, FunctionCall, Tool, ToolCall
from polar_gym.registry import PARSERS, RegistryError
from polar_gym.schema import TokenSpan

__all__ = [
    "OutputParser",
    "ParsedReply",
    "Segment",
    "SegmentKind",
    "call_id",
    "held_back",
    "malformed_call_spans",
    "parser_for",
    "project",
    "tool_call_from_json",
    "trailing_end_tokens",
]

#: ``tag``: a delimiter (dropped); ``reasoning``/``content``: model text; ``call``: the body of a parsed tool call
#: (its JSON); ``bad_call``: a tool-call block, tags included, that did not parse (kept as content, counted)
SegmentKind = Literal["tag", "reasoning", "content", "call", "bad_call"]


class Segment(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: SegmentKind
    text: str
    call: FunctionCall | None = None


class ParsedReply(BaseModel):
    """The assistant message a sampled text means, and how many tool-call blocks in it could not be parsed."""

    model_config = ConfigDict(extra="forbid")

    message: ChatMessage
    unparseable_tool_calls: int = 0
    segments: list[Segment] = Field(default_factory=list, exclude=True, repr=False)


class OutputParser(abc.ABC):
    """One model family's output format. Pure: no I/O, never raises on any text."""

    name: ClassVar[str]

    @abc.abstractmethod
    def segment(self, text: str, *, thinking: bool = True) -> list[Segment]:
        """Cut ``text`` into segments that concatenate back to exactly ``text``."""

    def stream_prefix(self, text: str, *, thinking: bool = True) -> tuple[str, str]:
        """(reasoning, content) of a streamed answer's first ``text`` that the whole answer's message keeps
        whatever is sampled next: a prefix of its ``reasoning_content`` and of its ``content`` (``""`` where
        unknown). Content is only given once the reasoning is whole, so a stream can close its reasoning block
        before its text starts. The default holds everything back until the answer is complete."""
        return "", ""

    def parse(self, text: str, tools: list[Tool] | None, *, thinking: bool = True) -> ParsedReply:
        """``thinking=False``: the prompt closed the think block, so the text holds no reasoning. ``tools`` is what
        the request offered; a call to a tool not offered is still a call (the harness answers it, as with any
        hosted API), so it is only informative here."""
        return project(self.segment(text, thinking=thinking), text)


def project(segments: list[Segment], text: str) -> ParsedReply:
    """Segments -> the assistant message: reasoning and content joined with their outer newlines trimmed (the
    templates put newlines around tags) and None when blank, calls in order with ids stable for this text and unique
    within it."""
    reasoning = "".join(s.text for s in segments if s.kind == "reasoning")
    content = "".join(s.text for s in segments if s.kind in ("content", "bad_call"))
    calls = [s.call for s in segments if s.kind == "call" and s.call is not None]
    has_reasoning = any(s.kind == "reasoning" for s in segments)
    reasoning_out = reasoning.strip("\n") if has_reasoning else None
    content_out = content.strip("\n") if content.strip() else None
    message = ChatMessage(
        role="assistant",
        content=content_out,
        reasoning_content=reasoning_out or None,
        tool_calls=[ToolCall(id=call_id(text, i), function=c) for i, c in enumerate(calls)] or None,
    )
    bad = sum(1 for s in segments if s.kind == "bad_call")
    return ParsedReply(message=message, unparseable_tool_calls=bad, segments=segments)


def call_id(text: str, index: int) -> str:
    """``call_<digest of the reply>_<index>``: the same text always yields the same ids (a replayed sample keeps
    them), and two calls of one reply never share one."""
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=6).hexdigest()
    return f"call_{digest}_{index}"


def tool_call_from_json(body: str, arguments_keys: tuple[str, ...] = ("arguments",)) -> FunctionCall | None:
    """``{"name": str, "<arguments key>": object}`` (strict JSON, nothing trailing) -> a call; else None. The first
    of ``arguments_keys`` present holds the arguments; they may also be a JSON string holding an object (some models
    double-encode); none present means ``{}``."""
    try:
        data: Any = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    name = data.get("name")
    if not isinstance(name, str) or not name.strip():
        return None
    args: Any = next((data[key] for key in arguments_keys if key in data), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return FunctionCall(name=name, arguments=json.dumps(args, ensure_ascii=False))


def malformed_call_spans(segments: list[Segment], response_ids: list[int],
                         decode: Callable[[list[int]], str]) -> list[TokenSpan]:
    """The sampled tokens of each ``bad_call`` segment: the fewest tokens whose decoded text covers the block (a
    token straddling its edge belongs to it), found by bisecting decoded prefixes. The segments must cut
    ``decode(response_ids)``; where the decoded tokens do not show the block there (an engine's text that is not
    its tokens' decoding), the span is the whole reply: a trainer masks too much rather than too little."""
    lengths: dict[int, int] = {}

    def chars(k: int) -> int:
        if k not in lengths:
            lengths[k] = len(decode(response_ids[:k]))
        return lengths[k]

    n = len(response_ids)
    spans: list[TokenSpan] = []
    pos = 0
    for seg in segments:
        start, pos = pos, pos + len(seg.text)
        if seg.kind != "bad_call":
            continue
        first = max(bisect_right(range(n + 1), start, key=chars) - 1, 0)
        last = min(bisect_left(range(n + 1), pos, key=chars), n)
        shown = seg.text.strip() in decode(response_ids[first:last]) if last > first else False
        spans.append(TokenSpan(start=first, end=last) if shown else TokenSpan(start=0, end=n))
    return spans


def trailing_end_tokens(text: str, end_tokens: tuple[str, ...]) -> int:
    """Where the run of end-of-turn tokens (and whitespace between them) at the end of ``text`` starts."""
    cut = len(text)
    while True:
        body = text[:cut].rstrip()
        for token in end_tokens:
            if body.endswith(token):
                cut = len(body) - len(token)
                break
        else:
            return cut


def held_back(text: str, start: int, markers: tuple[str, ...], stops: tuple[str, ...] = ()) -> int:
    """Where the plain text of ``text[start:]`` surely ends: before the first of ``stops`` in it, and before a
    trailing piece that the next tokens may complete into one of ``markers`` (a stream holds that back)."""
    end = len(text)
    for stop in stops:
        at = text.find(stop, start)
        if 0 <= at < end:
            end = at
    for marker in markers:
        for size in range(min(len(marker) - 1, end - start), 0, -1):
            if text.endswith(marker[:size], start, end):
                end -= size
                break
    return max(end, start)


def parser_for(name: str) -> OutputParser:
    """The parser registered as ``name`` (or a ``pkg.module:Class`` path), instantiated."""
    target = PARSERS.get(name)
    if not (isinstance(target, type) and issubclass(target, OutputParser)):
        raise RegistryError(f"parser {name!r} is {target!r}, not an OutputParser subclass")
    return target()
