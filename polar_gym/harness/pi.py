"""pi (``pi -p``): the one harness that speaks all four protocols, chosen by ``AgentSpec.config["api"]``.

``~/.pi/agent/models.json`` defines provider ``polar`` with the gateway as ``baseUrl`` (per API: ``/v1`` for the
OpenAI ones, the bare URL for Anthropic, ``/v1beta`` for Google) and the session key as ``apiKey``.
Side requests: none. pi makes no calls of its own in a ``-p`` run; compaction (long sessions only) runs on the main
model. pi has no MCP support by design, so :meth:`mcp_servers` stays the default.
"""

from __future__ import annotations

from typing import ClassVar

from polar_gym.harness._common import NO_PHONE_HOME, binary, dump_json
from polar_gym.harness.base import Harness, HarnessContext
from polar_gym.harness.config import HarnessConfig, PiConfig

__all__ = ["API_PROVIDERS", "Pi"]

#: pi's ``api`` value -> the proxy provider it talks to
API_PROVIDERS = {"openai-completions": "openai_chat", "openai-responses": "openai_responses",
                 "anthropic-messages": "anthropic", "google-generative-ai": "google"}
_BASE_PATH = {"openai-completions": "/v1", "openai-responses": "/v1", "anthropic-messages": "",
              "google-generative-ai": "/v1beta"}
_PROVIDER = "polar"


class Pi(Harness):
    name: ClassVar[str] = "pi"
    provider: ClassVar[str] = "openai_chat"  # the default api's; see provider_for
    pin: ClassVar[str | None] = "pi"
    config_model: ClassVar[type[HarnessConfig]] = PiConfig

    @staticmethod
    def api(ctx: HarnessContext) -> str:
        api = str(ctx.config.get("api", "openai-completions"))
        if api not in API_PROVIDERS:
            raise ValueError(f"pi api {api!r} is not one of {', '.join(API_PROVIDERS)}")
        return api

    def provider_for(self, ctx: HarnessContext) -> str:
        """The proxy provider this session's api speaks."""
        return API_PROVIDERS[self.api(ctx)]

    def files(self, ctx: HarnessContext) -> dict[str, str]:
        api = self.api(ctx)
        models = {"providers": {_PROVIDER: {"baseUrl": ctx.gateway_url + _BASE_PATH[api], "api": api,
                                            "apiKey": ctx.key,
                                            # "image": pi's read sends an image file to the model (issue 42)
                                            "models": [{"id": ctx.model_name, "reasoning": True,
                                                        "input": ["text", "image"]}]}}}
        return {f"{ctx.home}/.pi/agent/models.json": dump_json(models),
                f"{ctx.home}/.pi/agent/settings.json": dump_json({"enableInstallTelemetry": False})}

    def env(self, ctx: HarnessContext) -> dict[str, str]:
        return {"PI_OFFLINE": "1", "PI_SKIP_VERSION_CHECK": "1", "PI_TELEMETRY": "0", **NO_PHONE_HOME}

    def command(self, ctx: HarnessContext) -> list[str]:
        return [binary(ctx, "pi"), "--no-session", "--offline", "-p", "--provider", _PROVIDER,
                "--model", ctx.model_name, ctx.instruction]

    def log_paths(self, ctx: HarnessContext) -> list[str]:
        return []  # --no-session keeps no transcript; the proxy's journal holds every call
