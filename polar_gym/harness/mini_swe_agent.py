"""mini-swe-agent (``mini -y --exit-immediately``): the SWE-agent team's 100-line agent, through litellm.

It sends one ``bash`` tool and runs each call in a fresh shell in the working directory (its ``local``
environment); a run ends when a command's output starts with ``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` (its system
prompt tells the model so; the oracle follows that instruction), or at ``step_limit``. litellm picks the protocol
from the model name's prefix, chosen by ``AgentSpec.config["api"]``: ``openai/`` at ``OPENAI_API_BASE`` (Chat
Completions; Responses with ``--model-class litellm_response``) or ``anthropic/`` at ``ANTHROPIC_API_BASE``.
Quirks handled here: ``MSWEA_CONFIGURED`` skips its interactive first-run set-up (which aborts without a TTY);
``MSWEA_COST_TRACKING=ignore_errors`` keeps an unpriced model from failing the run after the first call;
``LITELLM_LOCAL_MODEL_COST_MAP`` stops litellm fetching its price list at import; retries are cut to two so a
gateway that is gone ends the run in seconds, not minutes. The trajectory file (``-o``) is kept as an artifact.
Side requests: none.
"""

from __future__ import annotations

from typing import ClassVar

from polar_gym.harness._common import NO_PHONE_HOME, binary
from polar_gym.harness.base import Harness, HarnessContext
from polar_gym.harness.config import HarnessConfig, MiniSweAgentConfig

__all__ = ["MiniSweAgent"]

#: config ``api`` -> (proxy provider, litellm prefix, extra argv)
_APIS = {"openai-chat": ("openai_chat", "openai", []),
         "openai-responses": ("openai_responses", "openai", ["--model-class", "litellm_response"]),
         "anthropic": ("anthropic", "anthropic", [])}


class MiniSweAgent(Harness):
    name: ClassVar[str] = "mini_swe_agent"
    provider: ClassVar[str] = "openai_chat"
    pin: ClassVar[str | None] = "mini_swe_agent"
    config_model: ClassVar[type[HarnessConfig]] = MiniSweAgentConfig

    def _settings(self, ctx: HarnessContext) -> MiniSweAgentConfig:
        return self.settings(ctx, MiniSweAgentConfig)

    def provider_for(self, ctx: HarnessContext) -> str:
        return _APIS[self._settings(ctx).api][0]

    def env(self, ctx: HarnessContext) -> dict[str, str]:
        api = self._settings(ctx).api
        base = ({"ANTHROPIC_API_BASE": ctx.gateway_url, "ANTHROPIC_API_KEY": ctx.key} if api == "anthropic" else
                {"OPENAI_API_BASE": f"{ctx.gateway_url}/v1", "OPENAI_API_KEY": ctx.key})
        return {**base, "MSWEA_CONFIGURED": "true", "MSWEA_COST_TRACKING": "ignore_errors",
                "MSWEA_SILENT_STARTUP": "1", "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "2",
                "MSWEA_GLOBAL_CONFIG_DIR": f"{ctx.home}/.config/mini-swe-agent",
                "LITELLM_LOCAL_MODEL_COST_MAP": "True", **NO_PHONE_HOME}

    def command(self, ctx: HarnessContext) -> list[str]:
        config = self._settings(ctx)
        _, prefix, extra = _APIS[config.api]
        return [binary(ctx, "mini_swe_agent"), "-y", "--exit-immediately", "-m", f"{prefix}/{ctx.model_name}", *extra,
                "-c", "mini.yaml", "-c", f"agent.step_limit={config.step_limit}",
                "-c", f"environment.timeout={config.command_timeout}", f"--task={ctx.instruction}",
                "-o", f"{ctx.home}/mini.traj.json"]  # --task=: an instruction starting with "-" stays the task

    def log_paths(self, ctx: HarnessContext) -> list[str]:
        return [f"{ctx.home}/mini.traj.json"]  # every message, each raw response, the exit status
