"""The evaluator interface: score a finished session, in its live runtime or a fresh one.

The gateway calls ``evaluate`` in POSTRUN with the built trajectory and the harness's result. An evaluator that
wants a clean environment sets ``needs_fresh_runtime`` (or the task sets ``EvaluatorSpec.refresh_runtime``); the
gateway then prepares that runtime while the harness still runs (prewarm) and hands it over in ``fresh_runtime``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from polar_gym.runtime.base import ExecResult, Runtime
from polar_gym.schema import EvalResult, EvaluatorSpec, SessionSpec, Trajectory

__all__ = ["EvalContext", "Evaluator", "EvaluatorConfig"]


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
