"""OpenHands (the ``openhands-sdk`` agent, through a runner script): the OpenHands agent loop, run locally.

The SDK has no CLI, so the adapter writes ``openhands_runner.py`` (shipped next to this module; it builds the SDK's
default CLI agent) into the session's home and runs it with the pinned venv's ``python``. Tools run in-process:
``terminal`` is a bash on a pty in the working directory (``/dev/ptmx`` is needed), ``file_editor`` edits files;
nothing asks for confirmation (no confirmation policy, no security analyzer). A run ends when the model answers in
text or calls ``finish``, or at ``max_iterations``; the runner exits 1 unless the conversation finished. litellm
picks the protocol from the model name's prefix, chosen by ``AgentSpec.config["api"]``: ``openai/`` at
``<gateway>/v1`` (Chat Completions, not streamed; Responses with ``api_mode="responses"``) or ``anthropic/`` at the
gateway. ``LITELLM_LOCAL_MODEL_COST_MAP`` stops litellm fetching its price list at import (its Laminar tracing is off
without its keys). Each request asks for ``reasoning_effort: high`` (the SDK's default). The conversation's events
are kept as an artifact. Side requests: the summarizing condenser (long runs only) uses the side model.
"""

from __future__ import annotations

from importlib import resources
from typing import ClassVar

from polar_gym.harness._common import NO_PHONE_HOME, binary, side_model
from polar_gym.harness.base import Harness, HarnessContext
from polar_gym.harness.config import HarnessConfig, OpenHandsConfig

__all__ = ["RUNNER", "OpenHands"]

#: the runner script's text (read once, at import: adapters do no I/O while they render)
RUNNER = resources.files("polar_gym.harness").joinpath("openhands_runner.py").read_text()

#: config ``api`` -> (proxy provider, litellm prefix, the SDK's api_mode, base URL path)
_APIS = {"openai-chat": ("openai_chat", "openai", "chat", "/v1"),
         "openai-responses": ("openai_responses", "openai", "responses", "/v1"),
         "anthropic": ("anthropic", "anthropic", "chat", "")}


class OpenHands(Harness):
    name: ClassVar[str] = "openhands"
    provider: ClassVar[str] = "openai_chat"
    pin: ClassVar[str | None] = "openhands"
    config_model: ClassVar[type[HarnessConfig]] = OpenHandsConfig

    def _settings(self, ctx: HarnessContext) -> OpenHandsConfig:
        return self.settings(ctx, OpenHandsConfig)

    def _runner(self, ctx: HarnessContext) -> str:
        return f"{ctx.home}/openhands_runner.py"

    def _conversations(self, ctx: HarnessContext) -> str:
        return f"{ctx.home}/openhands-conversations"

    def provider_for(self, ctx: HarnessContext) -> str:
        return _APIS[self._settings(ctx).api][0]

    def files(self, ctx: HarnessContext) -> dict[str, str]:
        return {self._runner(ctx): RUNNER}

    def env(self, ctx: HarnessContext) -> dict[str, str]:
        config = self._settings(ctx)
        _, prefix, api_mode, path = _APIS[config.api]
        return {"POLAR_OH_MODEL": f"{prefix}/{ctx.model_name}", "POLAR_OH_SIDE_MODEL": f"{prefix}/{side_model(ctx)}",
                "POLAR_OH_BASE_URL": f"{ctx.gateway_url}{path}", "POLAR_OH_API_KEY": ctx.key,
                "POLAR_OH_API_MODE": api_mode, "POLAR_OH_MAX_ITERATIONS": str(config.max_iterations),
                "POLAR_OH_CONVERSATIONS": self._conversations(ctx), "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                "OPENHANDS_SUPPRESS_BANNER": "1", **NO_PHONE_HOME}

    def command(self, ctx: HarnessContext) -> list[str]:
        return [binary(ctx, "openhands"), self._runner(ctx), ctx.instruction]

    def log_paths(self, ctx: HarnessContext) -> list[str]:
        return [self._conversations(ctx)]  # base_state.json and one JSON file per event

    def side_models(self, ctx: HarnessContext) -> list[str]:
        return [side_model(ctx)]
