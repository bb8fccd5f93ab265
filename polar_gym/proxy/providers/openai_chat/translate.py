"""OpenAI Chat Completions <-> the normalized chat form. Pure: no I/O, no SDK imports.

The normalized form is Chat-shaped already, so this front end mostly validates, folds legacy fields
(``functions``, ``max_completion_tokens``, ``reasoning``) into their current names, and renders chunks.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeGuard

import orjson

from polar_gym.known_json import KNOWN
from polar_gym.proxy.chat import (
    ChatMessage,
    ChatRequest,
    ChatResult,
    ContentPart,
    FunctionCall,
    Tool,
    ToolCall,
    collapse_parts,
)
from polar_gym.proxy.errors import RequestError
from polar_gym.proxy.providers.base import Inbound, Provider, RenderContext, Route, SSEEvent, at_place, parse_model
from polar_gym.proxy.providers.openai_chat.protocol import KNOWN_IGNORED, ChatCompletionRequest, InMessage

__all__ = ["OpenAIChatProvider", "OpenAIChatRenderState", "content_parts", "tool_calls_in", "tools_in"]


def content_parts(content: str | list[dict[str, Any]] | None, where: str) -> str | list[ContentPart] | None:
    """Chat content (a string or typed parts) as normalized content; unknown part types are a 400."""
    if content is None or isinstance(content, str):
        return content
    parts: list[ContentPart] = []
    for i, part in enumerate(content):
        kind = part.get("type")
        if kind in ("text", "input_text", "output_text"):
            if not isinstance(part.get("text"), str):
                raise RequestError(f"{where}.content.{i}.text: must be a string")
            parts.append(ContentPart(type="text", text=part["text"]))
        elif kind == "image_url":
            image = part.get("image_url")
            image = {"url": image} if isinstance(image, str) else image
            if not isinstance(image, dict) or not isinstance(image.get("url"), str):
                raise RequestError(f"{where}.content.{i}.image_url: needs a url")
            parts.append(ContentPart(type="image_url", image_url=image))
        else:
            raise RequestError(f"{where}.content.{i}.type: unsupported content part type {kind!r}")
    return collapse_parts(parts)


def _named(spec: Any) -> TypeGuard[dict[str, Any]]:
    """A function spec or call with a name to call it by (an empty name calls no tool)."""
    return isinstance(spec, dict) and isinstance(spec.get("name"), str) and bool(spec["name"])


def tool_calls_in(calls: list[dict[str, Any]], where: str) -> list[ToolCall]:
    """An assistant's tool calls; a missing or empty id gets a positional one, arguments given as an object are
    sent on as their JSON. A call that names no function, or whose id or arguments have the wrong type, is a 400."""
    out = []
    for i, call in enumerate(calls):
        w = f"{where}.tool_calls.{i}"
        if call.get("type", "function") != "function":
            raise RequestError(f"{w}.type: only function tool calls are supported, got {call['type']!r}")
        fn = call.get("function")
        if not _named(fn):
            raise RequestError(f"{w}.function.name: required, a non-empty string")
        call_id = call.get("id") or f"call_{i}"
        if not isinstance(call_id, str):
            raise RequestError(f"{w}.id: must be a string")
        args = fn.get("arguments", "{}")
        if isinstance(args, dict):
            args = orjson.dumps(args).decode()
        elif not isinstance(args, str):
            raise RequestError(f"{w}.function.arguments: must be a JSON string or an object")
        out.append(ToolCall(id=call_id, function=FunctionCall(name=fn["name"], arguments=args)))
    return out


def tools_in(tools: list[dict[str, Any]] | None, functions: list[dict[str, Any]] | None) -> list[Tool] | None:
    """``tools`` (function tools only) and the legacy ``functions`` as function tools; a spec without a name is a
    400 naming its own field."""
    out = []
    for i, tool in enumerate(tools or []):
        spec = tool.get("function") if tool.get("type", "function") == "function" else None
        if not _named(spec):
            raise RequestError(f"tools.{i}.function.name: required, a non-empty string "
                               "(only function tools are supported)")
        out.append(Tool(function=spec))
    for i, spec in enumerate(functions or []):
        if not _named(spec):
            raise RequestError(f"functions.{i}.name: required, a non-empty string")
        out.append(Tool(function=spec))
    return out or None


def _message_in(msg: InMessage, i: int) -> ChatMessage:
    where = f"messages.{i}"
    if msg.role == "function":
        if not msg.name:
            raise RequestError(f"{where}.name: a function result needs the name of the function it answers")
        return ChatMessage(role="tool", content=content_parts(msg.content, where), tool_call_id=msg.name)
    calls = tool_calls_in(msg.tool_calls, where) if msg.tool_calls else None
    if msg.function_call and not calls:
        calls = tool_calls_in([{"id": f"call_{i}", "function": msg.function_call}], where)
    content = content_parts(msg.content, where)
    if msg.role == "tool" and isinstance(content, list):
        raise RequestError(f"{where}.content: tool results carry text only")
    return ChatMessage(
        role=msg.role,
        content=content,
        reasoning_content=msg.reasoning_content if msg.reasoning_content is not None else msg.reasoning,
        tool_calls=calls,
        tool_call_id=msg.tool_call_id,
        name=msg.name if msg.role in ("user", "system", "developer") else None,
    )


def _message_out(result: ChatResult) -> dict[str, Any]:
    msg = result.message
    out: dict[str, Any] = {"role": "assistant", "content": result.text if msg.content is not None else None}
    if msg.reasoning_content:
        out["reasoning_content"] = msg.reasoning_content
    if msg.tool_calls:
        out["tool_calls"] = [c.model_dump() for c in msg.tool_calls]
    return out


@dataclass(frozen=True)
class OpenAIChatRenderState:
    """What rendering an answer remembers of the request."""

    #: ``stream_options.include_usage``: a stream ends with a usage chunk
    include_usage: bool = False


class OpenAIChatProvider(Provider[OpenAIChatRenderState]):
    name = "openai_chat"
    conversation_field = "messages"
    id_prefix = "chatcmpl-"

    def parse(self, body: dict[str, Any], route: Route) -> Inbound[OpenAIChatRenderState]:
        req = parse_model(ChatCompletionRequest, body)
        extras = set(req.model_extra or ())
        stop = [req.stop] if isinstance(req.stop, str) else req.stop
        extra: dict[str, Any] = {}
        if req.chat_template_kwargs:
            extra["chat_template_kwargs"] = req.chat_template_kwargs
        chat = ChatRequest(
            model=req.model,
            # a session's earlier messages give the same ones every call: translated once, never changed after
            messages=[KNOWN.derive(m, ("openai_chat.message", i), at_place(_message_in, i=i))
                      for i, m in enumerate(req.messages)],
            tools=(tools_in(req.tools, req.functions) if req.functions else
                   KNOWN.derive(req.tools, "openai_chat.tools", lambda tools: tools_in(tools, None))),
            tool_choice=req.tool_choice,
            parallel_tool_calls=req.parallel_tool_calls,
            max_tokens=req.max_completion_tokens or req.max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            stop=stop or None,
            seed=req.seed,
            response_format=req.response_format,
            extra=extra,
        )
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        notes = []
        if req.reasoning_effort is not None:
            notes.append(f"reasoning_effort {req.reasoning_effort!r} not applied (the engine's template decides)")
        return Inbound(
            provider=self.name,
            model=req.model,
            stream=req.stream,
            chat=chat,
            normalizations=notes,
            ignored_fields=sorted(extras - KNOWN_IGNORED),
            render_state=OpenAIChatRenderState(include_usage),
        )

    def render(self, result: ChatResult, inbound: Inbound[OpenAIChatRenderState],
               ctx: RenderContext) -> dict[str, Any]:
        return {
            "id": ctx.response_id,
            "object": "chat.completion",
            "created": ctx.created,
            "model": inbound.model,
            "choices": [{"index": 0, "message": _message_out(result), "logprobs": None,
                         "finish_reason": result.finish_reason}],
            "usage": _usage(result),
        }

    def stream(self, result: ChatResult, inbound: Inbound[OpenAIChatRenderState],
               ctx: RenderContext) -> Iterator[SSEEvent]:
        include_usage = inbound.render_state.include_usage

        def chunk(delta: dict[str, Any], finish: str | None = None) -> SSEEvent:
            body: dict[str, Any] = {
                "id": ctx.response_id, "object": "chat.completion.chunk", "created": ctx.created,
                "model": inbound.model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
            }
            if include_usage:
                body["usage"] = None
            return SSEEvent(body)

        msg = result.message
        yield chunk({"role": "assistant", "content": ""})
        if msg.reasoning_content:
            yield chunk({"reasoning_content": msg.reasoning_content})
        if result.text:
            yield chunk({"content": result.text})
        for i, call in enumerate(msg.tool_calls or []):
            yield chunk({"tool_calls": [{"index": i, "id": call.id, "type": "function",
                                         "function": {"name": call.function.name, "arguments": ""}}]})
            yield chunk({"tool_calls": [{"index": i, "function": {"arguments": call.function.arguments}}]})
        yield chunk({}, result.finish_reason)
        if include_usage:
            yield SSEEvent({"id": ctx.response_id, "object": "chat.completion.chunk", "created": ctx.created,
                            "model": inbound.model, "choices": [], "usage": _usage(result)})
        yield SSEEvent("[DONE]")


def _usage(result: ChatResult) -> dict[str, int]:
    return {"prompt_tokens": result.usage.prompt_tokens, "completion_tokens": result.usage.completion_tokens,
            "total_tokens": result.usage.total_tokens}
