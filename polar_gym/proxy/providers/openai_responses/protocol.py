"""OpenAI Responses request models (only what the proxy reads), the item shapes of ``input``, and the opaque
reasoning encoding this proxy hands out as ``encrypted_content``.

Item models tolerate extra fields (``id``, ``status``, codex's ``phase`` / ``end_turn``): harnesses echo whatever
they received, and none of it changes the prompt. Sets of field and type names document the decisions in one place.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from polar_gym.proxy.providers.reasoning import ENCRYPTED_PREFIX, decode_reasoning, encode_reasoning

__all__ = [
    "ENCRYPTED_PREFIX",
    "HOSTED_TOOL_TYPES",
    "KNOWN_IGNORED",
    "SKIPPED_ITEM_TYPES",
    "AdditionalToolsItem",
    "CustomToolCallItem",
    "CustomToolCallOutputItem",
    "FunctionCallItem",
    "FunctionCallOutputItem",
    "LocalShellCallItem",
    "LocalShellCallOutputItem",
    "MessageItem",
    "ReasoningItem",
    "ReasoningOptions",
    "ResponsesRequest",
    "TextOptions",
    "decode_reasoning",
    "encode_reasoning",
]

#: accepted and deliberately not forwarded (storage, billing, caching hints, client bookkeeping)
KNOWN_IGNORED = frozenset({
    "store", "metadata", "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options", "service_tier",
    "truncation", "user", "safety_identifier", "client_metadata", "max_tool_calls", "top_logprobs",
    "stream_options", "context_management", "moderation",
})

#: tool types that run on OpenAI's servers (or need its client-side built-in item grammar); nothing behind this
#: proxy executes them, so they are left out of the prompt with a normalization note
HOSTED_TOOL_TYPES = frozenset({
    "web_search", "web_search_preview", "web_search_preview_2025_03_11", "web_search_2025_08_26", "file_search",
    "code_interpreter", "image_generation", "computer_use_preview", "computer", "mcp", "tool_search", "shell",
    "apply_patch",
})

#: input items that record hosted-tool activity; they carry nothing a chat template can render, so they are
#: dropped with a normalization note instead of failing the harness's request
SKIPPED_ITEM_TYPES = frozenset({
    "web_search_call", "file_search_call", "image_generation_call", "code_interpreter_call", "computer_call",
    "computer_call_output", "tool_search_call", "tool_search_output", "mcp_list_tools", "mcp_approval_request",
    "mcp_approval_response", "mcp_call", "compaction", "compaction_summary", "compaction_trigger",
    "context_compaction", "ghost_snapshot",
})

class _Item(BaseModel):
    model_config = ConfigDict(extra="allow")


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, Any]]


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str | dict[str, Any] = "{}"
    namespace: str | None = None


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[dict[str, Any]]


class CustomToolCallItem(_Item):
    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    input: str
    namespace: str | None = None


class CustomToolCallOutputItem(_Item):
    type: Literal["custom_tool_call_output"]
    call_id: str
    output: str | list[dict[str, Any]]


class LocalShellCallItem(_Item):
    type: Literal["local_shell_call"]
    id: str | None = None
    call_id: str | None = None
    action: dict[str, Any]


class LocalShellCallOutputItem(_Item):
    type: Literal["local_shell_call_output"]
    id: str
    output: str


class ReasoningItem(_Item):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None


class AdditionalToolsItem(_Item):
    """Tools sent as an input item instead of the ``tools`` field (codex's lighter request shape)."""

    type: Literal["additional_tools"]
    tools: list[dict[str, Any]]


class ReasoningOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    format: dict[str, Any] | None = None
    verbosity: str | None = None


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``. Fields a stateless proxy cannot serve are typed so ``parse`` can refuse them."""

    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[Any] = Field(default_factory=list)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    stream: bool = False
    reasoning: ReasoningOptions | None = None
    include: list[str] | None = None
    text: TextOptions | None = None
    background: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
