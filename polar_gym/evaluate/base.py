"""The evaluator interface: score a finished session, in its live runtime or a fresh one.

The gateway calls ``evaluate`` in POSTRUN with the built trajectory and the harness's result. An evaluator that
wants a clean environment sets ``needs_fresh_runtime`` (or the task sets ``EvaluatorSpec.refresh_runtime``); the
gateway then prepares that runtime while the harness still runs (prewarm) and hands it over in ``fresh_runtime``.

Every evaluation goes through :func:`checked_evaluation`, which refuses a reward that is not a finite number
(:class:`~polar_gym.evaluate.errors.InvalidReward`), whichever evaluator made it: a built-in one, or a user's class
found by dotted path.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError

from polar_gym.evaluate.errors import EvaluationError, InvalidReward
from polar_gym.evaluate.judge import JudgeBatcher
from polar_gym.runtime.base import ExecResult, Runtime
from polar_gym.schema import MAX_REWARD, EvalResult, EvaluatorSpec, SessionSpec, Trajectory

__all__ = ["EvalContext", "Evaluator", "EvaluatorConfig", "check_reward", "checked_evaluation", "finite_reward"]


class EvaluatorConfig(BaseModel):
    """The keys an evaluator accepts in ``EvaluatorSpec.config``: none, unless it declares its own model."""

    model_config = ConfigDict(extra="forbid")


@dataclass
class EvalContext:
    spec: SessionSpec
    trajectory: Trajectory
    harness_result: ExecResult | None  # None when the harness never ran (cancelled or failed before RUNNING)
    runtime: Runtime | None  # the session's live runtime, after the harness
    fresh_runtime: Runtime | None = None  # a freshly prepared runtime, when asked for
    artifacts: dict[str, Any] = field(default_factory=dict)
    #: the LLM judges the operator configured on this gateway, by name (polar_gym.evaluate.judge)
    judges: Mapping[str, JudgeBatcher] = field(default_factory=dict)


class Evaluator(abc.ABC):
    name: ClassVar[str]
    needs_fresh_runtime: ClassVar[bool] = False
    #: the keys it accepts in ``EvaluatorSpec.config`` (unknown keys are refused when ``launch`` starts); an
    #: evaluator added by dotted path declares its own
    config_model: ClassVar[type[BaseModel]] = EvaluatorConfig

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        self.config = dict(config or {})

    def wants_fresh_runtime(self, spec: EvaluatorSpec | None = None) -> bool:
        """Whether the gateway must hand over a freshly prepared runtime: the class's default, the task's
        ``refresh_runtime`` flag, or (in subclasses) the evaluator's own config."""
        return self.needs_fresh_runtime or bool(spec is not None and spec.refresh_runtime)

    @abc.abstractmethod
    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        """The reward (and details) for this session."""


async def checked_evaluation(evaluator: Evaluator, ctx: EvalContext) -> EvalResult:
    """``evaluator.evaluate(ctx)`` with its rewards checked (:func:`check_reward`): the one way a session is scored.
    An EvalResult refused for a non-finite reward while the evaluator built it is an InvalidReward too."""
    who = _name(evaluator)
    try:
        result = await evaluator.evaluate(ctx)
    except ValidationError as exc:
        bad = [e for e in exc.errors() if e.get("type") in _OUT_OF_RANGE and e.get("loc", ("",))[0] in _REWARDS]
        if exc.title != EvalResult.__name__ or not bad:
            raise
        where = "".join(f"[{part}]" if isinstance(part, int) else part for part in bad[0]["loc"])
        raise InvalidReward(f"evaluator {who!r} gave {where} {_shown(bad[0].get('input'))}, not finite or beyond "
                            f"±{MAX_REWARD:g}") from exc
    return check_reward(result, who)


def check_reward(result: Any, who: str = "evaluator") -> EvalResult:
    """``result`` when it is an EvalResult whose reward and per-trace rewards are finite (:func:`finite_reward`); else
    InvalidReward naming the value (EvaluationError for something that is not an EvalResult at all). Checked after
    the fact because a result made with ``model_construct`` or changed after validation skips the schema's check."""
    if not isinstance(result, EvalResult):
        raise EvaluationError(f"evaluator {who!r} returned {type(result).__name__}, not an EvalResult")
    finite_reward(result.reward, f"evaluator {who!r} gave reward")
    for i, value in enumerate(result.per_trace_rewards or ()):
        finite_reward(value, f"evaluator {who!r} gave per_trace_rewards[{i}]")
    for key, value in (result.per_turn_rewards or {}).items():
        finite_reward(value, f"evaluator {who!r} gave per_turn_rewards[{key!r}]")
    return result


def finite_reward(value: Any, what: str) -> float:
    """``value`` as a float when it is a finite number within ±MAX_REWARD (bool is not a number); else InvalidReward
    saying ``what`` and the value."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidReward(f"{what} {_shown(value)}, not a number")
    try:
        number = float(value)
    except OverflowError:  # an int beyond a float's range
        raise InvalidReward(f"{what} {_shown(value)}, not finite or beyond ±{MAX_REWARD:g}") from None
    if not math.isfinite(number) or abs(number) > MAX_REWARD:
        raise InvalidReward(f"{what} {number!r}, not finite or beyond ±{MAX_REWARD:g}")
    return number


#: how pydantic refuses a reward of EvalResult (see schema.Reward), and the fields that hold rewards
_OUT_OF_RANGE = frozenset({"finite_number", "greater_than_equal", "less_than_equal"})
_REWARDS = frozenset({"reward", "per_trace_rewards", "per_turn_rewards"})


def _shown(value: Any, limit: int = 80) -> str:
    if isinstance(value, int) and value.bit_length() > 256:  # repr of a huge int is slow, or refused past 4300 digits
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _name(evaluator: Evaluator) -> str:
    return str(getattr(type(evaluator), "name", None) or type(evaluator).__name__)
