"""Anthropic Messages request models: only what the proxy reads. Content blocks stay plain dicts (they are
checked block by block in translate.py, so an unsupported block gets a precise message); top-level extras are
tolerated and reported, as the real API's strictness would break harnesses that send newer fields.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "KNOWN_IGNORED",
    "InMessage",
    "MessagesRequest",
    "ThinkingConfig",
    "ToolChoice",
]

#: accepted and deliberately not forwarded (billing, caching, server-side containers, telemetry, routing)
KNOWN_IGNORED = frozenset({
    "metadata", "service_tier", "cache_control", "container", "diagnostics", "inference_geo", "speed",
    "context_management", "anthropic_version", "anthropic_beta", "betas",
})


class InMessage(BaseModel):
    """One turn. ``system`` turns are what Claude Code (2.1.154 and later) sends inside ``messages``."""

    model_config = ConfigDict(extra="allow")

    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class ThinkingConfig(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = None

    @property
    def enabled(self) -> bool:
        return self.type != "disabled"


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    def to_chat(self) -> str | dict[str, Any]:
        """The OpenAI-Chat ``tool_choice`` with the same meaning."""
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


class MessagesRequest(BaseModel):
    """A ``/v1/messages`` body, and a ``/v1/messages/count_tokens`` one (which has no ``max_tokens``)."""

    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[InMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    stop_sequences: list[str] | None = None
    stream: bool = False
    thinking: ThinkingConfig | None = None
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None

    def sampling(self) -> dict[str, Any]:
        """The sampling fields of the normalized request (``top_k`` 0 means "unset" in Anthropic's API)."""
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k or None,
            "stop": list(self.stop_sequences) if self.stop_sequences else None,
        }

    def response_format(self) -> dict[str, Any] | None:
        """Structured output (``output_config.format`` or the older ``output_format``) as an OpenAI
        ``response_format``."""
        fmt = (self.output_config or {}).get("format") or self.output_format
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
            return None
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.get("schema") or {}}}
