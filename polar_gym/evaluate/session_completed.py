"""``session_completed``: reward 1.0 when the harness exited 0 after at least one model call.

Why it exists: the cheapest signal that the whole pipeline (sandbox, harness, proxy, builder) worked, used as the
default evaluator and for smoke tests. It says nothing about whether the task was solved.
"""

from __future__ import annotations

from typing import ClassVar

from polar_gym.evaluate.base import EvalContext, Evaluator
from polar_gym.schema import EvalResult, Trajectory

__all__ = ["SessionCompleted", "completion_count"]


def completion_count(trajectory: Trajectory) -> int:
    """Completions behind a trajectory: the builder's count when it reports one, else the number of traces."""
    count = trajectory.diagnostics.get("completions")
    return int(count) if isinstance(count, int) else len(trajectory.traces)


class SessionCompleted(Evaluator):
    name: ClassVar[str] = "session_completed"

    async def evaluate(self, ctx: EvalContext) -> EvalResult:
        completions = completion_count(ctx.trajectory)
        details: dict[str, object] = {"completions": completions}
        result = ctx.harness_result
        if result is None:
            reason = "the harness never ran"
        else:
            details.update(harness_status=result.status.value, exit_code=result.exit_code)
            if not result.ok:
                reason = f"the harness ended {result.status.value} (exit code {result.exit_code})"
            elif completions == 0:
                reason = "the harness exited 0 without calling the model"
            else:
                reason = ""
        passed = not reason
        details["reason"] = reason or f"the harness exited 0 after {completions} model call(s)"
        return EvalResult(reward=1.0 if passed else 0.0, passed=passed, details=details)
