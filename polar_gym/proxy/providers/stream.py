"""Streams rendered as the engine samples (pass-through): a :class:`StreamRenderer` per provider turns the
stream's pieces into the provider's events. Pure, like the synthesized streams.

The pieces come in order: ``start`` when the engine's first chunk arrives, ``delta`` with text the output parser can
already tell is plain reasoning or content (each a prefix of the final message's, content only once the reasoning
is whole), then ``finish`` with the whole result: it sends what was held back (the rest of the text, tool calls)
and ends the stream, so what the client assembles is exactly the non-streamed answer.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

from polar_gym.proxy.chat import ChatResult
from polar_gym.proxy.providers.base import Inbound, Provider, RenderContext, SSEEvent

__all__ = ["StreamRenderer", "SynthesizedStream", "rest"]


def rest(final: str | None, sent: str) -> str:
    """What ``final`` adds to the ``sent`` prefix of it (all of it when it does not start with ``sent``, which a
    parser keeping its contract never causes)."""
    final = final or ""
    return final[len(sent):] if final.startswith(sent) else final


class StreamRenderer(abc.ABC):
    """One streamed answer's events, piece by piece; it keeps what it already sent."""

    #: whether ``start`` says how long the prompt is (Anthropic's message_start): the stream then opens only once
    #: the prompt's IDs are known
    needs_prompt_tokens: ClassVar[bool] = False

    def __init__(self, inbound: Inbound[Any], ctx: RenderContext) -> None:
        self.inbound = inbound
        self.ctx = ctx
        self.reasoning = ""  # reasoning sent so far
        self.content = ""    # content sent so far

    @abc.abstractmethod
    def start(self, prompt_tokens: int) -> list[SSEEvent]:
        """The events that open the answer (the engine has started sampling)."""

    @abc.abstractmethod
    def delta(self, reasoning: str, content: str) -> list[SSEEvent]:
        """Events for more plain reasoning and content."""

    @abc.abstractmethod
    def finish(self, result: ChatResult) -> list[SSEEvent]:
        """The rest of ``result`` and the end of the stream."""


class SynthesizedStream(StreamRenderer):
    """A provider without a pass-through renderer: nothing until the end, then its synthesized stream."""

    def __init__(self, provider: Provider[Any], inbound: Inbound[Any], ctx: RenderContext) -> None:
        super().__init__(inbound, ctx)
        self.provider = provider

    def start(self, prompt_tokens: int) -> list[SSEEvent]:
        return []

    def delta(self, reasoning: str, content: str) -> list[SSEEvent]:
        return []

    def finish(self, result: ChatResult) -> list[SSEEvent]:
        return list(self.provider.stream(result, self.inbound, self.ctx))
