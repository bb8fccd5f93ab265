"""opencode (``opencode run``): OpenAI Chat Completions through an ``@ai-sdk/openai-compatible`` provider.

``~/.config/opencode/opencode.json`` defines provider ``polar`` with the gateway as ``baseURL`` and the session key as
``apiKey``; ``OPENCODE_DISABLE_MODELS_FETCH`` stops it fetching models.dev, the other flags stop downloads.
Side requests: opencode asks its ``small_model`` for session titles (the first call of a run) and summaries; it is set
to the side model, so the proxy flags them. Not separable: compaction runs on the main model. MCP servers become
``local`` entries of ``mcp``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from polar_gym.harness._common import NO_PHONE_HOME, binary, dump_json, mcp_config, side_model
from polar_gym.harness.base import Harness, HarnessContext
from polar_gym.harness.config import HarnessConfig, OpenCodeConfig

__all__ = ["OpenCode"]

_PROVIDER = "polar"


class OpenCode(Harness):
    name: ClassVar[str] = "opencode"
    provider: ClassVar[str] = "openai_chat"
    pin: ClassVar[str | None] = "opencode"
    config_model: ClassVar[type[HarnessConfig]] = OpenCodeConfig

    def files(self, ctx: HarnessContext) -> dict[str, str]:
        return self.mcp_servers(ctx, ctx.config.get("mcp_servers") or {})

    def env(self, ctx: HarnessContext) -> dict[str, str]:
        return {"OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_AUTOUPDATE": "1",
                "OPENCODE_DISABLE_LSP_DOWNLOAD": "1", "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1", **NO_PHONE_HOME}

    def command(self, ctx: HarnessContext) -> list[str]:
        return [binary(ctx, "opencode"), "run", "--model", f"{_PROVIDER}/{ctx.model_name}", ctx.instruction]

    def log_paths(self, ctx: HarnessContext) -> list[str]:
        return [f"{ctx.home}/.local/share/opencode"]  # log/*.log and the session database

    def mcp_servers(self, ctx: HarnessContext, servers: dict[str, Any]) -> dict[str, str]:
        side = side_model(ctx)
        config: dict[str, Any] = {
            "$schema": "https://opencode.ai/config.json",
            "provider": {_PROVIDER: {"npm": "@ai-sdk/openai-compatible", "name": "polar_gym",
                                     "options": {"baseURL": f"{ctx.gateway_url}/v1", "apiKey": ctx.key},
                                     "models": {m: {"name": m} for m in (ctx.model_name, side)}}},
            "model": f"{_PROVIDER}/{ctx.model_name}", "small_model": f"{_PROVIDER}/{side}",
            "autoupdate": False, "share": "disabled",
            # external_directory: a path outside the workdir (Harbor's /solution, /tmp) is auto-rejected otherwise
            "permission": {"edit": "allow", "bash": "allow", "webfetch": "deny", "external_directory": "allow"},
        }
        entries = {name: {"type": "local", "command": [s.command, *s.args], "environment": s.env, "enabled": True}
                   for name, s in mcp_config(servers).items()}
        if entries:
            config["mcp"] = entries
        return {f"{ctx.home}/.config/opencode/opencode.json": dump_json(config)}

    def side_models(self, ctx: HarnessContext) -> list[str]:
        return [side_model(ctx)]
