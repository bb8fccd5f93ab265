"""Messages SSE as the engine samples: ``message_start`` at once, a thinking block (when the request enabled
thinking) and a text block filled as their text comes, then the tool uses, ``message_delta`` and
``message_stop``. A thinking block is closed, with its signature, when the text starts: the parser only gives
content once the reasoning is whole."""

from __future__ import annotations

from polar_gym.proxy.chat import ChatResult
from polar_gym.proxy.providers.anthropic.translate import (
    _block_events,
    _event,
    _usage,
    content_blocks,
    stop_reason,
    thinking_signature,
)
from polar_gym.proxy.providers.base import SSEEvent
from polar_gym.proxy.providers.stream import StreamRenderer, rest

__all__ = ["MessagesStream"]


class MessagesStream(StreamRenderer):
    needs_prompt_tokens = True  # message_start's usage.input_tokens
    index = 0                  # the open block's index
    open_block: str | None = None

    def start(self, prompt_tokens: int) -> list[SSEEvent]:
        usage = {"input_tokens": prompt_tokens, "output_tokens": 0, "cache_creation_input_tokens": 0,
                 "cache_read_input_tokens": 0}
        return [_event("message_start", message={
            "id": self.ctx.response_id, "type": "message", "role": "assistant", "model": self.inbound.model,
            "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}), _event("ping")]

    def _close(self) -> list[SSEEvent]:
        events = []
        if self.open_block == "thinking":
            events.append(_event("content_block_delta", index=self.index, delta={
                "type": "signature_delta", "signature": thinking_signature(self.reasoning)}))
        if self.open_block is not None:
            events.append(_event("content_block_stop", index=self.index))
            self.index += 1
            self.open_block = None
        return events

    def delta(self, reasoning: str, content: str) -> list[SSEEvent]:
        events: list[SSEEvent] = []
        if reasoning and self.inbound.render_state.thinking:
            if self.open_block != "thinking":
                events.append(_event("content_block_start", index=self.index,
                                     content_block={"type": "thinking", "thinking": "", "signature": ""}))
                self.open_block = "thinking"
            events.append(_event("content_block_delta", index=self.index,
                                 delta={"type": "thinking_delta", "thinking": reasoning}))
        self.reasoning += reasoning
        if content:
            if self.open_block != "text":
                events += self._close()
                events.append(_event("content_block_start", index=self.index,
                                     content_block={"type": "text", "text": ""}))
                self.open_block = "text"
            events.append(_event("content_block_delta", index=self.index,
                                 delta={"type": "text_delta", "text": content}))
            self.content += content
        return events

    def finish(self, result: ChatResult) -> list[SSEEvent]:
        state = self.inbound.render_state
        blocks = content_blocks(result, state.thinking)
        events = self.delta(rest(result.message.reasoning_content, self.reasoning), rest(result.text, self.content))
        events += self._close()
        # blocks already streamed: the thinking block, and the text block once it had text
        skip = sum(1 for b in blocks if b["type"] == "thinking") + (1 if self.content else 0)
        for block in blocks[skip:]:
            events += _block_events(self.index, block)
            self.index += 1
        reason, sequence = stop_reason(result, state.stop_sequences)
        events.append(_event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                             usage={**_usage(result)}))
        events.append(_event("message_stop"))
        return events
