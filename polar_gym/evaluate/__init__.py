"""Evaluators: score a finished session (session_completed, test_on_output, swebench_harness, or a user's own class
by dotted path). Heavy evaluators are imported only when named, through the registry."""

from polar_gym.evaluate.base import EvalContext, Evaluator, checked_evaluation
from polar_gym.evaluate.errors import (
    EvaluationError,
    EvaluatorConfigError,
    InvalidReward,
    MissingRuntimeError,
    SandboxFailure,
)
from polar_gym.evaluate.registry import evaluator_class, load_evaluator, register_evaluator

__all__ = [
    "EvalContext",
    "EvaluationError",
    "Evaluator",
    "EvaluatorConfigError",
    "InvalidReward",
    "MissingRuntimeError",
    "SandboxFailure",
    "checked_evaluation",
    "evaluator_class",
    "load_evaluator",
    "register_evaluator",
]
