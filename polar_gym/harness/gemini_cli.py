"""Gemini CLI (``gemini -p``): Google generateContent at ``GOOGLE_GEMINI_BASE_URL``, the session key as the API key.

``~/.gemini/settings.json`` selects API-key auth (else it asks to log in) and turns telemetry and updates off;
``GEMINI_CLI_TRUST_WORKSPACE`` skips the trust prompt for the workdir.
Side requests: Gemini CLI sends its helper calls (loop detection, next-speaker check, edit correction, summaries,
web fetch) under its own built-in model names (the flash-lite and flash families), never the session's model name,
so the proxy flags them without any setting; their names depend on the CLI version, so none is listed here.
Not separable: chat compression runs on the main model. MCP servers go to ``mcpServers`` in the settings.
"""

from __future__ import annotations

from typing import Any, ClassVar

from polar_gym.harness._common import NO_PHONE_HOME, binary, dump_json, mcp_config
from polar_gym.harness.base import Harness, HarnessContext
from polar_gym.harness.config import GeminiCliConfig, HarnessConfig

__all__ = ["GeminiCli"]


class GeminiCli(Harness):
    name: ClassVar[str] = "gemini_cli"
    provider: ClassVar[str] = "google"
    pin: ClassVar[str | None] = "gemini_cli"
    config_model: ClassVar[type[HarnessConfig]] = GeminiCliConfig

    def files(self, ctx: HarnessContext) -> dict[str, str]:
        return self.mcp_servers(ctx, ctx.config.get("mcp_servers") or {})

    def env(self, ctx: HarnessContext) -> dict[str, str]:
        return {"GEMINI_API_KEY": ctx.key, "GOOGLE_GEMINI_BASE_URL": ctx.gateway_url,
                "GEMINI_CLI_TRUST_WORKSPACE": "true", **NO_PHONE_HOME}

    def command(self, ctx: HarnessContext) -> list[str]:
        return [binary(ctx, "gemini_cli"), "--approval-mode", "yolo", "--model", ctx.model_name, "-p",
                ctx.instruction]

    def log_paths(self, ctx: HarnessContext) -> list[str]:
        return [f"{ctx.home}/.gemini/tmp"]  # <project>/chats/session-*.jsonl

    def mcp_servers(self, ctx: HarnessContext, servers: dict[str, Any]) -> dict[str, str]:
        settings: dict[str, Any] = {
            "security": {"auth": {"selectedType": "gemini-api-key"}},
            "privacy": {"usageStatisticsEnabled": False}, "telemetry": {"enabled": False},
            "general": {"disableAutoUpdate": True, "disableUpdateNag": True},
        }
        entries = {name: {"command": s.command, "args": s.args, "env": s.env}
                   for name, s in mcp_config(servers).items()}
        if entries:
            settings["mcpServers"] = entries
        return {f"{ctx.home}/.gemini/settings.json": dump_json(settings)}
