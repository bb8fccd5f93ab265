"""A custom evaluator, as a user would write one outside this package, and reach by dotted path::

    evaluator: {strategy: "polar_gym.evaluate.examples:FinalAnswerContains", config: {text: "42"}}

It scores the agent's last message (no runtime needed) and shows per-trace rewards: the trace holding the final
answer gets the reward, the others 0.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from polar_gym.evaluate.base import EvalContext, Evaluator
from polar_gym.evaluate.errors import EvaluatorConfigError
from polar_gym.schema import EvalResult

__all__ = ["FinalAnswerConfig", "FinalAnswerContains", "message_text"]


def message_text(message: dict[str, Any]) -> str:
    """The text of a chat message whose content is a string or a list of parts."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


class FinalAnswerConfig(BaseModel):
    """Its config keys (a plug-in declares them so ``launch`` can refuse a typo before any session)."""

    model_config = ConfigDict(extra="forbid")

    text: str
    ignore_case: bool = False


class FinalAnswerContains(Evaluator):
    """Reward 1.0 when the last assistant message contains ``config["text"]`` (``ignore_case`` optional)."""

    name: ClassVar[str] = "final_answer_contains"
    config_model: ClassVar[type[BaseModel]] = FinalAnswerConfig

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        if not isinstance(self.config.get("text"), str):
            raise EvaluatorConfigError("final_answer_contains needs config.text (a string)")

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        needle: str = self.config["text"]
        fold = bool(self.config.get("ignore_case", False))
        traces = ctx.trajectory.traces
        last = next(((i, m) for i in range(len(traces) - 1, -1, -1) for m in reversed(traces[i].response_messages)
                     if m.get("role") == "assistant" and message_text(m)), None)
        if last is None:
            return EvalResult(reward=0.0, passed=False, per_trace_rewards=[0.0] * len(traces) or None,
                              details={"reason": "no assistant text in the trajectory"})
        index, message = last
        text = message_text(message)
        found = (needle.lower() in text.lower()) if fold else (needle in text)
        reward = 1.0 if found else 0.0
        per_trace = [reward if i == index else 0.0 for i in range(len(traces))]
        return EvalResult(reward=reward, passed=found, per_trace_rewards=per_trace,
                          details={"reason": f"final answer {'contains' if found else 'lacks'} {needle!r}",
                                   "trace": index})
