"""OpenAI Responses -> the normalized chat form. Pure: no I/O, no SDK imports.

A Responses conversation is a flat list of items; a chat is a list of messages. Consecutive assistant-side items
(reasoning, an assistant message, tool calls) fold into one assistant message, so the prompt renders exactly as the
engine's chat template rendered the turn it sampled. Reasoning comes back through ``encrypted_content`` that this
proxy minted itself (see ``protocol.encode_reasoning``), which keeps multi-turn prompts token-identical.

Tools map onto function tools: ``custom`` (freeform, e.g. codex's ``apply_patch``) becomes a function with one
string parameter ``input``; ``namespace`` tools are flattened to ``<namespace>__<name>`` (a name every chat API
accepts); ``local_shell`` becomes a function with an argv ``command``. ``ToolKinds`` (in the render state) remembers
the mapping so a reply renders back as the item type the harness offered. Hosted tools (web search, ...) are left
out with a note.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import pydantic

from polar_gym.known_json import KNOWN
from polar_gym.proxy.chat import ChatMessage, ChatRequest, ContentPart, FunctionCall, Tool, ToolCall, collapse_parts
from polar_gym.proxy.errors import RequestError, validation_message
from polar_gym.proxy.providers.base import Inbound, at_place, parse_model, translated_once
from polar_gym.proxy.providers.openai_responses.protocol import (
    HOSTED_TOOL_TYPES,
    KNOWN_IGNORED,
    SKIPPED_ITEM_TYPES,
    AdditionalToolsItem,
    CustomToolCallItem,
    CustomToolCallOutputItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    LocalShellCallItem,
    LocalShellCallOutputItem,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
    TextOptions,
    decode_reasoning,
)

__all__ = [
    "LOCAL_SHELL_PARAMETERS",
    "ResponsesRenderState",
    "ToolKinds",
    "custom_arguments",
    "flat_name",
    "items_in",
    "parse_request",
    "response_format_in",
    "tool_choice_in",
    "tools_in",
]

ENCRYPTED_INCLUDE = "reasoning.encrypted_content"
#: the argv form of OpenAI's local_shell action, as a function schema a chat model can fill
LOCAL_SHELL_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "command": {"type": "array", "items": {"type": "string"}, "description": "The command and its arguments"},
        "timeout_ms": {"type": "integer", "description": "Timeout in milliseconds"},
        "working_directory": {"type": "string", "description": "Directory to run the command in"},
    },
    "required": ["command"],
}
_LOCAL_SHELL_ACTION_KEYS = ("command", "timeout_ms", "working_directory", "env", "user")
_ITEM_MODELS: dict[str, type[pydantic.BaseModel]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "custom_tool_call": CustomToolCallItem,
    "custom_tool_call_output": CustomToolCallOutputItem,
    "local_shell_call": LocalShellCallItem,
    "local_shell_call_output": LocalShellCallOutputItem,
    "reasoning": ReasoningItem,
    "additional_tools": AdditionalToolsItem,
}


@dataclass
class ToolKinds:
    """Which normalized function names stand for non-function Responses tools."""

    custom: set[str] = field(default_factory=set)
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)
    local_shell: str | None = None

    def copy(self) -> ToolKinds:
        return ToolKinds(set(self.custom), dict(self.namespaced), self.local_shell)


@dataclass(frozen=True)
class ResponsesRenderState:
    """What rendering an answer remembers of the request."""

    #: a reasoning summary was asked for (the full reasoning text is the summary)
    summary: bool
    #: ``include`` asked for ``reasoning.encrypted_content``
    encrypted: bool
    tool_kinds: ToolKinds = field(default_factory=ToolKinds)
    #: request settings a Response object reports back
    echo: dict[str, Any] = field(default_factory=dict)


def flat_name(namespace: str | None, name: str) -> str:
    """One function name for a namespaced tool: ``mcp__srv__`` + ``read`` is ``mcp__srv__read``, ``crm`` + ``find``
    is ``crm__find`` (OpenAI-style names allow only letters, digits, ``_`` and ``-``)."""
    if not namespace:
        return name
    return namespace + name if namespace.endswith(("_", "-", ".", "/", ":")) else f"{namespace}__{name}"


def custom_arguments(text: str) -> str:
    """A freeform tool's input as the arguments of its function stand-in."""
    return json.dumps({"input": text}, ensure_ascii=False)


def _custom_function(spec: dict[str, Any], name: str) -> dict[str, Any]:
    about = "The raw input of this freeform tool"
    fmt = spec.get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
        about += f", written in this {fmt.get('syntax', 'grammar')} grammar:\n{fmt['definition']}"
    function: dict[str, Any] = {"name": name}
    if isinstance(spec.get("description"), str):
        function["description"] = spec["description"]
    function["parameters"] = {"type": "object", "properties": {"input": {"type": "string", "description": about}},
                              "required": ["input"], "additionalProperties": False}
    return function


def _function_tool(spec: dict[str, Any], where: str, namespace: str | None, kinds: ToolKinds) -> Tool:
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise RequestError(f"{where}.name: required")
    flat = flat_name(namespace, name)
    if namespace:
        kinds.namespaced[flat] = (namespace, name)
    if spec.get("type") == "custom":
        kinds.custom.add(flat)
        return Tool(function=_custom_function(spec, flat))
    function: dict[str, Any] = {"name": flat}
    for key in ("description", "parameters", "strict"):
        if spec.get(key) is not None:
            function[key] = spec[key]
    return Tool(function=function)


def tools_in(tools: list[dict[str, Any]] | None, kinds: ToolKinds, notes: list[str],
             where: str = "tools") -> list[Tool]:
    """Responses tools as chat function tools; ``kinds`` learns which names need rendering back as other items."""
    out: list[Tool] = []
    for i, spec in enumerate(tools or []):
        at = f"{where}.{i}"
        kind = spec.get("type") if isinstance(spec, dict) else None
        if kind in ("function", "custom"):
            out.append(_function_tool(spec, at, None, kinds))
        elif kind == "namespace":
            namespace = spec.get("name")
            if not isinstance(namespace, str) or not namespace:
                raise RequestError(f"{at}.name: required")
            for j, inner in enumerate(spec.get("tools") or []):
                if not isinstance(inner, dict) or inner.get("type") not in ("function", "custom"):
                    raise RequestError(f"{at}.tools.{j}.type: a namespace holds function or custom tools")
                out.append(_function_tool(inner, f"{at}.tools.{j}", namespace, kinds))
        elif kind == "local_shell":
            kinds.local_shell = "local_shell"
            out.append(Tool(function={"name": "local_shell", "description": "Run a command on the local machine",
                                      "parameters": LOCAL_SHELL_PARAMETERS}))
        elif kind in HOSTED_TOOL_TYPES:
            notes.append(f"{at}: built-in tool {kind!r} left out (no hosted tools behind this proxy)")
        else:
            raise RequestError(f"{at}.type: unsupported tool type {kind!r}")
    return out


def tool_choice_in(choice: str | dict[str, Any] | None, kinds: ToolKinds,
                   notes: list[str]) -> str | dict[str, Any] | None:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind in ("function", "custom") and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": flat_name(choice.get("namespace"), choice["name"])}}
        if kind == "allowed_tools" and choice.get("mode") in ("auto", "required"):
            notes.append("tool_choice: allowed_tools narrowed to its mode (every offered tool stays visible)")
            return str(choice["mode"])
        if kind in HOSTED_TOOL_TYPES:
            notes.append(f"tool_choice: built-in tool {kind!r} is not offered; using 'auto'")
            return "auto"
    raise RequestError(f"tool_choice: unsupported value {choice!r}")


def response_format_in(text: TextOptions | None) -> dict[str, Any] | None:
    """``text.format`` as a chat ``response_format``."""
    fmt = text.format if text else None
    if not fmt or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise RequestError("text.format.schema: required for json_schema")
        schema: dict[str, Any] = {"name": fmt.get("name") or "response", "schema": fmt["schema"]}
        for key in ("description", "strict"):
            if fmt.get(key) is not None:
                schema[key] = fmt[key]
        return {"type": "json_schema", "json_schema": schema}
    raise RequestError(f"text.format.type: unsupported {fmt.get('type')!r}")


def _content_in(content: str | list[dict[str, Any]], where: str) -> str | list[ContentPart]:
    """Message content: text parts join into a string; images stay parts; files and audio are refused."""
    if isinstance(content, str):
        return content
    parts: list[ContentPart] = []
    for i, part in enumerate(content):
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text", "refusal"):
            key = "refusal" if kind == "refusal" else "text"
            text = part.get(key)
            if not isinstance(text, str):
                raise RequestError(f"{where}.content.{i}.{key}: required for a {kind} part")
            parts.append(ContentPart(type="text", text=text))
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise RequestError(f"{where}.content.{i}.image_url: required (file_id images need a file store)")
            image = {"url": url}
            if part.get("detail"):
                image["detail"] = part["detail"]
            parts.append(ContentPart(type="image_url", image_url=image))
        else:
            raise RequestError(f"{where}.content.{i}.type: unsupported content part type {kind!r}")
    return collapse_parts(parts)


def _output_text(output: str | list[dict[str, Any]], where: str, notes: list[str]) -> str:
    """A tool result as text (chat tool messages carry text only); images in it are noted and dropped."""
    if isinstance(output, str):
        return output
    texts = []
    for i, part in enumerate(output):
        if part.get("type") in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            notes.append(f"{where}.output.{i}: {part.get('type')!r} part dropped (tool results carry text only)")
    return "\n".join(texts)


def _reasoning_in(item: ReasoningItem, where: str, notes: list[str]) -> str | None:
    """The reasoning text of an item: ours decodes exactly; else raw content; else the summary (noted)."""
    mine = decode_reasoning(item.encrypted_content)
    if mine is not None:
        return mine
    raw = [c["text"] for c in item.content or () if c.get("type") in ("reasoning_text", "text")
           and isinstance(c.get("text"), str)]
    if raw:
        return "".join(raw)
    summary = [s["text"] for s in item.summary if isinstance(s.get("text"), str)]
    if summary:
        notes.append(f"{where}: reasoning restored from its summary")
        return "\n\n".join(summary)
    if item.encrypted_content:
        notes.append(f"{where}: foreign encrypted reasoning cannot be read; dropped")
    return None


@dataclass
class _Turn:
    """The assistant-side items of one model turn (reasoning, then text, then calls): one chat message."""

    reasoning: str | None = None
    reasoning_at: str = ""
    text: str | None = None
    calls: list[ToolCall] = field(default_factory=list)

    def empty(self) -> bool:
        return self.reasoning is None and self.text is None and not self.calls

    def message(self) -> ChatMessage:
        return ChatMessage(role="assistant", content=self.text, reasoning_content=self.reasoning,
                           tool_calls=self.calls or None)


def _validate_item(raw: Any, where: str) -> pydantic.BaseModel | str:
    if not isinstance(raw, dict):
        raise RequestError(f"{where}: an input item must be an object")
    kind = raw.get("type", "message" if "role" in raw else None)
    if kind == "item_reference":
        raise RequestError(f"{where}: item_reference needs stored responses, which this stateless proxy does not "
                           "keep; send the full item instead")
    if kind in SKIPPED_ITEM_TYPES:
        return str(kind)
    model = _ITEM_MODELS.get(str(kind))
    if model is None:
        raise RequestError(f"{where}.type: unsupported input item type {kind!r}")
    try:
        return model.model_validate(raw)
    except pydantic.ValidationError as exc:
        raise RequestError(f"{where}." + validation_message(exc)) from exc


def _local_shell_arguments(action: dict[str, Any]) -> str:
    """The function stand-in's arguments for a local_shell action (empty env and nulls left out, as rendered)."""
    return json.dumps({k: action[k] for k in _LOCAL_SHELL_ACTION_KEYS if action.get(k) not in (None, {}, "")},
                      ensure_ascii=False)


class _Piece(NamedTuple):
    """What one input item gives on its own, before the turns are put together: its model (or the kind of a
    skipped item), the text of an assistant message, the message of a turn that stands alone (a user, system or
    developer message, a tool result), a call, reasoning; and the notes it gives. A session's earlier items give
    the same pieces on every call, so they are computed once (:meth:`polar_gym.known_json.KnownValues.derive`; a
    tuple, so its message is known in turn and dumped once too)."""

    item: Any
    text: str | None = None
    message: ChatMessage | None = None
    call: ToolCall | None = None
    reasoning: str | None = None
    notes: tuple[str, ...] = ()


def _piece(raw: Any, where: str) -> _Piece:
    item = _validate_item(raw, where)
    notes: list[str] = []
    if isinstance(item, str):
        return _Piece(item, notes=(f"{where}: {item} item left out (hosted-tool history this proxy cannot replay)",))
    if isinstance(item, MessageItem):
        content = _content_in(item.content, where)
        if item.role != "assistant":
            return _Piece(item, message=ChatMessage(role=item.role, content=content))
        if isinstance(content, str):
            return _Piece(item, text=content)
        # an assistant turn is text: an image in it has no place in the chat message
        notes += [f"{where}.content.{j}: {part.get('type')!r} part dropped (assistant messages carry text only)"
                  for j, part in enumerate(item.content) if isinstance(part, dict)
                  and part.get("type") not in ("input_text", "output_text", "text")]
        return _Piece(item, text="".join(p.text or "" for p in content), notes=tuple(notes))
    if isinstance(item, ReasoningItem):
        reasoning = _reasoning_in(item, where, notes)
        return _Piece(item, reasoning=reasoning, notes=tuple(notes))
    if isinstance(item, FunctionCallItem):
        args = item.arguments if isinstance(item.arguments, str) else json.dumps(item.arguments)
        return _Piece(item, call=ToolCall(id=item.call_id, function=FunctionCall(
            name=flat_name(item.namespace, item.name), arguments=args)))
    if isinstance(item, CustomToolCallItem):
        return _Piece(item, call=ToolCall(id=item.call_id, function=FunctionCall(
            name=flat_name(item.namespace, item.name), arguments=custom_arguments(item.input))))
    if isinstance(item, FunctionCallOutputItem | CustomToolCallOutputItem):
        message = ChatMessage(role="tool", tool_call_id=item.call_id, content=_output_text(item.output, where, notes))
        return _Piece(item, message=message, notes=tuple(notes))
    return _Piece(item)  # shell calls and their outputs, and added tools: read in context


def items_in(items: list[Any], kinds: ToolKinds, tools: list[Tool], notes: list[str]) -> list[ChatMessage]:
    """Input items as chat messages. ``tools`` receives tools carried by ``additional_tools`` items."""
    out: list[ChatMessage] = []
    turn = _Turn()
    shell_ids: dict[str, str] = {}

    def flush() -> None:
        nonlocal turn
        if turn.text is None and not turn.calls and turn.reasoning is not None:
            notes.append(f"{turn.reasoning_at}: reasoning with no message or call after it kept as an assistant "
                         "turn without text")
        if not turn.empty():
            out.append(turn.message())
        turn = _Turn()

    for i, raw in enumerate(items):
        where = f"input.{i}"
        piece = KNOWN.derive(raw, ("openai_responses.item", where), at_place(_piece, where=where))
        item = piece.item
        if isinstance(item, str):
            notes.extend(piece.notes)
        elif piece.message is not None:  # a turn of its own: a user, system or developer message, a tool result
            flush()
            notes.extend(piece.notes)
            out.append(piece.message)
        elif isinstance(item, MessageItem):  # the assistant's
            if turn.text is not None or turn.calls:
                flush()
            turn.text = piece.text
            notes.extend(piece.notes)
        elif isinstance(item, ReasoningItem):
            if turn.text is not None or turn.calls:
                flush()
            notes.extend(piece.notes)
            if piece.reasoning is not None and turn.reasoning is not None:
                notes.append(f"{where}: consecutive reasoning items joined into one turn")
                turn.reasoning += "\n\n" + piece.reasoning
            elif piece.reasoning is not None:
                turn.reasoning, turn.reasoning_at = piece.reasoning, where
        elif piece.call is not None:
            turn.calls.append(piece.call)
        elif isinstance(item, LocalShellCallItem):
            call_id = item.call_id or item.id or f"call_{i}"
            if item.id:
                shell_ids[item.id] = call_id
            turn.calls.append(ToolCall(id=call_id, function=FunctionCall(
                name="local_shell", arguments=_local_shell_arguments(item.action))))
        elif isinstance(item, LocalShellCallOutputItem):
            flush()
            out.append(ChatMessage(role="tool", tool_call_id=shell_ids.get(item.id, item.id), content=item.output))
        elif isinstance(item, AdditionalToolsItem):
            tools.extend(tools_in(item.tools, kinds, notes, where=f"{where}.tools"))
    flush()
    return out


def _refuse_stateful(req: ResponsesRequest) -> None:
    """Fields that need OpenAI's server-side state: a clear 400 beats a silently different conversation."""
    if req.previous_response_id:
        raise RequestError("previous_response_id: this proxy is stateless and keeps no responses; send the whole "
                           "conversation in input (store=false style)")
    if req.conversation:
        raise RequestError("conversation: this proxy is stateless and keeps no conversations; send the whole "
                           "conversation in input")
    if req.prompt:
        raise RequestError("prompt: stored prompt templates are not available behind this proxy")
    if req.background:
        raise RequestError("background: background responses need server-side storage; use stream or a plain call")


def _echo(req: ResponsesRequest, body: dict[str, Any]) -> dict[str, Any]:
    """Request settings a Response object reports back (the SDK and harnesses read some of them)."""
    reasoning = None
    if req.reasoning is not None:
        reasoning = {"effort": req.reasoning.effort, "summary": req.reasoning.summary or req.reasoning.generate_summary}
    return {
        "instructions": req.instructions,
        "tools": req.tools or [],
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "max_output_tokens": req.max_output_tokens,
        "text": {"format": {"type": "text"}, **(req.text.model_dump(exclude_none=True) if req.text else {})},
        "reasoning": reasoning,
        "metadata": body.get("metadata") or {},
        "store": bool(body.get("store", False)),
        "service_tier": body.get("service_tier") or "default",
        "truncation": body.get("truncation") or "disabled",
        "prompt_cache_key": body.get("prompt_cache_key"),
        "user": body.get("user"),
        "previous_response_id": None,
        "background": False,
    }


def _tools_and_kinds(tools: list[dict[str, Any]] | None, notes: list[str]) -> tuple[list[Tool], ToolKinds]:
    kinds = ToolKinds()
    return tools_in(tools, kinds, notes), kinds


def _system_message(instructions: str) -> ChatMessage:
    return ChatMessage(role="system", content=instructions)


def _unique_names(tools: list[Tool]) -> bool:
    names = [t.name for t in tools]
    return len(set(names)) == len(names)


def _check_unique_names(tools: list[Tool]) -> None:
    if not _unique_names(tools):
        raise RequestError(f"tools: tool names must be unique, got {sorted(t.name for t in tools)}")


def parse_request(body: dict[str, Any], provider: str = "openai_responses") -> Inbound[ResponsesRenderState]:
    """Validate a Responses request and translate it; raise RequestError with a field-addressed message."""
    req = parse_model(ResponsesRequest, body)
    _refuse_stateful(req)
    notes: list[str] = []
    shared, kinds = translated_once(req.tools, "openai_responses.tools", _tools_and_kinds, notes)
    tools, kinds = list(shared), kinds.copy()  # the items may add tools and kinds of their own
    n_shared = len(tools)
    messages: list[ChatMessage] = []
    if req.instructions:  # one message for a harness's repeated instructions, shared as its items' are
        messages.append(KNOWN.derive(req.instructions, "openai_responses.instructions", _system_message))
    items: list[Any] = [{"type": "message", "role": "user", "content": req.input}] if isinstance(
        req.input, str) else req.input
    messages += items_in(items, kinds, tools, notes)
    if not messages:
        raise RequestError("input: at least one item (or instructions) is required")
    if len(tools) != n_shared or not KNOWN.derive(shared, "openai_responses.unique-names", _unique_names):
        _check_unique_names(tools)  # raises: the shared list's answer is kept, a list the items added to is new
    if req.reasoning is not None and req.reasoning.effort is not None:
        notes.append(f"reasoning.effort {req.reasoning.effort!r} echoed, not applied (the engine's template decides)")
    extra: dict[str, Any] = {}
    if req.chat_template_kwargs:
        extra["chat_template_kwargs"] = req.chat_template_kwargs
    chat = ChatRequest(
        model=req.model,
        messages=messages,
        tools=(shared if len(tools) == len(shared) else tools) or None,  # the items added none: the shared list
        tool_choice=tool_choice_in(req.tool_choice, kinds, notes),
        parallel_tool_calls=req.parallel_tool_calls,
        max_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        response_format=response_format_in(req.text),
        extra=extra,
    )
    summary = req.reasoning is not None and (req.reasoning.summary or req.reasoning.generate_summary) is not None
    return Inbound(
        provider=provider,
        model=req.model,
        stream=req.stream,
        chat=chat,
        normalizations=notes,
        ignored_fields=sorted(set(req.model_extra or ()) - KNOWN_IGNORED),
        render_state=ResponsesRenderState(tool_kinds=kinds, summary=summary,
                                          encrypted=ENCRYPTED_INCLUDE in (req.include or ()), echo=_echo(req, body)),
    )
