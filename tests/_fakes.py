"""Working fakes for the unit tier. Faked edges:

- ``ByteTokenizer``: a round-tripping tokenizer (one token per UTF-8 byte, special tokens above 255) with a
  Qwen-like chat template, standing in for the real Qwen tokenizer where only token plumbing is under test.
- ``FakeVLLM``: a recording upstream speaking vLLM's chat API with ``return_token_ids``, served through
  ``httpx.MockTransport`` (no sockets).
- ``disk_full``: the journal's file append on a full disk (patched over ``polar_gym.proxy.capture._append``).
"""

from __future__ import annotations

import errno
import json
import os
import re
from collections.abc import Callable
from typing import Any

import httpx

__all__ = ["ByteTokenizer", "FakeVLLM", "disk_full"]

_SPECIAL = {"<|im_start|>": 256, "<|im_end|>": 257, "<|endoftext|>": 258}
_SPLIT = re.compile("(" + "|".join(re.escape(s) for s in _SPECIAL) + ")")


class ByteTokenizer:
    end_of_turn_ids = [257, 258]

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in _SPLIT.split(text):
            if piece in _SPECIAL:
                ids.append(_SPECIAL[piece])
            elif piece:
                ids.extend(piece.encode())
        return ids

    def decode(self, ids: list[int]) -> str:
        inverse = {v: k for k, v in _SPECIAL.items()}
        out, buf = [], bytearray()
        for t in ids:
            if t in inverse:
                out.append(buf.decode(errors="replace"))
                buf = bytearray()
                out.append(inverse[t])
            else:
                buf.append(t)
        out.append(buf.decode(errors="replace"))
        return "".join(out)

    end_of_turn_text = "<|im_end|>"

    def render_text(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, *,
                    add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None) -> str:
        text = ""
        if tools:
            text += "<|im_start|>system\n# Tools\n" + json.dumps(tools, sort_keys=True) + "<|im_end|>\n"
        for m in messages:
            body = m.get("content") or ""
            if m["role"] == "assistant":
                # Rendered like Qwen3's template renders a reply, so an oracle reply re-appears token for token.
                if m.get("reasoning_content"):
                    body = f"<think>\n{m['reasoning_content']}\n</think>\n\n{body}"
                for i, call in enumerate(m.get("tool_calls") or []):
                    fn = call["function"]
                    payload = json.dumps({"name": fn["name"], "arguments": fn["arguments"]}, ensure_ascii=False)
                    newline = "\n" if (i == 0 and m.get("content")) or i > 0 else ""
                    body += f"{newline}<tool_call>\n{payload}\n</tool_call>"
            text += f"<|im_start|>{m['role']}\n{body}<|im_end|>\n"
        return text + "<|im_start|>assistant\n" if add_generation_prompt else text

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
        return self.encode(self.render_text(messages, tools))


class FakeVLLM:
    """Answers like vLLM with ``return_token_ids``; records every body it receives."""

    def __init__(self, reply: str = "hello", *, tool_call: dict[str, Any] | None = None,
                 status: int = 200, garbage: bytes | None = None) -> None:
        self.tokenizer = ByteTokenizer()
        self.reply = reply
        self.tool_call = tool_call
        self.status = status
        self.garbage = garbage
        self.requests: list[dict[str, Any]] = []

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        prompt_ids = self.tokenizer.render(body["messages"], body.get("tools"))
        token_ids = self.tokenizer.encode(self.reply) + [257]
        message: dict[str, Any] = {"role": "assistant", "content": self.reply, "reasoning_content": None}
        finish = "stop"
        if self.tool_call is not None:
            message["tool_calls"] = [{"id": "call_1", "type": "function", "function": self.tool_call}]
            finish = "tool_calls"
        return {
            "id": "chatcmpl-fake", "object": "chat.completion", "created": 0, "model": body["model"],
            "prompt_token_ids": prompt_ids,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "token_ids": token_ids,
                         "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": -0.5 - i / 100,
                                                   "bytes": None, "top_logprobs": []}
                                                  for i, t in enumerate(token_ids)]}}],
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(token_ids),
                      "total_tokens": len(prompt_ids) + len(token_ids)},
        }

    def handler(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.requests.append(body)
        if self.garbage is not None:
            return httpx.Response(self.status, content=self.garbage)
        if self.status >= 400:
            return httpx.Response(self.status, json={"error": {"message": "engine failure"}})
        return httpx.Response(200, json=self.answer(body))

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handler)


def disk_full(torn: int = 0) -> Callable[[Any, Any, bool], None]:
    """A stand-in for the journal's ``_append(fds, payloads, fsync)`` on a full disk: it writes the first ``torn``
    bytes of the token payload (a torn write), then fails as ENOSPC does."""
    def append(fds: Any, payloads: Any, fsync: bool) -> None:
        if torn:
            os.write(fds[0], payloads[0][:torn])
        raise OSError(errno.ENOSPC, "No space left on device")

    return append
