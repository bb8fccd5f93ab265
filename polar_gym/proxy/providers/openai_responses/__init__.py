"""OpenAI Responses front end (``POST /v1/responses``): the protocol codex speaks.

``translate`` parses a request into the normalized chat form, ``render`` turns a result into a ``Response`` and its
stream; this class only wires the two to the :class:`Provider` interface.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from polar_gym.proxy.chat import ChatResult
from polar_gym.proxy.errors import ProxyError, error_type
from polar_gym.proxy.providers.base import Inbound, Provider, RenderContext, Route, SSEEvent
from polar_gym.proxy.providers.openai_responses.render import response_body, stream_events
from polar_gym.proxy.providers.openai_responses.translate import ResponsesRenderState, parse_request

__all__ = ["OpenAIResponsesProvider"]


class OpenAIResponsesProvider(Provider[ResponsesRenderState]):
    name = "openai_responses"
    conversation_field = "input"
    id_prefix = "resp_"

    def parse(self, body: dict[str, Any], route: Route) -> Inbound[ResponsesRenderState]:
        return parse_request(body, self.name)

    def render(self, result: ChatResult, inbound: Inbound[ResponsesRenderState], ctx: RenderContext) -> dict[str, Any]:
        return response_body(result, inbound, ctx)

    def stream(self, result: ChatResult, inbound: Inbound[ResponsesRenderState],
               ctx: RenderContext) -> Iterator[SSEEvent]:
        return stream_events(result, inbound, ctx)

    def stream_error(self, exc: ProxyError) -> SSEEvent:
        """The Responses stream's own ``error`` event (not the error body of a failed call)."""
        return SSEEvent({"type": "error", "code": error_type(exc, self.error_style), "message": exc.message,
                         "param": None, "sequence_number": 0}, "error")
