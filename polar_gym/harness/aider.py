"""aider (``aider --message``): the pair programmer, one instruction, edits applied by its edit format.

aider offers the model no tools: it reads edits from the reply's text (``--edit-format diff``: SEARCH/REPLACE
blocks) and, in that format, runs the ```` ```bash ```` blocks the reply suggests. It asks before each of those
steps; ``--yes-always`` answers "no" to running commands, so it is not used: stdin is closed, and every question then
takes its default, which is "yes" in 0.86.2. That is why every opt-out below is given as a flag (analytics, update
check, release notes, model warnings, URL scraping, ``git init``): a "yes" would otherwise opt in. One ``--message``
run is one model call, plus up to three reflections (a failed edit, lint errors); command output goes back into
aider's chat, not to the model, so aider is not an agent loop. Its chat and LLM logs, which it would otherwise
write into the task's directory, go to HOME and are kept as artifacts. It exits 0 even when the model call failed:
the evaluator, not the exit code, judges the run. The protocol is OpenAI Chat Completions (``openai/`` model names
at ``OPENAI_API_BASE``, streamed); ``~/.aider.model.metadata.json`` describes the models, so neither aider nor
litellm fetches a price list. Side requests: the weak model (commit messages, chat summaries) is the side model,
so the proxy flags its calls; with ``--no-git`` and one message it makes none.
"""

from __future__ import annotations

from typing import ClassVar

from polar_gym.harness._common import NO_PHONE_HOME, binary, dump_json, side_model
from polar_gym.harness.base import Harness, HarnessContext
from polar_gym.harness.config import AiderConfig, HarnessConfig

__all__ = ["Aider"]

_NO_OPT_INS = ["--no-git", "--no-analytics", "--no-check-update", "--no-show-model-warnings",
               "--no-show-release-notes", "--no-pretty", "--no-fancy-input", "--no-detect-urls",
               "--disable-playwright", "--no-auto-lint", "--map-tokens", "0"]


def _metadata() -> dict[str, object]:
    return {"max_input_tokens": 131072, "max_output_tokens": 32768, "max_tokens": 32768,
            "input_cost_per_token": 0, "output_cost_per_token": 0, "litellm_provider": "openai", "mode": "chat"}


class Aider(Harness):
    name: ClassVar[str] = "aider"
    provider: ClassVar[str] = "openai_chat"
    pin: ClassVar[str | None] = "aider"
    config_model: ClassVar[type[HarnessConfig]] = AiderConfig

    def files(self, ctx: HarnessContext) -> dict[str, str]:
        models = {f"openai/{m}": _metadata() for m in (ctx.model_name, side_model(ctx))}
        return {f"{ctx.home}/.aider.model.metadata.json": dump_json(models)}

    def env(self, ctx: HarnessContext) -> dict[str, str]:
        return {"OPENAI_API_BASE": f"{ctx.gateway_url}/v1", "OPENAI_API_KEY": ctx.key,
                "LITELLM_LOCAL_MODEL_COST_MAP": "True", **NO_PHONE_HOME}

    def command(self, ctx: HarnessContext) -> list[str]:
        config = self.settings(ctx, AiderConfig)
        return [binary(ctx, "aider"), "--model", f"openai/{ctx.model_name}",
                "--weak-model", f"openai/{side_model(ctx)}", "--edit-format", config.edit_format,
                "--model-metadata-file", f"{ctx.home}/.aider.model.metadata.json", *_NO_OPT_INS,
                "--chat-history-file", f"{ctx.home}/aider.chat.md",
                "--input-history-file", f"{ctx.home}/aider.input.history",
                "--llm-history-file", f"{ctx.home}/aider.llm.log", f"--message={ctx.instruction}",
                *(["--", *config.files] if config.files else [])]  # a file named like an option stays a file

    def log_paths(self, ctx: HarnessContext) -> list[str]:
        return [f"{ctx.home}/aider.chat.md", f"{ctx.home}/aider.llm.log"]

    def side_models(self, ctx: HarnessContext) -> list[str]:
        return [side_model(ctx)]
