"""Qwen Code (``qwen -p``): OpenAI Chat Completions at ``OPENAI_BASE_URL``, the session key as ``OPENAI_API_KEY``.

Side requests: Qwen Code sends its background calls (session titles, tool-use summaries, memory recall, prompt
suggestions) with its ``fastModel`` setting, and without one it skips most of them or falls back to the main model
(session recap, kebab titles), which is then not separable. ``AgentSpec.config["fast_model"] = True`` sets
``fastModel`` to the side model (listed in ``modelProviders`` so Qwen Code accepts it): the calls become separable,
but Qwen Code then makes more of them. Off by default to keep runs as short as the recorded ones. MCP servers go to
``mcpServers`` in ``~/.qwen/settings.json``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from polar_gym.harness._common import NO_PHONE_HOME, binary, dump_json, mcp_config, side_model
from polar_gym.harness.base import Harness, HarnessContext
from polar_gym.harness.config import HarnessConfig, QwenCodeConfig

__all__ = ["QwenCode"]


class QwenCode(Harness):
    name: ClassVar[str] = "qwen_code"
    provider: ClassVar[str] = "openai_chat"
    pin: ClassVar[str | None] = "qwen_code"
    config_model: ClassVar[type[HarnessConfig]] = QwenCodeConfig

    def files(self, ctx: HarnessContext) -> dict[str, str]:
        return self.mcp_servers(ctx, ctx.config.get("mcp_servers") or {})

    def env(self, ctx: HarnessContext) -> dict[str, str]:
        return {"OPENAI_BASE_URL": f"{ctx.gateway_url}/v1", "OPENAI_API_KEY": ctx.key,
                "OPENAI_MODEL": ctx.model_name, **NO_PHONE_HOME}

    def command(self, ctx: HarnessContext) -> list[str]:
        return [binary(ctx, "qwen_code"), "--approval-mode", "yolo", "--model", ctx.model_name, ctx.instruction]

    def log_paths(self, ctx: HarnessContext) -> list[str]:
        return [f"{ctx.home}/.qwen/projects", f"{ctx.home}/.qwen/debug"]  # chats/*.jsonl and debug logs

    def mcp_servers(self, ctx: HarnessContext, servers: dict[str, Any]) -> dict[str, str]:
        settings: dict[str, Any] = {
            "security": {"auth": {"selectedType": "openai"}}, "model": {"name": ctx.model_name},
            "privacy": {"usageStatisticsEnabled": False}, "telemetry": {"enabled": False},
            "general": {"disableAutoUpdate": True, "disableUpdateNag": True},
        }
        if ctx.config.get("fast_model"):
            base = {"baseUrl": f"{ctx.gateway_url}/v1", "envKey": "OPENAI_API_KEY"}
            settings["modelProviders"] = {"openai": [{"id": m, "name": m, **base}
                                                     for m in (ctx.model_name, side_model(ctx))]}
            settings["fastModel"] = side_model(ctx)
        entries = {name: {"command": s.command, "args": s.args, "env": s.env}
                   for name, s in mcp_config(servers).items()}
        if entries:
            settings["mcpServers"] = entries
        return {f"{ctx.home}/.qwen/settings.json": dump_json(settings)}

    def side_models(self, ctx: HarnessContext) -> list[str]:
        return [side_model(ctx)] if ctx.config.get("fast_model") else []
