"""streamGenerateContent (``alt=sse``) as the engine samples: one chunk per piece of text (thought parts when the
request asked for thoughts), then a last chunk with the rest, the function calls, finishReason and usage. The
thought signature rides on the first function call, else on the last chunk's last part, as the synthesized
stream puts it."""

from __future__ import annotations

from typing import Any

from polar_gym.proxy.chat import ChatResult
from polar_gym.proxy.providers.base import SSEEvent
from polar_gym.proxy.providers.google.translate import _FINISH, response_parts, usage_metadata
from polar_gym.proxy.providers.stream import StreamRenderer, rest

__all__ = ["GenerateContentStream"]


class GenerateContentStream(StreamRenderer):
    def _chunk(self, parts: list[dict[str, Any]]) -> dict[str, Any]:
        return {"candidates": [{"content": {"role": "model", "parts": parts}, "index": 0}],
                "modelVersion": self.inbound.model, "responseId": self.ctx.response_id}

    def start(self, prompt_tokens: int) -> list[SSEEvent]:
        return []  # Gemini's first chunk already carries parts: nothing to open

    def _parts(self, reasoning: str, content: str) -> list[dict[str, Any]]:
        parts: list[dict[str, Any]] = []
        if reasoning and self.inbound.render_state.include_thoughts:
            parts.append({"text": reasoning, "thought": True})
        if content:
            parts.append({"text": content})
        self.reasoning += reasoning
        self.content += content
        return parts

    def delta(self, reasoning: str, content: str) -> list[SSEEvent]:
        parts = self._parts(reasoning, content)
        return [SSEEvent(self._chunk(parts))] if parts else []

    def finish(self, result: ChatResult) -> list[SSEEvent]:
        state = self.inbound.render_state
        parts = self._parts(rest(result.message.reasoning_content, self.reasoning), rest(result.text, self.content))
        groups = response_parts(result, state.include_thoughts, state.call_ids)
        calls = [part for group in groups for part in group if "functionCall" in part]
        parts += calls
        if not parts:
            parts.append({"text": ""})
        if result.message.reasoning_content and not calls:
            parts[-1]["thoughtSignature"] = groups[-1][-1]["thoughtSignature"]
        chunk = self._chunk(parts)
        chunk["candidates"][0]["finishReason"] = _FINISH[result.finish_reason]
        chunk["usageMetadata"] = usage_metadata(result)
        return [SSEEvent(chunk)]
