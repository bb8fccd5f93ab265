"""Hermes Agent (``hermes -z``): Nous Research's agent, one prompt, its final answer on stdout.

``-z`` (oneshot) needs no TTY and turns approvals off itself (yolo; only its hard-line blocks, such as ``rm -rf /``,
still refuse); ``approvals.mode: off`` says so in the config too. It speaks streamed OpenAI Chat Completions to a
``custom`` provider set in ``$HERMES_HOME/config.yaml`` (no environment variable sets its URL and key; YAML being a
superset of JSON, the file is written as JSON). ``-t`` keeps its tools to the ``terminal`` and ``file`` toolsets
(its default set adds web search, a browser, vision and speech, which reach the internet); the terminal runs each
command in the working directory on the ``local`` backend, with the real HOME. What the config turns off: the
OpenRouter model-metadata fetch (``model.context_length`` given), the model catalog, the tirith scanner; API retries
are cut to two so a gateway that is gone ends the run in seconds. Side requests: every ``auxiliary`` task
(compression, titles, the curator...) is given the side model on the main endpoint, so the proxy flags its calls.

Exit code: hermes exits 0 when the model API failed (it prints the error as its answer); its ``--usage-file`` report
says ``"failed": true``. The command therefore runs it under ``sh``, which turns a 0 with that report into 1.
``state.db`` (SQLite: every message), its logs and the usage report are kept as artifacts.
"""

from __future__ import annotations

from typing import Any, ClassVar

from polar_gym.harness._common import NO_PHONE_HOME, binary, dump_json, side_model
from polar_gym.harness.base import Harness, HarnessContext
from polar_gym.harness.config import HarnessConfig, HermesConfig

__all__ = ["Hermes"]

#: hermes 0.19.0's auxiliary tasks (DEFAULT_CONFIG["auxiliary"]); each falls back to the main model unless named
AUX_TASKS = ("vision", "web_extract", "compression", "skills_hub", "approval", "mcp", "title_generation",
             "memory_query_rewrite", "tts_audio_tags", "triage_specifier", "kanban_decomposer", "profile_describer",
             "goal_judge", "curator", "monitor")

#: run hermes ("$@"), then fail a run whose usage report ($1) says it failed although hermes exited 0
_FAIL_ON_REPORT = ('usage="$1"; shift; rm -f "$usage"; "$@"; code=$?; '
                   'if [ "$code" = 0 ] && grep -q \'"failed": true\' "$usage" 2>/dev/null; then '
                   'echo "hermes: the usage report says the run failed" >&2; code=1; fi; exit "$code"')


class Hermes(Harness):
    name: ClassVar[str] = "hermes"
    provider: ClassVar[str] = "openai_chat"
    pin: ClassVar[str | None] = "hermes"
    config_model: ClassVar[type[HarnessConfig]] = HermesConfig

    def _settings(self, ctx: HarnessContext) -> HermesConfig:
        return self.settings(ctx, HermesConfig)

    def _hermes_home(self, ctx: HarnessContext) -> str:
        return f"{ctx.home}/.hermes"

    def _usage_file(self, ctx: HarnessContext) -> str:
        return f"{ctx.home}/hermes-usage.json"

    def files(self, ctx: HarnessContext) -> dict[str, str]:
        side = side_model(ctx)
        config: dict[str, Any] = {
            "model": {"provider": "custom", "base_url": f"{ctx.gateway_url}/v1", "api_key": ctx.key,
                      "default": ctx.model_name, "context_length": 131072},
            "auxiliary": {task: {"model": side} for task in AUX_TASKS},
            "agent": {"max_turns": self._settings(ctx).max_turns, "api_max_retries": 2},
            "terminal": {"backend": "local", "cwd": ".", "home_mode": "real"},
            "approvals": {"mode": "off"},
            "security": {"tirith_enabled": False},
            "model_catalog": {"enabled": False},
        }
        return {f"{self._hermes_home(ctx)}/config.yaml": dump_json(config)}

    def env(self, ctx: HarnessContext) -> dict[str, str]:
        return {"HERMES_HOME": self._hermes_home(ctx), **NO_PHONE_HOME}

    def command(self, ctx: HarnessContext) -> list[str]:
        usage = self._usage_file(ctx)
        return ["sh", "-c", _FAIL_ON_REPORT, "hermes", usage, binary(ctx, "hermes"), f"--oneshot={ctx.instruction}",
                "-t", ",".join(self._settings(ctx).toolsets), "--usage-file", usage]

    def log_paths(self, ctx: HarnessContext) -> list[str]:
        home = self._hermes_home(ctx)
        return [f"{home}/state.db", f"{home}/logs", self._usage_file(ctx)]

    def side_models(self, ctx: HarnessContext) -> list[str]:
        return [side_model(ctx)]
