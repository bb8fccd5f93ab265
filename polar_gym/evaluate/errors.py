"""Evaluation errors: the evaluator could not judge the session (as opposed to the agent failing the task).

Why a separate type: a failed test is a reward of 0, but a crashed sandbox or a missing runtime says nothing about the
policy; training on a 0 there would punish it for our infrastructure. The gateway turns these into an ERROR result.

    EvaluationError
    ├── EvaluatorConfigError   the evaluator's config is invalid (raised when it is built)
    ├── MissingRuntimeError    the runtime the evaluator needs was not given
    ├── SandboxFailure         a command could not run (sandbox crashed or was cancelled)
    └── InvalidReward          the evaluator produced a reward that is not a finite number (cause invalid_reward)
"""

from __future__ import annotations

__all__ = ["EvaluationError", "EvaluatorConfigError", "InvalidReward", "MissingRuntimeError", "SandboxFailure"]


class EvaluationError(RuntimeError):
    """The session could not be evaluated."""


class EvaluatorConfigError(EvaluationError, ValueError):
    """The evaluator's config is invalid."""


class MissingRuntimeError(EvaluationError):
    """The live or fresh runtime the evaluator needs is missing."""


class SandboxFailure(EvaluationError):
    """A command the evaluator ran did not run to its end for reasons outside the agent's control."""


class InvalidReward(EvaluationError):
    """A reward that is not a finite number (NaN, an infinity, a mean or an integer beyond a float's range). Why an
    error and not a 0: a trainer fed ``inf`` or ``NaN`` corrupts every advantage of its batch, JSON cannot carry it
    (it became ``null`` and the rollout server could not read the result back), and the value says the verifier is
    broken or was tampered with, not that the policy failed. The session ends ERROR with cause ``invalid_reward``."""
