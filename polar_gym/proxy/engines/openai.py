"""Any OpenAI-compatible server that cannot report token IDs: answers are recorded but marked not token-faithful,
so builders keep them out of training."""

from __future__ import annotations

from array import array
from typing import Any, ClassVar

from polar_gym.known_prompt_ids import PromptIds
from polar_gym.proxy.chat import ChatMessage, ChatRequest, ChatResult, FunctionCall, ToolCall, Usage
from polar_gym.proxy.engines.base import HttpEngine

__all__ = ["OpenAIEngine", "finish_reason_in", "message_from_openai", "token_ids_in", "usage_in"]

_FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls", "function_call": "tool_calls",
           "content_filter": "content_filter", "eos": "stop", "abort": "stop"}


def message_from_openai(msg: dict[str, Any]) -> ChatMessage:
    """The assistant message of an OpenAI-shaped choice (vLLM calls reasoning ``reasoning`` or
    ``reasoning_content`` depending on its version)."""
    calls = None
    if msg.get("tool_calls"):
        calls = []
        for i, call in enumerate(msg["tool_calls"]):
            fn = call["function"]
            args = fn.get("arguments")
            calls.append(ToolCall(id=call.get("id") or f"call_{i}",
                                  function=FunctionCall(name=fn["name"], arguments=args if args else "{}")))
    reasoning = msg.get("reasoning_content")
    if reasoning is None:
        reasoning = msg.get("reasoning")
    content = msg.get("content")
    if content is not None and not isinstance(content, str):
        raise ValueError("assistant content must be a string")
    return ChatMessage(role="assistant", content=content, reasoning_content=reasoning or None,
                       tool_calls=calls or None)


def finish_reason_in(choice: dict[str, Any], has_tool_calls: bool) -> Any:
    reason = _FINISH.get(str(choice.get("finish_reason") or "stop"), "stop")
    if has_tool_calls and reason == "stop":
        return "tool_calls"
    return reason


def usage_in(body: dict[str, Any], prompt_len: int, completion_len: int) -> Usage:
    usage = body.get("usage") or {}
    return Usage(prompt_tokens=int(usage.get("prompt_tokens", prompt_len)),
                 completion_tokens=int(usage.get("completion_tokens", completion_len)))


def token_ids_in(values: Any) -> list[int]:
    """Token IDs as a list of ints, each checked to fit a uint32 (what the journal packs them into). The check is
    ``array``'s, in C: half what pydantic's ``list[int]`` costs, so the result is built without validating them again
    (ChatResult does not validate them again), ~15 us a call at 2,000 prompt tokens and linear in the context."""
    if type(values) is PromptIds:
        return values  # checked as they were read
    if not isinstance(values, list):
        raise ValueError(f"token IDs must be a list, got {type(values).__name__}")
    try:
        array("I", values)
        return values
    except TypeError:
        pass  # not all ints (numbers written as floats or strings): converted, as validating a list[int] did
    except OverflowError as exc:
        raise ValueError(f"token IDs must be in 0..2**32-1: {exc}") from exc
    try:
        ints = [int(v) for v in values]
        array("I", ints)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"token IDs must be integers in 0..2**32-1: {exc}") from exc
    return ints


class OpenAIEngine(HttpEngine):
    name = "openai"
    token_faithful: ClassVar[bool] = False

    def build(self, request: ChatRequest) -> dict[str, Any]:
        return request.to_openai()

    def parse(self, body: dict[str, Any]) -> ChatResult:
        choice = body["choices"][0]
        message = message_from_openai(choice["message"])
        return ChatResult(message=message, finish_reason=finish_reason_in(choice, bool(message.tool_calls)),
                          usage=usage_in(body, 0, 0), token_faithful=False, engine=self.name)
