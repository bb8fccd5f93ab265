"""Responses events as the engine samples: ``response.created`` / ``in_progress`` at once; the message item's text
deltas as the text comes. The reasoning item goes out whole just before the message starts (or at the end), so
every item is announced in ``output`` order; calls and ``response.completed`` follow at the end, with the final
``Response`` the non-streamed call answers."""

from __future__ import annotations

import itertools
from typing import Any

from polar_gym.proxy.chat import ChatMessage, ChatResult
from polar_gym.proxy.providers.base import SSEEvent
from polar_gym.proxy.providers.openai_responses.render import _item_events, output_items, response_body
from polar_gym.proxy.providers.stream import StreamRenderer, rest

__all__ = ["ResponsesStream"]


class ResponsesStream(StreamRenderer):
    _counter: itertools.count[int] | None = None
    items_sent = 0               # output items announced so far
    message_at: int | None = None  # the output index of the open message item

    def _emit(self, kind: str, **data: Any) -> SSEEvent:
        if self._counter is None:
            self._counter = itertools.count()
        return SSEEvent(event=kind, data={"type": kind, "sequence_number": next(self._counter), **data})

    def start(self, prompt_tokens: int) -> list[SSEEvent]:
        final = response_body(ChatResult(message=ChatMessage(role="assistant")), self.inbound, self.ctx)
        begun = {**final, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None,
                 "completed_at": None}
        return [self._emit("response.created", response=begun), self._emit("response.in_progress", response=begun)]

    def _reasoning_item(self, reasoning: str) -> list[SSEEvent]:
        if not reasoning:
            return []
        item = output_items(ChatResult(message=ChatMessage(role="assistant", reasoning_content=reasoning)),
                            self.inbound, self.ctx)[0]
        events = list(_item_events(item, self.items_sent, self._emit))
        self.items_sent += 1
        return events

    def delta(self, reasoning: str, content: str) -> list[SSEEvent]:
        self.reasoning += reasoning
        if not content:
            return []
        events: list[SSEEvent] = []
        if self.message_at is None:
            events += self._reasoning_item(self.reasoning)
            self.message_at = self.items_sent
            key = self.ctx.response_id.removeprefix("resp_")
            events.append(self._emit("response.output_item.added", output_index=self.message_at, item={
                "id": f"msg_{key}", "type": "message", "status": "in_progress", "role": "assistant", "content": []}))
            events.append(self._emit("response.content_part.added", item_id=f"msg_{key}", output_index=self.message_at,
                                     content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                            "logprobs": []}))
        self.content += content
        events.append(self._emit("response.output_text.delta", item_id=f"msg_{self.ctx.response_id[5:]}",
                                 output_index=self.message_at, content_index=0, delta=content, logprobs=[]))
        return events

    def finish(self, result: ChatResult) -> list[SSEEvent]:
        final = response_body(result, self.inbound, self.ctx)
        events: list[SSEEvent] = []
        more = rest(result.text, self.content)
        if more:
            events += self.delta(rest(result.message.reasoning_content, self.reasoning), more)
        for index, item in enumerate(final["output"]):  # without text, the reasoning item too
            if index < self.items_sent:
                continue
            if index == self.message_at:
                at = {"item_id": item["id"], "output_index": index}
                part = item["content"][0]
                events.append(self._emit("response.output_text.done", **at, content_index=0, text=part["text"],
                                         logprobs=[]))
                events.append(self._emit("response.content_part.done", **at, content_index=0, part=part))
                events.append(self._emit("response.output_item.done", output_index=index, item=item))
            else:
                events += _item_events(item, index, self._emit)
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        events.append(self._emit(kind, response=final))
        return events
