"""OpenClaw (``openclaw agent exec``): the general assistant's headless one-turn run, no Gateway daemon.

``agent exec`` runs one embedded agent turn: no approvals (its "full execution policy"), its own agent sandbox
off, the ``coding`` tool profile (the shell tool is ``exec``), filesystem tools limited to the working directory.
It needs Node >= 24.16 (the pin's wrapper runs it with the Node 24 wheel, see ``polar_gym.harness.install``).
``~/.openclaw/openclaw.json`` defines provider ``polar`` (``models.mode: replace`` drops the built-in catalog) in
pi's model format, since OpenClaw uses pi's model layer: the ``api`` (``AgentSpec.config["api"]``) picks the
protocol and the base URL (``/v1`` for the OpenAI ones, the bare URL for Anthropic), the session key is
``apiKey``. ``update.checkOnStart: false`` and ``OPENCLAW_NO_AUTO_UPDATE`` stop the update check (the only
documented phone-home), ``telemetry.enabled: false`` and ``DO_NOT_TRACK`` the feature statistics,
``OPENCLAW_OFFLINE`` the downloads of its helper binaries. ``--state-dir`` keeps the run's state, which exec
otherwise deletes: it must already exist, so it is ``~/.openclaw`` itself, which holds the config file; the
transcript is the SQLite database under ``agents/``. ``--timeout 0`` leaves the deadline to the gateway (exec's
own default is 600 s). ``--`` keeps an instruction that starts with ``-`` the prompt.
Outside HOME it writes a rolling log (``/tmp/openclaw/``) and lock files (``/tmp/openclaw-state-locks-<uid>/``),
in the sandbox's private ``/tmp``; the log is kept as an artifact with the state. Exit codes: 0 ok, 1 a model or
result error, 2 its own timeout. Side requests: none seen (compaction runs on the main model). With Chat
Completions and Anthropic it moves an internal context message to the end of every request, so each call starts a
new chain (``history_edited``) and trace; with ``openai-responses`` a session's calls merge.
Memory: a two-call run peaks at about 1.3 GB of anonymous memory (the main isolate and up to six worker-thread
isolates for its SQLite stores, each loading much of its code), over the local sandbox's default of 1024 MB, which
then kills it (exit 137): :attr:`min_memory_mb` has the gateway give its sandbox 2048 MB unless the request or the
operator sets a limit. A process-wide
``--max-old-space-size=256`` only brings the peak to about 1 GB and would cap a long session's heap, so it is not set.
"""

from __future__ import annotations

from typing import Any, ClassVar

from polar_gym.harness._common import NO_PHONE_HOME, binary, dump_json
from polar_gym.harness.base import Harness, HarnessContext
from polar_gym.harness.config import HarnessConfig, OpenClawConfig

__all__ = ["API_PROVIDERS", "OpenClaw"]

#: OpenClaw's ``api`` value -> the proxy provider it talks to
API_PROVIDERS = {"openai-completions": "openai_chat", "openai-responses": "openai_responses",
                 "anthropic-messages": "anthropic"}
_BASE_PATH = {"openai-completions": "/v1", "openai-responses": "/v1", "anthropic-messages": ""}
_PROVIDER = "polar"
#: the rolling log agent exec writes whatever logging.file says
TMP_LOG_DIR = "/tmp/openclaw"


#: how long its exec tool waits for a command before moving it to the background, where the agent must poll it with
#: its process tool: its own default is 10 s, after which a slow command (a test run on a loaded machine) goes on
#: behind the agent, and a policy that answers instead of polling ends the session with it unfinished; 120 s is the
#: most it takes
_YIELD_MS = 120_000


class OpenClaw(Harness):
    name: ClassVar[str] = "openclaw"
    provider: ClassVar[str] = "openai_chat"  # the default api's; see provider_for
    pin: ClassVar[str | None] = "openclaw"
    config_model: ClassVar[type[HarnessConfig]] = OpenClawConfig
    min_memory_mb: ClassVar[int | None] = 2048

    def _api(self, ctx: HarnessContext) -> str:
        return self.settings(ctx, OpenClawConfig).api

    def _state_dir(self, ctx: HarnessContext) -> str:
        return f"{ctx.home}/.openclaw"

    def provider_for(self, ctx: HarnessContext) -> str:
        return API_PROVIDERS[self._api(ctx)]

    def files(self, ctx: HarnessContext) -> dict[str, str]:
        api = self._api(ctx)
        model = {"id": ctx.model_name, "name": ctx.model_name, "reasoning": True, "input": ["text"],
                 "contextWindow": 131072, "maxTokens": 32768}
        config: dict[str, Any] = {
            "update": {"checkOnStart": False},
            "telemetry": {"enabled": False},
            "models": {"mode": "replace", "providers": {_PROVIDER: {
                "baseUrl": ctx.gateway_url + _BASE_PATH[api], "apiKey": ctx.key, "api": api, "models": [model]}}},
            "agents": {"defaults": {"model": {"primary": f"{_PROVIDER}/{ctx.model_name}"}}},
        }
        return {f"{self._state_dir(ctx)}/openclaw.json": dump_json(config)}

    def env(self, ctx: HarnessContext) -> dict[str, str]:
        return {"OPENCLAW_NO_AUTO_UPDATE": "1", "OPENCLAW_OFFLINE": "1", "OPENCLAW_BASH_YIELD_MS": str(_YIELD_MS),
                **NO_PHONE_HOME}

    def command(self, ctx: HarnessContext) -> list[str]:
        return [binary(ctx, "openclaw"), "agent", "exec", "--json", "--model", f"{_PROVIDER}/{ctx.model_name}",
                "--state-dir", self._state_dir(ctx), "--timeout", "0", "--", ctx.instruction]

    def log_paths(self, ctx: HarnessContext) -> list[str]:
        return [f"{self._state_dir(ctx)}/agents", TMP_LOG_DIR]
