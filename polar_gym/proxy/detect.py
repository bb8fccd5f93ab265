"""Which provider protocol a request speaks: by path first, then headers, then body shape. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["detect_provider", "split_google_path"]

_PATH_SUFFIXES = (
    ("/messages/count_tokens", "anthropic"),
    ("/messages", "anthropic"),
    ("/chat/completions", "openai_chat"),
    ("/responses", "openai_responses"),
    (":generateContent", "google"),
    (":streamGenerateContent", "google"),
    (":countTokens", "google"),
)


def split_google_path(path: str) -> tuple[str, str] | None:
    """``/v1beta/models/gemini-x:streamGenerateContent`` -> (``gemini-x``, ``streamGenerateContent``)."""
    marker = "/models/"
    at = path.find(marker)
    if at < 0 or ":" not in path[at:]:
        return None
    model, _, action = path[at + len(marker):].rpartition(":")
    return (model, action) if model and action else None


def detect_provider(path: str, headers: Mapping[str, str], body: Any) -> str | None:
    path = path.split("?", 1)[0].rstrip("/")
    for suffix, provider in _PATH_SUFFIXES:
        if path.endswith(suffix):
            return provider
    lower = {k.lower() for k in headers}
    if "anthropic-version" in lower or "x-api-key" in lower:
        return "anthropic"
    if "x-goog-api-key" in lower:
        return "google"
    if isinstance(body, dict):
        if "contents" in body:
            return "google"
        if "input" in body and "messages" not in body:
            return "openai_responses"
        if "messages" in body:
            anthropic_shaped = ("system" in body and not isinstance(body.get("system"), type(None))) or any(
                isinstance(m, dict) and isinstance(m.get("content"), list)
                and any(isinstance(b, dict) and b.get("type") in ("tool_use", "tool_result", "thinking")
                        for b in m["content"])
                for m in body.get("messages") or [])
            return "anthropic" if anthropic_shaped else "openai_chat"
    return None
