"""Claude Code (``claude -p``): Anthropic Messages at ``ANTHROPIC_BASE_URL``, the session key as ``x-api-key``.

Side requests: its small/fast model (titles, summaries, quick checks; the "haiku" slot) is renamed to the side model
through ``ANTHROPIC_SMALL_FAST_MODEL`` and ``ANTHROPIC_DEFAULT_HAIKU_MODEL``, so the proxy flags those calls.
Not separable: compaction and subagents (Task tool) run on the main model and look like main calls; the builder keeps
them apart only as separate prompt prefixes. Skills go to ``~/.claude/skills/<name>/SKILL.md``; MCP servers to the
user-scope ``mcpServers`` of ``~/.claude.json``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from polar_gym.harness._common import NO_PHONE_HOME, binary, dump_json, mcp_config, side_model, skill_files
from polar_gym.harness.base import Harness, HarnessContext
from polar_gym.harness.config import ClaudeCodeConfig, HarnessConfig

__all__ = ["ClaudeCode"]


class ClaudeCode(Harness):
    name: ClassVar[str] = "claude_code"
    provider: ClassVar[str] = "anthropic"
    pin: ClassVar[str | None] = "claude_code"
    config_model: ClassVar[type[HarnessConfig]] = ClaudeCodeConfig

    def files(self, ctx: HarnessContext) -> dict[str, str]:
        return {**self.mcp_servers(ctx, ctx.config.get("mcp_servers") or {}),
                **self.skills(ctx, ctx.config.get("skills") or {})}

    def env(self, ctx: HarnessContext) -> dict[str, str]:
        side = side_model(ctx)
        return {
            "ANTHROPIC_BASE_URL": ctx.gateway_url, "ANTHROPIC_API_KEY": ctx.key,
            "ANTHROPIC_SMALL_FAST_MODEL": side, "ANTHROPIC_DEFAULT_HAIKU_MODEL": side,
            "IS_SANDBOX": "1",  # lets --dangerously-skip-permissions run as root (the sandbox is the boundary)
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1", **NO_PHONE_HOME,
        }

    def command(self, ctx: HarnessContext) -> list[str]:
        return [binary(ctx, "claude_code"), "-p", ctx.instruction, "--model", ctx.model_name,
                "--dangerously-skip-permissions"]

    def log_paths(self, ctx: HarnessContext) -> list[str]:
        return [f"{ctx.home}/.claude/projects"]  # one JSONL transcript per session

    def mcp_servers(self, ctx: HarnessContext, servers: dict[str, Any]) -> dict[str, str]:
        state: dict[str, Any] = {"hasCompletedOnboarding": True}  # skips the first-run screens
        entries = {name: {"type": "stdio", "command": s.command, "args": s.args, "env": s.env}
                   for name, s in mcp_config(servers).items()}
        if entries:
            state["mcpServers"] = entries
        return {f"{ctx.home}/.claude.json": dump_json(state)}

    def skills(self, ctx: HarnessContext, skills: dict[str, str]) -> dict[str, str]:
        return skill_files(f"{ctx.home}/.claude/skills", skills)

    def side_models(self, ctx: HarnessContext) -> list[str]:
        return [side_model(ctx)]
