"""Chat Completions chunks as the engine samples: a role chunk, reasoning and content deltas, then the tool calls,
the finish chunk, usage (when asked) and ``[DONE]``, as the synthesized stream ends."""

from __future__ import annotations

from typing import Any

from polar_gym.proxy.chat import ChatResult
from polar_gym.proxy.providers.base import SSEEvent
from polar_gym.proxy.providers.openai_chat.translate import _usage
from polar_gym.proxy.providers.stream import StreamRenderer, rest

__all__ = ["ChatStream"]


class ChatStream(StreamRenderer):
    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> SSEEvent:
        body: dict[str, Any] = {
            "id": self.ctx.response_id, "object": "chat.completion.chunk", "created": self.ctx.created,
            "model": self.inbound.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        if self.inbound.render_state.include_usage:
            body["usage"] = None
        return SSEEvent(body)

    def start(self, prompt_tokens: int) -> list[SSEEvent]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def delta(self, reasoning: str, content: str) -> list[SSEEvent]:
        events = []
        if reasoning:
            self.reasoning += reasoning
            events.append(self._chunk({"reasoning_content": reasoning}))
        if content:
            self.content += content
            events.append(self._chunk({"content": content}))
        return events

    def finish(self, result: ChatResult) -> list[SSEEvent]:
        events = self.delta(rest(result.message.reasoning_content, self.reasoning), rest(result.text, self.content))
        for i, call in enumerate(result.message.tool_calls or []):
            events.append(self._chunk({"tool_calls": [{"index": i, "id": call.id, "type": "function",
                                                       "function": {"name": call.function.name, "arguments": ""}}]}))
            arguments = {"arguments": call.function.arguments}
            events.append(self._chunk({"tool_calls": [{"index": i, "function": arguments}]}))
        events.append(self._chunk({}, result.finish_reason))
        if self.inbound.render_state.include_usage:
            events.append(SSEEvent({"id": self.ctx.response_id, "object": "chat.completion.chunk",
                                    "created": self.ctx.created, "model": self.inbound.model, "choices": [],
                                    "usage": _usage(result)}))
        events.append(SSEEvent("[DONE]"))
        return events
