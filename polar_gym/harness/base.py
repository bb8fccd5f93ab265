"""The harness adapter interface: what it takes to run one unmodified agent CLI against the gateway.

An adapter is a small class of attributes and pure methods (no protocol logic, no I/O): the config files and
environment that point the CLI at the gateway with the session's secret key (``ctx.key``) as its API key, the
non-interactive run command, and where its logs are. Files holding the key are written under ``ctx.home`` (the
session's own directory), never to a shared place; the key dies with the session's RUNNING stage. The gateway
writes the files, runs the command in the session's runtime and collects the logs. A new harness is one small file
registered in ``polar_gym.registry.HARNESSES``.

Side requests: harnesses make calls of their own (titles, summaries, memory scans). The proxy flags a call as a side
request when its model name differs from the session's ``model_name``, so adapters configure the CLI's side calls to
use another name where the CLI allows it, and :meth:`Harness.side_models` names them (for the gateway's model list).
Extra config (``AgentSpec.config``, its keys declared per adapter in :attr:`Harness.config_model`):
``mcp_servers`` ({name: {command, args, env}}) and ``skills`` ({name: SKILL.md
text}) are folded into :meth:`Harness.files` by the adapters that support them.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from polar_gym.harness.config import HarnessConfig

__all__ = ["Harness", "HarnessContext"]

C = TypeVar("C", bound=HarnessConfig)


@dataclass(frozen=True)
class HarnessContext:
    """Everything an adapter may use; paths are as seen inside the sandbox."""

    session_id: str
    instruction: str
    model_name: str  # the model name the harness is told to use
    gateway_url: str  # the proxy's base URL inside the sandbox (no trailing /v1)
    workdir: str
    home: str
    cli_path: str | None = None  # the CLI binary inside the sandbox (from the pinned install), when it has one
    config: dict[str, Any] = field(default_factory=dict)  # AgentSpec.config: per-harness options
    #: the secret the harness sends as its API key; served only while the session runs (None: the session id,
    #: which only a standalone proxy in ad-hoc mode accepts)
    api_key: str | None = field(default=None, repr=False)

    @property
    def key(self) -> str:
        """The API key to configure: ``api_key``, else the session id (ad-hoc mode)."""
        return self.api_key if self.api_key is not None else self.session_id


class Harness(abc.ABC):
    name: ClassVar[str]
    #: the provider protocol it speaks by default (anthropic, openai_chat, openai_responses, google)
    provider: ClassVar[str]
    #: key into polar_gym.harness.install.PINS, or None for harnesses that need no npm package
    pin: ClassVar[str | None] = None
    #: the keys it accepts in ``AgentSpec.config`` (unknown keys are refused when ``launch`` starts)
    config_model: ClassVar[type[HarnessConfig]] = HarnessConfig
    #: the sandbox memory (MB) it needs, when more than a runtime's default: the gateway gives it that much unless
    #: the request (``runtime.memory_mb``) or the operator (``runtime_options.memory_mb``) sets a limit
    min_memory_mb: ClassVar[int | None] = None

    @classmethod
    def validate_config(cls, config: dict[str, Any]) -> HarnessConfig:
        """``config`` as this harness's config model (raises pydantic's ValidationError naming each bad key)."""
        return cls.config_model.model_validate(config)

    def settings(self, ctx: HarnessContext, model: type[C]) -> C:
        """The session's ``AgentSpec.config`` as ``model`` (this harness's :attr:`config_model`), validated."""
        config = self.validate_config(ctx.config)
        if not isinstance(config, model):
            raise TypeError(f"{type(self).__name__}.config_model is {self.config_model.__name__}, not {model.__name__}")
        return config

    def provider_for(self, ctx: HarnessContext) -> str:
        """The provider this session speaks (differs from ``provider`` only for harnesses configured per session)."""
        return self.provider

    def files(self, ctx: HarnessContext) -> dict[str, str]:
        """Config files to write before the run: absolute path inside the sandbox -> content."""
        return {}

    def env(self, ctx: HarnessContext) -> dict[str, str]:
        """Environment of the run (on top of HOME, PATH and the runtime's own)."""
        return {}

    @abc.abstractmethod
    def command(self, ctx: HarnessContext) -> list[str]:
        """The non-interactive run command (argv)."""

    def log_paths(self, ctx: HarnessContext) -> list[str]:
        """Files or directories inside the sandbox to keep as the session's artifacts after the run."""
        return []

    def mcp_servers(self, ctx: HarnessContext, servers: dict[str, Any]) -> dict[str, str]:
        """Config files that register MCP servers, for harnesses that support them (default: none). Each returned
        file is complete (the harness's settings plus the servers), so it replaces a same-path file of files()."""
        return {}

    def skills(self, ctx: HarnessContext, skills: dict[str, str]) -> dict[str, str]:
        """Files that install skills ({name: SKILL.md text}), for harnesses that load them (default: none)."""
        return {}

    def side_models(self, ctx: HarnessContext) -> list[str]:
        """Model names the harness uses for its own side calls (titles, summaries), all different from
        ``ctx.model_name``; empty when its side calls cannot be told apart by name."""
        return []
