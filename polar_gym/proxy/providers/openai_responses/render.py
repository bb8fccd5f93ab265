"""The normalized chat result -> a Responses ``Response`` object and its exact stream grammar. Pure.

Output items are built once, in their final form; the stream is derived from them (an ``added`` form, the deltas,
the ``done`` events), so the streamed and the non-streamed answer can never disagree. There is no summarizer
behind this proxy: a requested reasoning summary is the full reasoning text, in one summary part.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from typing import Any

from polar_gym.proxy.chat import ChatResult, ToolCall
from polar_gym.proxy.providers.base import Inbound, RenderContext, SSEEvent
from polar_gym.proxy.providers.openai_responses.protocol import encode_reasoning
from polar_gym.proxy.providers.openai_responses.translate import ResponsesRenderState, ToolKinds

__all__ = ["output_items", "response_body", "stream_events"]

_Emit = Callable[..., SSEEvent]


def _custom_input(arguments: str) -> str:
    """A freeform tool's raw input from its function stand-in's arguments (the raw string if the model wrote
    something else)."""
    try:
        args = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(args, dict):
        if isinstance(args.get("input"), str):
            return str(args["input"])
        values = list(args.values())
        if len(values) == 1 and isinstance(values[0], str):
            return values[0]
    return arguments


def _shell_action(arguments: str) -> dict[str, Any] | None:
    """A local_shell action from the function stand-in's arguments, or None when they do not make one."""
    try:
        args = json.loads(arguments)
    except ValueError:
        return None
    if not isinstance(args, dict):
        return None
    command = args.get("command")
    if isinstance(command, str):
        command = ["bash", "-lc", command]
    if not isinstance(command, list) or not all(isinstance(c, str) for c in command):
        return None
    env = args.get("env")
    return {"type": "exec", "command": command, "env": env if isinstance(env, dict) else {},
            "timeout_ms": args.get("timeout_ms"), "working_directory": args.get("working_directory"),
            "user": args.get("user")}


def _call_item(call: ToolCall, kinds: ToolKinds, key: str) -> dict[str, Any]:
    name, arguments = call.function.name, call.function.arguments
    if kinds.local_shell is not None and name == kinds.local_shell:
        action = _shell_action(arguments)
        if action is not None:
            return {"id": f"lsh_{key}", "type": "local_shell_call", "call_id": call.id, "status": "completed",
                    "action": action}
    namespace, short = kinds.namespaced.get(name, (None, name))
    if name in kinds.custom:
        item: dict[str, Any] = {"id": f"ctc_{key}", "type": "custom_tool_call", "call_id": call.id, "name": short,
                                "input": _custom_input(arguments)}
    else:
        item = {"id": f"fc_{key}", "type": "function_call", "status": "completed", "call_id": call.id,
                "name": short, "arguments": arguments}
    if namespace is not None:
        item["namespace"] = namespace
    return item


def output_items(result: ChatResult, inbound: Inbound[ResponsesRenderState],
                 ctx: RenderContext) -> list[dict[str, Any]]:
    """The ``output`` list: reasoning, then the assistant message (unless the turn is only tool calls), then calls."""
    state = inbound.render_state
    kinds = state.tool_kinds
    key = ctx.response_id.removeprefix("resp_")
    msg = result.message
    items: list[dict[str, Any]] = []
    if msg.reasoning_content:
        reasoning: dict[str, Any] = {"id": f"rs_{key}", "type": "reasoning", "summary": []}
        if state.summary:
            reasoning["summary"] = [{"type": "summary_text", "text": msg.reasoning_content}]
        if state.encrypted:
            reasoning["encrypted_content"] = encode_reasoning(msg.reasoning_content)
        else:  # without our encrypted copy, the raw text is what lets the next request carry it back
            reasoning["content"] = [{"type": "reasoning_text", "text": msg.reasoning_content}]
        items.append(reasoning)
    text = result.text
    if text or not msg.tool_calls:
        status = "completed" if result.finish_reason in ("stop", "tool_calls") else "incomplete"
        items.append({"id": f"msg_{key}", "type": "message", "status": status, "role": "assistant",
                      "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]})
    for i, call in enumerate(msg.tool_calls or []):
        items.append(_call_item(call, kinds, f"{key}_{i}"))
    return items


def _usage(result: ChatResult) -> dict[str, Any]:
    return {
        "input_tokens": result.usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": result.usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": int(result.raw.get("reasoning_tokens", 0))},
        "total_tokens": result.usage.total_tokens,
    }


def response_body(result: ChatResult, inbound: Inbound[ResponsesRenderState], ctx: RenderContext) -> dict[str, Any]:
    """The complete ``Response`` object (also the payload of ``response.completed``)."""
    incomplete = {"length": "max_output_tokens", "content_filter": "content_filter"}.get(result.finish_reason)
    return {
        "id": ctx.response_id,
        "object": "response",
        "created_at": ctx.created,
        "status": "incomplete" if incomplete else "completed",
        "completed_at": None if incomplete else ctx.created,
        "error": None,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "model": inbound.model,
        "output": output_items(result, inbound, ctx),
        "usage": _usage(result),
        **inbound.render_state.echo,
    }


def _item_events(item: dict[str, Any], index: int, emit: _Emit) -> Iterator[SSEEvent]:
    """One output item: added, its parts and deltas (the whole text in one delta), done."""
    kind, item_id = item["type"], item["id"]
    at = {"item_id": item_id, "output_index": index}
    if kind == "reasoning":
        yield emit("response.output_item.added", output_index=index,
                   item={"id": item_id, "type": "reasoning", "summary": []})
        for s, part in enumerate(item["summary"]):
            yield emit("response.reasoning_summary_part.added", **at, summary_index=s,
                       part={"type": "summary_text", "text": ""})
            yield emit("response.reasoning_summary_text.delta", **at, summary_index=s, delta=part["text"])
            yield emit("response.reasoning_summary_text.done", **at, summary_index=s, text=part["text"])
            yield emit("response.reasoning_summary_part.done", **at, summary_index=s, part=part)
        for c, part in enumerate(item.get("content") or ()):
            yield emit("response.content_part.added", **at, content_index=c, part={**part, "text": ""})
            yield emit("response.reasoning_text.delta", **at, content_index=c, delta=part["text"])
            yield emit("response.reasoning_text.done", **at, content_index=c, text=part["text"])
            yield emit("response.content_part.done", **at, content_index=c, part=part)
    elif kind == "message":
        yield emit("response.output_item.added", output_index=index,
                   item={**item, "status": "in_progress", "content": []})
        for c, part in enumerate(item["content"]):
            yield emit("response.content_part.added", **at, content_index=c, part={**part, "text": ""})
            if part["text"]:
                yield emit("response.output_text.delta", **at, content_index=c, delta=part["text"], logprobs=[])
            yield emit("response.output_text.done", **at, content_index=c, text=part["text"], logprobs=[])
            yield emit("response.content_part.done", **at, content_index=c, part=part)
    elif kind == "function_call":
        yield emit("response.output_item.added", output_index=index,
                   item={**item, "arguments": "", "status": "in_progress"})
        if item["arguments"]:
            yield emit("response.function_call_arguments.delta", **at, delta=item["arguments"])
        yield emit("response.function_call_arguments.done", **at, arguments=item["arguments"])
    elif kind == "custom_tool_call":
        yield emit("response.output_item.added", output_index=index, item={**item, "input": ""})
        if item["input"]:
            yield emit("response.custom_tool_call_input.delta", **at, delta=item["input"])
        yield emit("response.custom_tool_call_input.done", **at, input=item["input"])
    else:  # local_shell_call: no deltas in its grammar
        yield emit("response.output_item.added", output_index=index, item={**item, "status": "in_progress"})
    yield emit("response.output_item.done", output_index=index, item=item)


def stream_events(result: ChatResult, inbound: Inbound[ResponsesRenderState],
                  ctx: RenderContext) -> Iterator[SSEEvent]:
    """created, in_progress, every item's events, then completed (or incomplete) with the full response;
    ``sequence_number`` counts up from 0 across the whole stream."""
    counter = itertools.count()

    def emit(kind: str, **data: Any) -> SSEEvent:
        return SSEEvent(event=kind, data={"type": kind, "sequence_number": next(counter), **data})

    final = response_body(result, inbound, ctx)
    start = {**final, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None,
             "completed_at": None}
    yield emit("response.created", response=start)
    yield emit("response.in_progress", response=start)
    for index, item in enumerate(final["output"]):
        yield from _item_events(item, index, emit)
    yield emit("response.completed" if final["status"] == "completed" else "response.incomplete", response=final)
