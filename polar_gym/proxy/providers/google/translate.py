"""Gemini generateContent <-> the normalized chat form. Pure: no I/O, no SDK imports.

Gemini differs from Chat in ways that matter for token fidelity: one ``model`` turn may be spread over several
contents and parts (a streamed answer replayed part by part), so parts are concatenated without separators and
consecutive model contents fold into one assistant message; function calls often carry no id, so ids are derived
from the call's position (stable because histories are append-only) and responses are matched by id, else by name
in call order; tool parameters use Gemini's OpenAPI subset (``type: OBJECT``, ``nullable``), lowered to JSON Schema.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

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
from polar_gym.proxy.errors import RequestError, UnsupportedRoute
from polar_gym.proxy.providers.base import Inbound, Provider, RenderContext, Route, SSEEvent, parse_model
from polar_gym.proxy.providers.google.protocol import (
    KNOWN_IGNORED,
    NOT_FORWARDED_GENERATION,
    Content,
    FunctionCallingConfig,
    GenerateContentRequest,
    GenerationConfig,
    Part,
    ToolSpec,
)
from polar_gym.proxy.providers.reasoning import decode_signature, encode_signature

__all__ = [
    "GoogleProvider",
    "GoogleRenderState",
    "contents_to_messages",
    "derived_call_id",
    "lower_schema",
    "response_parts",
    "tool_choice_in",
    "tools_in",
    "usage_metadata",
]

_ACTIONS = {"generateContent": False, "streamGenerateContent": True}
_FINISH = {"stop": "STOP", "tool_calls": "STOP", "length": "MAX_TOKENS", "content_filter": "SAFETY"}
_SCHEMA_SNAKE: dict[str, str] = {
    "any_of": "anyOf", "one_of": "oneOf", "all_of": "allOf", "max_items": "maxItems", "min_items": "minItems",
    "max_length": "maxLength", "min_length": "minLength", "max_properties": "maxProperties",
    "min_properties": "minProperties", "property_ordering": "propertyOrdering",
}
_SCHEMA_INTS = frozenset({"maxItems", "minItems", "maxLength", "minLength", "maxProperties", "minProperties"})
_SCHEMA_LISTS = frozenset({"anyOf", "oneOf", "allOf", "prefixItems"})


# ---------------------------------------------------------------- schemas


def lower_schema(schema: Any) -> Any:
    """A Gemini Schema (OpenAPI 3.0 subset) as JSON Schema: lowercase types, ``nullable`` as a ``null`` type,
    int64 bounds sent as strings made ints, ``example`` as ``examples``. Property names are never touched."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    nullable = False
    for raw_key, value in schema.items():
        key = str(raw_key)  # a JSON object's keys are strings already
        key = _SCHEMA_SNAKE.get(key, key)
        if key == "type":
            kinds = [value] if isinstance(value, str) else value if isinstance(value, list) else []
            lowered = [k.lower() for k in kinds if isinstance(k, str) and k.upper() != "TYPE_UNSPECIFIED"]
            if lowered:
                out["type"] = lowered[0] if isinstance(value, str) else lowered
        elif key == "nullable":
            nullable = bool(value)
        elif key == "properties" and isinstance(value, dict):
            out[key] = {name: lower_schema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            out[key] = lower_schema(value)
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [lower_schema(sub) for sub in value]
        elif key in _SCHEMA_INTS and isinstance(value, str) and value.strip().lstrip("-").isdigit():
            out[key] = int(value)
        elif key == "example":
            out.setdefault("examples", [value])
        elif key == "propertyOrdering":
            continue
        else:
            out[key] = value
    if nullable:
        kind = out.get("type")
        if isinstance(kind, str) and kind != "null":
            out["type"] = [kind, "null"]
        elif isinstance(kind, list) and "null" not in kind:
            out["type"] = [*kind, "null"]
        elif isinstance(out.get("anyOf"), list):
            out["anyOf"] = [*out["anyOf"], {"type": "null"}]
        if isinstance(out.get("enum"), list) and None not in out["enum"]:
            out["enum"] = [*out["enum"], None]
    return out


# ---------------------------------------------------------------- request: contents


def derived_call_id(name: str, content_index: int, part_index: int) -> str:
    """The id of a function call sent without one: its position, which an append-only history never changes."""
    return f"call_{content_index}_{part_index}_{name}"


@dataclass
class _Conversation:
    """State while folding contents into messages: the messages so far and the calls still awaiting answers."""

    messages: list[ChatMessage] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    pending: list[tuple[str, str]] = field(default_factory=list)  # (id, name) in call order
    ids_seen: bool = False
    idless_seen: bool = False

    def match(self, name: str, given: str | None) -> str | None:
        """The id of the call a response answers: by id when it names a pending call, else the first pending
        call of the same name."""
        if given is not None:
            for i, (call_id, _) in enumerate(self.pending):
                if call_id == given:
                    del self.pending[i]
                    return call_id
        for i, (call_id, call_name) in enumerate(self.pending):
            if call_name == name:
                del self.pending[i]
                return call_id
        return None


#: proto3 JSON writes bytes as base64 and reads both alphabets; the google-genai SDK sends the URL-safe one
_URL_SAFE_TO_STANDARD = str.maketrans("-_", "+/")


def _standard_base64(data: str) -> str:
    """``data`` in the standard base64 alphabet, padded (what a data URL, and every engine, reads)."""
    data = data.translate(_URL_SAFE_TO_STANDARD).rstrip("=")
    return data + "=" * (-len(data) % 4)


def _media_part(mime: str, data: str, where: str, conv: _Conversation) -> ContentPart:
    data = _standard_base64(data)
    if mime.startswith("image/"):
        return ContentPart(type="image_url", image_url={"url": f"data:{mime};base64,{data}"})
    if mime.startswith("text/") or mime in ("application/json", "application/xml"):
        try:
            return ContentPart(type="text", text=base64.b64decode(data, validate=True).decode("utf-8"))
        except (binascii.Error, UnicodeDecodeError) as exc:
            raise RequestError(f"{where}.inlineData.data: not base64-encoded UTF-8 text ({exc})") from exc
    conv.notes.append(f"{where}.inlineData: {mime} attachment replaced by a placeholder (text-only model)")
    return ContentPart(type="text", text=f"[{mime} attachment omitted]")


def _file_part(mime: str | None, uri: str, where: str, conv: _Conversation) -> ContentPart:
    if mime is None or mime.startswith("image/"):
        return ContentPart(type="image_url", image_url={"url": uri})
    conv.notes.append(f"{where}.fileData: {mime} file {uri} replaced by a placeholder (text-only model)")
    return ContentPart(type="text", text=f"[{mime} file {uri} omitted]")


def _code_text(part: Part, where: str, conv: _Conversation) -> str:
    if part.executable_code is not None:
        conv.notes.append(f"{where}.executableCode: rendered as text (code execution is not offered)")
        lang = (part.executable_code.language or "").lower().replace("language_unspecified", "")
        return f"\n```{lang}\n{part.executable_code.code}\n```\n"
    assert part.code_execution_result is not None
    conv.notes.append(f"{where}.codeExecutionResult: rendered as text (code execution is not offered)")
    outcome = part.code_execution_result.outcome or "OUTCOME_UNSPECIFIED"
    return f"\nCode execution result ({outcome}):\n{part.code_execution_result.output or ''}\n"


def _response_text(response: dict[str, Any] | None) -> str:
    """A function response as the tool message's text: a lone ``output``/``result``/``content`` string as is
    (gemini-cli's shape), anything else as JSON."""
    if not response:
        return ""
    if len(response) == 1:
        ((key, value),) = response.items()
        if key in ("output", "result", "content") and isinstance(value, str):
            return value
    return json.dumps(response, ensure_ascii=False)


_flatten = collapse_parts


def _user_content(content: Content, ci: int, conv: _Conversation) -> None:
    where = f"contents.{ci}"
    parts: list[ContentPart] = []
    tools: list[ChatMessage] = []
    for pi, part in enumerate(content.parts):
        at = f"{where}.parts.{pi}"
        if part.function_call is not None:
            raise RequestError(f"{at}.functionCall: function calls belong in a 'model' content")
        if part.function_response is not None:
            fr = part.function_response
            conv.ids_seen |= fr.id is not None
            conv.idless_seen |= fr.id is None
            call_id = conv.match(fr.name, fr.id)
            if call_id is None:
                call_id = fr.id or derived_call_id(fr.name, ci, pi)
                conv.notes.append(f"{at}.functionResponse: no earlier call to {fr.name!r} to answer")
            if fr.parts:
                conv.notes.append(f"{at}.functionResponse.parts: media in function responses dropped")
            tools.append(ChatMessage(role="tool", content=_response_text(fr.response), tool_call_id=call_id))
        elif part.text is not None:
            parts.append(ContentPart(type="text", text=part.text))
        elif part.inline_data is not None:
            parts.append(_media_part(part.inline_data.mime_type, part.inline_data.data, at, conv))
        elif part.file_data is not None:
            parts.append(_file_part(part.file_data.mime_type, part.file_data.file_uri, at, conv))
        elif part.executable_code is not None or part.code_execution_result is not None:
            parts.append(ContentPart(type="text", text=_code_text(part, at, conv)))
        else:
            raise RequestError(f"{at}: a part needs one of text, inlineData, fileData, functionResponse, "
                               "executableCode or codeExecutionResult")
    conv.messages.extend(tools)
    if parts or not tools:
        conv.messages.append(ChatMessage(role="user", content=_flatten(parts)))


def _model_content(content: Content, ci: int, conv: _Conversation, merge: bool) -> None:
    where = f"contents.{ci}"
    text, reasoning = "", ""
    calls: list[ToolCall] = []
    for pi, part in enumerate(content.parts):
        at = f"{where}.parts.{pi}"
        if part.function_response is not None:
            raise RequestError(f"{at}.functionResponse: function responses belong in a 'user' content")
        if part.function_call is not None:
            fc = part.function_call
            conv.ids_seen |= fc.id is not None
            conv.idless_seen |= fc.id is None
            call_id = fc.id or derived_call_id(fc.name, ci, pi)
            conv.pending.append((call_id, fc.name))
            args = json.dumps(fc.args or {}, ensure_ascii=False)
            calls.append(ToolCall(id=call_id, function=FunctionCall(name=fc.name, arguments=args)))
        elif part.text is not None and part.thought:
            reasoning += part.text
        elif part.text is not None:
            text += part.text
        elif part.executable_code is not None or part.code_execution_result is not None:
            text += _code_text(part, at, conv)
        elif part.inline_data is not None or part.file_data is not None:
            raise RequestError(f"{at}: media in a 'model' content is not supported (text-only model)")
    if not reasoning:  # thoughts are not sent back, but our signature carries them (see response_parts)
        signed = [decode_signature(p.thought_signature) for p in content.parts if p.thought_signature]
        reasoning = next((text for text in signed if text), "")
    prev = conv.messages[-1] if merge and conv.messages else None
    if prev is not None and prev.role == "assistant":
        prev.content = (prev.content if isinstance(prev.content, str) else "") + text
        prev.reasoning_content = ((prev.reasoning_content or "") + reasoning) or None
        prev.tool_calls = ((prev.tool_calls or []) + calls) or None
        return
    conv.messages.append(ChatMessage(role="assistant", content=text, reasoning_content=reasoning or None,
                                     tool_calls=calls or None))


def contents_to_messages(contents: list[Content], system: Content | str | None) -> tuple[list[ChatMessage],
                                                                                           list[str], bool]:
    """The chat messages of a Gemini conversation, the normalization notes, and whether the client round-trips
    call ids (true unless its history holds calls or responses and not one of them carries an id)."""
    conv = _Conversation()
    if system is not None:
        text = system if isinstance(system, str) else "".join(p.text or "" for p in system.parts)
        if not isinstance(system, str) and any(p.text is None for p in system.parts):
            conv.notes.append("systemInstruction: non-text parts dropped")
        conv.messages.append(ChatMessage(role="system", content=text))
    last_role = None
    for ci, content in enumerate(contents):
        role = content.role or "user"
        if role == "model":
            _model_content(content, ci, conv, merge=last_role == "model")
        elif role in ("user", "function"):
            _user_content(content, ci, conv)
        else:
            raise RequestError(f"contents.{ci}.role: must be 'user' or 'model', got {role!r}")
        last_role = role
    return conv.messages, conv.notes, conv.ids_seen or not conv.idless_seen


# ---------------------------------------------------------------- request: tools and config


def tools_in(tools: list[ToolSpec] | None) -> tuple[list[Tool] | None, list[str]]:
    """Function declarations as Chat tools; built-in tools (googleSearch, codeExecution, ...) are skipped."""
    out: list[Tool] = []
    notes: list[str] = []
    for ti, spec in enumerate(tools or []):
        for builtin in spec.model_extra or {}:
            notes.append(f"tools.{ti}.{builtin}: built-in tool not offered to the model")
        for di, decl in enumerate(spec.function_declarations or []):
            if decl.parameters_json_schema is not None:
                params: Any = decl.parameters_json_schema
                if not isinstance(params, dict):
                    raise RequestError(f"tools.{ti}.functionDeclarations.{di}.parametersJsonSchema: must be an "
                                       "object schema")
            elif decl.parameters is not None:
                params = lower_schema(decl.parameters)
            else:
                params = {"type": "object", "properties": {}}
            function: dict[str, Any] = {"name": decl.name}
            if decl.description is not None:
                function["description"] = decl.description
            function["parameters"] = params
            out.append(Tool(function=function))
    return out or None, notes


def tool_choice_in(config: FunctionCallingConfig | None) -> tuple[str | dict[str, Any] | None, list[str]]:
    """functionCallingConfig as a Chat tool_choice. ANY with one allowed name forces that function."""
    if config is None:
        return None, []
    mode = (config.mode or "AUTO").upper()
    allowed = config.allowed_function_names or []
    notes: list[str] = []
    if mode == "NONE":
        return "none", notes
    if mode == "ANY":
        if len(allowed) == 1:
            return {"type": "function", "function": {"name": allowed[0]}}, notes
        if allowed:
            notes.append("toolConfig.functionCallingConfig.allowedFunctionNames: more than one name, not enforced")
        return "required", notes
    if mode in ("AUTO", "VALIDATED", "MODE_UNSPECIFIED"):
        if allowed:
            notes.append("toolConfig.functionCallingConfig.allowedFunctionNames: not enforced in mode " + mode)
        return "auto", notes
    raise RequestError(f"toolConfig.functionCallingConfig.mode: unknown mode {config.mode!r}")


def _response_format(gen: GenerationConfig, notes: list[str]) -> dict[str, Any] | None:
    mime = gen.response_mime_type
    schema: Any = gen.response_json_schema
    if schema is None and gen.response_schema is not None:
        schema = lower_schema(gen.response_schema)
    if mime in (None, "text/plain"):
        if schema is not None:
            raise RequestError("generationConfig.responseSchema: needs responseMimeType 'application/json'")
        return None
    if mime == "application/json":
        if schema is None:
            return {"type": "json_object"}
        return {"type": "json_schema", "json_schema": {"name": "response", "schema": schema}}
    notes.append(f"generationConfig.responseMimeType: {mime} not enforced")
    return None


def _generation(gen: GenerationConfig | None, chat: dict[str, Any], notes: list[str]) -> bool:
    """Fill sampling fields of the chat request from generationConfig; returns includeThoughts."""
    if gen is None:
        return False
    if gen.candidate_count not in (None, 1):
        raise RequestError(f"generationConfig.candidateCount: only 1 candidate is supported, got "
                           f"{gen.candidate_count}")
    chat.update(temperature=gen.temperature, top_p=gen.top_p, max_tokens=gen.max_output_tokens,
                stop=gen.stop_sequences or None, seed=gen.seed, response_format=_response_format(gen, notes))
    if gen.top_k is not None:
        chat["top_k"] = int(gen.top_k)
    for name in NOT_FORWARDED_GENERATION:
        if getattr(gen, name) is not None:
            notes.append(f"generationConfig.{name}: not forwarded")
    thinking = gen.thinking_config
    if thinking is not None and (thinking.thinking_budget is not None or thinking.thinking_level is not None):
        notes.append("generationConfig.thinkingConfig: budget/level not forwarded (the template decides)")
    return bool(thinking and thinking.include_thoughts)


def _model_name(route: Route, body_model: str | None) -> str:
    model = route.model or body_model
    if not model:
        raise RequestError("no model: expected a path like /v1beta/models/{model}:generateContent")
    return model.removeprefix("models/")


# ---------------------------------------------------------------- response


def _args(arguments: str) -> dict[str, Any]:
    """Chat's argument string as Gemini's args object; text that is not a JSON object is kept under
    ``arguments`` rather than lost."""
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def response_parts(result: ChatResult, include_thoughts: bool, call_ids: bool) -> list[list[dict[str, Any]]]:
    """The answer's parts in stream order, grouped as a stream sends them: thoughts, text, function calls."""
    groups: list[list[dict[str, Any]]] = []
    msg = result.message
    if include_thoughts and msg.reasoning_content:
        groups.append([{"text": msg.reasoning_content, "thought": True}])
    if result.text:
        groups.append([{"text": result.text}])
    calls: list[dict[str, Any]] = []
    for call in msg.tool_calls or []:
        fc: dict[str, Any] = {"name": call.function.name, "args": _args(call.function.arguments)}
        if call_ids:
            fc["id"] = call.id
        calls.append({"functionCall": fc})
    if calls:
        groups.append(calls)
    groups = groups or [[{"text": ""}]]
    if msg.reasoning_content:
        # Gemini clients send a thought signature back on the part it came with (the first function call, else
        # the last part); ours carries the reasoning, so the next prompt renders it exactly as it was sampled.
        target = calls[0] if calls else groups[-1][-1]
        target["thoughtSignature"] = encode_signature(msg.reasoning_content)
    return groups


def usage_metadata(result: ChatResult) -> dict[str, int]:
    """Gemini usage. ``thoughtsTokenCount`` only when the engine reported the split (``raw['reasoning_tokens']``):
    a guessed split would be a made-up number."""
    usage = {"promptTokenCount": result.usage.prompt_tokens, "candidatesTokenCount": result.usage.completion_tokens,
             "totalTokenCount": result.usage.total_tokens}
    thoughts = result.raw.get("reasoning_tokens")
    if isinstance(thoughts, int) and 0 < thoughts <= result.usage.completion_tokens:
        usage["candidatesTokenCount"] -= thoughts
        usage["thoughtsTokenCount"] = thoughts
    return usage


# ---------------------------------------------------------------- the provider


@dataclass(frozen=True)
class GoogleRenderState:
    """What rendering an answer remembers of the request."""

    #: ``thinkingConfig.includeThoughts``: reasoning goes out as thought parts
    include_thoughts: bool
    #: the client sent ids with its function calls, so ours carry ids too
    call_ids: bool


class GoogleProvider(Provider[GoogleRenderState]):
    name = "google"
    conversation_field = "contents"
    error_style = "google"
    #: blank lines, not a comment: the google-genai SDK copy Gemini CLI bundles reads events only while its buffer
    #: starts with ``data:`` after whitespace, so a comment first leaves the whole stream unread and the call is sent
    #: again (a blank line is a no-op for any SSE reader)
    keepalive = b"\n"

    def parse(self, body: dict[str, Any], route: Route) -> Inbound[GoogleRenderState]:
        if route.action is None:
            raise UnsupportedRoute(f"no method in {route.path!r}: expected a path like "
                                   "/v1beta/models/{model}:generateContent")
        if route.action not in _ACTIONS:
            raise UnsupportedRoute(f"unsupported method {route.action!r}: the proxy serves generateContent, "
                                   "streamGenerateContent and countTokens")
        stream = _ACTIONS[route.action]
        inbound = self._inbound(body, route, stream)
        if stream and route.query.get("alt") != "sse":
            inbound.stream_json_array = True
        return inbound

    def parse_count(self, body: dict[str, Any], route: Route) -> Inbound[GoogleRenderState]:
        """countTokens: a body with ``contents`` (and, Vertex-style, tools and systemInstruction), or one that
        wraps a whole ``generateContentRequest``."""
        inner = body.get("generateContentRequest", body.get("generate_content_request"))
        if inner is not None:
            if not isinstance(inner, dict):
                raise RequestError("generateContentRequest: must be an object")
            body = inner
        return self._inbound(body, route, stream=False)

    def _inbound(self, body: dict[str, Any], route: Route, stream: bool) -> Inbound[GoogleRenderState]:
        req = parse_model(GenerateContentRequest, body)
        if req.cached_content is not None:
            raise RequestError("cachedContent: cached contents are not supported by this proxy; send the full "
                               "conversation in contents")
        messages, notes, call_ids = contents_to_messages(req.contents, req.system_instruction)
        tools, tool_notes = KNOWN.derive(req.tools, "google.tools", tools_in)
        choice, choice_notes = tool_choice_in(req.tool_config.function_calling_config if req.tool_config else None)
        sampling: dict[str, Any] = {}
        gen_notes: list[str] = []
        include_thoughts = _generation(req.generation_config, sampling, gen_notes)
        model = _model_name(route, req.model)
        chat = ChatRequest(model=model, messages=messages, tools=tools, tool_choice=choice if tools else None,
                           **sampling)
        ignored = sorted(set(req.model_extra or ()) - KNOWN_IGNORED)
        gen_extra = req.generation_config.model_extra if req.generation_config else None
        ignored += sorted(f"generationConfig.{k}" for k in gen_extra or ())
        return Inbound(
            provider=self.name, model=model, stream=stream, chat=chat,
            normalizations=notes + tool_notes + choice_notes + gen_notes, ignored_fields=ignored,
            render_state=GoogleRenderState(include_thoughts, call_ids),
        )

    def render(self, result: ChatResult, inbound: Inbound[GoogleRenderState], ctx: RenderContext) -> dict[str, Any]:
        state = inbound.render_state
        groups = response_parts(result, state.include_thoughts, state.call_ids)
        parts = [part for group in groups for part in group]
        candidate = {"content": {"role": "model", "parts": parts}, "finishReason": _FINISH[result.finish_reason],
                     "index": 0}
        return {"candidates": [candidate], "usageMetadata": usage_metadata(result), "modelVersion": inbound.model,
                "responseId": ctx.response_id}

    def stream(self, result: ChatResult, inbound: Inbound[GoogleRenderState],
               ctx: RenderContext) -> Iterator[SSEEvent]:
        """One chunk per part group; the last also carries finishReason and usageMetadata. Gemini's SSE has no
        event names and no terminator."""
        state = inbound.render_state
        groups = response_parts(result, state.include_thoughts, state.call_ids)
        for i, parts in enumerate(groups):
            candidate: dict[str, Any] = {"content": {"role": "model", "parts": parts}, "index": 0}
            chunk: dict[str, Any] = {"candidates": [candidate]}
            if i == len(groups) - 1:
                candidate["finishReason"] = _FINISH[result.finish_reason]
                chunk["usageMetadata"] = usage_metadata(result)
            chunk["modelVersion"] = inbound.model
            chunk["responseId"] = ctx.response_id
            yield SSEEvent(chunk)

    def render_count(self, total: int) -> dict[str, Any]:
        return {"totalTokens": total}
