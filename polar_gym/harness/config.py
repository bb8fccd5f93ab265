"""The keys each harness accepts in ``AgentSpec.config`` (``+harness.config.KEY=VALUE``), as pydantic models.

Every adapter names its model in :attr:`polar_gym.harness.base.Harness.config_model`; unknown keys are refused, so
a typo (``+harness.config.side_modle=x``) fails when ``launch`` starts instead of being ignored. A harness added by
dotted path declares its own model (a subclass of :class:`HarnessConfig`) the same way.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "AiderConfig",
    "ClaudeCodeConfig",
    "ClineConfig",
    "CodexConfig",
    "CrushConfig",
    "GeminiCliConfig",
    "HarnessConfig",
    "HermesConfig",
    "McpServerConfig",
    "MiniSweAgentConfig",
    "OpenClawConfig",
    "OpenCodeConfig",
    "OpenHandsConfig",
    "PiConfig",
    "QwenCodeConfig",
    "ShellConfig",
]


class HarnessConfig(BaseModel):
    """Keys every harness takes."""

    model_config = ConfigDict(extra="forbid")

    cli_path: str | None = Field(default=None, description="the CLI binary inside the sandbox (default: the "
                                 "pinned install in the local sandbox, else the binary's name on PATH)")


class McpServerConfig(BaseModel):
    """One stdio MCP server."""

    model_config = ConfigDict(extra="forbid")

    command: str
    args: list[str | int | float] = Field(default_factory=list)
    env: dict[str, str | int | float | bool] = Field(default_factory=dict)


class _Mcp(HarnessConfig):
    mcp_servers: dict[str, McpServerConfig] = Field(default_factory=dict, description="MCP servers to register: "
                                                    "{name: {command, args, env}}")


class _SideModel(HarnessConfig):
    side_model: str | None = Field(default=None, description="the model name of the harness's side calls (titles, "
                                   "summaries); default: the session's model name + '-side'")


class CodexConfig(_Mcp):
    skills: dict[str, str] = Field(default_factory=dict, description="skills to install: {name: SKILL.md text}")


class ClaudeCodeConfig(_Mcp, _SideModel):
    skills: dict[str, str] = Field(default_factory=dict, description="skills to install: {name: SKILL.md text}")


class GeminiCliConfig(_Mcp):
    pass


class OpenCodeConfig(_Mcp, _SideModel):
    pass


class QwenCodeConfig(_Mcp, _SideModel):
    fast_model: bool = Field(default=False, description="give qwen code a separate fast model (side_model) for "
                             "its side calls, which the proxy then flags as side requests")


class PiConfig(HarnessConfig):
    api: Literal["openai-completions", "openai-responses", "anthropic-messages", "google-generative-ai"] = Field(
        default="openai-completions", description="the provider protocol pi speaks")


class ShellConfig(HarnessConfig):
    command: str | list[str] | None = Field(default=None, description="what to run: a shell string (sh -c, the "
                                            "instruction is $1) or an argv list; required to run a session")
    files: dict[str, str] = Field(default_factory=dict, description="{path: text} written before the run "
                                  "(relative paths are under the workdir)")
    provider: str = Field(default="openai_chat", description="the provider protocol the command speaks "
                          "(openai_chat, openai_responses, anthropic, google)")
    env: dict[str, str | int | float | bool] = Field(default_factory=dict, description="extra environment of "
                                                     "the command")
    log_paths: list[str] = Field(default_factory=list, description="files kept as the session's artifacts")
    side_models: list[str] = Field(default_factory=list, description="model names the command uses for side calls")


class MiniSweAgentConfig(HarnessConfig):
    api: Literal["openai-chat", "openai-responses", "anthropic"] = Field(
        default="openai-chat", description="the protocol litellm speaks to the proxy")
    step_limit: int = Field(default=100, ge=1, description="model calls before mini stops (its own default: none)")
    command_timeout: int = Field(default=600, ge=1, description="seconds one command may run (its own default: 30)")


class AiderConfig(_SideModel):
    edit_format: Literal["diff", "diff-fenced", "whole", "udiff"] = Field(
        default="diff", description="how aider reads edits from the reply (diff: SEARCH/REPLACE blocks; only the "
        "diff family runs suggested shell blocks)")
    files: list[str] = Field(default_factory=list, description="files to add to aider's chat (paths in the "
                             "working directory); aider shows the model only these")


class HermesConfig(_SideModel):
    toolsets: list[Annotated[str, Field(pattern=r"^[\w-]+$")]] = Field(
        default_factory=lambda: ["terminal", "file"], min_length=1, description="hermes toolsets to offer (-t); "
        "the default keeps out its web, browser, vision and speech tools, which reach the internet")
    max_turns: int = Field(default=90, ge=1, description="model calls before hermes stops (agent.max_turns)")


class OpenHandsConfig(_SideModel):
    api: Literal["openai-chat", "openai-responses", "anthropic"] = Field(
        default="openai-chat", description="the protocol litellm speaks to the proxy")
    max_iterations: int = Field(default=100, ge=1, description="agent steps before the run stops (the SDK's "
                                "max_iteration_per_run; its own default: 500)")


class ClineConfig(HarnessConfig):
    api: Literal["openai-compatible", "openai-native", "anthropic"] = Field(
        default="openai-compatible", description="the cline provider id, hence the protocol: openai-compatible "
        "(Chat Completions), openai-native (Responses), anthropic (Messages)")


class OpenClawConfig(HarnessConfig):
    api: Literal["openai-completions", "openai-responses", "anthropic-messages"] = Field(
        default="openai-completions", description="the protocol OpenClaw speaks (its provider's api, as pi's)")


class CrushConfig(_SideModel):
    api: Literal["openai-compat", "anthropic"] = Field(
        default="openai-compat", description="the type of crush's provider: openai-compat (Chat Completions) or "
        "anthropic (Messages)")
