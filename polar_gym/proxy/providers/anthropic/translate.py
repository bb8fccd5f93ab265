"""Anthropic Messages <-> the normalized chat form. Pure: no I/O, no SDK imports.

Requests: content blocks become Chat messages (``tool_result`` blocks turn into ``role=tool`` messages, in block
order, ahead of the rest of their user turn; ``thinking`` becomes ``reasoning_content``; ``tool_use`` becomes
``tool_calls``). ``cache_control`` is ignored everywhere. Two decisions worth knowing:

- Tools. Custom tools become function tools. Anthropic's client-executed tools ``bash_*`` and ``text_editor_*``
  become function tools with the documented input schema, since the harness runs them like any other tool. Server
  tools (web search / fetch, code execution, tool search, computer and memory) are skipped with a normalization note:
  nothing here can run them, and a model offered a tool it cannot get results for only goes astray.
- Claude Code puts a billing line (``x-anthropic-billing-header: cc_version=...; cch=...;``) at the head of its system
  prompt whose values change on every request; it is removed, or no two calls of a session would share a prefix.
  Claude Code's in-``messages`` system turns (``<total_tokens>`` reminders and the like) are kept in place: they are
  append-only, so they do not break prefixes, and hoisting them into the system prompt would.

Responses: tool-use ids are derived from the engine's call ids (``toolu_01`` + 22 base62 characters of a hash), and
thinking signatures are an opaque hash of the thinking text, so rendering is deterministic; any signature is accepted
back.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

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
from polar_gym.proxy.errors import ProxyError, RequestError, error_body
from polar_gym.proxy.providers.anthropic.protocol import KNOWN_IGNORED, InMessage, MessagesRequest
from polar_gym.proxy.providers.base import (
    Inbound,
    Provider,
    RenderContext,
    Route,
    SSEEvent,
    at_place,
    parse_model,
    translated_once,
)

__all__ = [
    "BILLING_NOTE",
    "AnthropicProvider",
    "AnthropicRenderState",
    "content_blocks",
    "messages_in",
    "stop_reason",
    "strip_billing_lines",
    "system_in",
    "thinking_signature",
    "tool_input",
    "tool_use_id",
    "tools_in",
]

BILLING_NOTE = "removed Claude Code's per-request billing line (x-anthropic-billing-header) from the system prompt"
_BILLING_LINE = re.compile(r"^[ \t]*x-anthropic-billing-header:[^\n]*(?:\n|$)", re.MULTILINE | re.IGNORECASE)
_BASE62 = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use", "content_filter": "refusal"}

# Input schemas of Anthropic's client-executed tools, which the real API supplies itself.
_BASH_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "command": {"type": "string", "description": "The bash command to run."},
        "restart": {"type": "boolean", "description": "Restart the bash session instead of running a command."},
    },
}
_EDITOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "command": {"type": "string", "enum": ["view", "create", "str_replace", "insert", "undo_edit"]},
        "path": {"type": "string", "description": "Absolute path of the file or directory."},
        "file_text": {"type": "string", "description": "Content of the file to create."},
        "old_str": {"type": "string", "description": "Exact text to replace."},
        "new_str": {"type": "string", "description": "Replacement text (or, for older versions, text to insert)."},
        "insert_line": {"type": "integer", "description": "Line after which to insert."},
        "insert_text": {"type": "string", "description": "Text to insert."},
        "view_range": {"type": "array", "items": {"type": "integer"}, "description": "[start, end] lines to view."},
    },
    "required": ["command", "path"],
}
_CLIENT_TOOLS = {
    "bash_": ("Run a command in a persistent bash shell.", _BASH_SCHEMA),
    "text_editor_": ("View, create and edit files.", _EDITOR_SCHEMA),
}


# ---------------------------------------------------------------------------------------------------------- system


def _has_header_marker(text: str) -> bool:
    """Whether ``-header:`` is in ``text.lower()``, without lower-casing all of it (15 us on Claude Code's 6 KB
    in-conversation system turn, on every call): only ``H``, ``E``, ``A``, ``D`` and ``R`` lower-case to those
    letters (a case-blind match takes non-ASCII characters only for i, k and s), so a match starts at ``-h`` or
    ``-H``, and those are few."""
    for dash in ("-h", "-H"):
        at = text.find(dash)
        while at >= 0:
            if text[at + 1:at + 8].lower() == "header:":
                return True
            at = text.find(dash, at + 2)
    return False


def strip_billing_lines(text: str) -> tuple[str, int]:
    """``text`` without Claude Code's billing lines, and how many were removed. The case-blind scan is skipped when
    ``-header:`` is nowhere in the lower-cased text (:func:`_has_header_marker`): ~5x cheaper on a 27 KB system
    prompt."""
    if not _has_header_marker(text):
        return text, 0
    return _BILLING_LINE.subn("", text)


def _clean(texts: list[str], notes: list[str]) -> list[str]:
    out, removed = [], 0
    for text in texts:
        cleaned, n = strip_billing_lines(text)
        removed += n
        if n and not cleaned.strip():
            continue
        out.append(cleaned)
    if removed and BILLING_NOTE not in notes:
        notes.append(BILLING_NOTE)
    return out


def _text_blocks(value: str | list[dict[str, Any]], where: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    texts = []
    for i, block in enumerate(value):
        _require_object(block, f"{where}.{i}")
        if block.get("type") != "text":
            raise RequestError(f"{where}.{i}.type: only text blocks are allowed here, got {block.get('type')!r}")
        texts.append(_text(block, f"{where}.{i}"))
    return texts


def system_in(system: str | list[dict[str, Any]] | None, notes: list[str]) -> str | None:
    """The system prompt as one string, billing lines removed. Blocks are concatenated as they are: Claude Code
    writes its own separators into them (a block opening with a newline), as it does in user turns."""
    if system is None:
        return None
    texts = _clean(_text_blocks(system, "system"), notes)
    return "".join(texts) if texts else None


# ---------------------------------------------------------------------------------------------------------- blocks


def _system_message_in(system: str | list[dict[str, Any]] | None, notes: list[str]) -> ChatMessage | None:
    """The system prompt as the first Chat message (one for a harness's repeated system prompt, shared by its
    calls: nothing changes it)."""
    text = system_in(system, notes)
    return None if text is None else ChatMessage(role="system", content=text)


def _require_object(block: Any, where: str) -> None:
    if not isinstance(block, dict):
        raise RequestError(f"{where}: a content block must be an object, got {type(block).__name__}")


def _text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise RequestError(f"{where}.text: must be a string")
    return text


def _image(block: dict[str, Any], where: str) -> ContentPart:
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source, dict):
        data, media_type = source.get("data"), source.get("media_type")
        if not (isinstance(data, str) and data and isinstance(media_type, str) and media_type):
            raise RequestError(f"{where}.source: a base64 source needs media_type and data")
        return ContentPart(type="image_url", image_url={"url": f"data:{media_type};base64,{data}"})
    if kind == "url" and isinstance(source, dict):
        if not isinstance(source.get("url"), str) or not source["url"]:
            raise RequestError(f"{where}.source.url: must be a string (the image's address)")
        return ContentPart(type="image_url", image_url={"url": source["url"]})
    raise RequestError(f"{where}.source.type: unsupported image source {kind!r} (base64 and url are supported)")


def _document(block: dict[str, Any], where: str) -> str:
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "text" and isinstance(source, dict) and isinstance(source.get("data"), str):
        body = source["data"]
    elif kind == "content" and isinstance(source, dict) and isinstance(source.get("content"), str | list):
        body = "".join(_text_blocks(source["content"], f"{where}.source.content"))
    else:
        raise RequestError(f"{where}.source.type: {kind!r} documents are not supported (the policy reads text: "
                           "send a plain-text or content source)")
    head = [v for v in (block.get("title"), block.get("context")) if isinstance(v, str) and v]
    return "\n\n".join([*head, body]) + "\n\n"  # blocks concatenate: end with a separator of its own


def _search_result(block: dict[str, Any], where: str) -> str:
    content = block.get("content")
    if not isinstance(content, list):
        raise RequestError(f"{where}.content: must be a list of text blocks")
    head = "\n".join(v for v in (block.get("title"), block.get("source")) if isinstance(v, str) and v)
    return "\n\n".join(t for t in [head, "".join(_text_blocks(content, f"{where}.content"))] if t) + "\n\n"


def _part(block: dict[str, Any], where: str) -> ContentPart:
    """One user-side content block (text, image, document, search_result) as a content part."""
    _require_object(block, where)
    kind = block.get("type")
    if kind == "text":
        return ContentPart(type="text", text=_text(block, where))
    if kind == "image":
        return _image(block, where)
    if kind == "document":
        return ContentPart(type="text", text=_document(block, where))
    if kind == "search_result":
        return ContentPart(type="text", text=_search_result(block, where))
    if kind in ("tool_use", "thinking", "redacted_thinking"):
        raise RequestError(f"{where}.type: {kind!r} blocks belong in assistant messages")
    raise RequestError(f"{where}.type: unsupported content block type {kind!r}")


def _content(parts: list[ContentPart]) -> str | list[ContentPart]:
    """Adjacent text parts concatenated (Chat semantics; harnesses put separators in the blocks themselves); a plain
    string when there is no image."""
    merged: list[ContentPart] = []
    for part in parts:
        if part.type == "text" and merged and merged[-1].type == "text":
            merged[-1] = ContentPart(type="text", text=f"{merged[-1].text}{part.text}")
        else:
            merged.append(part)
    return collapse_parts(merged)


def _tool_result(block: dict[str, Any], where: str) -> ChatMessage:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise RequestError(f"{where}.tool_use_id: required")
    raw = block.get("content", "")
    if isinstance(raw, str):
        content: str | list[ContentPart] = raw
    elif isinstance(raw, list):
        content = _content([_part(b, f"{where}.content.{k}") for k, b in enumerate(raw)])
    else:
        raise RequestError(f"{where}.content: must be a string or a list of content blocks")
    if block.get("is_error") and content == "":
        content = "Error"  # an empty failure would read as success
    return ChatMessage(role="tool", content=content, tool_call_id=call_id)


def _user(blocks: list[dict[str, Any]], where: str) -> list[ChatMessage]:
    results = [_tool_result(b, f"{where}.{j}") for j, b in enumerate(blocks) if b.get("type") == "tool_result"]
    parts = [_part(b, f"{where}.{j}") for j, b in enumerate(blocks) if b.get("type") != "tool_result"]
    if parts or not results:
        results.append(ChatMessage(role="user", content=_content(parts)))
    return results


def _assistant(blocks: list[dict[str, Any]], where: str, notes: list[str]) -> ChatMessage:
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[ToolCall] = []
    for j, block in enumerate(blocks):
        w, kind = f"{where}.{j}", block.get("type")
        if kind == "text":
            texts.append(_text(block, w))
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise RequestError(f"{w}.thinking: must be a string")
            thoughts.append(block["thinking"])  # any signature is accepted: it only protects Anthropic's own text
        elif kind == "redacted_thinking":
            note = "dropped redacted_thinking blocks (encrypted, no text to show the policy)"
            if note not in notes:
                notes.append(note)
        elif kind == "tool_use":
            for key in ("id", "name"):  # an empty one would pair no tool_result / call no tool
                if not isinstance(block.get(key), str) or not block[key]:
                    raise RequestError(f"{w}.{key}: tool_use needs a non-empty string {key}")
            if not isinstance(block.get("input", {}), dict):
                raise RequestError(f"{w}.input: must be an object")
            calls.append(ToolCall(id=block["id"], function=FunctionCall(
                name=block["name"], arguments=json.dumps(block.get("input") or {}, ensure_ascii=False))))
        elif isinstance(kind, str) and (kind == "server_tool_use" or kind.endswith("_tool_result")):
            raise RequestError(f"{w}.type: {kind!r}: server tools are not supported by this gateway")
        else:
            raise RequestError(f"{w}.type: unsupported assistant content block type {kind!r}")
    return ChatMessage(role="assistant", content="".join(texts) if texts or not calls else None,
                       reasoning_content="\n\n".join(thoughts) if thoughts else None, tool_calls=calls or None)


def _message_in(msg: InMessage, i: int) -> tuple[list[ChatMessage], list[str]]:
    """One Anthropic turn's Chat messages and notes. A session's earlier turns give the same ones on every call, so
    they are translated once (:meth:`polar_gym.known_json.KnownValues.derive`); nothing changes them after."""
    where = f"messages.{i}.content"
    notes: list[str] = []
    if msg.role == "system":
        texts = _clean(_text_blocks(msg.content, where), notes)
        return ([ChatMessage(role="system", content="".join(texts))] if texts else []), notes
    blocks = [{"type": "text", "text": msg.content}] if isinstance(msg.content, str) else msg.content
    if msg.role == "user":
        return _user(blocks, where), notes
    return [_assistant(blocks, where, notes)], notes


def messages_in(messages: list[InMessage], notes: list[str]) -> list[ChatMessage]:
    """Anthropic turns as Chat messages (one turn can become several: its tool results, then its text)."""
    out: list[ChatMessage] = []
    for i, msg in enumerate(messages):
        translated, own = KNOWN.derive(msg, ("anthropic.message", i), at_place(_message_in, i=i))
        out.extend(translated)
        notes.extend(note for note in own if note not in notes)  # each note is given once
    if messages[-1].role == "assistant":
        notes.append("the final assistant message (a prefill) is sent as a complete turn, not continued")
    return out


# ----------------------------------------------------------------------------------------------------------- tools


def tools_in(tools: list[dict[str, Any]] | None, notes: list[str]) -> list[Tool] | None:
    """Custom tools and client-executed Anthropic tools as function tools; server tools skipped (see module doc)."""
    out: list[Tool] = []
    for i, tool in enumerate(tools or []):
        kind, name = tool.get("type"), tool.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError(f"tools.{i}.name: required")
        if kind in (None, "custom"):
            schema = tool.get("input_schema")
            if not isinstance(schema, dict):
                raise RequestError(f"tools.{i}.input_schema: required (a JSON schema object)")
            spec: dict[str, Any] = {"name": name, "parameters": schema}
            if isinstance(tool.get("description"), str):
                spec["description"] = tool["description"]
            out.append(Tool(function=spec))
            continue
        prefix = next((p for p in _CLIENT_TOOLS if str(kind).startswith(p)), None)
        if prefix is None:
            notes.append(f"skipped server tool {name!r} ({kind}): the gateway cannot run Anthropic server tools")
            continue
        description, schema = _CLIENT_TOOLS[prefix]
        out.append(Tool(function={"name": name, "description": description, "parameters": schema}))
        notes.append(f"mapped Anthropic tool {name!r} ({kind}) to a function tool with its documented input schema")
    return out or None


# --------------------------------------------------------------------------------------------------------- request


def _translate(req: MessagesRequest, notes: list[str]) -> ChatRequest:
    messages = messages_in(req.messages, notes)
    system = translated_once(req.system, "anthropic.system", _system_message_in, notes)
    if system is not None:
        messages.insert(0, system)
    tools = translated_once(req.tools, "anthropic.tools", tools_in, notes)
    tool_choice: str | dict[str, Any] | None = None
    parallel: bool | None = None
    if req.tool_choice is not None:
        names = {t.name for t in tools or []}
        if req.tool_choice.type == "tool" and req.tool_choice.name not in names:
            raise RequestError(f"tool_choice.name: {req.tool_choice.name!r} is not one of the request's tools")
        if tools or req.tool_choice.type == "none":
            tool_choice = req.tool_choice.to_chat()
        if req.tool_choice.disable_parallel_tool_use:
            parallel = False
    return ChatRequest(model=req.model, messages=messages, tools=tools, tool_choice=tool_choice,
                       parallel_tool_calls=parallel, response_format=req.response_format(), **req.sampling())


# -------------------------------------------------------------------------------------------------------- response


def _base62(data: bytes) -> str:
    n, out = int.from_bytes(data, "big"), []
    while n:
        n, r = divmod(n, 62)
        out.append(_BASE62[r])
    return "".join(reversed(out)) or "0"


def tool_use_id(call_id: str) -> str:
    """An Anthropic-looking id for an engine's tool-call id; the same call id always gives the same one."""
    if call_id.startswith("toolu_"):
        return call_id
    return "toolu_01" + _base62(hashlib.sha256(call_id.encode()).digest())[:22]


def thinking_signature(thinking: str) -> str:
    """An opaque, deterministic signature for thinking text we produced (only Anthropic can make real ones)."""
    digest = hashlib.blake2b(thinking.encode(), digest_size=48, person=b"polar_gym").digest()
    return base64.b64encode(b"pg1" + digest).decode()


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object Anthropic's ``input`` must be. Arguments that are not a JSON object (or
    that the response encoder cannot write back, such as integers past 64 bits) are kept verbatim under ``_raw``."""
    try:
        value = json.loads(arguments, parse_constant=_no_constants) if arguments.strip() else {}
        orjson.dumps(value)
    except (ValueError, TypeError):  # JSONDecodeError is a ValueError; orjson raises TypeError subclasses
        return {"_raw": arguments}
    return value if isinstance(value, dict) else {"_raw": arguments}


def content_blocks(result: ChatResult, thinking: bool) -> list[dict[str, Any]]:
    """The Message content: thinking (when the request enabled it), text, then tool uses."""
    msg = result.message
    blocks: list[dict[str, Any]] = []
    if thinking and msg.reasoning_content:
        blocks.append({"type": "thinking", "thinking": msg.reasoning_content,
                       "signature": thinking_signature(msg.reasoning_content)})
    seen: set[str] = set()
    if result.text or not msg.tool_calls:
        blocks.append({"type": "text", "text": result.text})
    for i, call in enumerate(msg.tool_calls or []):
        ident = tool_use_id(call.id)
        if ident in seen:  # engines that reuse a call id within one message
            ident = tool_use_id(f"{call.id}#{i}")
        seen.add(ident)
        blocks.append({"type": "tool_use", "id": ident, "name": call.function.name,
                       "input": tool_input(call.function.arguments)})
    return blocks


def stop_reason(result: ChatResult, stops: Sequence[str] | None) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)``. Which stop sequence matched is known only when the engine reports it."""
    if result.finish_reason == "length":
        return "max_tokens", None
    if result.message.tool_calls:
        return "tool_use", None
    if result.finish_reason in _STOP_REASONS:
        return _STOP_REASONS[result.finish_reason], None
    matched = result.raw.get("stop_reason", result.raw.get("matched_stop"))
    if stops and isinstance(matched, str) and matched in stops:
        return "stop_sequence", matched
    return "end_turn", None


def _usage(result: ChatResult) -> dict[str, int]:
    return {"input_tokens": result.usage.prompt_tokens, "output_tokens": result.usage.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}


def _event(kind: str, **fields: Any) -> SSEEvent:
    return SSEEvent(event=kind, data={"type": kind, **fields})


def _block_events(index: int, block: dict[str, Any]) -> Iterator[SSEEvent]:
    kind = block["type"]
    if kind == "thinking":
        yield _event("content_block_start", index=index,
                     content_block={"type": "thinking", "thinking": "", "signature": ""})
        yield _event("content_block_delta", index=index, delta={"type": "thinking_delta",
                                                                "thinking": block["thinking"]})
        yield _event("content_block_delta", index=index, delta={"type": "signature_delta",
                                                                "signature": block["signature"]})
    elif kind == "text":
        yield _event("content_block_start", index=index, content_block={"type": "text", "text": ""})
        if block["text"]:
            yield _event("content_block_delta", index=index, delta={"type": "text_delta", "text": block["text"]})
    else:
        yield _event("content_block_start", index=index,
                     content_block={"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}})
        yield _event("content_block_delta", index=index, delta={"type": "input_json_delta",
                                                                "partial_json": orjson.dumps(block["input"]).decode()})
    yield _event("content_block_stop", index=index)


@dataclass(frozen=True)
class AnthropicRenderState:
    """What rendering an answer remembers of the request."""

    #: the request enabled extended thinking (reasoning is rendered as thinking blocks)
    thinking: bool
    #: the request's stop sequences (a stop on one is reported as ``stop_sequence``)
    stop_sequences: tuple[str, ...]


class AnthropicProvider(Provider[AnthropicRenderState]):
    name = "anthropic"
    conversation_field = "messages"
    error_style = "anthropic"
    id_prefix = "msg_"

    def _inbound(self, body: dict[str, Any]) -> tuple[MessagesRequest, Inbound[AnthropicRenderState]]:
        req = parse_model(MessagesRequest, body)
        notes: list[str] = []
        chat = _translate(req, notes)
        thinking = req.thinking is not None and req.thinking.enabled
        inbound = Inbound(
            provider=self.name, model=req.model, stream=req.stream, chat=chat, normalizations=notes,
            ignored_fields=sorted(set(req.model_extra or ()) - KNOWN_IGNORED),
            render_state=AnthropicRenderState(thinking, tuple(req.stop_sequences or ())),
        )
        return req, inbound

    def parse(self, body: dict[str, Any], route: Route) -> Inbound[AnthropicRenderState]:
        req, inbound = self._inbound(body)
        if req.max_tokens is None:
            raise RequestError("max_tokens: Field required")
        return inbound

    def parse_count(self, body: dict[str, Any], route: Route) -> Inbound[AnthropicRenderState]:
        """A count_tokens request: the same body without ``max_tokens`` (and never streamed)."""
        _, inbound = self._inbound(body)
        inbound.stream = False
        return inbound

    def render_count(self, count: int) -> dict[str, Any]:
        return {"input_tokens": count}

    def render(self, result: ChatResult, inbound: Inbound[AnthropicRenderState], ctx: RenderContext) -> dict[str, Any]:
        state = inbound.render_state
        reason, sequence = stop_reason(result, state.stop_sequences)
        return {
            "id": ctx.response_id, "type": "message", "role": "assistant", "model": inbound.model,
            "content": content_blocks(result, state.thinking),
            "stop_reason": reason, "stop_sequence": sequence, "usage": _usage(result),
        }

    def stream(self, result: ChatResult, inbound: Inbound[AnthropicRenderState],
               ctx: RenderContext) -> Iterator[SSEEvent]:
        state = inbound.render_state
        reason, sequence = stop_reason(result, state.stop_sequences)
        usage = {**_usage(result), "output_tokens": 0}
        yield _event("message_start", message={
            "id": ctx.response_id, "type": "message", "role": "assistant", "model": inbound.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": usage})
        yield _event("ping")
        for index, block in enumerate(content_blocks(result, state.thinking)):
            yield from _block_events(index, block)
        yield _event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                     usage={"output_tokens": result.usage.completion_tokens})
        yield _event("message_stop")

    def stream_error(self, exc: ProxyError) -> SSEEvent:
        return SSEEvent(error_body(exc, self.error_style)[1], "error")
