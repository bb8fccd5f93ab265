"""A generic shell harness: any command the user gives (``AgentSpec.config["command"]``), told the instruction.

The command talks to the gateway however it likes (curl, a Python script with an SDK, a CLI we have no adapter for).
It gets, in its environment:

- ``POLAR_INSTRUCTION`` (the task), ``POLAR_MODEL`` (the model name to send), ``POLAR_GATEWAY_URL`` (no ``/v1``),
  ``POLAR_API_KEY`` (the session's secret key, served only while it runs), ``POLAR_SESSION_ID``;
- the usual SDK variables, so unmodified OpenAI / Anthropic / Gemini clients reach the gateway:
  ``OPENAI_BASE_URL``, ``OPENAI_API_KEY``, ``ANTHROPIC_BASE_URL``, ``ANTHROPIC_API_KEY``, ``GEMINI_API_KEY``,
  ``GOOGLE_GEMINI_BASE_URL``;
- ``config["env"]`` on top.

A string command runs as ``sh -c COMMAND polar-shell INSTRUCTION`` (so ``"$1"`` is the instruction too); a list runs
as given. ``config["files"]`` ({path: text}; relative paths are under the workdir) ships scripts along;
``config["provider"]`` names the protocol it speaks (default ``openai_chat``); ``config["log_paths"]`` lists artifacts.
Side requests: the command decides; any call with a model name other than ``POLAR_MODEL`` is flagged, and
``config["side_models"]`` lists the names it uses for them.
"""

from __future__ import annotations

import posixpath
from typing import ClassVar

from polar_gym.harness.base import Harness, HarnessContext
from polar_gym.harness.config import HarnessConfig, ShellConfig

__all__ = ["ShellHarness"]


class ShellHarness(Harness):
    name: ClassVar[str] = "shell"
    provider: ClassVar[str] = "openai_chat"
    pin: ClassVar[str | None] = None
    config_model: ClassVar[type[HarnessConfig]] = ShellConfig

    def provider_for(self, ctx: HarnessContext) -> str:
        return str(ctx.config.get("provider", self.provider))

    def files(self, ctx: HarnessContext) -> dict[str, str]:
        return {posixpath.join(ctx.workdir, path): text for path, text in (ctx.config.get("files") or {}).items()}

    def env(self, ctx: HarnessContext) -> dict[str, str]:
        url, key = ctx.gateway_url, ctx.key
        return {
            "POLAR_INSTRUCTION": ctx.instruction, "POLAR_MODEL": ctx.model_name, "POLAR_GATEWAY_URL": url,
            "POLAR_API_KEY": key, "POLAR_SESSION_ID": ctx.session_id,
            "OPENAI_BASE_URL": f"{url}/v1", "OPENAI_API_KEY": key, "ANTHROPIC_BASE_URL": url,
            "ANTHROPIC_API_KEY": key, "GEMINI_API_KEY": key, "GOOGLE_GEMINI_BASE_URL": url,
            **{str(k): str(v) for k, v in (ctx.config.get("env") or {}).items()},
        }

    def command(self, ctx: HarnessContext) -> list[str]:
        command = ctx.config.get("command")
        if isinstance(command, str) and command.strip():
            return ["sh", "-c", command, "polar-shell", ctx.instruction]
        if isinstance(command, list) and command and all(isinstance(a, str) for a in command):
            return list(command)
        raise ValueError("the shell harness needs config['command']: a shell string or a non-empty argv list")

    def log_paths(self, ctx: HarnessContext) -> list[str]:
        return [posixpath.join(ctx.workdir, p) for p in ctx.config.get("log_paths") or []]

    def side_models(self, ctx: HarnessContext) -> list[str]:
        return [str(m) for m in ctx.config.get("side_models") or [] if m != ctx.model_name]
