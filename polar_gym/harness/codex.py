"""Codex CLI (``codex exec``): OpenAI Responses through a custom ``model_provider`` in ``$CODEX_HOME/config.toml``.

The provider's ``wire_api`` must be ``responses`` (this version rejects ``chat``); its key comes from the env var
named by ``env_key``. Retries are off so a proxy error ends the run instead of repeating the call.
Side requests: none are separable by name. Compaction runs on the main model (the builder sees it as a new prompt
prefix); the memories and guardian features that name other models are not enabled here. MCP servers become
``[mcp_servers.<name>]`` tables; skills go to ``$CODEX_HOME/skills/<name>/SKILL.md``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from polar_gym.harness._common import NO_PHONE_HOME, binary, mcp_config, skill_files, toml_table
from polar_gym.harness.base import Harness, HarnessContext
from polar_gym.harness.config import CodexConfig, HarnessConfig

__all__ = ["Codex"]

_KEY_VAR = "POLAR_API_KEY"


class Codex(Harness):
    name: ClassVar[str] = "codex"
    provider: ClassVar[str] = "openai_responses"
    pin: ClassVar[str | None] = "codex"
    config_model: ClassVar[type[HarnessConfig]] = CodexConfig

    @staticmethod
    def codex_home(ctx: HarnessContext) -> str:
        return f"{ctx.home}/.codex"

    def files(self, ctx: HarnessContext) -> dict[str, str]:
        return {**self.mcp_servers(ctx, ctx.config.get("mcp_servers") or {}),
                **self.skills(ctx, ctx.config.get("skills") or {})}

    def env(self, ctx: HarnessContext) -> dict[str, str]:
        return {"CODEX_HOME": self.codex_home(ctx), _KEY_VAR: ctx.key, **NO_PHONE_HOME}

    def command(self, ctx: HarnessContext) -> list[str]:
        return [binary(ctx, "codex"), "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
                ctx.instruction]

    def log_paths(self, ctx: HarnessContext) -> list[str]:
        return [f"{self.codex_home(ctx)}/sessions"]  # rollout-*.jsonl: every turn and tool call

    def mcp_servers(self, ctx: HarnessContext, servers: dict[str, Any]) -> dict[str, str]:
        lines = [
            *toml_table((), {"model": ctx.model_name, "model_provider": "polar", "approval_policy": "never",
                             "sandbox_mode": "danger-full-access", "check_for_update_on_startup": False}),
            *toml_table(("model_providers", "polar"), {
                "name": "polar_gym", "base_url": f"{ctx.gateway_url}/v1", "env_key": _KEY_VAR,
                "wire_api": "responses", "request_max_retries": 0, "stream_max_retries": 0}),
            *toml_table(("analytics",), {"enabled": False}),
        ]
        for name, server in mcp_config(servers).items():
            lines += toml_table(("mcp_servers", name), {"command": server.command, "args": server.args,
                                                        **({"env": server.env} if server.env else {})})
        return {f"{self.codex_home(ctx)}/config.toml": "\n".join(lines)}

    def skills(self, ctx: HarnessContext, skills: dict[str, str]) -> dict[str, str]:
        return skill_files(f"{self.codex_home(ctx)}/skills", skills)
