"""OpenAI Chat Completions request models (only what the proxy reads; message-level extras are tolerated)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["KNOWN_IGNORED", "ChatCompletionRequest", "InMessage", "StreamOptions"]

#: accepted and deliberately not forwarded (billing, storage, client bookkeeping)
KNOWN_IGNORED = frozenset({
    "user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier", "logprobs",
    "top_logprobs", "frequency_penalty", "presence_penalty", "logit_bias", "modalities", "audio", "prediction",
    "web_search_options", "verbosity", "prompt_cache_retention",
})


class InMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    function_call: dict[str, Any] | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[InMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    functions: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = Field(default=None, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
