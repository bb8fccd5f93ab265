"""``rubric``: an outcome evaluator's reward plus an LLM judge's per-trace score (a process reward).

Each trace of the session is shown to the judge with its tool outputs (the conversation up to the trace's last
reply) and scored from 0 to ``max_score`` against ``rubric``; its reward is ``outcome + weight * score /
max_score`` (Polar upstream's ``harbor_rubric``: weight 0.2, scores 0-5, 32 traces per judge call). The outcome comes
from the evaluator ``outcome`` names (the task's tests, a Harbor verifier, ...); the judge is one the operator
configured on the gateway (``judges``, :mod:`polar_gym.evaluate.judge`), named here by ``judge``, never a URL a task
gives. A judge that is down or answers garbage ends the session ERROR with ``judge_unreachable`` or
``judge_garbage``, unscored: a 0 would read as the policy's failure.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from polar_gym.evaluate.base import EvalContext, Evaluator, EvaluatorConfig, checked_evaluation
from polar_gym.evaluate.errors import EvaluatorConfigError
from polar_gym.evaluate.judge import JUDGE_UNREACHABLE, JudgeError, JudgeItem, transcript
from polar_gym.registry import EVALUATORS
from polar_gym.schema import EvalResult, EvaluatorSpec

__all__ = ["DEFAULT_RUBRIC", "Rubric", "RubricConfig"]

DEFAULT_RUBRIC = ("Score how well the agent worked toward the user's goal: it read the relevant code and outputs "
                  "before acting, its commands were purposeful and their results were checked, it did not repeat "
                  "failing actions, and it stopped when the task was done.")


class OutcomeSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    strategy: str = Field(default="session_completed", description="the outcome's evaluator (launch: the task's "
                          "own, unless given)")
    config: dict[str, Any] = Field(default_factory=dict, description="that evaluator's config")


class RubricConfig(EvaluatorConfig):
    judge: str = Field(default="default", description="the gateway's judge to ask (GatewayPools.judges)")
    rubric: str = Field(default=DEFAULT_RUBRIC, max_length=20_000, description="what the judge scores")
    weight: float = Field(default=0.2, ge=0, le=10, description="a full score adds this to the outcome")
    max_score: int = Field(default=5, ge=1, le=100, description="the judge scores from 0 to this")
    outcome: OutcomeSpec = Field(default_factory=OutcomeSpec, description="the evaluator giving the outcome reward")


class Rubric(Evaluator):
    name: ClassVar[str] = "rubric"
    config_model: ClassVar[type[BaseModel]] = RubricConfig

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        self.settings = RubricConfig.model_validate(self.config)
        if self.settings.outcome.strategy == self.name:
            raise EvaluatorConfigError("a rubric's outcome evaluator cannot be another rubric")
        self.outcome: Evaluator = EVALUATORS.get(self.settings.outcome.strategy)(self.settings.outcome.config)

    def wants_fresh_runtime(self, spec: EvaluatorSpec | None = None) -> bool:
        return self.outcome.wants_fresh_runtime(spec)

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        outcome = await checked_evaluation(self.outcome, ctx)
        traces = ctx.trajectory.traces
        if not traces:
            return outcome
        judge = ctx.judges.get(self.settings.judge)
        if judge is None:
            raise JudgeError(JUDGE_UNREACHABLE, f"this gateway has no judge {self.settings.judge!r} (its judges: "
                             f"{', '.join(sorted(ctx.judges)) or 'none'}; GatewayPools.judges)")
        items = [JudgeItem(self.settings.rubric, transcript([*t.prompt_messages, *t.response_messages]),
                           self.settings.max_score) for t in traces]
        scores = await judge.score(items)
        s = self.settings
        rewards = [outcome.reward + s.weight * score / s.max_score for score in scores]
        return EvalResult(reward=outcome.reward, passed=outcome.passed, per_trace_rewards=rewards,
                          per_trace_scores=scores, per_turn_rewards=outcome.per_turn_rewards,
                          details={**outcome.details, "rubric": {"judge": s.judge, "scores": scores,
                                                                  "weight": s.weight, "max_score": s.max_score}})
