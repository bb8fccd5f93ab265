"""Cline CLI (``cline --data-dir D --json PROMPT``): the Cline agent, one task in act mode, auto-approve on.

The npm package is a small Node wrapper (any node) around a Bun-compiled binary that its postinstall links in place.
A prompt argument runs one task with auto-approve on by default, and a text-only reply ends it. ``--yolo`` is not
used: it adds a ``submit_and_exit`` tool and refuses every turn that does not call it, so a policy that answers in
text loops until Cline gives up (and then exits 0). ``--data-dir`` is always given: without it Cline starts a
detached hub daemon that outlives the run; with it a local backend exits with the CLI. It is the default data dir
(``~/.cline/data``), because ``global-settings.json``, where ``telemetryOptOut`` turns off its OpenTelemetry export,
is read from there and not from ``--data-dir`` (``DO_NOT_TRACK`` does not stop it); ``autoUpdateEnabled`` and
``CLINE_NO_AUTO_UPDATE`` stop the npm update check. Its PostHog feature-flag fetch has no switch and fails
harmlessly in a sandbox that reaches only the gateway.
The protocol is the provider of ``settings/providers.json`` (``AgentSpec.config["api"]``): openai-compatible (Chat
Completions), openai-native (Responses) or anthropic (Messages; the base URL is honoured there too, although ``cline
auth`` refuses one), each with the gateway at ``/v1`` and the session key. An entry needs ``updatedAt`` and
``tokenSource``, else Cline silently replaces the file with its own ``cline`` provider. ``-P`` and ``-m`` name the
provider and model again on the command line; ``--`` keeps an instruction that starts with ``-`` the prompt.
Side requests: none; compaction runs on the main model. The session transcripts (``sessions/<id>/``) and
``logs/cline.log`` are kept as artifacts.
"""

from __future__ import annotations

from typing import Any, ClassVar

from polar_gym.harness._common import NO_PHONE_HOME, binary, dump_json
from polar_gym.harness.base import Harness, HarnessContext
from polar_gym.harness.config import ClineConfig, HarnessConfig

__all__ = ["API_PROVIDERS", "Cline"]

#: cline's provider id -> the proxy provider it talks to
API_PROVIDERS = {"openai-compatible": "openai_chat", "openai-native": "openai_responses", "anthropic": "anthropic"}
#: a fixed time: the file must carry one, and the same session renders the same text
_UPDATED_AT = "2026-01-01T00:00:00.000Z"


class Cline(Harness):
    name: ClassVar[str] = "cline"
    provider: ClassVar[str] = "openai_chat"  # the default api's; see provider_for
    pin: ClassVar[str | None] = "cline"
    config_model: ClassVar[type[HarnessConfig]] = ClineConfig

    def _api(self, ctx: HarnessContext) -> str:
        return self.settings(ctx, ClineConfig).api

    def _data_dir(self, ctx: HarnessContext) -> str:
        return f"{ctx.home}/.cline/data"

    def provider_for(self, ctx: HarnessContext) -> str:
        return API_PROVIDERS[self._api(ctx)]

    def files(self, ctx: HarnessContext) -> dict[str, str]:
        api = self._api(ctx)
        settings: dict[str, Any] = {"provider": api, "apiKey": ctx.key, "model": ctx.model_name,
                                    "baseUrl": f"{ctx.gateway_url}/v1"}
        providers = {"version": 1, "lastUsedProvider": api, "modes": {},
                     "providers": {api: {"settings": settings, "updatedAt": _UPDATED_AT, "tokenSource": "manual"}}}
        data = self._data_dir(ctx)
        return {f"{data}/settings/providers.json": dump_json(providers),
                f"{data}/settings/global-settings.json": dump_json({"telemetryOptOut": True,
                                                                    "autoUpdateEnabled": False})}

    def env(self, ctx: HarnessContext) -> dict[str, str]:
        return {"CLINE_NO_AUTO_UPDATE": "1", **NO_PHONE_HOME}

    def command(self, ctx: HarnessContext) -> list[str]:
        return [binary(ctx, "cline"), "--data-dir", self._data_dir(ctx), "--json", "-P", self._api(ctx),
                "-m", ctx.model_name, "--", ctx.instruction]

    def log_paths(self, ctx: HarnessContext) -> list[str]:
        data = self._data_dir(ctx)
        return [f"{data}/sessions", f"{data}/logs"]
