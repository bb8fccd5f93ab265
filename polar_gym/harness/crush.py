"""Crush (``crush run -q``): Charm's terminal agent, one prompt, its answer on stdout. Not installed by polar_gym.

Its npm package (``@charmland/crush``) holds no binary: its postinstall downloads the release tarball from GitHub,
which machines that reach only package registries cannot, so Crush has no pin (``pin = None``); the command runs
``AgentSpec.config["cli_path"]`` or ``crush`` on PATH (docs/harnesses/crush.md). Written from Crush's source and
docs, not run here. ``crush run`` approves every tool call itself and drops the question tool (no TTY needed).
The config is ``crush.json`` in ``$CRUSH_GLOBAL_CONFIG`` (set under HOME, so no ``XDG_CONFIG_HOME`` moves it): a
custom provider ``polar`` of type ``openai-compat`` (Chat Completions at ``/v1``) or ``anthropic`` (Messages, base
URL ``/v1``; ``AgentSpec.config["api"]``), the session key as ``api_key``, its ``large`` model the session's and its
``small`` model (titles, summaries) the side model, so the proxy flags those calls. Metrics (PostHog) and the
provider catalog update (Catwalk) are off by option and by environment, and the built-in providers are hidden.
``--data-dir`` moves its sessions database and log from ``<cwd>/.crush/``, which would land in the task's
repository, to HOME; they are kept as artifacts. Its ``bash`` tool refuses a list of commands (curl, wget, sudo,
apt-get, ...), so a task's reference solution run through it must avoid them.
"""

from __future__ import annotations

from typing import Any, ClassVar

from polar_gym.harness._common import NO_PHONE_HOME, dump_json, side_model
from polar_gym.harness.base import Harness, HarnessContext
from polar_gym.harness.config import CrushConfig, HarnessConfig

__all__ = ["API_PROVIDERS", "Crush"]

#: crush's provider ``type`` -> the proxy provider it talks to
API_PROVIDERS = {"openai-compat": "openai_chat", "anthropic": "anthropic"}
_PROVIDER = "polar"


class Crush(Harness):
    name: ClassVar[str] = "crush"
    provider: ClassVar[str] = "openai_chat"  # the default api's; see provider_for
    pin: ClassVar[str | None] = None  # see the module docstring: not installable from a package registry
    config_model: ClassVar[type[HarnessConfig]] = CrushConfig

    def _settings(self, ctx: HarnessContext) -> CrushConfig:
        return self.settings(ctx, CrushConfig)

    def _api(self, ctx: HarnessContext) -> str:
        return self._settings(ctx).api

    def _config_dir(self, ctx: HarnessContext) -> str:
        return f"{ctx.home}/.config/crush"

    def _data_dir(self, ctx: HarnessContext) -> str:
        return f"{ctx.home}/.crush"

    def provider_for(self, ctx: HarnessContext) -> str:
        return API_PROVIDERS[self._api(ctx)]

    def files(self, ctx: HarnessContext) -> dict[str, str]:
        side = side_model(ctx)
        models = [{"id": m, "name": m, "context_window": 131072, "default_max_tokens": 32768}
                  for m in (ctx.model_name, side)]
        config: dict[str, Any] = {
            "$schema": "https://charm.land/crush.json",
            "providers": {_PROVIDER: {"type": self._api(ctx), "base_url": f"{ctx.gateway_url}/v1",
                                      "api_key": ctx.key, "models": models}},
            "models": {"large": {"provider": _PROVIDER, "model": ctx.model_name},
                       "small": {"provider": _PROVIDER, "model": side}},
            "options": {"disable_provider_auto_update": True, "disable_metrics": True,
                        "disable_default_providers": True},
        }
        return {f"{self._config_dir(ctx)}/crush.json": dump_json(config)}

    def env(self, ctx: HarnessContext) -> dict[str, str]:
        return {"CRUSH_GLOBAL_CONFIG": self._config_dir(ctx), "CRUSH_GLOBAL_DATA": f"{ctx.home}/.local/share/crush",
                "CRUSH_DISABLE_METRICS": "1", "CRUSH_DISABLE_PROVIDER_AUTO_UPDATE": "1",
                "CRUSH_DISABLE_DEFAULT_PROVIDERS": "1", **NO_PHONE_HOME}

    def command(self, ctx: HarnessContext) -> list[str]:
        return [ctx.cli_path or self._settings(ctx).cli_path or "crush", "run", "--data-dir", self._data_dir(ctx), "-q",
                "-m", f"{_PROVIDER}/{ctx.model_name}", "--small-model", f"{_PROVIDER}/{side_model(ctx)}",
                "--", ctx.instruction]

    def log_paths(self, ctx: HarnessContext) -> list[str]:
        return [self._data_dir(ctx)]  # crush.db (every session's messages) and logs/crush.log

    def side_models(self, ctx: HarnessContext) -> list[str]:
        return [side_model(ctx)]
