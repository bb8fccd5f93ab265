"""The one normalized form every front end translates to and from: an OpenAI-Chat-shaped request and a result.

Providers never translate pairwise; each one maps its protocol onto :class:`ChatRequest` and maps a
:class:`ChatResult` back. Engines only ever see a ChatRequest. Everything here is plain data (no I/O).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    SkipValidation,
    model_validator,
)

from polar_gym.known_json import KNOWN
from polar_gym.schema import VersionSpan

__all__ = [
    "ChatMessage",
    "ChatRequest",
    "ChatResult",
    "ContentPart",
    "FinishReason",
    "FunctionCall",
    "Tool",
    "ToolCall",
    "Usage",
    "collapse_parts",
    "message_text",
]


#: why the engine stopped sampling (OpenAI's names; each provider maps them onto its own)
FinishReason = Literal["stop", "length", "tool_calls", "content_filter"]


class _Data(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _private(model: BaseModel) -> dict[str, Any]:
    """A model's private attributes, read directly: ``self._dump`` goes through pydantic's ``__getattr__``, ~3 us
    (a harness sends dozens of tools a call)."""
    private = model.__pydantic_private__
    assert private is not None  # the model declares private attributes
    return private


class ContentPart(_Data):
    type: Literal["text", "image_url"]
    text: str | None = None
    image_url: dict[str, Any] | None = None


class FunctionCall(_Data):
    name: str
    arguments: str = "{}"


class ToolCall(_Data):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Data):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


def _dump_message(message: ChatMessage) -> dict[str, Any]:
    return message.model_dump(exclude_none=True)


class Tool(_Data):
    type: Literal["function"] = "function"
    function: dict[str, Any]
    _dump: dict[str, Any] | None = PrivateAttr(default=None)

    def dump(self) -> dict[str, Any]:
        """This tool as plain JSON data, computed once: a harness's tools are translated once and then shared by
        every call that sends them (:mod:`polar_gym.known_json`), so never change what this returns."""
        private = _private(self)
        dumped = private.get("_dump")
        if dumped is None:
            dumped = private["_dump"] = self.model_dump(exclude_none=True)
        return dumped

    @property
    def name(self) -> str:
        return str(self.function.get("name", ""))

    @property
    def parameters(self) -> dict[str, Any]:
        params = self.function.get("parameters")
        return params if isinstance(params, dict) else {}


class ChatRequest(_Data):
    """What an engine is asked. ``extra`` carries engine arguments (e.g. chat_template_kwargs) verbatim."""

    model: str
    messages: list[ChatMessage]
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: list[str] | None = None
    seed: int | None = None
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    extra: dict[str, Any] = Field(default_factory=dict)
    _dump: dict[str, Any] | None = PrivateAttr(default=None)

    @model_validator(mode="wrap")
    @classmethod
    def _share_known_tools(cls, data: Any, handler: ModelWrapValidatorHandler[ChatRequest]) -> ChatRequest:
        """Tools translated once for a harness's repeated tools (:mod:`polar_gym.known_json`) stay that very list
        (validation would copy it), so their dump and its JSON are computed once too."""
        request = handler(data)
        tools = data.get("tools") if isinstance(data, dict) else None
        if tools is not None and KNOWN.known(tools) and all(isinstance(tool, Tool) for tool in tools):
            request.__dict__["tools"] = tools
        return request

    def dump(self) -> dict[str, Any]:
        """This request as plain JSON data (None fields left out), computed once: the journal records it and every
        engine builds its upstream body from it, and walking a 30K-token conversation is not free."""
        private = _private(self)
        data = private.get("_dump")
        if data is None:
            rest = self.model_dump(exclude_none=True, exclude={"model", "messages", "tools"})
            # a session's earlier messages are shared (known) and dumped once; the others now
            data = {"model": self.model, "messages": [KNOWN.derive(m, "dump", _dump_message) for m in self.messages]}
            if self.tools is not None:  # each tool's own dump (kept with the tool)
                data["tools"] = KNOWN.derive(self.tools, "dump", lambda tools: [tool.dump() for tool in tools])
            data.update(rest)
            private["_dump"] = data
        return data

    def with_sampling(self, values: Mapping[str, float | int]) -> tuple[ChatRequest, str | None]:
        """This request with ``values`` (validated sampling fields: temperature, top_p, top_k, seed) in place of
        its own, and a note of what changed for the capture record (None and the request itself: nothing did). The
        harness's own values stay in the record's ``request``; its ``normalized_request`` is what the engine got."""
        changed = {name: value for name, value in values.items() if getattr(self, name) != value}
        if not changed:
            return self, None
        note = "sampling override: " + ", ".join(
            f"{name} {'unset' if getattr(self, name) is None else getattr(self, name)} -> {value}"
            for name, value in changed.items())
        copy = self.model_copy(update=changed)  # validated already (SamplingOverride): no re-parse
        _private(copy)["_dump"] = None  # a dump computed before the copy holds the old values
        return copy, note

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI Chat body for an upstream (always non-streaming: streams are synthesized by the proxy)."""
        data = self.dump()
        body: dict[str, Any] = {"model": self.model, "messages": data["messages"], "stream": False}
        for name in ("tools", "tool_choice", "max_tokens", "temperature", "top_p", "top_k", "seed",
                     "response_format", "parallel_tool_calls", "stop"):
            value = data.get(name)
            if value:
                body[name] = value
            elif value is not None and name not in ("tools", "stop"):
                body[name] = value
        body.update(self.extra)
        return body


class Usage(_Data):
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class ChatResult(_Data):
    """An engine's answer: the assistant message plus the exact token data behind it. The token lists are not
    validated here: each engine's reader checks what it read (:func:`polar_gym.proxy.engines.openai.token_ids_in`
    does it in C), and validating 2,000 IDs again cost more than the rest of reading the answer."""

    message: ChatMessage
    finish_reason: FinishReason = "stop"
    prompt_ids: SkipValidation[list[int]] = Field(default_factory=list)
    response_ids: SkipValidation[list[int]] = Field(default_factory=list)
    response_logprobs: SkipValidation[list[float]] = Field(default_factory=list)
    token_faithful: bool = True
    usage: Usage = Field(default_factory=Usage)
    engine: str = ""
    server: str | None = None
    policy_version: int | str | None = None
    #: a generation weight updates cut: which response_ids each policy version sampled (None: one version did;
    #: see CompletionRecord.version_spans)
    version_spans: list[VersionSpan] | None = None
    raw: dict[str, Any] = Field(default_factory=dict)

    @property
    def text(self) -> str:
        return message_text(self.message)


def message_text(message: ChatMessage) -> str:
    """The text of a message, joining text parts (images are dropped)."""
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "".join(part.text or "" for part in message.content if part.type == "text")


def collapse_parts(parts: list[ContentPart]) -> str | list[ContentPart]:
    """Content as a plain string when it is all text (what chat templates render best), else the parts."""
    if all(p.type == "text" for p in parts):
        return "".join(p.text or "" for p in parts)
    return parts
